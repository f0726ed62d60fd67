//! Worker health as routing sees it: a circuit breaker per worker. A worker whose requests
//! fail [`TRIP_AFTER`] times in a row (an internal error or a lost stream, before or after
//! its first token; not a refusal for want of room, nor the client's doing) is left out of
//! routing for a while — 2 s, doubling up to a minute while it keeps failing — then given
//! one probe request: its first token closes the breaker, a failure opens it again. While
//! every live worker is out, they are all used: a breaker never empties the pool by itself.
//! [`Health`] takes the time as an argument, so its tests run on a scripted clock.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Failures in a row that open a worker's breaker.
pub const TRIP_AFTER: u32 = 3;
const FIRST_OPEN: Duration = Duration::from_secs(2);
const LONGEST_OPEN: Duration = Duration::from_secs(60);

#[derive(Default)]
struct Breaker {
    fails: u32,
    open_until: Option<Instant>,
    /// How long it opens next time.
    backoff: Duration,
    /// A half-open worker's probe is in flight.
    probing: bool,
}

/// Each worker's breaker.
#[derive(Default)]
pub struct Health {
    per: Mutex<HashMap<u64, Breaker>>,
}

/// A breaker's state, as `dyn inspect workers` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Closed,
    Open,
    /// Past its time out: the next request is a probe.
    HalfOpen,
}

impl State {
    /// Its name in `dyn inspect workers`.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open => "open",
            State::HalfOpen => "half_open",
        }
    }
}

/// The state of a breaker (none: closed) at `now`.
fn state_of(b: Option<&Breaker>, now: Instant) -> State {
    match b.and_then(|b| b.open_until) {
        Some(until) if until > now => State::Open,
        Some(_) => State::HalfOpen,
        None => State::Closed,
    }
}

impl Health {
    /// A request routed to `worker` failed; whether that opened its breaker.
    pub fn failed(&self, worker: u64, now: Instant) -> bool {
        let mut per = self.per.lock();
        let b = per.entry(worker).or_default();
        b.fails += 1;
        let was_probe = std::mem::take(&mut b.probing);
        if b.fails < TRIP_AFTER && !was_probe {
            return false;
        }
        b.backoff = if b.backoff.is_zero() {
            FIRST_OPEN
        } else {
            (b.backoff * 2).min(LONGEST_OPEN)
        };
        b.open_until = Some(now + b.backoff);
        true
    }

    /// A request routed to `worker` got its first token: the breaker closes.
    pub fn ok(&self, worker: u64) {
        self.per.lock().remove(&worker);
    }

    /// A request routed to `worker` ended with neither (its client left): a probe's place
    /// goes back.
    pub fn abandoned(&self, worker: u64) {
        if let Some(b) = self.per.lock().get_mut(&worker) {
            b.probing = false;
        }
    }

    pub fn state(&self, worker: u64, now: Instant) -> State {
        state_of(self.per.lock().get(&worker), now)
    }

    /// Whether `worker` may take a request now: closed, or half-open with no probe out.
    pub fn usable(&self, worker: u64, now: Instant) -> bool {
        let per = self.per.lock();
        let b = per.get(&worker);
        match state_of(b, now) {
            State::Closed => true,
            State::Open => false,
            State::HalfOpen => !b.is_some_and(|b| b.probing),
        }
    }

    /// A request goes to `worker`: if it is half-open, that request is its probe.
    pub fn taken(&self, worker: u64, now: Instant) {
        if let Some(b) = self.per.lock().get_mut(&worker)
            && b.open_until.is_some_and(|until| until <= now)
        {
            b.probing = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_failures_open_it_a_probe_closes_or_reopens_it_for_longer() {
        let h = Health::default();
        let t0 = Instant::now();
        let s = Duration::from_secs;
        assert!(!h.failed(7, t0));
        // A success in between starts the count again.
        h.ok(7);
        assert!(!h.failed(7, t0));
        assert!(!h.failed(7, t0));
        assert!(h.usable(7, t0));
        assert!(h.failed(7, t0), "the third in a row opens it");
        assert_eq!(h.state(7, t0), State::Open);
        assert!(!h.usable(7, t0 + s(1)));
        // After 2 s: one probe, and no other request meanwhile.
        assert_eq!(h.state(7, t0 + s(2)), State::HalfOpen);
        assert!(h.usable(7, t0 + s(2)));
        h.taken(7, t0 + s(2));
        assert!(!h.usable(7, t0 + s(2)));
        // The probe fails: open again, twice as long.
        assert!(h.failed(7, t0 + s(2)));
        assert!(!h.usable(7, t0 + s(5)));
        assert!(h.usable(7, t0 + s(6)));
        // A probe whose client left gives its place back; one that answers closes it.
        h.taken(7, t0 + s(6));
        h.abandoned(7);
        assert!(h.usable(7, t0 + s(6)));
        h.taken(7, t0 + s(6));
        h.ok(7);
        assert_eq!(h.state(7, t0 + s(6)), State::Closed);
        assert!(h.usable(8, t0), "other workers are untouched");
    }
}
