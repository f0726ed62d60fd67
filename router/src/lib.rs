//! dyn-router: the `route` kind and everything it routes by — the radix index of workers'
//! caches ([`indexer`]), fed by the KV events and load metrics whose wire formats live in
//! `kv`, the cost model and policies — plus the `remote_prefill` kind
//! ([`remote_prefill`]) and the router's metrics ([`metrics`]). Like `dynamo-kv-router`, it is
//! usable and benchmarkable on its own: it depends on core and the protocol only, never on
//! the tokenizers, the kernels, the runtime's planes, the frontend, the planner or an engine.
//!
//! `route`: picks the worker that will serve each request, and records it in the request
//! (`target`) so the runtime sends it there.
//!
//! The router watches discovery for the instances of the node that takes its output, so
//! workers joining or leaving are seen at once. Policies:
//!
//! - `kv` (KV-cache aware, [`kv_aware`]): takes the worker with the lowest predicted time to
//!   first token ([`cost`]: its prefill queue and the prompt's uncached tokens, from the step
//!   times workers report), within load bounds, from an index ([`indexer`]) the workers' KV
//!   events feed ([`follow`]) — or its own decisions when there are no events — and this
//!   router's pending requests; [`quality`] counts how well it used the caches;
//! - `round_robin`, `random`, `least_loaded` (fewest active requests from this router),
//!   `power_of_two` (the less loaded of two random workers) ([`policy`]).
//!
//! Every policy tracks its requests per worker ([`sequences`]) through the request's context
//! hooks: on route, first token, and when the request is over for any reason. `dyn inspect`
//! asks through [`inspect`].
//!
//! One router (per worker node it feeds) is made of parts, each a module that owns its state
//! and what reads or changes it: `workers` (the node's instances, which are live, their
//! places), `loads` (each worker's load as counted and as reported), `placement` (the policy,
//! its index and quality counts), `affinity` (sessions bound to workers, shared between
//! routers), `avoidance` (circuit breakers, and the worker a resent request failed on) and
//! `adapters` (the LoRA adapters each worker holds), beside [`admission`]. `config` holds the
//! settings, `start` assembles a router and its background tasks; this file routes a request
//! through the parts.
//!
//! ```yaml
//! route: {kind: route, inputs: [preprocess], config: {policy: kv, miss_weight: 2.0}}
//! ```

mod adapters;
pub mod admission;
mod affinity;
mod avoidance;
mod config;
pub mod cost;
pub mod follow;
pub mod health;
pub mod indexer;
pub mod inspect;
pub mod kv_aware;
mod loads;
pub mod metrics;
mod placement;
pub mod policy;
pub mod pools;
pub mod quality;
pub mod remote_prefill;
pub mod sequences;
pub mod sessions;
#[cfg(test)]
mod sim;
mod start;
mod workers;

use std::collections::HashMap;
use std::sync::Arc;

use dyn_core::planes::Instance;
use dyn_core::{Ctx, Input, OpError, Operator, Output};
use dyn_protocol::types::{Precedence, PreprocessedRequest};
use futures::StreamExt;

use adapters::Adapters;
use affinity::Affinity;
use avoidance::Avoidance;
use cost::CostModel;
use loads::Loads;
use placement::Placement;
use policy::View;
pub use policy::{Decision, Policy, PromptRef};
use workers::Workers;

pub use config::RouteConfig;

/// Each pool's rule and router, in the order they are tried.
type Pools = Arc<[(pools::PoolRule, Arc<Inner>)]>;

pub struct Route {
    inner: Arc<Inner>,
    _task: tokio_util::task::AbortOnDropHandle<()>,
    _tick: Option<tokio_util::task::AbortOnDropHandle<()>>,
    _sessions: Option<tokio_util::task::AbortOnDropHandle<()>>,
    _charges: Option<tokio_util::task::AbortOnDropHandle<()>>,
    /// Over several pools: each one's rule and router (`inner` is the first's).
    pools: Option<Pools>,
    /// The other pools' routers, kept running.
    _pool_routes: Vec<Route>,
}

