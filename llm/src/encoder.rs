//! Prompt encoding: [fastokens](https://crates.io/crates/fastokens) where it loads the model's
//! tokenizer and agrees with Hugging Face tokenizers, Hugging Face tokenizers otherwise.
//!
//! Tokenizing the prompt was half of the frontend's CPU per request (a 512-token chat prompt
//! took ~0.6 ms in `tokenizers`' `encode_fast`, most of it in the byte-level pre-tokenizer's
//! per-character alignment bookkeeping); fastokens encodes the same text to the same ids about
//! 80× faster. Dynamo's frontend offers the same backend, also as a hybrid: fastokens encodes,
//! Hugging Face decodes (incremental detokenization stays on [`tokenizers::Tokenizer`]).
//!
//! Trust is checked, not assumed: at load both encoders run over a set of probe strings (the
//! tokenizer's own added tokens, whitespace runs, digits, punctuation, non-Latin scripts) and
//! any disagreement drops fastokens for that model with a warning. A panic inside fastokens
//! falls back to Hugging Face for that call.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use tokenizers::Tokenizer;

/// Encodes prompts to token ids for one model.
pub struct Encoder {
    hf: Arc<Tokenizer>,
    fast: Option<fastokens::Tokenizer>,
}

impl Encoder {
    /// Hugging Face tokenizers only.
    pub fn hf(hf: Arc<Tokenizer>) -> Self {
        Self { hf, fast: None }
    }

    /// fastokens built from the same `tokenizer.json` text `hf` was, kept only when it loads
    /// and encodes every probe string as `hf` does.
    pub fn new(hf: Arc<Tokenizer>, json: &str) -> Self {
        let fast = serde_json::from_str(json)
            .map_err(fastokens::Error::from)
            .and_then(fastokens::Tokenizer::from_json);
        let fast = match fast {
            Ok(f) => f,
            Err(e) => {
                tracing::info!(error = %e, "fastokens cannot load this tokenizer; prompts are encoded by Hugging Face tokenizers");
                return Self::hf(hf);
            }
        };
        let this = Self {
            hf,
            fast: Some(fast),
        };
        match this.disagreement() {
            None => this,
            Some(probe) => {
                tracing::warn!(probe = %probe.escape_debug(), "fastokens and Hugging Face tokenizers disagree; prompts are encoded by Hugging Face tokenizers");
                Self::hf(this.hf)
            }
        }
    }

    /// Whether prompts go through fastokens.
    pub fn is_fast(&self) -> bool {
        self.fast.is_some()
    }

    /// The same model, Hugging Face tokenizers only (for comparing the two).
    pub fn without_fast(&self) -> Self {
        Self::hf(self.hf.clone())
    }

    /// Token ids of `text`; `add_special` adds the post-processor's special tokens (a completion
    /// prompt), as `tokenizers`' `encode(text, add_special)` does.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, String> {
        match self.encode_fast(text, add_special) {
            Some(ids) => Ok(ids),
            None => self.encode_hf(text, add_special),
        }
    }

    /// fastokens' ids; `None` without it, or when it fails or panics (logged).
    fn encode_fast(&self, text: &str, add_special: bool) -> Option<Vec<u32>> {
        let fast = self.fast.as_ref()?;
        match catch_unwind(AssertUnwindSafe(|| {
            fast.encode_with_special_tokens(text, add_special)
        })) {
            Ok(Ok(ids)) => Some(ids),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "fastokens failed; encoding with Hugging Face tokenizers");
                None
            }
            Err(_) => {
                tracing::error!("fastokens panicked; encoding with Hugging Face tokenizers");
                None
            }
        }
    }

    fn encode_hf(&self, text: &str, add_special: bool) -> Result<Vec<u32>, String> {
        self.hf
            .encode_fast(text, add_special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    /// The first probe string the two encoders disagree on (with or without special tokens).
    fn disagreement(&self) -> Option<String> {
        self.fast.as_ref()?;
        probes(&self.hf).into_iter().find(|p| {
            [false, true]
                .into_iter()
                .any(|special| self.encode_hf(p, special).ok() != self.encode_fast(p, special))
        })
    }
}

/// Strings that exercise what BPE tokenizers differ on, with the tokenizer's added tokens
/// between and around words (as a chat template puts them).
fn probes(hf: &Tokenizer) -> Vec<String> {
    const TEXTS: &[&str] = &[
        "",
        " ",
        "Hello, world! How are you today?",
        "  leading and trailing spaces  ",
        "tabs\tand\nnew\n\nlines\r\n and   runs    of spaces",
        "numbers 0 12 345 6789 3.14159 1,000,000 2026-11-23",
        "punctuation: (a) [b] {c} <d> \"e\" 'f' `g` ... --- !!! ???",
        "contractions: don't won't it's we'll they've I'm you'd",
        "CamelCaseWords snake_case_words kebab-case-words URLs https://example.com/a?b=c",
        "código 日本語のテキスト 中文 한국어 Ελληνικά русский العربية עברית हिन्दी",
        "emoji 🙂👍🏽 🇫🇷 and combining e\u{301} a\u{308}",
        "fn main() {\n    println!(\"{}\", 1 + 2);\n}\n",
        "\u{0}\u{1}\u{7f} control characters",
    ];
    let added: Vec<String> = hf
        .get_added_tokens_decoder()
        .into_values()
        .map(|t| t.content)
        .take(64)
        .collect();
    let mut out: Vec<String> = TEXTS.iter().map(|s| (*s).to_owned()).collect();
    for (i, tok) in added.iter().enumerate() {
        let text = TEXTS[2 + i % (TEXTS.len() - 2)];
        out.push(format!("{tok}{text}{tok}\n{text} {tok} x{tok}y"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny_dir() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tiny")
    }

    fn tiny() -> (Arc<Tokenizer>, String) {
        let path = tiny_dir().join("tokenizer.json");
        let json = std::fs::read_to_string(&path).expect("tokenizer.json");
        (Arc::new(Tokenizer::from_file(&path).expect("loads")), json)
    }

    #[test]
    fn fastokens_is_used_for_the_tiny_model_and_agrees_with_hugging_face() {
        let (hf, json) = tiny();
        let enc = Encoder::new(hf.clone(), &json);
        assert!(enc.is_fast(), "fastokens should load the tiny tokenizer");
        let corpus = std::fs::read_to_string(tiny_dir().join("corpus.txt")).expect("corpus");
        for text in corpus.lines().chain(probes(&hf).iter().map(String::as_str)) {
            for special in [false, true] {
                let want = hf
                    .encode_fast(text, special)
                    .expect("hf")
                    .get_ids()
                    .to_vec();
                assert_eq!(enc.encode(text, special).expect("fast"), want, "{text:?}");
            }
        }
    }

    #[test]
    fn a_tokenizer_fastokens_cannot_load_falls_back_to_hugging_face() {
        let (hf, _) = tiny();
        let enc = Encoder::new(hf.clone(), "{\"not\": \"a tokenizer\"}");
        assert!(!enc.is_fast());
        let want = hf
            .encode_fast("Hello there", true)
            .expect("hf")
            .get_ids()
            .to_vec();
        assert_eq!(enc.encode("Hello there", true).expect("hf"), want);
    }
}
