//! Batched decode with bf16 weights on CPUs that have AVX512-BF16 (`vdpbf16ps`: 32 bf16
//! multiply-adds per instruction, twice the f32 rate): the input rows are rounded to bf16
//! once per product — as torch's bf16 path does — and each output is a dot product of bf16
//! pairs accumulated in f32, in 4 × 4 register blocks (four weight rows against four input
//! rows: eight loads feed sixteen instructions). Elsewhere [`available`] is false and the
//! caller widens the weights to f32 instead.

#![allow(unsafe_code)]

use half::bf16;

/// Whether this CPU can run [`dots`].
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512bf16") && std::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[r * m + i] = Σ_k w[r][k] · x[i][k]` for `rows` weight rows of `k` (`w`) and `m` input
/// rows (`x`, already bf16).
///
/// # Panics
/// When [`available`] is false, or the slices do not hold `rows × k`, `m × k` and `rows × m`
/// elements (callers' bugs).
pub fn dots(w: &[bf16], x: &[bf16], k: usize, m: usize, out: &mut [f32]) {
    let rows = out.len() / m;
    assert!(available(), "bf16dot::dots without AVX512-BF16");
    assert!(w.len() >= rows * k && x.len() >= m * k && out.len() == rows * m);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has the features (checked above); every pointer the kernel forms stays
    // inside the slices, whose lengths are checked above.
    unsafe {
        x86::dots(w, x, k, m, rows, out)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::bf16;

    /// 32 bf16 values from `p` (unaligned).
    #[inline(always)]
    unsafe fn load(p: *const bf16) -> __m512bh {
        // SAFETY: the caller keeps `p..p + 32` inside its slice; __m512i and __m512bh are
        // both 512 bits of plain data.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p.cast())) }
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn dots(
        w: &[bf16],
        x: &[bf16],
        k: usize,
        m: usize,
        rows: usize,
        out: &mut [f32],
    ) {
        let full = k / 32 * 32;
        let tail = |r: usize, i: usize| -> f32 {
            (full..k)
                .map(|c| w[r * k + c].to_f32() * x[i * k + c].to_f32())
                .sum()
        };
        let mut r0 = 0;
        while r0 < rows {
            let nr = (rows - r0).min(4);
            let mut i0 = 0;
            while i0 < m {
                let ni = (m - i0).min(4);
                let mut acc = [[_mm512_setzero_ps(); 4]; 4];
                let wp: [*const bf16; 4] =
                    std::array::from_fn(|j| w[(r0 + j.min(nr - 1)) * k..].as_ptr());
                let xp: [*const bf16; 4] =
                    std::array::from_fn(|i| x[(i0 + i.min(ni - 1)) * k..].as_ptr());
                let mut c = 0;
                while c < full {
                    // SAFETY: c + 32 <= full <= k: inside every row (rows past the block's end
                    // repeat its last row and are not stored).
                    let (wv, xv) = unsafe {
                        (
                            [
                                load(wp[0].add(c)),
                                load(wp[1].add(c)),
                                load(wp[2].add(c)),
                                load(wp[3].add(c)),
                            ],
                            [
                                load(xp[0].add(c)),
                                load(xp[1].add(c)),
                                load(xp[2].add(c)),
                                load(xp[3].add(c)),
                            ],
                        )
                    };
                    for j in 0..4 {
                        for i in 0..4 {
                            acc[j][i] = _mm512_dpbf16_ps(acc[j][i], wv[j], xv[i]);
                        }
                    }
                    c += 32;
                }
                for j in 0..nr {
                    for i in 0..ni {
                        out[(r0 + j) * m + i0 + i] =
                            _mm512_reduce_add_ps(acc[j][i]) + tail(r0 + j, i0 + i);
                    }
                }
                i0 += ni;
            }
            r0 += nr;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_f32_dot_products_of_the_rounded_values() {
        if !available() {
            println!("SKIPPED: no AVX512-BF16 on this CPU");
            return;
        }
        for (rows, m, k) in [(4, 4, 64), (7, 5, 70), (1, 1, 31), (9, 16, 96)] {
            let w: Vec<bf16> = (0..rows * k)
                .map(|i| bf16::from_f32(((i * 7 % 23) as f32 - 11.0) / 16.0))
                .collect();
            let x: Vec<bf16> = (0..m * k)
                .map(|i| bf16::from_f32(((i * 5 % 19) as f32 - 9.0) / 8.0))
                .collect();
            let mut out = vec![0.0; rows * m];
            dots(&w, &x, k, m, &mut out);
            for r in 0..rows {
                for i in 0..m {
                    let want: f32 = (0..k)
                        .map(|c| w[r * k + c].to_f32() * x[i * k + c].to_f32())
                        .sum();
                    assert!(
                        (out[r * m + i] - want).abs() < 1e-3,
                        "{rows}×{m}×{k} ({r}, {i})"
                    );
                }
            }
        }
    }
}
