//! The CPU backend: the Llama-family forward pass over a paged KV cache, with matrix
//! products on weights packed at load time for register-blocked SIMD kernels (decode) and
//! the `gemm` crate's microkernels (prefill), and the work spread by rayon.
//!
//! A step flattens the new tokens of every sequence into one `[tokens, hidden]` activation, so
//! the projections and the MLP are one matrix product each per layer for the whole batch
//! (weights read once per step). Attention runs per (sequence, KV head) in parallel. A
//! sequence with a few new tokens (decode) reads its keys and values where they lie in its
//! blocks; a longer chunk (prefill) gathers them and multiplies the query heads sharing that
//! KV head against them in query tiles (two more matrix products). The causal mask (and a
//! sliding window, for mistral) is applied between the two.
//!
//! The cache keeps the weights' precision ([`kv`] has its layout). LoRA adapters are added
//! per token row after (inside, for the gated MLP) the base's products ([`lora`]).

mod attn;
mod columns;
pub mod gemm;
mod kv;
pub mod linear;
mod lora;
pub(crate) mod math;
pub mod panel;

use rayon::prelude::*;

use crate::backend::{Backend, ComputeError, KvShape, SeqStep, check_batch};
use crate::model::lora::Target;
use crate::model::{DType, Host, ModelConfig, ModelWeights};
use columns::by_bands;
use kv::{Geometry, KvCache, on_cache};
use linear::{Linear, Write};

struct Layer {
    attn_norm: Vec<f32>,
    qkv: Linear,
    o: Linear,
    mlp_norm: Vec<f32>,
    /// `[gate; up]`, giving the gated activation directly.
    gate_up: Linear,
    down: Linear,
}

/// Buffers reused from step to step.
#[derive(Default)]
struct Buffers {
    x: Vec<f32>,
    normed: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    act: Vec<f32>,
    /// LoRA's additions to the gate and up products, before the activation.
    pre: Vec<f32>,
    logits: Vec<f32>,
    linear: linear::Scratch,
}

pub struct CpuBackend {
    cfg: ModelConfig,
    embed: Host,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Linear,
    inv_freq: Vec<f32>,
    kv: KvShape,
    cache: KvCache,
    /// The weights' dtype, which the cache keeps too.
    dtype: DType,
    /// The types of the matrices kept quantized (a GGUF file's), if any.
    quantized: Vec<crate::quant::QType>,
    buf: Buffers,
    /// The step runs inside this pool: its parallel loops are then forks from a worker that
    /// stays awake between them, not one wake-up of a sleeping pool per matrix product.
    pool: std::sync::Arc<rayon::ThreadPool>,
}

impl CpuBackend {
    pub fn new(w: ModelWeights, kv: KvShape) -> Result<Self, ComputeError> {
        Self::with_threads(w, kv, 0)
    }

