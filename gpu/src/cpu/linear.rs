//! `y = x · Wᵀ (+ b)` for the CPU backend, parallel over runs of W's output features.
//!
//! The weights are packed at load time into groups of 48 output features
//! ([`super::panel`]). Each rayon task owns a run of groups and multiplies every input row by
//! it, so a weight is read from memory once per step however many tokens the step has —
//! which is what makes batched decode cheap. Two ways, by the number of input rows:
//!
//! - up to [`PANEL_ROWS`] (decode, batched decode): the panel kernels, which keep blocks of
//!   outputs in registers while the weights stream past;
//! - more (prefill): gemm's microkernels, one group at a time as a `[k, 48]` matrix (widened
//!   from f16/bf16 into a per-thread buffer that stays in cache, so memory traffic is the
//!   2-byte weights), with the input transposed so gemm reads it in place.
//!
//! Either way a task writes its outputs as a `[rows, run]` block, and the blocks are then
//! copied into `y` row by row (with the bias).

use std::cell::RefCell;

use rayon::prelude::*;

use super::gemm::{Strides, matmul};
use super::panel::{InputBuf, Isa, Panels, WIDTH};
use crate::model::Matrix;

/// A weight matrix `[out, inp]` ready for [`Linear::forward`].
pub struct Linear {
    pub out: usize,
    pub inp: usize,
    w: Panels,
    bias: Option<Vec<f32>>,
    isa: Isa,
}

/// Buffers a caller keeps for [`Linear::forward`].
#[derive(Default)]
pub struct Scratch {
    blocks: Vec<f32>,
    xt: Vec<f32>,
    input: InputBuf,
}

/// Up to this many input rows take the panel kernels; gemm's blocking pays off beyond.
const PANEL_ROWS: usize = 64;

thread_local! {
    static WIDE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl Linear {
    pub fn new(m: Matrix) -> Self {
        Linear {
            out: m.rows,
            inp: m.cols,
            w: Panels::pack(&m.data, m.rows, m.cols),
            bias: m.bias,
            isa: Isa::detect(),
        }
    }

    /// `y[m×out] = x[m×inp] · Wᵀ (+ b)`; `scratch` keeps its buffers between calls (fresh
    /// large buffers would cost page faults every step).
    pub fn forward(&self, x: &[f32], m: usize, y: &mut [f32], scratch: &mut Scratch) {
        let (out, inp) = (self.out, self.inp);
        debug_assert_eq!(x.len(), m * inp);
        debug_assert_eq!(y.len(), m * out);
        if m == 0 {
            return;
        }
        let Scratch { blocks, xt, input } = scratch;
        let groups = self.w.groups();
        // Several runs per thread, so an uneven split costs little.
        let run = groups
            .div_ceil(8 * rayon::current_num_threads().max(1))
            .max(1);
        let width = run * WIDTH;
        blocks.resize(groups.div_ceil(run) * m * width, 0.0);
        let runs = blocks.par_chunks_mut(m * width).enumerate();
        let groups_of = |r: usize| r * run..((r + 1) * run).min(groups);
        if m <= PANEL_ROWS {
            let input = self.w.input(x, m, self.isa, input);
            runs.for_each(|(r, block)| {
                self.w
                    .product(groups_of(r), &input, m, self.isa, block, width)
            });
        } else {
            // x transposed (`[inp, m]`): gemm then uses it in place instead of packing a
            // copy for every group.
            xt.resize(m * inp, 0.0);
            for (i, row) in x.chunks_exact(inp).enumerate() {
                for (k, v) in row.iter().enumerate() {
                    xt[k * m + i] = *v;
                }
            }
            let xt = &xt[..];
            runs.for_each(|(r, block)| {
                WIDE.with(|wide| {
                    let wide = &mut wide.borrow_mut();
                    for (j, g) in groups_of(r).enumerate() {
                        let b = self.w.group_f32(g, wide);
                        let (ds, a, bs) =
                            (Strides::rows(width), Strides::cols(m), Strides::rows(WIDTH));
                        matmul(
                            m,
                            WIDTH,
                            inp,
                            &mut block[j * WIDTH..],
                            ds,
                            false,
                            xt,
                            a,
                            b,
                            bs,
                        );
                    }
                })
            });
        }
        // Each run's block into its columns of `y`, row by row.
        let blocks = &blocks[..];
        let bias = self.bias.as_deref();
        y.par_chunks_mut(out).enumerate().for_each(|(t, row)| {
            for (r, block) in blocks.chunks(m * width).enumerate() {
                let o0 = r * width;
                let n = width.min(out - o0);
                let dst = &mut row[o0..o0 + n];
                dst.copy_from_slice(&block[t * width..t * width + n]);
                if let Some(b) = bias {
                    dst.iter_mut()
                        .zip(&b[o0..o0 + n])
                        .for_each(|(v, b)| *v += b);
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;
    use crate::model::Host;

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
        for m in [1, 3, 5, 16, 23, 33, 64, 65, 100] {
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
