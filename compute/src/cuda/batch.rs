//! A batch on its way to the device: the host [`Layout`] the kernels read (each token's
//! position, cache block and sequence, the block tables, the rows asked for) and the [`Step`]
//! it is uploaded into, with the step's activations and the attention scores scratch.

use cudarc::cublas::{CudaBlas, Gemm};
use cudarc::driver::CudaSlice;

use super::engine::Engine;
use super::lora::LoraRows;
use super::{DevFloat, dev, int};
use crate::backend::{ComputeError, SeqStep};

/// Scores scratch for attention is kept under this; longer batches attend in token chunks.
const SCORES_BYTES: usize = 512 << 20;

/// A batch laid out on the host as the kernels read it.
pub(super) struct Layout {
    /// Per token: id, position, its cache block, its sequence.
    pub(super) ids: Vec<u32>,
    pub(super) pos: Vec<i32>,
    pub(super) blk: Vec<i32>,
    pub(super) seq: Vec<i32>,
    /// Per sequence: its block table, all of them end to end, and where each starts.
    pub(super) tables: Vec<i32>,
    pub(super) table_off: Vec<i32>,
    /// The tokens whose logits are returned: the last of each sequence that asks (all of its
    /// new tokens where it asks for all).
    pub(super) rows: Vec<i32>,
    /// Per row: its final hidden state is returned instead ([`SeqStep::hidden`]).
    pub(super) hidden: Vec<bool>,
    /// The longest context in the batch (at least 1), which sizes the attention scratch.
    pub(super) max_ctx: usize,
}

impl Layout {
    pub(super) fn of(batch: &[SeqStep<'_>], bs: usize) -> Result<Self, ComputeError> {
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
pub(super) struct Step<T> {
    pub(super) t: usize,
    pub(super) ids: CudaSlice<u32>,
    pub(super) pos: CudaSlice<i32>,
    pub(super) blk: CudaSlice<i32>,
    pub(super) seq: CudaSlice<i32>,
    pub(super) tables: CudaSlice<i32>,
    pub(super) table_off: CudaSlice<i32>,
    pub(super) x: CudaSlice<T>,
    pub(super) normed: CudaSlice<T>,
    pub(super) qkv: CudaSlice<T>,
    pub(super) attn: CudaSlice<T>,
    pub(super) gu: CudaSlice<T>,
    pub(super) act: CudaSlice<T>,
    /// Tokens per attention launch: their scores fit `scores`, kept under [`SCORES_BYTES`].
    pub(super) chunk: usize,
    pub(super) scores: CudaSlice<f32>,
    /// The runs of rows with an adapter, and the scratch of the largest run's `X·Aᵀ`.
    pub(super) lora: Vec<LoraRows>,
    pub(super) lora_scratch: CudaSlice<T>,
}

impl<T: DevFloat> Engine<T>
where
    CudaBlas: Gemm<T>,
{
    /// The batch's layout on the device, and the step's activations and attention scratch.
    pub(super) fn upload(&self, layout: &Layout) -> Result<Step<T>, ComputeError> {
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
}
