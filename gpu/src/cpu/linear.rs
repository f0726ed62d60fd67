//! `y = x · Wᵀ (+ b)` for the CPU backend, parallel over runs of W's rows (output features).
//!
//! Each rayon task owns a run of output features and multiplies every input row by it, so a
//! weight is read from memory once per step however many tokens the step has — which is what
//! makes batched decode cheap. Three ways, by the number of input rows:
//!
//! - up to four (decode): streamed dot products, compiled for AVX-512, AVX2 and NEON and
//!   chosen at run time, half-precision weights widened in the loop — memory-bound, as it
//!   should be;
//! - bf16 weights and up to 64 rows on a CPU with AVX512-BF16: its native dot products
//!   ([`super::bf16dot`]);
//! - otherwise gemm's microkernels on tiles of W, with the input transposed so gemm reads it
//!   in place; half-precision tiles are widened into a per-thread f32 buffer that stays in
//!   cache, so memory traffic is the 2-byte weights.

use std::cell::RefCell;

use half::{bf16, f16};
use rayon::prelude::*;

use super::gemm::{Strides, matmul};
use crate::model::{Host, Matrix};

/// A weight matrix `[out, inp]` ready for [`Linear::forward`].
pub struct Linear {
    pub out: usize,
    pub inp: usize,
    w: Host,
    bias: Option<Vec<f32>>,
    tile: usize,
}

/// Buffers a caller keeps for [`Linear::forward`].
#[derive(Default)]
pub struct Scratch {
    yt: Vec<f32>,
    xt: Vec<f32>,
    xb: Vec<bf16>,
}

/// With bf16 weights on a CPU with AVX512-BF16, up to this many rows (batched decode) take
/// its native dot products instead of widening the weights for gemm.
const BF16_DOT_ROWS: usize = 64;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl Linear {
    pub fn new(m: Matrix) -> Self {
        let threads = rayon::current_num_threads().max(1);
        // Enough tiles to balance threads; a widened tile stays within ~128 KiB.
        let by_balance = m.rows.div_ceil(8 * threads);
        let by_cache = (32 * 1024 / m.cols.max(1)).max(8);
        let tile = by_balance.min(by_cache).clamp(8, 512).div_ceil(8) * 8;
        Linear {
            out: m.rows,
            inp: m.cols,
            w: m.data,
            bias: m.bias,
            tile,
        }
    }

    /// `y[m×out] = x[m×inp] · Wᵀ (+ b)`; `scratch` keeps its buffers between calls (fresh
    /// large buffers would cost page faults every step).
    pub fn forward(&self, x: &[f32], m: usize, y: &mut [f32], scratch: &mut Scratch) {
        let (out, inp) = (self.out, self.inp);
        debug_assert_eq!(x.len(), m * inp);
        debug_assert_eq!(y.len(), m * out);
        let Scratch { yt, xt, xb } = scratch;
        if m <= DOT_ROWS {
            // Few rows (decode): every output is a dot product of a weight row with each input
            // row, streaming W once at memory speed with no widening copy; large runs of
            // rows per task, so the per-task cost is paid a few times per matrix.
            let run = out
                .div_ceil(4 * rayon::current_num_threads().max(1))
                .max(16);
            return self.by_runs(m, run, y, yt, |o0, dst| {
                let w = o0 * inp..(o0 + dst.len() / m) * inp;
                let mut one = Vec::new();
                for i in 0..m {
                    let xi = &x[i * inp..(i + 1) * inp];
                    // One row writes its dots in place; more take turns through `one`.
                    let d: &mut [f32] = if m == 1 {
                        &mut *dst
                    } else {
                        one.resize(dst.len() / m, 0.0);
                        &mut one
                    };
                    match &self.w {
                        Host::F32(v) => dots_f32(xi, &v[w.clone()], d),
                        Host::Bf16(v) => dots_bf16(xi, &v[w.clone()], d),
                        Host::F16(v) => dots_f16(xi, &v[w.clone()], d),
                    }
                    if m > 1 {
                        for (j, v) in one.iter().enumerate() {
                            dst[j * m + i] = *v;
                        }
                    }
                }
            });
        }
        if let Host::Bf16(w) = &self.w
            && m <= BF16_DOT_ROWS
            && super::bf16dot::available()
        {
            // Batched decode with bf16 weights on AVX512-BF16 (see [`super::bf16dot`]): the
            // input rounded to bf16 once.
            xb.clear();
            xb.extend(x.iter().map(|v| bf16::from_f32(*v)));
            let run = out
                .div_ceil(4 * rayon::current_num_threads().max(1))
                .div_ceil(4)
                .max(1)
                * 4;
            let xb = &xb[..];
            return self.by_runs(m, run, y, yt, |o0, dst| {
                super::bf16dot::dots(&w[o0 * inp..(o0 + dst.len() / m) * inp], xb, inp, m, dst);
            });
        }
        // x transposed (`[inp, m]`): gemm then uses it in place instead of packing a copy
        // for every tile.
        xt.resize(m * inp, 0.0);
        for (i, row) in x.chunks_exact(inp).enumerate() {
            for (k, v) in row.iter().enumerate() {
                xt[k * m + i] = *v;
            }
        }
        let x = &xt[..];
        self.by_runs(m, self.tile, y, yt, |o0, dst| {
            let n = dst.len() / m;
            let (ds, a, bs) = (Strides::cols(m), Strides::cols(m), Strides::cols(inp));
            let w = o0 * inp..(o0 + n) * inp;
            match &self.w {
                Host::F32(v) => matmul(m, n, inp, dst, ds, false, x, a, &v[w], bs),
                Host::Bf16(v) => widened(&v[w], bf16_to_f32, |wt| {
                    matmul(m, n, inp, dst, ds, false, x, a, wt, bs)
                }),
                Host::F16(v) => widened(&v[w], f16::to_f32, |wt| {
                    matmul(m, n, inp, dst, ds, false, x, a, wt, bs)
                }),
            }
        });
    }

    /// Split the output features into runs of `run`, have `f(first, dst)` fill each run's
    /// `[run, m]` slice of `yt` (`[out, m]`) in parallel, add the bias, and scatter `yt` into
    /// `y` (`[m, out]`). With one input row the two layouts are the same.
    fn by_runs(
        &self,
        m: usize,
        run: usize,
        y: &mut [f32],
        yt: &mut Vec<f32>,
        f: impl Fn(usize, &mut [f32]) + Sync,
    ) {
        let out = self.out;
        let fill = |yt: &mut [f32]| {
            yt.par_chunks_mut(run * m).enumerate().for_each(|(r, dst)| {
                let o0 = r * run;
                f(o0, dst);
                if let Some(b) = &self.bias {
                    for (j, col) in dst.chunks_mut(m).enumerate() {
                        col.iter_mut().for_each(|v| *v += b[o0 + j]);
                    }
                }
            })
        };
        if m == 1 {
            return fill(y);
        }
        yt.resize(out * m, 0.0);
        fill(&mut yt[..]);
        for (o, col) in yt.chunks(m).enumerate() {
            for (i, v) in col.iter().enumerate() {
                y[i * out + o] = *v;
            }
        }
    }
}

