//! The quantized products on one core, every GGUF type against f32 on the same shape, in one
//! run: `cargo bench -p dyn-compute --bench quant`. Throughput is in weights per second (one row
//! of input); at one row, bytes of weights read per second is that times the type's bytes per
//! weight.
//!
//! The shape is a 4096 × 1536 matrix (24 MiB as f32, too large for the caches, so weights
//! stream from memory as in a decode step) at 1 and 16 input rows. `f32` is the packed
//! AVX-512 f32 product ([`Linear`] on f32 weights); the others are [`Linear`] on quantized
//! weights: eight-row panels and `vpdpbusd` where the CPU has AVX512-VNNI.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench: a panic is a failure report

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use dyn_compute::cpu::linear::{Linear, Scratch, Write};
use dyn_compute::model::{Host, Matrix};
use dyn_compute::quant::{QTensor, QType};

const OUT: usize = 4096;
const INP: usize = 1536;

/// Random blocks with sane f16 scales (splitmix64 bytes).
fn random(ty: QType) -> QTensor {
    let n = OUT * ty.row_bytes(INP).unwrap();
    let mut s = 7u64;
    let mut data: Vec<u8> = (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            (z ^ (z >> 27)) as u8
        })
        .collect();
    let scales: &[usize] = match ty {
        QType::Q4_0 | QType::Q8_0 => &[0],
        QType::Q6K => &[208],
        _ => &[0, 2],
    };
    for block in data.chunks_exact_mut(ty.block_bytes()) {
        for &at in scales {
            block[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        }
    }
    QTensor::new(ty, OUT, INP, data).unwrap()
}

fn bench(c: &mut Criterion) {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let types = [
        ("f32", None),
        ("Q8_0", Some(QType::Q8_0)),
        ("Q4_0", Some(QType::Q4_0)),
        ("Q4_1", Some(QType::Q4_1)),
        ("Q4_K", Some(QType::Q4K)),
        ("Q5_K", Some(QType::Q5K)),
        ("Q6_K", Some(QType::Q6K)),
    ];
    for rows in [1, 16] {
        let x: Vec<f32> = (0..rows * INP)
            .map(|i| ((i * 13 % 29) as f32 - 14.0) / 16.0)
            .collect();
        let mut y = vec![0.0f32; rows * OUT];
        let mut g = c.benchmark_group(format!("product_{rows}x{OUT}x{INP}_one_core"));
        g.throughput(Throughput::Elements((OUT * INP) as u64));
        g.sample_size(20);
        g.measurement_time(Duration::from_secs(3));
        for (name, ty) in types {
            let data = match ty {
                None => Host::F32(
                    (0..OUT * INP)
                        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 512.0)
                        .collect(),
                ),
                Some(ty) => Host::Quant(random(ty)),
            };
            let l = Linear::new(Matrix {
                rows: OUT,
                cols: INP,
                data,
                bias: None,
            });
            let mut scratch = Scratch::default();
            g.bench_function(name, |b| {
                b.iter(|| pool.install(|| l.forward(&x, rows, &mut y, Write::Set, &mut scratch)))
            });
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
