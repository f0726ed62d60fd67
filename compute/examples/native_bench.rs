//! Decode throughput of the CPU backend against the machine's memory-bandwidth roofline, at
//! batch 1 and with 16 sequences decoding together, measured in one run.
//!
//! ```text
//! cargo run --release -p dyn-compute --example native_bench -- MODEL [f32|bf16|f16|quant] [steps] [rounds] [cpu|cuda]
//! ```
//! MODEL is a checkpoint directory or a GGUF file; `quant` keeps a GGUF's quantized matrices
//! quantized (the roofline is then their bytes). Prompt processing (one 512-token prefill)
//! is measured too.
//! On `cuda` (a build with `--features cuda`) the bandwidth is the device's, measured by a
//! large device-to-device copy. Prints one JSON line: measured read bandwidth (GB/s),
//! weight bytes per token,
//! roofline tokens/s (bandwidth ÷ bytes per token), and decode tokens/s at batch 1 and 16.

use std::time::Instant;

use dyn_compute::backend::{Backend, KvShape, SeqStep};
use dyn_compute::cpu::CpuBackend;
use dyn_compute::model::gguf::GgufWeights as _;
use dyn_compute::model::{DType, ModelWeights};
use dyn_compute::sample::argmax;
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;

const PROMPT: usize = 32;
const BLOCK: usize = 16;

/// Best of several multi-threaded passes over a buffer much larger than the caches. The sum
/// is of integers (wrapping), which the compiler vectorizes freely, so the pass is limited by
/// memory, not by a chain of float additions.
fn read_bandwidth(buf: &[u32]) -> f64 {
    let n = buf.len();
    let mut best: f64 = 0.0;
    for _ in 0..3 {
        let t = Instant::now();
        let s: u32 = buf
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u32, |a, x| a.wrapping_add(*x)))
            .reduce(|| 0, u32::wrapping_add);
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(s);
        best = best.max((n * 4) as f64 / secs / 1e9);
    }
    best
}

/// Decode `steps` tokens for `batch` sequences after a `PROMPT`-token prefill; tokens/s.
fn decode(b: &mut dyn Backend, batch: usize, steps: usize, bar: &ProgressBar) -> f64 {
    let per_seq = (PROMPT + steps + 1).div_ceil(BLOCK);
    let mut seqs: Vec<(Vec<u32>, Vec<u32>)> = (0..batch)
        .map(|i| {
            let prompt = (0..PROMPT as u32)
                .map(|t| (t * 31 + i as u32 * 7) % 1000)
                .collect();
            let blocks = ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect();
            (prompt, blocks)
        })
        .collect();
    let steps_in: Vec<SeqStep<'_>> = seqs
        .iter()
        .map(|(t, bl)| SeqStep {
            tokens: t,
            start: 0,
            blocks: bl,
            logits: true,
            all_logits: false,
            hidden: false,
            lora: None,
        })
        .collect();
    let first: Vec<u32> = b
        .forward(&steps_in)
        .map(|l| l.iter().map(|x| argmax(x)).collect())
        .unwrap_or_default();
    for ((t, _), f) in seqs.iter_mut().zip(first) {
        t.push(f);
    }
    bar.set_length(steps as u64);
    bar.set_position(0);
    let started = Instant::now();
    for _ in 0..steps {
        let batch: Vec<SeqStep<'_>> = seqs
            .iter()
            .map(|(t, bl)| SeqStep {
                tokens: &t[t.len() - 1..],
                start: t.len() - 1,
                blocks: bl,
                logits: true,
                all_logits: false,
                hidden: false,
                lora: None,
            })
            .collect();
        let logits = match b.forward(&batch) {
            Ok(l) => l,
            Err(e) => panic!("forward failed: {e}"),
        };
        let next: Vec<u32> = logits.iter().map(|l| argmax(l)).collect();
        for ((t, _), n) in seqs.iter_mut().zip(next) {
            t.push(n);
        }
        bar.inc(1);
    }
    (batch * steps) as f64 / started.elapsed().as_secs_f64()
}

/// Prompt-processing length.
const PP: usize = 512;

