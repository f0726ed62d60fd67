//! `route`: picks the worker that will serve each request, and records it in the request
//! (`target`) so the runtime sends it there.
//!
//! The router watches discovery for the instances of the node that takes its output, so
//! workers joining or leaving are seen at once. Policies:
//!
//! - `kv` (KV-cache aware): hashes the prompt into blocks, asks the [`Indexer`] how much of it
//!   each worker caches, and takes the cheapest worker by [`kv_router::candidates`]. The index
//!   is fed by the workers' KV events on the event plane, applied by a background task (a gap
//!   in a worker's event ids drops its blocks and asks it for a full dump). With
//!   `kv_events: false` (engines that publish none) the router records its own decisions
//!   instead and forgets them after `approx_ttl_s`.
//! - `round_robin`, `random`, `least_loaded` (fewest active requests from this router),
//!   `power_of_two` (the less loaded of two random workers).
//!
//! Every policy tracks its requests per worker ([`ActiveSequences`]) through the request's
//! context hooks: on route, first token, and when the request is over for any reason.
//!
//! ```yaml
//! route: {kind: route, inputs: [preprocess], config: {policy: kv, overlap_weight: 1.0}}
//! ```

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use dyn_pipeline::planes::{EventBus, Instance, LiveInstances, Planes};
use dyn_pipeline::registry::Role;
use dyn_pipeline::runtime::ENDPOINT;
use dyn_pipeline::{
    BuildCx, BuildError, Ctx, Input, Inspect, Inspectables, Invalid, OpError, Operator,
    OperatorConfig, Output,
};
use futures::StreamExt;
use parking_lot::{Mutex, RwLock};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use serde_json::{Value, json};

use super::indexer::{Applied, Indexer};
use super::kv::{
    BlockHash, KvEventData, LoadMetrics, ResyncRequest, RouterEvent, block_hashes,
    kv_events_subject, kv_resync_subject, load_metrics_subject,
};
use super::kv_router::{self, ActiveSequences, Candidate};
use super::types::PreprocessedRequest;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    #[default]
    RoundRobin,
    Random,
    LeastLoaded,
    PowerOfTwo,
    Kv,
}

fn one() -> f64 {
    1.0
}
fn yes() -> bool {
    true
}
fn ttl() -> f64 {
    120.0
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    #[serde(default)]
    pub policy: Policy,
    /// `kv`: weight of the blocks a worker would have to prefill against its decode load.
    #[serde(default = "one")]
    pub overlap_weight: f64,
    /// `kv`: 0 picks the cheapest worker; above 0 samples, more evenly the higher it is.
    #[serde(default)]
    pub temperature: f64,
    /// `kv`: the workers publish KV events; `false` makes the router track its own decisions.
    #[serde(default = "yes")]
    pub kv_events: bool,
    /// `kv` without events: how long a routed prompt counts as cached on its worker.
    #[serde(default = "ttl")]
    pub approx_ttl_s: f64,
    /// `kv`: tokens per KV block; by default what the workers announce (16 until they do).
    #[serde(default)]
    pub block_size: Option<u32>,
}

impl Default for RouteConfig {
    fn default() -> Self {
        Self {
            policy: Policy::default(),
            overlap_weight: one(),
            temperature: 0.0,
            kv_events: true,
            approx_ttl_s: ttl(),
            block_size: None,
        }
    }
}

/// Block size until the workers announce theirs (vLLM's default).
const DEFAULT_BLOCK_SIZE: u32 = 16;

impl OperatorConfig for RouteConfig {
    const KIND: &'static str = "route";
    const SUMMARY: &'static str = "Chooses the worker for each request (policy: kv, round_robin, random, least_loaded, power_of_two)";
    const ROLE: Role = Role::Router;
    type Op = Route;

    fn validate(&self) -> Vec<Invalid> {
        let mut out = Vec::new();
        let mut check = |name: &str, ok: bool, what: &str| {
            if !ok {
                out.push(Invalid::field(name, what));
            }
        };
        check(
            "overlap_weight",
            self.overlap_weight.is_finite() && self.overlap_weight >= 0.0,
            "must be a number ≥ 0",
        );
        check(
            "temperature",
            self.temperature.is_finite() && self.temperature >= 0.0,
            "must be a number ≥ 0",
        );
        check(
            "approx_ttl_s",
            self.approx_ttl_s.is_finite() && self.approx_ttl_s > 0.0,
            "must be a positive number of seconds",
        );
        check(
            "block_size",
            self.block_size != Some(0),
            "must be at least 1",
        );
        out
    }

