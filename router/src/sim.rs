//! Deterministic simulations of the `kv` policy: scripted arrivals, first tokens, KV events
//! and completions against [`KvAware`] and [`ActiveSequences`] directly (no planes, no
//! clocks, a seeded generator), checking where each request goes.

use std::collections::HashMap;
use std::sync::Arc;

use dyn_core::planes::{LiveInstances, Planes};

use super::cost::Pricing;
use super::kv_aware::KvAware;
use super::policy::{Decision, PromptRef, Reported, RoutingPolicy, View};
use super::sequences::{ActiveRequest, ActiveSequences, Load};
use dyn_protocol::kv::{KvEventData, LoadMetrics, block_hashes};

const BS: usize = 16;
/// Shared prefixes of 1,024 tokens and unique suffixes of 128, as in the routing grid.
const PREFIX: usize = 1024;
const SUFFIX: usize = 128;

struct Sim {
    kv: KvAware,
    active: Arc<ActiveSequences>,
    live: Vec<u64>,
    reported: HashMap<u64, Reported>,
    /// Unused by the `kv` policy, required by [`View`].
    instances: LiveInstances,
    next_suffix: u32,
}

impl Sim {
    async fn new(workers: &[u64]) -> Self {
        let planes = Planes::embedded();
        let instances = LiveInstances::watch(&*planes.discovery, "sim/")
            .await
            .expect("watch");
        Self {
            kv: KvAware::new(Some(BS as u32), Pricing::default()).seeded(7),
            active: Arc::default(),
            live: workers.to_vec(),
            reported: HashMap::new(),
            instances,
            next_suffix: 0,
        }
    }

    /// A prompt: prefix `p`, then a suffix no other prompt has.
    fn prompt(&mut self, p: u32) -> Vec<u32> {
        self.next_suffix += 1;
        let s = self.next_suffix;
        (0..PREFIX as u32)
            .map(|i| p * 100_000 + i)
            .chain((0..SUFFIX as u32).map(|i| 50_000_000 + s * 1_000 + i))
            .collect()
    }

    fn decide(&self, tokens: &[u32]) -> Decision {
        let view = View {
            live: &self.live,
            instances: &self.instances,
            active: &self.active,
            reported: &self.reported,
            lora_holders: None,
        };
        let memo = dyn_protocol::kv::PromptHashes::default();
        self.kv
            .decide(PromptRef::new(tokens, None, &memo), &view)
            .expect("a decision")
    }

    /// Worker `m.worker_id` reports its load; this router had `own_then` there at the time.
    fn report(&mut self, m: LoadMetrics, own_then: Load) {
        self.reported.insert(
            m.worker_id,
            Reported {
                metrics: m,
                own_then,
            },
        );
    }

    /// Route a request as the router does; the handle finishes it when dropped.
    fn arrive(&self, tokens: &[u32]) -> (u64, ActiveRequest) {
        let d = self.decide(tokens);
        let prefill = tokens.len() - d.cached_tokens(tokens.len());
        let hashes = d.blocks.iter().map(|b| b.block_hash).collect();
        (
            d.worker,
            self.active
                .start(d.worker, prefill as u64, hashes, Default::default()),
        )
    }

    /// Worker `w` reports (KV event) that it caches `tokens`' full blocks.
    fn stored(&self, w: u64, tokens: &[u32]) {
        self.kv.index.write().apply_data(
            w,
            &KvEventData::Stored {
                parent_hash: None,
                blocks: block_hashes(tokens, BS),
            },
        );
    }

    /// Serve a request to the end: route, prefill, cache, finish. Where it went.
    fn serve(&self, tokens: &[u32]) -> u64 {
        let (w, req) = self.arrive(tokens);
        req.first_token();
        self.stored(w, tokens);
        w
    }
}

#[tokio::test]
async fn scripted_arrivals_and_completions_give_the_expected_placements() {
    let mut sim = Sim::new(&[1, 2, 3, 4]).await;
    let (a1, a2, b1) = (sim.prompt(1), sim.prompt(1), sim.prompt(2));
    // Prefix A's first request goes somewhere; its sibling, before any KV event, follows it
    // (the router's own pending blocks count as cached there).
    let (wa, r1) = sim.arrive(&a1);
    let d = sim.decide(&a2);
    assert_eq!(d.worker, wa, "{}", d.reason());
    let home = d.candidates.iter().find(|c| c.worker == wa).expect("home");
    assert_eq!((home.indexed_blocks, home.pending_blocks), (0, PREFIX / BS));
    let (_, r2) = sim.arrive(&a2);
    // A new prefix goes to an idle worker.
    let (wb, r3) = sim.arrive(&b1);
    assert_ne!(wb, wa);
    // Prefilled, cached, finished: later requests go home from the index.
    for r in [&r1, &r2, &r3] {
        r.first_token();
    }
    sim.stored(wa, &a1);
    sim.stored(wb, &b1);
    drop((r1, r2, r3));
    let (a3, b2) = (sim.prompt(1), sim.prompt(2));
    let d = sim.decide(&a3);
    assert_eq!(d.worker, wa);
    assert!(d.reason().starts_with("holds the most"), "{}", d.reason());
    assert_eq!(sim.decide(&b2).worker, wb);
}

