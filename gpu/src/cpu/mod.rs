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
//! The cache is f32, per layer `[block][kv_head][dim][slot]` for K (transposed, so a decode
//! query scores a block's sixteen slots with one vector per dimension, no horizontal sums)
//! and `[block][kv_head][slot][dim]` for V. Exported blocks are `[kv_head][slot][dim]` for
//! both, the layout every backend exchanges.

mod attn;
mod columns;
pub mod gemm;
pub mod linear;
mod math;
pub mod panel;

use rayon::prelude::*;

use crate::backend::{Backend, ComputeError, KvShape, SeqStep, check_batch};
use crate::model::{DType, Host, ModelConfig, ModelWeights};
use columns::by_bands;
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
    /// Per layer, `[block][kv_head][slot][dim]`.
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    dtype: DType,
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
        let dtype = w.lm_head.data.dtype();
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
            k: vec![vec![0.0; per_layer]; c.layers],
            v: vec![vec![0.0; per_layer]; c.layers],
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
        let (h, d, bs) = (c.hidden, c.head_dim, self.kv.block_size);
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
            let r = *tok as usize * h;
            match &self.embed {
                Host::F32(e) => row.copy_from_slice(&e[r..r + h]),
                Host::Bf16(e) => row
                    .iter_mut()
                    .zip(&e[r..r + h])
                    .for_each(|(o, v)| *o = v.to_f32()),
                Host::F16(e) => row
                    .iter_mut()
                    .zip(&e[r..r + h])
                    .for_each(|(o, v)| *o = v.to_f32()),
            }
        }
        b.normed.resize(t * h, 0.0);
        b.qkv.resize(t * width, 0.0);
        b.attn.resize(t * qd, 0.0);
        b.act.resize(t * c.intermediate, 0.0);
        let block_floats = c.kv_heads * bs * d;
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
        for (li, layer) in self.layers.iter().enumerate() {
            rmsnorm(&b.x, &layer.attn_norm, c.rms_eps, &mut b.normed);
            layer
                .qkv
                .forward(&b.normed, t, &mut b.qkv, Write::Set, &mut b.linear);
            // Rope on q and k (rows in parallel), then store k and v in the token's cache slot.
            b.qkv
                .par_chunks_exact_mut(width)
                .zip(turns.par_chunks_exact(half))
                .with_min_len(PAR_FLOATS / width + 1)
                .for_each(|(row, turns)| rope(&mut row[..qd + kvd], d, turns));
            let (kc, vc) = (&mut self.k[li], &mut self.v[li]);
            for (row, &(si, pos)) in b.qkv.chunks_exact(width).zip(&owner) {
                let blk = batch[si].blocks[pos / bs] as usize;
                for g in 0..c.kv_heads {
                    let head = blk * block_floats + g * bs * d;
                    let key = &row[qd + g * d..qd + (g + 1) * d];
                    for (j, x) in key.iter().enumerate() {
                        kc[head + j * bs + pos % bs] = *x;
                    }
                    let at = head + pos % bs * d;
                    vc[at..at + d].copy_from_slice(&row[qd + kvd + g * d..qd + kvd + (g + 1) * d]);
                }
            }
            let (kc, vc) = (&self.k[li], &self.v[li]);
            // Per sequence (its rows of `attn` are contiguous), per KV head (a band of
            // those rows: the query heads sharing it).
            let mut parts = Vec::with_capacity(batch.len());
            let mut rest = &mut b.attn[..];
            for s in batch {
                let (mine, tail) = rest.split_at_mut(s.tokens.len() * qd);
                parts.push((s, mine));
                rest = tail;
            }
            let (qkv, grp) = (&b.qkv, c.group());
            parts
                .into_par_iter()
                .zip(&offsets)
                .filter(|((s, _), _)| !s.tokens.is_empty())
                .for_each(|((s, rows), &offset)| {
                    by_bands(rows, s.tokens.len(), qd, grp * d, |g, band| {
                        attn::attend(c, bs, s, offset, g, qkv, kc, vc, band)
                    })
                });
            // The residual adds happen as the products are written.
            layer
                .o
                .forward(&b.attn, t, &mut b.x, Write::Add, &mut b.linear);
            rmsnorm(&b.x, &layer.mlp_norm, c.rms_eps, &mut b.normed);
            layer
                .gate_up
                .forward(&b.normed, t, &mut b.act, Write::Set, &mut b.linear);
            layer
                .down
                .forward(&b.act, t, &mut b.x, Write::Add, &mut b.linear);
        }
        // Logits only for the last new token of the sequences that asked.
        let rows: Vec<usize> = batch
            .iter()
            .zip(&offsets)
            .filter(|(s, _)| s.logits)
            .map(|(s, o)| o + s.tokens.len() - 1)
            .collect();
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let last: Vec<f32> = rows
            .iter()
            .flat_map(|r| b.x[r * h..(r + 1) * h].iter().copied())
            .collect();
        let mut normed = vec![0.0; last.len()];
        rmsnorm(&last, &self.norm, c.rms_eps, &mut normed);
        b.logits.resize(rows.len() * c.vocab, 0.0);
        self.lm_head.forward(
            &normed,
            rows.len(),
            &mut b.logits,
            Write::Set,
            &mut b.linear,
        );
        Ok(b.logits
            .chunks_exact(c.vocab)
            .map(<[f32]>::to_vec)
            .collect())
    }

    fn block_floats(&self) -> usize {
        self.cfg.kv_heads * self.kv.block_size * self.cfg.head_dim
    }
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