    /// `threads` 0: one per core.
    pub fn with_threads(
        w: ModelWeights,
        kv: KvShape,
        threads: usize,
    ) -> Result<Self, ComputeError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("dyn-cpu-{i}"))
            .build()
            .map_err(|e| ComputeError::Device(format!("cannot start compute threads: {e}")))?;
        let c = w.config.clone();
        let per_layer = kv
            .num_blocks
            .checked_mul(kv.block_size * c.kv_heads * c.head_dim)
            .ok_or_else(|| ComputeError::Invalid("KV cache size overflows".into()))?;
        let dtype = w.dtype;
        let mut quantized: Vec<crate::quant::QType> = [&w.lm_head]
            .into_iter()
            .chain(
                w.layers
                    .iter()
                    .flat_map(|l| [&l.qkv, &l.o, &l.gate_up, &l.down]),
            )
            .filter_map(|m| match &m.data {
                Host::Quant(q) => Some(q.types()),
                _ => None,
            })
            .flatten()
            .collect();
        quantized.sort_unstable();
        quantized.dedup();
        Ok(CpuBackend {
            inv_freq: c.inv_freq(),
            embed: w.embed,
            layers: w
                .layers
                .into_iter()
                .map(|l| Layer {
                    attn_norm: l.attn_norm,
                    qkv: Linear::new(l.qkv),
                    o: Linear::new(l.o),
                    mlp_norm: l.mlp_norm,
                    gate_up: Linear::gated(l.gate_up),
                    down: Linear::new(l.down),
                })
                .collect(),
            norm: w.norm,
            lm_head: Linear::new(w.lm_head),
            quantized,
            cache: KvCache::new(dtype, c.layers, per_layer),
            kv,
            cfg: c,
            dtype,
            buf: Buffers::default(),
            pool: std::sync::Arc::new(pool),
        })
    }

    /// One forward pass (on a pool thread).
    fn step(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<Vec<f32>>, ComputeError> {
        let c = &self.cfg;
        let (h, d, geo) = (c.hidden, c.head_dim, self.geometry());
        let (qd, kvd) = (c.heads * d, c.kv_heads * d);
        let width = qd + 2 * kvd;
        let t: usize = batch.iter().map(|s| s.tokens.len()).sum();
        if t == 0 {
            return Ok(Vec::new());
        }
        // Token i of the flattened batch: its sequence and position.
        let mut owner = Vec::with_capacity(t);
        let mut offsets = Vec::with_capacity(batch.len());
        for (si, s) in batch.iter().enumerate() {
            offsets.push(owner.len());
            owner.extend((0..s.tokens.len()).map(|j| (si, s.start + j)));
        }
        let b = &mut self.buf;
        b.x.resize(t * h, 0.0);
        for (row, tok) in
            b.x.chunks_exact_mut(h)
                .zip(batch.iter().flat_map(|s| s.tokens))
        {
            self.embed.row_f32(*tok as usize, row);
        }
        b.normed.resize(t * h, 0.0);
        b.qkv.resize(t * width, 0.0);
        b.attn.resize(t * qd, 0.0);
        b.act.resize(t * c.intermediate, 0.0);
        // Each token's rotation (cos, sin per frequency), shared by every head and layer.
        let turns: Vec<(f32, f32)> = owner
            .iter()
            .flat_map(|&(_, pos)| {
                self.inv_freq
                    .iter()
                    .map(move |f| (pos as f32 * f).sin_cos())
            })
            .map(|(sin, cos)| (cos, sin))
            .collect();
        let half = self.inv_freq.len();
        let lora = lora::Rows::of(batch);
        let i = c.intermediate;
        for (li, layer) in self.layers.iter().enumerate() {
            rmsnorm(&b.x, &layer.attn_norm, c.rms_eps, &mut b.normed);
            layer
                .qkv
                .forward(&b.normed, t, &mut b.qkv, Write::Set, &mut b.linear);
            for (target, at) in [(Target::Q, 0), (Target::K, qd), (Target::V, qd + kvd)] {
                lora.add(li, target, &b.normed, h, &mut b.qkv, width, at);
            }
            // Rope on q and k (rows in parallel for prefill), then store k and v in the
            // token's cache slot.
            b.qkv
                .par_chunks_exact_mut(width)
                .zip(turns.par_chunks_exact(half))
                .with_min_len(PAR_FLOATS / width + 1)
                .for_each(|(row, turns)| rope(&mut row[..qd + kvd], d, turns));
            let attn = &mut b.attn;
            let qkv = &b.qkv;
            on_cache!(&mut self.cache, cache => {
                cache.store(li, geo, batch, &owner, qkv, width, qd, qd + kvd);
                attention(c, geo, batch, &offsets, qkv, &cache.k[li], &cache.v[li], attn);
            });
            // The residual adds happen as the products are written.
            layer
                .o
                .forward(&b.attn, t, &mut b.x, Write::Add, &mut b.linear);
            lora.add(li, Target::O, &b.attn, qd, &mut b.x, h, 0);
            rmsnorm(&b.x, &layer.mlp_norm, c.rms_eps, &mut b.normed);
            let pre = (lora.changes(li, Target::Gate) || lora.changes(li, Target::Up)).then(|| {
                b.pre.clear();
                b.pre.resize(t * 2 * i, 0.0);
                lora.add(li, Target::Gate, &b.normed, h, &mut b.pre, 2 * i, 0);
                lora.add(li, Target::Up, &b.normed, h, &mut b.pre, 2 * i, i);
                &b.pre[..]
            });
            layer
                .gate_up
                .forward_pre(&b.normed, t, &mut b.act, Write::Set, &mut b.linear, pre);
            layer
                .down
                .forward(&b.act, t, &mut b.x, Write::Add, &mut b.linear);
            lora.add(li, Target::Down, &b.act, i, &mut b.x, h, 0);
        }
        // Logits only for the last new token of the sequences that asked (every new token of
        // those that asked for all); hidden states instead for those that asked for them.
        let rows: Vec<(usize, bool)> = batch
            .iter()
            .zip(&offsets)
            .filter(|(s, _)| s.logits)
            .flat_map(|(s, o)| {
                let first = if s.all_logits { 0 } else { s.tokens.len() - 1 };
                (o + first..o + s.tokens.len()).map(|r| (r, s.hidden))
            })
            .collect();
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let last: Vec<f32> = rows
            .iter()
            .flat_map(|(r, _)| b.x[r * h..(r + 1) * h].iter().copied())
            .collect();
        let mut normed = vec![0.0; last.len()];
        rmsnorm(&last, &self.norm, c.rms_eps, &mut normed);
        if rows.iter().all(|(_, hidden)| *hidden) {
            return Ok(normed.chunks_exact(h).map(<[f32]>::to_vec).collect());
        }
        // The vocabulary projection for the logits rows only (a hidden row would cost a
        // vocabulary of floats for nothing).
        let mut projected = Vec::with_capacity(normed.len());
        for (row, (_, hidden)) in normed.chunks_exact(h).zip(&rows) {
            if !hidden {
                projected.extend_from_slice(row);
            }
        }
        let n = projected.len() / h;
        b.logits.resize(n * c.vocab, 0.0);
        self.lm_head
            .forward(&projected, n, &mut b.logits, Write::Set, &mut b.linear);
        let mut logits = b.logits.chunks_exact(c.vocab);
        Ok(normed
            .chunks_exact(h)
            .zip(&rows)
            .map(|(row, (_, hidden))| match hidden {
                true => row.to_vec(),
                false => logits.next().map(<[f32]>::to_vec).unwrap_or_default(),
            })
            .collect())
    }

    fn geometry(&self) -> Geometry {
        Geometry {
            bs: self.kv.block_size,
            d: self.cfg.head_dim,
            kv_heads: self.cfg.kv_heads,
        }
    }
}

