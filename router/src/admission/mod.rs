//! Admission control at the router: requests beyond what the workers have room for wait here,
//! in a bounded queue ordered by priority (lower first, as vLLM's `priority`), then deadline,
//! then arrival, instead of piling into the workers' own queues. Each finished request lets
//! the best waiting one go. A request is refused (503, `Retry-After`) when the queue is full
//! and it ranks last — a full queue refuses its worst entry to take a better one, so lower
//! classes are refused before higher ones — and as soon as its place in the queue says it
//! would wait past its deadline: requests finish at a rate the router measures (a moving
//! average of the gaps between them), so the `i`-th waiting one should start in about `i`
//! gaps ([`WAIT_MARGIN`](forecast::WAIT_MARGIN) times over: better-ranked arrivals go ahead
//! of it meanwhile). Most refusals thus come at once, not after the wait they predict. A
//! waiter whose client hangs up simply leaves: its place is skipped. A request's own deadline
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
//!
//! Its parts: `config` (the settings), `queue` (the order alone), `room` (who may take a
//! place), `forecast` (refusing those that would wait too long), `limits` (tenants' rate
//! limits), `charges` (what the node's routers tell each other) and `answer` (`dyn inspect
//! queue`); this file holds the requests' way through them, from [`Admission::admit`] to
//! the [`Permit`] that lets the next one go.

mod answer;
mod charges;
mod config;
mod forecast;
mod limits;
mod queue;
mod room;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

// tokio's clock, which tests can pause and advance.
use tokio::time::Instant;

use dyn_core::{Ctx, OpError};
use dyn_protocol::types::Precedence;

use super::metrics::ADMISSION;
use super::sequences::ByPrecedence;
use parking_lot::Mutex;
use tokio::sync::oneshot;

pub use answer::{QueueAnswer, TenantRow};
pub use charges::{Charges, charges_subject};
pub use config::{AdmissionConfig, TenantConfig, UNADVERTISED_PLACES};
use limits::Bucket;
pub use queue::{Pushed, Queue, Rank};
use room::Room;

/// The code of a request refused because the queue was full (and it ranked last).
pub const QUEUE_FULL: &str = "queue_full";
/// The code of a request that waited, or would wait, in the queue past its deadline.
pub const QUEUE_TIMEOUT: &str = "queue_timeout";

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

/// What admission keeps under its one lock: the requests in flight, the queue, the tenants'
/// places and buckets, and the pace of finishes.
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
            let room = a.room();
            s.count_finish(room);
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

    /// Requests in flight and waiting.
    pub fn counts(&self) -> (usize, usize) {
        let s = self.state.lock();
        (s.inflight, s.queue.len())
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
