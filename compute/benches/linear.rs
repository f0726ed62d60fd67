//! The CPU backend's batched-decode product on one core, against the `gemm` crate on the same
//! shape, in one run: `cargo bench -p dyn-compute --bench linear`. Throughput is reported in
//! multiply-adds ×2 (flops) per second, so `elem/s` reads as FLOPS.
//!
//! The shape is a decode step's: 16 rows (sixteen sequences) against a 49152 × 768 matrix
//! (the size of the ~100M model's per-step weights, too large for the caches, so the weights
//! stream from memory as they do in a step). `panel f32` / `panel bf16` are
//! [`Linear::forward`] (weights packed at load, register-blocked AVX-512 kernels; bf16 through
//! AVX512-BF16 where the CPU has it); `gemm f32` multiplies the same row-major weights with
//! the `gemm` crate's microkernels, what the backend used before the packed kernels.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench: a panic is a failure report

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use dyn_compute::cpu::gemm::{Strides, matmul};
use dyn_compute::cpu::linear::{Linear, Scratch, Write};
use dyn_compute::model::{Host, Matrix};
use half::bf16;

const ROWS: usize = 16;
const OUT: usize = 49152;
const INP: usize = 768;

fn bench(c: &mut Criterion) {
    // One core: the figure is per core, and rayon inside `Linear` runs on this pool.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let w: Vec<f32> = (0..OUT * INP)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 512.0)
        .collect();
    let x: Vec<f32> = (0..ROWS * INP)
        .map(|i| ((i * 13 % 29) as f32 - 14.0) / 16.0)
        .collect();
    let mut y = vec![0.0f32; ROWS * OUT];
    let mut g = c.benchmark_group("decode_product_16x49152x768_one_core");
    g.throughput(Throughput::Elements((2 * ROWS * OUT * INP) as u64));
    g.sample_size(20);
    g.measurement_time(Duration::from_secs(5));

    for (name, data) in [
        ("panel f32", Host::F32(w.clone())),
        (
            "panel bf16",
            Host::Bf16(w.iter().map(|v| bf16::from_f32(*v)).collect()),
        ),
    ] {
        let l = Linear::new(Matrix {
            rows: OUT,
            cols: INP,
            data,
            bias: None,
        });
        let mut scratch = Scratch::default();
        g.bench_function(name, |b| {
            b.iter(|| pool.install(|| l.forward(&x, ROWS, &mut y, Write::Set, &mut scratch)))
        });
    }
    // y = x · Wᵀ with W row-major `[OUT, INP]`: Wᵀ is W read column-major.
    g.bench_function("gemm f32", |b| {
        b.iter(|| {
            matmul(
                ROWS,
                OUT,
                INP,
                &mut y,
                Strides::rows(OUT),
                false,
                &x,
                Strides::rows(INP),
                &w,
                Strides::cols(INP),
            )
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
