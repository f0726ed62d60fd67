//! A model as serving sees it, read once at build time: a Hugging Face directory
//! (`config.json`, `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`, and
//! the chat template where current transformers saves it, `chat_template.jinja` or
//! `chat_template.json`), or a GGUF file (its `tokenizer.*` and architecture metadata).
//!
//! Only what serving needs is kept: the tokenizer, the chat template with its bos/eos
//! strings, the eos token ids (from all three places HF keeps them), the context length, the
//! vocabulary size and the sampling defaults of `generation_config.json`. Missing optional
//! files fall back to what the others say.
//!
//! Several nodes of a graph need the same directory (preprocess, postprocess, every decode
//! replica), so [`ModelDir::shared`] loads it once per graph run (the [`ModelCache`] service),
//! on the blocking thread pool, and hands out the same `Arc` while anyone holds it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};

use dyn_core::{BuildCx, BuildError, ModelSpec, Service};
use serde_json::Value;
use tokenizers::Tokenizer;

use super::detok::TokenBytes;
use super::encoder::Encoder;
use super::grammar::Grammars;

/// The parts of a model directory the LLM operators use.
pub struct ModelDir {
    /// The name clients use (`model` in requests).
    pub name: String,
    pub path: PathBuf,
    /// Decoding (and the vocabulary).
    pub tokenizer: Arc<Tokenizer>,
    /// Encoding prompts: fastokens where it agrees with `tokenizer`.
    pub encoder: Arc<Encoder>,
    /// Each token's bytes where the tokenizer is byte-level (detokenizing without decoding).
    pub token_bytes: Option<Arc<TokenBytes>>,
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub eos_token_ids: Vec<u32>,
    pub context_length: u32,
    pub vocab_size: u32,
    /// Sampling defaults for requests that leave a parameter out (as vLLM applies them).
    pub defaults: GenerationDefaults,
    /// How its embeddings are pooled (sentence-transformers' `1_Pooling`, a GGUF's
    /// `pooling_type`; the last token's where neither says, as vLLM embeds with decoder
    /// models), or why they cannot be (a pooling the engine does not compute).
    pub pooling: Result<dyn_protocol::types::Pooling, String>,
    /// The width of its hidden states (an embedding's dimensions), where the config says.
    pub hidden_size: Option<u32>,
    /// The vocabulary compiled for structured output, built on first use (tens of ms).
    grammars: std::sync::OnceLock<Result<Arc<Grammars>, String>>,
}

/// Sampling for requests that leave a parameter out: `generation_config.json`'s, or a graph's
/// `defaults:` of `preprocess` (the same fields, `max_tokens` by that name there) — the ones
/// vLLM takes from a model's generation config.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerationDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    /// `max_new_tokens`.
    pub max_tokens: Option<u32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

impl GenerationDefaults {
    fn from_json(v: &Value) -> Self {
        let f = |k: &str| v.get(k).and_then(Value::as_f64).map(|x| x as f32);
        let u = |k: &str| {
            v.get(k)
                .and_then(Value::as_u64)
                .and_then(|x| u32::try_from(x).ok())
        };
        // `do_sample: false` is greedy whatever the temperature says (transformers).
        let greedy = v.get("do_sample").and_then(Value::as_bool) == Some(false);
        GenerationDefaults {
            temperature: if greedy { Some(0.0) } else { f("temperature") },
            top_p: f("top_p").filter(|p| *p > 0.0 && *p <= 1.0),
            top_k: u("top_k").filter(|k| *k > 0),
            max_tokens: u("max_new_tokens").filter(|m| *m > 0),
            min_p: f("min_p").filter(|p| *p > 0.0 && *p <= 1.0),
            repetition_penalty: f("repetition_penalty").filter(|p| *p > 0.0 && *p != 1.0),
        }
    }

    /// These, with `under`'s where these have none (a graph's over the model's).
    pub fn over(&self, under: &Self) -> Self {
        Self {
            temperature: self.temperature.or(under.temperature),
            top_p: self.top_p.or(under.top_p),
            top_k: self.top_k.or(under.top_k),
            max_tokens: self.max_tokens.or(under.max_tokens),
            min_p: self.min_p.or(under.min_p),
            repetition_penalty: self.repetition_penalty.or(under.repetition_penalty),
        }
    }

