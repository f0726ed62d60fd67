//! KV routing hot paths: hashing a prompt into blocks, `find_matches` in a large index,
//! applying KV events, and a whole `kv` decision with each cost model.
//!
//! ```text
//! cargo bench -p dyn-router --bench kv
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: fail loudly

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Arc;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use dyn_core::planes::{LiveInstances, Planes};
use dyn_protocol::kv::{
    BlockHash, KvCacheEvent, KvEventData, LoadMetrics, PromptHashes, block_hashes, chain_hash,
};
use dyn_router::cost::{CostModel, Pricing};
use dyn_router::indexer::Indexer;
use dyn_router::kv_aware::KvAware;
use dyn_router::policy::{PromptRef, Reported, RoutingPolicy, View};
use dyn_router::sequences::ActiveSequences;

const BLOCK: usize = 16;
const WORKERS: u64 = 64;

/// splitmix64: deterministic pseudo-random u64s without a dependency.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A chain of `n` blocks whose first `shared` local hashes come from `group`, the rest from
/// `unique`.
fn chain(group: u64, shared: usize, unique: u64, n: usize) -> Vec<BlockHash> {
    let mut parent = None;
    (0..n)
        .map(|i| {
            let local = if i < shared {
                mix(group << 20 | i as u64)
            } else {
                mix(unique << 20 | i as u64 | 1 << 63)
            };
            let seq = chain_hash(parent, local);
            parent = Some(seq);
            BlockHash {
                block_hash: seq,
                tokens_hash: local,
            }
        })
        .collect()
}

fn stored(id: u64, blocks: Vec<BlockHash>) -> KvCacheEvent {
    KvCacheEvent {
        event_id: id,
        dp_rank: 0,
        medium: Default::default(),
        data: KvEventData::Stored {
            parent_hash: None,
            blocks,
        },
    }
}

/// 64 workers × 31 sequences of 512 blocks ≈ 1,000,000 stored blocks; sequences come in
/// groups of 4 workers sharing their first 256 blocks. Returns one query per worker and
/// sequence (its sequence hashes), so lookups can rotate and not stay in cache.
fn big_index() -> (Indexer, Vec<Vec<u64>>) {
    let mut ix = Indexer::new();
    let mut queries = Vec::new();
    for w in 0..WORKERS {
        for s in 0..31u64 {
            let c = chain(w / 4 * 100 + s, 256, w * 1000 + s, 512);
            queries.push(c.iter().map(|b| b.block_hash).collect());
            ix.apply(w, &stored(s, c));
        }
    }
    (ix, queries)
}

