//! Who may take a place: the room (the live workers' places summed, and those one tenant may
//! hold beside the reserve), each tenant's share of it by weight, and where a request stands
//! against those in flight ([`Precedence`]) — which is what lets a request go beyond the room
//! for a running one to give way at its worker.

// tokio's clock, which tests can pause and advance.
use tokio::time::Instant;

use dyn_protocol::types::Precedence;

use super::{Admission, State};

/// Places: the live workers' places summed, and those one tenant may hold (less the
/// reserve on each worker).
#[derive(Debug, Clone, Copy)]
pub(super) struct Room {
    pub(super) places: usize,
    pub(super) tenant_places: usize,
}

/// The tenants in flight or waiting, as [`Admission::precedence`] weighs them.
pub(super) struct Active<'a> {
    weight: f64,
    room: Room,
    /// The two lowest recent services, with their tenants (infinite where fewer).
    lowest: [(f64, &'a str); 2],
    now: Instant,
}

impl Admission {
    /// The places now (asks the router for its live workers once).
    pub(super) fn room(&self) -> Room {
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

    /// Where a request of `tenant` and `priority` sent now would stand (see [`Precedence`]):
    /// it gives way if its tenant holds its share of the places or more — the places shared
    /// by weight among the tenants in flight or waiting — unless it is the one served least
    /// of them lately ([`Queue::recent`](super::Queue::recent), over weight: a light
    /// tenant's burst goes at once, where the virtual token counter, lifted level on each
    /// arrival, would make it wait).
    /// A tenant on its own gives way beyond the share it would have beside one more tenant
    /// of the default weight, so that a tenant arriving at a node that another fills finds
    /// requests that give way to it. Requests of no tenant never do.
    pub(super) fn precedence(
        &self,
        s: &State,
        tenant: &str,
        priority: i32,
        active: &Active,
    ) -> Precedence {
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
    pub(super) fn active<'a>(&self, s: &'a State, also: Option<&'a str>, room: Room) -> Active<'a> {
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
    pub(super) fn may_start(&self, s: &State, tenant: &str, p: Precedence, room: Room) -> bool {
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
}
