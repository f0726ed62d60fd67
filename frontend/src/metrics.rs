//! The frontend's Prometheus series. The `http` ingress serves the whole default registry at
//! `GET /metrics` ([`dyn_protocol::metrics::render`]): the router's, workers' and planner's series
//! live in their crates.
//!
//! Everything registers in the process's default registry, so one scrape of a process shows
//! its frontend and every worker it runs. Names follow Prometheus conventions (`_total` for
//! counters, base units in seconds) under `dyn_frontend_` and `dyn_worker_`.

use std::sync::LazyLock;

use dyn_protocol::metrics::{counter_vec, gauge, histogram};
use prometheus::{HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec};

pub struct Frontend {
    pub requests: IntCounterVec,
    pub inflight: IntGaugeVec,
    pub ttft: HistogramVec,
    pub itl: HistogramVec,
    pub duration: HistogramVec,
    pub input_tokens: IntCounterVec,
    pub output_tokens: IntCounterVec,
    pub lora_requests: IntCounterVec,
    pub connections: IntGauge,
    pub write_timeouts: IntCounter,
}

pub static FRONTEND: LazyLock<Frontend> = LazyLock::new(|| {
    Frontend {
    requests: counter_vec(
        "dyn_frontend_requests_total",
        "Requests by model, endpoint, request type (stream|unary) and status (success|error|cancelled)",
        &["model", "endpoint", "request_type", "status"],
    ),
    inflight: gauge(
        "dyn_frontend_inflight_requests",
        "Requests being served",
        &["model"],
    ),
    ttft: histogram(
        "dyn_frontend_time_to_first_token_seconds",
        "Time from request arrival to the first token",
        &["model"],
    ),
    itl: histogram(
        "dyn_frontend_inter_token_latency_seconds",
        "Time between consecutive output tokens",
        &["model"],
    ),
    duration: histogram(
        "dyn_frontend_request_duration_seconds",
        "Time from request arrival to the last token",
        &["model"],
    ),
    input_tokens: counter_vec(
        "dyn_frontend_input_tokens_total",
        "Prompt tokens",
        &["model"],
    ),
    output_tokens: counter_vec(
        "dyn_frontend_output_tokens_total",
        "Generated tokens",
        &["model"],
    ),
    // Which adapters are asked for, beside the base model's own series (its requests count
    // there too). One series per adapter name ever served: names are the operator's.
    lora_requests: counter_vec(
        "dyn_frontend_lora_requests_total",
        "Requests by the LoRA adapter they name",
        &["model", "lora"],
    ),
    // Against `max_connections`: a server whose open connections sit at the limit refuses
    // new ones, and this shows it before clients report it.
    connections: gauge(
        "dyn_frontend_open_connections",
        "HTTP connections open now (every HTTP ingress of the process)",
        &[],
    )
    .with_label_values::<&str>(&[]),
    write_timeouts: counter_vec(
        "dyn_frontend_write_timeouts_total",
        "HTTP connections closed because no write went through for write_timeout_s (the client stopped reading)",
        &[],
    )
    .with_label_values::<&str>(&[]),
}
});
