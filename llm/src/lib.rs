//! dyn-llm: the LLM protocol and text. It owns the payload types that travel between kinds
//! ([`types`], [`text`]), model directories ([`model`]), tokenizers ([`encoder`],
//! [`gguf_tokenizer`]), chat templates and the `preprocess` kind ([`preprocess`]), structured-output grammars
//! ([`grammar`], and [`gbnf`] for llama.cpp workers), the
//! detokenizer ([`detok`]) and the `postprocess` kind ([`postprocess`]), plus the helpers every
//! crate's Prometheus statics register through ([`metrics`]).
//!
//! It must not depend on the router, the engines, the planner or the frontend: they all build
//! on it.

pub mod detok;
pub mod encoder;
pub mod gbnf;
pub mod gguf_tokenizer;
pub mod grammar;
pub mod metrics;
pub mod model;
pub mod postprocess;
pub mod preprocess;
pub mod text;
pub mod types;

#[cfg(any(test, feature = "testing"))]
pub mod testing;
