//! What the router has outstanding on each worker.
//!
//! [`ActiveSequences`] counts, per worker, what the router has sent and not yet seen finish:
//! requests, prompt tokens still to prefill (until the first token comes back), and the
//! distinct KV blocks its active requests hold there (requests sharing a prefix share its
//! blocks in the engine, so they count once, as in Dynamo). It is updated on route, first
//! token, finish and cancel through the request's context hooks, so it is exact and
//! immediate where the workers' own load metrics are periodic.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::indexer::IdMap;
use dyn_protocol::kv::LoadMetrics;
use dyn_protocol::types::Precedence;

/// A worker's last load metrics, and this router's own load on it when they arrived: what
/// the router sent since is not in them yet (with several routers, the others' requests
/// are, as of then).
#[derive(Debug, Clone, Default)]
pub struct Reported {
    pub metrics: LoadMetrics,
    pub own_then: Load,
}

/// What the router has outstanding on one worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Load {
    pub requests: u32,
    /// Prompt tokens not yet prefilled (not found in the cache, no first token yet).
    pub prefill_tokens: u64,
    /// Distinct KV blocks the router's active requests hold there (in a [`super::cost::Candidate`]:
    /// with the new prompt's blocks added).
    pub decode_blocks: u64,
}

/// Per-worker [`Load`], shared by the router and its requests' hooks.
#[derive(Debug, Default)]
pub struct ActiveSequences {
    per_worker: Mutex<HashMap<u64, Active>>,
}

#[derive(Debug, Default)]
struct Active {
    requests: u32,
    prefill_tokens: u64,
    /// Block hash → how many of the worker's active requests hold it (block hashes are
    /// hashes already: not hashed again).
    blocks: IdMap<u32>,
    /// Active requests by precedence: a request has a place there if fewer than the bound
    /// come before it or level with it (the engine preempts the others for it).
    ranks: ByPrecedence,
}

/// Requests counted by precedence (see [`Precedence`]).
#[derive(Debug, Default)]
pub struct ByPrecedence(BTreeMap<Precedence, u32>);

impl ByPrecedence {
    pub fn add(&mut self, p: Precedence) {
        *self.0.entry(p).or_default() += 1;
    }

    pub fn remove(&mut self, p: Precedence) {
        if let Some(n) = self.0.get_mut(&p) {
            *n -= 1;
            if *n == 0 {
                self.0.remove(&p);
            }
        }
    }

    /// Those that come before a request of `p`, or level with it.
    pub fn ahead(&self, p: Precedence) -> u32 {
        self.0.range(..=p).map(|(_, n)| n).sum()
    }
}

impl Active {
    fn load(&self) -> Load {
        Load {
            requests: self.requests,
            prefill_tokens: self.prefill_tokens,
            decode_blocks: self.blocks.len() as u64,
        }
    }
}

impl ActiveSequences {
    /// Count a request routed to `worker` holding the blocks `hashes`; the returned handle
    /// settles it: call [`ActiveRequest::first_token`] when output starts, and drop it when
    /// the request is over.
    pub fn start(
        self: &Arc<Self>,
        worker: u64,
        prefill_tokens: u64,
        hashes: Vec<u64>,
        precedence: Precedence,
    ) -> ActiveRequest {
        let mut m = self.per_worker.lock();
        let a = m.entry(worker).or_default();
        a.requests += 1;
        a.ranks.add(precedence);
        a.prefill_tokens += prefill_tokens;
        for h in &hashes {
            *a.blocks.entry(*h).or_insert(0) += 1;
        }
        ActiveRequest {
            seqs: self.clone(),
            worker,
            prefill: AtomicU64::new(prefill_tokens),
            hashes,
            precedence,
        }
    }

    /// Active requests on `worker` that come before a request of `precedence`, or level with
    /// it: with fewer than the worker's places, the request starts there at once.
    pub fn ahead(&self, worker: u64, precedence: Precedence) -> u32 {
        self.per_worker
            .lock()
            .get(&worker)
            .map_or(0, |a| a.ranks.ahead(precedence))
    }