    /// The request's sampling parameters, with the model's where the client sent none
    /// (`max_tokens` is applied by preprocess, within the room the context leaves).
    pub fn apply(&self, s: &mut dyn_protocol::types::Sampling) {
        s.temperature = s.temperature.or(self.temperature);
        s.top_p = s.top_p.or(self.top_p);
        s.top_k = s.top_k.or(self.top_k);
        s.min_p = s.min_p.or(self.min_p);
        s.repetition_penalty = s.repetition_penalty.or(self.repetition_penalty);
    }
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

/// The model directories one graph run has loaded, by (name, path): a service, so every
/// node of the run shares one copy, and a directory is dropped when no node holds it.
#[derive(Default)]
pub struct ModelCache {
    loaded: parking_lot::Mutex<HashMap<(String, PathBuf), Weak<ModelDir>>>,
}

impl Service for ModelCache {
    async fn start(_cx: &BuildCx) -> Result<Self, BuildError> {
        Ok(Self::default())
    }
}

impl ModelDir {
    /// The vocabulary compiled for grammars when it already is (never blocks).
    pub fn grammars_built(&self) -> Option<Result<Arc<Grammars>, String>> {
        self.grammars.get().cloned()
    }

    /// The vocabulary compiled for grammars (compiled once; a blocking call the first time).
    pub fn grammars(&self) -> Result<Arc<Grammars>, String> {
        self.grammars
            .get_or_init(|| {
                Grammars::new(&self.tokenizer, self.vocab_size, &self.eos_token_ids).map(Arc::new)
            })
            .clone()
    }

    /// The node's model, resolved against the graph file's directory (or `~`): loaded once per
    /// graph run (file reads and tokenizer parsing on the blocking pool), then shared.
    pub async fn shared(cx: &BuildCx) -> Result<Arc<ModelDir>, BuildError> {
        let spec = cx.model.as_ref().ok_or_else(|| {
            BuildError::new(
                "this kind needs a model: add `model: {name: ..., path: ...}` to the graph",
            )
        })?;
        Self::shared_spec(cx, spec).await
    }

    /// Model `spec` (one of the graph's), loaded once per graph run as [`Self::shared`] does.
    pub async fn shared_spec(cx: &BuildCx, spec: &ModelSpec) -> Result<Arc<ModelDir>, BuildError> {
        let cache = cx.service::<ModelCache>().await?;
        let key = (spec.name.clone(), cx.resolve(&spec.path));
        if let Some(m) = cache.loaded.lock().get(&key).and_then(Weak::upgrade) {
            return Ok(m);
        }
        let (name, path) = key.clone();
        let model = tokio::task::spawn_blocking(move || ModelDir::load(&name, &path))
            .await
            .map_err(|e| BuildError::new(format!("model loading task failed: {e}")))??;
        // Two nodes may have loaded it at once; keep the first so all share one copy.
        let mut loaded = cache.loaded.lock();
        if let Some(m) = loaded.get(&key).and_then(Weak::upgrade) {
            return Ok(m);
        }
        let model = Arc::new(model);
        loaded.insert(key, Arc::downgrade(&model));
        Ok(model)
    }

    pub fn load(name: &str, path: &Path) -> Result<ModelDir, BuildError> {
        if dyn_model::gguf::is_gguf(path) {
            return Self::load_gguf(name, path);
        }
        let config = read_json(&path.join("config.json"), true)?.unwrap_or_default();
        let tok_config = read_json(&path.join("tokenizer_config.json"), false)?.unwrap_or_default();
        let gen_config =
            read_json(&path.join("generation_config.json"), false)?.unwrap_or_default();
        let tok_path = path.join("tokenizer.json");
        let tok_json = std::fs::read_to_string(&tok_path)
            .map_err(|e| BuildError::new(format!("cannot read {}: {e}", tok_path.display())))?;
        let tokenizer =
            Arc::new(tok_json.parse::<Tokenizer>().map_err(|e| {
                BuildError::new(format!("cannot load {}: {e}", tok_path.display()))
            })?);
        let encoder = Arc::new(Encoder::new(tokenizer.clone(), &tok_json));

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
        let chat_template = chat_template(path, &tok_config)?;
        Ok(ModelDir {
            pooling: st_pooling(path)?,
            hidden_size: config
                .get("hidden_size")
                .and_then(Value::as_u64)
                .and_then(|n| u32::try_from(n).ok()),
            name: name.to_owned(),
            path: path.to_owned(),
            token_bytes: TokenBytes::new(&tokenizer).map(Arc::new),
            tokenizer,
            encoder,
            chat_template,
            bos_token: tok_config.get("bos_token").and_then(token_string),
            eos_token,
            eos_token_ids,
            context_length,
            vocab_size,
            defaults: GenerationDefaults::from_json(&gen_config),
            grammars: Default::default(),
        })
    }

