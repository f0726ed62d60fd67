//! The planner's loop: observe, predict, decide, act, publish — once per interval.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dyn_core::Connector;
use dyn_core::planes::EventBus;

use super::config::PlannerConfig;
use super::decide::{Phase, PoolObservation, Prediction, decide, node_view};
use super::observe::Observer;
use super::predict::{Predictor, Smoothed};
use super::profile::{Profile, ProfileError};
use super::state::{NodeState, PlannerState, state_subject};

/// What the planner needs from the graph, resolved before it starts (so a bad profile is an
/// error at `dyn graph up`, not a log line later).
pub struct Plan {
    pub cfg: PlannerConfig,
    pub namespace: String,
    pub phases: BTreeMap<String, Phase>,
    pub profile: Option<Profile>,
}

/// What the planner reads of the compiled graph (the runtime's `CompiledGraph`, which this
/// crate does not depend on): its namespace, the directory its relative paths start from, and
/// each node's kind.
pub struct GraphFacts<'a> {
    pub namespace: &'a str,
    pub base_dir: &'a Path,
    /// `(node id, kind name)` for every node.
    pub kinds: Vec<(&'a str, &'a str)>,
}

impl Plan {
    /// The planner of a graph whose `planner:` section is `cfg`, with its profile loaded.
    pub fn of(cfg: &PlannerConfig, graph: &GraphFacts<'_>) -> Result<Self, ProfileError> {
        // A graph with prefill workers is disaggregated: its decode workers only decode.
        let disaggregated = graph.kinds.iter().any(|(_, k)| *k == "prefill");
        let kind_of = |id: &str| {
            graph
                .kinds
                .iter()
                .find(|(n, _)| *n == id)
                .map_or("", |(_, k)| *k)
        };
        let phases = cfg
            .nodes
            .keys()
            .map(|id| {
                let kind = kind_of(id);
                let phase = match kind {
                    "prefill" => Phase::Prefill,
                    _ if disaggregated => Phase::Decode,
                    _ => Phase::Both,
                };
                (id.clone(), phase)
            })
            .collect();
        let profile = match &cfg.profile {
            Some(p) => Some(Profile::load(&resolve(graph.base_dir, p))?),
            None => None,
        };
        Ok(Self {
            cfg: cfg.clone(),
            namespace: graph.namespace.to_owned(),
            phases,
            profile,
        })
    }
}

fn resolve(base: &Path, p: &Path) -> std::path::PathBuf {
    if p.is_absolute() {
        p.to_owned()
    } else {
        base.join(p)
    }
}

/// One traffic series' predictors: the request rate (the configured predictor) and the mean
/// prompt and output lengths (smoothed).
struct Series {
    rate: Predictor,
    isl: Smoothed,
    osl: Smoothed,
}

impl Series {
    fn new(cfg: &PlannerConfig) -> Self {
        Self {
            rate: Predictor::new(cfg.predictor),
            isl: Smoothed::default(),
            osl: Smoothed::default(),
        }
    }

