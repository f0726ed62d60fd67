//! Routing quality: how much of the cache that was there to hit the router used.
//!
//! For every `kv` decision it counts the prompt's blocks, the most any live worker cached
//! (reachable hits), what the chosen worker cached (achieved hits), the tokens between the two
//! (avoidable prefill), and whether the chosen worker was one caching the most. They go to
//! `/metrics` (`dyn_router_*`) and `dyn inspect workers`, with the requests routed to each
//! worker (every policy), which is how several routers' combined placements are compared.
//! Reachable is an upper bound for one decision, not for the run: sending a request away from
//! its prefix can be the right call when that worker is overloaded, and the ratio says how
//! often that happened.

use std::collections::HashMap;

use parking_lot::Mutex;
use prometheus::IntCounter;
use serde::{Deserialize, Serialize};

use super::policy::Decision;
use crate::metrics::ROUTER;

/// This node's counters: its own totals (for `dyn inspect`; a process may build a node's
/// router more than once, and the Prometheus series are per node name) and its series.
pub struct Quality {
    node: String,
    own: Mutex<Own>,
    decisions: IntCounter,
    match_decisions: IntCounter,
    best_match: IntCounter,
    prompt_blocks: IntCounter,
    reachable: IntCounter,
    achieved: IntCounter,
    avoidable_tokens: IntCounter,
}

#[derive(Default)]
struct Own {
    row: QualityRow,
    /// Each worker's series of routed requests, bound once (not a label lookup per request).
    routed: HashMap<u64, IntCounter>,
}

/// What `dyn inspect workers` shows of them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct QualityRow {
    pub decisions: u64,
    /// Decisions where some worker cached part of the prompt, and how many of them went to
    /// a worker caching the most.
    pub match_decisions: u64,
    pub best_match_decisions: u64,
    pub prompt_blocks: u64,
    pub reachable_hit_blocks: u64,
    pub achieved_hit_blocks: u64,
    pub avoidable_prefill_tokens: u64,
}

impl QualityRow {
    /// Achieved and reachable hit rates over prompt blocks.
    pub fn hit_rates(&self) -> (f64, f64) {
        let of = |n: u64| n as f64 / self.prompt_blocks.max(1) as f64;
        (of(self.achieved_hit_blocks), of(self.reachable_hit_blocks))
    }
}

impl Quality {
    /// The route node it counts for.
    pub fn node(&self) -> &str {
        &self.node
    }

    pub fn new(node: &str) -> Self {
        let r = &*ROUTER;
        let l = [node];
        Self {
            node: node.to_owned(),
            own: Mutex::default(),
            decisions: r.decisions.with_label_values(&l),
            match_decisions: r.match_decisions.with_label_values(&l),
            best_match: r.best_match_decisions.with_label_values(&l),
            prompt_blocks: r.prompt_blocks.with_label_values(&l),
            reachable: r.reachable_blocks.with_label_values(&l),
            achieved: r.achieved_blocks.with_label_values(&l),
            avoidable_tokens: r.avoidable_tokens.with_label_values(&l),
        }
    }

    pub fn record(&self, d: &Decision) {
        let mut guard = self.own.lock();
        let Own { row: own, routed } = &mut *guard;
        routed
            .entry(d.worker)
            .or_insert_with(|| {
                let id = format!("{:x}", d.worker);
                ROUTER.routed.with_label_values(&[self.node.as_str(), &id])
            })
            .inc();
        own.decisions += 1;
        self.decisions.inc();
        if d.candidates.is_empty() {
            return;
        }
        let most = d
            .candidates
            .iter()
            .map(|c| c.matched_blocks)
            .max()
            .unwrap_or(0);
        let got = d
            .candidates
            .iter()
            .find(|c| c.worker == d.worker)
            .map_or(0, |c| c.matched_blocks);
        let avoidable = ((most - got.min(most)) * d.block_size) as u64;
        let add = |row: &mut u64, c: &IntCounter, n: u64| {
            *row += n;
            c.inc_by(n);
        };
        add(
            &mut own.prompt_blocks,
            &self.prompt_blocks,
            d.blocks.len() as u64,
        );
        add(&mut own.reachable_hit_blocks, &self.reachable, most as u64);
        add(&mut own.achieved_hit_blocks, &self.achieved, got as u64);
        add(
            &mut own.avoidable_prefill_tokens,
            &self.avoidable_tokens,
            avoidable,
        );
        if most > 0 {
            add(&mut own.match_decisions, &self.match_decisions, 1);
            add(
                &mut own.best_match_decisions,
                &self.best_match,
                u64::from(got == most),
            );
        }
    }

    /// Drop the routed-requests series of workers no longer in `workers` (they left
    /// discovery): removed replicas leave `/metrics`.
    pub fn retain(&self, workers: &[u64]) {
        let mut own = self.own.lock();
        own.routed.retain(|w, _| {
            let keep = workers.contains(w);
            if !keep {
                let id = format!("{w:x}");
                let _ = ROUTER
                    .routed
                    .remove_label_values(&[self.node.as_str(), &id]);
            }
            keep
        });
    }

    pub fn row(&self) -> QualityRow {
        self.own.lock().row.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_that_left_takes_its_routed_series_with_it() {
        let q = Quality::new("route-quality-test");
        let series = || {
            dyn_protocol::metrics::render()
                .lines()
                .filter(|l| {
                    l.starts_with("dyn_router_routed_requests_total")
                        && l.contains("node=\"route-quality-test\"")
                })
                .count()
        };
        for w in [1, 2, 3] {
            q.record(&Decision::plain(w));
        }
        assert_eq!(series(), 3);
        q.retain(&[2]);
        assert_eq!(series(), 1);
        // Its own totals are the node's, not the workers': they stay.
        assert_eq!(q.row().decisions, 3);
    }
}
