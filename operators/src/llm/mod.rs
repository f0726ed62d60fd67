//! The LLM layer: payload types, model directories, and the `preprocess`, `route` and
//! `postprocess` kinds. The `http` ingress lives in [`crate::http::openai`] and the engines
//! behind `decode` in [`crate::decode`].

pub mod detok;
pub mod encoder;
pub mod gguf_tokenizer;
pub mod kv;
pub mod model;
pub mod postprocess;
pub mod preprocess;
pub mod remote_prefill;
pub mod route;
pub mod types;
