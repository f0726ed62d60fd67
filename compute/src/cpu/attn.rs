//! Attention of one sequence's new tokens for the query heads that share one KV head, over
//! the paged cache ([`super`] describes its layout).
//!
//! Decode (a few new tokens) reads keys and values where they lie in their blocks: gathering
//! them first would copy the whole context every step, and a decode step's attention is
//! bound by reading the cache. With a block size and head size in sixteens, AVX-512 kernels
//! score sixteen slots of a block per vector (keys are stored transposed) and accumulate
//! values sixteen dimensions per vector, several independent accumulators at a time, while
//! the next block is prefetched. Prefill gathers the context once and uses gemm.

#![allow(unsafe_code)]

use super::columns::Band;
use super::gemm::{Strides, matmul};
use super::kv::Elem;
use super::math;
use crate::backend::SeqStep;
use crate::model::ModelConfig;

/// Query tokens attended at once (bounds the score matrix for long chunks).
const QUERY_TILE: usize = 64;

/// Per-thread buffers for [`attend`], reused from step to step.
#[derive(Default)]
struct AttnScratch {
    k: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
    scores: Vec<f32>,
    out: Vec<f32>,
}

thread_local! {
    static ATTN: std::cell::RefCell<AttnScratch> = std::cell::RefCell::new(AttnScratch::default());
}

/// Attention of one sequence's new tokens for the query heads of KV head `g`, written into
/// `band`: row `i` is token `i`'s outputs for those heads, side by side.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend<T: Elem>(
    c: &ModelConfig,
    bs: usize,
    s: &SeqStep<'_>,
    offset: usize,
    g: usize,
    qkv: &[f32],
    kc: &[T],
    vc: &[T],
    mut band: Band<'_>,
) {
    ATTN.with(|a| {
        let AttnScratch {
            k,
            v,
            q,
            scores,
            out,
        } = &mut *a.borrow_mut();
        let block_floats = c.kv_heads * bs * c.head_dim;
        let d = c.head_dim;
        let grp = c.group();
        let width = (c.heads + 2 * c.kv_heads) * d;
        let n = s.tokens.len();
        let ctx = s.start + n;
        let scale = 1.0 / (d as f32).sqrt();
        let window = c.sliding_window;
        out.clear();
        out.resize(n * grp * d, 0.0);
        // (first position, offset of this head in the block, slots used) of each block.
        let blocks = || {
            s.blocks
                .iter()
                .take(ctx.div_ceil(bs))
                .enumerate()
                .map(|(bi, &blk)| {
                    (
                        bi * bs,
                        blk as usize * block_floats + g * bs * d,
                        bs.min(ctx - bi * bs),
                    )
                })
        };
        // The query rows of tokens `i0..i1`, `(token, head in group)`.
        let queries = |q: &mut Vec<f32>, i0: usize, i1: usize| {
            q.clear();
            for i in i0..i1 {
                let at = (offset + i) * width + g * grp * d;
                q.extend_from_slice(&qkv[at..at + grp * d]);
            }
        };
        if n <= DIRECT_TOKENS {
            // Decode: read the keys and values where they lie in their blocks; gathering
            // them costs a copy of the whole context per step.
            queries(q, 0, n);
            scores.resize(n * grp * ctx, 0.0);
            let fast = Fast::new(bs, d);
            let mut all = blocks().peekable();
            while let Some((first, head, len)) = all.next() {
                let keys = &kc[head..head + bs * d];
                let next = all.peek().map_or(&[][..], |b| &kc[b.1..b.1 + bs * d]);
                block_scores(fast, q, d, keys, bs, len, &mut scores[first..], ctx, next);
            }
            softmax_rows(scores, ctx, s.start, grp, window, scale);
            let mut all = blocks().peekable();
            while let Some((first, head, len)) = all.next() {
                let values = &vc[head..head + len * d];
                let next = all.peek().map_or(&[][..], |b| &vc[b.1..b.1 + b.2 * d]);
                block_values(fast, &scores[first..], ctx, values, d, out, next);
            }
        } else {
            // Gather this head's keys (`[d, ctx]`) and values (`[ctx, d]`) for gemm.
            k.resize(d * ctx, 0.0);
            v.clear();
            for (first, head, len) in blocks() {
                for (j, kt) in kc[head..head + bs * d].chunks_exact(bs).enumerate() {
                    let dst = &mut k[j * ctx + first..j * ctx + first + len];
                    dst.iter_mut()
                        .zip(&kt[..len])
                        .for_each(|(o, x)| *o = x.to_f32());
                }
                v.extend(vc[head..head + len * d].iter().map(|x| x.to_f32()));
            }
            for i0 in (0..n).step_by(QUERY_TILE) {
                let qn = QUERY_TILE.min(n - i0);
                let rows = qn * grp;
                // The tile's last query sees positions up to `start + i0 + qn - 1`.
                let seen = s.start + i0 + qn;
                queries(q, i0, i0 + qn);
                scores.resize(rows * seen, 0.0);
                let (ss, qs) = (Strides::rows(seen), Strides::rows(d));
                matmul(
                    rows,
                    seen,
                    d,
                    scores,
                    ss,
                    false,
                    q,
                    qs,
                    k,
                    Strides::rows(ctx),
                );
                softmax_rows(scores, seen, s.start + i0, grp, window, scale);
                let dst = &mut out[i0 * grp * d..(i0 + qn) * grp * d];
                matmul(rows, d, seen, dst, qs, false, scores, ss, v, qs);
            }
        }
        for (i, row) in out.chunks_exact(grp * d).enumerate() {
            band.row(i).copy_from_slice(row);
        }
    })
}