    async fn build(&self, cx: &BuildCx) -> Result<Route, BuildError> {
        let [target] = cx.consumers.as_slice() else {
            return Err(BuildError::new(
                "route needs exactly one node taking its output (the workers to choose from)",
            ));
        };
        let route = self.start(cx, target).await?;
        let shown: Arc<dyn Inspect> = route.inner.clone();
        cx.service::<Inspectables>()
            .await?
            .register(&cx.node, &shown);
        Ok(route)
    }
}

impl RouteConfig {
    /// A router among the instances of node `target`, not shown in `dyn inspect` on its own
    /// (kinds that route a pool of their own, like `remote_prefill`, show it through themselves).
    pub async fn start(&self, cx: &BuildCx, target: &str) -> Result<Route, BuildError> {
        let prefix = Instance::prefix(&cx.namespace, target, ENDPOINT);
        let workers =
            cx.planes.live(&prefix).await.map_err(|e| {
                BuildError::new(format!("cannot watch the workers of '{target}': {e}"))
            })?;
        // A router that starts after its workers learns their block size from discovery, before
        // any load metrics arrive.
        let announced = workers
            .read()
            .iter()
            .find_map(|i| {
                i.metadata
                    .get("block_size")
                    .and_then(serde_json::Value::as_u64)
            })
            .and_then(|b| u32::try_from(b).ok());
        let kv = (self.policy == Policy::Kv).then(|| KvState {
            index: RwLock::new(Indexer::new()),
            block_size: AtomicU32::new(self.block_size.or(announced).unwrap_or(0)),
            approx: Mutex::new(HashMap::new()),
        });
        let inner = Arc::new(Inner {
            target: target.to_owned(),
            workers,
            config: self.clone(),
            active: Arc::default(),
            kv,
            metrics: Mutex::new(HashMap::new()),
            rng: Mutex::new(StdRng::from_os_rng()),
            planes: cx.planes.clone(),
        });
        let follow = follow_workers(
            inner.clone(),
            cx.planes.events.clone(),
            cx.namespace.clone(),
            self.policy == Policy::Kv && self.kv_events,
        )
        .await
        .map_err(|e| BuildError::new(format!("cannot follow the workers' events: {e}")))?;
        let task = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(follow));
        Ok(Route { inner, _task: task })
    }
}

pub struct Route {
    inner: Arc<Inner>,
    _task: tokio_util::task::AbortOnDropHandle<()>,
}

impl Route {
    /// Route `tokens` among the workers, as a request through this node would be (for kinds
    /// that choose among a pool of their own, like `remote_prefill`): the worker's load counts
    /// the request until `ctx` is done.
    pub fn choose(&self, ctx: &Ctx, tokens: &[u32]) -> Result<u64, OpError> {
        self.inner.route(ctx, tokens).map(|(w, _)| w)
    }

    /// Live workers, less those the request plane saw fail.
    pub fn live(&self) -> Vec<u64> {
        self.inner.live()
    }

    /// Requests on the live workers: per worker, what its load metrics last said (running +
    /// waiting, from every router) or what this router has sent it and not seen finish,
    /// whichever is more (metrics lag a burst by up to their publishing interval).
    pub fn busy(&self) -> u64 {
        let metrics = self.inner.metrics.lock();
        self.inner
            .live()
            .into_iter()
            .map(|w| {
                let reported = metrics.get(&w).map_or(0, |m| {
                    u64::from(m.requests_running) + u64::from(m.requests_waiting)
                });
                reported.max(u64::from(self.inner.active.load(w).requests))
            })
            .sum()
    }

    /// What `dyn inspect` asks a route node.
    pub fn inspect(&self, query: &str, args: &Value) -> Result<Value, String> {
        Inspect::inspect(&*self.inner, query, args)
    }
}

