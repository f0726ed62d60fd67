//! The planner's Prometheus series (the process's default registry, rendered by
//! [`dyn_protocol::metrics::render`]).

use std::sync::LazyLock;

use dyn_protocol::metrics::{float_gauge, gauge};
use prometheus::IntGaugeVec;

/// The SLA planner's latest decision, as the frontend saw it (set by the state it follows).
pub(crate) struct PlannerMetrics {
    pub replicas: IntGaugeVec,
    pub rate: prometheus::GaugeVec,
    pub observed_latency: prometheus::GaugeVec,
    pub target_latency: prometheus::GaugeVec,
}

pub(crate) static PLANNER: LazyLock<PlannerMetrics> = LazyLock::new(|| PlannerMetrics {
    replicas: gauge(
        "dyn_planner_replicas",
        "Replicas per scaled node: which=desired (the planner's decision) or actual (running)",
        &["node", "which"],
    ),
    rate: float_gauge(
        "dyn_planner_requests_per_second",
        "Request rate: which=observed (arrivals over the planner's last interval) or predicted (its prediction of the next)",
        &["which"],
    ),
    observed_latency: float_gauge(
        "dyn_planner_observed_latency_seconds",
        "TTFT and ITL at the planner's percentile over its last interval (metric=ttft|itl)",
        &["metric"],
    ),
    target_latency: float_gauge(
        "dyn_planner_target_latency_seconds",
        "The planner's TTFT and ITL targets (metric=ttft|itl)",
        &["metric"],
    ),
});
