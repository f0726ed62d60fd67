//! A GGUF file's vocabulary (`tokenizer.ggml.*`) as a Hugging Face `tokenizers` tokenizer.
//!
//! Two vocabulary kinds cover the llama and qwen2 families:
//!
//! - `gpt2`: byte-level BPE with the file's merges. The pre-tokenizer follows
//!   `tokenizer.ggml.pre` as llama.cpp does: GPT-2's split for `default`/`gpt2`, digits one by
//!   one first for `smollm`, and the split expressions of Llama 3 (`llama-bpe`) and Qwen2
//!   (`qwen2`).
//! - `llama`: SentencePiece BPE (`▁` for spaces, `<0xNN>` byte fallback). GGUF keeps scores
//!   instead of merges, so merges are derived as transformers does: every split of a piece
//!   into two pieces, the piece's score deciding the order.
//!
//! Tokens of type control (3) and user-defined (4) become special added tokens, so they
//! are matched whole in text and skipped when decoding without specials. The tokenizer is
//! assembled as `tokenizer.json` and parsed by the library, the format's own definition.

use dyn_model::gguf::{Gguf, Value};
use serde_json::{Value as Json, json};
use tokenizers::Tokenizer;

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The special-token ids GGUF names (`tokenizer.ggml.*_token_id`).
#[derive(Debug, Default, Clone)]
pub struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// `tokenizer.ggml.eot_token_id` (end of turn), another stop token.
    pub eot: Option<u32>,
    pub add_bos: bool,
}

pub fn special_ids(g: &Gguf) -> SpecialIds {
    let id = |k: &str| {
        g.get(&format!("tokenizer.ggml.{k}_token_id"))
            .and_then(Value::as_u64)
            .and_then(|v| u32::try_from(v).ok())
    };
    SpecialIds {
        bos: id("bos"),
        eos: id("eos"),
        eot: id("eot"),
        add_bos: g
            .get("tokenizer.ggml.add_bos_token")
            .and_then(Value::as_bool)
            .unwrap_or(false),
    }
}

fn strings<'a>(g: &'a Gguf, key: &str) -> Result<Vec<&'a str>, String> {
    let arr = g
        .get(key)
        .ok_or_else(|| format!("metadata {key} is missing"))?
        .as_array()
        .ok_or_else(|| format!("metadata {key} is not an array"))?;
    arr.iter()
        .map(|v| {
            v.as_str()
                .ok_or_else(|| format!("metadata {key} holds a non-string"))
        })
        .collect()
}

/// Build the tokenizer; errors name the metadata key at fault.
pub fn tokenizer(g: &Gguf) -> Result<Tokenizer, String> {
    let model = g
        .get("tokenizer.ggml.model")
        .and_then(Value::as_str)
        .ok_or("metadata tokenizer.ggml.model is missing")?;
    let tokens = strings(g, "tokenizer.ggml.tokens")?;
    let types = token_types(g, tokens.len())?;
    let common = Common {
        vocab: tokens
            .iter()
            .enumerate()
            .map(|(i, t)| ((*t).to_owned(), json!(i)))
            .collect(),
        added: added_tokens(&tokens, &types),
        post_processor: post_processor(&special_ids(g), &tokens),
    };
    let spec = match model {
        "gpt2" => gpt2_spec(g, common)?,
        "llama" => llama_spec(g, &tokens, common)?,
        other => {
            return Err(format!(
                "tokenizer.ggml.model {other:?} is not supported (gpt2, llama)"
            ));
        }
    };
    Tokenizer::from_bytes(spec.to_string().as_bytes())
        .map_err(|e| format!("the tokenizer built from tokenizer.ggml.* does not load: {e}"))
}

/// What both vocabulary kinds' `tokenizer.json` hold alike.
struct Common {
    vocab: serde_json::Map<String, Json>,
    added: Vec<Json>,
    post_processor: Json,
}

/// `tokenizer.ggml.token_type`, one per token; without it every token is normal (1).
fn token_types(g: &Gguf, tokens: usize) -> Result<Vec<i64>, String> {
    Ok(match g.get("tokenizer.ggml.token_type") {
        Some(v) => v
            .as_array()
            .ok_or("metadata tokenizer.ggml.token_type is not an array")?
            .iter()
            .map(|t| t.as_i64().unwrap_or(1))
            .collect(),
        None => vec![1; tokens],
    })
}

