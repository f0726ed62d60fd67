//! A long prompt's tokenized request on the request plane: written and read as JSON with its
//! token ids as an array of numbers (first), as JSON with base64 ids (`dyn_protocol::wire`,
//! then), and by the request's codec (MessagePack, the ids one byte string: now), for a
//! 32k-token prompt of a 49k-token vocabulary (SmolLM2's).
//!
//!   cargo bench -p dyn-protocol --bench wire
#![allow(clippy::expect_used)] // a bench: a panic is a failure report

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use dyn_core::Payload;
use dyn_protocol::types::PreprocessedRequest;

/// The same request with its ids as numbers, as they travelled before.
#[derive(serde::Serialize, serde::Deserialize)]
struct Numbers {
    token_ids: Vec<u32>,
}

fn bench(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..32_768u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 49_152)
        .collect();
    let req = dyn_protocol::testing::preprocessed(tokens.clone(), 1);
    let numbers = Numbers { token_ids: tokens };
    let mut g = c.benchmark_group("request_32k_tokens");
    g.throughput(Throughput::Elements(32_768));
    g.bench_function("numbers_write", |b| {
        b.iter(|| serde_json::to_vec(black_box(&numbers)).expect("writes"))
    });
    g.bench_function("base64_write", |b| {
        b.iter(|| serde_json::to_vec(black_box(&req)).expect("writes"))
    });
    let text = serde_json::to_vec(&numbers).expect("writes");
    g.bench_function("numbers_read", |b| {
        b.iter(|| serde_json::from_slice::<Numbers>(black_box(&text)).expect("reads"))
    });
    let text = serde_json::to_vec(&req).expect("writes");
    g.bench_function("base64_read", |b| {
        b.iter(|| serde_json::from_slice::<PreprocessedRequest>(black_box(&text)).expect("reads"))
    });
    let codec = PreprocessedRequest::codec().expect("crosses processes");
    g.bench_function("codec_write", |b| {
        b.iter(|| {
            let mut out = bytes::BytesMut::new();
            (codec.encode)(black_box(&req), &mut out).expect("writes");
            out
        })
    });
    let mut bytes = bytes::BytesMut::new();
    (codec.encode)(&req, &mut bytes).expect("writes");
    g.bench_function("codec_read", |b| {
        b.iter(|| (codec.decode)(black_box(&bytes)).expect("reads"))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
