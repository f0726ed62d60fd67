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
            lora: None,
        },
        SeqStep {
            tokens: other,
            start: 0,
            blocks: other_blocks,
            logits: true,
            all_logits: false,
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
