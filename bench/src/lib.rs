//! dyn-bench: the load generator behind `dyn bench`.
//!
//! It will drive a running graph over its OpenAI-compatible HTTP API (synthetic prompts or a
//! Mooncake trace), and report AIPerf-compatible metrics: TTFT, inter-token latency, request
//! and token throughput, goodput, with p50/p90/p99 from HDR histograms. The crate is a member
//! of the workspace from the start so the layout is fixed; its contents land with the bench
//! issue and nothing uses it yet.
