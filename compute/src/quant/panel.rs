//! Quantized weights repacked for the products: eight rows interleaved per block.
//!
//! The row-at-a-time kernels ([`super::QTensor::product`]) pay, per 32 weights, a scalar
//! unpack, a scale conversion and a scalar offset, and a horizontal sum per output: about
//! 25 cycles where decoding at memory speed allows five. Here the rows of a matrix are
//! grouped by eight ("panels"), and each chunk of 32 values is stored as the eight rows'
//! scales side by side, then their values interleaved so that each 32-bit lane of a vector
//! holds four consecutive values of one row: lane `r` of vector `g` is row `r`'s values
//! `4g..4g + 4`. 4-bit values keep two such vectors in one (groups `g` and `g + 4` in the
//! low and high nibbles); the fifth and sixth bits of Q5_K and Q6_K sit in one or two more
//! vectors, in the same lanes. The K-quants keep their per-256 f16 scales once per
//! superblock and their 6-bit sub-block scales as bytes, so every type takes the file's bytes
//! give or take 3 %.
//!
//! A product then needs no horizontal sums: for each group of four input values, broadcast
//! to every lane, one `u8 × i8` multiply-add (`vpdpbusd`, or `vpmaddubsw` + `vpmaddwd` on
//! AVX2) adds each row's four products into its own lane, so after a chunk's eight groups
//! each lane is its row's chunk sum (two sums, one per half, for Q6_K's scales of sixteen).
//! Eight scales are widened with one instruction, and one or two multiply-adds scale and
//! offset eight outputs. The unpacked weights stay in registers while every input row (up
//! to eight) passes, so a batch reads and unpacks each weight once. With AVX512-VNNI two
//! panels of one type run side by side in 512-bit registers: each broadcast input and each
//! scale instruction then serves sixteen rows (1.4× at sixteen input rows on Zen 4, where
//! the 512-bit multiply-add itself is no faster than two 256-bit ones).

#![allow(unsafe_code)]

use super::formats::{Format, Q4_0, Q4_1, Q4K, Q5K, Q6K, Q8_0, QType, scale_min_k4};
use super::{Acts, CHUNK, Isa, Level, QTensor};

/// Rows per panel.
pub const ROWS: usize = 8;
/// Input rows per pass over a panel.
const TILE: usize = 8;

/// How a type is laid out in a panel (bytes for eight rows).
#[derive(Debug, Clone, Copy)]
struct Layout {
    /// Chunks per superblock (1 for the 32-value types, 8 for the K-quants).
    chunks: usize,
    /// Per superblock: f16 scales (K-quants: `d`, and `dmin` for Q4_K/Q5_K).
    head: usize,
    /// Per chunk: scales (f16 `d`, Q4_1's f16 `m`; K-quants' sub-block scales as bytes).
    scales: usize,
    /// Per chunk: the values (and their high bits).
    values: usize,
}

impl Layout {
    fn of(ty: QType) -> Layout {
        let (chunks, head, scales, values) = match ty {
            QType::Q4_0 => (1, 0, 16, 128),
            QType::Q4_1 => (1, 0, 32, 128),
            QType::Q8_0 => (1, 0, 16, 256),
            QType::Q4K => (8, 32, 16, 128),
            QType::Q5K => (8, 32, 16, 160),
            QType::Q6K => (8, 16, 16, 192),
        };
        Layout {
            chunks,
            head,
            scales,
            values,
        }
    }

    fn chunk_bytes(self) -> usize {
        self.scales + self.values
    }

    fn superblock_bytes(self) -> usize {
        self.head + self.chunks * self.chunk_bytes()
    }
}

/// A matrix in panels of eight rows (the last padded with zero rows), each panel of one type
/// (fused matrices keep each part's: q/k/v boundaries fall between panels).
pub struct QPanels {
    pub rows: usize,
    pub cols: usize,
    /// Per panel: its type and where its bytes start.
    panels: Vec<(QType, usize)>,
    /// Per panel, per superblock: its head, then per chunk scales and values.
    data: Vec<u8>,
}

