//! Admission control at the router: requests beyond what the workers have room for wait here,
//! in a bounded queue ordered by priority (lower first, as vLLM's `priority`), then deadline,
//! then arrival, instead of piling into the workers' own queues. Each finished request lets
//! the best waiting one go. A request is refused (503, `Retry-After`) when the queue is full
//! and it ranks last — a full queue refuses its worst entry to take a better one, so lower
//! classes are refused before higher ones — and as soon as its place in the queue says it
//! would wait past its deadline: requests finish at a rate the router measures (a moving
//! average of the gaps between them), so the `i`-th waiting one should start in about `i`
//! gaps ([`WAIT_MARGIN`] times over: better-ranked arrivals go ahead of it meanwhile). Most
//! refusals thus come at once, not after the wait they predict. A waiter whose client
//! hangs up simply leaves: its place is skipped. A request's own deadline
//! (`x-request-timeout`) bounds its wait when it is sooner than `max_wait_s`.
//!
//! **On by default**: a server that accepts whatever arrives collapses at a few times its
//! capacity (every request queues at the workers and none meets its latency), so a `route`
//! node admits unless told `admission: false`. Room: `per_worker` requests in flight from this
//! router per live worker (what `dyn bench` measures a worker sustains at the latency wanted),
//! by default each worker's own batch size as it advertises it in discovery (`max_num_seqs`;
//! [`UNADVERTISED_PLACES`] for a worker that does not, such as an external server).
//! [`Queue`] is the ordering alone; time is
//! tokio's clock, so the tests run on a paused, scripted one.
//!
//! **Tenants** (the API key's, or the ingress's tenant header) share the room by weight:
//! within a priority, the next request to go is the best-ranked one of the tenant that has been
//! served least for its weight — a virtual token counter (VTC, as AIBrix and llm-d use): each
//! request dispatched adds its budget (prompt + `max_tokens`, what OpenAI's token limits
//! count, since the router does not see the output) over the tenant's weight to its counter. A
//! tenant that starts waiting behind tenants served more is lifted to the lowest of theirs, not
//! left with credit banked while away, so a tenant sending ten times more cannot starve another
//! and an idle one cannot flood later. A full queue refuses the request that would go last
//! (each tenant's last, at its counter once its requests ahead are charged). Per-tenant rate limits (requests and tokens per minute,
//! token buckets holding a minute's worth) refuse at once with 429 `rate_limit_exceeded` and
//! the seconds until the bucket has room. Routers of the same node share their tenants'
//! charges over the event plane (every tick): the served counts are sums, so every router holds
//! the same ones whatever order charges reach it in, and a tenant's share is its share of the
//! node, whichever frontend its requests come through (the lifts stay each router's own).
//!
//! **Preemption** (`preempt`, on by default): the room is counted by [`Precedence`] — priority,
//! then whether a request gives way. A request goes at once, beyond the room, while fewer
//! requests than the places come before it or level with it; the router sends it to a worker
//! where one that comes after it runs, and the engine preempts that one for it (recomputing
//! its KV when it resumes, as vLLM's priority scheduling does). A request gives way when its
//! tenant held its share of the places or more as it went, unless that tenant is the one
//! served least lately. So at full occupancy an interactive request starts at once, and so
//! does a light tenant's burst, while the queue still orders everything else.
//!
//! ```yaml
//! route: {kind: route, inputs: [preprocess], config: {admission: {per_worker: 8, queue: 256, max_wait_s: 2,
//!   tenants: {acme: {weight: 4, requests_per_minute: 600}}, tenant_default: {weight: 1}}}}
//! ```

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

// tokio's clock, which tests can pause and advance.
use tokio::time::Instant;

use dyn_core::{Ctx, OpError};
use dyn_protocol::types::Precedence;

use super::metrics::ADMISSION;
use super::sequences::ByPrecedence;
use parking_lot::Mutex;
use serde::Deserialize;
use tokio::sync::oneshot;

/// The code of a request refused because the queue was full (and it ranked last).
pub const QUEUE_FULL: &str = "queue_full";
/// The code of a request that waited, or would wait, in the queue past its deadline.
pub const QUEUE_TIMEOUT: &str = "queue_timeout";

/// `route`'s `admission` settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Requests in flight per live worker before new ones wait; by default the batch size
    /// each worker advertises.
    #[serde(default)]
    pub per_worker: Option<u32>,
    /// Requests that may wait at once.
    #[serde(default = "queue")]
    pub queue: usize,
    /// How long a request may wait before it is refused.
    #[serde(default = "max_wait_s")]
    pub max_wait_s: f64,
    /// Named tenants' weights and limits.
    #[serde(default)]
    pub tenants: BTreeMap<String, TenantConfig>,
    /// Those of every other tenant, and of requests without one (each tenant counted on its
    /// own).
    #[serde(default)]
    pub tenant_default: TenantConfig,
    /// Places per live worker that no one tenant may take: kept free for the others, so a
    /// light tenant's request starts at once while a heavy one fills the rest (0: none; a
    /// single tenant then gets `per_worker - reserve`).
    #[serde(default)]
    pub reserve: u32,
    /// A request that comes before some in flight (a better priority, or a tenant under its
    /// share against one over it: [`Precedence`]) goes at once, beyond the room, to a worker
    /// where one of those runs, and the engine preempts that one for it (the native engine and
    /// the mocker do). Off: priorities and tenants only order the queue, for engines that
    /// would queue such a request instead (external workers do not get the priority).
    #[serde(default = "yes")]
    pub preempt: bool,
}