/// Up to this many new tokens of a sequence attend straight from the cache blocks.
const DIRECT_TOKENS: usize = 4;

/// Scale, mask and softmax each row of `scores` (`width` positions): row `r` is query
/// position `first + r / grp`, which sees positions up to itself (and, with a sliding
/// window, not before `pos + 1 - window`).
fn softmax_rows(
    scores: &mut [f32],
    width: usize,
    first: usize,
    grp: usize,
    window: Option<usize>,
    scale: f32,
) {
    for (r, row) in scores.chunks_exact_mut(width).enumerate() {
        let pos = first + r / grp;
        let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        math::softmax(row, lo, pos + 1, scale);
    }
}

/// `scores[r * ld + j] = q_r · key_j` for the query rows `q` (`d` wide) and the first `len`
/// keys of one block, stored transposed (`[d][bs]`): a row's scores grow by one multiply-add
/// across the slots per dimension, no horizontal sums.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
fn portable_scores<T: Elem>(
    q: &[f32],
    d: usize,
    keys: &[T],
    bs: usize,
    len: usize,
    scores: &mut [f32],
    ld: usize,
) {
    for (r, qr) in q.chunks_exact(d).enumerate() {
        let row = &mut scores[r * ld..r * ld + len];
        row.fill(0.0);
        for (qc, kt) in qr.iter().zip(keys.chunks_exact(bs)) {
            row.iter_mut()
                .zip(&kt[..len])
                .for_each(|(s, k)| *s += qc * k.to_f32());
        }
    }
}

/// `out_r += Σ_j p[r * ld + j] · value_j` for one block's values (`[len][d]`).
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
fn portable_values<T: Elem>(p: &[f32], ld: usize, values: &[T], d: usize, out: &mut [f32]) {
    for (r, o) in out.chunks_exact_mut(d).enumerate() {
        for (w, v) in p[r * ld..].iter().zip(values.chunks_exact(d)) {
            o.iter_mut().zip(v).for_each(|(o, v)| *o += w * v.to_f32());
        }
    }
}

/// Whether the AVX-512 kernels apply, and to which sizes: the CPU has AVX-512F, blocks hold
/// whole sixteens of slots, and heads have 64 or 128 dimensions. The checked `bs` and `d`
/// travel in the token, and the kernels run only on exactly those, so a token made for one
/// shape can never send another into the unchecked code (it takes the portable path).
#[derive(Clone, Copy)]
struct Fast(Option<(usize, usize)>);

impl Fast {
    fn new(bs: usize, d: usize) -> Fast {
        #[cfg(target_arch = "x86_64")]
        {
            let ok = bs.is_multiple_of(16)
                && (d == 64 || d == 128)
                && std::is_x86_feature_detected!("avx512f");
            Fast(ok.then_some((bs, d)))
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (bs, d);
            Fast(None)
        }
    }

    /// Checked for blocks of `bs` slots of heads of `d` dimensions.
    fn covers(self, bs: usize, d: usize) -> bool {
        self.0 == Some((bs, d))
    }

    /// Checked for heads of `d` dimensions (the values' kernel reads whole rows of `d`).
    fn covers_dim(self, d: usize) -> bool {
        self.0.is_some_and(|(_, fd)| fd == d)
    }
}

