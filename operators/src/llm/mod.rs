//! The LLM layer: payload types, model directories, and the `preprocess`, `route` and
//! `postprocess` kinds. The `http` ingress lives in [`crate::http::openai`] and the engines
//! behind `decode` in [`crate::decode`].

pub use dyn_router as route;
pub use dyn_router::{kv, remote_prefill};

pub use dyn_llm::{detok, encoder, gguf_tokenizer, model, postprocess, preprocess, types};
