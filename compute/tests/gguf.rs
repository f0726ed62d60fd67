//! GGUF files: a checkpoint written the way llama.cpp's converter writes it (q and k rows
//! interleaved per head) runs exactly as the safetensors original; corrupt files are errors
//! that name the file and the problem; and the real SmolLM2-135M-Instruct GGUF (fetched by
//! scripts/test into a cache; skipped visibly without it) continues prompts as transformers
//! does on the same file.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

mod common;

use std::path::{Path, PathBuf};

use common::{dir, max_diff, reference};
use dyn_compute::backend::{Backend, KvShape, SeqStep};
use dyn_compute::cpu::CpuBackend;
use dyn_compute::model::gguf::{Gguf, GgufWeights as _};
use dyn_compute::model::{DType, ModelWeights};
use dyn_compute::sample::argmax;

/// A minimal GGUF writer (version 3), for fixtures and corrupt files.
#[derive(Default)]
struct Writer {
    kv: Vec<u8>,
    n_kv: u64,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl Writer {
    fn u32(&mut self, key: &str, v: u32) -> &mut Self {
        string(&mut self.kv, key);
        self.kv.extend(4u32.to_le_bytes());
        self.kv.extend(v.to_le_bytes());
        self.n_kv += 1;
        self
    }
    fn f32(&mut self, key: &str, v: f32) -> &mut Self {
        string(&mut self.kv, key);
        self.kv.extend(6u32.to_le_bytes());
        self.kv.extend(v.to_le_bytes());
        self.n_kv += 1;
        self
    }
    fn str(&mut self, key: &str, v: &str) -> &mut Self {
        string(&mut self.kv, key);
        self.kv.extend(8u32.to_le_bytes());
        string(&mut self.kv, v);
        self.n_kv += 1;
        self
    }
    /// An f32 tensor with ggml dims (innermost first).
    fn tensor(&mut self, name: &str, dims: &[u64], v: &[f32]) -> &mut Self {
        let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.tensors.push((name.into(), dims.to_vec(), 0, bytes));
        self
    }
    fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend(&self.kv);
        let mut offset = 0u64;
        for (name, dims, ty, data) in &self.tensors {
            string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
            out.extend(ty.to_le_bytes());
            out.extend(offset.to_le_bytes());
            offset += (data.len() as u64).div_ceil(32) * 32;
        }
        out.resize(out.len().div_ceil(32) * 32, 0);
        for (_, _, _, data) in &self.tensors {
            out.extend(data);
            out.resize(out.len().div_ceil(32) * 32, 0);
        }
        out
    }
}