fn benches(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..8192u32)
        .map(|i| (mix(i as u64) % 128_256) as u32)
        .collect();
    let mut g = c.benchmark_group("hash");
    g.throughput(Throughput::Elements(tokens.len() as u64));
    g.bench_function("block_hashes_8192_tokens_bs16", |b| {
        b.iter(|| block_hashes(black_box(&tokens), BLOCK))
    });
    g.finish();

    let (ix, queries) = big_index();
    let st = ix.stats();
    eprintln!(
        "index: {} stored blocks over {WORKERS} workers, {} nodes, {} bytes, {:.1} bytes per stored block",
        st.worker_blocks,
        st.nodes,
        st.bytes,
        st.bytes as f64 / st.worker_blocks as f64
    );
    let m = ix.find_matches(&queries[0]);
    assert_eq!(m.len(), 4, "the query's group");
    assert!(m.contains(&(0, 512)));
    let mut g = c.benchmark_group("find_matches");
    // Each iteration asks for another of the 1,984 stored sequences (a full 512-block walk,
    // 4 workers sharing the first half), spread over the 80 MB index.
    let mut next = 0usize;
    g.bench_function("512_blocks_64_workers_1m_blocks", |b| {
        b.iter(|| {
            next = (next + 97) % queries.len();
            ix.find_matches(black_box(&queries[next]))
        })
    });
    g.finish();

    // Event application: 64 workers each storing 16 chains of 64 blocks, into a fresh index.
    let events: Vec<(u64, KvCacheEvent)> = (0..WORKERS)
        .flat_map(|w| (0..16u64).map(move |s| (w, stored(s, chain(s, 32, w * 100 + s, 64)))))
        .collect();
    let blocks = WORKERS * 16 * 64;
    let mut g = c.benchmark_group("apply");
    g.throughput(Throughput::Elements(blocks));
    g.bench_function("store_65536_blocks", |b| {
        b.iter_batched(
            || events.clone(),
            |evs| {
                let mut ix = Indexer::new();
                for (w, e) in &evs {
                    ix.apply(*w, e);
                }
                ix
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

/// One routing decision as the router makes it: hash a 1,152-token prompt (a 1,024-token
/// prefix of 48 and its own suffix), look it up, price 16 workers with 8 active requests of
/// 72 blocks each and load metrics, choose. Dynamo's `blocks` cost (the policy before the
/// `time` cost) and the `time` cost in the same run.
fn decisions(c: &mut Criterion) {
    const WORKERS: u64 = 16;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let planes = Planes::embedded();
    let instances = rt
        .block_on(LiveInstances::watch(&*planes.discovery, "bench/"))
        .unwrap();
    let live: Vec<u64> = (0..WORKERS).collect();
    let active = Arc::new(ActiveSequences::default());
    let _held: Vec<_> = (0..WORKERS)
        .flat_map(|w| (0..8u64).map(move |r| (w, r)))
        .map(|(w, r)| {
            active.start(
                w,
                128,
                (0..72).map(|k| mix(w << 32 | r << 16 | k)).collect(),
                Default::default(),
            )
        })
        .collect();
    let reported: HashMap<u64, Reported> = live
        .iter()
        .map(|&w| {
            let metrics = LoadMetrics {
                worker_id: w,
                requests_running: 8,
                step_ms: 5.0,
                prefill_ms_per_token: 0.02,
                ..LoadMetrics::default()
            };
            let own_then = Default::default();
            (w, Reported { metrics, own_then })
        })
        .collect();
    let prefix = |g: u64| (0..1024u64).map(move |i| (mix(g << 20 | i) % 50_000) as u32);
    let prompts: Vec<Vec<u32>> = (0..256u64)
        .map(|i| {
            prefix(i % 48)
                .chain((0..128u64).map(|k| (mix(1 << 40 | i << 10 | k) % 50_000) as u32))
                .collect()
        })
        .collect();
    let view = View {
        live: &live,
        instances: &instances,
        active: &active,
        reported: &reported,
        lora_holders: None,
    };
    let mut g = c.benchmark_group("decide");
    for (name, model) in [
        ("blocks_cost", CostModel::Blocks),
        ("time_cost", CostModel::Time),
    ] {
        let kv = KvAware::new(
            Some(BLOCK as u32),
            Pricing {
                model,
                ..Pricing::default()
            },
        );
        for grp in 0..48u64 {
            let tokens: Vec<u32> = prefix(grp).collect();
            kv.index.write().apply_data(
                grp % WORKERS,
                &KvEventData::Stored {
                    parent_hash: None,
                    blocks: block_hashes(&tokens, BLOCK),
                },
            );
        }
        let mut next = 0usize;
        g.bench_function(format!("1152_tokens_16_workers_{name}"), |b| {
            b.iter(|| {
                next = (next + 1) % prompts.len();
                // A request's memo of its own, as in the router: hashed once per decide.
                let memo = PromptHashes::default();
                kv.decide(
                    PromptRef::new(black_box(&prompts[next]), None, &memo),
                    &view,
                )
                .unwrap()
                .worker
            })
        });
    }
    g.finish();
}

criterion_group!(kv, benches, decisions);
criterion_main!(kv);
