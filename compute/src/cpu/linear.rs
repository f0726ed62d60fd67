//! `y = x · Wᵀ (+ b)` for the CPU backend, parallel over bands of W's output features.
//!
//! The weights are packed at load time into groups of 48 output features
//! ([`super::panel`]). Each rayon task owns a band of `y`'s columns and multiplies every
//! input row by the groups behind it, so a weight is read from memory once per step however
//! many tokens the step has — which is what makes batched decode cheap. Two ways, by the
//! number of input rows:
//!
//! - up to [`PANEL_ROWS`] (decode, batched decode): the panel kernels, which keep blocks of
//!   outputs in registers while the weights stream past;
//! - more (prefill): gemm's microkernels, one group at a time as a `[k, 48]` matrix (widened
//!   from f16/bf16 into a per-thread buffer that stays in cache, so memory traffic is the
//!   2-byte weights), with the input transposed so gemm reads it in place.
//!
//! Quantized weights (a GGUF file's) take a third way at every batch size: the input rows are
//! quantized to 8 bits and multiplied in integers against eight-row panels of the weights
//! ([`crate::quant::panel`]; one row at a time on portable code where the CPU lacks AVX2,
//! with gemm on widened groups for prefill).
//!
//! Every way, a group's products land in a small per-thread block, and the task then writes
//! them into its columns of `y` (see [`super::columns`]) with whatever the layer does next
//! that needs only those outputs: the bias, the residual add ([`Write::Add`]), or the
//! gated activation of the MLP ([`Linear::gated`]). One fork-join per product, and the
//! outputs are touched once.

use std::cell::RefCell;

use super::columns::by_bands;
use super::gemm::{Strides, matmul};
use super::math::silu_mul;
use super::panel::{InputBuf, Isa, Panels, WIDTH};
use crate::model::{Host, Matrix};
use crate::quant::{self, Acts, QPanels, QTensor};

/// A weight matrix ready for [`Linear::forward`].
pub struct Linear {
    /// Columns of `y`.
    pub out: usize,
    pub inp: usize,
    w: Weights,
    /// Per packed row.
    bias: Option<Vec<f32>>,
    /// Packed as pairs of groups (48 gate features, the same 48 up features); `y` gets
    /// `silu(gate) · up`.
    gated: bool,
    isa: Isa,
    qisa: quant::Isa,
}

/// The weights, packed.
enum Weights {
    Dense(Panels),
    /// Quantized, in eight-row panels (where the CPU has AVX2).
    QPanels(QPanels),
    /// Quantized rows in packed order (whole groups of [`WIDTH`], zero rows padding), for
    /// the row kernels elsewhere.
    QRows(QTensor),
}

/// How a product lands in `y`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write {
    /// `y = x · Wᵀ (+ b)`.
    Set,
    /// `y += x · Wᵀ (+ b)`: the residual connection, without a pass of its own.
    Add,
}

/// Buffers a caller keeps for [`Linear::forward`].
#[derive(Default)]
pub struct Scratch {
    xt: Vec<f32>,
    input: InputBuf,
    acts: Acts,
}

/// Up to this many input rows take the panel kernels; gemm's blocking pays off beyond.
const PANEL_ROWS: usize = 64;

/// A task's buffers: one group's (or gate/up pair's) products, and a group widened to f32
/// for gemm.
#[derive(Default)]
struct Task {
    block: Vec<f32>,
    wide: Vec<f32>,
}

thread_local! {
    static TASK: RefCell<Task> = RefCell::new(Task::default());
}

/// Group `g` as a row-major `[k, 48]` f32 matrix for gemm (panels never come here: they
/// take the integer products at any batch size).
fn group_f32<'a>(w: &'a Weights, g: usize, buf: &'a mut Vec<f32>) -> &'a [f32] {
    match w {
        Weights::Dense(p) => p.group_f32(g, buf),
        Weights::QPanels(_) => unreachable!("panels multiply in integers"),
        Weights::QRows(q) => {
            let k = q.cols;
            buf.resize(k * (WIDTH + 1), 0.0);
            let (out, row) = buf.split_at_mut(k * WIDTH);
            for l in 0..WIDTH {
                q.dequantize_row(g * WIDTH + l, row);
                for (c, v) in row.iter().enumerate() {
                    out[c * WIDTH + l] = *v;
                }
            }
            &buf[..k * WIDTH]
        }
    }
}

