//! The planner's Prometheus series (the process's default registry, rendered by
//! [`dyn_protocol::metrics::render`]).

use std::sync::LazyLock;

use dyn_protocol::metrics::{float_gauge, gauge};
use prometheus::IntGaugeVec;

/// The SLA planner's latest decision, as the frontend saw it ([`crate::state`]).
struct PlannerMetrics {
    replicas: IntGaugeVec,
    rate: prometheus::GaugeVec,
    observed_latency: prometheus::GaugeVec,
    target_latency: prometheus::GaugeVec,
}

static PLANNER: LazyLock<PlannerMetrics> = LazyLock::new(|| PlannerMetrics {
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

/// Update the planner gauges from a published state.
pub fn planner(s: &crate::state::PlannerState) {
    let m = &*PLANNER;
    for n in &s.nodes {
        let node = n.decision.node.as_str();
        m.replicas
            .with_label_values(&[node, "desired"])
            .set(i64::from(n.decision.desired));
        m.replicas
            .with_label_values(&[node, "actual"])
            .set(i64::from(n.actual));
    }
    m.rate
        .with_label_values(&["predicted"])
        .set(s.predicted.request_rate);
    m.rate
        .with_label_values(&["observed"])
        .set(s.observed.request_rate);
    for (metric, observed, target) in [
        ("ttft", s.observed.ttft_ms, s.ttft_ms),
        ("itl", s.observed.itl_ms, s.itl_ms),
    ] {
        if let Some(v) = observed {
            m.observed_latency
                .with_label_values(&[metric])
                .set(v / 1000.0);
        }
        m.target_latency
            .with_label_values(&[metric])
            .set(target / 1000.0);
    }
}
