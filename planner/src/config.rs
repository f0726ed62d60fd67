//! The `planner:` section of a graph: targets, bounds per node, timing.

use std::collections::BTreeMap;
use std::path::PathBuf;

use dyn_core::{Invalid, Role, SectionConfig, SectionNode};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlannerConfig {
    /// Time to first token target (milliseconds) at `percentile`.
    pub ttft_ms: f64,
    /// Inter-token latency target (milliseconds, per request: its mean gap) at `percentile`.
    pub itl_ms: f64,
    #[serde(default = "default_percentile")]
    pub percentile: f64,
    /// Seconds between decisions.
    #[serde(default = "default_interval")]
    pub interval_s: f64,
    /// Seconds after any change before a scale-down (a scale-up waits one interval).
    #[serde(default = "default_cooldown")]
    pub cooldown_s: f64,
    #[serde(default)]
    pub predictor: PredictorKind,
    /// Performance profile from `dyn graph profile`, relative to the graph file. Without one
    /// the planner scales reactively.
    #[serde(default)]
    pub profile: Option<PathBuf>,
    /// Fraction of a replica's profiled capacity to plan for: the rest absorbs bursts and
    /// the queueing a fully used worker would add to TTFT.
    #[serde(default = "default_utilization")]
    pub utilization: f64,
    /// The worker nodes it scales, with their bounds.
    pub nodes: BTreeMap<String, Bounds>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bounds {
    pub min: u32,
    pub max: u32,
    /// This node's own TTFT target, milliseconds (default: the planner's `ttft_ms`); for a
    /// pool, held against the pool's own latencies.
    #[serde(default)]
    pub ttft_ms: Option<f64>,
    /// This node's own ITL target, milliseconds (default: the planner's `itl_ms`).
    #[serde(default)]
    pub itl_ms: Option<f64>,
}

/// How the next interval's load is predicted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PredictorKind {
    /// Level and trend, exponentially smoothed (Holt): a ramp is followed, not lagged.
    #[default]
    Holt,
    /// The last interval's load.
    Constant,
}

fn default_percentile() -> f64 {
    90.0
}
fn default_interval() -> f64 {
    10.0
}
fn default_cooldown() -> f64 {
    30.0
}
fn default_utilization() -> f64 {
    0.8
}

impl SectionConfig for PlannerConfig {
    const NAME: &'static str = "planner";
    const SUMMARY: &'static str =
        "SLA planner: scale worker nodes between min and max to meet TTFT and ITL targets";

    fn validate(&self, nodes: &[SectionNode<'_>]) -> Vec<Invalid> {
        let mut out = Vec::new();
        let positive = |v: f64| v.is_finite() && v > 0.0;
        for (field, v) in [
            ("ttft_ms", self.ttft_ms),
            ("itl_ms", self.itl_ms),
            ("interval_s", self.interval_s),
        ] {
            if !positive(v) {
                out.push(Invalid::field(field, "must be a positive number"));
            }
        }
        if !(self.percentile > 0.0 && self.percentile < 100.0) {
            out.push(Invalid::field(
                "percentile",
                "must be between 0 and 100 (e.g. 90)",
            ));
        }
        if !(self.cooldown_s.is_finite() && self.cooldown_s >= 0.0) {
            out.push(Invalid::field("cooldown_s", "must be 0 or more seconds"));
        }
        if !(self.utilization > 0.0 && self.utilization <= 1.0) {
            out.push(Invalid::field("utilization", "must be in (0, 1]"));
        }
        if self.nodes.is_empty() {
            out.push(Invalid::field(
                "nodes",
                "name at least one worker node to scale",
            ));
        }
        for (id, b) in &self.nodes {
            let field = format!("nodes.{id}");
            let Some(n) = nodes.iter().find(|n| n.id == id) else {
                let workers: Vec<&str> = nodes
                    .iter()
                    .filter(|n| n.role == Role::Worker)
                    .map(|n| n.id)
                    .collect();
                out.push(Invalid::field(
                    field.clone(),
                    format!(
                        "no node '{id}' in this graph; worker nodes: {}",
                        workers.join(", ")
                    ),
                ));
                continue;
            };
            if n.role != Role::Worker {
                out.push(Invalid::field(
                    field.clone(),
                    format!(
                        "'{id}' is a {} node; the planner scales worker nodes (engines)",
                        n.role
                    ),
                ));
                continue;
            }
            if n.process_nodes > 1 {
                out.push(Invalid::field(
                    field.clone(),
                    format!(
                        "'{id}' shares process '{}' with other nodes; a scaled node needs its own process group",
                        n.process
                    ),
                ));
            }
            for (name, v) in [("ttft_ms", b.ttft_ms), ("itl_ms", b.itl_ms)] {
                if v.is_some_and(|v| !positive(v)) {
                    out.push(Invalid::field(
                        format!("{field}.{name}"),
                        "must be a positive number",
                    ));
                }
            }
            if b.min == 0 {
                out.push(Invalid::field(
                    format!("{field}.min"),
                    "must be at least 1 (a router needs a worker to route to)",
                ));
            }
            if b.max < b.min {
                out.push(Invalid::field(
                    format!("{field}.max"),
                    format!("must be at least min ({})", b.min),
                ));
            } else if !(b.min..=b.max).contains(&n.replicas) {
                out.push(Invalid::field(
                    format!("{field}.min"),
                    format!(
                        "'{id}' starts with {} replicas, outside [{}, {}]",
                        n.replicas, b.min, b.max
                    ),
                ));
            }
        }
        out
    }
}

impl PlannerConfig {
    /// The percentile as a fraction (0.9).
    pub fn quantile(&self) -> f64 {
        self.percentile / 100.0
    }
}
