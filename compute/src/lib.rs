//! dyn-compute: the native engine's compute, and KV transfer between workers.
//!
//! - [`model`] reads a Llama-family checkpoint (Hugging Face `config.json` and safetensors, or
//!   GGUF) into the weights every backend uses; the file formats it reads are `dyn-model`'s,
//!   re-exported in it.
//! - [`backend`] is the trait the engine drives: a batch of sequences through the model over
//!   a paged KV cache. [`cpu`] implements it everywhere; `cuda` (feature `cuda`) on NVIDIA
//!   GPUs through cudarc, loading the driver at run time.
//! - [`sample`] picks tokens from logits.
//! - [`transfer`] moves KV-cache blocks between workers (disaggregated prefill).
//!
//! It depends on no other dyn crate and knows nothing of requests, graphs or planes: the
//! engine (`dyn-engine`) drives it, and `dyn-llm`'s payloads carry its transfer descriptor.

pub mod backend;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod model;
pub mod quant;
pub mod sample;
pub mod transfer;

pub use backend::{Backend, ComputeError, KvShape, SeqStep};

/// True when the `cuda` feature was enabled at build time.
pub const fn cuda_compiled() -> bool {
    cfg!(feature = "cuda")
}
