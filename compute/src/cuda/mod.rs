//! The CUDA backend: the same forward pass as [`crate::cpu`], on an NVIDIA GPU through cudarc,
//! which loads the driver, cuBLAS and NVRTC at run time — a build needs no CUDA toolkit, and a
//! machine without a driver gets an error from [`load`], never a panic.
//!
//! Matrix products go to cuBLAS (fp32 products stay fp32: no TF32); everything else is a
//! handful of kernels compiled by NVRTC from `kernels.cu` at start-up for the weights' storage
//! type: embedding gather, RMSNorm, bias, rope plus the KV-cache write, paged attention over
//! block tables, SiLU·mul, row gather, and the KV block copy that stages blocks for export and
//! import. Activations and the KV cache are kept in the weights' type (f32, bf16 or f16); all
//! arithmetic inside kernels is f32. The residual additions ride on cuBLAS's `beta = 1`.
//!
//! LoRA adapters: each adapter's `Aᵀ` and scaled `Bᵀ` are uploaded once, in the weights' type
//! (the most recent [`MAX_DEVICE_LORAS`] kept); after each fused projection, each sequence
//! with an adapter gets two cuBLAS products on its own rows — its tokens are contiguous in the
//! batch — `T = X·Aᵀ`, then `Y[:, offset..] += T·Bᵀ` into its projection's columns of the fused
//! output (q/k/v, gate/up; o and down into the residual), before rope and the activation, as
//! the CPU backend adds them.

#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use half::{bf16, f16};

use crate::backend::{Backend, ComputeError, KvShape, SeqStep, check_batch};
use crate::model::lora::{LoraAdapter, Target};
use crate::model::{DType, Host, Matrix, ModelConfig, ModelWeights};

mod dtype;
mod kernels;

pub use dtype::DevFloat;
pub use kernels::compile_kernels;

use kernels::{Funcs, KERNELS, grid};

/// Scores scratch for attention is kept under this; longer batches attend in token chunks.
const SCORES_BYTES: usize = 512 << 20;

/// Adapters kept on the device, and their bytes at most; the least recently used beyond
/// either are dropped (an adapter of the current step never is).
const MAX_DEVICE_LORAS: usize = 32;
const MAX_DEVICE_LORA_BYTES: usize = 1 << 30;

fn dev<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> ComputeError {
    move |e| ComputeError::Device(format!("{what}: {e}"))
}