impl Linear {
    pub fn new(m: Matrix) -> Self {
        let (order, out) = ((0..m.rows).map(Some).collect(), m.rows);
        Linear::packed(m, order, out, false, Isa::detect(), quant::Isa::detect())
    }

    /// The MLP's `[gate; up]` (`2 · i` rows stacked): [`Linear::forward`] then gives
    /// `silu(x · gateᵀ) ⊙ (x · upᵀ)`, `[m, i]`, with no `[m, 2i]` intermediate.
    pub fn gated(m: Matrix) -> Self {
        let i = m.rows / 2;
        let order: Vec<Option<usize>> = (0..i.div_ceil(WIDTH))
            .flat_map(|c| {
                let feature = move |l: usize| Some(c * WIDTH + l).filter(|f| *f < i);
                (0..WIDTH)
                    .map(feature)
                    .chain((0..WIDTH).map(move |l| feature(l).map(|f| f + i)))
            })
            .collect();
        Linear::packed(m, order, i, true, Isa::detect(), quant::Isa::detect())
    }

    /// `m`'s rows packed in `order`, giving `out` columns of `y`.
    fn packed(
        m: Matrix,
        order: Vec<Option<usize>>,
        out: usize,
        gated: bool,
        isa: Isa,
        qisa: quant::Isa,
    ) -> Self {
        // Padded to whole groups, like the weights.
        let padded = order.len().div_ceil(WIDTH) * WIDTH;
        let bias = m.bias.map(|b| {
            (0..padded)
                .map(|r| order.get(r).copied().flatten().map_or(0.0, |r| b[r]))
                .collect()
        });
        let w = match &m.data {
            Host::Quant(q) => {
                let mut order = order;
                order.resize(padded, None);
                let rows = q.select_rows(&order);
                match QPanels::pack(&rows, qisa) {
                    Some(p) => Weights::QPanels(p),
                    None => Weights::QRows(rows),
                }
            }
            dense => Weights::Dense(Panels::pack_rows(dense, m.cols, &order)),
        };
        Linear {
            out,
            inp: m.cols,
            w,
            bias,
            gated,
            isa,
            qisa,
        }
    }

    /// `m` on the portable kernels (tests compare them with the best).
    #[cfg(test)]
    fn portable(m: Matrix) -> Self {
        let order = (0..m.rows).map(Some).collect();
        let out = m.rows;
        Linear::packed(
            m,
            order,
            out,
            false,
            Isa::portable(),
            quant::Isa::portable(),
        )
    }

    /// `y[m×out] (+)= x[m×inp] · Wᵀ (+ b)` (gated: see [`Linear::gated`]); `scratch` keeps
    /// its buffers between calls (fresh large buffers would cost page faults every step).
    pub fn forward(&self, x: &[f32], m: usize, y: &mut [f32], write: Write, scratch: &mut Scratch) {
        self.forward_pre(x, m, y, write, scratch, None);
    }

