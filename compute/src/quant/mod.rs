//! GGML's block-quantized weight formats, kept quantized on the CPU.
//!
//! A GGUF file stores most matrices in blocks of 32 (Q4_0, Q4_1, Q8_0) or 256 (the K-quants
//! Q4_K, Q5_K, Q6_K) values that share scales. Decoding one token reads every weight once, so
//! a quarter to an eighth of f32's bytes is a proportional speed-up — if the products run on
//! the quantized bytes instead of a widened copy. The products here do as llama.cpp does:
//! the input rows are quantized to 8 bits per block of 32 ([`Acts`]), and each block of
//! weights and inputs is multiplied in integers (`u8 × i8`, four products summed per 32-bit
//! lane: AVX512-VNNI's `vpdpbusd`, or AVX2's `vpmaddubsw`), then scaled once per block in
//! f32.
//!
//! Every format is described once, by how a chunk of 32 weights unpacks ([`formats`]): 32
//! small unsigned integers `u` and, per half of 16, a scale `s` and an offset `o` with
//! `w = s·u + o` (Q8_0's are signed, with no offset). The reference dequantization, the
//! portable row kernel ([`QTensor::product`], for CPUs without AVX2) and the repacking into
//! the SIMD kernels' panels ([`panel`]) all read the formats through that one description,
//! so a format is right everywhere once its unpacking is, and the tests check that against
//! vectors from ggml's own Python package (`gguf`).

mod formats;
pub mod panel;

use std::ops::Range;

pub use formats::QType;
use formats::{Chunk, Format, Q4_0, Q4_1, Q4K, Q5K, Q6K, Q8_0};
pub use panel::QPanels;

/// Values per chunk: the unit every kernel multiplies.
pub const CHUNK: usize = 32;

/// A quantized matrix `[rows, cols]`, row-major: each row is `cols / block` whole blocks of
/// its type. Rows may differ in type: quantizers mix them (a Q4_K file keeps some `attn_v`
/// and `ffn_down` matrices in Q6_K), and fused matrices (q, k and v stacked) keep each part's.
#[derive(Clone)]
pub struct QTensor {
    pub rows: usize,
    pub cols: usize,
    data: Vec<u8>,
    /// Per row: its type and where its bytes start.
    index: Vec<(QType, usize)>,
}

impl std::fmt::Debug for QTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QTensor")
            .field("types", &self.types())
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish_non_exhaustive()
    }
}

impl QTensor {
    /// `data` holding `rows` rows of `cols` values in `ty`'s blocks.
    pub fn new(ty: QType, rows: usize, cols: usize, data: Vec<u8>) -> Result<Self, String> {
        let row = ty.row_bytes(cols).ok_or_else(|| {
            format!(
                "{} rows of {cols} values are not whole blocks of {}",
                ty.name(),
                ty.block()
            )
        })?;
        if data.len() != rows * row {
            return Err(format!(
                "{} [{rows}, {cols}] needs {} bytes, got {}",
                ty.name(),
                rows * row,
                data.len()
            ));
        }
        Ok(QTensor {
            rows,
            cols,
            data,
            index: (0..rows).map(|r| (ty, r * row)).collect(),
        })
    }

    /// The types its rows use, each once.
    pub fn types(&self) -> Vec<QType> {
        let mut t: Vec<QType> = self.index.iter().map(|(ty, _)| *ty).collect();
        t.sort_unstable();
        t.dedup();
        t
    }

    /// Bytes of the whole matrix.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Row `r`: its type and bytes.
    pub fn row(&self, r: usize) -> (QType, &[u8]) {
        let (ty, at) = self.index[r];
        (
            ty,
            &self.data[at..at + ty.block_bytes() * self.cols / ty.block()],
        )
    }

