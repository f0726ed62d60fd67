//! Compare a GGUF model's quantized path with its dequantized f32 path on one prompt:
//! logits difference of the prefill and greedy tokens of both.
//!   cargo run --release -p dyn-gpu --example gguf_check -- MODEL.gguf 1,2,3 [steps]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use dyn_gpu::backend::{Backend, KvShape, SeqStep};
use dyn_gpu::cpu::CpuBackend;
use dyn_gpu::model::DType;
use dyn_gpu::model::gguf::Gguf;
use dyn_gpu::sample::argmax;

fn run(b: &mut CpuBackend, prompt: &[u32], steps: usize) -> (Vec<u32>, Vec<f32>) {
    let blocks: Vec<u32> = (0..64).collect();
    let mut tokens = prompt.to_vec();
    let (mut done, mut first) = (0, Vec::new());
    for _ in 0..steps {
        let s = SeqStep {
            tokens: &tokens[done..],
            start: done,
            blocks: &blocks,
            logits: true,
        };
        let l = b.forward(&[s]).unwrap().remove(0);
        if first.is_empty() {
            first = l.clone();
        }
        done = tokens.len();
        tokens.push(argmax(&l));
    }
    (tokens[prompt.len()..].to_vec(), first)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let g = Gguf::open(std::path::Path::new(&args[1])).unwrap();
    let prompt: Vec<u32> = args[2]
        .split(',')
        .map(|t| t.trim().parse().unwrap())
        .collect();
    let steps = args.get(3).map_or(16, |s| s.parse().unwrap());
    let kv = KvShape {
        num_blocks: 64,
        block_size: 16,
    };
    let mut f = CpuBackend::new(
        g.weights(g.config().unwrap(), DType::F32, false).unwrap(),
        kv,
    )
    .unwrap();
    let mut q = CpuBackend::new(
        g.weights(g.config().unwrap(), DType::F32, true).unwrap(),
        kv,
    )
    .unwrap();
    let (tf, lf) = run(&mut f, &prompt, steps);
    let (tq, lq) = run(&mut q, &prompt, steps);
    let diff = lf
        .iter()
        .zip(&lq)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    let top = |l: &[f32]| {
        let mut i: Vec<usize> = (0..l.len()).collect();
        i.sort_by(|a, b| l[*b].total_cmp(&l[*a]));
        i[..5].iter().map(|&i| (i, l[i])).collect::<Vec<_>>()
    };
    println!("max |logit f32 - quant| at prefill: {diff}");
    println!("top5 f32:   {:?}\ntop5 quant: {:?}", top(&lf), top(&lq));
    println!("f32:   {tf:?}\nquant: {tq:?}");
}