    /// A GGUF file: tokenizer, template and special tokens from its metadata.
    fn load_gguf(name: &str, path: &Path) -> Result<ModelDir, BuildError> {
        use dyn_model::gguf::{Gguf, Value as Meta};
        let err = |e: String| BuildError::new(format!("{}: {e}", path.display()));
        let g = Gguf::open(path).map_err(|e| BuildError::new(e.to_string()))?;
        let config = g.config().map_err(|e| BuildError::new(e.to_string()))?;
        let tokenizer = Arc::new(super::gguf_tokenizer::tokenizer(&g).map_err(err)?);
        let ids = super::gguf_tokenizer::special_ids(&g);
        let text = |id: Option<u32>| id.and_then(|i| tokenizer.id_to_token(i));
        // eos and end-of-turn, once each (they are often the same token).
        let mut eos_token_ids: Vec<u32> = [ids.eos, ids.eot].into_iter().flatten().collect();
        eos_token_ids.dedup();
        if eos_token_ids.is_empty() {
            return Err(err("metadata tokenizer.ggml.eos_token_id is missing".into()));
        }
        // llama.cpp's pooling types: 0 none, 1 mean, 2 cls, 3 last, 4 rank.
        let arch = g.architecture().unwrap_or_default();
        let pooling = match g
            .get(&format!("{arch}.pooling_type"))
            .and_then(Meta::as_u64)
        {
            None | Some(0 | 3) => Ok(dyn_protocol::types::Pooling::Last),
            Some(1) => Ok(dyn_protocol::types::Pooling::Mean),
            Some(t) => Err(format!(
                "its GGUF asks for pooling type {t} (cls or rank), which dyn does not compute"
            )),
        };
        Ok(ModelDir {
            pooling,
            hidden_size: u32::try_from(config.hidden).ok(),
            name: name.to_owned(),
            path: path.to_owned(),
            chat_template: g
                .get("tokenizer.chat_template")
                .and_then(Meta::as_str)
                .map(str::to_owned),
            bos_token: text(ids.bos),
            eos_token: text(ids.eos),
            eos_token_ids,
            context_length: u32::try_from(config.max_position).unwrap_or(u32::MAX),
            vocab_size: u32::try_from(config.vocab).unwrap_or(u32::MAX),
            encoder: Arc::new(match tokenizer.to_string(false) {
                Ok(json) => Encoder::new(tokenizer.clone(), &json),
                Err(_) => Encoder::hf(tokenizer.clone()),
            }),
            token_bytes: TokenBytes::new(&tokenizer).map(Arc::new),
            tokenizer,
            defaults: GenerationDefaults::default(),
            grammars: Default::default(),
        })
    }
}

/// How sentence-transformers pools `dir`'s embeddings (`modules.json` names its pooling
/// module's directory, whose `config.json` sets one `pooling_mode_*`): last token or mean.
/// A directory without them pools the last token's.
fn st_pooling(dir: &Path) -> Result<Result<dyn_protocol::types::Pooling, String>, BuildError> {
    use dyn_protocol::types::Pooling;
    let Some(modules) = read_json(&dir.join("modules.json"), false)? else {
        return Ok(Ok(Pooling::Last));
    };
    let Some(at) = modules.as_array().into_iter().flatten().find_map(|m| {
        m["type"]
            .as_str()
            .filter(|t| t.ends_with(".Pooling"))
            .and(m["path"].as_str())
    }) else {
        return Ok(Ok(Pooling::Last));
    };
    let path = dir.join(at).join("config.json");
    let Some(config) = read_json(&path, false)? else {
        return Ok(Err(format!("{} is missing", path.display())));
    };
    let on = |k: &str| config[k].as_bool() == Some(true);
    Ok(if on("pooling_mode_lasttoken") {
        Ok(Pooling::Last)
    } else if on("pooling_mode_mean_tokens") {
        Ok(Pooling::Mean)
    } else {
        Err(format!(
            "{}: a pooling other than last token or mean, which dyn does not compute",
            path.display()
        ))
    })
}

/// The chat template where transformers looks for it: `chat_template.jinja`, then
/// `chat_template.json` (`{"chat_template": ...}`), then `tokenizer_config.json`. Where a
/// file holds named templates, the one named `default`.
fn chat_template(dir: &Path, tok_config: &Value) -> Result<Option<String>, BuildError> {
    let jinja = dir.join("chat_template.jinja");
    match std::fs::read_to_string(&jinja) {
        Ok(s) => return Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(BuildError::new(format!(
                "cannot read {}: {e}",
                jinja.display()
            )));
        }
    }
    let json = read_json(&dir.join("chat_template.json"), false)?;
    let v = json
        .as_ref()
        .and_then(|j| j.get("chat_template"))
        .or_else(|| tok_config.get("chat_template"));
    Ok(match v {
        Some(Value::String(s)) => Some(s.clone()),
        // A list of named templates: use the default one.
        Some(Value::Array(list)) => list.iter().find_map(|t| {
            (t.get("name").and_then(Value::as_str) == Some("default"))
                .then(|| t.get("template").and_then(Value::as_str).map(str::to_owned))
                .flatten()
        }),
        _ => None,
    })
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

