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
//! Room: `per_worker` requests in flight from this router per live worker (what `dyn bench`
//! measures a worker sustains at the latency wanted). [`Queue`] is the ordering alone, with the
//! time passed in, so its tests run on a scripted clock.
//!
//! ```yaml
//! route: {kind: route, inputs: [preprocess], config: {admission: {per_worker: 8, queue: 256, max_wait_s: 2}}}
//! ```

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

// tokio's clock, which tests can pause and advance.
use tokio::time::Instant;

use dyn_core::{Ctx, OpError};

use super::metrics::ADMISSION;
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
    /// Requests in flight per live worker before new ones wait.
    pub per_worker: u32,
    /// Requests that may wait at once.
    #[serde(default = "queue")]
    pub queue: usize,
    /// How long a request may wait before it is refused.
    #[serde(default = "max_wait_s")]
    pub max_wait_s: f64,
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

/// The waiting requests, best first; bounded.
#[derive(Debug)]
pub struct Queue<T> {
    entries: BTreeMap<Rank, T>,
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

impl<T> Queue<T> {
    pub fn new(cap: usize) -> Self {
        Self {
            entries: BTreeMap::new(),
            cap,
            seq: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn push(&mut self, priority: i32, deadline: Instant, item: T) -> Pushed<T> {
        self.seq += 1;
        let rank = Rank {
            priority,
            deadline,
            seq: self.seq,
        };
        if self.entries.len() < self.cap {
            self.entries.insert(rank, item);
            return Pushed::Waiting;
        }
        match self.entries.last_key_value() {
            Some((worst, _)) if *worst > rank => match self.entries.pop_last() {
                Some((_, out)) => {
                    self.entries.insert(rank, item);
                    Pushed::Displaced(out)
                }
                None => Pushed::Refused(item),
            },
            _ => Pushed::Refused(item),
        }
    }

    /// The best entry, taken out.
    pub fn pop(&mut self) -> Option<(Rank, T)> {
        self.entries.pop_first()
    }

    /// Keeps only the entries still waiting (their client has not left).
    pub fn retain(&mut self, mut waiting: impl FnMut(&T) -> bool) {
        self.entries.retain(|_, v| waiting(v));
    }

    /// Takes out, best first, the entries `late(place, rank)` says to (`place` 0 is the best's).
    pub fn take_late(&mut self, mut late: impl FnMut(usize, &Rank) -> bool) -> Vec<T> {
        let out: Vec<Rank> = self
            .entries
            .keys()
            .enumerate()
            .filter(|(i, r)| late(*i, r))
            .map(|(_, r)| *r)
            .collect();
        out.iter().filter_map(|r| self.entries.remove(r)).collect()
    }
}

type Waiter = oneshot::Sender<Result<Permit, OpError>>;

/// Admission for one router.
pub struct Admission {
    config: AdmissionConfig,
    /// The route node, for the metrics.
    node: String,
    state: Mutex<State>,
    /// Live workers now (the router's view).
    workers: Box<dyn Fn() -> usize + Send + Sync>,
}

struct State {
    inflight: usize,
    queue: Queue<Waiter>,
    /// When a request last finished, and the moving average of the gaps between finishes.
    last_done: Option<Instant>,
    gap: Option<Duration>,
}

/// Weight of the newest gap in the moving average.
const GAP_WEIGHT: f64 = 0.1;
/// A waiting request's predicted start is its place × the gap × this: better-ranked requests
/// arriving meanwhile go ahead of it, so a place is worth more than one gap.
const WAIT_MARGIN: f64 = 4.0;

/// A request's place among those in flight; dropping it (when the request is over) lets the
/// best waiting request go.
pub struct Permit {
    admission: Option<Arc<Admission>>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(a) = self.admission.take() {
            let mut s = a.state.lock();
            s.inflight = s.inflight.saturating_sub(1);
            let now = Instant::now();
            if let Some(last) = s.last_done {
                let gap = now - last;
                s.gap = Some(match s.gap {
                    Some(avg) => avg.mul_f64(1.0 - GAP_WEIGHT) + gap.mul_f64(GAP_WEIGHT),
                    None => gap,
                });
            }
            s.last_done = Some(now);
            a.dispatch(&mut s);
        }
    }
}

impl Admission {
    pub fn new(
        config: AdmissionConfig,
        node: &str,
        workers: impl Fn() -> usize + Send + Sync + 'static,
    ) -> Arc<Self> {
        Arc::new(Self {
            node: node.to_owned(),
            state: Mutex::new(State {
                inflight: 0,
                queue: Queue::new(config.queue),
                last_done: None,
                gap: None,
            }),
            config,
            workers: Box::new(workers),
        })
    }

