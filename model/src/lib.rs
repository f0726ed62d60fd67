//! dyn-model: the model file formats, read without the kernels that run them.
//!
//! - [`config`] checks a Hugging Face `config.json` into a [`ModelConfig`], the shape every
//!   backend runs.
//! - [`gguf`] maps a GGUF file (llama.cpp's format) and reads its header, metadata and tensor
//!   table, every length checked; its tensors' bytes are there for a backend to load.
//! - [`lora`] reads LoRA adapters (PEFT's directories and llama.cpp's GGUF files), checks them
//!   against the base model's shape, and hands checked ones over to the workers of the same
//!   process.
//! - [`files`] bounds what a file named at run time can make the process read.
//!
//! It is a crate of its own so that the serving side reads model files without compiling
//! kernels: `dyn-llm` reads tokenizers and chat templates from GGUF metadata, and the frontend
//! checks an adapter against the base model's shape, through it alone; `dyn-compute` builds the
//! weights its backends multiply on top of it (and re-exports these modules under its
//! `model`). It depends on no other dyn crate.

pub mod config;
pub mod files;
pub mod gguf;
pub mod lora;

use std::path::Path;

pub use config::{Arch, ModelConfig, RopeScaling};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("config: {0}")]
    Config(String),
    #[error("weights: {0}")]
    Weights(String),
}

impl ModelError {
    /// An I/O error on `path`.
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        ModelError::Io {
            // Escaped: a name with a newline must not forge a line where this is logged.
            path: files::shown(path),
            source,
        }
    }
}

/// The shape of the model at `path` (a checkpoint directory or a GGUF file), read from its
/// config or its GGUF header alone: what an adapter is checked against.
pub fn shape(path: &Path) -> Result<ModelConfig, ModelError> {
    if gguf::is_gguf(path) {
        gguf::Gguf::open(path)?.config()
    } else {
        ModelConfig::load(path)
    }
}

/// Little-endian bytes as numbers (copied, so `bytes` need not be aligned). Casting is the
/// identity only on a little-endian host, which every target dyn builds for is.
pub fn le_vec<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    const {
        assert!(
            cfg!(target_endian = "little"),
            "dyn reads tensors as little-endian"
        )
    };
    bytemuck::pod_collect_to_vec(bytes)
}
