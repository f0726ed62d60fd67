//! The one trait the native engine drives: run a batch of sequences through the model, reading
//! and writing their KV in a paged cache the backend owns.
//!
//! The engine's scheduler decides *which* tokens run and *where* their KV lives (block
//! tables); a backend only computes. Every backend exports and imports a block in one layout
//! ([`BlockLayout::LayerKvHeadSlotDim`](crate::transfer::BlockLayout), whatever it keeps
//! inside), so KV blocks can be exported from one worker and imported into another by the
//! transfer agent.

use crate::model::{DType, ModelConfig};

/// One sequence's part of a step: `tokens` are new (their KV is computed and stored), at
/// positions `start..start + tokens.len()`; positions `0..start` are already in the cache.
#[derive(Debug, Clone, Copy)]
pub struct SeqStep<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    /// Block ids covering positions `0..start + tokens.len()`, in order.
    pub blocks: &'a [u32],
    /// Return next-token logits after the last new token.
    pub logits: bool,
    /// With `logits`: after every new token, in order, not only the last (a prompt's
    /// log-probabilities).
    pub all_logits: bool,
    /// With `logits`: the rows are the final hidden states (after the model's last norm,
    /// `hidden` floats each) instead of logits — what embeddings are pooled from.
    pub hidden: bool,
    /// The sequence's LoRA adapter, added to the base's projections for its tokens only (see
    /// [`Backend::lora`]). Its KV is the adapter's: a sequence's blocks must never be shared
    /// with one of another adapter.
    pub lora: Option<&'a crate::model::lora::LoraAdapter>,
}

#[derive(Debug, thiserror::Error)]
pub enum ComputeError {
    #[error("{0}")]
    Invalid(String),
    #[error("device: {0}")]
    Device(String),
}

/// Size of the paged KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    pub num_blocks: usize,
    pub block_size: usize,
}

pub trait Backend: Send {
    fn config(&self) -> &ModelConfig;

    /// Run one step; logits (`vocab` floats) for each sequence that asked, in batch order
    /// (final hidden states, `hidden` floats, for those that asked for [`SeqStep::hidden`]).
    fn forward(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<Vec<f32>>, ComputeError>;

    /// Bytes of one KV block ([`Backend::export_block`]'s length).
    fn block_bytes(&self) -> usize;

    /// A block's KV: for each layer, K then V, each `[kv_heads, block_size, head_dim]`, in
    /// [`Backend::kv_dtype`], little-endian.
    fn export_block(&self, block: u32) -> Result<Vec<u8>, ComputeError>;

    fn import_block(&mut self, block: u32, bytes: &[u8]) -> Result<(), ComputeError>;

    /// Several blocks at once (a backend may batch the copies).
    fn export_blocks(&mut self, blocks: &[u32]) -> Result<Vec<Vec<u8>>, ComputeError> {
        blocks.iter().map(|b| self.export_block(*b)).collect()
    }

    /// Several blocks back to back in one buffer: what a KV transfer registers with UCX where
    /// it lies (blocks in separate buffers would be copied into one first).
    fn export_blocks_packed(&mut self, blocks: &[u32]) -> Result<Vec<u8>, ComputeError> {
        Ok(self.export_blocks(blocks)?.concat())
    }

    fn import_blocks(&mut self, blocks: &[u32], data: &[&[u8]]) -> Result<(), ComputeError> {
        if blocks.len() != data.len() {
            return Err(ComputeError::Invalid(format!(
                "{} blocks and {} payloads",
                blocks.len(),
                data.len()
            )));
        }
        for (b, d) in blocks.iter().zip(data) {
            self.import_block(*b, d)?;
        }
        Ok(())
    }

    /// Blocks' KV in this backend's own layout, for its offload tiers (host memory, disk),
    /// which only this kind of backend reads back: no reordering into the exchanged layout.
    /// [`Backend::saved_layout`] names the layout (disk files record it).
    fn save_blocks(&mut self, blocks: &[u32]) -> Result<Vec<Vec<u8>>, ComputeError> {
        self.export_blocks(blocks)
    }

    /// Write [`Backend::save_blocks`]'s bytes back into `blocks`.
    fn load_blocks(&mut self, blocks: &[u32], data: &[&[u8]]) -> Result<(), ComputeError> {
        self.import_blocks(blocks, data)
    }

    /// The layout of [`Backend::save_blocks`]'s bytes.
    fn saved_layout(&self) -> &'static str {
        "layer-kv-head-slot-dim"
    }

    fn kv_dtype(&self) -> DType;

    /// Whether [`SeqStep::lora`] is applied; a backend that does not refuses batches with one.
    fn lora(&self) -> bool {
        false
    }

    /// For logs: `cpu f32`, `cuda:0 bf16`.
    fn describe(&self) -> String;
}

/// Check a batch against the cache before running it (shared by the backends).
pub fn check_batch(
    batch: &[SeqStep<'_>],
    kv: KvShape,
    c: &ModelConfig,
) -> Result<(), ComputeError> {
    for (i, s) in batch.iter().enumerate() {
        let end = s.start + s.tokens.len();
        if s.blocks.len() * kv.block_size < end {
            return Err(ComputeError::Invalid(format!(
                "sequence {i}: {} blocks of {} cannot hold {end} positions",
                s.blocks.len(),
                kv.block_size
            )));
        }
        if let Some(b) = s.blocks.iter().find(|b| **b as usize >= kv.num_blocks) {
            return Err(ComputeError::Invalid(format!(
                "sequence {i}: block {b} is outside the cache ({} blocks)",
                kv.num_blocks
            )));
        }
        if let Some(t) = s.tokens.iter().find(|t| **t as usize >= c.vocab) {
            return Err(ComputeError::Invalid(format!(
                "sequence {i}: token {t} is outside the vocabulary ({})",
                c.vocab
            )));
        }
        if let Some(a) = s.lora
            && a.layers() != c.layers
        {
            return Err(ComputeError::Invalid(format!(
                "sequence {i}: a LoRA adapter of {} layers on a model of {}",
                a.layers(),
                c.layers
            )));
        }
        if s.tokens.is_empty() && s.logits {
            return Err(ComputeError::Invalid(format!(
                "sequence {i}: logits asked for with no new token"
            )));
        }
    }
    Ok(())
}