    /// models/tiny saved as current transformers saves it: the template moved out of
    /// tokenizer_config.json into `chat_template.jinja` (or `chat_template.json`).
    #[test]
    fn templates_in_their_own_files_and_generation_defaults() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tiny");
        let dir = std::env::temp_dir().join(format!("dyn-model-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp");
        for f in ["config.json", "tokenizer.json"] {
            std::fs::copy(src.join(f), dir.join(f)).expect("copy");
        }
        let mut tc: Value = serde_json::from_str(
            &std::fs::read_to_string(src.join("tokenizer_config.json")).expect("read"),
        )
        .expect("json");
        let template = tc["chat_template"].as_str().expect("template").to_owned();
        tc.as_object_mut().expect("map").remove("chat_template");
        std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).expect("write");
        assert_eq!(
            ModelDir::load("t", &dir).expect("loads").chat_template,
            None
        );

        std::fs::write(
            dir.join("chat_template.json"),
            serde_json::json!({"chat_template": [{"name": "tool_use", "template": "x"},
                                                  {"name": "default", "template": "from json"}]})
            .to_string(),
        )
        .expect("write");
        let m = ModelDir::load("t", &dir).expect("loads");
        assert_eq!(m.chat_template.as_deref(), Some("from json"));
        // `.jinja` wins, as in transformers.
        std::fs::write(dir.join("chat_template.jinja"), &template).expect("write");
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"temperature": 0.2, "top_p": 0.9, "top_k": 50, "max_new_tokens": 64,
                "repetition_penalty": 1.05, "min_p": 0.0}"#,
        )
        .expect("write");
        let m = ModelDir::load("t", &dir).expect("loads");
        assert_eq!(m.chat_template.as_deref(), Some(template.as_str()));
        let d = &m.defaults;
        assert_eq!(
            (d.temperature, d.top_p, d.top_k, d.max_tokens),
            (Some(0.2), Some(0.9), Some(50), Some(64))
        );
        // min_p 0 is no default; a repetition penalty is one.
        assert_eq!((d.min_p, d.repetition_penalty), (None, Some(1.05)));
        // A request's own parameters win; missing ones take the model's.
        let mut s = dyn_protocol::types::Sampling {
            temperature: Some(0.0),
            ..Default::default()
        };
        d.apply(&mut s);
        assert_eq!(
            (s.temperature, s.top_p, s.top_k, s.repetition_penalty),
            (Some(0.0), Some(0.9), Some(50), Some(1.05))
        );
        // `do_sample: false` is greedy.
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"do_sample": false, "temperature": 0.6}"#,
        )
        .expect("write");
        let m = ModelDir::load("t", &dir).expect("loads");
        assert_eq!(m.defaults.temperature, Some(0.0));
        std::fs::remove_dir_all(&dir).ok();
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