struct Inner {
    target: String,
    workers: Arc<LiveInstances>,
    config: RouteConfig,
    active: Arc<ActiveSequences>,
    kv: Option<KvState>,
    /// The latest load metrics per worker.
    metrics: Mutex<HashMap<u64, LoadMetrics>>,
    rng: Mutex<StdRng>,
    /// For the request plane's view of unreachable workers and the event plane's health.
    planes: Planes,
}

/// What the `kv` policy knows of the workers' caches.
struct KvState {
    index: RwLock<Indexer>,
    /// 0 until configured or announced.
    block_size: AtomicU32,
    /// Approximate mode: when each (worker, block) the router sent there was last routed.
    approx: Mutex<HashMap<(u64, u64), Instant>>,
}

impl KvState {
    fn block_size(&self) -> usize {
        match self.block_size.load(Ordering::Relaxed) {
            0 => DEFAULT_BLOCK_SIZE as usize,
            n => n as usize,
        }
    }
}

/// One routing decision, with what it was based on.
#[derive(Debug, Clone)]
pub struct Decision {
    pub worker: u64,
    /// The `kv` policy's terms per worker (empty for other policies).
    pub candidates: Vec<Candidate>,
    pub prompt_blocks: usize,
    pub block_size: usize,
    /// The prompt's full blocks (`kv` only).
    pub blocks: Vec<BlockHash>,
}

impl Inner {
    fn unavailable(&self) -> OpError {
        OpError::unavailable(format!("no worker of '{}' is available", self.target))
    }

    /// Workers in discovery, less those the request plane just saw fail (their lease has
    /// not run out yet, but a request sent there would be lost).
    fn live(&self) -> Vec<u64> {
        self.workers
            .read()
            .iter()
            .map(|i| i.instance_id)
            .filter(|id| !self.planes.is_down(*id))
            .collect()
    }

    /// True while the KV index cannot follow the workers' events: with `kv_events: false`,
    /// or while the event plane is down. The router then records its own decisions.
    fn approximate(&self) -> bool {
        !self.config.kv_events || !self.planes.events.connected()
    }

    /// Decide where `tokens` would go, without recording anything.
    fn decide(&self, tokens: &[u32]) -> Result<Decision, OpError> {
        let live = self.live();
        if live.is_empty() {
            return Err(self.unavailable());
        }
        // The generator is locked only to draw: hashing and index lookups run concurrently.
        let least = |ids: &[u64], rng: &mut StdRng| {
            let loads: Vec<u32> = ids.iter().map(|w| self.active.load(*w).requests).collect();
            let min = loads.iter().copied().min().unwrap_or(0);
            let tied: Vec<u64> = ids
                .iter()
                .zip(&loads)
                .filter(|(_, l)| **l == min)
                .map(|(w, _)| *w)
                .collect();
            tied[rng.random_range(0..tied.len())]
        };
        let plain = |worker| Decision {
            worker,
            candidates: Vec::new(),
            prompt_blocks: 0,
            block_size: 0,
            blocks: Vec::new(),
        };
        let worker = match self.config.policy {
            Policy::RoundRobin => {
                return self
                    .workers
                    .round_robin(|i| !self.planes.is_down(i.instance_id))
                    .map(|i| plain(i.instance_id))
                    .ok_or_else(|| self.unavailable());
            }
            Policy::Random => live[self.rng.lock().random_range(0..live.len())],
            Policy::LeastLoaded => least(&live, &mut self.rng.lock()),
            Policy::PowerOfTwo => {
                let mut rng = self.rng.lock();
                let a = live[rng.random_range(0..live.len())];
                let b = live[rng.random_range(0..live.len())];
                least(&[a, b], &mut rng)
            }
            Policy::Kv => {
                let Some(kv) = &self.kv else {
                    return Err(OpError::internal("kv policy without KV state"));
                };
                let bs = kv.block_size();
                let blocks = block_hashes(tokens, bs);
                let seqs: Vec<u64> = blocks.iter().map(|b| b.block_hash).collect();
                let matches = kv.index.read().find_matches(&seqs);
                let prompt_blocks = tokens.len().div_ceil(bs);
                let candidates = kv_router::candidates(
                    &live,
                    &matches,
                    &seqs,
                    prompt_blocks,
                    self.config.overlap_weight,
                    &self.active,
                );
                let i =
                    kv_router::choose(&candidates, self.config.temperature, &mut *self.rng.lock())
                        .ok_or_else(|| self.unavailable())?;
                return Ok(Decision {
                    worker: candidates[i].worker,
                    candidates,
                    prompt_blocks,
                    block_size: bs,
                    blocks,
                });
            }
        };
        Ok(plain(worker))
    }

