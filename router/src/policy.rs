//! Routing policies: how a router picks one of its live workers for a prompt.
//!
//! A policy is one [`RoutingPolicy`] value; the router hands it a [`View`] of the workers
//! (live ids, this router's outstanding requests per worker) and takes its [`Decision`]. The
//! load-only policies live here; the KV-cache-aware one, which keeps an index of the
//! workers' caches, is [`super::kv_aware`]. A new policy is a new type and a line in
//! `Policy::build_load_only`.

use std::collections::HashMap;

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use dyn_core::planes::LiveInstances;

use super::cost::Candidate;
use super::sequences::ActiveSequences;
pub use super::sequences::Reported;
use dyn_protocol::kv::{BlockHash, PromptHashes};

/// The policy a `route` node is configured with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    #[default]
    RoundRobin,
    Random,
    LeastLoaded,
    PowerOfTwo,
    Kv,
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Policy::RoundRobin => "round_robin",
            Policy::Random => "random",
            Policy::LeastLoaded => "least_loaded",
            Policy::PowerOfTwo => "power_of_two",
            Policy::Kv => "kv",
        })
    }
}

impl Policy {
    /// The load-only policies (`Kv` is built with its index by [`super::kv_aware::KvAware`]).
    pub(super) fn build_load_only(self) -> Box<dyn RoutingPolicy> {
        let rng = || Mutex::new(StdRng::from_os_rng());
        match self {
            Policy::RoundRobin | Policy::Kv => Box::new(RoundRobin),
            Policy::Random => Box::new(Random(rng())),
            Policy::LeastLoaded => Box::new(LeastLoaded(rng())),
            Policy::PowerOfTwo => Box::new(PowerOfTwo(rng())),
        }
    }
}

/// What a policy sees of the workers when it decides.
pub struct View<'a> {
    /// The workers it may choose: those in discovery, less those the request plane just saw
    /// fail and those the router leaves out of this request (unless that is all); never empty.
    pub live: &'a [u64],
    /// Every worker as discovery lists them (round robin keeps its cursor there).
    pub instances: &'a LiveInstances,
    /// What this router has outstanding on each worker.
    pub active: &'a ActiveSequences,
    /// Each worker's last load metrics, with this router's load there when they arrived.
    pub reported: &'a HashMap<u64, Reported>,
    /// For a request with a LoRA adapter: the workers known to hold it (`None`: no adapter).
    pub lora_holders: Option<&'a [u64]>,
}

/// One routing decision, with what it was based on.
#[derive(Debug, Clone)]
pub struct Decision {
    pub worker: u64,
    /// The `kv` policy's terms per worker (empty for other policies).
    pub candidates: Vec<Candidate>,
    pub prompt_blocks: usize,
    pub block_size: usize,
    /// The prompt's full blocks (`kv` only).
    pub blocks: std::sync::Arc<[BlockHash]>,
}

impl Decision {
    /// A decision on load alone.
    pub fn plain(worker: u64) -> Self {
        Self {
            worker,
            candidates: Vec::new(),
            prompt_blocks: 0,
            block_size: 0,
            blocks: std::sync::Arc::new([]),
        }
    }

    /// Why this worker (`kv`; empty otherwise).
    pub fn reason(&self) -> String {
        self.candidates
            .iter()
            .position(|c| c.worker == self.worker)
            .map(|i| super::cost::reason(&self.candidates, i))
            .unwrap_or_default()
    }

    /// Prompt tokens the chosen worker caches (`kv` only; 0 otherwise).
    pub fn cached_tokens(&self, prompt_tokens: usize) -> usize {
        self.candidates
            .iter()
            .find(|c| c.worker == self.worker)
            .map_or(0, |c| {
                (c.matched_blocks * self.block_size).min(prompt_tokens)
            })
    }
}

/// The prompt a policy decides for: its tokens, its salt (the request's `cache_salt` and
/// adapter, [`dyn_protocol::kv::salt_of`]: a salted prompt shares cached blocks only with
/// prompts of the same salt), and the request's memo of its block hashes, so that pricing it
/// in several pools, routing it and admitting it in an engine of this process hash it once.
#[derive(Clone, Copy)]
pub struct PromptRef<'a> {
    pub tokens: &'a [u32],
    pub salt: Option<u64>,
    pub hashes: &'a PromptHashes,
}

impl<'a> PromptRef<'a> {
    pub fn new(tokens: &'a [u32], salt: Option<u64>, hashes: &'a PromptHashes) -> Self {
        Self {
            tokens,
            salt,
            hashes,
        }
    }

    /// The prompt's full blocks hashed for `block_size`.
    pub fn blocks(&self, block_size: usize) -> std::sync::Arc<[BlockHash]> {
        self.hashes.get(self.tokens, block_size, self.salt)
    }
}

/// How a router picks a worker.
pub trait RoutingPolicy: Send + Sync {
    /// Where `prompt` would go; `None` when no worker can take it. Records nothing.
    fn decide(&self, prompt: PromptRef<'_>, view: &View<'_>) -> Option<Decision>;
}

/// In turn, skipping workers it may not choose.
struct RoundRobin;

impl RoutingPolicy for RoundRobin {
    fn decide(&self, _prompt: PromptRef<'_>, view: &View<'_>) -> Option<Decision> {
        view.instances
            .round_robin(|i| view.live.contains(&i.instance_id.get()))
            .map(|i| Decision::plain(i.instance_id.get()))
    }
}

/// Uniformly at random.
struct Random(Mutex<StdRng>);

impl RoutingPolicy for Random {
    fn decide(&self, _prompt: PromptRef<'_>, view: &View<'_>) -> Option<Decision> {
        let i = self.0.lock().random_range(0..view.live.len());
        Some(Decision::plain(view.live[i]))
    }
}

/// Fewest active requests from this router (ties at random).
struct LeastLoaded(Mutex<StdRng>);

impl RoutingPolicy for LeastLoaded {
    fn decide(&self, _prompt: PromptRef<'_>, view: &View<'_>) -> Option<Decision> {
        least_loaded(view.live, view.active, &mut self.0.lock()).map(Decision::plain)
    }
}

/// The less loaded of two workers drawn at random.
struct PowerOfTwo(Mutex<StdRng>);

impl RoutingPolicy for PowerOfTwo {
    fn decide(&self, _prompt: PromptRef<'_>, view: &View<'_>) -> Option<Decision> {
        let mut rng = self.0.lock();
        let a = view.live[rng.random_range(0..view.live.len())];
        let b = view.live[rng.random_range(0..view.live.len())];
        least_loaded(&[a, b], view.active, &mut rng).map(Decision::plain)
    }
}

fn least_loaded(ids: &[u64], active: &ActiveSequences, rng: &mut StdRng) -> Option<u64> {
    let loads: Vec<u32> = ids.iter().map(|w| active.load(*w).requests).collect();
    let min = loads.iter().copied().min()?;
    let tied: Vec<u64> = ids
        .iter()
        .zip(&loads)
        .filter(|(_, l)| **l == min)
        .map(|(w, _)| *w)
        .collect();
    Some(tied[rng.random_range(0..tied.len())])
}
