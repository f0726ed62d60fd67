//! One-sided UCX reads against the TCP agent's pull and a plain memcpy of the same bytes, in
//! one run: `cargo bench -p dyn-ucx --bench get`. 1, 16 and 256 blocks of 256 KiB, each read
//! as one contiguous run (what a pull of adjacent blocks posts). Both agents serve from
//! another UCX context / agent in this process; UCX reads it as it would another process's
//! memory (cross-memory attach here, see BENCHMARKS.md).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench: a panic is a failure report

use std::time::Duration;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use dyn_compute::transfer::{BlockFormat, KvTransferAgent, TcpAgent};
use dyn_ucx::Agent;

const BLOCK_BYTES: usize = 256 << 10;

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let all: Vec<u8> = (0..256 * BLOCK_BYTES).map(|i| (i % 251) as u8).collect();
    let all = Bytes::from(all);
    let owner = Agent::new("ucx-owner").unwrap();
    let reader = Agent::new("ucx-reader").unwrap();
    let region = owner.register(all.clone()).unwrap();
    let remote = region.remote().clone();
    let (prefill, decode) = rt.block_on(async {
        (
            TcpAgent::bind("127.0.0.1:0", None, dyn_trust::Trust::plain())
                .await
                .unwrap(),
            TcpAgent::bind("127.0.0.1:0", None, dyn_trust::Trust::plain())
                .await
                .unwrap(),
        )
    });
    let format = BlockFormat {
        block_bytes: BLOCK_BYTES as u32,
        layout: dyn_compute::transfer::BlockLayout::LayerKvHeadSlotDim,
        dtype: dyn_compute::transfer::BlockDType::Bf16,
    };
    let limit = Duration::from_secs(30);
    let mut g = c.benchmark_group("kv_blocks_256KiB");
    g.sample_size(20);
    g.measurement_time(Duration::from_secs(4));
    g.warm_up_time(Duration::from_secs(1));
    for n in [1usize, 16, 256] {
        let bytes = n * BLOCK_BYTES;
        g.throughput(Throughput::Bytes(bytes as u64));
        let mut dst = vec![0u8; bytes];
        g.bench_with_input(BenchmarkId::new("memcpy", n), &n, |b, _| {
            b.iter(|| dst.copy_from_slice(&all[..bytes]))
        });
        g.bench_with_input(BenchmarkId::new("ucx_get", n), &n, |b, _| {
            b.iter(|| rt.block_on(reader.get(&remote, 0, bytes, limit)).unwrap())
        });
        let mut buf = Some(Vec::with_capacity(bytes));
        g.bench_with_input(BenchmarkId::new("ucx_get_into", n), &n, |b, _| {
            b.iter(|| {
                let into = buf.take().unwrap();
                let got = rt.block_on(reader.get_into(&remote, 0, into, bytes, limit));
                buf = Some(got.unwrap());
            })
        });
        let blocks: Vec<Bytes> = (0..n)
            .map(|i| all.slice(i * BLOCK_BYTES..(i + 1) * BLOCK_BYTES))
            .collect();
        g.bench_with_input(BenchmarkId::new("tcp_agent_pull", n), &n, |b, _| {
            b.iter(|| {
                rt.block_on(async {
                    let ids = (0..n as u32).collect();
                    let desc = prefill
                        .offer(ids, blocks.clone(), format.clone(), limit)
                        .unwrap();
                    decode.pull(&desc, None).await.unwrap()
                })
            })
        });
    }
    g.finish();
    drop(region);
}

criterion_group!(benches, bench);
criterion_main!(benches);