    /// Row `r` widened to f32.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let (ty, bytes) = self.row(r);
        dequantize(ty, bytes, out);
    }

    /// Every value widened to f32 (row-major).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, out) in out.chunks_exact_mut(self.cols.max(1)).enumerate() {
            self.dequantize_row(r, out);
        }
        out
    }

    /// The rows `order` names, in that order; `None` is a row of zeros (an all-zero block
    /// is zero in every format).
    pub fn select_rows(&self, order: &[Option<usize>]) -> QTensor {
        let zero = self.index.first().map_or(QType::Q8_0, |r| r.0);
        let mut data = Vec::new();
        let mut index = Vec::with_capacity(order.len());
        for src in order {
            match src {
                Some(r) => {
                    let (ty, bytes) = self.row(*r);
                    index.push((ty, data.len()));
                    data.extend_from_slice(bytes);
                }
                None => {
                    index.push((zero, data.len()));
                    data.resize(
                        data.len() + zero.block_bytes() * self.cols / zero.block(),
                        0,
                    );
                }
            }
        }
        QTensor {
            rows: order.len(),
            cols: self.cols,
            data,
            index,
        }
    }

    /// Stack matrices with equal columns (rows end to end).
    pub fn concat(parts: &[&QTensor]) -> Result<QTensor, String> {
        let first = parts.first().ok_or("nothing to concatenate")?;
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
        let mut index = Vec::new();
        for p in parts {
            if p.cols != first.cols {
                return Err(format!(
                    "cannot stack rows of {} values with rows of {}",
                    p.cols, first.cols
                ));
            }
            let base = data.len();
            index.extend(p.index.iter().map(|(ty, at)| (*ty, base + at)));
            data.extend_from_slice(&p.data);
        }
        Ok(QTensor {
            rows: index.len(),
            cols: first.cols,
            data,
            index,
        })
    }

    /// `out[i · ld + (r - rows.start)] = Σ_c acts[i][c] · W[r][c]` for every input row `i` and
    /// weight row `r` in `rows`, one row at a time on portable code: the kernels for CPUs
    /// without AVX2 (elsewhere [`QPanels`] multiply).
    ///
    /// # Panics
    /// When `acts` is not `self.cols` wide or `out` is too short (callers' bugs).
    pub fn product(&self, rows: Range<usize>, acts: &Acts, out: &mut [f32], ld: usize) {
        assert_eq!(acts.k, self.cols, "input width");
        assert!(rows.end <= self.rows && ld >= rows.len());
        if acts.m == 0 || rows.is_empty() {
            return;
        }
        assert!(out.len() >= (acts.m - 1) * ld + rows.len());
        for (j, r) in rows.enumerate() {
            let (ty, w) = self.row(r);
            let out = &mut out[j..];
            match ty {
                QType::Q4_0 => dot_rows::<Q4_0>(w, acts, out, ld),
                QType::Q4_1 => dot_rows::<Q4_1>(w, acts, out, ld),
                QType::Q8_0 => dot_rows::<Q8_0>(w, acts, out, ld),
                QType::Q4K => dot_rows::<Q4K>(w, acts, out, ld),
                QType::Q5K => dot_rows::<Q5K>(w, acts, out, ld),
                QType::Q6K => dot_rows::<Q6K>(w, acts, out, ld),
            }
        }
    }
}

/// Widen whole blocks of `ty` to f32 (`out.len()` values).
///
/// # Panics
/// When `data` holds fewer blocks than `out` needs.
pub fn dequantize(ty: QType, data: &[u8], out: &mut [f32]) {
    fn run<F: Format>(data: &[u8], out: &mut [f32]) {
        for (block, out) in data
            .chunks_exact(F::BYTES)
            .zip(out.chunks_exact_mut(F::BLOCK))
        {
            for (c, out) in out.chunks_exact_mut(CHUNK).enumerate() {
                let mut u = [0u8; CHUNK];
                let Chunk { s, o } = F::unpack(block, c, &mut u);
                for (h, out) in out.chunks_exact_mut(CHUNK / 2).enumerate() {
                    for (o_, u) in out.iter_mut().zip(&u[h * 16..]) {
                        *o_ = if F::SIGNED {
                            s[h] * f32::from(*u as i8)
                        } else {
                            s[h] * f32::from(*u) + o[h]
                        };
                    }
                }
            }
        }
    }
    match ty {
        QType::Q4_0 => run::<Q4_0>(data, out),
        QType::Q4_1 => run::<Q4_1>(data, out),
        QType::Q8_0 => run::<Q8_0>(data, out),
        QType::Q4K => run::<Q4K>(data, out),
        QType::Q5K => run::<Q5K>(data, out),
        QType::Q6K => run::<Q6K>(data, out),
    }
}

/// Input rows quantized for the integer products: per chunk of 32 values, `q = round(x / d)`
/// with `d = max|x| / 127`, and the sum of each half of `q` times `d` (what the weights'
/// offsets multiply).
#[derive(Default)]
pub struct Acts {
    m: usize,
    k: usize,
    q: Vec<i8>,
    /// Per chunk.
    d: Vec<f32>,
    /// Per chunk: `d · Σ q` over each half.
    sums: Vec<[f32; 2]>,
}

