//! KV transfer throughput, in one run: `cargo bench -p dyn-compute --bench transfer`.
//!
//! - `kv_transfer_64MiB`: the TCP agent's pull against a raw loopback socket copy of the same
//!   bytes (target: the agent reaches at least 70 % of the raw copy).
//! - `kv_blocks_256KiB`: one-sided UCX reads (`dyn-ucx`) of 1, 16 and 256 blocks of 256 KiB,
//!   each read as one contiguous run (what a pull of adjacent blocks posts), against the TCP
//!   agent's pull and a plain memcpy of the same bytes. The region is served by another UCX
//!   context in this process, which UCX reads as it would another process's memory
//!   (cross-memory attach here, see BENCHMARKS.md).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench: a panic is a failure report

use std::time::Duration;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use dyn_compute::transfer::{BlockFormat, KvTransferAgent, TcpAgent};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// 256 blocks of 256 KiB: 64 MiB, a long prompt's KV for a 1B-class model.
const BLOCKS: usize = 256;
const BLOCK_BYTES: usize = 256 << 10;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A prefill side's TCP agent and a decode side's, on loopback, without an identity.
fn tcp_pair(rt: &tokio::runtime::Runtime) -> (TcpAgent, TcpAgent) {
    let bind = || TcpAgent::bind("127.0.0.1:0", None, dyn_trust::Trust::plain());
    rt.block_on(async { (bind().await.unwrap(), bind().await.unwrap()) })
}

fn format() -> BlockFormat {
    BlockFormat {
        block_bytes: BLOCK_BYTES as u32,
        layout: dyn_compute::transfer::BlockLayout::LayerKvHeadSlotDim,
        dtype: dyn_compute::transfer::BlockDType::Bf16,
    }
}

fn bench(c: &mut Criterion) {
    let rt = runtime();
    let blocks: Vec<Bytes> = (0..BLOCKS)
        .map(|i| Bytes::from(vec![i as u8; BLOCK_BYTES]))
        .collect();
    let total = (BLOCKS * BLOCK_BYTES) as u64;
    let mut g = c.benchmark_group("kv_transfer_64MiB");
    g.throughput(Throughput::Bytes(total));
    g.sample_size(20);
    g.measurement_time(Duration::from_secs(10));

    // Raw: a server that writes the same bytes to every connection; the client reads them all.
    let (addr, payload) = rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let payload = Bytes::from(vec![7u8; BLOCKS * BLOCK_BYTES]);
        let p = payload.clone();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                let p = p.clone();
                tokio::spawn(async move {
                    let _ = s.set_nodelay(true);
                    let _ = s.read_u8().await;
                    let _ = s.write_all(&p).await;
                });
            }
        });
        (addr, payload)
    });
    g.bench_function("raw_socket_copy", |b| {
        b.iter(|| {
            rt.block_on(async {
                let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
                let _ = s.set_nodelay(true);
                s.write_u8(1).await.unwrap();
                let mut buf = bytes::BytesMut::zeroed(payload.len());
                s.read_exact(&mut buf).await.unwrap();
                buf
            })
        })
    });

    let (prefill, decode) = tcp_pair(&rt);
    let format = format();
    g.bench_function("tcp_agent_pull", |b| {
        b.iter(|| {
            rt.block_on(async {
                let ids = (0..BLOCKS as u32).collect();
                let desc = prefill
                    .offer(ids, blocks.clone(), format.clone(), Duration::from_secs(60))
                    .unwrap();
                decode.pull(&desc, None).await.unwrap()
            })
        })
    });
    g.finish();
}

fn ucx_reads(c: &mut Criterion) {
    let rt = runtime();
    let all: Vec<u8> = (0..BLOCKS * BLOCK_BYTES).map(|i| (i % 251) as u8).collect();
    let all = Bytes::from(all);
    let owner = dyn_ucx::Agent::new("ucx-owner").unwrap();
    let reader = dyn_ucx::Agent::new("ucx-reader").unwrap();
    let region = rt.block_on(owner.register(all.clone())).unwrap();
    let remote = region.remote().clone();
    let (prefill, decode) = tcp_pair(&rt);
    let format = format();
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

criterion_group!(benches, bench, ucx_reads);
criterion_main!(benches);