fn yes() -> bool {
    true
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            per_worker: None,
            queue: queue(),
            max_wait_s: max_wait_s(),
            tenants: BTreeMap::new(),
            tenant_default: TenantConfig::default(),
            reserve: 0,
            preempt: true,
        }
    }
}

/// The places of a worker that advertises no batch size (an external server) when
/// `per_worker` is not set: vLLM's default `max_num_seqs`, so such a worker's own queue
/// still decides, as it did before admission was on by default.
pub const UNADVERTISED_PLACES: u32 = 256;

impl AdmissionConfig {
    /// The places of a worker that advertises `max_num_seqs` (`per_worker` where set).
    pub fn places(&self, max_num_seqs: Option<u32>) -> u32 {
        self.per_worker
            .or(max_num_seqs)
            .unwrap_or(UNADVERTISED_PLACES)
            .max(1)
    }

    /// `admission` in a graph: `false` (or `null`) for none, `true` for the defaults, or the
    /// settings; absent, the defaults.
    pub fn deserialize_option<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Self>, D::Error> {
        // A visitor rather than an untagged enum: a mistake inside the settings keeps its own
        // error (an unknown field, with its position), and a switch read from YAML as text
        // (`--set route.admission=false`) is still a switch.
        struct Switch;
        impl<'de> serde::de::Visitor<'de> for Switch {
            type Value = Option<AdmissionConfig>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("`false`, `true` or the admission settings")
            }
            fn visit_bool<E: serde::de::Error>(self, on: bool) -> Result<Self::Value, E> {
                Ok(on.then(AdmissionConfig::default))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                match v {
                    "true" => self.visit_bool(true),
                    "false" => self.visit_bool(false),
                    // marked-yaml reads `null`, `~` and an empty value as text.
                    "null" | "~" | "" => Ok(None),
                    _ => Err(E::invalid_value(serde::de::Unexpected::Str(v), &self)),
                }
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_some<D: serde::Deserializer<'de>>(
                self,
                d: D,
            ) -> Result<Self::Value, D::Error> {
                d.deserialize_any(self)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                m: A,
            ) -> Result<Self::Value, A::Error> {
                AdmissionConfig::deserialize(serde::de::value::MapAccessDeserializer::new(m))
                    .map(Some)
            }
        }
        d.deserialize_any(Switch)
    }
}

/// One tenant's share and limits.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// Its share of the room relative to the others' (1 by default).
    #[serde(default = "one")]
    pub weight: f64,
    #[serde(default)]
    pub requests_per_minute: Option<u32>,
    /// Prompt + `max_tokens` per minute.
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
}

impl Default for TenantConfig {
    fn default() -> Self {
        Self {
            weight: 1.0,
            requests_per_minute: None,
            tokens_per_minute: None,
        }
    }
}

fn one() -> f64 {
    1.0
}

/// What admission needs to know of a request.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    /// Lower first.
    pub priority: i32,
    /// "" for none.
    pub tenant: &'a str,
    /// Its budget: prompt + `max_tokens`.
    pub tokens: u64,
}

impl Ask<'static> {
    /// A request of `priority` from no tenant, of one token.
    pub fn priority(priority: i32) -> Self {
        Self {
            priority,
            tenant: "",
            tokens: 1,
        }
    }
}

fn queue() -> usize {
    256
}
fn max_wait_s() -> f64 {
    2.0
}

/// Where a waiting request ranks: lower first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Rank {
    pub priority: i32,
    pub deadline: Instant,
    seq: u64,
}

/// The waiting requests, bounded: the best-ranked request (priority, then deadline, then
/// arrival) of the least-served tenant (its virtual token counter) goes first.
#[derive(Debug)]
pub struct Queue<T> {
    /// Each tenant's waiting requests, best first, with their cost (tokens over weight).
    waiting: HashMap<String, BTreeMap<Rank, (f64, T)>>,
    /// Each tenant's tokens served over its weight, by every router of the node: sums,
    /// so the routers agree whatever order the charges reach them in.
    served: HashMap<String, f64>,
    /// What this router adds to a tenant's count when it starts waiting behind tenants
    /// served more (VTC's lift): its counter is `served + lift`.
    lift: HashMap<String, f64>,
    /// The counter of the tenant this router served last: the floor of a tenant that starts
    /// waiting in an empty queue.
    last: f64,
    /// Tenants' charges made here since [`Queue::take_charged`], for the other routers.
    charged: Vec<(String, f64)>,
    /// Each tenant's recent service (tokens over weight, halving every [`RECENT_HALF_LIFE`])
    /// and when it was last brought up to date: who was served least lately, lifts aside.
    recent: HashMap<String, (f64, Instant)>,
    len: usize,
    cap: usize,
    seq: u64,
}

/// What pushing into a full queue did.
#[derive(Debug, PartialEq, Eq)]
pub enum Pushed<T> {
    /// Queued.
    Waiting,
    /// Queued in place of this worse entry, which is refused.
    Displaced(T),
    /// Not queued: it ranks last in a full queue.
    Refused(T),
}

/// Counters of idle tenants kept at most; beyond, the least served idle ones go (coming back,
/// they would be lifted to the waiting tenants' level anyway).
const SERVED_KEPT: usize = 4096;

