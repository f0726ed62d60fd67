//! A Hugging Face model directory: `config.json`, `tokenizer.json`, `tokenizer_config.json`
//! and `generation_config.json`, read once at build time.
//!
//! Only what serving needs is kept: the tokenizer, the chat template with its bos/eos
//! strings, the eos token ids (from all three places HF keeps them), the context length and
//! the vocabulary size. Missing optional files fall back to what the others say.
//!
//! Several nodes of a graph need the same directory (preprocess, postprocess, every decode
//! replica), so [`ModelDir::shared`] loads it once per process, on the blocking thread pool,
//! and hands out the same `Arc` while anyone holds it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Weak};

use dyn_pipeline::{BuildCx, BuildError};
use serde_json::Value;
use tokenizers::Tokenizer;

/// The parts of a model directory the LLM operators use.
pub struct ModelDir {
    /// The name clients use (`model` in requests).
    pub name: String,
    pub path: PathBuf,
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub eos_token_ids: Vec<u32>,
    pub context_length: u32,
    pub vocab_size: u32,
}

impl std::fmt::Debug for ModelDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelDir")
            .field("name", &self.name)
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

fn read_json(path: &Path, required: bool) -> Result<Option<Value>, BuildError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| BuildError::new(format!("{}: {e}", path.display()))),
        Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(BuildError::new(format!(
            "cannot read {}: {e}",
            path.display()
        ))),
    }
}

/// `bos_token` and friends are either a string or `{"content": "..."}`.
fn token_string(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

/// `eos_token_id` is a number or a list of numbers.
fn ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .into_iter()
            .collect(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|n| n.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect(),
        _ => Vec::new(),
    }
}

/// Loaded directories by (name, path), kept only while some node holds them.
type Loaded = HashMap<(String, PathBuf), Weak<ModelDir>>;
static LOADED: LazyLock<parking_lot::Mutex<Loaded>> = LazyLock::new(Default::default);

impl ModelDir {
    /// The graph's model, resolved against the graph file's directory: loaded once per
    /// process (file reads and tokenizer parsing on the blocking pool), then shared.
    pub async fn shared(cx: &BuildCx) -> Result<Arc<ModelDir>, BuildError> {
        let spec = cx.model.as_ref().ok_or_else(|| {
            BuildError::new(
                "this kind needs a model: add `model: {name: ..., path: ...}` to the graph",
            )
        })?;
        let key = (spec.name.clone(), cx.base_dir.join(&spec.path));
        if let Some(m) = LOADED.lock().get(&key).and_then(Weak::upgrade) {
            return Ok(m);
        }
        let (name, path) = key.clone();
        let model = tokio::task::spawn_blocking(move || ModelDir::load(&name, &path))
            .await
            .map_err(|e| BuildError::new(format!("model loading task failed: {e}")))??;
        // Two nodes may have loaded it at once; keep the first so all share one copy.
        let mut loaded = LOADED.lock();
        if let Some(m) = loaded.get(&key).and_then(Weak::upgrade) {
            return Ok(m);
        }
        let model = Arc::new(model);
        loaded.insert(key, Arc::downgrade(&model));
        Ok(model)
    }

    pub fn load(name: &str, path: &Path) -> Result<ModelDir, BuildError> {
        let config = read_json(&path.join("config.json"), true)?.unwrap_or_default();
        let tok_config = read_json(&path.join("tokenizer_config.json"), false)?.unwrap_or_default();
        let gen_config =
            read_json(&path.join("generation_config.json"), false)?.unwrap_or_default();
        let tok_path = path.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| BuildError::new(format!("cannot load {}: {e}", tok_path.display())))?;

        let eos_token = tok_config.get("eos_token").and_then(token_string);
        let mut eos_token_ids = ids(gen_config.get("eos_token_id"));
        for id in ids(config.get("eos_token_id")) {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        if let Some(id) = eos_token.as_deref().and_then(|t| tokenizer.token_to_id(t))
            && !eos_token_ids.contains(&id)
        {
            eos_token_ids.push(id);
        }
        let context_length = [
            "max_position_embeddings",
            "max_sequence_length",
            "n_positions",
        ]
        .iter()
        .find_map(|k| config.get(*k).and_then(Value::as_u64))
        .or_else(|| tok_config.get("model_max_length").and_then(Value::as_u64))
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| {
            BuildError::new(format!(
                "{}: no context length (max_position_embeddings)",
                path.join("config.json").display()
            ))
        })?;
        let vocab_size = config
            .get("vocab_size")
            .and_then(Value::as_u64)
            .and_then(|n| u32::try_from(n).ok())
            .unwrap_or_else(|| u32::try_from(tokenizer.get_vocab_size(true)).unwrap_or(u32::MAX));
        let chat_template = match tok_config.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            // A list of named templates: use the default one.
            Some(Value::Array(list)) => list.iter().find_map(|t| {
                (t.get("name").and_then(Value::as_str) == Some("default"))
                    .then(|| t.get("template").and_then(Value::as_str).map(str::to_owned))
                    .flatten()
            }),
            _ => None,
        };
        Ok(ModelDir {
            name: name.to_owned(),
            path: path.to_owned(),
            tokenizer: Arc::new(tokenizer),
            chat_template,
            bos_token: tok_config.get("bos_token").and_then(token_string),
            eos_token,
            eos_token_ids,
            context_length,
            vocab_size,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn tiny() -> ModelDir {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tiny");
        ModelDir::load("tiny", &dir).expect("models/tiny loads")
    }

    #[test]
    fn loads_the_tiny_model() {
        let m = tiny();
        assert_eq!(m.context_length, 4096);
        assert_eq!(m.bos_token.as_deref(), Some("<|begin_of_text|>"));
        let eot = m.tokenizer.token_to_id("<|eot_id|>").expect("eot");
        assert!(m.eos_token_ids.contains(&eot));
        assert!(m.chat_template.is_some());
        assert_eq!(m.vocab_size as usize, m.tokenizer.get_vocab_size(true));
    }

    #[test]
    fn missing_directory_is_a_clear_error() {
        let e = ModelDir::load("x", Path::new("/nonexistent/model")).expect_err("fails");
        assert!(
            e.message.contains("/nonexistent/model/config.json"),
            "{}",
            e.message
        );
    }
}
