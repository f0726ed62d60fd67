//! The LLM layer: payload types, model directories, and the `preprocess`, `route` and
//! `postprocess` kinds. The `http` ingress lives in [`crate::http::openai`] and the engines
//! behind `decode` in [`crate::decode`].

pub mod kv;
pub mod remote_prefill;
pub mod route;

pub use dyn_llm::{detok, encoder, gguf_tokenizer, model, postprocess, preprocess, types};
