//! The `kv` policy: route each prompt where its prefix is cached, priced against load.
//!
//! It hashes the prompt into blocks, asks the [`Indexer`] how much of it each worker caches
//! (and this router's active requests how much they hold), and takes the cheapest worker by
//! [`cost::candidates`] within the load bounds. The index is fed by the workers' KV
//! events ([`super::follow`]). In approximate mode (`kv_events: false`, or the event plane
//! down) the router records its own decisions in the index instead, and forgets each after
//! `approx_ttl_s` unless routed again.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::cost::{self, Pricing, WorkerView};
use super::indexer::Indexer;
use super::policy::{Decision, PromptRef, RoutingPolicy, View};
use dyn_protocol::kv::{BlockHash, KvEventData};

/// Block size until the workers announce theirs (vLLM's default).
const DEFAULT_BLOCK_SIZE: u32 = 16;

/// What the `kv` policy knows of the workers' caches, and how it weighs them.
pub struct KvAware {
    pub index: RwLock<Indexer>,
    /// 0 until configured or announced.
    block_size: AtomicU32,
    /// Approximate mode: when each (worker, block) the router sent there was last routed.
    approx: Mutex<HashMap<(u64, u64), Instant>>,
    pub pricing: Pricing,
    rng: Mutex<StdRng>,
}

impl KvAware {
    pub fn new(block_size: Option<u32>, pricing: Pricing) -> Self {
        Self {
            index: RwLock::new(Indexer::new()),
            block_size: AtomicU32::new(block_size.unwrap_or(0)),
            approx: Mutex::new(HashMap::new()),
            pricing,
            rng: Mutex::new(StdRng::from_os_rng()),
        }
    }

    /// Draw ties and samples from a fixed seed (deterministic simulations).
    #[cfg(test)]
    pub fn seeded(self, seed: u64) -> Self {
        *self.rng.lock() = StdRng::seed_from_u64(seed);
        self
    }

    pub fn block_size(&self) -> usize {
        match self.block_size.load(Ordering::Relaxed) {
            0 => DEFAULT_BLOCK_SIZE as usize,
            n => n as usize,
        }
    }

    /// The block size the workers announced (when the config gives none).
    pub fn set_block_size(&self, block_size: u32) {
        self.block_size.store(block_size, Ordering::Relaxed);
    }

    /// Approximate mode: the prompt's blocks now count as cached on `worker`.
    pub fn record_own_decision(&self, worker: u64, blocks: &[BlockHash]) {
        if blocks.is_empty() {
            return;
        }
        let now = Instant::now();
        {
            let mut approx = self.approx.lock();
            for b in blocks {
                approx.insert((worker, b.block_hash), now);
            }
        }
        self.index.write().apply_data(
            worker,
            &KvEventData::Stored {
                parent_hash: None,
                blocks: blocks.to_vec(),
            },
        );
    }

    /// Approximate mode: forget blocks not routed again within `ttl`.
    pub fn expire(&self, ttl: Duration) {
        let mut by_worker: HashMap<u64, Vec<u64>> = HashMap::new();
        self.approx.lock().retain(|(w, h), at| {
            let keep = at.elapsed() < ttl;
            if !keep {
                by_worker.entry(*w).or_default().push(*h);
            }
            keep
        });
        if by_worker.is_empty() {
            return;
        }
        let mut index = self.index.write();
        for (w, block_hashes) in by_worker {
            index.apply_data(w, &KvEventData::Removed { block_hashes });
        }
    }

    /// Drop the records of approximate mode (a resync from the workers replaces them).
    pub fn forget_own_decisions(&self) {
        self.approx.lock().clear();
    }

    #[cfg(test)]
    pub fn own_decisions(&self) -> usize {
        self.approx.lock().len()
    }
}

impl RoutingPolicy for KvAware {
    fn decide(&self, prompt: PromptRef<'_>, view: &View<'_>) -> Option<Decision> {
        // Hashing and index lookups run concurrently; the generator is locked only to draw.
        let bs = self.block_size();
        let tokens = prompt.tokens;
        let blocks = prompt.blocks(bs);
        let seqs: Vec<u64> = blocks.iter().map(|b| b.block_hash).collect();
        let prompt_blocks = tokens.len().div_ceil(bs);
        let workers: Vec<WorkerView<'_>> = {
            let index = self.index.read();
            let matches = index.find_tiered(&seqs);
            view.live
                .iter()
                .map(|&w| {
                    let (mut load, new_blocks, held) = view.active.load_new_and_held(w, &seqs);
                    // The prompt's blocks this worker would add, a last partial one included.
                    load.decode_blocks += (new_blocks + prompt_blocks - seqs.len()) as u64;
                    let m = matches
                        .iter()
                        .find(|(id, _)| *id == w)
                        .map(|(_, m)| *m)
                        .unwrap_or_default();
                    WorkerView {
                        worker: w,
                        indexed_blocks: m.blocks,
                        indexed_lower: [m.host, m.disk],
                        pending_blocks: held,
                        load,
                        cached_total: index.worker_blocks(w),
                        reported: view.reported.get(&w),
                        lora_missing: view.lora_holders.is_some_and(|h| !h.contains(&w)),
                    }
                })
                .collect()
        };
        let candidates = cost::candidates(&workers, tokens.len(), prompt_blocks, bs, &self.pricing);
        let cached_total: Vec<usize> = workers.iter().map(|w| w.cached_total).collect();
        let i = cost::choose(
            &candidates,
            &cached_total,
            self.pricing.temperature,
            &mut *self.rng.lock(),
        )?;
        Some(Decision {
            worker: candidates[i].worker,
            candidates,
            prompt_blocks,
            block_size: bs,
            blocks,
        })
    }
}