    /// Decide, and count the request against its worker until it is over; the worker and
    /// how many of the prompt's tokens it caches.
    fn route(&self, ctx: &Ctx, tokens: &[u32]) -> Result<(u64, usize), OpError> {
        let d = self.decide(tokens)?;
        let cached = d
            .candidates
            .iter()
            .find(|c| c.worker == d.worker)
            .map_or(0, |c| (c.matched_blocks * d.block_size).min(tokens.len()));
        let prefill = (tokens.len() - cached) as u64;
        if let Some(kv) = &self.kv
            && self.approximate()
        {
            self.record_own_decision(kv, d.worker, &d.blocks);
        }
        let hashes = d.blocks.iter().map(|b| b.block_hash).collect();
        let active = Arc::new(self.active.start(d.worker, prefill, hashes));
        let first = active.clone();
        ctx.on_first_output(move || first.first_token());
        ctx.on_done(move || drop(active));
        Ok((d.worker, cached))
    }

    /// Approximate mode: the prompt's blocks now count as cached on `worker`.
    fn record_own_decision(&self, kv: &KvState, worker: u64, blocks: &[BlockHash]) {
        if blocks.is_empty() {
            return;
        }
        let now = Instant::now();
        {
            let mut approx = kv.approx.lock();
            for b in blocks {
                approx.insert((worker, b.block_hash), now);
            }
        }
        kv.index.write().apply_data(
            worker,
            &KvEventData::Stored {
                parent_hash: None,
                blocks: blocks.to_vec(),
            },
        );
    }
}

/// Keep the workers' load metrics and (`kv`) apply their KV events to the index; once a
/// second drop departed workers, expire approximate records, and ask again for dumps still
/// missing.
async fn follow_workers(
    inner: Arc<Inner>,
    events: Arc<dyn EventBus>,
    namespace: String,
    kv_events: bool,
) -> Result<impl std::future::Future<Output = ()>, dyn_pipeline::planes::PlaneError> {
    let node = inner.target.clone();
    let mut kv_sub = if kv_events {
        Some(
            events
                .subscribe(&kv_events_subject(&namespace, &node))
                .await?,
        )
    } else {
        None
    };
    let mut load_sub = events
        .subscribe(&load_metrics_subject(&namespace, &node))
        .await?;
    let resync_subject = kv_resync_subject(&namespace, &node);
    Ok(async move {
        let kv = inner.kv.as_ref();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let mut awaiting: HashMap<u64, Instant> = HashMap::new();
        let mut events_up = true;
        let ask = |worker_id: u64| {
            let events = events.clone();
            let subject = resync_subject.clone();
            async move {
                let Ok(payload) = serde_json::to_vec(&ResyncRequest { worker_id }) else {
                    return;
                };
                if let Err(e) = events.publish(&subject, payload.into()).await {
                    tracing::warn!(error = %e, "Cannot ask for a KV dump");
                }
            }
        };
        loop {
            tokio::select! {
                Some(ev) = async { match kv_sub.as_mut() { Some(s) => s.next().await, None => std::future::pending().await } } => {
                    let Ok(ev) = serde_json::from_slice::<RouterEvent>(&ev.payload) else {
                        tracing::warn!("Ignoring a malformed KV event");
                        continue;
                    };
                    let Some(kv) = kv else { continue };
                    let applied = kv.index.write().apply(ev.worker_id, &ev.event);
                    match applied {
                        Applied::Gap { expected, got } => {
                            tracing::warn!(worker_id = format_args!("{:x}", ev.worker_id), expected, got, "KV events lost; asking the worker for a dump");
                            awaiting.insert(ev.worker_id, Instant::now());
                            ask(ev.worker_id).await;
                        }
                        Applied::Ok if ev.event.data == KvEventData::Cleared => {
                            awaiting.remove(&ev.worker_id);
                        }
                        Applied::Full => tracing::warn!(worker_id = format_args!("{:x}", ev.worker_id), "Too many workers for the KV index; ignoring this one"),
                        _ => {}
                    }
                }
                Some(ev) = load_sub.next() => {
                    let Ok(m) = serde_json::from_slice::<LoadMetrics>(&ev.payload) else {
                        tracing::warn!("Ignoring malformed load metrics");
                        continue;
                    };
                    if let Some(kv) = kv && m.block_size > 0 && inner.config.block_size.is_none() {
                        kv.block_size.store(m.block_size, Ordering::Relaxed);
                    }
                    inner.metrics.lock().insert(m.worker_id, m);
                }
                _ = tick.tick() => {
                    let live = inner.live();
                    inner.metrics.lock().retain(|w, _| live.contains(w));
                    let Some(kv) = kv else { continue };
                    let gone: Vec<u64> = kv.index.read().worker_ids().filter(|w| !live.contains(w)).collect();
                    if !gone.is_empty() {
                        let mut index = kv.index.write();
                        for w in &gone {
                            index.remove_worker(*w);
                            awaiting.remove(w);
                        }
                    }
                    let up = events.connected();
                    if kv_events && up != events_up {
                        if up {
                            // Events were lost meanwhile: rebuild every worker's blocks from a
                            // dump, which replaces the decisions recorded during the outage.
                            tracing::info!("Event plane is back; resyncing the KV index from every worker");
                            kv.approx.lock().clear();
                            let stale = Instant::now().checked_sub(Duration::from_secs(1)).unwrap_or_else(Instant::now);
                            for w in &live {
                                awaiting.insert(*w, stale);
                            }
                        } else {
                            tracing::warn!("Event plane is down; routing on this router's own decisions until it is back");
                        }
                        events_up = up;
                    }
                    if !kv_events || !up {
                        expire(kv, Duration::from_secs_f64(inner.config.approx_ttl_s));
                    }
                    for (w, since) in awaiting.iter_mut() {
                        if since.elapsed() >= Duration::from_secs(1) {
                            *since = Instant::now();
                            ask(*w).await;
                        }
                    }
                }
            }
        }
    })
}