    /// Take this interval's figures; the next interval's prediction (lengths from the
    /// profile's first decode point until traffic shows them).
    fn next(
        &mut self,
        seen: &PoolObservation,
        fallback: Option<&super::profile::DecodePoint>,
    ) -> Prediction {
        self.rate.observe(seen.request_rate);
        if let Some(x) = seen.isl {
            self.isl.observe(x);
        }
        if let Some(x) = seen.osl {
            self.osl.observe(x);
        }
        Prediction {
            request_rate: self.rate.predict().unwrap_or(0.0),
            isl: self.isl.get().or(fallback.map(|d| d.isl)).unwrap_or(0.0),
            osl: self.osl.get().or(fallback.map(|d| d.osl)).unwrap_or(0.0),
        }
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Run the planner until dropped.
pub async fn run(plan: Plan, events: Arc<dyn EventBus>, connector: Arc<dyn Connector>) {
    let cfg = &plan.cfg;
    let nodes: Vec<String> = cfg.nodes.keys().cloned().collect();
    let observer = match Observer::start(
        events.clone(),
        &plan.namespace,
        nodes.clone(),
        cfg.quantile(),
    )
    .await
    {
        Ok(o) => o,
        Err(e) => {
            tracing::error!(error = %e, "The planner cannot follow the event plane; not scaling");
            return;
        }
    };
    let interval = Duration::from_secs_f64(cfg.interval_s);
    let mut all = Series::new(cfg);
    // Per pool (a node a router chooses among others, once seen as one): its own series.
    let mut pools: BTreeMap<String, Series> = BTreeMap::new();
    // Start-up counts as a change: no scale-down within the first cool-down.
    let mut changed: BTreeMap<String, Instant> =
        nodes.iter().map(|n| (n.clone(), Instant::now())).collect();
    let subject = state_subject(&plan.namespace);
    let mode = if plan.profile.is_some() {
        "profile"
    } else {
        "reactive"
    };
    tracing::info!(connector = connector.name(), mode, interval_s = cfg.interval_s, nodes = ?nodes, "Planner started");
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let mut last = Instant::now();
    loop {
        tick.tick().await;
        let now = Instant::now();
        let obs = observer.take(now - last);
        last = now;
        let fallback = plan.profile.as_ref().and_then(|p| p.decode.first());
        let whole = PoolObservation {
            request_rate: obs.request_rate,
            isl: obs.isl,
            osl: obs.osl,
            ttft_ms: obs.ttft_ms,
            itl_ms: obs.itl_ms,
        };
        let pred = all.next(&whole, fallback);
        for node in obs.pools.keys() {
            if nodes.contains(node) && !pools.contains_key(node) {
                pools.insert(node.clone(), Series::new(cfg));
            }
        }
        let mut pool_preds = BTreeMap::new();
        for (node, series) in &mut pools {
            let seen = obs.pools.get(node).cloned().unwrap_or_default();
            pool_preds.insert(node.clone(), series.next(&seen, fallback));
        }
        let mut states = Vec::new();
        for node in &nodes {
            let current = match connector.replicas(node).await {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(node, error = %e, "Planner cannot count replicas");
                    continue;
                }
            };
            let since = changed
                .get(node)
                .map_or(f64::INFINITY, |t| t.elapsed().as_secs_f64());
            let st = super::decide::NodeState {
                node,
                phase: plan.phases.get(node).copied().unwrap_or(Phase::Both),
                bounds: cfg.nodes[node],
                current,
                since_change_s: since,
            };
            // A pool is weighed on its own traffic and targets; any node on its own targets.
            let empty = PoolObservation::default();
            let pool = pools
                .contains_key(node)
                .then(|| obs.pools.get(node).unwrap_or(&empty));
            let (node_cfg, node_obs) = node_view(cfg, &obs, node, pool);
            let node_pred = pool_preds.get(node).unwrap_or(&pred);
            let d = decide(&node_cfg, plan.profile.as_ref(), &node_obs, node_pred, &st);
            let mut error = None;
            if d.desired != current {
                tracing::info!(node, from = current, to = d.desired, reason = %d.reason, "Planner scaling");
                if let Err(e) = connector.set_replicas(node, d.desired).await {
                    tracing::warn!(node, error = %e, "Planner could not scale");
                    error = Some(e.to_string());
                }
                changed.insert(node.clone(), Instant::now());
            } else {
                tracing::debug!(node, replicas = current, reason = %d.reason, "Planner keeps");
            }
            let actual = connector.replicas(node).await.unwrap_or(current);
            states.push(NodeState {
                decision: d,
                actual,
                error,
            });
        }
        let state = PlannerState {
            at_unix_ms: unix_ms(),
            connector: connector.name().into(),
            mode: mode.into(),
            predictor: cfg.predictor,
            ttft_ms: cfg.ttft_ms,
            itl_ms: cfg.itl_ms,
            percentile: cfg.percentile,
            interval_s: cfg.interval_s,
            cooldown_s: cfg.cooldown_s,
            observed: obs,
            predicted: pred,
            nodes: states,
        };
        match serde_json::to_vec(&state) {
            Ok(body) => {
                if let Err(e) = events.publish(&subject, body.into()).await {
                    tracing::debug!(error = %e, "Cannot publish the planner's state");
                }
            }
            Err(e) => tracing::warn!(error = %e, "Cannot encode the planner's state"),
        }
    }
}
