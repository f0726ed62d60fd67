//! `dyn inspect queue`: what a router's admission shows of itself — requests in flight and
//! waiting, the room, the finish pace, and each tenant's places, queue, counter and lift.

use std::collections::{BTreeMap, HashMap};

use serde::Deserialize;

use super::Admission;

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

impl Admission {
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
}