/// Up to this many input rows take the dot-product path.
const DOT_ROWS: usize = 4;

/// `out[r] = x · w[r]` for each row `r` of `w`, compiled for AVX-512, AVX2 and NEON and
/// chosen at run time (once per run of rows: dispatching per row costs more than the row).
/// Sixteen independent accumulators fill the vector registers and let the compiler
/// vectorize without reassociating one float sum.
macro_rules! dot_kernel {
    ($name:ident, $t:ty, $widen:expr) => {
        #[multiversion::multiversion(targets(
            "x86_64+avx512f+avx512bw",
            "x86_64+avx2+fma",
            "aarch64+neon"
        ))]
        fn $name(x: &[f32], w: &[$t], out: &mut [f32]) {
            let k = x.len();
            for (row, o) in w.chunks_exact(k).zip(out.iter_mut()) {
                let mut acc = [0.0f32; 16];
                let (xc, wc) = (x.chunks_exact(16), row.chunks_exact(16));
                let tail: f32 = xc
                    .remainder()
                    .iter()
                    .zip(wc.remainder())
                    .map(|(a, b)| a * ($widen)(*b))
                    .sum();
                for (a, b) in xc.zip(wc) {
                    for j in 0..16 {
                        acc[j] += a[j] * ($widen)(b[j]);
                    }
                }
                *o = acc.iter().sum::<f32>() + tail;
            }
        }
    };
}

dot_kernel!(dots_f32, f32, f32::from);
dot_kernel!(dots_bf16, bf16, bf16_to_f32);
dot_kernel!(dots_f16, f16, f16::to_f32);

/// bf16 is the top half of an f32: a shift, which vectorizes (unlike a call per element).
#[inline(always)]
fn bf16_to_f32(x: bf16) -> f32 {
    f32::from_bits(u32::from(x.to_bits()) << 16)
}

/// Run `f` on `w` widened to f32 in this thread's scratch tile.
#[inline(always)]
fn widened<T: Copy>(w: &[T], widen: impl Fn(T) -> f32, f: impl FnOnce(&[f32])) {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        s.clear();
        s.extend(w.iter().map(|x| widen(*x)));
        f(&s);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &[f32], m: usize, w: &[f32], out: usize, inp: usize, b: &[f32]) -> Vec<f32> {
        let mut y = vec![0.0; m * out];
        for i in 0..m {
            for o in 0..out {
                y[i * out + o] = b[o]
                    + (0..inp)
                        .map(|k| x[i * inp + k] * w[o * inp + k])
                        .sum::<f32>();
            }
        }
        y
    }

    #[test]
    fn every_dtype_and_batch_matches_the_definition() {
        let (out, inp) = (203, 96);
        let w: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
            .collect();
        let b: Vec<f32> = (0..out).map(|i| i as f32 / 100.0).collect();
        for m in [1, 3, 5, 16, 23, 33] {
            let x: Vec<f32> = (0..m * inp)
                .map(|i| ((i * 13 % 29) as f32 - 14.0) / 16.0)
                .collect();
            let want = reference(&x, m, &w, out, inp, &b);
            for data in [
                Host::F32(w.clone()),
                Host::Bf16(w.iter().map(|v| bf16::from_f32(*v)).collect()),
                Host::F16(w.iter().map(|v| f16::from_f32(*v)).collect()),
            ] {
                let dt = data.dtype();
                let l = Linear::new(Matrix {
                    rows: out,
                    cols: inp,
                    data,
                    bias: Some(b.clone()),
                });
                let mut y = vec![0.0; m * out];
                l.forward(&x, m, &mut y, &mut Scratch::default());
                // These weights are exact in every dtype (multiples of 1/64 below 1).
                for (g, e) in y.iter().zip(&want) {
                    assert!((g - e).abs() < 1e-4, "{dt:?} m={m}: {g} vs {e}");
                }
            }
        }
    }
}
