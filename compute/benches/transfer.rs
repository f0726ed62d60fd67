//! KV transfer throughput against a raw loopback socket copy of the same bytes, in one run:
//! `cargo bench -p dyn-compute --bench transfer`. The ratio of the two is the figure in
//! BENCHMARKS.md (target: the agent reaches at least 70 % of the raw copy).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench: a panic is a failure report

use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use dyn_compute::transfer::{BlockFormat, KvTransferAgent, TcpAgent};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// 256 blocks of 256 KiB: 64 MiB, a long prompt's KV for a 1B-class model.
const BLOCKS: usize = 256;
const BLOCK_BYTES: usize = 256 << 10;

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
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

criterion_group!(benches, bench);
criterion_main!(benches);