impl QPanels {
    /// `q` repacked, if the CPU runs the panel kernels (AVX2) and each panel's rows share a
    /// type (rows of zeros, padding, go with any).
    pub fn pack(q: &QTensor, isa: Isa) -> Option<QPanels> {
        if isa.0 < Level::Avx2 {
            return None;
        }
        let mut panels = Vec::with_capacity(q.rows.div_ceil(ROWS));
        let mut size = 0;
        for p in 0..q.rows.div_ceil(ROWS) {
            let rows = p * ROWS..((p + 1) * ROWS).min(q.rows);
            let real = rows.filter(|r| q.row(*r).1.iter().any(|b| *b != 0));
            let mut types = real.map(|r| q.row(r).0);
            let ty = types.next().unwrap_or(q.row(p * ROWS).0);
            if types.any(|t| t != ty) {
                return None;
            }
            panels.push((ty, size));
            size += q.cols / ty.block() * Layout::of(ty).superblock_bytes();
        }
        let mut data = vec![0u8; size];
        for r in 0..q.rows {
            let (rty, row) = q.row(r);
            let (ty, at) = panels[r / ROWS];
            if rty != ty {
                continue; // a row of zeros
            }
            let (lay, sbb) = (Layout::of(ty), Layout::of(ty).superblock_bytes());
            for (sb, block) in row.chunks_exact(ty.block_bytes()).enumerate() {
                let dst = &mut data[at + sb * sbb..at + (sb + 1) * sbb];
                pack_block(ty, lay, block, r % ROWS, dst);
            }
        }
        Some(QPanels {
            rows: q.rows,
            cols: q.cols,
            panels,
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
        let vnni = isa.0 >= Level::Vnni;
        let bytes = |p: usize| {
            let (ty, at) = self.panels[p];
            &self.data[at..at + self.cols / ty.block() * Layout::of(ty).superblock_bytes()]
        };
        let mut p = panels.start;
        while p < panels.end {
            let ty = self.panels[p].0;
            // Two panels of one type side by side in 512-bit registers where VNNI runs, for
            // two input rows or more: with one row, joining the halves costs more than the
            // broadcasts it saves (batch-1 decode 335 against 260 tok/s on SmolLM2).
            let pair = vnni && acts.m > 1 && p + 1 < panels.end && self.panels[p + 1].0 == ty;
            let w = [bytes(p), bytes(if pair { p + 1 } else { p })];
            let mut i0 = 0;
            while i0 < acts.m {
                let t = (acts.m - i0).min(TILE);
                let y = &mut out[i0 * ld + (p - panels.start) * ROWS..];
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `pack` made panels only where the CPU has AVX2 (and `isa` names
                // VNNI only where it has that and AVX-512 F/BW/VL); the slices are the sizes
                // the kernels read (checked above: a pair's sixteen outputs are in `out`).
                unsafe {
                    x86::panel(ty, vnni, pair, w, acts, i0, t, y, ld)
                };
                #[cfg(not(target_arch = "x86_64"))]
                let _ = (isa, w, y);
                i0 += t;
            }
            p += if pair { 2 } else { 1 };
        }
    }
}

/// Row `l`'s block `block` into its superblock `dst` of a panel.
fn pack_block(ty: QType, lay: Layout, block: &[u8], l: usize, dst: &mut [u8]) {
    let f16_to = |dst: &mut [u8], at: usize, src: usize| {
        dst[at + 2 * l..at + 2 * l + 2].copy_from_slice(&block[src..src + 2]);
    };
    // The superblock's f16 scales.
    match ty {
        QType::Q4K | QType::Q5K => {
            f16_to(dst, 0, 0);
            f16_to(dst, 2 * ROWS, 2);
        }
        QType::Q6K => f16_to(dst, 0, 208),
        _ => {}
    }
    let mut u = [0u8; CHUNK];
    for c in 0..lay.chunks {
        let at = lay.head + c * lay.chunk_bytes();
        let chunk = &mut dst[at..at + lay.chunk_bytes()];
        // Scales, then the 32 values in value order (Q8_0's signed, the rest unsigned).
        match ty {
            QType::Q4_0 => {
                f16_to(chunk, 0, 0);
                Q4_0::unpack(block, c, &mut u);
            }
            QType::Q4_1 => {
                f16_to(chunk, 0, 0);
                f16_to(chunk, 2 * ROWS, 2);
                Q4_1::unpack(block, c, &mut u);
            }
            QType::Q8_0 => {
                f16_to(chunk, 0, 0);
                Q8_0::unpack(block, c, &mut u);
            }
            QType::Q4K | QType::Q5K => {
                let (sc, m) = scale_min_k4(c, &block[4..16]);
                (chunk[l], chunk[ROWS + l]) = (sc, m);
                if ty == QType::Q4K {
                    Q4K::unpack(block, c, &mut u);
                } else {
                    Q5K::unpack(block, c, &mut u);
                }
            }
            QType::Q6K => {
                let (n, part) = (c / 4, c % 4);
                for h in 0..2 {
                    chunk[h * ROWS + l] = block[192 + 8 * n + h + 2 * part];
                }
                Q6K::unpack(block, c, &mut u);
            }
        }
        let vals = &mut chunk[lay.scales..];
        for (e, v) in u.iter().enumerate() {
            let (g, j) = (e / 4, e % 4);
            let lane = 4 * l + j;
            if ty == QType::Q8_0 {
                // Vector g, lane l, byte j.
                vals[32 * g + lane] = *v;
                continue;
            }
            // Low nibble: vector g % 4, group g ≥ 4 in the high nibble.
            vals[32 * (g % 4) + lane] |= (v & 15) << (4 * (g / 4));
            match ty {
                // Bit 4 of group g: bit g of the fifth vector's byte.
                QType::Q5K => vals[128 + lane] |= ((v >> 4) & 1) << g,
                // Bits 4–5 of group g: bits 2(g % 4) of vector 4 + g / 4.
                QType::Q6K => vals[128 + 32 * (g / 4) + lane] |= ((v >> 4) & 3) << (2 * (g % 4)),
                _ => {}
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Layout, QType, ROWS};
    use crate::quant::{Acts, CHUNK};

    /// Type codes for the kernels' const parameter.
    const Q40: u8 = 0;
    const Q41: u8 = 1;
    const Q80: u8 = 8;
    const Q4K: u8 = 4;
    const Q5K: u8 = 5;
    const Q6K: u8 = 6;

    /// # Safety
    /// AVX2 and FMA (and with `vnni`, AVX512-VNNI, F, BW and VL) are present; `w` holds the
    /// superblocks of one panel (twice, unless `pair`: then two panels of type `ty`);
    /// `acts` has rows `i0..i0 + t`; `y` reaches row `t - 1` at `ld`, eight outputs wide
    /// (sixteen for a pair).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn panel(
        ty: QType,
        vnni: bool,
        pair: bool,
        w: [&[u8]; 2],
        acts: &Acts,
        i0: usize,
        t: usize,
        y: &mut [f32],
        ld: usize,
    ) {
        let nsb = acts.k / ty.block();
        let w = [w[0].as_ptr(), w[1].as_ptr()];
        macro_rules! by_type {
            ($k:ident, $t:literal) => {
                // SAFETY: as this function's.
                unsafe {
                    match ty {
                        QType::Q4_0 => $k::<Q40, $t>(w, nsb, acts, i0, y, ld),
                        QType::Q4_1 => $k::<Q41, $t>(w, nsb, acts, i0, y, ld),
                        QType::Q8_0 => $k::<Q80, $t>(w, nsb, acts, i0, y, ld),
                        QType::Q4K => $k::<Q4K, $t>(w, nsb, acts, i0, y, ld),
                        QType::Q5K => $k::<Q5K, $t>(w, nsb, acts, i0, y, ld),
                        QType::Q6K => $k::<Q6K, $t>(w, nsb, acts, i0, y, ld),
                    }
                }
            };
        }
        macro_rules! by_tile {
            ($k:ident) => {
                match t {
                    1 => by_type!($k, 1),
                    2 => by_type!($k, 2),
                    3 => by_type!($k, 3),
                    4 => by_type!($k, 4),
                    5 => by_type!($k, 5),
                    6 => by_type!($k, 6),
                    7 => by_type!($k, 7),
                    _ => by_type!($k, 8),
                }
            };
        }
        match (vnni, pair) {
            (true, true) => by_tile!(vnni512_k),
            (true, false) => by_tile!(vnni256_k),
            _ => by_tile!(avx2_k),
        }
    }

    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vnni,avx512vl")]
    unsafe fn vnni512_k<const F: u8, const T: usize>(
        w: [*const u8; 2],
        nsb: usize,
        acts: &Acts,
        i0: usize,
        y: &mut [f32],
        ld: usize,
    ) {
        // SAFETY: as `panel`'s.
        unsafe {
            kernel::<F, T, true, Two>(w, nsb, acts, i0, y, ld, |sum, u, q| {
                _mm512_dpbusd_epi32(sum, u, q)
            })
        }
    }

    #[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
    unsafe fn vnni256_k<const F: u8, const T: usize>(
        w: [*const u8; 2],
        nsb: usize,
        acts: &Acts,
        i0: usize,
        y: &mut [f32],
        ld: usize,
    ) {
        // SAFETY: as `panel`'s.
        unsafe {
            kernel::<F, T, true, One>(w, nsb, acts, i0, y, ld, |sum, u, q| {
                _mm256_dpbusd_epi32(sum, u, q)
            })
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2_k<const F: u8, const T: usize>(
        w: [*const u8; 2],
        nsb: usize,
        acts: &Acts,
        i0: usize,
        y: &mut [f32],
        ld: usize,
    ) {
        let ones = _mm256_set1_epi16(1);
        // SAFETY: as `panel`'s.
        unsafe {
            kernel::<F, T, false, One>(w, nsb, acts, i0, y, ld, |sum, u, q| {
                // Values under 64 keep pairs within i16; Q8_0 comes here signed and goes
                // through the sign trick (|w| · (q with w's sign)).
                let pairs = if F == Q80 {
                    _mm256_maddubs_epi16(_mm256_sign_epi8(u, u), _mm256_sign_epi8(q, u))
                } else {
                    _mm256_maddubs_epi16(u, q)
                };
                _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones))
            })
        }
    }

    /// The registers a kernel works in: a panel's eight rows per 256-bit vector ([`One`]),
    /// or two panels' sixteen per 512-bit vector ([`Two`]). On Zen 4 a 512-bit multiply-add
    /// costs two 256-bit ones, but each broadcast input and each scale instruction then
    /// serves sixteen rows: 1.4× the throughput at sixteen input rows.
    ///
    /// Every method is called only from the kernels, whose target features cover it.
    trait Lanes {
        type I: Copy;
        type F: Copy;
        /// 32 bytes at `off` of each panel.
        unsafe fn load(w: [*const u8; 2], off: usize) -> Self::I;
        /// Eight f16 at `off` of each panel, widened.
        unsafe fn halves(w: [*const u8; 2], off: usize) -> Self::F;
        /// Eight bytes at `off` of each panel, widened (`SIGNED`: as i8).
        unsafe fn bytes<const SIGNED: bool>(w: [*const u8; 2], off: usize) -> Self::F;
        unsafe fn store(y: *mut f32, v: Self::F);
        unsafe fn splat8(b: i8) -> Self::I;
        unsafe fn splat32(x: i32) -> Self::I;
        unsafe fn splat(x: f32) -> Self::F;
        unsafe fn zero_i() -> Self::I;
        unsafe fn zero() -> Self::F;
        unsafe fn and(a: Self::I, b: Self::I) -> Self::I;
        unsafe fn or(a: Self::I, b: Self::I) -> Self::I;
        unsafe fn xor(a: Self::I, b: Self::I) -> Self::I;
        unsafe fn add_i(a: Self::I, b: Self::I) -> Self::I;
        /// Each 16-bit lane shifted right by `n`.
        unsafe fn shr(a: Self::I, n: u32) -> Self::I;
        /// Each 16-bit lane shifted left by 4.
        unsafe fn shl4(a: Self::I) -> Self::I;
        unsafe fn float(a: Self::I) -> Self::F;
        unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
        unsafe fn sub(a: Self::F, b: Self::F) -> Self::F;
        /// `a · b + c`.
        unsafe fn fma(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    }

    #[derive(Clone, Copy)]
    struct One;
    #[derive(Clone, Copy)]
    struct Two;

    /// The methods whose 256- and 512-bit forms are one intrinsic each, named in this order.
    macro_rules! same_ops {
        ($splat8:ident, $splat32:ident, $splat:ident, $zero_i:ident, $zero:ident, $and:ident,
         $or:ident, $xor:ident, $add_i:ident, $shl:ident, $float:ident, $mul:ident,
         $sub:ident, $fma:ident) => {
            #[inline(always)]
            unsafe fn splat8(b: i8) -> Self::I {
                unsafe { $splat8(b) }
            }
            #[inline(always)]
            unsafe fn splat32(x: i32) -> Self::I {
                unsafe { $splat32(x) }
            }
            #[inline(always)]
            unsafe fn splat(x: f32) -> Self::F {
                unsafe { $splat(x) }
            }
            #[inline(always)]
            unsafe fn zero_i() -> Self::I {
                unsafe { $zero_i() }
            }
            #[inline(always)]
            unsafe fn zero() -> Self::F {
                unsafe { $zero() }
            }
            #[inline(always)]
            unsafe fn and(a: Self::I, b: Self::I) -> Self::I {
                unsafe { $and(a, b) }
            }
            #[inline(always)]
            unsafe fn or(a: Self::I, b: Self::I) -> Self::I {
                unsafe { $or(a, b) }
            }
            #[inline(always)]
            unsafe fn xor(a: Self::I, b: Self::I) -> Self::I {
                unsafe { $xor(a, b) }
            }
            #[inline(always)]
            unsafe fn add_i(a: Self::I, b: Self::I) -> Self::I {
                unsafe { $add_i(a, b) }
            }
            #[inline(always)]
            unsafe fn shl4(a: Self::I) -> Self::I {
                unsafe { $shl(a, 4) }
            }
            #[inline(always)]
            unsafe fn float(a: Self::I) -> Self::F {
                unsafe { $float(a) }
            }
            #[inline(always)]
            unsafe fn mul(a: Self::F, b: Self::F) -> Self::F {
                unsafe { $mul(a, b) }
            }
            #[inline(always)]
            unsafe fn sub(a: Self::F, b: Self::F) -> Self::F {
                unsafe { $sub(a, b) }
            }
            #[inline(always)]
            unsafe fn fma(a: Self::F, b: Self::F, c: Self::F) -> Self::F {
                unsafe { $fma(a, b, c) }
            }
        };
    }

    // SAFETY (both impls): the callers' — the kernels' target features, and `off` plus the
    // width inside each panel's bytes.
    impl Lanes for One {
        type I = __m256i;
        type F = __m256;
        same_ops! {
            _mm256_set1_epi8, _mm256_set1_epi32, _mm256_set1_ps, _mm256_setzero_si256,
            _mm256_setzero_ps, _mm256_and_si256, _mm256_or_si256, _mm256_xor_si256,
            _mm256_add_epi32, _mm256_slli_epi16, _mm256_cvtepi32_ps, _mm256_mul_ps,
            _mm256_sub_ps, _mm256_fmadd_ps
        }
        #[inline(always)]
        unsafe fn load(w: [*const u8; 2], off: usize) -> __m256i {
            unsafe { _mm256_loadu_si256(w[0].add(off).cast()) }
        }
        #[inline(always)]
        unsafe fn halves(w: [*const u8; 2], off: usize) -> __m256 {
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(w[0].add(off).cast())) }
        }
        #[inline(always)]
        unsafe fn bytes<const SIGNED: bool>(w: [*const u8; 2], off: usize) -> __m256 {
            unsafe { bytes8::<SIGNED>(w[0].add(off)) }
        }
        #[inline(always)]
        unsafe fn store(y: *mut f32, v: __m256) {
            unsafe { _mm256_storeu_ps(y, v) }
        }
        #[inline(always)]
        unsafe fn shr(a: __m256i, n: u32) -> __m256i {
            unsafe { _mm256_srl_epi16(a, _mm_cvtsi32_si128(n as i32)) }
        }
    }

    impl Lanes for Two {
        type I = __m512i;
        type F = __m512;
        same_ops! {
            _mm512_set1_epi8, _mm512_set1_epi32, _mm512_set1_ps, _mm512_setzero_si512,
            _mm512_setzero_ps, _mm512_and_si512, _mm512_or_si512, _mm512_xor_si512,
            _mm512_add_epi32, _mm512_slli_epi16, _mm512_cvtepi32_ps, _mm512_mul_ps,
            _mm512_sub_ps, _mm512_fmadd_ps
        }
        #[inline(always)]
        unsafe fn load(w: [*const u8; 2], off: usize) -> __m512i {
            unsafe {
                let lo = _mm512_castsi256_si512(One::load(w, off));
                _mm512_inserti64x4(lo, One::load([w[1]; 2], off), 1)
            }
        }
        #[inline(always)]
        unsafe fn halves(w: [*const u8; 2], off: usize) -> __m512 {
            unsafe { join(One::halves(w, off), One::halves([w[1]; 2], off)) }
        }
        #[inline(always)]
        unsafe fn bytes<const SIGNED: bool>(w: [*const u8; 2], off: usize) -> __m512 {
            unsafe {
                join(
                    One::bytes::<SIGNED>(w, off),
                    One::bytes::<SIGNED>([w[1]; 2], off),
                )
            }
        }
        #[inline(always)]
        unsafe fn store(y: *mut f32, v: __m512) {
            unsafe { _mm512_storeu_ps(y, v) }
        }
        #[inline(always)]
        unsafe fn shr(a: __m512i, n: u32) -> __m512i {
            unsafe { _mm512_srl_epi16(a, _mm_cvtsi32_si128(n as i32)) }
        }
    }

    /// `lo` and `hi` as one register (AVX-512 F: `vinsertf32x8` would need DQ).
    #[inline(always)]
    unsafe fn join(lo: __m256, hi: __m256) -> __m512 {
        // SAFETY: the callers' (AVX-512 F).
        unsafe {
            let lo = _mm512_castps_pd(_mm512_castps256_ps512(lo));
            _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(hi), 1))
        }
    }

    /// Eight bytes widened to f32 (`SIGNED`: as i8).
    #[inline(always)]
    unsafe fn bytes8<const SIGNED: bool>(p: *const u8) -> __m256 {
        // SAFETY: the callers' (AVX2; 8 readable bytes at `p`).
        unsafe {
            let b = _mm_loadl_epi64(p.cast());
            _mm256_cvtepi32_ps(if SIGNED {
                _mm256_cvtepi8_epi32(b)
            } else {
                _mm256_cvtepu8_epi32(b)
            })
        }
    }

    /// The shared loop over superblocks and their chunks. Per chunk, per row: `w = s·u + o`
    /// (`s`, `o` per half for Q6_K). VNNI multiplies Q8_0's `q + 128` and takes `128·d·Σa`
    /// back through the offset.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn kernel<const F: u8, const T: usize, const VNNI: bool, L: Lanes>(
        w: [*const u8; 2],
        nsb: usize,
        acts: &Acts,
        i0: usize,
        y: &mut [f32],
        ld: usize,
        dot: impl Fn(L::I, L::I, L::I) -> L::I,
    ) {
        // SAFETY: the loads stay inside `w` (`nsb` superblocks of each panel) and the input
        // rows (`acts` checked by `QPanels::product`); the kernels' target features cover
        // `L` and `dot`.
        unsafe {
            let ty = match F {
                Q40 => QType::Q4_0,
                Q41 => QType::Q4_1,
                Q80 => QType::Q8_0,
                Q4K => QType::Q4K,
                Q5K => QType::Q5K,
                _ => QType::Q6K,
            };
            let lay = Layout::of(ty);
            let signed_vnni = F == Q80 && VNNI;
            // Offsets apply (Q8_0 has none on the sign-trick path).
            let offsets = F != Q80 || VNNI;
            let halves = F == Q6K;
            let mask = L::splat8(0x0F);
            let one = L::splat8(1);
            let three = L::splat8(3);
            let flip = L::splat8(-128);
            let k = acts.k;
            let chunks_per_row = k / CHUNK;
            let mut acc = [L::zero(); T];
            for sb in 0..nsb {
                let base = sb * lay.superblock_bytes();
                // K-quants: the superblock's scales for the rows.
                let (hd, hdm) = match F {
                    Q4K | Q5K => (L::halves(w, base), L::halves(w, base + 2 * ROWS)),
                    Q6K => (L::halves(w, base), L::zero()),
                    _ => (L::zero(), L::zero()),
                };
                for c in 0..lay.chunks {
                    let sc = base + lay.head + c * lay.chunk_bytes();
                    // Scale and offset per row (per half for Q6_K: `s2`, `o2` the second).
                    let (s, o, s2, o2) = match F {
                        Q40 => {
                            let d = L::halves(w, sc);
                            (d, L::mul(d, L::splat(-8.0)), d, d)
                        }
                        Q41 => {
                            let d = L::halves(w, sc);
                            (d, L::halves(w, sc + 2 * ROWS), d, d)
                        }
                        Q80 => {
                            let d = L::halves(w, sc);
                            (d, L::mul(d, L::splat(-128.0)), d, d)
                        }
                        Q4K | Q5K => {
                            let s = L::mul(hd, L::bytes::<false>(w, sc));
                            let m = L::mul(hdm, L::bytes::<false>(w, sc + ROWS));
                            (s, L::sub(L::zero(), m), s, s)
                        }
                        _ => {
                            let s = L::mul(hd, L::bytes::<true>(w, sc));
                            let s2 = L::mul(hd, L::bytes::<true>(w, sc + ROWS));
                            let k32 = L::splat(-32.0);
                            (s, L::mul(s, k32), s2, L::mul(s2, k32))
                        }
                    };
                    let vals = sc + lay.scales;
                    // Vector g: lane r holds row r's values 4g..4g + 4.
                    let mut u = [L::zero_i(); ROWS];
                    if F == Q80 {
                        for (g, u) in u.iter_mut().enumerate() {
                            let v = L::load(w, vals + 32 * g);
                            *u = if signed_vnni { L::xor(v, flip) } else { v };
                        }
                    } else {
                        for g in 0..4 {
                            let v = L::load(w, vals + 32 * g);
                            u[g] = L::and(v, mask);
                            u[g + 4] = L::and(L::shr(v, 4), mask);
                        }
                        if F == Q5K {
                            let h = L::load(w, vals + 128);
                            for (g, u) in u.iter_mut().enumerate() {
                                let bit = L::and(L::shr(h, g as u32), one);
                                *u = L::or(*u, L::shl4(bit));
                            }
                        } else if F == Q6K {
                            for half in 0..2 {
                                let h = L::load(w, vals + 128 + 32 * half);
                                for g4 in 0..4 {
                                    let bits = L::and(L::shr(h, 2 * g4 as u32), three);
                                    let u = &mut u[4 * half + g4];
                                    *u = L::or(*u, L::shl4(bits));
                                }
                            }
                        }
                    }
                    let chunk = sb * lay.chunks + c;
                    // Group-major over the input rows: the T rows' sums are independent
                    // chains, so consecutive multiply-adds never wait on each other's
                    // latency. Each row keeps two sums (groups 0–3 and 4–7: Q6_K's halves,
                    // and for the others a shorter chain when few rows pass).
                    let mut lo = [L::zero_i(); T];
                    let mut hi = [L::zero_i(); T];
                    let a0 = acts.q.as_ptr().add(i0 * k + chunk * CHUNK).cast::<i32>();
                    for (g, u) in u.iter().enumerate() {
                        for t in 0..T {
                            let a = L::splat32(a0.add(t * k / 4 + g).read_unaligned());
                            if g >= 4 && (halves || T <= 4) {
                                hi[t] = dot(hi[t], *u, a);
                            } else {
                                lo[t] = dot(lo[t], *u, a);
                            }
                        }
                    }
                    for (t, acc) in acc.iter_mut().enumerate() {
                        let ci = (i0 + t) * chunks_per_row + chunk;
                        let da = L::splat(*acts.d.get_unchecked(ci));
                        let sums = acts.sums.get_unchecked(ci);
                        if halves {
                            *acc = L::fma(L::float(lo[t]), L::mul(s, da), *acc);
                            *acc = L::fma(L::float(hi[t]), L::mul(s2, da), *acc);
                            *acc = L::fma(o, L::splat(sums[0]), *acc);
                            *acc = L::fma(o2, L::splat(sums[1]), *acc);
                        } else {
                            let sum = if T <= 4 {
                                L::add_i(lo[t], hi[t])
                            } else {
                                lo[t]
                            };
                            *acc = L::fma(L::float(sum), L::mul(s, da), *acc);
                            if offsets {
                                *acc = L::fma(o, L::splat(sums[0] + sums[1]), *acc);
                            }
                        }
                    }
                }
            }
            for (t, acc) in acc.iter().enumerate() {
                L::store(y.as_mut_ptr().add(t * ld), *acc);
            }
        }
    }
}
