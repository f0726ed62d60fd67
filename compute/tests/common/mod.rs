//! What the backend tests share: the fixture checkpoints in `models/` and their reference
//! outputs from Hugging Face transformers (scripts/make-native-fixtures).
#![allow(dead_code, clippy::unwrap_used)] // each test file uses part of it

use std::path::PathBuf;

#[derive(serde::Deserialize)]
pub struct Reference {
    pub prompts: Vec<Case>,
}

/// One prompt: its greedy continuation, and the logits of the prefill and the first decode
/// steps.
#[derive(serde::Deserialize)]
pub struct Case {
    pub prompt: Vec<u32>,
    pub greedy: Vec<u32>,
    pub logits: Vec<Vec<f32>>,
}

/// The fixture checkpoints: llama, qwen2 (q/k/v bias, tied, sharded), mistral (sliding
/// window, bf16).
pub const MODELS: [&str; 3] = ["tiny", "tiny-qwen2", "tiny-mistral"];

pub fn dir(model: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models")
        .join(model)
}

pub fn reference(model: &str) -> Reference {
    let text = std::fs::read_to_string(dir(model).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

impl Case {
    /// The prompt and the greedy answer but its last token: one forward pass over it with
    /// every position's logits gives, at the answer's positions, each greedy step's logits.
    pub fn answered(&self) -> Vec<u32> {
        let mut tokens = self.prompt.clone();
        tokens.extend(&self.greedy[..self.logits.len() - 1]);
        tokens
    }
}

/// A step computing `tokens` from `start` with every position's logits, batched with the
/// one-token sequence `other` on blocks of its own that asks for its last logits only.
pub fn all_logits_step<'a>(
    tokens: &'a [u32],
    start: usize,
    blocks: &'a [u32],
    other: &'a [u32],
    other_blocks: &'a [u32],
) -> [dyn_compute::backend::SeqStep<'a>; 2] {
    use dyn_compute::backend::SeqStep;
    [
        SeqStep {
            tokens,
            start,
            blocks,
            logits: true,
            all_logits: true,
            hidden: false,
            lora: None,
        },
        SeqStep {
            tokens: other,
            start: 0,
            blocks: other_blocks,
            logits: true,
            all_logits: false,
            hidden: false,
            lora: None,
        },
    ]
}

pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// One sequence's state for driving a backend by hand.
pub struct Seq<'a> {
    pub tokens: Vec<u32>,
    pub computed: usize,
    pub blocks: Vec<u32>,
    /// The LoRA adapter its tokens run with.
    pub lora: Option<&'a dyn_compute::model::lora::LoraAdapter>,
    /// The logits of each sampled token.
    pub logits: Vec<Vec<f32>>,
}

impl<'a> Seq<'a> {
    pub fn new(prompt: &[u32], first_block: u32, block_size: usize, max_len: usize) -> Seq<'a> {
        let n = max_len.div_ceil(block_size) as u32;
        Seq {
            tokens: prompt.to_vec(),
            computed: 0,
            blocks: (first_block..first_block + n).collect(),
            lora: None,
            logits: Vec::new(),
        }
    }
}

/// Run `seqs` together until each has `steps` new tokens, prefilling `chunk` tokens a step.
pub fn generate(
    b: &mut dyn dyn_compute::backend::Backend,
    seqs: &mut [Seq<'_>],
    steps: usize,
    chunk: usize,
) {
    loop {
        let want: Vec<bool> = seqs.iter().map(|s| s.logits.len() < steps).collect();
        if !want.contains(&true) {
            return;
        }
        let plan: Vec<(usize, usize)> = seqs
            .iter()
            .zip(&want)
            .enumerate()
            .filter(|(_, (_, w))| **w)
            .map(|(i, (s, _))| (i, (s.tokens.len() - s.computed).min(chunk)))
            .collect();
        let batch: Vec<dyn_compute::backend::SeqStep<'_>> = plan
            .iter()
            .map(|&(i, n)| {
                let s = &seqs[i];
                dyn_compute::backend::SeqStep {
                    tokens: &s.tokens[s.computed..s.computed + n],
                    start: s.computed,
                    blocks: &s.blocks,
                    logits: s.computed + n == s.tokens.len(),
                    all_logits: false,
                    hidden: false,
                    lora: s.lora,
                }
            })
            .collect();
        let mut logits = b.forward(&batch).unwrap().into_iter();
        for &(i, n) in &plan {
            let s = &mut seqs[i];
            s.computed += n;
            if s.computed == s.tokens.len() {
                let l = logits.next().unwrap();
                s.tokens.push(dyn_compute::sample::argmax(&l));
                s.logits.push(l);
            }
        }
    }
}

/// The greedy choice at each step of `prompt` followed by `given` (teacher forcing), with
/// `lora`.
pub fn forced(
    b: &mut dyn dyn_compute::backend::Backend,
    prompt: &[u32],
    given: &[u32],
    lora: Option<&dyn_compute::model::lora::LoraAdapter>,
) -> Vec<u32> {
    let all: Vec<u32> = prompt.iter().chain(given).copied().collect();
    let blocks: Vec<u32> = (0..all.len().div_ceil(16) as u32).collect();
    let mut done = 0;
    (prompt.len()..prompt.len() + given.len())
        .map(|end| {
            let step = dyn_compute::backend::SeqStep {
                tokens: &all[done..end],
                start: done,
                blocks: &blocks,
                logits: true,
                all_logits: false,
                hidden: false,
                lora,
            };
            done = end;
            dyn_compute::sample::argmax(&b.forward(&[step]).unwrap().remove(0))
        })
        .collect()
}
