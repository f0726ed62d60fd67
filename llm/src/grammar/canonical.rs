//! The model's own tokenizer as llguidance's [`TokenizerEnv`], so that text a grammar forces
//! (a tool call's `<tool_call>\n{"name": "`, a schema's keys and punctuation) is generated in
//! the tokens the tokenizer would give it, not one character a token.
//!
//! With an environment whose tokenization is canonical, llguidance does two things for text
//! the grammar forces: the mask allows only the first token of its normal tokenization (a
//! model left free among the masked tokens spells such text byte by byte, since every prefix
//! of it is allowed), and it computes the forced run as "fast-forward" tokens
//! ([`llguidance::Matcher::compute_ff_tokens`]), which a guide appends to the output without
//! sampling them (see [`super::Guide::take_forced`]). llguidance itself retokenizes across
//! the last sampled token and holds back a suffix that later bytes could tokenize differently;
//! this module only tokenizes.
//!
//! Where the tokenizer's answer is not the bytes asked for (a SentencePiece tokenizer adding
//! its dummy-prefix space, an added token the trie holds as special, a duplicate left empty
//! by [`super::token_bytes`]), the trie's greedy tokenization is used instead: valid for the
//! grammar, if not always the shortest.

use std::sync::Arc;

use llguidance::toktrie::{TokTrie, TokenId, TokenizerEnv};
use tokenizers::Tokenizer;

/// A [`TokTrie`] over the model's vocabulary that tokenizes with the model's tokenizer.
pub(super) struct CanonicalEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl CanonicalEnv {
    pub(super) fn new(trie: TokTrie, tokenizer: Arc<Tokenizer>) -> Self {
        Self { trie, tokenizer }
    }

    /// The tokenizer's encoding of `s` (no special tokens added), if it spells exactly `s`
    /// in the trie's bytes.
    fn encode(&self, s: &str) -> Option<Vec<TokenId>> {
        let ids = self
            .tokenizer
            .encode_fast(s, false)
            .ok()?
            .get_ids()
            .to_vec();
        let vocab = self.trie.vocab_size() as u32;
        if ids.iter().any(|&t| t >= vocab) {
            return None;
        }
        (self.trie.decode_raw(&ids) == s.as_bytes()).then_some(ids)
    }
}

impl TokenizerEnv for CanonicalEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // Text as the tokenizer splits it; bytes that are not whole characters greedily.
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.encode(text)
                .unwrap_or_else(|| self.trie.greedy_tokenize(text.as_bytes()))
        })
    }

    fn tokenize_is_canonical(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::Grammars;
    use dyn_protocol::types::Constraint;
    use serde_json::json;
    use std::sync::Arc;
    use tokenizers::Tokenizer;

    /// The repository's tiny model, or SmolLM2 where `DYN_SMOLLM2_GGUF` names its file.
    fn models() -> Vec<(Arc<Grammars>, Arc<Tokenizer>)> {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/tiny");
        let mut paths = vec![std::path::PathBuf::from(dir)];
        paths.extend(std::env::var_os("DYN_SMOLLM2_GGUF").map(std::path::PathBuf::from));
        paths
            .iter()
            .map(|p| {
                let m = crate::model::ModelDir::load("m", p).expect("loads");
                let g =
                    Grammars::new(&m.tokenizer, m.vocab_size, &m.eos_token_ids).expect("compiles");
                (Arc::new(g), m.tokenizer.clone())
            })
            .collect()
    }

    /// A forced Hermes-style call of one function: `<tool_call>\n{"name": "get_weather",
    /// "arguments": ` is all forced.
    fn weather_call() -> Constraint {
        dyn_protocol::testing::weather_call(json!({"type": "string", "maxLength": 20}))
    }

    #[test]
    fn a_forced_call_is_fast_forwarded_in_the_tokenizers_own_tokens() {
        for (g, t) in models() {
            let c = g.compile_here(&weather_call()).expect("compiles");
            let mut guide = g.guide(&c, Vec::new(), 128);
            let vocab = t.get_vocab_size(true);
            // The first token is forced: the mask allows exactly the first token of the
            // tokenizer's encoding of the forced text.
            let mask = guide.mask(vocab);
            assert_eq!(mask.num_set(), 1);
            let first = (0..vocab as u32)
                .find(|&i| mask.is_allowed(i))
                .expect("one");
            guide.commit(first);
            let forced = guide.take_forced();
            let mut out = vec![first];
            out.extend(&forced);
            let text = t.decode(&out, false).expect("decodes");
            // All of the call's text up to the city's value is forced (llguidance may hold
            // back its last token or two, which later text could tokenize differently).
            let all = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"";
            let least = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\":";
            assert!(
                all.starts_with(&text) && text.starts_with(least),
                "forced {text:?}"
            );
            // Those are the tokens the tokenizer gives the same text.
            let normal = t.encode(text.as_str(), false).expect("encodes");
            assert_eq!(out, normal.get_ids(), "{text:?}");
            // And taken from the guide once: the next commit starts afresh.
            assert!(guide.take_forced().is_empty());
        }
    }

    #[test]
    fn without_fast_forward_forced_text_is_still_tokenized_normally_one_token_a_step() {
        for (g, t) in models() {
            let c = g.compile_here(&weather_call()).expect("compiles");
            let mut guide = g.guide(&c, Vec::new(), 128).with_fast_forward(false);
            let vocab = t.get_vocab_size(true);
            let mut out = Vec::new();
            loop {
                let mask = guide.mask(vocab);
                if mask.num_set() != 1 {
                    break;
                }
                let only = (0..vocab as u32)
                    .find(|&i| mask.is_allowed(i))
                    .expect("one");
                guide.commit(only);
                assert!(guide.take_forced().is_empty());
                out.push(only);
            }
            let text = t.decode(&out, false).expect("decodes");
            assert!(
                text.starts_with("<tool_call>\n{\"name\": \"get_weather\""),
                "{text:?}"
            );
            let normal = t.encode(text.as_str(), false).expect("encodes");
            assert_eq!(out, normal.get_ids(), "{text:?}");
        }
    }

    #[test]
    fn fast_forward_stops_at_the_budget() {
        for (g, t) in models() {
            let c = g.compile_here(&weather_call()).expect("compiles");
            let mut guide = g.guide(&c, Vec::new(), 3);
            let mask = guide.mask(t.get_vocab_size(true));
            let first = (0..mask.len() as u32)
                .find(|&i| mask.is_allowed(i))
                .expect("one");
            guide.commit(first);
            assert_eq!(guide.take_forced().len(), 2, "three tokens in all");
        }
    }
}
