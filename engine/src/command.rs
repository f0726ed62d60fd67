//! What the handle sends the engine loop ([`Command`]) and what comes back on a request's
//! channel ([`EngineItem`]) or a prefill's offer ([`OfferResult`]): the types both sides share,
//! so the loop does not depend on the handle.

use bytes::Bytes;
use dyn_compute::transfer::TransferDescriptor;
use dyn_core::OpError;
use dyn_protocol::types::Generated;
use tokio::sync::{mpsc, oneshot};

use super::EngineError;
use super::scheduler::{SeqId, SeqSpec};

/// What a request's channel carries: tokens, or the engine's failure.
pub type EngineItem = Result<Generated, OpError>;

/// Where a prefill-only request's blocks went: the offer to pull them, or why there is none.
pub type OfferResult = Result<TransferDescriptor, EngineError>;

/// Prefill role: where the offer of a prompt's blocks goes, and the lock of the one key that
/// may pull them (sent to the decode worker the router chose), when the router bound it.
pub struct OfferTo {
    pub reply: oneshot::Sender<OfferResult>,
    pub lock: Option<dyn_compute::transfer::PullLock>,
}

pub(super) enum Command {
    Add {
        id: SeqId,
        /// Boxed: a request's spec is large, and the queue's every slot is as large as the
        /// largest command.
        spec: Box<SeqSpec>,
        /// Imported KV for the sequence's blocks.
        kv: Option<Vec<Bytes>>,
        tx: mpsc::Sender<EngineItem>,
        /// Prefill role: where to send the offer of the prompt's blocks.
        offer: Option<OfferTo>,
    },
    /// Publish the whole cache (a router lost events).
    Dump,
}