impl Acts {
    /// Quantize `m` rows of `x` (`[m, k]`, `k` a multiple of 32), reusing the buffers.
    pub fn quantize(&mut self, x: &[f32], m: usize, k: usize) {
        assert!(k.is_multiple_of(CHUNK) && x.len() >= m * k);
        let chunks = m * k / CHUNK;
        self.m = m;
        self.k = k;
        self.q.resize(m * k, 0);
        self.d.resize(chunks, 0.0);
        self.sums.resize(chunks, [0.0; 2]);
        // Runs of chunks in parallel for prefill-sized inputs; a decode step's few rows stay
        // on this thread (a fork-join would cost more than the work).
        use rayon::prelude::*;
        const RUN: usize = 1024;
        if chunks <= RUN {
            quantize_chunks(&x[..m * k], &mut self.q, &mut self.d, &mut self.sums);
            return;
        }
        x[..m * k]
            .par_chunks(RUN * CHUNK)
            .zip(self.q.par_chunks_mut(RUN * CHUNK))
            .zip(self.d.par_chunks_mut(RUN))
            .zip(self.sums.par_chunks_mut(RUN))
            .for_each(|(((x, q), d), sums)| quantize_chunks(x, q, d, sums));
    }

    fn row(&self, i: usize) -> Row<'_> {
        let c = self.k / CHUNK;
        Row {
            q: &self.q[i * self.k..(i + 1) * self.k],
            d: &self.d[i * c..(i + 1) * c],
            sums: &self.sums[i * c..(i + 1) * c],
        }
    }
}

/// Chunks of 32 values of `x` quantized into `q`, with their scales `d` and half sums.
#[allow(unsafe_code)] // the AVX-512 version, behind its feature check
fn quantize_chunks(x: &[f32], q: &mut [i8], d: &mut [f32], sums: &mut [[f32; 2]]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw") {
        // SAFETY: the CPU has AVX-512 F and BW (checked just above).
        unsafe { x86::quantize_chunks(x, q, d, sums) };
        return;
    }
    for (((x, q), d), sums) in x
        .chunks_exact(CHUNK)
        .zip(q.chunks_exact_mut(CHUNK))
        .zip(d.iter_mut())
        .zip(sums.iter_mut())
    {
        quantize_chunk(x, q, d, sums);
    }
}

/// llama.cpp's `quantize_row_q8_0` for one chunk, with the half sums of Q8_1 (the reference;
/// [`x86::quantize_chunks`] computes the same values sixteen at a time).
fn quantize_chunk(x: &[f32], q: &mut [i8], d: &mut f32, sums: &mut [f32; 2]) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    *d = amax / 127.0;
    let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    for (q, x) in q.iter_mut().zip(x) {
        // |x · id| ≤ 127. Ties to even (one vector instruction) where llama.cpp's `roundf`
        // goes away from zero (a call per value): they differ only on exact halves.
        *q = (x * id).round_ties_even() as i8;
    }
    for (h, s) in sums.iter_mut().enumerate() {
        let n: i32 = q[h * 16..(h + 1) * 16].iter().map(|v| i32::from(*v)).sum();
        *s = *d * n as f32;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    #![allow(unsafe_code)]
    use std::arch::x86_64::*;

    use super::CHUNK;

    /// [`super::quantize_chunk`] on whole chunks, a half (16 values) per register: a decode
    /// step quantizes every matrix's input, and the scalar version, called per chunk, cost
    /// 12 % of a 16-stream step. The conversion rounds ties to even (MXCSR's default mode),
    /// as the reference does.
    ///
    /// # Safety
    /// The CPU has AVX-512 F and BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn quantize_chunks(x: &[f32], q: &mut [i8], d: &mut [f32], sums: &mut [[f32; 2]]) {
        let n = (x.len() / CHUNK)
            .min(q.len() / CHUNK)
            .min(d.len())
            .min(sums.len());
        let sign = _mm512_set1_epi32(0x7FFF_FFFF);
        for c in 0..n {
            // SAFETY: chunk `c` of `x` and `q` is in bounds (`n` above).
            unsafe {
                let lo = _mm512_loadu_ps(x.as_ptr().add(c * CHUNK));
                let hi = _mm512_loadu_ps(x.as_ptr().add(c * CHUNK + 16));
                let abs =
                    |v: __m512| _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), sign));
                let amax = _mm512_reduce_max_ps(_mm512_max_ps(abs(lo), abs(hi)));
                let dc = amax / 127.0;
                let id = _mm512_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
                let ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, id));
                let qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, id));
                let out = q.as_mut_ptr().add(c * CHUNK).cast::<__m128i>();
                _mm_storeu_si128(out, _mm512_cvtsepi32_epi8(ql));
                _mm_storeu_si128(out.add(1), _mm512_cvtsepi32_epi8(qh));
                d[c] = dc;
                sums[c] = [
                    dc * _mm512_reduce_add_epi32(ql) as f32,
                    dc * _mm512_reduce_add_epi32(qh) as f32,
                ];
            }
        }
    }
}

