//! Quantized weights repacked for the decode products: eight rows interleaved per block.
//!
//! The row-at-a-time kernels ([`super::QTensor::product`]) pay, per 32 weights, a scalar
//! unpack, a scale conversion and a scalar offset, and a horizontal sum per output: about
//! 25 cycles where decoding at memory speed allows five. Here the rows of a matrix are
//! grouped by eight ("panels") and each block of 32 values is stored as the eight rows'
//! scales side by side (`[d ×8 f16][m ×8 f16]`), then their quants interleaved so that each
//! 32-bit lane of a vector holds four consecutive values of one row: lane `r` of vector `g`
//! is row `r`'s values `4g..4g + 4`. (4-bit types keep two such vectors in one, groups `g`
//! and `g + 4` in the low and high nibbles.) The bytes are the file's, reordered.
//!
//! A product then needs no horizontal sums at all: for each group of four input values,
//! broadcast to every lane, one `u8 × i8` multiply-add (`vpdpbusd`, or `vpmaddubsw` +
//! `vpmaddwd` on AVX2) adds each row's four products into its own lane, so after a block's
//! eight groups each lane is its row's block sum. One conversion and two multiply-adds scale
//! and offset the eight outputs. The unpacked weights stay in registers while every input
//! row (up to eight) passes, so batched decode reads and unpacks each weight once.
//!
//! Q4_0, Q4_1 and Q8_0 are repacked (the formats with one scale per 32 values); other types
//! keep the row kernels.

#![allow(unsafe_code)]

use super::formats::QType;
use super::{Acts, CHUNK, Isa, Level, QTensor};

/// Rows per panel.
pub const ROWS: usize = 8;
/// Input rows per pass over a panel.
const TILE: usize = 8;

/// A matrix of one type in panels of eight rows (the last padded with zero rows).
pub struct QPanels {
    ty: QType,
    pub rows: usize,
    pub cols: usize,
    /// Per panel, per block: scales (and offsets), then each row's quants.
    data: Vec<u8>,
}

/// Bytes of one block's part of a panel: for eight rows, the f16 scale (and Q4_1's f16
/// offset) and the quants.
fn block_bytes(ty: QType) -> usize {
    ROWS * ty.block_bytes()
}

/// Where a block's quants start after its scales.
fn quants_at(ty: QType) -> usize {
    match ty {
        QType::Q4_1 => 4 * ROWS,
        _ => 2 * ROWS,
    }
}

impl QPanels {
    /// `q` repacked, if it is all one type this layout takes and the CPU runs its kernels.
    pub fn pack(q: &QTensor, isa: Isa) -> Option<QPanels> {
        let [ty] = q.types()[..] else { return None };
        if !matches!(ty, QType::Q4_0 | QType::Q4_1 | QType::Q8_0) || isa.0 < Level::Avx2 {
            return None;
        }
        let nb = q.cols / CHUNK;
        let bb = block_bytes(ty);
        let panels = q.rows.div_ceil(ROWS);
        let mut data = vec![0u8; panels * nb * bb];
        let head = quants_at(ty);
        let mut u = [0u8; CHUNK];
        for r in 0..q.rows {
            let (_, row) = q.row(r);
            let (p, l) = (r / ROWS, r % ROWS);
            for (b, block) in row.chunks_exact(ty.block_bytes()).enumerate() {
                let dst = &mut data[(p * nb + b) * bb..(p * nb + b + 1) * bb];
                // d (and m) of row l.
                dst[2 * l..2 * l + 2].copy_from_slice(&block[..2]);
                if ty == QType::Q4_1 {
                    dst[2 * ROWS + 2 * l..2 * ROWS + 2 * l + 2].copy_from_slice(&block[2..4]);
                }
                // Its 32 values in value order (nibbles unpacked, or Q8_0's bytes).
                let qs = &block[head / ROWS..];
                if ty == QType::Q8_0 {
                    u.copy_from_slice(qs);
                } else {
                    for (j, q) in qs.iter().enumerate() {
                        (u[j], u[j + 16]) = (q & 15, q >> 4);
                    }
                }
                let qd = &mut dst[head..];
                for (e, v) in u.iter().enumerate() {
                    let (g, j) = (e / 4, e % 4);
                    if ty == QType::Q8_0 {
                        // Vector g, lane l, byte j.
                        qd[32 * g + 4 * l + j] = *v;
                    } else {
                        // Vector g % 4, lane l, byte j; group g ≥ 4 in the high nibble.
                        qd[32 * (g % 4) + 4 * l + j] |= v << (4 * (g / 4));
                    }
                }
            }
        }
        Some(QPanels {
            ty,
            rows: q.rows,
            cols: q.cols,
            data,
        })
    }

