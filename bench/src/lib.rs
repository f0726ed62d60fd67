//! dyn-bench: the load generator behind `dyn bench`.
//!
//! It drives any OpenAI-compatible server (a running graph, vLLM, SGLang) with streaming chat
//! or completion requests — synthetic prompts of exact token lengths, shared-prefix groups, a
//! Mooncake trace on its own timestamps, or a prompts file — in a closed loop (fixed
//! concurrency) or an open loop (Poisson, gamma or constant arrivals), and reports
//! AIPerf-compatible metrics: TTFT, ITL, inter-chunk latency, TPOT, end-to-end latency,
//! request and token throughput, goodput, with p50/p90/p99 from HDR histograms.
//!
//! Layout: [`sse`] parses the event stream, [`client`] times one request, [`arrival`] and
//! [`dataset`] say when and what to send, [`run`] drives the load, [`metrics`] turns records
//! into a [`Summary`], [`report`] prints and writes it, [`plot`] draws it. It depends on no
//! other dyn crate: it speaks HTTP to any server.

pub mod arrival;
pub mod client;
pub mod dataset;
pub mod metrics;
pub mod oracle;
pub mod planner;
pub mod plot;
pub mod report;
pub mod run;
pub mod sse;

use std::path::PathBuf;

pub use metrics::{Record, Slo, Stats, Summary};
pub use run::{Config, Endpoint, Load, Stop};

/// Everything that can stop a benchmark from running (request failures are not errors: they
/// are counted in the summary).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A bad line in a trace or prompts file.
    #[error("{}:{line}: {message}", path.display())]
    Line {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("tokenizer {}: {message}", path.display())]
    Tokenizer { path: PathBuf, message: String },
    #[error("{url}: {message}")]
    Server { url: String, message: String },
    #[error("{0}")]
    Invalid(String),
    #[error("cannot write {}: {message}", path.display())]
    Output { path: PathBuf, message: String },
}
