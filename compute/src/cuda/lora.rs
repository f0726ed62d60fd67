//! LoRA adapters on the device: each adapter's `Aᵀ` and scaled `Bᵀ`, uploaded once in the
//! weights' type and kept while recently used (within [`MAX_DEVICE_LORAS`] and
//! [`MAX_DEVICE_LORA_BYTES`]); the runs of a step's rows each adapter applies to; and the two
//! cuBLAS products that add an adapter's delta to a projection's output.

use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::CudaSlice;

use super::engine::Engine;
use super::{DevFloat, dev, int};
use crate::backend::{ComputeError, SeqStep};
use crate::model::Host;
use crate::model::lora::{LoraAdapter, Target};

/// Adapters kept on the device, and their bytes at most; the least recently used beyond
/// either are dropped (an adapter of the current step never is).
pub(super) const MAX_DEVICE_LORAS: usize = 32;
const MAX_DEVICE_LORA_BYTES: usize = 1 << 30;

/// One projection's adapter on the device: `Aᵀ` `[in, rank]` and `Bᵀ` `[rank, out]` (scale
/// folded in), row-major.
struct DevPair<T> {
    rank: usize,
    at: CudaSlice<T>,
    bt: CudaSlice<T>,
}

/// An adapter on the device, per layer and projection.
pub(super) struct DevLora<T> {
    layers: Vec<[Option<DevPair<T>>; 7]>,
    /// The step it was last used in.
    used: u64,
    bytes: usize,
}

/// Rows `row0..row0 + n` of the step run with adapter `id` (whose largest rank is `rank`).
#[derive(Clone, Copy)]
pub(super) struct LoraRows {
    pub(super) row0: usize,
    pub(super) n: usize,
    pub(super) id: u64,
    pub(super) rank: usize,
}