    fn capacity(&self) -> usize {
        (self.workers)() * self.config.per_worker as usize
    }

    /// Requests in flight and waiting.
    pub fn counts(&self) -> (usize, usize) {
        let s = self.state.lock();
        (s.inflight, s.queue.len())
    }

    /// Lets waiting requests go while there is room (their permits counted in flight).
    fn dispatch(self: &Arc<Self>, s: &mut State) {
        let cap = self.capacity();
        while s.inflight < cap {
            let Some((_, waiter)) = s.queue.pop() else {
                break;
            };
            s.inflight += 1;
            let permit = Permit {
                admission: Some(self.clone()),
            };
            if let Err(Ok(mut p)) = waiter.send(Ok(permit)) {
                // Its client left: the place goes back (not through the permit's drop, which
                // would take the lock held here).
                p.admission = None;
                s.inflight -= 1;
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
        let late = s
            .queue
            .take_late(|i, r| now + gap.mul_f64(WAIT_MARGIN * (i + 1) as f64) > r.deadline);
        for w in late {
            let _ = w.send(Err(self.refused(late_error(self.config.max_wait_s))));
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

    /// Wait for room for a request of `priority`; the permit counts it in flight until
    /// dropped. Refused (503, [`QUEUE_FULL`] or [`QUEUE_TIMEOUT`]) when it cannot get room.
    pub async fn admit(self: &Arc<Self>, ctx: &Ctx, priority: i32) -> Result<Permit, OpError> {
        let wait = Duration::from_secs_f64(self.config.max_wait_s.max(0.0));
        // The request's own deadline (`x-request-timeout`) when it comes sooner.
        let deadline = match ctx.deadline() {
            Some(d) => (Instant::now() + wait).min(Instant::from_std(d)),
            None => Instant::now() + wait,
        };
        let rx = {
            let mut s = self.state.lock();
            s.queue.retain(|w| !w.is_closed());
            if s.queue.is_empty() && s.inflight < self.capacity() {
                s.inflight += 1;
                return Ok(Permit {
                    admission: Some(self.clone()),
                });
            }
            let (tx, rx) = oneshot::channel();
            match s.queue.push(priority, deadline, tx) {
                Pushed::Waiting => {}
                Pushed::Displaced(worse) => {
                    let _ = worse.send(Err(self.refused(full())));
                }
                Pushed::Refused(_) => return Err(self.refused(full())),
            }
            // Room may have opened meanwhile (more workers).
            self.dispatch(&mut s);
            self.shed(&mut s);
            rx
        };
        tracing::debug!(request_id = %ctx.id(), priority, "Waiting for room");
        let queued = Instant::now();
        let answer = match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(OpError::internal("the admission queue dropped a request")),
            Err(_) => Err(self.refused(late_error(self.config.max_wait_s))),
        };
        if answer.is_ok() {
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

    /// Lets waiting requests go if workers joined (called on a timer by the router).
    pub fn tick(self: &Arc<Self>) {
        let mut s = self.state.lock();
        s.queue.retain(|w| !w.is_closed());
        self.dispatch(&mut s);
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
mod tests {
    use super::*;

    #[test]
    fn the_queue_orders_by_priority_then_deadline_then_arrival() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut q = Queue::new(8);
        q.push(1, t0 + s(5), "batch late");
        q.push(1, t0 + s(2), "batch early");
        q.push(0, t0 + s(9), "interactive");
        q.push(1, t0 + s(2), "batch early, second");
        let order: Vec<&str> = std::iter::from_fn(|| q.pop().map(|(_, v)| v)).collect();
        assert_eq!(
            order,
            [
                "interactive",
                "batch early",
                "batch early, second",
                "batch late"
            ]
        );
    }

    #[test]
    fn a_full_queue_refuses_lower_classes_first() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut q = Queue::new(2);
        assert!(matches!(q.push(1, t0 + s(1), "b1"), Pushed::Waiting));
        assert!(matches!(q.push(1, t0 + s(2), "b2"), Pushed::Waiting));
        // A batch request ranks last: refused.
        assert_eq!(q.push(1, t0 + s(3), "b3"), Pushed::Refused("b3"));
        // An interactive one takes the worst place.
        assert!(matches!(
            q.push(0, t0 + s(3), "i1"),
            Pushed::Displaced("b2")
        ));
        assert_eq!(q.pop().map(|(_, v)| v), Some("i1"));
        assert_eq!(q.pop().map(|(_, v)| v), Some("b1"));
    }

    fn admission(per_worker: u32, queue: usize, max_wait_s: f64) -> Arc<Admission> {
        Admission::new(
            AdmissionConfig {
                per_worker,
                queue,
                max_wait_s,
            },
            "route",
            || 1,
        )
    }

    #[tokio::test(start_paused = true)]
    async fn requests_wait_for_room_and_go_best_first() {
        let a = admission(1, 4, 10.0);
        let ctx = Ctx::new();
        let running = a.admit(&ctx, 5).await.expect("room");
        // Two wait; the interactive one (0) goes first when the running one ends.
        let (a1, a2) = (a.clone(), a.clone());
        let batch = tokio::spawn(async move { a1.admit(&Ctx::new(), 1).await.map(|_| "batch") });
        tokio::task::yield_now().await;
        let inter = tokio::spawn(async move {
            let p = a2.admit(&Ctx::new(), 0).await;
            p.map(|p| {
                drop(p);
                "interactive"
            })
        });
        tokio::task::yield_now().await;
        assert_eq!(a.counts(), (1, 2));
        drop(running);
        assert_eq!(inter.await.unwrap().unwrap(), "interactive");
        assert_eq!(batch.await.unwrap().unwrap(), "batch");
    }

    #[tokio::test(start_paused = true)]
    async fn no_room_within_the_deadline_is_refused_and_a_full_queue_at_once() {
        let a = admission(1, 1, 0.5);
        let _running = a.admit(&Ctx::new(), 0).await.expect("room");
        let a1 = a.clone();
        let waiting = tokio::spawn(async move { a1.admit(&Ctx::new(), 0).await.err() });
        tokio::task::yield_now().await;
        // The queue (one place) is taken by an equal: refused now.
        let e = a.admit(&Ctx::new(), 0).await.err().expect("refused");
        assert_eq!(e.code.as_deref(), Some(QUEUE_FULL));
        // The waiter gives up at its deadline.
        let e = waiting.await.unwrap().expect("timed out");
        assert_eq!(e.code.as_deref(), Some(QUEUE_TIMEOUT));
        assert_eq!(a.counts(), (1, 1));
        a.tick();
        assert_eq!(a.counts(), (1, 0), "the closed waiter leaves the queue");
    }

    #[tokio::test(start_paused = true)]
    async fn requests_that_would_wait_past_their_deadline_are_refused_at_once() {
        let a = admission(1, 16, 1.0);
        // Requests finish every 100 ms.
        for _ in 0..3 {
            let p = a.admit(&Ctx::new(), 0).await.expect("room");
            tokio::time::advance(Duration::from_millis(100)).await;
            drop(p);
        }
        let _running = a.admit(&Ctx::new(), 0).await.expect("room");
        let t0 = Instant::now();
        let mut waiting = Vec::new();
        for _ in 0..5 {
            let a = a.clone();
            waiting.push(tokio::spawn(async move {
                a.admit(&Ctx::new(), 0)
                    .await
                    .err()
                    .map(|e| (e.code, Instant::now()))
            }));
            tokio::task::yield_now().await;
        }
        // Place i should start in (i + 1) x 100 ms x the margin: those past 1 s are refused now.
        let kept = ((1000.0 / (100.0 * WAIT_MARGIN)) as usize).min(5);
        assert!(kept < 5);
        assert_eq!(a.counts(), (1, kept));
        for w in waiting.into_iter().skip(kept) {
            let (code, at) = w.await.unwrap().expect("refused");
            assert_eq!(code.as_deref(), Some(QUEUE_TIMEOUT));
            assert_eq!(at, t0, "refused at once, not at the deadline");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_whose_client_left_does_not_take_the_room() {
        let a = admission(1, 4, 10.0);
        let running = a.admit(&Ctx::new(), 0).await.expect("room");
        let a1 = a.clone();
        let gone = tokio::spawn(async move { a1.admit(&Ctx::new(), 0).await.map(drop) });
        tokio::task::yield_now().await;
        gone.abort();
        let _ = gone.await;
        let a2 = a.clone();
        let next = tokio::spawn(async move { a2.admit(&Ctx::new(), 1).await.map(drop) });
        tokio::task::yield_now().await;
        drop(running);
        assert!(next.await.unwrap().is_ok());
        assert_eq!(a.counts(), (0, 0));
    }
}