    /// `out[i · ld + (r - 8 · panels.start)] = Σ_c acts[i][c] · W[r][c]` for the rows of
    /// `panels`.
    ///
    /// # Panics
    /// When `acts` is not `self.cols` wide or `out` is too short (callers' bugs).
    pub fn product(
        &self,
        panels: std::ops::Range<usize>,
        acts: &Acts,
        isa: Isa,
        out: &mut [f32],
        ld: usize,
    ) {
        assert_eq!(acts.k, self.cols, "input width");
        assert!(panels.end <= self.rows.div_ceil(ROWS) && ld >= panels.len() * ROWS);
        if acts.m == 0 || panels.is_empty() {
            return;
        }
        assert!(out.len() >= (acts.m - 1) * ld + panels.len() * ROWS);
        let nb = self.cols / CHUNK;
        let bb = block_bytes(self.ty);
        for (pi, p) in panels.enumerate() {
            let w = &self.data[p * nb * bb..(p + 1) * nb * bb];
            let mut i0 = 0;
            while i0 < acts.m {
                let t = (acts.m - i0).min(TILE);
                let y = &mut out[i0 * ld + pi * ROWS..];
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `pack` made panels only where `kernels_here` found the CPU's
                // instructions; the slices are the sizes the kernels read (checked above).
                unsafe {
                    x86::panel(self.ty, isa.0 >= Level::Vnni, w, nb, acts, i0, t, y, ld)
                };
                #[cfg(not(target_arch = "x86_64"))]
                let _ = (isa, w, y);
                i0 += t;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{QType, ROWS, quants_at};
    use crate::quant::{Acts, CHUNK};

    /// # Safety
    /// AVX2 and FMA (and with `vnni`, AVX512-VNNI and VL) are present; `w` holds `nb` blocks of
    /// a panel; `acts` has rows `i0..i0 + t`; `y` reaches row `t - 1` at `ld`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn panel(
        ty: QType,
        vnni: bool,
        w: &[u8],
        nb: usize,
        acts: &Acts,
        i0: usize,
        t: usize,
        y: &mut [f32],
        ld: usize,
    ) {
        macro_rules! go {
            ($t:literal) => {
                // SAFETY: as this function's.
                unsafe {
                    match (ty, vnni) {
                        (QType::Q4_0, true) => vnni_k::<0, $t>(w, nb, acts, i0, y, ld),
                        (QType::Q4_1, true) => vnni_k::<1, $t>(w, nb, acts, i0, y, ld),
                        (_, true) => vnni_k::<8, $t>(w, nb, acts, i0, y, ld),
                        (QType::Q4_0, false) => avx2_k::<0, $t>(w, nb, acts, i0, y, ld),
                        (QType::Q4_1, false) => avx2_k::<1, $t>(w, nb, acts, i0, y, ld),
                        (_, false) => avx2_k::<8, $t>(w, nb, acts, i0, y, ld),
                    }
                }
            };
        }
        match t {
            1 => go!(1),
            2 => go!(2),
            3 => go!(3),
            4 => go!(4),
            5 => go!(5),
            6 => go!(6),
            7 => go!(7),
            _ => go!(8),
        }
    }

    #[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
    unsafe fn vnni_k<const F: u8, const T: usize>(
        w: &[u8],
        nb: usize,
        acts: &Acts,
        i0: usize,
        y: &mut [f32],
        ld: usize,
    ) {
        // SAFETY: as `panel`'s.
        unsafe {
            kernel::<F, T, true>(w, nb, acts, i0, y, ld, |sum, u, q| {
                _mm256_dpbusd_epi32(sum, u, q)
            })
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2_k<const F: u8, const T: usize>(
        w: &[u8],
        nb: usize,
        acts: &Acts,
        i0: usize,
        y: &mut [f32],
        ld: usize,
    ) {
        let ones = _mm256_set1_epi16(1);
        // SAFETY: as `panel`'s.
        unsafe {
            kernel::<F, T, false>(w, nb, acts, i0, y, ld, |sum, u, q| {
                // 4-bit values: pairs stay within i16. Q8_0 comes here signed (see below).
                let pairs = if F == 8 {
                    _mm256_maddubs_epi16(_mm256_sign_epi8(u, u), _mm256_sign_epi8(q, u))
                } else {
                    _mm256_maddubs_epi16(u, q)
                };
                _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones))
            })
        }
    }

    /// The shared loop. `F`: 0 = Q4_0 (`w = d·(q - 8)`), 1 = Q4_1 (`w = d·q + m`),
    /// 8 = Q8_0 (`w = d·q`, signed; VNNI multiplies `q + 128` and takes `128·d·Σa` back).
    #[inline(always)]
    unsafe fn kernel<const F: u8, const T: usize, const VNNI: bool>(
        w: &[u8],
        nb: usize,
        acts: &Acts,
        i0: usize,
        y: &mut [f32],
        ld: usize,
        dot: impl Fn(__m256i, __m256i, __m256i) -> __m256i,
    ) {
        // SAFETY: the loads stay inside `w` (nb blocks of the panel) and the input rows
        // (`acts` checked by `QPanels::product`); AVX2/FMA (and VNNI where `dot` uses it)
        // are present.
        unsafe {
            let ty = match F {
                0 => QType::Q4_0,
                1 => QType::Q4_1,
                _ => QType::Q8_0,
            };
            let bb = ROWS * ty.block_bytes();
            let head = quants_at(ty);
            let signed_vnni = F == 8 && VNNI;
            let mask = _mm256_set1_epi8(0x0F);
            let flip = _mm256_set1_epi8(-128);
            let k = acts.k;
            let mut acc = [_mm256_setzero_ps(); T];
            for b in 0..nb {
                let blk = w.as_ptr().add(b * bb);
                let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.cast()));
                // The offset per unit of the input's chunk sum `d_a · Σq`.
                let off = match F {
                    0 => _mm256_mul_ps(d, _mm256_set1_ps(-8.0)),
                    1 => _mm256_cvtph_ps(_mm_loadu_si128(blk.add(2 * ROWS).cast())),
                    _ if signed_vnni => _mm256_mul_ps(d, _mm256_set1_ps(-128.0)),
                    _ => _mm256_setzero_ps(),
                };
                let qs = blk.add(head);
                // Vector g: lane r holds row r's values 4g..4g + 4.
                let mut u = [_mm256_setzero_si256(); ROWS];
                if F == 8 {
                    for (g, u) in u.iter_mut().enumerate() {
                        let v = _mm256_loadu_si256(qs.add(32 * g).cast());
                        *u = if signed_vnni {
                            _mm256_xor_si256(v, flip)
                        } else {
                            v
                        };
                    }
                } else {
                    for g in 0..4 {
                        let v = _mm256_loadu_si256(qs.add(32 * g).cast());
                        u[g] = _mm256_and_si256(v, mask);
                        u[g + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                    }
                }
                for (t, acc) in acc.iter_mut().enumerate() {
                    let i = i0 + t;
                    let ci = i * (k / CHUNK) + b;
                    let a = acts.q.as_ptr().add(i * k + b * CHUNK).cast::<i32>();
                    let mut sum = _mm256_setzero_si256();
                    for (g, u) in u.iter().enumerate() {
                        // Four input values, in every lane.
                        let ag = _mm256_set1_epi32(a.add(g).read_unaligned());
                        sum = dot(sum, *u, ag);
                    }
                    let s = _mm256_cvtepi32_ps(sum);
                    let da = *acts.d.get_unchecked(ci);
                    *acc = _mm256_fmadd_ps(s, _mm256_mul_ps(d, _mm256_set1_ps(da)), *acc);
                    if F != 8 || signed_vnni {
                        let sums = acts.sums.get_unchecked(ci);
                        *acc = _mm256_fmadd_ps(off, _mm256_set1_ps(sums[0] + sums[1]), *acc);
                    }
                }
            }
            for (t, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(y.as_mut_ptr().add(t * ld), *acc);
            }
        }
    }
}