/// Attention of every sequence's new tokens over layer cache `kc`/`vc` into `out`
/// (`[tokens, heads · d]`): per sequence (its rows of `out` are contiguous) and per KV head
/// (a band of those rows: the query heads sharing it), in parallel.
#[allow(clippy::too_many_arguments)]
fn attention<T: kv::Elem>(
    c: &ModelConfig,
    geo: Geometry,
    batch: &[SeqStep<'_>],
    offsets: &[usize],
    qkv: &[f32],
    kc: &[T],
    vc: &[T],
    out: &mut [f32],
) {
    let qd = c.heads * c.head_dim;
    let mut parts = Vec::with_capacity(batch.len());
    let mut rest = out;
    for s in batch {
        let (mine, tail) = rest.split_at_mut(s.tokens.len() * qd);
        parts.push((s, mine));
        rest = tail;
    }
    parts
        .into_par_iter()
        .zip(offsets)
        .filter(|((s, _), _)| !s.tokens.is_empty())
        .for_each(|((s, rows), &offset)| {
            by_bands(
                rows,
                s.tokens.len(),
                qd,
                c.group() * c.head_dim,
                |g, band| attn::attend(c, geo.bs, s, offset, g, qkv, kc, vc, band),
            )
        });
}

/// Element-wise work runs in parallel in tasks of at least this many floats; below that a
/// fork-join costs more than it saves (a decode step's rows stay on one thread).
const PAR_FLOATS: usize = 1 << 15;

/// Rows in parallel for prefill-sized steps.
fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let h = w.len();
    x.par_chunks_exact(h)
        .zip(out.par_chunks_exact_mut(h))
        .with_min_len(PAR_FLOATS / h + 1)
        .for_each(|(row, o)| {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / h as f32;
            let r = 1.0 / (ms + eps).sqrt();
            for ((o, v), g) in o.iter_mut().zip(row).zip(w) {
                *o = g * (v * r);
            }
        });
}

