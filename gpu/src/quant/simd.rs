//! x86 kernels for the integer products: one chunk of 32 weights, unpacked once (by the
//! format's own portable [`Format::unpack`], inlined here and compiled for these
//! instructions), multiplies up to four input rows in 256-bit registers. Per row and chunk:
//! one `u8 × i8` product into eight 32-bit lanes (lanes 0–3 are the first half of 16, 4–7
//! the second), widened to f32 and scaled by the input's and the half's scales into a vector
//! accumulator; the offsets' share is a scalar. One horizontal sum per row at the end.

#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::formats::{Chunk, Format};
use super::{CHUNK, Row, TILE};

pub fn has_vnni() -> bool {
    std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("avx512vnni")
        && std::is_x86_feature_detected!("avx512vl")
}

pub fn has_avx2() -> bool {
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
}

/// `Σ u·q` per four bytes, `u` unsigned (`vpdpbusd` doesn't saturate).
#[inline(always)]
unsafe fn dot_vnni(u: __m256i, q: __m256i) -> __m256i {
    // SAFETY: only called from `tile_vnni`, whose callers checked the CPU.
    unsafe { _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, q) }
}

/// # Safety
/// The CPU has AVX2, FMA, AVX512-VNNI and AVX512-VL ([`has_vnni`]).
#[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
pub unsafe fn tile_vnni<F: Format, const R: usize>(
    w: &[u8],
    rows: &[Row<'_>; TILE],
    out: &mut [f32],
) {
    // Signed weights are shifted into u8 (+128) and the shift taken back through the
    // inputs' sums.
    let flip = _mm256_set1_epi8(-128);
    // SAFETY: the caller checked the CPU.
    unsafe {
        tile::<F, R>(w, rows, out, -128.0, |u, q| {
            if F::SIGNED {
                dot_vnni(_mm256_xor_si256(u, flip), q)
            } else {
                dot_vnni(u, q)
            }
        })
    }
}

/// # Safety
/// The CPU has AVX2 and FMA ([`has_avx2`]).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn tile_avx2<F: Format, const R: usize>(
    w: &[u8],
    rows: &[Row<'_>; TILE],
    out: &mut [f32],
) {
    let ones = _mm256_set1_epi16(1);
    // SAFETY: the caller checked the CPU.
    unsafe {
        tile::<F, R>(w, rows, out, 0.0, |u, q| {
            // `vpmaddubsw` saturates pairs at i16: unsigned formats' values stay under 64,
            // and signed ones go through the sign trick (|w| · (q with w's sign)).
            let pairs = if F::SIGNED {
                _mm256_maddubs_epi16(_mm256_sign_epi8(u, u), _mm256_sign_epi8(q, u))
            } else {
                _mm256_maddubs_epi16(u, q)
            };
            _mm256_madd_epi16(pairs, ones)
        })
    }
}

/// The shared loop; `signed_offset` is what a signed format's values were shifted by, per
/// unit of scale (-128 for VNNI's +128, 0 for the sign trick).
#[inline(always)]
unsafe fn tile<F: Format, const R: usize>(
    w: &[u8],
    rows: &[Row<'_>; TILE],
    out: &mut [f32],
    signed_offset: f32,
    dot: impl Fn(__m256i, __m256i) -> __m256i,
) {
    // SAFETY: inlined into `tile_vnni` / `tile_avx2`, whose callers checked the CPU; the
    // loads read 32-byte arrays and slices.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); R];
        let mut offs = [0.0f32; R];
        let mut u = [0u8; CHUNK];
        let per = F::BLOCK / CHUNK;
        for (b, block) in w.chunks_exact(F::BYTES).enumerate() {
            for c in 0..per {
                let Chunk { s, mut o } = F::unpack(block, c, &mut u);
                if F::SIGNED {
                    o = [signed_offset * s[0], signed_offset * s[1]];
                }
                let uv = _mm256_loadu_si256(u.as_ptr().cast());
                let scale = _mm256_set_m128(_mm_set1_ps(s[1]), _mm_set1_ps(s[0]));
                let ci = b * per + c;
                for r in 0..R {
                    let row = &rows[r];
                    let q = &row.q[ci * CHUNK..(ci + 1) * CHUNK];
                    let qv = _mm256_loadu_si256(q.as_ptr().cast());
                    let p = _mm256_cvtepi32_ps(dot(uv, qv));
                    let sd = _mm256_mul_ps(scale, _mm256_set1_ps(row.d[ci]));
                    acc[r] = _mm256_fmadd_ps(sd, p, acc[r]);
                    let sums = row.sums[ci];
                    offs[r] += o[0] * sums[0] + o[1] * sums[1];
                }
            }
        }
        for r in 0..R {
            out[r] = hsum(acc[r]) + offs[r];
        }
    }
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    // SAFETY: AVX, checked by the kernels' callers.
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
}