/// Scores of the query rows `q` against the first `len` keys of a block (as
/// [`portable_scores`]), prefetching `next` (the following block's keys).
#[allow(clippy::too_many_arguments)]
fn block_scores<T: Elem>(
    fast: Fast,
    q: &[f32],
    d: usize,
    keys: &[T],
    bs: usize,
    len: usize,
    scores: &mut [f32],
    ld: usize,
    next: &[T],
) {
    let rows = q.len() / d;
    #[cfg(target_arch = "x86_64")]
    if fast.covers(bs, d) {
        assert!(keys.len() >= d * bs && len <= bs && rows > 0 && ld >= len);
        assert!(scores.len() >= (rows - 1) * ld + len);
        prefetch(next);
        // SAFETY: `Fast` checked AVX-512F, and `bs % 16 == 0` and `d` for exactly these
        // `bs` and `d` (`covers`); the asserts keep every read inside `q` and `keys` and
        // every write inside `scores`.
        unsafe {
            x86::scores(
                q.as_ptr(),
                rows,
                d,
                keys.as_ptr(),
                bs,
                len,
                scores.as_mut_ptr(),
                ld,
            )
        };
        return;
    }
    let _ = (fast, next, rows);
    portable_scores(q, d, keys, bs, len, scores, ld);
}

/// As [`portable_values`], prefetching `next` (the following block's values).
fn block_values<T: Elem>(
    fast: Fast,
    p: &[f32],
    ld: usize,
    values: &[T],
    d: usize,
    out: &mut [f32],
    next: &[T],
) {
    let (rows, len) = (out.len() / d, values.len() / d);
    #[cfg(target_arch = "x86_64")]
    if fast.covers_dim(d) {
        assert!(rows > 0 && ld >= len && p.len() >= (rows - 1) * ld + len);
        prefetch(next);
        let (p, v, o) = (p.as_ptr(), values.as_ptr(), out.as_mut_ptr());
        // SAFETY: `Fast` checked AVX-512F and this `d` (`covers_dim`); the assert and the
        // slice lengths keep every read inside `p` and `values` and every write inside
        // `out`.
        unsafe {
            if d == 64 {
                x86::values::<T, 4>(p, ld, rows, v, len, o)
            } else {
                x86::values::<T, 8>(p, ld, rows, v, len, o)
            }
        };
        return;
    }
    let _ = (fast, next, rows, len);
    portable_values(p, ld, values, d, out);
}

