//! Onboarding KV from the offload tiers against moving the same bytes plainly: from host
//! memory (G2: the tier's lookup and the copy into the native CPU backend's pool, per layer
//! its keys and its values, `Backend::load_blocks`) against one `memcpy` per block into a flat
//! buffer, and from disk (G3: reading and checking each block file, then the same copy in)
//! against a plain `std::fs::read` of files holding the same bytes (both from the page
//! cache). Also the copy out at eviction (`Backend::save_blocks`).
//!
//! The pool is the repository's tiny model with 64-token blocks, so each contiguous run in
//! the pool's layout is 4 KiB, as SmolLM2-135M's are with 16-token blocks; 256 blocks, 8 MiB.
//!
//! ```text
//! cargo bench -p dyn-engine --bench offload
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: fail loudly

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use dyn_compute::backend::{Backend, KvShape};
use dyn_engine::events::KvPublisher;
use dyn_engine::offload::disk::DiskDir;
use dyn_engine::offload::{Meta, OffloadConfig, Tiers};

const BLOCKS: usize = 256;
const BLOCK_TOKENS: usize = 64;

fn backend() -> Box<dyn Backend> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tiny");
    let shape = dyn_compute::model::ModelConfig::load(&dir).unwrap();
    let ck = dyn_compute::model::Checkpoint::open(&dir).unwrap();
    let weights = dyn_compute::model::ModelWeights::from_checkpoint(
        shape,
        &ck,
        dyn_compute::model::DType::F32,
    )
    .unwrap();
    let kv = KvShape {
        num_blocks: BLOCKS,
        block_size: BLOCK_TOKENS,
    };
    Box::new(dyn_compute::cpu::CpuBackend::with_threads(weights, kv, 1).unwrap())
}

fn onboard(c: &mut Criterion) {
    let mut backend = backend();
    let block_bytes = backend.block_bytes();
    let payloads: Vec<Bytes> = (0..BLOCKS)
        .map(|i| {
            Bytes::from(
                (0..block_bytes)
                    .map(|j| (i * 31 + j) as u8)
                    .collect::<Vec<u8>>(),
            )
        })
        .collect();
    let hashes: Vec<u64> = (1..=BLOCKS as u64).collect();
    let ids: Vec<u32> = (0..BLOCKS as u32).collect();
    let meta = |h: u64| Meta {
        parent: (h > 1).then(|| h - 1),
        tokens_hash: h,
    };

    // G2, filled through the offload thread as an engine fills it.
    let (tx, _rx) = tokio::sync::mpsc::channel(1 << 16);
    let events = Arc::new(KvPublisher::new(1, "bench".into(), tx));
    let config = OffloadConfig {
        host_blocks: BLOCKS as u32,
        queue_blocks: 1024,
        ..OffloadConfig::default()
    };
    let tiers = Tiers::start(&config, None, "bench", "bench", None, events).unwrap();
    tiers.offload(
        hashes
            .iter()
            .zip(&payloads)
            .map(|(h, d)| (*h, meta(*h), d.clone()))
            .collect(),
    );
    while tiers.occupancy()[0].0 < BLOCKS {
        std::thread::sleep(Duration::from_millis(1));
    }

    // G3, and the same bytes as plain files.
    let root = std::env::temp_dir().join(format!("dyn-bench-offload-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let disk = DiskDir::open(&root, "bench", "bench").unwrap();
    let plain = root.join("plain");
    std::fs::create_dir_all(&plain).unwrap();
    for (h, d) in hashes.iter().zip(&payloads) {
        disk.write(*h, meta(*h), d).unwrap();
        std::fs::write(plain.join(h.to_string()), d).unwrap();
    }

    let mut g = c.benchmark_group("onboard");
    g.throughput(Throughput::Bytes((BLOCKS * block_bytes) as u64));
    let mut flat = vec![0u8; BLOCKS * block_bytes];
    g.bench_function("memcpy", |b| {
        b.iter(|| {
            for (dst, src) in flat.chunks_exact_mut(block_bytes).zip(&payloads) {
                dst.copy_from_slice(src);
            }
            black_box(&flat);
        })
    });
    g.bench_function("g2_host_to_pool", |b| {
        b.iter(|| {
            let data = tiers.take(&hashes);
            let slices: Vec<&[u8]> = data.iter().map(|d| d.as_ref()).collect();
            backend.load_blocks(&ids, &slices).unwrap();
        })
    });
    // Block by block, each dropped after use: the allocator hands the same memory back, so
    // neither side measures the page faults of fresh allocations (which made runs that kept
    // all 256 blocks vary from 1.4 to 8 ms).
    g.bench_function("file_read", |b| {
        b.iter(|| {
            for h in &hashes {
                black_box(std::fs::read(plain.join(h.to_string())).unwrap());
            }
        })
    });
    g.bench_function("g3_disk_to_pool", |b| {
        b.iter(|| {
            for (h, id) in hashes.iter().zip(&ids) {
                let data = disk.read(*h).unwrap();
                backend.load_blocks(&[*id], &[data.as_ref()]).unwrap();
            }
        })
    });
    // What G3 adds to a file read besides the copy in: the check of every payload.
    g.bench_function("xxh3_checksum", |b| {
        b.iter(|| {
            for p in &payloads {
                black_box(xxhash_rust::xxh3::xxh3_64(p));
            }
        })
    });
    // The other direction, on the engine thread at eviction: the pool's blocks copied out.
    g.bench_function("g1_pool_to_host", |b| {
        b.iter(|| black_box(backend.save_blocks(&ids).unwrap()))
    });
    g.finish();
    let _ = std::fs::remove_dir_all(&root);
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3));
    targets = onboard
}
criterion_main!(benches);