    /// [`Linear::forward`] with `pre` (`[m, 2 · out]`: gate features, then up features) added
    /// to a gated product before its activation: what a LoRA adapter of the gate and up
    /// projections adds. (An ungated product takes such additions after it, as it is linear.)
    pub fn forward_pre(
        &self,
        x: &[f32],
        m: usize,
        y: &mut [f32],
        write: Write,
        scratch: &mut Scratch,
        pre: Option<&[f32]>,
    ) {
        let (out, inp) = (self.out, self.inp);
        debug_assert_eq!(x.len(), m * inp);
        debug_assert_eq!(y.len(), m * out);
        debug_assert!(pre.is_none_or(|p| self.gated && p.len() == m * 2 * out));
        if m == 0 {
            return;
        }
        let Scratch { xt, input, acts } = scratch;
        // Groups per 48 columns of `y`.
        let per = if self.gated { 2 } else { 1 };
        let ld = per * WIDTH;
        // Several bands per thread, so an uneven split costs little.
        let chunks = out.div_ceil(WIDTH);
        let run = chunks
            .div_ceil(8 * rayon::current_num_threads().max(1))
            .max(1);
        // How the input is read: by the panel kernels, quantized for the integer products
        // (at any batch size where the weights are in panels: integer multiply-adds do four
        // times the work of f32 ones per instruction), or (prefill) transposed for gemm.
        let integer = matches!(self.w, Weights::QPanels(_));
        let input = (m <= PANEL_ROWS || integer).then(|| match &self.w {
            Weights::Dense(w) => Some(w.input(x, m, self.isa, input)),
            Weights::QPanels(_) | Weights::QRows(_) => {
                acts.quantize(x, m, inp);
                None
            }
        });
        if input.is_none() {
            // x transposed (`[inp, m]`): gemm then uses it in place instead of packing a
            // copy for every group.
            xt.resize(m * inp, 0.0);
            for (i, row) in x.chunks_exact(inp).enumerate() {
                for (k, v) in row.iter().enumerate() {
                    xt[k * m + i] = *v;
                }
            }
        }
        let xt = &xt[..];
        by_bands(y, m, out, run * WIDTH, |_, mut band| {
            TASK.with(|task| {
                let Task { block, wide } = &mut *task.borrow_mut();
                block.resize(m * ld, 0.0);
                let cols = band.cols();
                for c0 in cols.clone().step_by(WIDTH) {
                    let groups = c0 / WIDTH * per..(c0 / WIDTH + 1) * per;
                    match (&self.w, &input) {
                        (Weights::Dense(w), Some(Some(input))) => {
                            w.product(groups.clone(), input, m, self.isa, block, ld)
                        }
                        (Weights::QPanels(p), Some(_)) => {
                            // A group of 48 rows is six panels.
                            let per = WIDTH / quant::panel::ROWS;
                            let panels = groups.start * per..groups.end * per;
                            p.product(panels, acts, self.qisa, block, ld);
                        }
                        (Weights::QRows(w), Some(_)) => {
                            for (gi, g) in groups.clone().enumerate() {
                                let rows = g * WIDTH..(g + 1) * WIDTH;
                                w.product(rows, acts, &mut block[gi * WIDTH..], ld);
                            }
                        }
                        (w, _) => {
                            for (gi, g) in groups.clone().enumerate() {
                                let b = group_f32(w, g, wide);
                                let (ds, a, bs) =
                                    (Strides::rows(ld), Strides::cols(m), Strides::rows(WIDTH));
                                matmul(
                                    m,
                                    WIDTH,
                                    inp,
                                    &mut block[gi * WIDTH..],
                                    ds,
                                    false,
                                    xt,
                                    a,
                                    b,
                                    bs,
                                );
                            }
                        }
                    }
                    if let Some(bias) = &self.bias {
                        let bias = &bias[groups.start * WIDTH..groups.end * WIDTH];
                        for row in block.chunks_exact_mut(ld) {
                            row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
                        }
                    }
                    let (off, n) = (c0 - cols.start, (cols.end - c0).min(WIDTH));
                    if let Some(pre) = pre {
                        for (i, row) in block.chunks_exact_mut(ld).enumerate() {
                            let (g, u) = row.split_at_mut(WIDTH);
                            let at = i * 2 * out + c0;
                            g[..n].iter_mut().zip(&pre[at..]).for_each(|(v, p)| *v += p);
                            let at = at + out;
                            u[..n].iter_mut().zip(&pre[at..]).for_each(|(v, p)| *v += p);
                        }
                    }
                    for (i, src) in block.chunks_exact(ld).enumerate() {
                        let dst = &mut band.row(i)[off..off + n];
                        match (self.gated, write) {
                            (false, Write::Set) => dst.copy_from_slice(&src[..n]),
                            (false, Write::Add) => {
                                dst.iter_mut().zip(src).for_each(|(d, v)| *d += v)
                            }
                            (true, _) => {
                                let (g, u) = src.split_at(WIDTH);
                                silu_mul(dst, &g[..n], &u[..n], write == Write::Add)
                            }
                        }
                    }
                }
            })
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

    /// `w` in every dtype (its values must be exact in each).
    fn matrices(w: &[f32], out: usize, inp: usize, b: &[f32]) -> Vec<Matrix> {
        [
            Host::F32(w.to_vec()),
            Host::Bf16(w.iter().map(|v| bf16::from_f32(*v)).collect()),
            Host::F16(w.iter().map(|v| f16::from_f32(*v)).collect()),
        ]
        .into_iter()
        .map(|data| Matrix {
            rows: out,
            cols: inp,
            data,
            bias: Some(b.to_vec()),
        })
        .collect()
    }

    fn close(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len());
        for (g, e) in got.iter().zip(want) {
            assert!(
                (g - e).abs() < 1e-4 * e.abs().max(1.0),
                "{what}: {g} vs {e}"
            );
        }
    }

    fn input(m: usize, inp: usize) -> Vec<f32> {
        (0..m * inp)
            .map(|i| ((i * 13 % 29) as f32 - 14.0) / 16.0)
            .collect()
    }

    // Sizes cross both paths (≤ 64 rows: panels; more: gemm) and leave partial groups.
    const BATCHES: [usize; 9] = [1, 3, 5, 16, 23, 33, 64, 65, 100];

    #[test]
    fn every_dtype_and_batch_matches_the_definition() {
        let (out, inp) = (203, 96);
        let w: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
            .collect();
        let b: Vec<f32> = (0..out).map(|i| i as f32 / 100.0).collect();
        for m in BATCHES {
            let x = input(m, inp);
            let want = reference(&x, m, &w, out, inp, &b);
            let base: Vec<f32> = (0..m * out).map(|i| (i % 7) as f32).collect();
            let added: Vec<f32> = want.iter().zip(&base).map(|(w, b)| w + b).collect();
            for mat in matrices(&w, out, inp, &b) {
                let dt = mat.data.dtype();
                let l = Linear::new(mat);
                let mut y = vec![f32::NAN; m * out];
                l.forward(&x, m, &mut y, Write::Set, &mut Scratch::default());
                close(&y, &want, &format!("{dt:?} m={m} set"));
                let mut y = base.clone();
                l.forward(&x, m, &mut y, Write::Add, &mut Scratch::default());
                close(&y, &added, &format!("{dt:?} m={m} add"));
            }
        }
    }

    /// Quantized weights: each format at every batch size, plain and gated, on the best
    /// kernels (panels) and the portable ones (rows, with dequantized gemm beyond 64 rows),
    /// against the dequantized weights in f32 (8-bit activations: within 1 % of the terms).
    #[test]
    fn quantized_weights_match_their_dequantized_values() {
        use crate::quant::tests::{TYPES, matrix};
        let (out, inp) = (100, 256);
        for ty in TYPES {
            let q = matrix(ty, out, inp, 3);
            let w = q.to_f32();
            let b: Vec<f32> = (0..out).map(|i| i as f32 / 100.0).collect();
            let abs: Vec<f32> = w.iter().map(|v| v.abs()).collect();
            let mat = || Matrix {
                rows: out,
                cols: inp,
                data: Host::Quant(q.clone()),
                bias: Some(b.clone()),
            };
            for m in BATCHES {
                let x = input(m, inp);
                let xa: Vec<f32> = x.iter().map(|v| v.abs()).collect();
                let want = reference(&x, m, &w, out, inp, &b);
                let mag = reference(&xa, m, &abs, out, inp, &vec![0.0; out]);
                for l in [Linear::new(mat()), Linear::portable(mat())] {
                    let mut y = vec![f32::NAN; m * out];
                    l.forward(&x, m, &mut y, Write::Set, &mut Scratch::default());
                    for (j, (g, e)) in y.iter().zip(&want).enumerate() {
                        assert!(
                            (g - e).abs() <= 0.01 * mag[j] + 1e-4,
                            "{ty:?} m={m} [{j}]: {g} vs {e}"
                        );
                    }
                }
                // Gated: gate = rows 0..50, up = rows 50..100.
                let l = Linear::gated(mat());
                let mut y = vec![f32::NAN; m * out / 2];
                l.forward(&x, m, &mut y, Write::Set, &mut Scratch::default());
                for i in 0..m {
                    for f in 0..out / 2 {
                        let (g, u) = (want[i * out + f], want[i * out + out / 2 + f]);
                        let e = g / (1.0 + (-g).exp()) * u;
                        let tol = 0.01
                            * (mag[i * out + f] * u.abs() + mag[i * out + out / 2 + f] * g.abs())
                            + 1e-4;
                        let got = y[i * out / 2 + f];
                        assert!((got - e).abs() <= tol, "{ty:?} gated m={m}: {got} vs {e}");
                    }
                }
            }
        }
    }

    /// A fused matrix whose parts differ in type (a Q4_K_M file's q and k in Q4_K, v in
    /// Q6_K) keeps each part's type in its panels.
    #[test]
    fn fused_parts_of_different_types() {
        use crate::quant::{QTensor, QType, tests::matrix};
        let (qk, v, inp) = (64, 32, 256);
        let q = QTensor::concat(&[
            &matrix(QType::Q4K, qk, inp, 1),
            &matrix(QType::Q6K, v, inp, 2),
        ])
        .unwrap();
        let w = q.to_f32();
        let out = qk + v;
        let l = Linear::new(Matrix {
            rows: out,
            cols: inp,
            data: Host::Quant(q),
            bias: None,
        });
        #[cfg(target_arch = "x86_64")]
        assert!(matches!(l.w, Weights::QPanels(_)) || !std::is_x86_feature_detected!("avx2"));
        let zero = vec![0.0; out];
        for m in [1, 7, 70] {
            let x = input(m, inp);
            let want = reference(&x, m, &w, out, inp, &zero);
            let abs: Vec<f32> = w.iter().map(|v| v.abs()).collect();
            let xa: Vec<f32> = x.iter().map(|v| v.abs()).collect();
            let mag = reference(&xa, m, &abs, out, inp, &zero);
            let mut y = vec![f32::NAN; m * out];
            l.forward(&x, m, &mut y, Write::Set, &mut Scratch::default());
            for (j, (g, e)) in y.iter().zip(&want).enumerate() {
                assert!(
                    (g - e).abs() <= 0.01 * mag[j] + 1e-4,
                    "m={m} [{j}]: {g} vs {e}"
                );
            }
        }
    }

    #[test]
    fn gated_products_are_silu_gate_times_up() {
        // 100 features: two full groups and a partial one of each half.
        let (i, inp) = (100, 64);
        let w: Vec<f32> = (0..2 * i * inp)
            .map(|v| ((v * 29 % 97) as f32 - 48.0) / 256.0)
            .collect();
        let b: Vec<f32> = (0..2 * i).map(|v| (v % 11) as f32 / 32.0 - 0.125).collect();
        for m in BATCHES {
            let x = input(m, inp);
            let both = reference(&x, m, &w, 2 * i, inp, &b);
            let want: Vec<f32> = both
                .chunks_exact(2 * i)
                .flat_map(|r| {
                    let (g, u) = r.split_at(i);
                    g.iter()
                        .zip(u)
                        .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                        .collect::<Vec<_>>()
                })
                .collect();
            for mat in matrices(&w, 2 * i, inp, &b) {
                let dt = mat.data.dtype();
                let l = Linear::gated(mat);
                assert_eq!(l.out, i);
                let mut y = vec![f32::NAN; m * i];
                l.forward(&x, m, &mut y, Write::Set, &mut Scratch::default());
                close(&y, &want, &format!("{dt:?} m={m} gated"));
            }
        }
    }
}
