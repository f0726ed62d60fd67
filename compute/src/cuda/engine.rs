//! The engine: one model on one GPU — its stream, cuBLAS handle and kernels, the weights
//! uploaded in their storage type, a paged KV cache per layer — and the [`Backend`] it
//! implements; with the pieces every part of a step uses: the cuBLAS product (`linear`),
//! RMSNorm, activation buffers, and binding the context to the calling thread.

use std::sync::Arc;

use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, PushKernelArg};

use super::kernels::{Funcs, grid};
use super::lora::DevLora;
use super::{DevFloat, dev, int};
use crate::backend::{Backend, ComputeError, KvShape, SeqStep, check_batch};
use crate::model::{DType, Host, Matrix, ModelConfig, ModelWeights};

pub(super) struct DevMatrix<T> {
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) w: CudaSlice<T>,
    pub(super) bias: Option<CudaSlice<f32>>,
}

pub(super) struct DevLayer<T> {
    pub(super) attn_norm: CudaSlice<f32>,
    pub(super) qkv: DevMatrix<T>,
    pub(super) o: DevMatrix<T>,
    pub(super) mlp_norm: CudaSlice<f32>,
    pub(super) gate_up: DevMatrix<T>,
    pub(super) down: DevMatrix<T>,
}

pub(super) struct Engine<T> {
    pub(super) cfg: ModelConfig,
    /// Adapters on the device, by [`LoraAdapter::id`](crate::model::lora::LoraAdapter::id).
    pub(super) loras: std::collections::HashMap<u64, DevLora<T>>,
    pub(super) steps: u64,
    pub(super) kv: KvShape,
    pub(super) ordinal: usize,
    pub(super) stream: Arc<CudaStream>,
    pub(super) blas: CudaBlas,
    pub(super) f: Funcs,
    pub(super) embed: CudaSlice<T>,
    pub(super) layers: Vec<DevLayer<T>>,
    pub(super) norm: CudaSlice<f32>,
    pub(super) lm_head: DevMatrix<T>,
    pub(super) inv_freq: CudaSlice<f32>,
    pub(super) k: Vec<CudaSlice<T>>,
    pub(super) v: Vec<CudaSlice<T>>,
}

impl<T: DevFloat> Engine<T>
where
    CudaBlas: Gemm<T>,
{
    pub(super) fn new(w: &ModelWeights, kv: KvShape, ordinal: usize) -> Result<Self, ComputeError> {
        let ctx = CudaContext::new(ordinal).map_err(dev("opening the GPU"))?;
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(dev("starting cuBLAS"))?;
        let f = Funcs::load(&ctx, T::DEFINE)?;
        let up_f32 = |v: &[f32]| stream.clone_htod(v).map_err(dev("uploading weights"));
        let up = |h: &Host| {
            stream
                .clone_htod(&T::from_host(h))
                .map_err(dev("uploading weights"))
        };
        let matrix = |m: &Matrix| -> Result<DevMatrix<T>, ComputeError> {
            Ok(DevMatrix {
                rows: m.rows,
                cols: m.cols,
                w: up(&m.data)?,
                bias: m.bias.as_deref().map(up_f32).transpose()?,
            })
        };
        let c = w.config.clone();
        let mut layers = Vec::with_capacity(c.layers);
        for l in &w.layers {
            layers.push(DevLayer {
                attn_norm: up_f32(&l.attn_norm)?,
                qkv: matrix(&l.qkv)?,
                o: matrix(&l.o)?,
                mlp_norm: up_f32(&l.mlp_norm)?,
                gate_up: matrix(&l.gate_up)?,
                down: matrix(&l.down)?,
            });
        }
        let per_layer = kv
            .num_blocks
            .checked_mul(kv.block_size * c.kv_heads * c.head_dim)
            .ok_or_else(|| ComputeError::Invalid("KV cache size overflows".into()))?;
        let mut k = Vec::with_capacity(c.layers);
        let mut v = Vec::with_capacity(c.layers);
        for _ in 0..c.layers {
            k.push(
                stream
                    .alloc_zeros::<T>(per_layer)
                    .map_err(dev("allocating the KV cache"))?,
            );
            v.push(
                stream
                    .alloc_zeros::<T>(per_layer)
                    .map_err(dev("allocating the KV cache"))?,
            );
        }
        Ok(Engine {
            loras: std::collections::HashMap::new(),
            steps: 0,
            embed: up(&w.embed)?,
            norm: up_f32(&w.norm)?,
            lm_head: matrix(&w.lm_head)?,
            inv_freq: up_f32(&c.inv_freq())?,
            layers,
            k,
            v,
            cfg: c,
            kv,
            ordinal,
            stream,
            blas,
            f,
        })
    }

    /// `y[t × rows] (+)= x[t × cols] · Wᵀ` (cuBLAS is column-major: `yᵀ = W · xᵀ`).
    pub(super) fn linear(
        &self,
        m: &DevMatrix<T>,
        x: &CudaSlice<T>,
        t: usize,
        y: &mut CudaSlice<T>,
        accumulate: bool,
    ) -> Result<(), ComputeError> {
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: int(m.rows)?,
            n: int(t)?,
            k: int(m.cols)?,
            alpha: T::one(),
            lda: int(m.cols)?,
            ldb: int(m.cols)?,
            beta: if accumulate { T::one() } else { T::zero() },
            ldc: int(m.rows)?,
        };
        // SAFETY: `x` holds t × cols and `y` t × rows elements (allocated so by the caller);
        // the weights hold rows × cols.
        unsafe { self.blas.gemm(cfg, &m.w, x, y) }.map_err(dev("cuBLAS gemm"))?;
        if let Some(b) = &m.bias {
            let mut l = self.stream.launch_builder(&self.f.add_bias);
            let cols = int(m.rows)?;
            l.arg(y).arg(b).arg(&cols);
            // SAFETY: y has t rows of `rows` columns; b has `rows` entries.
            unsafe { l.launch(grid(t, 256, 0)) }.map_err(dev("add_bias"))?;
        }
        Ok(())
    }

    pub(super) fn rmsnorm(
        &self,
        x: &CudaSlice<T>,
        w: &CudaSlice<f32>,
        out: &mut CudaSlice<T>,
        rows: usize,
    ) -> Result<(), ComputeError> {
        let h = int(self.cfg.hidden)?;
        let eps = self.cfg.rms_eps;
        let mut l = self.stream.launch_builder(&self.f.rmsnorm);
        l.arg(x).arg(w).arg(out).arg(&h).arg(&eps);
        // SAFETY: x and out hold rows × hidden, w hidden.
        unsafe { l.launch(grid(rows, 1024, 0)) }.map_err(dev("rmsnorm"))?;
        Ok(())
    }

    pub(super) fn alloc(&self, n: usize) -> Result<CudaSlice<T>, ComputeError> {
        self.stream
            .alloc_zeros::<T>(n.max(1))
            .map_err(dev("allocating activations"))
    }

    /// Make the context current on this thread: the backend is built on one thread and
    /// driven from the engine's, and cuBLAS calls use whatever context is current.
    pub(super) fn bind(&self) -> Result<(), ComputeError> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(dev("binding the CUDA context"))
    }
}

