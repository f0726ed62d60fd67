//! dyn-engine: the engine every native and mocked worker runs — scheduler, block pool, engine
//! loop, handle, settings, step model, KV events, offload tiers, the mocker, the native
//! executor, the process's KV transfer agent — and the workers' metrics ([`metrics`]). It must
//! not depend on the frontend (dyn-frontend), the planner or the external engines: touching the
//! scheduler must not recompile the frontend.
//!
//! The engine loop the `decode` and `prefill` kinds run, shared by the engines: the
//! simulated [`mocker`] and the [`native`] model.
//!
//! Each worker runs its scheduler loop on a dedicated OS thread, as a real engine's busy loop
//! would: it takes new requests from a bounded queue, plans a [`scheduler`] step over the
//! paged block [`pool`], has the engine's [`Executor`] compute it, and hands each sequence's
//! new tokens to its request. A request whose consumer went away (client disconnect, stop
//! string, kill) is noticed at the next step and its blocks are freed — that is how
//! cancellation reaches the engine. KV events and load metrics go to the event plane; block
//! and request gauges go to `/metrics`. In the prefill role a finished prompt's blocks are
//! exported by the executor and offered to the transfer agent; a decode worker pulls them,
//! and its executor writes them into the blocks the scheduler gives the sequence.
//!
//! Evicted cached blocks may live on below the pool, in host memory and on disk
//! ([`offload`]), and come back on a prefix hit.
//!
//! Files: [`handle`] (what a node holds: submit, import, the thread's start), `engine_loop`
//! (the thread), [`settings`] (the scheduler settings every engine shares), [`transfer`] (the
//! KV transfer agent service), [`offload`] (the tiers below the pool), [`events`] (the KV
//! event stream), [`lora`] (the LoRA adapters a native worker keeps); an engine adds an
//! [`Executor`] and its config section.

mod command;
mod engine_loop;
pub mod events;
#[cfg(test)]
mod fast_forward_tests;
pub mod handle;
pub mod lora;
pub mod metrics;
pub mod mocker;
pub mod native;
pub mod offload;
pub mod pool;
pub mod scheduler;
pub mod settings;
pub mod step_model;
pub mod transfer;

use bytes::Bytes;
use dyn_compute::backend::ComputeError;
use dyn_compute::transfer::TransferError;

pub use handle::{EngineHandle, EngineItem, ImportCheck, ImportedKv, OfferResult, VerifyImport};
use pool::BlockId;
use scheduler::{SeqId, Work};
pub use settings::{EngineSettings, SchedulerConfig};

/// What computes a step: the mocker's timing model, or a model on a backend.
pub trait Executor: Send + 'static {
    /// Compute the planned work; one token per [`Work`] with `sample` set, in order.
    fn execute(&mut self, work: &[Work<'_>]) -> Result<Vec<u32>, EngineError>;
    /// The bytes of `blocks` (holding `tokens`' KV), for a prefill offer.
    fn export(&mut self, blocks: &[BlockId], tokens: &[u32]) -> Result<Vec<Bytes>, EngineError>;
    /// The bytes of cached `blocks` (sequence hashes `hashes`) the pool is evicting, for an
    /// offload tier: in the engine's own layout ([`Executor::offload_layout`]), which only
    /// [`Executor::onboard`] reads.
    fn export_cached(
        &mut self,
        blocks: &[BlockId],
        hashes: &[u64],
    ) -> Result<Vec<Bytes>, EngineError> {
        let _ = hashes;
        self.export(blocks, &[])
    }
    /// Write [`Executor::export_cached`]'s bytes back into `blocks`.
    fn onboard(&mut self, blocks: &[BlockId], data: Vec<Bytes>) -> Result<(), EngineError> {
        self.import(blocks, data)
    }
    /// Names the layout of [`Executor::export_cached`]'s bytes (disk files record it).
    fn offload_layout(&self) -> String {
        "exchanged".into()
    }
    /// Write KV pulled from a prefill worker into `blocks`.
    fn import(&mut self, blocks: &[BlockId], data: Vec<Bytes>) -> Result<(), EngineError>;
    /// The log-probabilities the last [`Executor::execute`] computed for the sequences whose
    /// spec asks for them: one [`Logprob::Sampled`] per token it sampled for such a sequence,
    /// and [`Logprob::Prompt`] for the prompt positions it computed.
    fn take_logprobs(&mut self) -> Vec<(SeqId, Logprob)> {
        Vec::new()
    }
    /// The embeddings the last [`Executor::execute`] finished: one for each embeddings
    /// sequence whose prompt it completed (the token it returned for that one is not output).
    fn take_embeddings(&mut self) -> Vec<(SeqId, Vec<f32>)> {
        Vec::new()
    }
    /// `id` is gone (finished, cancelled or failed): drop what the executor keeps for it
    /// between steps.
    fn forget(&mut self, id: SeqId) {
        let _ = id;
    }
}

/// What an executor reports for a sequence that asked for log-probabilities.
#[derive(Debug, Clone, PartialEq)]
pub enum Logprob {
    /// The token sampled this step.
    Sampled(dyn_protocol::types::TokenLogprob),
    /// Prompt tokens from position `at` on (position 0 has none).
    Prompt {
        at: usize,
        items: Vec<dyn_protocol::types::TokenLogprob>,
    },
}

/// Why an engine could not do what a request needed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The backend failed a step, an export or an import.
    #[error(transparent)]
    Compute(#[from] ComputeError),
    /// The KV could not be offered or pulled.
    #[error(transparent)]
    Transfer(#[from] TransferError),
    /// Pulled KV that does not fit the request (other sizes, other tokens).
    #[error("{0}")]
    Mismatch(String),
    /// A bug: the engine broke its own contract.
    #[error("{0}")]
    Internal(String),
}