/// Each head's `[rows][cols]` block of `src` into `[cols][rows]` in `dst` (a block's keys
/// between the exchanged `[slot][dim]` and the cache's `[dim][slot]`).
fn transpose_heads(src: &[f32], dst: &mut [f32], rows: usize, cols: usize) {
    for (s, t) in src
        .chunks_exact(rows * cols)
        .zip(dst.chunks_exact_mut(rows * cols))
    {
        for (i, row) in s.chunks_exact(cols).enumerate() {
            for (j, x) in row.iter().enumerate() {
                t[j * rows + i] = *x;
            }
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
        self.cfg.layers * 2 * self.block_floats() * 4
    }

    fn export_block(&self, block: u32) -> Result<Vec<u8>, ComputeError> {
        let n = self.block_floats();
        let at = block as usize * n;
        if block as usize >= self.kv.num_blocks {
            return Err(ComputeError::Invalid(format!("no block {block}")));
        }
        let (bs, d) = (self.kv.block_size, self.cfg.head_dim);
        let mut out = Vec::with_capacity(self.block_bytes());
        let mut keys = vec![0.0; n];
        for l in 0..self.cfg.layers {
            transpose_heads(&self.k[l][at..at + n], &mut keys, d, bs);
            for floats in [&keys[..], &self.v[l][at..at + n]] {
                out.extend(floats.iter().flat_map(|x| x.to_le_bytes()));
            }
        }
        Ok(out)
    }

    fn import_block(&mut self, block: u32, bytes: &[u8]) -> Result<(), ComputeError> {
        let n = self.block_floats();
        if block as usize >= self.kv.num_blocks || bytes.len() != self.block_bytes() {
            return Err(ComputeError::Invalid(format!(
                "block {block} with {} bytes: this cache has {} blocks of {} bytes",
                bytes.len(),
                self.kv.num_blocks,
                self.block_bytes()
            )));
        }
        let at = block as usize * n;
        let (bs, d) = (self.kv.block_size, self.cfg.head_dim);
        let floats: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        for (l, layer) in floats.chunks_exact(2 * n).enumerate() {
            let (keys, values) = layer.split_at(n);
            transpose_heads(keys, &mut self.k[l][at..at + n], bs, d);
            self.v[l][at..at + n].copy_from_slice(values);
        }
        Ok(())
    }

    fn kv_dtype(&self) -> DType {
        DType::F32
    }

    fn describe(&self) -> String {
        format!(
            "cpu ({} threads) {} weights",
            rayon::current_num_threads(),
            self.dtype.name()
        )
    }
}