impl<T> Queue<T> {
    pub fn new(cap: usize) -> Self {
        Self {
            waiting: HashMap::new(),
            served: HashMap::new(),
            lift: HashMap::new(),
            last: 0.0,
            charged: Vec::new(),
            recent: HashMap::new(),
            len: 0,
            cap,
            seq: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A tenant's counter: what it was served over its weight, plus its lift.
    pub fn counter(&self, tenant: &str) -> f64 {
        self.served.get(tenant).copied().unwrap_or(0.0)
            + self.lift.get(tenant).copied().unwrap_or(0.0)
    }

    /// Where `tenant`'s entry `rank` stands in the order the queue would empty in: its
    /// tenant's counter once the `ahead` costs of its requests before it are charged.
    fn projected(&self, tenant: &str, rank: &Rank, ahead: f64) -> (i32, f64, Instant, u64) {
        (
            rank.priority,
            self.counter(tenant) + ahead,
            rank.deadline,
            rank.seq,
        )
    }

    /// Counts `cost` (tokens over weight) as served to `tenant` here: a request that went
    /// without waiting is charged as one that waited. Kept for the other routers.
    pub fn charge(&mut self, tenant: &str, cost: f64) {
        if self.charged.len() < SERVED_KEPT {
            self.charged.push((tenant.to_owned(), cost));
        }
        self.credit(tenant, cost);
        self.last = self.counter(tenant);
    }

    /// The charges made here since last asked.
    pub fn take_charged(&mut self) -> Vec<(String, f64)> {
        std::mem::take(&mut self.charged)
    }

    /// Counts `cost` as served to `tenant` (here, or by another router of the node).
    pub fn credit(&mut self, tenant: &str, cost: f64) {
        *self.served.entry(tenant.to_owned()).or_default() += cost;
        let now = Instant::now();
        let r = self.recent.entry(tenant.to_owned()).or_insert((0.0, now));
        *r = (decayed(*r, now) + cost, now);
        if self.served.len() > SERVED_KEPT {
            self.forget_idle();
        }
    }

    /// Drops the least served idle tenants down to half the bound.
    fn forget_idle(&mut self) {
        let mut idle: Vec<(f64, String)> = self
            .served
            .iter()
            .filter(|(t, _)| !self.waiting.contains_key(*t))
            .map(|(t, _)| (self.counter(t), t.clone()))
            .collect();
        let drop = self
            .served
            .len()
            .saturating_sub(SERVED_KEPT / 2)
            .min(idle.len());
        if drop == 0 {
            return;
        }
        idle.select_nth_unstable_by(drop - 1, |a, b| a.0.total_cmp(&b.0));
        for (_, t) in idle.into_iter().take(drop) {
            self.served.remove(&t);
            self.lift.remove(&t);
            self.recent.remove(&t);
        }
    }

    /// `tenant`'s recent service at `now`.
    pub fn recent(&self, tenant: &str, now: Instant) -> f64 {
        self.recent.get(tenant).map_or(0.0, |r| decayed(*r, now))
    }

    /// `tenant` starts waiting with a request of `cost`: a counter below the waiting tenants'
    /// lowest (in an empty queue, below the tenant served last) is lifted to just under it —
    /// the request goes next, and once charged the tenant stands level with them — so time
    /// away from the queue banks no credit (VTC).
    pub fn lift_on_arrival(&mut self, tenant: &str, cost: f64) {
        if self.waiting.contains_key(tenant) {
            return;
        }
        let floor = self
            .waiting
            .keys()
            .map(|t| self.counter(t))
            .min_by(f64::total_cmp)
            .unwrap_or(self.last);
        let c = self.counter(tenant);
        let to = floor - cost;
        if c < to {
            *self.lift.entry(tenant.to_owned()).or_default() += to - c;
        }
    }

    pub fn push(
        &mut self,
        priority: i32,
        deadline: Instant,
        tenant: &str,
        cost: f64,
        item: T,
    ) -> Pushed<T> {
        self.seq += 1;
        let rank = Rank {
            priority,
            deadline,
            seq: self.seq,
        };
        self.lift_on_arrival(tenant, cost);
        if self.len >= self.cap {
            // The worst entry is the one that would go last: each tenant's last, at its
            // counter once the tenant's requests before it are served.
            let worst = self
                .waiting
                .iter()
                .filter_map(|(t, q)| {
                    let (r, (cost, _)) = q.last_key_value()?;
                    let ahead: f64 = q.values().map(|(c, _)| c).sum::<f64>() - cost;
                    Some((self.projected(t, r, ahead), t, *r))
                })
                .max_by(|a, b| cmp_key(&a.0, &b.0));
            let Some((worst_key, worst_tenant, worst_rank)) = worst else {
                return Pushed::Refused(item);
            };
            let ahead: f64 = self
                .waiting
                .get(tenant)
                .map_or(0.0, |q| q.values().map(|(c, _)| c).sum());
            if cmp_key(&worst_key, &self.projected(tenant, &rank, ahead)).is_le() {
                return Pushed::Refused(item);
            }
            let worst_tenant = worst_tenant.clone();
            let out = self.remove(&worst_tenant, &worst_rank);
            self.insert(tenant, rank, cost, item);
            return match out {
                Some(out) => Pushed::Displaced(out),
                None => Pushed::Waiting,
            };
        }
        self.insert(tenant, rank, cost, item);
        Pushed::Waiting
    }

    fn insert(&mut self, tenant: &str, rank: Rank, cost: f64, item: T) {
        self.waiting
            .entry(tenant.to_owned())
            .or_default()
            .insert(rank, (cost, item));
        self.len += 1;
    }

    fn remove(&mut self, tenant: &str, rank: &Rank) -> Option<T> {
        let q = self.waiting.get_mut(tenant)?;
        let (_, item) = q.remove(rank)?;
        if q.is_empty() {
            self.waiting.remove(tenant);
        }
        self.len -= 1;
        Some(item)
    }

    /// The next request to go, taken out and charged to its tenant.
    #[cfg(test)]
    pub fn pop(&mut self) -> Option<(Rank, T)> {
        let (tenant, rank) = self.peek_where(|_, _| true)?;
        self.take(&tenant, &rank).map(|(_, r, t)| (r, t))
    }

    /// The next request to go among each tenant's best-ranked one that `may_go` allows.
    pub fn peek_where(&self, may_go: impl Fn(&str, &Rank) -> bool) -> Option<(String, Rank)> {
        self.waiting
            .iter()
            .filter_map(|(t, q)| q.first_key_value().map(|(r, _)| (t, *r)))
            .filter(|(t, r)| may_go(t, r))
            .map(|(t, r)| (self.projected(t, &r, 0.0), t, r))
            .min_by(|a, b| cmp_key(&a.0, &b.0))
            .map(|(_, t, r)| (t.clone(), r))
    }

    /// Takes out `tenant`'s request `rank`, charged to it.
    pub fn take(&mut self, tenant: &str, rank: &Rank) -> Option<(String, Rank, T)> {
        let cost = self
            .waiting
            .get(tenant)
            .and_then(|q| q.get(rank))
            .map_or(0.0, |(c, _)| *c);
        let item = self.remove(tenant, rank)?;
        self.charge(tenant, cost);
        Some((tenant.to_owned(), *rank, item))
    }

    /// Keeps only the entries still waiting (their client has not left).
    pub fn retain(&mut self, mut waiting: impl FnMut(&T) -> bool) {
        for q in self.waiting.values_mut() {
            q.retain(|_, (_, v)| waiting(v));
        }
        self.waiting.retain(|_, q| !q.is_empty());
        self.len = self.waiting.values().map(BTreeMap::len).sum();
    }

    /// Takes out the entries `late(place, rank, entry)` says to, `place` being where each
    /// stands in the order they would go in now (0 goes next).
    pub fn take_late(&mut self, mut late: impl FnMut(usize, &Rank, &T) -> bool) -> Vec<T> {
        let mut all = Vec::with_capacity(self.len);
        for (t, q) in &self.waiting {
            let mut ahead = 0.0;
            for (r, (cost, _)) in q {
                all.push((self.projected(t, r, ahead), t.clone(), *r));
                ahead += cost;
            }
        }
        all.sort_by(|a, b| cmp_key(&a.0, &b.0));
        let waiting = &self.waiting;
        let out: Vec<(String, Rank)> = all
            .into_iter()
            .enumerate()
            .filter(|(i, (_, t, r))| {
                waiting
                    .get(t)
                    .and_then(|q| q.get(r))
                    .is_some_and(|(_, item)| late(*i, r, item))
            })
            .map(|(_, (_, t, r))| (t, r))
            .collect();
        out.iter().filter_map(|(t, r)| self.remove(t, r)).collect()
    }

    /// The tenants with requests waiting.
    pub fn tenants(&self) -> impl Iterator<Item = &str> {
        self.waiting.keys().map(String::as_str)
    }

    /// How many wait, by priority and by tenant.
    pub fn waiting_by(&self) -> (BTreeMap<i32, usize>, HashMap<&str, usize>) {
        let mut by_priority = BTreeMap::new();
        let mut by_tenant = HashMap::new();
        for (t, q) in &self.waiting {
            for r in q.keys() {
                *by_priority.entry(r.priority).or_default() += 1;
                *by_tenant.entry(t.as_str()).or_default() += 1;
            }
        }
        (by_priority, by_tenant)
    }

    /// What this router added to `tenant`'s counter on its arrivals.
    pub fn lift_of(&self, tenant: &str) -> f64 {
        self.lift.get(tenant).copied().unwrap_or(0.0)
    }

    /// Each tenant's tokens served over weight, node-wide.
    pub fn counters(&self) -> Vec<(String, f64)> {
        let mut out: Vec<(String, f64)> =
            self.served.iter().map(|(t, c)| (t.clone(), *c)).collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

/// How fast recent service is forgotten (see [`Queue::recent`]).
const RECENT_HALF_LIFE: Duration = Duration::from_secs(5);

/// A recent-service value `(value, at)` brought to `now`.
fn decayed((value, at): (f64, Instant), now: Instant) -> f64 {
    let halves = now.saturating_duration_since(at).as_secs_f64() / RECENT_HALF_LIFE.as_secs_f64();
    value * 0.5f64.powf(halves)
}

fn cmp_key(a: &(i32, f64, Instant, u64), b: &(i32, f64, Instant, u64)) -> std::cmp::Ordering {
    a.0.cmp(&b.0)
        .then(a.1.total_cmp(&b.1))
        .then(a.2.cmp(&b.2))
        .then(a.3.cmp(&b.3))
}

/// A waiting request: where its permit (or refusal) goes, and what its tenant's rate limits
/// took for it (given back if it is refused).
struct Waiter {
    tx: oneshot::Sender<Result<Permit, OpError>>,
    tenant: String,
    tokens: u64,
    /// When it started waiting.
    since: Instant,
}

/// Admission for one router.
pub struct Admission {
    config: AdmissionConfig,
    /// This router, in the charges it publishes.
    origin: u64,
    /// The route node, for the metrics.
    node: String,
    state: Mutex<State>,
    /// The places of each live worker now (the router's view).
    workers: Box<dyn Fn() -> Vec<u32> + Send + Sync>,
}

struct State {
    inflight: usize,
    /// Requests in flight by precedence.
    ranks: ByPrecedence,
    queue: Queue<Waiter>,
    /// Places each tenant holds.
    held: HashMap<String, usize>,
    /// Rate-limited tenants' buckets.
    buckets: HashMap<String, Bucket>,
    /// When a request last finished leaving a place for the queue, and the moving average of
    /// the gaps between such finishes.
    last_done: Option<Instant>,
    gap: Option<Duration>,
    /// When the newest waiter started waiting (none younger: nothing for the forecast to
    /// refuse).
    newest: Option<Instant>,
}

impl State {
    /// Requests in flight that come before a request of `p` or level with it.
    fn ahead(&self, p: Precedence) -> usize {
        self.ranks.ahead(p) as usize
    }

    /// Counts a request of `tenant` and `p` in flight.
    fn hold(&mut self, tenant: &str, p: Precedence) {
        self.inflight += 1;
        self.ranks.add(p);
        *self.held.entry(tenant.to_owned()).or_default() += 1;
    }

    /// A request of `tenant` and `p` is no longer in flight.
    fn unhold(&mut self, tenant: &str, p: Precedence) {
        self.inflight = self.inflight.saturating_sub(1);
        self.ranks.remove(p);
        self.release(tenant);
    }

    fn release(&mut self, tenant: &str) {
        if let Some(n) = self.held.get_mut(tenant) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.held.remove(tenant);
            }
        }
    }
}

/// What a router tells the others of the node: its tenants' charges, in order.
#[derive(Debug, Clone, PartialEq, serde::Serialize, Deserialize)]
pub struct Charges {
    pub origin: u64,
    pub charges: Vec<(String, f64)>,
}

/// The event-plane subject on which the routers of node `target` share tenants' charges.
pub fn charges_subject(namespace: &str, target: &str) -> String {
    format!("dyn.{namespace}.{target}.tenant_charges")
}

/// `dyn inspect queue`: a router's admission queue.
#[derive(Debug, Clone, serde::Serialize, Deserialize)]
pub struct QueueAnswer {
    pub in_flight: usize,
    /// Places: live workers × `per_worker`.
    pub room: usize,
    /// The places one tenant may hold (`room` less the reserve).
    pub tenant_room: usize,
    pub waiting: usize,
    /// The queue's bound.
    pub queue: usize,
    pub max_wait_s: f64,
    /// The moving average of the gaps between finishes (the refusal forecast's unit).
    pub finish_gap_ms: Option<f64>,
    pub waiting_by_priority: BTreeMap<i32, usize>,
    /// Tenants waiting, in flight, or with a counter, by name ("" for none).
    pub tenants: Vec<TenantRow>,
}

#[derive(Debug, Clone, serde::Serialize, Deserialize)]
pub struct TenantRow {
    pub tenant: String,
    pub weight: f64,
    pub in_flight: usize,
    pub waiting: usize,
    /// Tokens (prompt + `max_tokens`) admitted over its weight, by every router of the node.
    pub counter: f64,
    /// What this router added when it started waiting behind tenants served more (its
    /// place in the order is `counter + lift`).
    #[serde(default)]
    pub lift: f64,
}

/// A tenant's rate-limit buckets: requests and tokens left, refilled continuously up to a
/// minute's worth.
struct Bucket {
    requests: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn refill(&mut self, (rpm, tpm): (Option<f64>, Option<f64>), now: Instant) {
        let minutes = (now - self.at).as_secs_f64() / 60.0;
        self.at = now;
        if let Some(r) = rpm {
            self.requests = (self.requests + r * minutes).min(r);
        }
        if let Some(t) = tpm {
            self.tokens = (self.tokens + t * minutes).min(t);
        }
    }
}

/// Weight of the newest gap in the moving average.
const GAP_WEIGHT: f64 = 0.1;
/// A waiting request's predicted start is its place × the gap × this: better-ranked requests
/// arriving meanwhile go ahead of it, so a place is worth more than one gap.
const WAIT_MARGIN: f64 = 4.0;

/// Places: the live workers' places summed, and those one tenant may hold (less the
/// reserve on each worker).
#[derive(Debug, Clone, Copy)]
struct Room {
    places: usize,
    tenant_places: usize,
}

/// The tenants in flight or waiting, as [`Admission::precedence`] weighs them.
struct Active<'a> {
    weight: f64,
    room: Room,
    /// The two lowest recent services, with their tenants (infinite where fewer).
    lowest: [(f64, &'a str); 2],
    now: Instant,
}

/// How long after it starts waiting a request may still be refused by forecast: one that
/// passed it is kept for its turn — past `max_wait_s` if need be, up to twice that or its own
/// deadline — so that a refusal comes at once or (rarely) at that bound, and a request the
/// forecast let in is served late rather than refused late.
const REFUSE_WINDOW: Duration = Duration::from_millis(50);

/// A request's place among those in flight; dropping it (when the request is over) lets the
/// best waiting request go.
pub struct Permit {
    admission: Option<Arc<Admission>>,
    tenant: String,
    precedence: Precedence,
}

impl Permit {
    /// Where the request stands for a place at its worker (its priority, and whether it
    /// gives way: its tenant held its share of the places or more when it went).
    pub fn precedence(&self) -> Precedence {
        self.precedence
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(a) = self.admission.take() {
            let mut s = a.state.lock();
            s.unhold(&self.tenant, self.precedence);
            // Only a finish that leaves a place for the queue counts: one that brings requests
            // that went past the room back down to it lets no one wait less.
            let room = a.room();
            if s.inflight < room.places {
                let now = Instant::now();
                if let Some(last) = s.last_done {
                    let gap = now - last;
                    s.gap = Some(match s.gap {
                        Some(avg) => avg.mul_f64(1.0 - GAP_WEIGHT) + gap.mul_f64(GAP_WEIGHT),
                        None => gap,
                    });
                }
                s.last_done = Some(now);
            }
            a.dispatch(&mut s, room);
        }
    }
}

impl Admission {
    pub fn new(
        config: AdmissionConfig,
        node: &str,
        workers: impl Fn() -> Vec<u32> + Send + Sync + 'static,
    ) -> Arc<Self> {
        Arc::new(Self {
            origin: rand::random(),
            node: node.to_owned(),
            state: Mutex::new(State {
                inflight: 0,
                ranks: ByPrecedence::default(),
                queue: Queue::new(config.queue),
                buckets: HashMap::new(),
                held: HashMap::new(),
                last_done: None,
                gap: None,
                newest: None,
            }),
            config,
            workers: Box::new(workers),
        })
    }

    /// The places now (asks the router for its live workers once).
    fn room(&self) -> Room {
        let workers = (self.workers)();
        let reserve = self.config.reserve;
        Room {
            places: workers.iter().map(|&p| p as usize).sum(),
            // (A worker with fewer places than the reserve still lets a tenant have one.)
            tenant_places: workers
                .iter()
                .map(|&p| p.saturating_sub(reserve).max(1) as usize)
                .sum(),
        }
    }

    /// Requests in flight and waiting.
    pub fn counts(&self) -> (usize, usize) {
        let s = self.state.lock();
        (s.inflight, s.queue.len())
    }

    /// Where a request of `tenant` and `priority` sent now would stand (see [`Precedence`]):
    /// it gives way if its tenant holds its share of the places or more — the places shared
    /// by weight among the tenants in flight or waiting — unless it is the one served least
    /// of them lately ([`Queue::recent`], over weight: a light tenant's burst goes at once,
    /// where the virtual token counter, lifted level on each arrival, would make it wait).
    /// A tenant on its own gives way beyond the share it would have beside one more tenant
    /// of the default weight, so that a tenant arriving at a node that another fills finds
    /// requests that give way to it. Requests of no tenant never do.
    fn precedence(&self, s: &State, tenant: &str, priority: i32, active: &Active) -> Precedence {
        if !self.config.preempt || tenant.is_empty() {
            return Precedence {
                priority,
                yields: false,
            };
        }
        let held = s.held.get(tenant).copied().unwrap_or(0);
        let weight = self.tenant(tenant).weight;
        let share = active.room.places as f64 * weight
            / active
                .weight
                .max(weight + self.config.tenant_default.weight);
        let others = match active.lowest {
            [(_, t), (second, _)] if t == tenant => second,
            [(first, _), _] => first,
        };
        // (Alone, there are no others: infinity.)
        let least = others.is_finite() && s.queue.recent(tenant, active.now) < others;
        Precedence {
            priority,
            yields: held as f64 >= share && !least,
        }
    }

    /// The tenants in flight or waiting, and `also` if it is neither.
    fn active<'a>(&self, s: &'a State, also: Option<&'a str>, room: Room) -> Active<'a> {
        let mut names: Vec<&str> = s.held.keys().map(String::as_str).collect();
        names.extend(s.queue.tenants());
        names.extend(also);
        names.sort_unstable();
        names.dedup();
        let now = Instant::now();
        let mut lowest = [(f64::INFINITY, ""); 2];
        for &t in &names {
            let c = s.queue.recent(t, now);
            if c < lowest[0].0 {
                lowest = [(c, t), lowest[0]];
            } else if c < lowest[1].0 {
                lowest[1] = (c, t);
            }
        }
        Active {
            weight: names.iter().map(|t| self.tenant(t).weight).sum(),
            lowest,
            now,
            room,
        }
    }

    /// Whether a request of `tenant` standing at `p` may go now: fewer requests than the
    /// places come before it or level with it (the rest give way to it at their workers), and
    /// with a reserve, its tenant holds less than the places left to one tenant.
    fn may_start(&self, s: &State, tenant: &str, p: Precedence, room: Room) -> bool {
        let ahead = if self.config.preempt {
            s.ahead(p)
        } else {
            s.inflight
        };
        let held = s.held.get(tenant).copied().unwrap_or(0);
        ahead < room.places && (self.config.reserve == 0 || held < room.tenant_places)
    }

    /// Whether requests may go beyond the room, making running ones give way.
    pub fn preempts(&self) -> bool {
        self.config.preempt
    }

    /// Lets waiting requests go while there is room (their permits counted in flight).
    fn dispatch(self: &Arc<Self>, s: &mut State, room: Room) {
        // Requests whose clients left (or gave up waiting) are neither served nor charged.
        s.queue.retain(|w| !w.tx.is_closed());
        loop {
            let active = self.active(s, None, room);
            let state = &*s;
            let go = |t: &str, r: &Rank| {
                let p = self.precedence(state, t, r.priority, &active);
                self.may_start(state, t, p, room)
            };
            // Chosen, then taken: the queue cannot be borrowed while `go` reads the state.
            let Some((tenant, rank)) = s.queue.peek_where(go) else {
                break;
            };
            let p = self.precedence(s, &tenant, rank.priority, &active);
            let Some((tenant, _, waiter)) = s.queue.take(&tenant, &rank) else {
                break;
            };
            s.hold(&tenant, p);
            let permit = Permit {
                admission: Some(self.clone()),
                tenant,
                precedence: p,
            };
            if let Err(Ok(mut permit)) = waiter.tx.send(Ok(permit)) {
                // Its client left: the place goes back (not through the permit's drop, which
                // would take the lock held here).
                permit.admission = None;
                s.unhold(&permit.tenant, p);
            }
        }
        ADMISSION
            .waiting
            .with_label_values(&[&self.node])
            .set(s.queue.len() as i64);
    }

    /// Refuses now the waiting requests that would start past their deadline (at the measured
    /// rate of finishes), rather than when their deadline comes.
    fn shed(&self, s: &mut State) {
        let Some(gap) = s.gap else { return };
        let now = Instant::now();
        if s.newest.is_none_or(|t| now - t >= REFUSE_WINDOW) {
            return;
        }
        let late = s.queue.take_late(|i, r, w| {
            now - w.since < REFUSE_WINDOW
                && now + gap.mul_f64(WAIT_MARGIN * (i + 1) as f64) > r.deadline
        });
        for w in late {
            self.refund(s, &w.tenant, w.tokens);
            let _ =
                w.tx.send(Err(self.refused(late_error(self.config.max_wait_s))));
        }
    }

    fn refused(&self, e: OpError) -> OpError {
        let reason = e.code.as_deref().unwrap_or("other").to_owned();
        ADMISSION
            .refused
            .with_label_values(&[&self.node, &reason])
            .inc();
        e
    }

    /// `tenant`'s weight and limits.
    fn tenant(&self, tenant: &str) -> &TenantConfig {
        self.config
            .tenants
            .get(tenant)
            .unwrap_or(&self.config.tenant_default)
    }

    /// Takes a request from `tenant`'s buckets, or says in how many seconds there will be
    /// room (a request over a whole minute's tokens never fits: an hour).
    fn take(&self, s: &mut State, tenant: &str, tokens: u64) -> Result<(), u64> {
        let tc = self.tenant(tenant);
        if tc.requests_per_minute.is_none() && tc.tokens_per_minute.is_none() {
            return Ok(());
        }
        let now = Instant::now();
        if s.buckets.len() > SERVED_KEPT {
            // A bucket untouched for a minute is full again: the same as none.
            s.buckets
                .retain(|_, b| now - b.at < Duration::from_secs(60));
        }
        let limits = (
            tc.requests_per_minute.map(f64::from),
            tc.tokens_per_minute.map(|t| t as f64),
        );
        let b = s.buckets.entry(tenant.to_owned()).or_insert(Bucket {
            requests: limits.0.unwrap_or(0.0),
            tokens: limits.1.unwrap_or(0.0),
            at: now,
        });
        b.refill(limits, now);
        let need = [
            (limits.0, b.requests, 1.0),
            (limits.1, b.tokens, tokens as f64),
        ];
        let wait = need
            .iter()
            .filter_map(|&(limit, have, want)| {
                let limit = limit?;
                if want > limit {
                    return Some(3600.0);
                }
                (have < want).then(|| (want - have) / (limit / 60.0))
            })
            .fold(0.0f64, f64::max);
        if wait > 0.0 {
            return Err(wait.ceil() as u64);
        }
        b.requests -= 1.0;
        b.tokens -= tokens as f64;
        Ok(())
    }

    /// Gives back what a refused request took from its tenant's rate limits: a 503 does not
    /// count against them.
    fn refund(&self, s: &mut State, tenant: &str, tokens: u64) {
        let tc = self.tenant(tenant);
        if let Some(b) = s.buckets.get_mut(tenant) {
            if let Some(r) = tc.requests_per_minute {
                b.requests = (b.requests + 1.0).min(f64::from(r));
            }
            if let Some(t) = tc.tokens_per_minute {
                b.tokens = (b.tokens + tokens as f64).min(t as f64);
            }
        }
    }

    /// Wait for room for `ask`; the permit counts it in flight until dropped. Refused (503,
    /// [`QUEUE_FULL`] or [`QUEUE_TIMEOUT`]) when it cannot get room, and (429,
    /// `rate_limit_exceeded`) when its tenant is over a rate limit.
    pub async fn admit(self: &Arc<Self>, ctx: &Ctx, ask: Ask<'_>) -> Result<Permit, OpError> {
        let priority = ask.priority;
        let cost = ask.tokens as f64 / self.tenant(ask.tenant).weight;
        let wait = Duration::from_secs_f64(self.config.max_wait_s.max(0.0));
        // The request's own deadline (`x-request-timeout`) when it comes sooner.
        let queued = Instant::now();
        let deadline = match ctx.deadline() {
            Some(d) => (queued + wait).min(Instant::from_std(d)),
            None => queued + wait,
        };
        let rx = {
            let mut s = self.state.lock();
            if let Err(retry) = self.take(&mut s, ask.tenant, ask.tokens) {
                let e = OpError::rate_limited(
                    format!("this tenant is over its rate limit; try again in {retry} s"),
                    retry,
                );
                return Err(self.refused(e));
            }
            s.queue.retain(|w| !w.tx.is_closed());
            let room = self.room();
            let active = self.active(&s, Some(ask.tenant), room);
            let p = self.precedence(&s, ask.tenant, priority, &active);
            if s.queue.is_empty() && self.may_start(&s, ask.tenant, p, room) {
                s.hold(ask.tenant, p);
                s.queue.lift_on_arrival(ask.tenant, cost);
                s.queue.charge(ask.tenant, cost);
                drop(s);
                self.count_tokens(ask);
                return Ok(Permit {
                    admission: Some(self.clone()),
                    tenant: ask.tenant.to_owned(),
                    precedence: p,
                });
            }
            let (tx, rx) = oneshot::channel();
            let waiter = Waiter {
                tx,
                tenant: ask.tenant.to_owned(),
                tokens: ask.tokens,
                since: queued,
            };
            s.newest = Some(queued);
            match s.queue.push(priority, deadline, ask.tenant, cost, waiter) {
                Pushed::Waiting => {}
                Pushed::Displaced(worse) => {
                    self.refund(&mut s, &worse.tenant, worse.tokens);
                    let _ = worse.tx.send(Err(self.refused(full())));
                }
                Pushed::Refused(_) => {
                    self.refund(&mut s, ask.tenant, ask.tokens);
                    return Err(self.refused(full()));
                }
            }
            // Room may have opened meanwhile (more workers).
            self.dispatch(&mut s, self.room());
            self.shed(&mut s);
            rx
        };
        tracing::debug!(request_id = %ctx.id(), priority, tenant = ask.tenant, "Waiting for room");
        // Past the refusal window a request is kept for its turn (see [`REFUSE_WINDOW`]), up
        // to twice the wait its forecast was held to (its own deadline still ends it).
        let kept = match ctx.deadline() {
            Some(d) => (queued + wait * 2).min(Instant::from_std(d)),
            None => queued + wait * 2,
        };
        let answer = match tokio::time::timeout_at(kept, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(OpError::internal("the admission queue dropped a request")),
            Err(_) => {
                self.refund(&mut self.state.lock(), ask.tenant, ask.tokens);
                Err(self.refused(late_error(self.config.max_wait_s)))
            }
        };
        if answer.is_ok() {
            self.count_tokens(ask);
            // The label takes a client's number: a bounded set of them.
            let class = if (-16..=16).contains(&priority) {
                priority.to_string()
            } else {
                "other".to_owned()
            };
            ADMISSION
                .wait_seconds
                .with_label_values(&[&self.node, &class])
                .observe(queued.elapsed().as_secs_f64());
        }
        answer
    }

    fn count_tokens(&self, ask: Ask<'_>) {
        // The label takes the graph's names only: a header may carry any.
        let tenant = match ask.tenant {
            "" => "none",
            t if self.config.tenants.contains_key(t) => t,
            _ => "other",
        };
        ADMISSION
            .tenant_tokens
            .with_label_values(&[&self.node, tenant])
            .inc_by(ask.tokens);
    }

    /// This router's tenant charges since last asked, to publish (none: nothing to say).
    pub fn take_charges(&self) -> Option<Charges> {
        let charges = self.state.lock().queue.take_charged();
        (!charges.is_empty()).then_some(Charges {
            origin: self.origin,
            charges,
        })
    }

    /// Another router's charges (this router's own are skipped).
    pub fn apply_charges(&self, c: Charges) {
        if c.origin == self.origin {
            return;
        }
        let mut s = self.state.lock();
        for (tenant, cost) in &c.charges {
            s.queue.credit(tenant, *cost);
        }
    }

    /// The queue now, for `dyn inspect queue`.
    pub fn answer(&self) -> QueueAnswer {
        let room = self.room();
        let s = self.state.lock();
        let (by_priority, by_tenant) = s.queue.waiting_by();
        let counters: HashMap<String, f64> = s.queue.counters().into_iter().collect();
        let mut names: Vec<&str> = by_tenant.keys().copied().collect();
        names.extend(s.held.keys().map(String::as_str));
        names.extend(counters.keys().map(String::as_str));
        names.sort_unstable();
        names.dedup();
        let tenants = names
            .into_iter()
            .map(|t| {
                let tc = self.tenant(t);
                TenantRow {
                    tenant: t.to_owned(),
                    weight: tc.weight,
                    in_flight: s.held.get(t).copied().unwrap_or(0),
                    waiting: by_tenant.get(t).copied().unwrap_or(0),
                    counter: counters.get(t).copied().unwrap_or(0.0),
                    lift: s.queue.lift_of(t),
                }
            })
            .collect();
        QueueAnswer {
            in_flight: s.inflight,
            room: room.places,
            tenant_room: room.tenant_places,
            waiting: s.queue.len(),
            queue: self.config.queue,
            max_wait_s: self.config.max_wait_s,
            finish_gap_ms: s.gap.map(|g| g.as_secs_f64() * 1e3),
            waiting_by_priority: by_priority,
            tenants,
        }
    }

    /// Lets waiting requests go if workers joined (called on a timer by the router).
    pub fn tick(self: &Arc<Self>) {
        let mut s = self.state.lock();
        // (`dispatch` first drops the waiters whose clients left.)
        self.dispatch(&mut s, self.room());
        self.shed(&mut s);
    }
}

fn late_error(max_wait_s: f64) -> OpError {
    OpError::overloaded(format!(
        "the server is over capacity: no room before the request's deadline (a wait of at most {max_wait_s:.1} s)"
    ))
    .with_code(QUEUE_TIMEOUT)
}

fn full() -> OpError {
    OpError::overloaded("the server is over capacity and its queue is full").with_code(QUEUE_FULL)
}

#[cfg(test)]
mod tests;