/// llama.cpp's converter's `permute` for q/k: within each head, row `i · d/2 + j` goes to
/// `2j + i`.
fn permute(w: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let d = w.len() / cols / heads;
    let mut out = vec![0.0; w.len()];
    for h in 0..heads {
        for i in 0..2 {
            for j in 0..d / 2 {
                let (src, dst) = (h * d + i * d / 2 + j, h * d + 2 * j + i);
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// models/tiny as a GGUF, written as llama.cpp's converter writes a llama checkpoint.
fn tiny_gguf() -> Writer {
    let ck = dyn_compute::model::Checkpoint::open(&dir("tiny")).unwrap();
    let (h, i, v, layers, heads, kvh) = (64usize, 128usize, 689usize, 2, 4, 2);
    let d = h / heads;
    let t = |n: &str, shape: &[usize]| ck.get_f32(n, shape).unwrap();
    let mut g = Writer::default();
    g.str("general.architecture", "llama")
        .u32("llama.block_count", layers as u32)
        .u32("llama.context_length", 4096)
        .u32("llama.embedding_length", h as u32)
        .u32("llama.feed_forward_length", i as u32)
        .u32("llama.attention.head_count", heads as u32)
        .u32("llama.attention.head_count_kv", kvh as u32)
        .f32("llama.rope.freq_base", 10000.0)
        .f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .u32("llama.vocab_size", v as u32);
    let (h64, i64_, v64) = (h as u64, i as u64, v as u64);
    g.tensor(
        "token_embd.weight",
        &[h64, v64],
        &t("model.embed_tokens.weight", &[v, h]),
    );
    g.tensor("output.weight", &[h64, v64], &t("lm_head.weight", &[v, h]));
    g.tensor("output_norm.weight", &[h64], &t("model.norm.weight", &[h]));
    for l in 0..layers {
        let p = |n: &str| format!("model.layers.{l}.{n}");
        let b = |n: &str| format!("blk.{l}.{n}");
        let q = permute(&t(&p("self_attn.q_proj.weight"), &[h, h]), heads, h);
        let k = permute(&t(&p("self_attn.k_proj.weight"), &[kvh * d, h]), kvh, h);
        g.tensor(&b("attn_q.weight"), &[h64, h64], &q);
        g.tensor(&b("attn_k.weight"), &[h64, (kvh * d) as u64], &k);
        g.tensor(
            &b("attn_v.weight"),
            &[h64, (kvh * d) as u64],
            &t(&p("self_attn.v_proj.weight"), &[kvh * d, h]),
        );
        g.tensor(
            &b("attn_output.weight"),
            &[h64, h64],
            &t(&p("self_attn.o_proj.weight"), &[h, h]),
        );
        g.tensor(
            &b("ffn_gate.weight"),
            &[h64, i64_],
            &t(&p("mlp.gate_proj.weight"), &[i, h]),
        );
        g.tensor(
            &b("ffn_up.weight"),
            &[h64, i64_],
            &t(&p("mlp.up_proj.weight"), &[i, h]),
        );
        g.tensor(
            &b("ffn_down.weight"),
            &[i64_, h64],
            &t(&p("mlp.down_proj.weight"), &[h, i]),
        );
        g.tensor(
            &b("attn_norm.weight"),
            &[h64],
            &t(&p("input_layernorm.weight"), &[h]),
        );
        g.tensor(
            &b("ffn_norm.weight"),
            &[h64],
            &t(&p("post_attention_layernorm.weight"), &[h]),
        );
    }
    g
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// A directory of the test's own (tests run in parallel).
fn tmp(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("dyn-gguf-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Greedy: prefill `prompt`, then `steps` decode steps; the tokens and each step's logits.
fn greedy(b: &mut dyn Backend, prompt: &[u32], steps: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let blocks: Vec<u32> = (0..(prompt.len() + steps).div_ceil(16) as u32).collect();
    let mut tokens = prompt.to_vec();
    let (mut out, mut logits) = (Vec::new(), Vec::new());
    let mut done = 0;
    while out.len() < steps {
        let step = SeqStep {
            tokens: &tokens[done..],
            start: done,
            blocks: &blocks,
            logits: true,
            all_logits: false,
            hidden: false,
            lora: None,
        };
        let l = b.forward(&[step]).unwrap().remove(0);
        done = tokens.len();
        let t = argmax(&l);
        tokens.push(t);
        out.push(t);
        logits.push(l);
    }
    (out, logits)
}

fn cpu(w: ModelWeights) -> CpuBackend {
    let kv = KvShape {
        num_blocks: 64,
        block_size: 16,
    };
    CpuBackend::new(w, kv).unwrap()
}

#[test]
fn a_llama_gguf_runs_exactly_as_its_safetensors_original() {
    let d = tmp("tiny");
    let path = write(&d, "tiny.gguf", &tiny_gguf().bytes());
    let from_gguf = ModelWeights::load(&path, DType::F32).unwrap();
    let original = ModelWeights::load(&dir("tiny"), DType::F32).unwrap();
    // GGUF has no torch_dtype; everything else is the same shape.
    let shape = dyn_compute::model::ModelConfig {
        torch_dtype: None,
        ..original.config.clone()
    };
    assert_eq!(from_gguf.config, shape);
    for case in reference("tiny").prompts {
        let n = case.greedy.len();
        let (tokens, logits) = greedy(&mut cpu(from_gguf.clone()), &case.prompt, n);
        assert_eq!(tokens, case.greedy, "transformers' greedy tokens");
        for (got, want) in logits.iter().zip(&case.logits) {
            assert!(max_diff(got, want) < 1e-4, "{}", max_diff(got, want));
        }
    }
    std::fs::remove_dir_all(d).ok();
}

#[test]
fn corrupt_files_are_errors_that_name_the_file_and_the_problem() {
    let d = tmp("bad");
    let good = tiny_gguf().bytes();
    let open = |name: &str, bytes: &[u8]| -> String {
        let p = write(&d, name, bytes);
        match Gguf::open(&p).and_then(|g| g.weights(g.config()?, DType::F32, true)) {
            Ok(_) => panic!("{name} loaded"),
            Err(e) => {
                let e = e.to_string();
                assert!(e.contains(&p.display().to_string()), "{e}");
                e
            }
        }
    };
    // Cut anywhere: header, metadata, tensor table, data.
    for cut in (0..good.len()).step_by(good.len() / 97) {
        let e = open("cut.gguf", &good[..cut]);
        assert!(
            e.contains("truncated") || e.contains("magic") || e.contains("more than"),
            "cut at {cut}: {e}"
        );
    }
    let mut magic = good.clone();
    magic[..4].copy_from_slice(b"GGML");
    assert!(open("magic.gguf", &magic).contains("not a GGUF file"));
    // A type dyn does not read (Q2_K, ggml type 10).
    let mut w = tiny_gguf();
    w.tensors[3].2 = 10;
    let e = open("type.gguf", &w.bytes());
    assert!(
        e.contains("Q2_K") && e.contains("blk.0.attn_q.weight"),
        "{e}"
    );
    // Metadata the shape needs.
    let mut w = Writer::default();
    w.str("general.architecture", "llama")
        .u32("llama.embedding_length", 64);
    let e = open("meta.gguf", &w.bytes());
    assert!(e.contains("llama.attention.head_count is missing"), "{e}");
    let mut w = Writer::default();
    w.str("general.architecture", "gpt2");
    assert!(open("arch.gguf", &w.bytes()).contains("\"gpt2\" is not supported"));
    // A tensor whose dims disagree with the metadata.
    let mut w = tiny_gguf();
    w.tensors[2].1 = vec![32];
    let e = open("dims.gguf", &w.bytes());
    assert!(e.contains("output_norm.weight has dims [32]"), "{e}");
    // A huge count does not allocate.
    let mut huge = good[..24].to_vec();
    huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(open("huge.gguf", &huge).contains("more than"));
    std::fs::remove_dir_all(d).ok();
}

/// A Q8_0 tensor (what llama.cpp's LoRA converter writes with `--outtype q8_0`) read by the
/// GGUF reader's own widening (`dyn-model`, no kernels) gives what the kernels' dequantization
/// gives (checked against ggml's in `quant::tests`).
#[test]
fn q8_0_tensors_widen_as_the_kernels_dequantize_them() {
    // Eight blocks: scales of either sign, and every byte as a value.
    let data: Vec<u8> = (0..8u8)
        .flat_map(|b| {
            let d = half::f16::from_f32((f32::from(b) - 3.5) / 64.0);
            let values = (0..32u8).map(move |i| i.wrapping_mul(8).wrapping_add(b));
            d.to_le_bytes().into_iter().chain(values)
        })
        .collect();
    let mut w = Writer::default();
    w.tensors.push((
        "blk.0.attn_q.weight.lora_a".into(),
        vec![64, 4],
        8,
        data.clone(),
    ));
    let d = tmp("q8");
    let g = Gguf::open(&write(&d, "q8.gguf", &w.bytes())).unwrap();
    let (dims, got) = g.tensor_f32("blk.0.attn_q.weight.lora_a").unwrap();
    assert_eq!(dims, [64, 4]);
    let mut want = vec![0.0; 256];
    dyn_compute::quant::dequantize(dyn_compute::quant::QType::Q8_0, &data, &mut want);
    assert_eq!(got, want);
    std::fs::remove_dir_all(d).ok();
}

/// The cached SmolLM2-135M-Instruct Q4_1 GGUF (scripts/test fetches it), if present.
pub fn smollm2() -> Option<PathBuf> {
    let p = PathBuf::from(std::env::var_os("DYN_SMOLLM2_GGUF")?);
    p.exists().then_some(p)
}

#[derive(serde::Deserialize)]
struct SmolReference {
    cases: Vec<SmolCase>,
    #[serde(default)]
    ppl_tokens: Vec<u32>,
    #[serde(default)]
    ppl: f64,
}

#[derive(serde::Deserialize)]
struct SmolCase {
    prompt: Vec<u32>,
    greedy: Vec<u32>,
}

fn smol_reference(name: &str) -> SmolReference {
    let text = std::fs::read_to_string(dir(name)).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Perplexity of `tokens`, one decode step per token (the backend returns the last logits).
fn perplexity(b: &mut dyn Backend, tokens: &[u32]) -> f64 {
    let blocks: Vec<u32> = (0..tokens.len().div_ceil(16) as u32).collect();
    let mut nll = 0.0;
    for i in 0..tokens.len() - 1 {
        let step = SeqStep {
            tokens: &tokens[i..=i],
            start: i,
            blocks: &blocks,
            logits: true,
            all_logits: false,
            hidden: false,
            lora: None,
        };
        let l = b.forward(&[step]).unwrap().remove(0);
        let max = l.iter().fold(f32::NEG_INFINITY, |a, v| a.max(*v)) as f64;
        let lse = max + l.iter().map(|v| (*v as f64 - max).exp()).sum::<f64>().ln();
        nll += lse - l[tokens[i + 1] as usize] as f64;
    }
    (nll / (tokens.len() - 1) as f64).exp()
}

/// The quantized path (integer products on the Q4_1/Q8_0 blocks, 8-bit activations) against
/// llama.cpp on the same file (models/smollm2-llamacpp-reference.json, from
/// scripts/make-gguf-reference): perplexity on a fixed text within 1 %, and the greedy
/// agreement printed.
#[test]
fn smollm2_quantized_path_agrees_with_llama_cpp() {
    let Some(path) = smollm2() else {
        dyn_tests::skip("DYN_SMOLLM2_GGUF is not set (scripts/test fetches the model)");
        return;
    };
    let tf = smol_reference("smollm2-gguf-reference.json");
    let lc = smol_reference("smollm2-llamacpp-reference.json");
    let g = Gguf::open(&path).unwrap();
    let qw = g.weights(g.config().unwrap(), DType::F32, true).unwrap();
    let ppl = perplexity(&mut cpu(qw.clone()), &tf.ppl_tokens);
    eprintln!(
        "perplexity: dyn quantized {ppl:.4}, llama.cpp {:.4}",
        lc.ppl
    );
    assert!((ppl / lc.ppl - 1.0).abs() < 0.01, "{ppl} vs {}", lc.ppl);
    let (mut prefix, mut same, mut total) = (0, 0, 0);
    for case in &lc.cases {
        let (q, _) = greedy(&mut cpu(qw.clone()), &case.prompt, case.greedy.len());
        prefix += q
            .iter()
            .zip(&case.greedy)
            .take_while(|(a, b)| a == b)
            .count();
        // Teacher-forced: fed llama.cpp's tokens, does dyn choose llama.cpp's next one?
        let choices = common::forced(&mut cpu(qw.clone()), &case.prompt, &case.greedy, None);
        same += choices
            .iter()
            .zip(&case.greedy)
            .filter(|(a, b)| a == b)
            .count();
        total += case.greedy.len();
    }
    eprintln!(
        "greedy vs llama.cpp: {prefix} of {total} tokens before the first divergence; fed llama.cpp's tokens, {same} of {total} steps choose its token"
    );
    assert!(same * 10 >= total * 9, "{same} of {total}");
}

/// Greedy continuations of the real GGUF, dequantized to f32, equal transformers' of the
/// same file (models/smollm2-gguf-reference.json, from scripts/make-gguf-reference); the
/// quantized path's agreement with them is printed.
#[test]
fn smollm2_gguf_continues_as_transformers_does() {
    let Some(path) = smollm2() else {
        dyn_tests::skip("DYN_SMOLLM2_GGUF is not set (scripts/test fetches the model)");
        return;
    };
    let r = smol_reference("smollm2-gguf-reference.json");
    let g = Gguf::open(&path).unwrap();
    let f32w = g.weights(g.config().unwrap(), DType::F32, false).unwrap();
    let qw = g.weights(g.config().unwrap(), DType::F32, true).unwrap();
    let (mut same, mut total) = (0, 0);
    for case in &r.cases {
        let (tokens, _) = greedy(&mut cpu(f32w.clone()), &case.prompt, case.greedy.len());
        assert_eq!(tokens, case.greedy, "prompt {:?}", case.prompt);
        let (q, _) = greedy(&mut cpu(qw.clone()), &case.prompt, case.greedy.len());
        let agree = q.iter().zip(&tokens).take_while(|(a, b)| a == b).count();
        same += agree;
        total += tokens.len();
    }
    eprintln!("quantized path: {same} of {total} greedy tokens before the first divergence");
}