impl Route {
    /// Route `tokens` (with `cache_salt` `salt`, see [`kv::salt_hash`]) among the workers,
    /// as a request through this node would be (for kinds that choose among a pool of their
    /// own, like `remote_prefill`): the worker's load counts the request until `ctx` is done.
    pub fn choose(
        &self,
        ctx: &Ctx,
        prompt: PromptRef<'_>,
        lora: Option<&str>,
    ) -> Result<u64, OpError> {
        self.inner
            .route(ctx, prompt, lora, None, Precedence::default())
            .map(|(w, _)| w)
    }

    /// Live workers, less those the request plane saw fail.
    pub fn live(&self) -> Vec<u64> {
        self.inner.workers.live()
    }

    /// Worker `id`'s discovery record, while it is registered.
    pub fn instance(&self, id: u64) -> Option<Instance> {
        self.inner.workers.instance(id)
    }

    /// Requests on the live workers: per worker, what its load metrics last said (running +
    /// waiting, from every router) or what this router has sent it and not seen finish,
    /// whichever is more (metrics lag a burst by up to their publishing interval).
    pub fn busy(&self) -> u64 {
        self.inner.loads.busy(self.inner.workers.live())
    }

    /// What `dyn inspect workers` shows of this router.
    pub fn workers_answer(&self) -> inspect::WorkersAnswer {
        self.inner.workers_answer()
    }

    /// What `dyn inspect route` shows: where `tokens` would go.
    pub fn route_answer(
        &self,
        tokens: &[u32],
        lora: Option<&str>,
    ) -> Result<inspect::RouteAnswer, String> {
        self.inner.route_answer(tokens, None, lora)
    }

    /// What `dyn inspect kv` shows of this router's index.
    pub fn kv_answer(&self, args: &inspect::KvArgs) -> Result<inspect::KvAnswer, String> {
        self.inner.kv_answer(args)
    }
}

/// One router among the instances of one worker node, in parts (see the crate's doc).
pub(crate) struct Inner {
    config: RouteConfig,
    /// The node's instances, live or not.
    workers: Workers,
    /// Requests wait here for room when the graph says so.
    admission: Option<Arc<admission::Admission>>,
    /// Each worker's load, as this router counts it and as the worker reports it.
    loads: Loads,
    /// The policy (for `kv`, its index) that chooses, and how well it used the caches.
    placement: Placement,
    /// Sessions bound to workers (`session_affinity`).
    sessions: Option<Affinity>,
    /// Workers left out of routing: open breakers, and a resent request's last worker.
    avoidance: Avoidance,
    /// The LoRA adapters each worker holds.
    adapters: Adapters,
}

impl Inner {
    /// Each live worker's places, for every admission step.
    fn live_places(&self) -> Vec<u32> {
        self.workers
            .places_of(self.config.admission.as_ref(), true)
            .into_iter()
            .map(|(_, p)| p)
            .collect()
    }

    /// `worker`'s places, with admission.
    fn places(&self, worker: u64) -> Option<u32> {
        self.workers
            .places_of(self.config.admission.as_ref(), false)
            .into_iter()
            .find_map(|(w, p)| (w == worker).then_some(p))
    }

    /// True while the KV index cannot follow the workers' events: with `kv_events: false`,
    /// or while the event plane is down. The router then records its own decisions.
    fn approximate(&self) -> bool {
        !self.config.kv_events || !self.workers.planes.events.connected()
    }

    /// Decide where `tokens` (unsalted) would go, without recording anything.
    #[cfg(test)]
    fn decide(&self, tokens: &[u32]) -> Result<Decision, OpError> {
        let memo = dyn_protocol::kv::PromptHashes::default();
        self.decide_without(PromptRef::new(tokens, None, &memo), None, &|_| false)
    }

