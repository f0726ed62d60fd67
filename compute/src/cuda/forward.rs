//! The forward pass over one step: the embeddings, each layer (attention — rope with the KV
//! cache write, then paged attention over the block tables — and the MLP with SiLU·mul),
//! each adapter's delta after its projections, and the logits or final hidden states of the
//! rows asked for, read back as f32.

use cudarc::cublas::{CudaBlas, Gemm};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::batch::{Layout, Step};
use super::engine::Engine;
use super::kernels::grid;
use super::{DevFloat, dev, int};
use crate::backend::{ComputeError, SeqStep};
use crate::model::lora::Target;

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

impl<T: DevFloat> Engine<T>
where
    CudaBlas: Gemm<T>,
{
    /// One forward pass over the batch: embed, every layer, then the logits asked for.
    pub(super) fn step(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<Vec<f32>>, ComputeError> {
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
}