/// The control (3) and user-defined (4) tokens, as special added tokens.
fn added_tokens(tokens: &[&str], types: &[i64]) -> Vec<Json> {
    tokens
        .iter()
        .zip(types)
        .enumerate()
        .filter(|(_, (_, ty))| matches!(**ty, 3 | 4))
        .map(|(i, (t, _))| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect()
}

fn post_processor(ids: &SpecialIds, tokens: &[&str]) -> Json {
    // Where the file asks for bos, the tokenizer adds it (as transformers' conversion does).
    let bos_token = ids.bos.and_then(|b| tokens.get(b as usize).copied());
    match (ids.add_bos, bos_token) {
        (true, Some(b)) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {b: {"id": b, "ids": [ids.bos], "tokens": [b]}}
        }),
        _ => Json::Null,
    }
}

/// Byte-level BPE with the file's merges.
fn gpt2_spec(g: &Gguf, common: Common) -> Result<Json, String> {
    let merges: Vec<Json> = strings(g, "tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| json!([a, b]))
                .ok_or_else(|| format!("tokenizer.ggml.merges: {m:?} is not a pair"))
        })
        .collect::<Result<_, _>>()?;
    let pre = g
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let pre_tokenizer = gpt2_pre_tokenizer(pre)?;
    let Common {
        vocab,
        added,
        post_processor,
    } = common;
    Ok(json!({
        "version": "1.0",
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": merges},
    }))
}

/// The pre-tokenizer `tokenizer.ggml.pre` names, as llama.cpp splits for it.
fn gpt2_pre_tokenizer(pre: &str) -> Result<Json, String> {
    let byte_level = |regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": regex});
    let split = |re: &str| json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false});
    Ok(match pre {
        "default" | "gpt2" | "gpt-2" => byte_level(true),
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        "llama-bpe" | "llama3" | "llama-v3" => {
            json!({"type": "Sequence", "pretokenizers": [
            split(LLAMA3_SPLIT), byte_level(false)]})
        }
        "qwen2" => json!({"type": "Sequence", "pretokenizers": [
            split(QWEN2_SPLIT), byte_level(false)]}),
        other => {
            return Err(format!(
                "tokenizer.ggml.pre {other:?} is not supported (default, gpt2, smollm, llama-bpe, qwen2)"
            ));
        }
    })
}

/// SentencePiece BPE: merges derived from the scores, `▁` for spaces, byte fallback.
fn llama_spec(g: &Gguf, tokens: &[&str], common: Common) -> Result<Json, String> {
    let scores: Vec<f64> = match g.get("tokenizer.ggml.scores") {
        Some(v) => v
            .as_array()
            .ok_or("metadata tokenizer.ggml.scores is not an array")?
            .iter()
            .map(|s| s.as_f64().unwrap_or(0.0))
            .collect(),
        None => return Err("metadata tokenizer.ggml.scores is missing".into()),
    };
    let unk = g
        .get("tokenizer.ggml.unknown_token_id")
        .and_then(Value::as_u64)
        .and_then(|u| tokens.get(u as usize).copied());
    let Common {
        vocab,
        added,
        post_processor,
    } = common;
    Ok(json!({
        "version": "1.0",
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": null,
        "post_processor": post_processor,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
                  "ignore_merges": false, "vocab": vocab,
                  "merges": sentencepiece_merges(tokens, &scores)},
    }))
}