    pub fn load(&self, worker: u64) -> Load {
        self.per_worker
            .lock()
            .get(&worker)
            .map(Active::load)
            .unwrap_or_default()
    }

    pub fn snapshot(&self) -> HashMap<u64, Load> {
        self.per_worker
            .lock()
            .iter()
            .map(|(w, a)| (*w, a.load()))
            .collect()
    }

    /// `worker`'s load, how many of `hashes` no active request there holds, and how many
    /// leading ones an active request there does (hashes chain, so held means a held prefix);
    /// one lock.
    pub(super) fn load_new_and_held(&self, worker: u64, hashes: &[u64]) -> (Load, usize, usize) {
        match self.per_worker.lock().get(&worker) {
            Some(a) => (
                a.load(),
                hashes.iter().filter(|h| !a.blocks.contains_key(h)).count(),
                hashes
                    .iter()
                    .take_while(|h| a.blocks.contains_key(h))
                    .count(),
            ),
            None => (Load::default(), hashes.len(), 0),
        }
    }

    fn settle(&self, worker: u64, f: impl FnOnce(&mut Active)) {
        let mut m = self.per_worker.lock();
        if let Some(a) = m.get_mut(&worker) {
            f(a);
            if a.requests == 0 && a.prefill_tokens == 0 && a.blocks.is_empty() {
                m.remove(&worker);
            }
        }
    }
}

/// One routed request's share of [`ActiveSequences`].
#[derive(Debug)]
pub struct ActiveRequest {
    seqs: Arc<ActiveSequences>,
    worker: u64,
    prefill: AtomicU64,
    hashes: Vec<u64>,
    precedence: Precedence,
}

impl ActiveRequest {
    /// The prompt is prefilled: its tokens no longer count as pending prefill.
    pub fn first_token(&self) {
        let p = self.prefill.swap(0, Ordering::AcqRel);
        if p > 0 {
            self.seqs.settle(self.worker, |l| {
                l.prefill_tokens = l.prefill_tokens.saturating_sub(p)
            });
        }
    }
}

impl Drop for ActiveRequest {
    fn drop(&mut self) {
        let p = *self.prefill.get_mut();
        let hashes = std::mem::take(&mut self.hashes);
        let precedence = self.precedence;
        self.seqs.settle(self.worker, |a| {
            a.requests = a.requests.saturating_sub(1);
            a.ranks.remove(precedence);
            a.prefill_tokens = a.prefill_tokens.saturating_sub(p);
            for h in hashes {
                if let Some(n) = a.blocks.get_mut(&h) {
                    *n -= 1;
                    if *n == 0 {
                        a.blocks.remove(&h);
                    }
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn active_sequences_return_to_zero_after_finish_and_cancel() {
        let active = Arc::new(ActiveSequences::default());
        // Two requests sharing blocks 1 and 2: they count once.
        let batch = Precedence {
            priority: 1,
            yields: false,
        };
        let done = active.start(7, 100, vec![1, 2, 3], batch);
        let cancelled = active.start(7, 50, vec![1, 2, 4], Precedence::default());
        // Counted by precedence: one comes level with an interactive request, both with a
        // batch one.
        assert_eq!(active.ahead(7, Precedence::default()), 1);
        assert_eq!(active.ahead(7, batch), 2);
        assert_eq!(
            active.load(7),
            Load {
                requests: 2,
                prefill_tokens: 150,
                decode_blocks: 4
            }
        );
        done.first_token();
        done.first_token();
        assert_eq!(active.load(7).prefill_tokens, 50);
        drop(done);
        assert_eq!(
            active.load(7),
            Load {
                requests: 1,
                prefill_tokens: 50,
                decode_blocks: 3
            }
        );
        // Cancelled before its first token: its prefill goes too.
        drop(cancelled);
        assert_eq!(active.load(7), Load::default());
        assert_eq!(active.ahead(7, batch), 0);
        assert!(active.snapshot().is_empty());
    }
}