fn hex(id: u64) -> String {
    format!("{id:x}")
}

/// `dyn inspect`: `workers`, `route` (`{"tokens": [..]}`) and `kv` (`{"worker": "hex id",
/// "top": n}`).
impl Inspect for Inner {
    fn inspect(&self, query: &str, args: &Value) -> Result<Value, String> {
        let policy = serde_json::to_value(policy_name(self.config.policy)).unwrap_or_default();
        match query {
            "workers" => {
                let live = self.live();
                let metrics = self.metrics.lock().clone();
                let index = self.kv.as_ref().map(|kv| kv.index.read());
                let mut ids: Vec<u64> = live.clone();
                if let Some(ix) = &index {
                    ids.extend(ix.worker_ids().filter(|w| !live.contains(w)));
                }
                ids.sort_unstable();
                let workers: Vec<Value> = ids
                    .iter()
                    .map(|&w| {
                        let load = self.active.load(w);
                        let m = metrics.get(&w);
                        json!({
                            "worker_id": hex(w),
                            "live": live.contains(&w),
                            "active_requests": load.requests,
                            "pending_prefill_tokens": load.prefill_tokens,
                            "active_blocks_routed": load.decode_blocks,
                            "indexed_blocks": index.as_ref().map(|ix| ix.worker_blocks(w)),
                            "requests_running": m.map(|m| m.requests_running),
                            "requests_waiting": m.map(|m| m.requests_waiting),
                            "kv_active_blocks": m.map(|m| m.kv_active_blocks),
                            "kv_total_blocks": m.map(|m| m.kv_total_blocks),
                            "prefix_cache_hit_rate": m.map(|m| m.prefix_cache_hit_rate),
                        })
                    })
                    .collect();
                Ok(json!({"policy": policy, "target": self.target, "workers": workers}))
            }
            "route" => {
                let tokens: Vec<u32> = serde_json::from_value(args["tokens"].clone())
                    .map_err(|_| "route needs {\"tokens\": [token ids]}".to_owned())?;
                let d = self.decide(&tokens).map_err(|e| e.message)?;
                let candidates: Vec<Value> = d
                    .candidates
                    .iter()
                    .map(|c| {
                        json!({
                            "worker_id": hex(c.worker),
                            "matched_blocks": c.matched_blocks,
                            "prefill_blocks": c.prefill_blocks,
                            "active_requests": c.load.requests,
                            "decode_blocks": c.load.decode_blocks,
                            "cost": c.cost,
                        })
                    })
                    .collect();
                Ok(json!({
                    "policy": policy,
                    "worker_id": hex(d.worker),
                    "prompt_tokens": tokens.len(),
                    "block_size": d.block_size,
                    "prompt_blocks": d.prompt_blocks,
                    "overlap_weight": self.config.overlap_weight,
                    "temperature": self.config.temperature,
                    "candidates": candidates,
                }))
            }
            "kv" => {
                let Some(kv) = &self.kv else {
                    return Err(format!(
                        "policy {} keeps no KV index",
                        policy_name(self.config.policy)
                    ));
                };
                let only = match args.get("worker").and_then(Value::as_str) {
                    Some(h) => Some(
                        u64::from_str_radix(h, 16)
                            .map_err(|_| format!("worker {h:?} is not a hex worker id"))?,
                    ),
                    None => None,
                };
                let top = args.get("top").and_then(Value::as_u64).unwrap_or(5) as usize;
                let bs = kv.block_size();
                let ix = kv.index.read();
                let st = ix.stats();
                let mut ids: Vec<u64> = ix
                    .worker_ids()
                    .filter(|w| only.is_none_or(|o| o == *w))
                    .collect();
                ids.sort_unstable();
                let workers: Vec<Value> = ids
                    .iter()
                    .map(|&w| json!({"worker_id": hex(w), "blocks": ix.worker_blocks(w)}))
                    .collect();
                let prefixes: Vec<Value> = ix
                    .top_prefixes(top)
                    .into_iter()
                    .filter(|(_, _, ws)| only.is_none_or(|o| ws.contains(&o)))
                    .map(|(depth, hash, ws)| {
                        json!({
                            "blocks": depth,
                            "tokens": depth * bs,
                            "hash": hex(hash),
                            "workers": ws.into_iter().map(hex).collect::<Vec<_>>(),
                        })
                    })
                    .collect();
                Ok(json!({
                    "block_size": bs,
                    "tree_nodes": st.nodes,
                    "stored_blocks": st.worker_blocks,
                    "bytes": st.bytes,
                    "bytes_per_block": if st.worker_blocks > 0 { st.bytes as f64 / st.worker_blocks as f64 } else { 0.0 },
                    "workers": workers,
                    "top_shared_prefixes": prefixes,
                }))
            }
            other => Err(format!(
                "unknown query {other:?} for a route node; known: workers, route, kv"
            )),
        }
    }
}