/// One `PP`-token prefill, best of `rounds`; tokens/s.
fn prefill(b: &mut dyn Backend, rounds: usize) -> f64 {
    let tokens: Vec<u32> = (0..PP as u32).map(|t| (t * 37) % 1000 + 10).collect();
    let blocks: Vec<u32> = (0..PP.div_ceil(BLOCK) as u32).collect();
    let mut best: f64 = 0.0;
    for _ in 0..rounds {
        let step = SeqStep {
            tokens: &tokens,
            start: 0,
            blocks: &blocks,
            logits: true,
            all_logits: false,
            hidden: false,
            lora: None,
        };
        let t = Instant::now();
        if let Err(e) = b.forward(&[step]) {
            panic!("prefill failed: {e}");
        }
        best = best.max(PP as f64 / t.elapsed().as_secs_f64());
    }
    best
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = std::path::PathBuf::from(
        args.first()
            .ok_or("usage: native_bench MODEL_DIR [f32|bf16] [steps] [rounds] [cpu|cuda]")?,
    );
    let kind = args.get(1).map_or("f32", String::as_str);
    let dtype = match kind {
        "bf16" => DType::Bf16,
        "f16" => DType::F16,
        _ => DType::F32,
    };
    let steps: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(64);
    let n_rounds: usize = args
        .get(3)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(5)
        .max(1);
    let bar = ProgressBar::new(0).with_style(ProgressStyle::with_template(
        "{msg:>14} {bar:30} {pos}/{len} steps",
    )?);
    bar.set_message("loading");
    let w = if kind == "quant" {
        let g = dyn_compute::model::gguf::Gguf::open(&dir)?;
        g.weights(g.config()?, DType::F32, true)?
    } else {
        ModelWeights::load(&dir, dtype)?
    };
    let bytes = w.bytes_per_token();
    let params = w.config.parameters();
    let kv = KvShape {
        num_blocks: (16 * (PROMPT + steps + 1).div_ceil(BLOCK)).max(PP.div_ceil(BLOCK)),
        block_size: BLOCK,
    };
    let device = args.get(4).map_or("cpu", String::as_str);
    let (mut b, bandwidth): (Box<dyn Backend>, Box<dyn Fn() -> f64>) = match device {
        "cpu" => {
            let buf: Vec<u32> = (0..256u32 << 20).collect(); // 1 GiB
            (
                Box::new(CpuBackend::new(w, kv)?),
                Box::new(move || read_bandwidth(&buf)),
            )
        }
        #[cfg(feature = "cuda")]
        "cuda" => (
            dyn_compute::cuda::load(&w, kv, 0)?,
            Box::new(|| dyn_compute::cuda::copy_bandwidth(0).unwrap_or(f64::NAN)),
        ),
        other => {
            return Err(
                format!("device {other}: cpu, or cuda in a build with --features cuda").into(),
            );
        }
    };
    // Warm up (page in the weights, size the buffers).
    bar.set_message("warm-up");
    decode(b.as_mut(), 1, 4, &bar);
    // This machine's bandwidth drifts (shared hosts): bandwidth and batch-1 decode are
    // measured back to back in each of several rounds, and the median round is reported.
    let mut rounds = Vec::new();
    for r in 0..n_rounds {
        bar.set_message(format!("bandwidth {}", r + 1));
        let gbps = bandwidth();
        bar.set_message(format!("batch 1 ({})", r + 1));
        let b1 = decode(b.as_mut(), 1, steps, &bar);
        let roofline = gbps * 1e9 / bytes as f64;
        rounds.push((b1 / roofline, gbps, b1, roofline));
    }
    rounds.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (fraction, gbps, b1, roofline) = rounds[rounds.len() / 2];
    bar.set_message("batch 16");
    let b16 = decode(b.as_mut(), 16, steps, &bar);
    bar.set_message("prefill 512");
    let pp = prefill(b.as_mut(), n_rounds);
    bar.finish_and_clear();
    println!(
        "{}",
        serde_json::json!({
            "backend": b.describe(), "parameters": params, "dtype": dtype.name(),
            "read_gbps": gbps, "weight_bytes_per_token": bytes, "roofline_tok_s": roofline,
            "batch1_tok_s": b1, "batch1_of_roofline": fraction, "batch16_tok_s": b16,
            "prefill512_tok_s": pp,
            "rounds_of_roofline": rounds.iter().map(|r| r.0).collect::<Vec<_>>(),
            "steps": steps, "prompt": PROMPT,
        })
    );
    Ok(())
}
