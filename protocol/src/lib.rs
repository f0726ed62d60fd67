//! dyn-protocol: what crosses a boundary between dyn's crates and processes, and nothing that
//! computes. The payloads of an LLM graph ([`types`], [`text`]), KV block identity, KV events
//! and load metrics ([`kv`]), the KV transfer descriptor and its pull capability
//! ([`transfer`]), token ids as JSON payloads carry them ([`wire`]), and the helpers every
//! crate's Prometheus statics register through ([`metrics`]).
//!
//! It sits just above `dyn-core` and depends on serde and small leaf crates (xxhash, `ring`,
//! `prometheus`, `base64`), no tokenizer, kernel or runtime, so an engine, a
//! router or a planner can speak to the others without compiling them: the router builds and
//! benchmarks on its own, and a kernel edit rebuilds no protocol user that has no kernel.

pub mod kv;
pub mod metrics;
pub mod text;
pub mod transfer;
pub mod types;
pub mod wire;

#[cfg(any(test, feature = "testing"))]
pub mod testing;