#[tokio::test]
async fn a_hot_prefix_spreads_past_the_threshold_and_returns_home_when_it_clears() {
    let mut sim = Sim::new(&[1, 2, 3, 4]).await;
    let warm = sim.prompt(9);
    let home = sim.serve(&warm);
    // A burst on the hot prefix, none finishing: the first `load_slack` stay home (a
    // request's prefill there is a suffix; elsewhere the whole prompt), then the bound sends
    // the next one away.
    let slack = Pricing::default().load_slack as usize;
    let mut held = Vec::new();
    let mut placed = Vec::new();
    for _ in 0..slack + 4 {
        let p = sim.prompt(9);
        let (w, r) = sim.arrive(&p);
        placed.push(w);
        held.push(r);
    }
    assert!(placed[..slack].iter().all(|w| *w == home), "{placed:?}");
    let away = placed[slack];
    assert_ne!(away, home, "{placed:?}");
    let p = sim.prompt(9);
    let d = sim.decide(&p);
    let c = d
        .candidates
        .iter()
        .find(|c| c.worker == home)
        .expect("home");
    assert!(c.excluded.is_some(), "{c:?}");
    // The overflow worker now holds the prefix too (its own requests do): the burst
    // continues there rather than scattering over a third worker.
    assert!(placed[slack..].iter().all(|w| *w == away), "{placed:?}");
    // The burst clears: the prefix goes home again (only the home worker caches it).
    drop(held);
    let p = sim.prompt(9);
    assert_eq!(sim.decide(&p).worker, home);
}

#[tokio::test]
async fn workers_joining_and_leaving_move_only_what_they_must() {
    let mut sim = Sim::new(&[1, 2, 3, 4]).await;
    let prefixes: Vec<u32> = (0..12).collect();
    let mut homes = HashMap::new();
    for &p in &prefixes {
        let t = sim.prompt(p);
        homes.insert(p, sim.serve(&t));
    }
    // New prefixes spread over the emptiest caches: three each.
    let mut per_worker: HashMap<u64, usize> = HashMap::new();
    for w in homes.values() {
        *per_worker.entry(*w).or_default() += 1;
    }
    assert_eq!(per_worker.values().copied().collect::<Vec<_>>(), [3; 4]);
    // A fifth worker joins: every cached prefix stays home; a new one goes to the newcomer.
    sim.live.push(5);
    for &p in &prefixes {
        let t = sim.prompt(p);
        assert_eq!(sim.serve(&t), homes[&p], "prefix {p} moved");
    }
    let t = sim.prompt(100);
    assert_eq!(sim.serve(&t), 5);
    // Worker 2 leaves: only its prefixes move.
    sim.live.retain(|w| *w != 2);
    sim.kv.index.write().remove_worker(2);
    let moved = prefixes
        .iter()
        .filter(|&&p| {
            let t = sim.prompt(p);
            sim.serve(&t) != homes[&p]
        })
        .count();
    assert_eq!(moved, 3);
}

#[tokio::test]
async fn the_time_model_uses_the_speed_workers_report() {
    let mut sim = Sim::new(&[1, 2]).await;
    let p = sim.prompt(1);
    // Worker 1 has a long prefill queue; worker 2 none but a slow step.
    sim.report(
        LoadMetrics {
            worker_id: 1,
            pending_prefill_tokens: 4000,
            requests_waiting: 4,
            step_ms: 5.0,
            prefill_ms_per_token: 0.02,
            ..LoadMetrics::default()
        },
        Load::default(),
    );
    sim.report(
        LoadMetrics {
            worker_id: 2,
            step_ms: 20.0,
            prefill_ms_per_token: 0.02,
            ..LoadMetrics::default()
        },
        Load::default(),
    );
    let d = sim.decide(&p);
    let c: HashMap<u64, _> = d.candidates.iter().map(|c| (c.worker, c)).collect();
    // Worker 1: half a step in progress + 4,000 queued tokens; then a step and the prompt.
    assert!((c[&1].queue_ms - (2.5 + 80.0)).abs() < 1e-9, "{:?}", c[&1]);
    assert!((c[&1].prefill_ms - (5.0 + 1152.0 * 0.02)).abs() < 1e-9);
    assert!((c[&2].ttft_ms() - (20.0 + 1152.0 * 0.02)).abs() < 1e-9);
    assert_eq!(d.worker, 2);
}

#[tokio::test]
async fn another_routers_requests_count_through_the_workers_reports() {
    let mut sim = Sim::new(&[1, 2]).await;
    let p = sim.prompt(1);
    // This router sent one request to worker 1 before its last report and two since; the
    // report says 5 (three of them another router's).
    let _held: Vec<_> = (0..3)
        .map(|_| sim.active.start(1, 0, Vec::new(), Default::default()))
        .collect();
    sim.report(
        LoadMetrics {
            worker_id: 1,
            requests_running: 5,
            ..LoadMetrics::default()
        },
        Load {
            requests: 1,
            ..Load::default()
        },
    );
    let d = sim.decide(&p);
    let c = d.candidates.iter().find(|c| c.worker == 1).expect("1");
    assert_eq!(c.requests, 5 + 2);
    assert_eq!(d.worker, 2);
}