/// Merges of a SentencePiece BPE vocabulary: every split of a piece into two pieces, ordered
/// by the merged piece's score (highest first), ties by the halves' ids (transformers'
/// `generate_merges`).
fn sentencepiece_merges(tokens: &[&str], scores: &[f64]) -> Vec<Json> {
    let id: std::collections::HashMap<&str, usize> =
        tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    let mut merges: Vec<(f64, usize, usize, &str, &str)> = Vec::new();
    for (i, piece) in tokens.iter().enumerate() {
        let score = scores.get(i).copied().unwrap_or(0.0);
        for (at, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(at);
            if let (Some(&li), Some(&ri)) = (id.get(l), id.get(r)) {
                merges.push((score, li, ri, l, r));
            }
        }
    }
    merges.sort_by(|a, b| {
        b.0.partial_cmp(&a.0)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then((a.1, a.2).cmp(&(b.1, b.2)))
    });
    merges
        .into_iter()
        .map(|(_, _, _, l, r)| json!([l, r]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelDir;

    fn smollm2() -> Option<std::path::PathBuf> {
        let p = std::path::PathBuf::from(std::env::var_os("DYN_SMOLLM2_GGUF")?);
        p.exists().then_some(p)
    }

    fn reference() -> serde_json::Value {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../models/smollm2-gguf-reference.json");
        serde_json::from_str(&std::fs::read_to_string(p).expect("fixture")).expect("json")
    }

    fn ids(v: &serde_json::Value) -> Vec<u32> {
        v.as_array()
            .expect("ids")
            .iter()
            .map(|i| i.as_u64().expect("id") as u32)
            .collect()
    }

    /// Token ids equal transformers' tokenizer loaded from the same GGUF, on unicode, code,
    /// whitespace runs and special tokens (scripts/make-gguf-reference).
    #[test]
    fn smollm2_tokenizes_as_transformers_does() {
        let Some(path) = smollm2() else {
            dyn_tests::skip("DYN_SMOLLM2_GGUF is not set (scripts/test fetches the model)");
            return;
        };
        let m = ModelDir::load("smollm2", &path).expect("loads");
        assert!(m.encoder.is_fast(), "fastokens loads the GGUF's tokenizer");
        let table = m
            .token_bytes
            .clone()
            .expect("a byte-level tokenizer gets a byte table");
        let r = reference();
        for case in r["tokenize"].as_array().expect("cases") {
            let text = case["text"].as_str().expect("text");
            let got = m.tokenizer.encode_fast(text, false).expect("encodes");
            assert_eq!(got.get_ids(), ids(&case["ids"]), "{text:?}");
            // The prompt encoder (fastokens here) agrees with transformers too.
            assert_eq!(
                m.encoder.encode(text, false).expect("encodes"),
                ids(&case["ids"]),
                "{text:?}"
            );
            // And back: decoding gives the text again.
            let back = m.tokenizer.decode(got.get_ids(), false).expect("decodes");
            assert_eq!(back, text);
            // Streamed through the byte table too (special tokens are skipped there).
            let mut d = crate::detok::Detokenizer::with_bytes(m.tokenizer.clone(), table.clone());
            let mut streamed: String = got
                .get_ids()
                .iter()
                .map(|&id| d.push(id).expect("push"))
                .collect();
            streamed += &d.finish().expect("finish");
            assert_eq!(
                streamed,
                m.tokenizer.decode(got.get_ids(), true).expect("decodes")
            );
        }
        assert_eq!(m.eos_token_ids, vec![2]);
        assert_eq!(m.bos_token.as_deref(), Some("<|im_start|>"));
        assert_eq!(m.context_length, 8192);
        assert!(
            m.chat_template
                .as_deref()
                .is_some_and(|t| t.contains("im_start"))
        );
    }

    /// A SentencePiece-style (`llama`) vocabulary: spaces as `▁`, merges by score, bytes
    /// outside the vocabulary through `<0xNN>` tokens, control tokens whole.
    #[test]
    fn sentencepiece_vocabularies_merge_by_score_and_fall_back_to_bytes() {
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        let mut types = vec![2i64, 3, 3];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
        }
        let pieces = [
            "▁", "h", "e", "l", "o", "w", "r", "d", "ll", "he", "▁he", "llo", "▁hello", "▁w", "or",
            "▁wor", "ld", "▁world",
        ];
        for p in pieces {
            tokens.push(p.into());
            types.push(1);
        }
        // Longer pieces score higher, so they merge first.
        let scores: Vec<f64> = tokens
            .iter()
            .zip(&types)
            .map(|(t, ty)| {
                if *ty == 1 {
                    t.chars().count() as f64
                } else {
                    0.0
                }
            })
            .collect();
        let arr = |v: Vec<Value>| Value::Array(v);
        let meta = [
            ("general.architecture", Value::Str("llama".into())),
            ("tokenizer.ggml.model", Value::Str("llama".into())),
            (
                "tokenizer.ggml.tokens",
                arr(tokens.iter().map(|t| Value::Str(t.clone())).collect()),
            ),
            (
                "tokenizer.ggml.token_type",
                arr(types.iter().map(|t| Value::I32(*t as i32)).collect()),
            ),
            (
                "tokenizer.ggml.scores",
                arr(scores.iter().map(|s| Value::F32(*s as f32)).collect()),
            ),
            ("tokenizer.ggml.bos_token_id", Value::U32(1)),
            ("tokenizer.ggml.eos_token_id", Value::U32(2)),
            ("tokenizer.ggml.unknown_token_id", Value::U32(0)),
            ("tokenizer.ggml.add_bos_token", Value::Bool(true)),
        ];
        let g = Gguf::from_meta(meta.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
            .expect("metadata");
        let t = tokenizer(&g).expect("builds");
        let id = |p: &str| t.token_to_id(p).expect("in vocab");
        let enc = t.encode_fast("hello world", true).expect("encodes");
        assert_eq!(enc.get_ids(), [1, id("▁hello"), id("▁world")]);
        // "z" is not a piece: its byte token.
        let enc = t.encode_fast("hez</s>", false).expect("encodes");
        assert_eq!(enc.get_ids(), [id("▁he"), id("<0x7A>"), 2]);
        assert_eq!(
            t.decode(&[1, id("▁hello"), id("▁world")], true)
                .expect("decodes"),
            "hello world"
        );
    }
}