impl<T: DevFloat> Backend for Engine<T>
where
    CudaBlas: Gemm<T>,
{
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn forward(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<Vec<f32>>, ComputeError> {
        check_batch(batch, self.kv, &self.cfg)?;
        self.bind()?;
        self.step(batch)
    }

    fn lora(&self) -> bool {
        true
    }

    fn block_bytes(&self) -> usize {
        self.cfg.layers * 2 * self.block_elems() * std::mem::size_of::<T>()
    }

    fn export_block(&self, block: u32) -> Result<Vec<u8>, ComputeError> {
        if block as usize >= self.kv.num_blocks {
            return Err(ComputeError::Invalid(format!("no block {block}")));
        }
        self.bind()?;
        let be = self.block_elems();
        let range = block as usize * be..(block as usize + 1) * be;
        let mut out = Vec::with_capacity(self.block_bytes());
        for li in 0..self.cfg.layers {
            for cache in [&self.k[li], &self.v[li]] {
                let host = self
                    .stream
                    .clone_dtoh(&cache.slice(range.clone()))
                    .map_err(dev("reading a block"))?;
                out.extend(T::to_le(&host));
            }
        }
        Ok(out)
    }

    fn import_block(&mut self, block: u32, bytes: &[u8]) -> Result<(), ComputeError> {
        if bytes.len() != self.block_bytes() {
            return Err(ComputeError::Invalid(format!(
                "{} bytes for a block of {}",
                bytes.len(),
                self.block_bytes()
            )));
        }
        self.copy_blocks(&[block], Some(&[bytes])).map(|_| ())
    }

    fn export_blocks(&mut self, blocks: &[u32]) -> Result<Vec<Vec<u8>>, ComputeError> {
        self.copy_blocks(blocks, None)
    }

    fn import_blocks(&mut self, blocks: &[u32], data: &[&[u8]]) -> Result<(), ComputeError> {
        if blocks.len() != data.len() || data.iter().any(|d| d.len() != self.block_bytes()) {
            return Err(ComputeError::Invalid(format!(
                "{} blocks of {} bytes expected",
                blocks.len(),
                self.block_bytes()
            )));
        }
        self.copy_blocks(blocks, Some(data)).map(|_| ())
    }

    fn kv_dtype(&self) -> DType {
        T::DTYPE
    }

    fn describe(&self) -> String {
        format!("cuda:{} {} weights", self.ordinal, T::DTYPE.name())
    }
}