fn policy_name(p: Policy) -> &'static str {
    match p {
        Policy::RoundRobin => "round_robin",
        Policy::Random => "random",
        Policy::LeastLoaded => "least_loaded",
        Policy::PowerOfTwo => "power_of_two",
        Policy::Kv => "kv",
    }
}

/// Approximate mode: forget blocks not routed again within `ttl`.
fn expire(kv: &KvState, ttl: Duration) {
    let mut by_worker: HashMap<u64, Vec<u64>> = HashMap::new();
    kv.approx.lock().retain(|(w, h), at| {
        let keep = at.elapsed() < ttl;
        if !keep {
            by_worker.entry(*w).or_default().push(*h);
        }
        keep
    });
    if by_worker.is_empty() {
        return;
    }
    let mut index = kv.index.write();
    for (w, block_hashes) in by_worker {
        index.apply_data(w, &KvEventData::Removed { block_hashes });
    }
}

impl Operator for Route {
    type In = PreprocessedRequest;
    type Out = PreprocessedRequest;

    fn call(&self, ctx: Ctx, input: Input<PreprocessedRequest>) -> Output<PreprocessedRequest> {
        let inner = self.inner.clone();
        input
            .map(move |mut req| {
                let (worker, cached) = inner.route(&ctx, &req.token_ids)?;
                tracing::debug!(request_id = %ctx.id(), worker_id = format_args!("{worker:x}"), cached, "Routed");
                req.target = Some(worker);
                req.cached_tokens = u32::try_from(cached).unwrap_or(u32::MAX);
                Ok(req)
            })
            .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dyn_pipeline::planes::{Planes, Transport};
    use futures::stream;

    fn cx(planes: &Planes) -> BuildCx {
        crate::testing::cx("route", 1, &["decode"], planes)
    }

    async fn route_once(r: &Route) -> Result<PreprocessedRequest, OpError> {
        let mut out = r.call(
            Ctx::new(),
            stream::iter([crate::testing::preprocessed(vec![1], 1)]).boxed(),
        );
        out.next().await.expect("one item")
    }

    #[tokio::test]
    async fn cycles_through_live_workers_and_is_unavailable_without_any() {
        let planes = Planes::embedded();
        let r = RouteConfig::default()
            .build(&cx(&planes))
            .await
            .expect("builds");
        let e = route_once(&r).await.expect_err("no workers");
        assert_eq!(e.kind, dyn_pipeline::ErrorKind::Unavailable);

        register(&planes, &[10, 11]).await;
        // The watch applies registrations asynchronously.
        until(|| r.inner.live().len() == 2).await;
        let mut picked = Vec::new();
        for _ in 0..4 {
            picked.push(
                route_once(&r)
                    .await
                    .expect("routed")
                    .target
                    .expect("target"),
            );
        }
        picked.sort_unstable();
        assert_eq!(picked, [10, 10, 11, 11]);
    }

    async fn register(planes: &Planes, ids: &[u64]) {
        for &id in ids {
            let i = Instance {
                namespace: "ns".into(),
                component: "decode".into(),
                endpoint: ENDPOINT.into(),
                instance_id: id,
                transport: Transport::InProcess,
                metadata: Default::default(),
            };
            planes.discovery.register(i).await.expect("register");
        }
    }

    /// Poll until `f` holds (the route's watch and event task run asynchronously).
    async fn until(mut f: impl FnMut() -> bool) {
        for _ in 0..500 {
            if f() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("condition never held");
    }

    /// A route with `policy` (and `config`'s other settings) over live workers `ids`.
    async fn started(planes: &Planes, config: RouteConfig, ids: &[u64]) -> Route {
        let r = config.build(&cx(planes)).await.expect("builds");
        register(planes, ids).await;
        until(|| r.inner.live().len() == ids.len()).await;
        r
    }

    /// Publish worker `worker`'s first KV event: it stored the full blocks of `tokens`.
    async fn publish_stored(planes: &Planes, worker: u64, tokens: &[u32]) {
        let ev = RouterEvent {
            worker_id: worker,
            event: crate::llm::kv::KvCacheEvent {
                event_id: 0,
                dp_rank: 0,
                data: KvEventData::Stored {
                    parent_hash: None,
                    blocks: block_hashes(tokens, 16),
                },
            },
        };
        let payload = serde_json::to_vec(&ev).expect("json");
        planes
            .events
            .publish("dyn.ns.decode.kv_events", payload.into())
            .await
            .expect("publish");
    }

    async fn route_with(r: &Route, ctx: Ctx, tokens: Vec<u32>) -> u64 {
        let mut out = r.call(
            ctx,
            stream::iter([crate::testing::preprocessed(tokens, 1)]).boxed(),
        );
        out.next()
            .await
            .expect("item")
            .expect("routed")
            .target
            .expect("target")
    }

    #[tokio::test]
    async fn kv_policy_follows_the_cached_prefix() {
        let planes = Planes::embedded();
        let config = RouteConfig {
            policy: Policy::Kv,
            ..RouteConfig::default()
        };
        let r = started(&planes, config, &[10, 11]).await;
        let prompt: Vec<u32> = (0..64).collect();
        publish_stored(&planes, 11, &prompt).await;
        let kv = r.inner.kv.as_ref().expect("kv state");
        until(|| kv.index.read().worker_blocks(11) == 4).await;
        let d = r.inner.decide(&prompt).expect("decides");
        assert_eq!(d.worker, 11);
        let c11 = d.candidates.iter().find(|c| c.worker == 11).expect("11");
        assert_eq!(
            (c11.matched_blocks, c11.prefill_blocks, c11.cost),
            (4, 0, 4.0)
        );
        // While the request is active its blocks count against worker 11; once it is over
        // they are released.
        let ctx = Ctx::new();
        assert_eq!(route_with(&r, ctx.clone(), prompt.clone()).await, 11);
        assert_eq!(r.inner.active.load(11).decode_blocks, 4);
        assert_eq!(r.inner.active.load(11).prefill_tokens, 0, "fully cached");
        drop(ctx);
        until(|| r.inner.active.load(11) == kv_router::Load::default()).await;
    }

    #[tokio::test]
    async fn a_departed_worker_leaves_the_index() {
        let planes = Planes::embedded();
        let config = RouteConfig {
            policy: Policy::Kv,
            ..RouteConfig::default()
        };
        let r = started(&planes, config, &[10, 11]).await;
        publish_stored(&planes, 11, &(0..32).collect::<Vec<_>>()).await;
        let kv = r.inner.kv.as_ref().expect("kv state");
        until(|| kv.index.read().worker_blocks(11) == 2).await;
        let key = Instance {
            namespace: "ns".into(),
            component: "decode".into(),
            endpoint: ENDPOINT.into(),
            instance_id: 11,
            transport: Transport::InProcess,
            metadata: Default::default(),
        }
        .key();
        planes.discovery.deregister(&key).await.expect("deregister");
        // Reconciled on the router's once-a-second tick.
        until(|| kv.index.read().stats().nodes == 0).await;
        assert_eq!(
            kv.index.read().worker_ids().collect::<Vec<_>>(),
            Vec::<u64>::new()
        );
    }

    #[tokio::test]
    async fn least_loaded_counts_active_requests_until_they_finish() {
        let planes = Planes::embedded();
        let config = RouteConfig {
            policy: Policy::LeastLoaded,
            ..RouteConfig::default()
        };
        let r = started(&planes, config, &[1, 2]).await;
        let a = Ctx::new();
        let first = route_with(&r, a.clone(), vec![1, 2, 3]).await;
        let b = Ctx::new();
        let second = route_with(&r, b.clone(), vec![1, 2, 3]).await;
        assert_ne!(first, second, "the busy worker is avoided");
        a.first_output();
        assert_eq!(r.inner.active.load(first).prefill_tokens, 0);
        assert_eq!(r.inner.active.load(first).requests, 1);
        drop(a);
        assert_eq!(r.inner.active.load(first).requests, 0);
        assert_eq!(route_with(&r, Ctx::new(), vec![1]).await, first);
        drop(b);
        assert!(r.inner.active.snapshot().is_empty());
    }

    #[tokio::test]
    async fn approximate_kv_remembers_its_own_decisions_until_the_ttl() {
        let planes = Planes::embedded();
        let config = RouteConfig {
            policy: Policy::Kv,
            kv_events: false,
            ..RouteConfig::default()
        };
        let r = started(&planes, config, &[1, 2, 3]).await;
        let prompt: Vec<u32> = (100..164).collect();
        let w = route_with(&r, Ctx::new(), prompt.clone()).await;
        let kv = r.inner.kv.as_ref().expect("kv");
        assert_eq!(r.inner.decide(&prompt).expect("decides").worker, w);
        // Not yet expired with a long TTL; gone with a zero one.
        expire(kv, Duration::from_secs(3600));
        assert_eq!(kv.index.read().worker_blocks(w), 4);
        expire(kv, Duration::ZERO);
        assert_eq!(kv.index.read().worker_blocks(w), 0);
        assert!(kv.approx.lock().is_empty());
    }

    #[test]
    fn bad_settings_are_reported() {
        let c = RouteConfig {
            overlap_weight: -1.0,
            temperature: f64::NAN,
            approx_ttl_s: 0.0,
            block_size: Some(0),
            ..RouteConfig::default()
        };
        assert_eq!(c.validate().len(), 4);
        assert!(RouteConfig::default().validate().is_empty());
    }

    #[tokio::test]
    async fn needs_exactly_one_consumer() {
        let planes = Planes::embedded();
        let mut c = cx(&planes);
        c.consumers.clear();
        assert!(RouteConfig::default().build(&c).await.is_err());
    }
}
