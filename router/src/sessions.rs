//! Session affinity: the requests of one conversation (one session id: the `http` ingress's
//! `x-session-id` header, else OpenAI's `user` field) go to the worker its first one went to,
//! until `ttl_s` passes without one, or that worker leaves or holds `max_active` requests from
//! this router — then the router chooses as usual and the session moves there. An agent's
//! turns thus find their prefix cached even where the KV index cannot see it (`round_robin`,
//! or events lost), and keep finding it while the worker has room.
//!
//! Routers of the same node share their bindings over the event plane (subject
//! `dyn.{namespace}.{target}.sessions`): a binding that is new, moved, or half its TTL old is
//! published, and every router applies what the others publish, so the turns of one
//! conversation arriving through different frontends land on one worker. [`Sessions`] is the
//! map alone, with the time passed in, so its tests run on a scripted clock.
//!
//! ```yaml
//! route: {kind: route, inputs: [preprocess], config: {session_affinity: {ttl_s: 600, max_active: 8}}}
//! ```

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// `route`'s `session_affinity` settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AffinityConfig {
    /// How long a session stays bound after its last request.
    #[serde(default = "ttl_s")]
    pub ttl_s: f64,
    /// Requests in flight from this router on the bound worker beyond which a session moves
    /// (default: the worker's admission places; no bound without admission).
    #[serde(default)]
    pub max_active: Option<u32>,
}

fn ttl_s() -> f64 {
    600.0
}

/// The event-plane subject on which the routers of node `target` share session bindings.
pub fn sessions_subject(namespace: &str, target: &str) -> String {
    format!("dyn.{namespace}.{target}.sessions")
}

/// One binding, as routers tell each other.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Binding {
    pub session: String,
    pub worker: u64,
    /// Time left, relative (the routers' clocks need not agree).
    pub ttl_ms: u64,
    /// The router that bound it (its own messages come back to it).
    pub origin: u64,
}

struct Bound {
    worker: u64,
    expires: Instant,
    /// When this router last told the others.
    told: Instant,
}

/// Sessions bound to workers; bounded in size.
pub struct Sessions {
    ttl: Duration,
    /// This router, in the bindings it publishes.
    origin: u64,
    map: Mutex<HashMap<String, Bound>>,
}

/// Sessions kept at most; past it, expired ones go, then the tenth nearest to expiring.
const KEPT: usize = 100_000;

/// Drops expired bindings and, if that is not enough, the tenth nearest to expiring: a full
/// map keeps taking new sessions, at the cost of its stalest.
fn make_room(map: &mut HashMap<String, Bound>, now: Instant) {
    map.retain(|_, b| b.expires > now);
    if map.len() < KEPT {
        return;
    }
    let mut expiries: Vec<Instant> = map.values().map(|b| b.expires).collect();
    let cut = KEPT / 10;
    expiries.select_nth_unstable(cut);
    let before = expiries[cut];
    map.retain(|_, b| b.expires > before);
}

impl Sessions {
    pub fn new(ttl: Duration, origin: u64) -> Self {
        Self {
            ttl,
            origin,
            map: Mutex::new(HashMap::new()),
        }
    }

    /// The worker `session` is bound to at `now`.
    pub fn get(&self, session: &str, now: Instant) -> Option<u64> {
        self.binding(session, now).map(|(w, _)| w)
    }

    /// Binds `session` to `worker` from `now` for the TTL; the binding to publish when the
    /// other routers should hear of it (new, moved, or told half a TTL ago).
    pub fn bind(&self, session: &str, worker: u64, now: Instant) -> Option<Binding> {
        let mut map = self.map.lock();
        let tell = match map.get_mut(session) {
            Some(b) => {
                let tell = b.worker != worker || b.expires <= now || now >= b.told + self.ttl / 2;
                b.worker = worker;
                b.expires = now + self.ttl;
                if tell {
                    b.told = now;
                }
                tell
            }
            None => {
                if map.len() >= KEPT {
                    make_room(&mut map, now);
                }
                map.insert(
                    session.to_owned(),
                    Bound {
                        worker,
                        expires: now + self.ttl,
                        told: now,
                    },
                );
                true
            }
        };
        tell.then(|| Binding {
            session: session.to_owned(),
            worker,
            ttl_ms: self.ttl.as_millis().try_into().unwrap_or(u64::MAX),
            origin: self.origin,
        })
    }

    /// A binding another router published (this router's own are skipped).
    pub fn apply(&self, b: Binding, now: Instant) {
        if b.origin == self.origin {
            return;
        }
        let expires = now + Duration::from_millis(b.ttl_ms).min(self.ttl);
        let mut map = self.map.lock();
        if map.len() >= KEPT && !map.contains_key(&b.session) {
            make_room(&mut map, now);
        }
        map.insert(
            b.session,
            Bound {
                worker: b.worker,
                expires,
                told: now,
            },
        );
    }

    /// Live bindings: how many, and per worker.
    pub fn counts(&self, now: Instant) -> (usize, HashMap<u64, usize>) {
        let map = self.map.lock();
        let mut per = HashMap::new();
        let mut n = 0;
        for b in map.values().filter(|b| b.expires > now) {
            n += 1;
            *per.entry(b.worker).or_default() += 1;
        }
        (n, per)
    }

    /// `session`'s binding at `now`: the worker and the seconds left.
    pub fn binding(&self, session: &str, now: Instant) -> Option<(u64, f64)> {
        self.map
            .lock()
            .get(session)
            .filter(|b| b.expires > now)
            .map(|b| (b.worker, (b.expires - now).as_secs_f64()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_stays_for_its_ttl_and_is_told_when_new_moved_or_half_old() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let m = Sessions::new(s(10), 1);
        assert_eq!(m.get("a", t0), None);
        let told = m.bind("a", 7, t0).expect("new: told");
        assert_eq!((told.worker, told.ttl_ms, told.origin), (7, 10_000, 1));
        assert_eq!(m.get("a", t0 + s(9)), Some(7));
        // Used again: kept longer, not told again until half the TTL passed.
        assert_eq!(m.bind("a", 7, t0 + s(2)), None);
        assert!(m.bind("a", 7, t0 + s(5)).is_some());
        assert_eq!(m.get("a", t0 + s(14)), Some(7));
        assert_eq!(m.get("a", t0 + s(15)), None, "expired");
        // Moved: told at once.
        assert_eq!(m.bind("a", 8, t0 + s(6)).map(|b| b.worker), Some(8));
    }

    #[test]
    fn bindings_from_other_routers_apply_and_own_ones_are_skipped() {
        let t0 = Instant::now();
        let a = Sessions::new(Duration::from_secs(10), 1);
        let b = Sessions::new(Duration::from_secs(10), 2);
        let told = a.bind("conv", 5, t0).expect("told");
        b.apply(told.clone(), t0);
        assert_eq!(b.get("conv", t0), Some(5));
        assert_eq!(b.binding("conv", t0), Some((5, 10.0)));
        // Its own message coming back changes nothing.
        a.bind("conv", 6, t0);
        a.apply(told, t0);
        assert_eq!(a.get("conv", t0), Some(6));
        assert_eq!(a.counts(t0), (1, HashMap::from([(6, 1)])));
    }
}