/// One input row's quantized chunks.
#[derive(Clone, Copy)]
struct Row<'a> {
    q: &'a [i8],
    d: &'a [f32],
    sums: &'a [[f32; 2]],
}

/// Which kernels to run. Only [`Isa::detect`] names instruction sets, and the others only
/// step down from it, so a safe caller cannot ask for instructions this CPU lacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Isa(Level);

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Level {
    Portable,
    /// AVX2 `vpmaddubsw`.
    Avx2,
    /// AVX512-VNNI's `vpdpbusd`, on 512-bit registers over two panels (256-bit over one).
    Vnni,
}

impl Isa {
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            use std::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") {
                if has!("avx512vnni") && has!("avx512vl") && has!("avx512f") && has!("avx512bw") {
                    return Isa(Level::Vnni);
                }
                return Isa(Level::Avx2);
            }
        }
        Isa(Level::Portable)
    }

    pub const fn portable() -> Isa {
        Isa(Level::Portable)
    }

    /// At most AVX2 (no VNNI).
    pub fn without_vnni(self) -> Isa {
        Isa(self.0.min(Level::Avx2))
    }

    pub fn name(self) -> &'static str {
        match self.0 {
            Level::Portable => "portable",
            Level::Avx2 => "avx2",
            Level::Vnni => "vnni",
        }
    }
}

/// Input rows per kernel call: each unpacked chunk of weights feeds this many rows.
const TILE: usize = 4;

/// One weight row against every input row: `out[i · ld] = W · x_i`.
fn dot_rows<F: Format>(w: &[u8], acts: &Acts, out: &mut [f32], ld: usize) {
    let mut i0 = 0;
    while i0 < acts.m {
        let t = (acts.m - i0).min(TILE);
        let mut rows = [acts.row(i0); TILE];
        for (j, r) in rows.iter_mut().enumerate().take(t) {
            *r = acts.row(i0 + j);
        }
        let mut res = [0.0f32; TILE];
        match t {
            1 => tile::<F, 1>(w, &rows, &mut res),
            2 => tile::<F, 2>(w, &rows, &mut res),
            3 => tile::<F, 3>(w, &rows, &mut res),
            _ => tile::<F, 4>(w, &rows, &mut res),
        }
        for (j, v) in res.iter().enumerate().take(t) {
            out[(i0 + j) * ld] = *v;
        }
        i0 += t;
    }
}

/// The definition, in integers per half chunk as the panel kernels compute it.
fn tile<F: Format, const R: usize>(w: &[u8], rows: &[Row<'_>; TILE], out: &mut [f32]) {
    let mut acc = [0.0f32; R];
    let mut u = [0u8; CHUNK];
    for (b, block) in w.chunks_exact(F::BYTES).enumerate() {
        for c in 0..F::BLOCK / CHUNK {
            let Chunk { s, o } = F::unpack(block, c, &mut u);
            let ci = b * F::BLOCK / CHUNK + c;
            for (acc, row) in acc.iter_mut().zip(rows) {
                let q = &row.q[ci * CHUNK..(ci + 1) * CHUNK];
                let mut dot = [0i32; 2];
                for (h, dot) in dot.iter_mut().enumerate() {
                    let (u, q) = (&u[h * 16..(h + 1) * 16], &q[h * 16..(h + 1) * 16]);
                    *dot = if F::SIGNED {
                        u.iter()
                            .zip(q)
                            .map(|(u, q)| i32::from(*u as i8) * i32::from(*q))
                            .sum()
                    } else {
                        u.iter()
                            .zip(q)
                            .map(|(u, q)| i32::from(*u) * i32::from(*q))
                            .sum()
                    };
                }
                *acc += row.d[ci] * (s[0] * dot[0] as f32 + s[1] * dot[1] as f32);
                if !F::SIGNED {
                    *acc += o[0] * row.sums[ci][0] + o[1] * row.sums[ci][1];
                }
            }
        }
    }
    out[..R].copy_from_slice(&acc);
}

#[cfg(test)]
pub(crate) mod tests;