/// Rotate each head of `row` (heads of `d` dims back to back) by the token's `(cos, sin)`
/// per frequency, halves style.
fn rope(row: &mut [f32], d: usize, turns: &[(f32, f32)]) {
    let half = d / 2;
    for head in row.chunks_exact_mut(d) {
        let (a, b) = head.split_at_mut(half);
        for ((x1, x2), &(cos, sin)) in a.iter_mut().zip(b.iter_mut()).zip(turns) {
            let (u, v) = (*x1, *x2);
            *x1 = u * cos - v * sin;
            *x2 = v * cos + u * sin;
        }
    }
}

impl Backend for CpuBackend {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn forward(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<Vec<f32>>, ComputeError> {
        check_batch(batch, self.kv, &self.cfg)?;
        let pool = self.pool.clone();
        pool.install(|| self.step(batch))
    }

    fn block_bytes(&self) -> usize {
        self.cfg.layers * 2 * self.geometry().block_elems() * self.dtype.size()
    }

    fn export_blocks_packed(&mut self, blocks: &[u32]) -> Result<Vec<u8>, ComputeError> {
        let bb = self.block_bytes();
        if let Some(b) = blocks.iter().find(|&&b| b as usize >= self.kv.num_blocks) {
            return Err(ComputeError::Invalid(format!("no block {b}")));
        }
        let geo = self.geometry();
        let mut out = vec![0u8; blocks.len() * bb];
        for (b, dst) in blocks.iter().zip(out.chunks_exact_mut(bb.max(1))) {
            on_cache!(&self.cache, c => c.export_into(*b as usize, geo, dst));
        }
        Ok(out)
    }

    fn export_block(&self, block: u32) -> Result<Vec<u8>, ComputeError> {
        if block as usize >= self.kv.num_blocks {
            return Err(ComputeError::Invalid(format!("no block {block}")));
        }
        let geo = self.geometry();
        Ok(on_cache!(&self.cache, c => c.export(block as usize, geo)))
    }

    fn import_block(&mut self, block: u32, bytes: &[u8]) -> Result<(), ComputeError> {
        if block as usize >= self.kv.num_blocks || bytes.len() != self.block_bytes() {
            return Err(ComputeError::Invalid(format!(
                "block {block} with {} bytes: this cache has {} blocks of {} bytes",
                bytes.len(),
                self.kv.num_blocks,
                self.block_bytes()
            )));
        }
        let geo = self.geometry();
        on_cache!(&mut self.cache, c => c.import(block as usize, geo, bytes));
        Ok(())
    }

    fn save_blocks(&mut self, blocks: &[u32]) -> Result<Vec<Vec<u8>>, ComputeError> {
        let geo = self.geometry();
        blocks
            .iter()
            .map(|&b| {
                if b as usize >= self.kv.num_blocks {
                    return Err(ComputeError::Invalid(format!("no block {b}")));
                }
                Ok(on_cache!(&self.cache, c => c.save(b as usize, geo)))
            })
            .collect()
    }

    fn load_blocks(&mut self, blocks: &[u32], data: &[&[u8]]) -> Result<(), ComputeError> {
        let (geo, bytes) = (self.geometry(), self.block_bytes());
        if blocks.len() != data.len() {
            return Err(ComputeError::Invalid(format!(
                "{} blocks and {} payloads",
                blocks.len(),
                data.len()
            )));
        }
        for (&b, d) in blocks.iter().zip(data) {
            if b as usize >= self.kv.num_blocks || d.len() != bytes {
                return Err(ComputeError::Invalid(format!(
                    "block {b} with {} bytes: this cache has {} blocks of {bytes} bytes",
                    d.len(),
                    self.kv.num_blocks,
                )));
            }
            on_cache!(&mut self.cache, c => c.load(b as usize, geo, d));
        }
        Ok(())
    }

    fn saved_layout(&self) -> &'static str {
        // `kv.rs`: per layer, keys `[kv_head][dim][slot]`, then values `[kv_head][slot][dim]`.
        "cpu-k-head-dim-slot-v-head-slot-dim"
    }

    fn kv_dtype(&self) -> DType {
        self.dtype
    }

    fn lora(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        let weights = if self.quantized.is_empty() {
            format!("{} weights", self.dtype.name())
        } else {
            let types: Vec<&str> = self.quantized.iter().map(|t| t.name()).collect();
            format!("{} weights, {} cache", types.join("+"), self.dtype.name())
        };
        format!(
            "cpu ({} threads, {} kernels) {weights}",
            self.pool.current_num_threads(),
            crate::quant::Isa::detect().name()
        )
    }
}