/// Ask for every cache line of `next` ahead of use: a sequence's blocks lie anywhere in the
/// cache, so the hardware prefetcher starts over at each one.
#[cfg(target_arch = "x86_64")]
fn prefetch<T>(next: &[T]) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    for line in next.chunks(64 / size_of::<T>()) {
        // SAFETY: a prefetch is a hint that never faults; the pointer is inside `next`.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! Callers guarantee AVX-512F and the bounds the parameters describe.

    use std::arch::x86_64::*;

    use super::Elem;

    /// `s[r * ld + j] = q_r · key_j` for `j < len`, keys `[d][bs]`, four rows at a time
    /// (four independent sums per key vector; rows past the end repeat the last row and are
    /// not stored).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores<T: Elem>(
        q: *const f32,
        rows: usize,
        d: usize,
        keys: *const T,
        bs: usize,
        len: usize,
        s: *mut f32,
        ld: usize,
    ) {
        let mut j0 = 0;
        while j0 < len {
            let n = (len - j0).min(16);
            let mask: __mmask16 = if n == 16 { 0xffff } else { (1u16 << n) - 1 };
            let mut r0 = 0;
            while r0 < rows {
                let rn = (rows - r0).min(4);
                // SAFETY (this block): rows r0..r0 + rn of `q`, c < d, j0 + 16 <= bs.
                unsafe {
                    let qr: [*const f32; 4] =
                        std::array::from_fn(|i| q.add((r0 + i.min(rn - 1)) * d));
                    let mut acc = [_mm512_setzero_ps(); 4];
                    for c in 0..d {
                        let kv = T::load16(keys.add(c * bs + j0));
                        for i in 0..4 {
                            acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(*qr[i].add(c)), kv, acc[i]);
                        }
                    }
                    for (i, a) in acc.iter().enumerate().take(rn) {
                        _mm512_mask_storeu_ps(s.add((r0 + i) * ld + j0), mask, *a);
                    }
                }
                r0 += 4;
            }
            j0 += 16;
        }
    }

    /// `out_r += Σ_j p[r * ld + j] · v_j` for `j < len`, values `[len][16 · N]`: the row's
    /// `N` output vectors stay in registers across the block.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn values<T: Elem, const N: usize>(
        p: *const f32,
        ld: usize,
        rows: usize,
        v: *const T,
        len: usize,
        out: *mut f32,
    ) {
        let d = 16 * N;
        for r in 0..rows {
            // SAFETY: row r < rows of `out` and `p`; j < len rows of `v`.
            unsafe {
                let o = out.add(r * d);
                let mut acc: [__m512; N] = std::array::from_fn(|i| _mm512_loadu_ps(o.add(16 * i)));
                for j in 0..len {
                    let w = _mm512_set1_ps(*p.add(r * ld + j));
                    let vj = v.add(j * d);
                    for (i, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(w, T::load16(vj.add(16 * i)), *a);
                    }
                }
                for (i, a) in acc.iter().enumerate() {
                    _mm512_storeu_ps(o.add(16 * i), *a);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;

    /// The AVX-512 kernels against the portable ones (which the model tests check against
    /// transformers), for each cache element type, partial blocks and row counts that leave
    /// partial groups of four.
    #[test]
    fn fast_kernels_match_the_portable_ones() {
        if Fast::new(16, 64).0.is_none() {
            println!("SKIPPED: no AVX-512F on this CPU");
            return;
        }
        same_as_portable::<f32>();
        same_as_portable::<bf16>();
        same_as_portable::<f16>();
    }

    /// A token checked for one shape sends another to the portable kernels: a head of 128
    /// dimensions (or blocks of 32) under a token made for 64 (or 16) reads and writes only
    /// inside its slices and gets the portable answer.
    #[test]
    fn fast_token_refuses_other_sizes() {
        let fast = Fast::new(16, 64);
        for (bs, d) in [(16, 128), (32, 64)] {
            let q: Vec<f32> = (0..2 * d).map(|i| (i % 7) as f32 / 8.0).collect();
            let keys: Vec<f32> = (0..bs * d).map(|i| (i % 5) as f32 / 4.0).collect();
            let (mut want, mut got) = (vec![0.0; 2 * bs], vec![0.0; 2 * bs]);
            portable_scores(&q, d, &keys, bs, bs, &mut want, bs);
            block_scores(fast, &q, d, &keys, bs, bs, &mut got, bs, &[]);
            assert_eq!(got, want, "scores bs {bs} d {d}");
            let p: Vec<f32> = (0..2 * bs).map(|i| (i % 3) as f32 / 2.0).collect();
            let (mut want, mut got) = (vec![0.0; 2 * d], vec![0.0; 2 * d]);
            portable_values(&p, bs, &keys, d, &mut want);
            // (The values' kernel depends only on `d`: blocks of 32 may take it.)
            block_values(fast, &p, bs, &keys, d, &mut got, &[]);
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < 1e-4, "values bs {bs} d {d}: {g} vs {w}");
            }
        }
        assert!(!fast.covers(16, 128) && !fast.covers(32, 64));
    }

    fn same_as_portable<T: Elem>() {
        for (bs, d) in [(16, 64), (32, 64), (16, 128)] {
            for rows in [1, 3, 4, 6, 12] {
                for len in [1, 7, 16, bs] {
                    let what = format!("{:?} rows {rows} len {len} bs {bs} d {d}", T::DTYPE);
                    let q: Vec<f32> = (0..rows * d)
                        .map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0)
                        .collect();
                    let keys: Vec<T> = (0..bs * d)
                        .map(|i| T::from_f32(((i * 5 % 11) as f32 - 5.0) / 4.0))
                        .collect();
                    let ld = len + 3;
                    let mut want = vec![0.0; rows * ld];
                    let mut got = want.clone();
                    portable_scores(&q, d, &keys, bs, len, &mut want, ld);
                    let fast = Fast::new(bs, d);
                    block_scores(fast, &q, d, &keys, bs, len, &mut got, ld, &keys);
                    assert_eq!(got, want, "scores {what}");
                    let p: Vec<f32> = (0..rows * ld).map(|i| (i % 5) as f32 / 4.0).collect();
                    let values = &keys[..len * d];
                    let mut want: Vec<f32> = (0..rows * d).map(|i| i as f32).collect();
                    let mut got = want.clone();
                    portable_values(&p, ld, values, d, &mut want);
                    block_values(fast, &p, ld, values, d, &mut got, &[]);
                    for (g, w) in got.iter().zip(&want) {
                        assert!((g - w).abs() < 1e-4, "values {what}: {g} vs {w}");
                    }
                }
            }
        }
    }
}
