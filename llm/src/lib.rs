//! dyn-llm: the text side of an LLM graph. It owns model directories ([`model`]), tokenizers
//! ([`encoder`], [`gguf_tokenizer`]), chat templates and the `preprocess` kind
//! ([`preprocess`], with its cache of tokenized conversation prefixes, [`prefix`]),
//! structured-output grammars ([`grammar`], and [`gbnf`] for llama.cpp
//! workers), the detokenizer ([`detok`]) and the `postprocess` kind ([`postprocess`]). The
//! payloads it reads and writes are `dyn_protocol`'s.
//!
//! It must not depend on the router, the engines, the planner or the frontend: they all build
//! on it.

pub mod detok;
pub mod encoder;
pub mod gbnf;
pub mod gguf_tokenizer;
pub mod grammar;
pub mod model;
pub mod postprocess;
pub mod prefix;
pub mod preprocess;
