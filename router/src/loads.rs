//! Each worker's load, two ways: what this router has outstanding there, exact and immediate
//! ([`ActiveSequences`], kept by its requests' hooks), and what the worker last said in its
//! load metrics (every router's requests, but only as often as it publishes), kept with this
//! router's own load when they came so the policies can tell what they do not cover yet.

use std::collections::HashMap;
use std::sync::Arc;

use dyn_protocol::kv::LoadMetrics;
use parking_lot::Mutex;

use crate::sequences::{ActiveSequences, Reported};

/// What the router knows of its workers' load.
#[derive(Default)]
pub(crate) struct Loads {
    /// What this router has outstanding on each worker.
    pub active: Arc<ActiveSequences>,
    /// The latest load metrics per worker.
    pub reported: Mutex<HashMap<u64, Reported>>,
}

impl Loads {
    /// Keeps `m`, a worker's latest load metrics, with this router's load there now.
    pub fn report(&self, m: LoadMetrics) {
        let own_then = self.active.load(m.worker_id);
        self.reported.lock().insert(
            m.worker_id,
            Reported {
                metrics: m,
                own_then,
            },
        );
    }

    /// Forgets the metrics of workers that are not `live`.
    pub fn retain(&self, live: &[u64]) {
        self.reported.lock().retain(|w, _| live.contains(w));
    }

    /// Requests on the `live` workers: per worker, what its load metrics last said (running +
    /// waiting, from every router) or what this router has sent it and not seen finish,
    /// whichever is more (metrics lag a burst by up to their publishing interval).
    pub fn busy(&self, live: Vec<u64>) -> u64 {
        let metrics = self.reported.lock();
        live.into_iter()
            .map(|w| {
                let reported = metrics.get(&w).map_or(0, |r| {
                    u64::from(r.metrics.requests_running) + u64::from(r.metrics.requests_waiting)
                });
                reported.max(u64::from(self.active.load(w).requests))
            })
            .sum()
    }
}