    /// Decide among the live workers `left_out` does not name (among all of them when it
    /// names every one: leaving workers out never empties the pool).
    /// `lora`: the key of the request's adapter ([`dyn_protocol::types::LoraRef::key`]).
    fn decide_without(
        &self,
        prompt: PromptRef<'_>,
        lora: Option<&str>,
        left_out: &(dyn Fn(u64) -> bool + Sync),
    ) -> Result<Decision, OpError> {
        let all = self.workers.live();
        if all.is_empty() {
            return Err(self.workers.unavailable());
        }
        let kept: Vec<u64> = all.iter().copied().filter(|w| !left_out(*w)).collect();
        let live = if kept.is_empty() { all } else { kept };
        let holders: Option<Vec<u64>> = lora.map(|key| self.adapters.holders(key, &live));
        let reported = self.loads.reported.lock();
        let view = View {
            live: &live,
            instances: &self.workers.instances,
            active: &self.loads.active,
            reported: &reported,
            lora_holders: holders.as_deref(),
        };
        self.placement
            .policy
            .decide(prompt, &view)
            .ok_or_else(|| self.workers.unavailable())
    }

    /// The predicted time to first token of `tokens` on the worker this router would choose,
    /// milliseconds (the `kv` policy's `time` cost; `None` for the others).
    fn predicted_ttft_ms(&self, prompt: PromptRef<'_>, lora: Option<&str>) -> Option<f64> {
        if self.config.policy != Policy::Kv || self.config.cost != CostModel::Time {
            return None;
        }
        let d = self.decide_without(prompt, lora, &|_| false).ok()?;
        d.candidates
            .iter()
            .find(|c| c.worker == d.worker)
            .map(cost::Candidate::ttft_ms)
    }

    /// This router's requests on `worker` that a request of `precedence` would wait behind
    /// there: those that come before it or level with it where the engines preempt
    /// (`admission.preempt`), else all.
    fn before(&self, worker: u64, precedence: Precedence) -> u32 {
        match &self.admission {
            Some(a) if a.preempts() => self.loads.active.ahead(worker, precedence),
            _ => self.loads.active.load(worker).requests,
        }
    }

    /// The worker `session` is bound to, if it may still take the session's next request
    /// (of `precedence`): live, and under its bound of requests in flight from this router
    /// that come before it or level with it.
    fn affinity(
        &self,
        session: &str,
        precedence: Precedence,
        now: std::time::Instant,
    ) -> Option<u64> {
        let sessions = self.sessions.as_ref()?;
        let w = sessions.table.get(session, now)?;
        let bound = self
            .config
            .session_affinity
            .as_ref()
            .and_then(|a| a.max_active)
            .or_else(|| self.places(w));
        let room = bound.is_none_or(|b| self.before(w, precedence) < b);
        let healthy = self.avoidance.health.usable(w, now);
        (room && healthy && self.workers.live().contains(&w)).then_some(w)
    }

    /// Decide, and count the request against its worker until it is over; the worker and
    /// how many of the prompt's tokens it caches. A request of a bound session goes to its
    /// worker while that one has room (`session_affinity`). `salt`: its `cache_salt`.
    fn route(
        &self,
        ctx: &Ctx,
        prompt: PromptRef<'_>,
        lora: Option<&str>,
        session: Option<&str>,
        precedence: Precedence,
    ) -> Result<(u64, usize), OpError> {
        let now = std::time::Instant::now();
        // A resent request (its last worker failed) goes elsewhere; workers whose breaker is
        // open are left out, and with admission, workers where it would not start at once
        // (as many requests as places come before it or level with it).
        let failed_here = self.avoidance.failed_here(ctx.id().as_str());
        // Each worker's places, read once (not once per candidate).
        let places: HashMap<u64, u32> = self
            .workers
            .places_of(self.config.admission.as_ref(), false)
            .into_iter()
            .collect();
        let left_out = |w: u64| {
            Some(w) == failed_here
                || !self.avoidance.health.usable(w, now)
                || places
                    .get(&w)
                    .is_some_and(|&n| self.before(w, precedence) >= n)
        };
        let mut d = self.decide_without(prompt, lora, &left_out)?;
        if let (Some(s), Some(sessions)) = (session, &self.sessions) {
            // (Not back to the worker the request just failed on.)
            if let Some(w) = self
                .affinity(s, precedence, now)
                .filter(|w| Some(*w) != failed_here)
            {
                d.worker = w;
            }
            sessions.bind(s, d.worker, now, &self.workers.planes.events);
        }
        self.placement.quality.record(&d);
        if let Some(key) = lora {
            self.adapters.hold(d.worker, key, &self.workers);
        }
        let cached = d.cached_tokens(prompt.tokens.len());
        let prefill = (prompt.tokens.len() - cached) as u64;
        if let Some(kv) = &self.placement.kv
            && self.approximate()
        {
            kv.record_own_decision(d.worker, &d.blocks);
        }
        let hashes = d.blocks.iter().map(|b| b.block_hash).collect();
        let active = Arc::new(
            self.loads
                .active
                .start(d.worker, prefill, hashes, precedence),
        );
        let first = active.clone();
        ctx.on_first_output(move || first.first_token());
        ctx.on_done(move || drop(active));
        self.avoidance
            .watch(ctx, d.worker, now, &self.workers.target);
        Ok((d.worker, cached))
    }
}

