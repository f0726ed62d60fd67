//! The exponentials of a step — softmax over attention scores and the MLP's SiLU — as
//! loops the compiler vectorizes.
//!
//! `f32::exp` is a call into libm per element, which no loop around it can vectorize; at
//! sixteen sequences a step takes a few hundred thousand of them. [`exp`] is the classic
//! Cephes single-precision scheme (range reduction by `ln 2` in two parts, a degree-6
//! polynomial, the exponent put back by bit arithmetic) written without calls or branches,
//! so the loops below compile to AVX-512, AVX2 or NEON code picked at run time. It stays
//! within 2 ulp of libm's over the range that matters here (the model tests compare
//! logits against transformers to 1e-4). Crates with vector exponentials (`wide`, `sleef`)
//! pick their instruction set at compile time or need nightly Rust, and this binary is
//! built once for every x86-64.

/// Below this `exp` is 0 (the smallest normal f32 is `exp(-87.34)`).
const LOWEST: f32 = -87.3;
/// Above this `exp` is ∞ (2ⁿ would need an exponent f32 lacks; e⁸⁸·⁷² is the largest finite).
const HIGHEST: f32 = 88.3;

/// `e^x` for the loops below: within 2 ulp of libm's, 0 below [`LOWEST`] (and for -∞), ∞ above
/// [`HIGHEST`], NaN for NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 = HI + LO, HI with few mantissa bits so that n · HI is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 · 2²³ rounds to an integer in the low mantissa bits (|v| < 2²²).
    const ROUND: f32 = 12_582_912.0;
    let c = x.clamp(LOWEST, HIGHEST);
    let shifted = c * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = c - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_2e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    // 2ⁿ: n sits in the low bits of `shifted`'s mantissa.
    let n = (shifted.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let two_n = f32::from_bits((n.wrapping_add(127) << 23) as u32);
    let v = e * two_n;
    if x < LOWEST {
        0.0
    } else if x > HIGHEST {
        f32::INFINITY
    } else {
        // NaN falls through: `c` and so `v` are NaN.
        v
    }
}

/// `y = silu(g) · u` (`y += …` when `add`), element-wise.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub fn silu_mul(y: &mut [f32], g: &[f32], u: &[f32], add: bool) {
    let act = |g: f32, u: f32| g / (1.0 + exp(-g)) * u;
    if add {
        for ((y, g), u) in y.iter_mut().zip(g).zip(u) {
            *y += act(*g, *u);
        }
    } else {
        for ((y, g), u) in y.iter_mut().zip(g).zip(u) {
            *y = act(*g, *u);
        }
    }
}

/// Lanes of the reductions below: independent partial results let the compiler keep them
/// in one vector (a single running max or sum is a chain it may not reorder).
const LANES: usize = 16;

/// Softmax of `row[lo..hi]` after scaling by `scale`; entries outside the range (masked)
/// become 0. An empty range leaves the row all zeros.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub fn softmax(row: &mut [f32], lo: usize, hi: usize, scale: f32) {
    let hi = hi.min(row.len());
    let lo = lo.min(hi);
    let (head, rest) = row.split_at_mut(lo);
    let (valid, tail) = rest.split_at_mut(hi - lo);
    head.fill(0.0);
    tail.fill(0.0);
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = valid.chunks_exact(LANES);
    for c in &mut chunks {
        for (m, x) in lanes.iter_mut().zip(c) {
            *m = m.max(*x);
        }
    }
    let max = chunks
        .remainder()
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, x| m.max(*x));
    let mut sums = [0.0f32; LANES];
    let mut chunks = valid.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (s, x) in sums.iter_mut().zip(c.iter_mut()) {
            *x = exp((*x - max) * scale);
            *s += *x;
        }
    }
    let mut sum: f32 = sums.iter().sum();
    for x in chunks.into_remainder() {
        *x = exp((*x - max) * scale);
        sum += *x;
    }
    let inv = 1.0 / sum;
    valid.iter_mut().for_each(|x| *x *= inv);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp(x), x.exp());
            let ulps = (got.to_bits() as i64 - want.to_bits() as i64).abs();
            assert!(ulps <= 2, "exp({x}) = {got}, libm {want} ({ulps} ulp)");
            x += 0.0137;
        }
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn softmax_and_silu_match_the_definitions() {
        for len in [1, 5, 16, 17, 40, 100] {
            let row: Vec<f32> = (0..len)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.9)
                .collect();
            for (lo, hi) in [
                (0, len),
                (len / 3, len),
                (0, len / 2 + 1),
                (len / 2, len / 2 + 1),
            ] {
                let mut got = row.clone();
                softmax(&mut got, lo, hi, 0.3);
                let max = row[lo..hi].iter().fold(f32::NEG_INFINITY, |m, x| m.max(*x));
                let sum: f32 = row[lo..hi].iter().map(|x| ((x - max) * 0.3).exp()).sum();
                for (j, g) in got.iter().enumerate() {
                    let want = if (lo..hi).contains(&j) {
                        ((row[j] - max) * 0.3).exp() / sum
                    } else {
                        0.0
                    };
                    assert!(
                        (g - want).abs() < 1e-6,
                        "len {len} [{lo}, {hi}) at {j}: {g} vs {want}"
                    );
                }
            }
            let u: Vec<f32> = (0..len).map(|i| i as f32 / 10.0 - 1.0).collect();
            let mut y = vec![1.0; len];
            silu_mul(&mut y, &row, &u, true);
            for ((y, g), u) in y.iter().zip(&row).zip(&u) {
                let want = 1.0 + g / (1.0 + (-g).exp()) * u;
                assert!((y - want).abs() < 1e-5, "silu {g} {u}: {y} vs {want}");
            }
        }
    }
}