impl<T: DevFloat> Engine<T>
where
    CudaBlas: Gemm<T>,
{
    /// For each sequence in `rows` whose adapter changes `targets` of layer `li`:
    /// `y[its rows, offset..offset + out] += (x[its rows] · Aᵀ) · Bᵀ`, where `x` has `x_cols`
    /// columns and `y` rows of `y_width` (a fused projection's output, or the residual).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn add_lora(
        &self,
        li: usize,
        targets: &[(Target, usize)],
        rows: &[LoraRows],
        x: &CudaSlice<T>,
        x_cols: usize,
        y: &mut CudaSlice<T>,
        y_width: usize,
        scratch: &mut CudaSlice<T>,
    ) -> Result<(), ComputeError> {
        for r in rows.iter().filter(|r| r.n > 0) {
            let Some(lora) = self.loras.get(&r.id) else {
                continue;
            };
            for &(target, offset) in targets {
                let Some(p) = &lora.layers[li][target as usize] else {
                    continue;
                };
                // (Shapes checked when the adapter was uploaded.)
                let (inp, out) = target.dims(&self.cfg);
                debug_assert_eq!(inp, x_cols);
                // T (n × rank, row-major) = X (n × in) · Aᵀ (in × rank); column-major:
                // Tᵀ = (Aᵀ)ᵀ · Xᵀ with both operands as stored.
                let first = GemmConfig {
                    transa: cublasOperation_t::CUBLAS_OP_N,
                    transb: cublasOperation_t::CUBLAS_OP_N,
                    m: int(p.rank)?,
                    n: int(r.n)?,
                    k: int(inp)?,
                    alpha: T::one(),
                    lda: int(p.rank)?,
                    ldb: int(inp)?,
                    beta: T::zero(),
                    ldc: int(p.rank)?,
                };
                let xs = x.slice(r.row0 * x_cols..(r.row0 + r.n) * x_cols);
                let mut t = scratch.slice_mut(0..r.n * p.rank);
                // SAFETY: `xs` holds n × in, `at` in × rank, `t` n × rank elements.
                unsafe { self.blas.gemm(first, &p.at, &xs, &mut t) }
                    .map_err(dev("cuBLAS gemm (LoRA A)"))?;
                // Y[:, offset..offset + out] (+)= T · Bᵀ; column-major with ldc = y_width.
                let second = GemmConfig {
                    transa: cublasOperation_t::CUBLAS_OP_N,
                    transb: cublasOperation_t::CUBLAS_OP_N,
                    m: int(out)?,
                    n: int(r.n)?,
                    k: int(p.rank)?,
                    alpha: T::one(),
                    lda: int(out)?,
                    ldb: int(p.rank)?,
                    beta: T::one(),
                    ldc: int(y_width)?,
                };
                let start = r.row0 * y_width + offset;
                let end = (r.row0 + r.n - 1) * y_width + offset + out;
                let ts = scratch.slice(0..r.n * p.rank);
                let mut ys = y.slice_mut(start..end);
                // SAFETY: `bt` holds rank × out, `ts` n × rank; `ys` spans the n rows' `out`
                // columns at `offset` with stride `y_width`.
                unsafe { self.blas.gemm(second, &p.bt, &ts, &mut ys) }
                    .map_err(dev("cuBLAS gemm (LoRA B)"))?;
            }
        }
        Ok(())
    }

    /// The batch's adapters on the device (uploaded once, the least recently used dropped past
    /// [`MAX_DEVICE_LORAS`]), and the rows each runs on.
    pub(super) fn lora_rows(
        &mut self,
        batch: &[SeqStep<'_>],
    ) -> Result<Vec<LoraRows>, ComputeError> {
        self.steps += 1;
        let mut rows: Vec<LoraRows> = Vec::new();
        let mut row0 = 0;
        for s in batch {
            if let Some(a) = s.lora {
                self.upload_lora(a)?;
                // Sequences of one adapter side by side (the engine's scheduler puts them so)
                // are one run: two products for all their rows.
                match rows.last_mut() {
                    Some(r) if r.id == a.id && r.row0 + r.n == row0 => r.n += s.tokens.len(),
                    _ => rows.push(LoraRows {
                        row0,
                        n: s.tokens.len(),
                        id: a.id,
                        rank: a.rank,
                    }),
                }
            }
            row0 += s.tokens.len();
        }
        let bytes = |l: &std::collections::HashMap<u64, DevLora<T>>| -> usize {
            l.values().map(|d| d.bytes).sum()
        };
        while self.loras.len() > MAX_DEVICE_LORAS || bytes(&self.loras) > MAX_DEVICE_LORA_BYTES {
            let oldest = self
                .loras
                .iter()
                .filter(|(_, l)| l.used < self.steps)
                .min_by_key(|(_, l)| l.used)
                .map(|(id, _)| *id);
            match oldest {
                Some(id) => {
                    self.loras.remove(&id);
                }
                None => break,
            }
        }
        Ok(rows)
    }

    fn upload_lora(&mut self, a: &LoraAdapter) -> Result<(), ComputeError> {
        if let Some(l) = self.loras.get_mut(&a.id) {
            l.used = self.steps;
            return Ok(());
        }
        let up = |v: &[f32]| {
            self.stream
                .clone_htod(&T::from_host(&Host::F32(v.to_vec())))
                .map_err(dev("uploading a LoRA adapter"))
        };
        let mut layers = Vec::with_capacity(self.cfg.layers);
        for li in 0..self.cfg.layers {
            let mut per: [Option<DevPair<T>>; 7] = Default::default();
            for t in Target::ALL {
                if let Some(p) = a.pair(li, t) {
                    // The products index the device buffers by the model's shapes: a mismatch
                    // would read and write outside them, not panic, so it is refused here,
                    // before the adapter is kept.
                    let (inp, out) = t.dims(&self.cfg);
                    if p.at.len() != inp * p.rank || p.bt.len() != p.rank * out {
                        return Err(ComputeError::Invalid(format!(
                            "LoRA adapter for layer {li} {t:?} does not fit the model's {inp} x {out}"
                        )));
                    }
                    per[t as usize] = Some(DevPair {
                        rank: p.rank,
                        at: up(&p.at)?,
                        bt: up(&p.bt)?,
                    });
                }
            }
            layers.push(per);
        }
        self.loras.insert(
            a.id,
            DevLora {
                layers,
                used: self.steps,
                bytes: a.bytes() / 4 * std::mem::size_of::<T>(),
            },
        );
        Ok(())
    }
}