impl Operator for Route {
    type In = PreprocessedRequest;
    type Out = PreprocessedRequest;

    fn call(&self, ctx: Ctx, input: Input<PreprocessedRequest>) -> Output<PreprocessedRequest> {
        let (first, pools) = (self.inner.clone(), self.pools.clone());
        input
            .then(move |mut req| {
                let (ctx, pools) = (ctx.clone(), pools.clone());
                let s = &req.routing;
                let lora = s.lora.as_ref().map(dyn_protocol::types::LoraRef::key);
                let salt = dyn_protocol::kv::request_salt(s);
                let inner = match &pools {
                    None => first.clone(),
                    Some(p) => pick_pool(p, &req, salt, lora.as_deref(), &ctx),
                };
                async move {
                    // With no live worker there is nothing to wait for a place on: the request
                    // is refused at once below (503 `no_worker_available`), as without
                    // admission, rather than after `max_wait_s` as if the node were busy.
                    if let Some(a) = inner.admission.as_ref().filter(|_| inner.workers.any_live()) {
                        let ask = admission::Ask {
                            priority: req.routing.priority,
                            tenant: req.routing.tenant.as_deref().unwrap_or_default(),
                            tokens: req.token_ids.len() as u64 + u64::from(req.stop.max_tokens),
                        };
                        let permit = a.admit(&ctx, ask).await?;
                        req.routing.yields = permit.precedence().yields;
                        ctx.on_done(move || drop(permit));
                    }
                    let prompt = PromptRef::new(&req.token_ids, salt, &req.hashes);
                    let (worker, cached) = inner.route(
                        &ctx,
                        prompt,
                        lora.as_deref(),
                        req.routing.session.as_deref(),
                        req.routing.precedence(),
                    )?;
                    tracing::debug!(request_id = %ctx.id(), worker_id = format_args!("{worker:x}"), cached, yields = req.routing.yields, tenant = req.routing.tenant.as_deref().unwrap_or_default(), "Routed");
                    req.target = Some(worker.into());
                    req.cached_tokens = u32::try_from(cached).unwrap_or(u32::MAX);
                    Ok(req)
                }
            })
            .boxed()
    }
}

/// The pool for `req` ([`pools::choose`]), counted in `dyn_router_pool_requests_total`.
fn pick_pool(
    pools: &[(pools::PoolRule, Arc<Inner>)],
    req: &PreprocessedRequest,
    salt: Option<u64>,
    lora: Option<&str>,
    ctx: &Ctx,
) -> Arc<Inner> {
    let rules: Vec<&pools::PoolRule> = pools.iter().map(|(r, _)| r).collect();
    let (i, why) = pools::choose(
        &rules,
        req.token_ids.len(),
        &req.routing.targets,
        |i| !pools[i].1.workers.live().is_empty(),
        |i| {
            let prompt = PromptRef::new(&req.token_ids, salt, &req.hashes);
            pools[i].1.predicted_ttft_ms(prompt, lora)
        },
    );
    let (rule, inner) = &pools[i];
    metrics::ROUTER
        .pool_requests
        .with_label_values(&[inner.placement.quality.node(), rule.node.as_str()])
        .inc();
    tracing::debug!(request_id = %ctx.id(), pool = %rule.node, why = ?why, prompt_tokens = req.token_ids.len(), "Pool chosen");
    inner.clone()
}

#[cfg(test)]
mod tests;
