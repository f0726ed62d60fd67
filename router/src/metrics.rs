//! The router's and disaggregated serving's Prometheus series (the process's default
//! registry, rendered by [`dyn_protocol::metrics::render`]).

use std::sync::LazyLock;

use dyn_protocol::metrics::{counter_vec, gauge, histogram};
use prometheus::{HistogramVec, IntCounterVec, IntGaugeVec};

/// Routing quality of the `kv` policy, per route node: how much of the cache that was there
/// to hit the router actually sent requests to.
pub struct Router {
    pub decisions: IntCounterVec,
    pub routed: IntCounterVec,
    pub match_decisions: IntCounterVec,
    pub best_match_decisions: IntCounterVec,
    pub prompt_blocks: IntCounterVec,
    pub reachable_blocks: IntCounterVec,
    pub achieved_blocks: IntCounterVec,
    pub avoidable_tokens: IntCounterVec,
    /// Workers left out of routing by their circuit breaker (each time one opens).
    pub breaker_trips: IntCounterVec,
    /// Requests sent to each pool, where a route node feeds several.
    pub pool_requests: IntCounterVec,
}

pub static ROUTER: LazyLock<Router> = LazyLock::new(|| {
    let l: &[&str] = &["node"];
    Router {
        decisions: counter_vec("dyn_router_decisions_total", "Requests routed", l),
        pool_requests: counter_vec(
            "dyn_router_pool_requests_total",
            "Requests sent to each pool, where a route node chooses among several",
            &["node", "pool"],
        ),
        routed: counter_vec(
            "dyn_router_routed_requests_total",
            "Requests routed, by worker (every policy)",
            &["node", "worker_id"],
        ),
        match_decisions: counter_vec(
            "dyn_router_match_decisions_total",
            "Requests routed while some worker cached part of the prompt",
            l,
        ),
        best_match_decisions: counter_vec(
            "dyn_router_best_match_decisions_total",
            "Of those, requests sent to a worker caching the most of the prompt",
            l,
        ),
        prompt_blocks: counter_vec(
            "dyn_router_prompt_blocks_total",
            "Full prompt blocks routed",
            l,
        ),
        reachable_blocks: counter_vec(
            "dyn_router_reachable_hit_blocks_total",
            "Prompt blocks the best-matching worker cached (the reachable hits)",
            l,
        ),
        achieved_blocks: counter_vec(
            "dyn_router_achieved_hit_blocks_total",
            "Prompt blocks the chosen worker cached (the hits the router expects)",
            l,
        ),
        avoidable_tokens: counter_vec(
            "dyn_router_avoidable_prefill_tokens_total",
            "Prompt tokens prefilled that the best-matching worker cached",
            l,
        ),
        breaker_trips: counter_vec(
            "dyn_router_breaker_trips_total",
            "Times a worker was left out of routing because its requests kept failing",
            l,
        ),
    }
});

/// Admission control ([`crate::admission`]), per route node.
pub struct Admission {
    /// Requests waiting for room.
    pub waiting: IntGaugeVec,
    /// Requests refused, by `reason` (`queue_full`, `queue_timeout`, `rate_limit_exceeded`).
    pub refused: IntCounterVec,
    /// How long admitted requests waited, by `priority` (-16 to 16, else `other`).
    pub wait_seconds: HistogramVec,
    /// Tokens (prompt + `max_tokens`) admitted, by `tenant` (those the graph names, `none`,
    /// else `other`): the shares fairness gives.
    pub tenant_tokens: IntCounterVec,
}

pub static ADMISSION: LazyLock<Admission> = LazyLock::new(|| Admission {
    waiting: gauge(
        "dyn_router_queue_waiting",
        "Requests waiting at the router for room on a worker",
        &["node"],
    ),
    refused: counter_vec(
        "dyn_router_admission_refused_total",
        "Requests the router refused by reason: queue_full, queue_timeout (503), rate_limit_exceeded (429)",
        &["node", "reason"],
    ),
    wait_seconds: histogram(
        "dyn_router_queue_wait_seconds",
        "Time admitted requests waited at the router, by priority",
        &["node", "priority"],
    ),
    tenant_tokens: counter_vec(
        "dyn_router_tenant_tokens_total",
        "Tokens (prompt + max_tokens) the router admitted, by tenant",
        &["node", "tenant"],
    ),
});

/// Disaggregated serving: where prompts were prefilled (the decode workers count how their
/// KV transfers went, in `dyn_engine::metrics::TRANSFERS`).
pub struct Disagg {
    /// `decision`: remote|local; `reason`: remote, below_threshold, queue_full,
    /// no_prefill_worker, prefill_failed.
    pub decisions: IntCounterVec,
}

pub static DISAGG: LazyLock<Disagg> = LazyLock::new(|| Disagg {
    decisions: counter_vec(
        "dyn_remote_prefill_decisions_total",
        "Prefill decisions by node, decision (remote|local) and reason",
        &["node", "decision", "reason"],
    ),
});
