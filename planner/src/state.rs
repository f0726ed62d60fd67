//! What the planner publishes after each decision, and the frontend's mirror of it.
//!
//! The planner may run in the supervisor (multi-process) or beside the graph (embedded); the
//! `http` ingress follows [`state_subject`] either way through [`PlannerView`], serves the
//! latest state at `/admin/planner` (`dyn inspect planner`) and sets the `dyn_planner_*`
//! gauges from it, so one scrape of the frontend shows desired and actual replicas.

use std::sync::{Arc, Weak};

use dyn_core::{BuildCx, BuildError, Service};
use futures::StreamExt;
use parking_lot::RwLock;
use serde::{Deserialize, Serialize};

use super::config::PredictorKind;
use super::decide::{NodeDecision, Observation, Prediction};

/// Event-plane subject of the planner's decisions.
pub fn state_subject(namespace: &str) -> String {
    format!("dyn.{namespace}.planner.state")
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannerState {
    pub at_unix_ms: u64,
    /// What carries out its decisions: `embedded` or `processes`.
    pub connector: String,
    /// `profile` (replicas from the performance model) or `reactive`.
    pub mode: String,
    pub predictor: PredictorKind,
    pub ttft_ms: f64,
    pub itl_ms: f64,
    pub percentile: f64,
    pub interval_s: f64,
    pub cooldown_s: f64,
    pub observed: Observation,
    pub predicted: Prediction,
    pub nodes: Vec<NodeState>,
}

impl PlannerState {
    /// Set the planner gauges to this published state.
    fn export_metrics(&self) {
        let s = self;
        let m = &*crate::metrics::PLANNER;
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
}

/// A node's decision and what runs after it was carried out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeState {
    #[serde(flatten)]
    pub decision: NodeDecision,
    /// Replicas running after the decision was carried out.
    pub actual: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The latest planner state, as the frontend saw it; a [`Service`].
pub struct PlannerView {
    latest: Arc<RwLock<Option<PlannerState>>>,
}

impl Service for PlannerView {
    async fn start(cx: &BuildCx) -> Result<Self, BuildError> {
        let latest: Arc<RwLock<Option<PlannerState>>> = Arc::default();
        let mut states = cx
            .planes
            .events
            .subscribe(&state_subject(&cx.namespace))
            .await
            .map_err(|e| BuildError::new(format!("cannot follow the planner: {e}")))?;
        let weak: Weak<RwLock<Option<PlannerState>>> = Arc::downgrade(&latest);
        tokio::spawn(async move {
            while let Some(ev) = states.next().await {
                let Some(latest) = weak.upgrade() else { return };
                match serde_json::from_slice::<PlannerState>(&ev.payload) {
                    Ok(s) => {
                        s.export_metrics();
                        *latest.write() = Some(s);
                    }
                    Err(e) => tracing::debug!(error = %e, "Bad planner state message"),
                }
            }
        });
        Ok(Self { latest })
    }
}

impl PlannerView {
    pub fn latest(&self) -> Option<PlannerState> {
        self.latest.read().clone()
    }
}