/// Whether a CUDA driver can be loaded here (checked before cudarc touches it: cudarc
/// panics when the library is absent).
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the shared library by its usual names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Start the backend on GPU `ordinal` with `w` in its own dtype (uploaded from the host
/// copy, which the caller keeps: a failed start can fall back to the CPU without reloading).
pub fn load(
    w: &ModelWeights,
    kv: KvShape,
    ordinal: usize,
) -> Result<Box<dyn Backend>, ComputeError> {
    if !driver_present() {
        return Err(ComputeError::Device(
            "no CUDA driver (libcuda) on this machine".into(),
        ));
    }
    // SAFETY: as above, for cuBLAS and NVRTC.
    let (blas, nvrtc) = unsafe {
        (
            cudarc::cublas::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
        )
    };
    if !blas || !nvrtc {
        return Err(ComputeError::Device(format!(
            "the CUDA driver is present but {} cannot be loaded (install the CUDA runtime libraries)",
            if blas { "NVRTC" } else { "cuBLAS" }
        )));
    }
    // Quantized GGUF matrices are widened to this dtype as they are uploaded.
    match w.dtype {
        DType::F32 => Ok(Box::new(Engine::<f32>::new(w, kv, ordinal)?)),
        DType::Bf16 => Ok(Box::new(Engine::<bf16>::new(w, kv, ordinal)?)),
        DType::F16 => Ok(Box::new(Engine::<f16>::new(w, kv, ordinal)?)),
    }
}

/// Device memory bandwidth in GB/s (bytes read plus written), measured by copying 1 GiB
/// device to device, best of three: the roofline for decode on GPU `ordinal`.
pub fn copy_bandwidth(ordinal: usize) -> Result<f64, ComputeError> {
    if !driver_present() {
        return Err(ComputeError::Device(
            "no CUDA driver (libcuda) on this machine".into(),
        ));
    }
    let ctx = CudaContext::new(ordinal).map_err(dev("opening the GPU"))?;
    let stream = ctx.default_stream();
    let n = 256 << 20; // u32s
    let src = stream.alloc_zeros::<u32>(n).map_err(dev("allocating"))?;
    let mut dst = stream.alloc_zeros::<u32>(n).map_err(dev("allocating"))?;
    let mut best: f64 = 0.0;
    for _ in 0..3 {
        stream.synchronize().map_err(dev("synchronizing"))?;
        let t = std::time::Instant::now();
        stream.memcpy_dtod(&src, &mut dst).map_err(dev("copying"))?;
        stream.synchronize().map_err(dev("synchronizing"))?;
        best = best.max(2.0 * (n * 4) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    Ok(best)
}

struct DevMatrix<T> {
    rows: usize,
    cols: usize,
    w: CudaSlice<T>,
    bias: Option<CudaSlice<f32>>,
}

struct DevLayer<T> {
    attn_norm: CudaSlice<f32>,
    qkv: DevMatrix<T>,
    o: DevMatrix<T>,
    mlp_norm: CudaSlice<f32>,
    gate_up: DevMatrix<T>,
    down: DevMatrix<T>,
}

/// One projection's adapter on the device: `Aᵀ` `[in, rank]` and `Bᵀ` `[rank, out]` (scale
/// folded in), row-major.
struct DevPair<T> {
    rank: usize,
    at: CudaSlice<T>,
    bt: CudaSlice<T>,
}

/// An adapter on the device, per layer and projection.
struct DevLora<T> {
    layers: Vec<[Option<DevPair<T>>; 7]>,
    /// The step it was last used in.
    used: u64,
    bytes: usize,
}

/// Rows `row0..row0 + n` of the step run with adapter `id` (whose largest rank is `rank`).
#[derive(Clone, Copy)]
struct LoraRows {
    row0: usize,
    n: usize,
    id: u64,
    rank: usize,
}

struct Engine<T> {
    cfg: ModelConfig,
    /// Adapters on the device, by [`LoraAdapter::id`].
    loras: std::collections::HashMap<u64, DevLora<T>>,
    steps: u64,
    kv: KvShape,
    ordinal: usize,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    f: Funcs,
    embed: CudaSlice<T>,
    layers: Vec<DevLayer<T>>,
    norm: CudaSlice<f32>,
    lm_head: DevMatrix<T>,
    inv_freq: CudaSlice<f32>,
    k: Vec<CudaSlice<T>>,
    v: Vec<CudaSlice<T>>,
}

/// A batch laid out on the host as the kernels read it.
struct Layout {
    /// Per token: id, position, its cache block, its sequence.
    ids: Vec<u32>,
    pos: Vec<i32>,
    blk: Vec<i32>,
    seq: Vec<i32>,
    /// Per sequence: its block table, all of them end to end, and where each starts.
    tables: Vec<i32>,
    table_off: Vec<i32>,
    /// The tokens whose logits are returned: the last of each sequence that asks (all of its
    /// new tokens where it asks for all).
    rows: Vec<i32>,
    /// Per row: its final hidden state is returned instead ([`SeqStep::hidden`]).
    hidden: Vec<bool>,
    /// The longest context in the batch (at least 1), which sizes the attention scratch.
    max_ctx: usize,
}

impl Layout {
    fn of(batch: &[SeqStep<'_>], bs: usize) -> Result<Self, ComputeError> {
        let (mut ids, mut pos, mut blk, mut seq) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut tables, mut table_off, mut rows) = (Vec::new(), Vec::new(), Vec::new());
        let mut hidden = Vec::new();
        let mut max_ctx = 1;
        for (si, s) in batch.iter().enumerate() {
            table_off.push(int(tables.len())?);
            for &b in s.blocks {
                tables.push(int(b as usize)?);
            }
            for (j, &tok) in s.tokens.iter().enumerate() {
                let p = s.start + j;
                ids.push(tok);
                pos.push(int(p)?);
                blk.push(int(s.blocks[p / bs] as usize)?);
                seq.push(int(si)?);
            }
            max_ctx = max_ctx.max(s.start + s.tokens.len());
            if s.logits {
                let first = if s.all_logits { s.tokens.len() } else { 1 };
                for back in (1..=first).rev() {
                    rows.push(int(ids.len() - back)?);
                    hidden.push(s.hidden);
                }
            }
        }
        Ok(Layout {
            ids,
            pos,
            blk,
            seq,
            tables,
            table_off,
            rows,
            hidden,
            max_ctx,
        })
    }
}

/// One step on the device: the batch's layout, the activations of its `t` tokens (`x` is the
/// residual stream) and the attention scores scratch.
struct Step<T> {
    t: usize,
    ids: CudaSlice<u32>,
    pos: CudaSlice<i32>,
    blk: CudaSlice<i32>,
    seq: CudaSlice<i32>,
    tables: CudaSlice<i32>,
    table_off: CudaSlice<i32>,
    x: CudaSlice<T>,
    normed: CudaSlice<T>,
    qkv: CudaSlice<T>,
    attn: CudaSlice<T>,
    gu: CudaSlice<T>,
    act: CudaSlice<T>,
    /// Tokens per attention launch: their scores fit `scores`, kept under [`SCORES_BYTES`].
    chunk: usize,
    scores: CudaSlice<f32>,
    /// The runs of rows with an adapter, and the scratch of the largest run's `X·Aᵀ`.
    lora: Vec<LoraRows>,
    lora_scratch: CudaSlice<T>,
}

/// The attention kernels' scalar arguments, the same for every layer of a step.
struct AttnArgs {
    heads: i32,
    kvh: i32,
    di: i32,
    bsi: i32,
    scale: f32,
    window: i32,
    mctx: i32,
}

fn int(n: usize) -> Result<i32, ComputeError> {
    i32::try_from(n)
        .map_err(|_| ComputeError::Invalid(format!("{n} does not fit a kernel argument")))
}

impl<T: DevFloat> Engine<T>
where
    CudaBlas: Gemm<T>,
{
    fn new(w: &ModelWeights, kv: KvShape, ordinal: usize) -> Result<Self, ComputeError> {
        let ctx = CudaContext::new(ordinal).map_err(dev("opening the GPU"))?;
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(dev("starting cuBLAS"))?;
        let src = format!("{}{KERNELS}", T::DEFINE);
        let ptx = cudarc::nvrtc::compile_ptx(src).map_err(dev("compiling the kernels"))?;
        let module = ctx.load_module(ptx).map_err(dev("loading the kernels"))?;
        let func = |name: &str| module.load_function(name).map_err(dev("loading a kernel"));
        let f = Funcs {
            embedding: func("embedding")?,
            rmsnorm: func("rmsnorm")?,
            add_bias: func("add_bias")?,
            rope_store: func("rope_store")?,
            paged_attention: func("paged_attention")?,
            silu_mul: func("silu_mul")?,
            gather_rows: func("gather_rows")?,
            kv_block_copy: func("kv_block_copy")?,
            to_f32: func("to_f32")?,
            _module: module.clone(),
        };
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
    fn linear(
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

    /// For each sequence in `rows` whose adapter changes `targets` of layer `li`:
    /// `y[its rows, offset..offset + out] += (x[its rows] · Aᵀ) · Bᵀ`, where `x` has `x_cols`
    /// columns and `y` rows of `y_width` (a fused projection's output, or the residual).
    #[allow(clippy::too_many_arguments)]
    fn add_lora(
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
    fn lora_rows(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<LoraRows>, ComputeError> {
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

    fn rmsnorm(
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

    fn alloc(&self, n: usize) -> Result<CudaSlice<T>, ComputeError> {
        self.stream
            .alloc_zeros::<T>(n.max(1))
            .map_err(dev("allocating activations"))
    }

    /// One forward pass over the batch: embed, every layer, then the logits asked for.
    fn step(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<Vec<f32>>, ComputeError> {
        let layout = Layout::of(batch, self.kv.block_size)?;
        if layout.ids.is_empty() {
            return Ok(Vec::new());
        }
        let lora = self.lora_rows(batch)?;
        // The largest run's `X·Aᵀ`.
        let rank = lora.iter().map(|r| r.rank * r.n).max().unwrap_or(1);
        let mut s = self.upload(&layout)?;
        s.lora = lora;
        s.lora_scratch = self.alloc(rank)?;
        self.embed(&s)?;
        let a = self.attn_args(layout.max_ctx)?;
        for li in 0..self.cfg.layers {
            self.layer(li, &mut s, &a)?;
        }
        if layout.rows.is_empty() {
            return Ok(Vec::new());
        }
        if !layout.hidden.contains(&true) {
            return self.logits(&s.x, &layout.rows);
        }
        // Hidden states for the rows that asked, logits for the others, in row order.
        let pick = |want: bool| -> Vec<i32> {
            layout
                .rows
                .iter()
                .zip(&layout.hidden)
                .filter(|(_, h)| **h == want)
                .map(|(r, _)| *r)
                .collect()
        };
        let (logit_rows, hidden_rows) = (pick(false), pick(true));
        let mut logits = match logit_rows.is_empty() {
            true => Vec::new(),
            false => self.logits(&s.x, &logit_rows)?,
        }
        .into_iter();
        let mut states = self.hidden_states(&s.x, &hidden_rows)?.into_iter();
        layout
            .hidden
            .iter()
            .map(|h| match h {
                true => states.next(),
                false => logits.next(),
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ComputeError::Device("fewer rows came back than were asked".into()))
    }

    /// The batch's layout on the device, and the step's activations and attention scratch.
    fn upload(&self, layout: &Layout) -> Result<Step<T>, ComputeError> {
        let c = &self.cfg;
        let h = c.hidden;
        let width = (c.heads + 2 * c.kv_heads) * c.head_dim;
        let t = layout.ids.len();
        let up = |v: &[i32]| {
            self.stream
                .clone_htod(v)
                .map_err(dev("uploading the batch"))
        };
        let ids = self
            .stream
            .clone_htod(&layout.ids)
            .map_err(dev("uploading the batch"))?;
        let (pos, blk, seq) = (up(&layout.pos)?, up(&layout.blk)?, up(&layout.seq)?);
        let (tables, table_off) = (up(&layout.tables)?, up(&layout.table_off)?);
        let x = self.alloc(t * h)?;
        let normed = self.alloc(t * h)?;
        let qkv = self.alloc(t * width)?;
        let attn = self.alloc(t * c.heads * c.head_dim)?;
        let gu = self.alloc(t * 2 * c.intermediate)?;
        let act = self.alloc(t * c.intermediate)?;
        let chunk = (SCORES_BYTES / (4 * c.heads * layout.max_ctx)).clamp(1, t);
        let scores = self
            .stream
            .alloc_zeros::<f32>(chunk * c.heads * layout.max_ctx)
            .map_err(dev("allocating attention scratch"))?;
        Ok(Step {
            t,
            ids,
            pos,
            blk,
            seq,
            tables,
            table_off,
            x,
            normed,
            qkv,
            attn,
            gu,
            act,
            chunk,
            scores,
            lora: Vec::new(),
            lora_scratch: self.alloc(1)?,
        })
    }

    /// The tokens' embeddings into the residual stream `x`.
    fn embed(&self, s: &Step<T>) -> Result<(), ComputeError> {
        let hid = int(self.cfg.hidden)?;
        let mut l = self.stream.launch_builder(&self.f.embedding);
        l.arg(&self.embed).arg(&s.ids).arg(&s.x).arg(&hid);
        // SAFETY: ids are checked to be inside the vocabulary (check_batch).
        unsafe { l.launch(grid(s.t, 256, 0)) }.map_err(dev("embedding"))?;
        Ok(())
    }

    fn attn_args(&self, max_ctx: usize) -> Result<AttnArgs, ComputeError> {
        let c = &self.cfg;
        let d = c.head_dim;
        Ok(AttnArgs {
            heads: int(c.heads)?,
            kvh: int(c.kv_heads)?,
            di: int(d)?,
            bsi: int(self.kv.block_size)?,
            scale: 1.0 / (d as f32).sqrt(),
            window: int(c.sliding_window.unwrap_or(0))?,
            mctx: int(max_ctx)?,
        })
    }

    /// Transformer layer `li`: attention, then the MLP, each added to the residual stream.
    fn layer(&self, li: usize, s: &mut Step<T>, a: &AttnArgs) -> Result<(), ComputeError> {
        self.attention(li, s, a)?;
        self.mlp(li, s)
    }

    fn attention(&self, li: usize, s: &mut Step<T>, a: &AttnArgs) -> Result<(), ComputeError> {
        let layer = &self.layers[li];
        let c = &self.cfg;
        let (h, qd, kvd) = (c.hidden, c.heads * c.head_dim, c.kv_heads * c.head_dim);
        self.rmsnorm(&s.x, &layer.attn_norm, &mut s.normed, s.t)?;
        self.linear(&layer.qkv, &s.normed, s.t, &mut s.qkv, false)?;
        if !s.lora.is_empty() {
            let qkv = [(Target::Q, 0), (Target::K, qd), (Target::V, qd + kvd)];
            let width = qd + 2 * kvd;
            self.add_lora(
                li,
                &qkv,
                &s.lora,
                &s.normed,
                h,
                &mut s.qkv,
                width,
                &mut s.lora_scratch,
            )?;
        }
        self.rope_store(li, s, a)?;
        self.paged_attention(li, s, a)?;
        self.linear(&layer.o, &s.attn, s.t, &mut s.x, true)?;
        if !s.lora.is_empty() {
            let o = [(Target::O, 0)];
            self.add_lora(
                li,
                &o,
                &s.lora,
                &s.attn,
                qd,
                &mut s.x,
                h,
                &mut s.lora_scratch,
            )?;
        }
        Ok(())
    }

    /// Rope on the tokens' q and k, then their k and v into layer `li`'s cache: the cache
    /// holds them before attention reads it.
    fn rope_store(&self, li: usize, s: &Step<T>, a: &AttnArgs) -> Result<(), ComputeError> {
        let mut l = self.stream.launch_builder(&self.f.rope_store);
        l.arg(&s.qkv).arg(&s.pos).arg(&s.blk).arg(&self.inv_freq);
        l.arg(&self.k[li])
            .arg(&self.v[li])
            .arg(&a.heads)
            .arg(&a.kvh)
            .arg(&a.di)
            .arg(&a.bsi);
        // SAFETY: every token's block id is inside the cache (check_batch).
        unsafe { l.launch(grid(s.t, 512, 0)) }.map_err(dev("rope_store"))?;
        Ok(())
    }

    /// Attention of every token over its sequence's cache through the block tables, `chunk`
    /// tokens per launch so that their scores fit the scratch.
    fn paged_attention(
        &self,
        li: usize,
        s: &mut Step<T>,
        a: &AttnArgs,
    ) -> Result<(), ComputeError> {
        let c = &self.cfg;
        let (t, d, chunk) = (s.t, c.head_dim, s.chunk);
        let width = (c.heads + 2 * c.kv_heads) * d;
        for t0 in (0..t).step_by(chunk) {
            let n = chunk.min(t - t0);
            let q_in = s.qkv.slice(t0 * width..(t0 + n) * width);
            let mut out = s.attn.slice_mut(t0 * c.heads * d..(t0 + n) * c.heads * d);
            let (p, sq) = (s.pos.slice(t0..t0 + n), s.seq.slice(t0..t0 + n));
            let mut l = self.stream.launch_builder(&self.f.paged_attention);
            l.arg(&q_in).arg(&mut out).arg(&self.k[li]).arg(&self.v[li]);
            l.arg(&p)
                .arg(&sq)
                .arg(&s.tables)
                .arg(&s.table_off)
                .arg(&mut s.scores)
                .arg(&a.mctx);
            l.arg(&a.heads)
                .arg(&a.kvh)
                .arg(&a.di)
                .arg(&a.bsi)
                .arg(&a.scale)
                .arg(&a.window);
            let cfg = LaunchConfig {
                grid_dim: (n as u32, c.heads as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: (d * 4) as u32,
            };
            // SAFETY: block tables cover every position attended (check_batch); the
            // scratch holds n × heads × max_ctx scores.
            unsafe { l.launch(cfg) }.map_err(dev("paged_attention"))?;
        }
        Ok(())
    }

    fn mlp(&self, li: usize, s: &mut Step<T>) -> Result<(), ComputeError> {
        let layer = &self.layers[li];
        let (h, inter) = (self.cfg.hidden, self.cfg.intermediate);
        self.rmsnorm(&s.x, &layer.mlp_norm, &mut s.normed, s.t)?;
        self.linear(&layer.gate_up, &s.normed, s.t, &mut s.gu, false)?;
        if !s.lora.is_empty() {
            // Before the activation, as the CPU backend adds them.
            let gu = [(Target::Gate, 0), (Target::Up, inter)];
            self.add_lora(
                li,
                &gu,
                &s.lora,
                &s.normed,
                h,
                &mut s.gu,
                2 * inter,
                &mut s.lora_scratch,
            )?;
        }
        {
            let inter = int(self.cfg.intermediate)?;
            let mut l = self.stream.launch_builder(&self.f.silu_mul);
            l.arg(&s.gu).arg(&mut s.act).arg(&inter);
            let cfg = LaunchConfig {
                grid_dim: (s.t as u32, self.cfg.intermediate.div_ceil(256) as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: gu holds t × 2·inter, act t × inter; the kernel skips i ≥ inter.
            unsafe { l.launch(cfg) }.map_err(dev("silu_mul"))?;
        }
        self.linear(&layer.down, &s.act, s.t, &mut s.x, true)?;
        if !s.lora.is_empty() {
            let down = [(Target::Down, 0)];
            self.add_lora(
                li,
                &down,
                &s.lora,
                &s.act,
                inter,
                &mut s.x,
                h,
                &mut s.lora_scratch,
            )?;
        }
        Ok(())
    }

    /// The final-norm hidden states of the tokens in `rows`, on the device (`rows` × `hidden`).
    fn normed_rows(&self, x: &CudaSlice<T>, rows: &[i32]) -> Result<CudaSlice<T>, ComputeError> {
        let h = self.cfg.hidden;
        let r = rows.len();
        let d_rows = self
            .stream
            .clone_htod(rows)
            .map_err(dev("uploading the batch"))?;
        let mut last = self.alloc(r * h)?;
        {
            let hid = int(h)?;
            let mut l = self.stream.launch_builder(&self.f.gather_rows);
            l.arg(x).arg(&d_rows).arg(&mut last).arg(&hid);
            // SAFETY: rows index tokens of this batch.
            unsafe { l.launch(grid(r, 256, 0)) }.map_err(dev("gather_rows"))?;
        }
        let mut last_n = self.alloc(r * h)?;
        self.rmsnorm(&last, &self.norm, &mut last_n, r)?;
        Ok(last_n)
    }

    /// `n` elements of `v` read back as f32, in rows of `width`.
    fn host_rows(
        &self,
        v: &CudaSlice<T>,
        n: usize,
        width: usize,
    ) -> Result<Vec<Vec<f32>>, ComputeError> {
        let mut out = self
            .stream
            .alloc_zeros::<f32>(n)
            .map_err(dev("allocating the output"))?;
        {
            let ni = int(n)?;
            let mut l = self.stream.launch_builder(&self.f.to_f32);
            l.arg(v).arg(&mut out).arg(&ni);
            // SAFETY: both hold n elements.
            unsafe { l.launch(grid(n.div_ceil(256), 256, 0)) }.map_err(dev("to_f32"))?;
        }
        let host = self
            .stream
            .clone_dtoh(&out)
            .map_err(dev("reading the output"))?;
        Ok(host.chunks_exact(width).map(<[f32]>::to_vec).collect())
    }

    /// Next-token logits of the tokens in `rows`: only their hidden states are normed and
    /// projected to the vocabulary, then read back as f32, one row per token.
    fn logits(&self, x: &CudaSlice<T>, rows: &[i32]) -> Result<Vec<Vec<f32>>, ComputeError> {
        let c = &self.cfg;
        let r = rows.len();
        let last_n = self.normed_rows(x, rows)?;
        let mut logits = self.alloc(r * c.vocab)?;
        self.linear(&self.lm_head, &last_n, r, &mut logits, false)?;
        self.host_rows(&logits, r * c.vocab, c.vocab)
    }

    /// The final hidden states (after the model's last norm) of the tokens in `rows`, read
    /// back as f32: what embeddings are pooled from.
    fn hidden_states(&self, x: &CudaSlice<T>, rows: &[i32]) -> Result<Vec<Vec<f32>>, ComputeError> {
        let h = self.cfg.hidden;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let last_n = self.normed_rows(x, rows)?;
        self.host_rows(&last_n, rows.len() * h, h)
    }

    /// Make the context current on this thread: the backend is built on one thread and
    /// driven from the engine's, and cuBLAS calls use whatever context is current.
    fn bind(&self) -> Result<(), ComputeError> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(dev("binding the CUDA context"))
    }

    fn block_elems(&self) -> usize {
        self.cfg.kv_heads * self.kv.block_size * self.cfg.head_dim
    }

    /// Gather (export) or scatter (import) `ids`' blocks through a staging buffer with the
    /// block copy kernel: one launch and one transfer per layer and K/V, not one per block.
    fn copy_blocks(
        &mut self,
        ids: &[u32],
        data: Option<&[&[u8]]>,
    ) -> Result<Vec<Vec<u8>>, ComputeError> {
        self.bind()?;
        let be = self.block_elems();
        let n = ids.len();
        if let Some(b) = ids.iter().find(|b| **b as usize >= self.kv.num_blocks) {
            return Err(ComputeError::Invalid(format!("no block {b}")));
        }
        let ids_i: Vec<i32> = ids
            .iter()
            .map(|b| int(*b as usize))
            .collect::<Result<_, _>>()?;
        let d_ids = self
            .stream
            .clone_htod(&ids_i)
            .map_err(dev("uploading block ids"))?;
        let mut out = vec![Vec::with_capacity(self.block_bytes()); n];
        let size = std::mem::size_of::<T>();
        let bei = int(be)?;
        for li in 0..self.cfg.layers {
            for which in 0..2 {
                let mut staging = match data {
                    Some(blocks) => {
                        let mut host = Vec::with_capacity(n * be);
                        for b in blocks {
                            let at = (2 * li + which) * be * size;
                            host.extend(T::from_le(&b[at..at + be * size]));
                        }
                        self.stream
                            .clone_htod(&host)
                            .map_err(dev("staging blocks"))?
                    }
                    None => self.alloc(n * be)?,
                };
                let to_cache = i32::from(data.is_some());
                let cache = if which == 0 {
                    &mut self.k[li]
                } else {
                    &mut self.v[li]
                };
                let mut l = self.stream.launch_builder(&self.f.kv_block_copy);
                l.arg(cache)
                    .arg(&mut staging)
                    .arg(&d_ids)
                    .arg(&bei)
                    .arg(&to_cache);
                // SAFETY: ids are inside the cache (checked above); staging holds n blocks.
                unsafe { l.launch(grid(n, 256, 0)) }.map_err(dev("kv_block_copy"))?;
                if data.is_none() {
                    let host = self
                        .stream
                        .clone_dtoh(&staging)
                        .map_err(dev("reading blocks"))?;
                    for (i, o) in out.iter_mut().enumerate() {
                        o.extend(T::to_le(&host[i * be..(i + 1) * be]));
                    }
                }
            }
        }
        if data.is_some() {
            self.stream.synchronize().map_err(dev("importing blocks"))?;
        }
        Ok(out)
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
