//! What a kind gets when it builds a replica: the build context ([`BuildCx`]), its readiness,
//! and the process-wide services the graph's nodes share.
//!
//! Services: one instance per running graph of something many nodes share (the KV transfer
//! agent, the loaded model directories, the introspection registry). The runtime knows none of
//! them. A crate that owns a service implements [`Service`] for its type, and a kind asks for
//! it with [`BuildCx::service`]: the first asker starts it, everyone after shares that
//! instance. Keyed by type, so two crates cannot collide on a name, and a test builds a fresh
//! set with `Services::default()`. They live beside [`BuildCx`] because each needs the other:
//! a service starts from the context of the node that first asked for it.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::OnceCell;

use crate::planes::Planes;

/// The model a graph serves: a name for clients and a Hugging Face-style directory (or a GGUF
/// file), and the LoRA adapters served on it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub name: String,
    pub path: String,
    /// How the model writes tool calls; detected from its chat template when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_parser: Option<ToolParserName>,
    /// How it writes its reasoning (`none` when it does not); detected from its chat template
    /// when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_parser: Option<ReasoningParserName>,
    /// LoRA adapters served beside the model, by name: PEFT directories or GGUF LoRA files (relative to the
    /// graph file). A request whose `model` is one of these names runs with that adapter.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub loras: std::collections::BTreeMap<String, String>,
}

impl ModelSpec {
    /// What is wrong with its adapters' names, if anything: each is a name clients send as
    /// `model`, so it must be one (1 to 256 characters, no spaces or control characters) and
    /// not the model's own.
    pub fn lora_problems(&self) -> Vec<String> {
        self.loras
            .keys()
            .filter_map(|name| lora_name_problem(name, &self.name))
            .map(|p| format!("model.loras: {p}"))
            .collect()
    }
}

/// Why `name` cannot name a LoRA adapter of model `model`, if it cannot: clients send it as
/// `model`, so it must be a model name (1 to 256 characters, no spaces or control
/// characters) other than the model's own.
pub fn lora_name_problem(name: &str, model: &str) -> Option<String> {
    let bad = name.is_empty()
        || name.chars().count() > 256
        || name.chars().any(|c| c.is_control() || c.is_whitespace());
    if bad {
        Some(format!(
            "`{name}` is not a model name (1 to 256 characters, no spaces)"
        ))
    } else if name == model {
        Some(format!("`{name}` is the model's own name"))
    } else {
        None
    }
}

/// The tool-call formats a graph can name for its model (vLLM's parser names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolParserName {
    /// `<tool_call>{json}</tool_call>` (Hermes, Qwen).
    Hermes,
    /// `{"name", "parameters"}`, optionally after `<|python_tag|>` (Llama 3.1+).
    Llama3Json,
    /// `[TOOL_CALLS][…]`.
    Mistral,
    /// A Python list of calls, `[get_weather(city="Paris")]` (Llama 3.2, Llama 4).
    Pythonic,
    /// `<｜tool▁calls▁begin｜>…` (DeepSeek V3, V3.1).
    DeepseekV3,
    /// OpenAI's harmony messages (gpt-oss; vLLM calls it `openai`): calls and reasoning.
    #[serde(alias = "openai")]
    Harmony,
}

/// The reasoning formats a graph can name for its model (vLLM's parser names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReasoningParserName {
    /// The model does not reason in its answer: nothing is parsed.
    None,
    /// `<think>…</think>` opening the answer (Qwen3, SmolLM3).
    Qwen3,
    /// The template opens `<think>`; the answer's reasoning runs to `</think>`.
    DeepseekR1,
    /// Harmony's `analysis` channel (gpt-oss; vLLM's `openai_gptoss`), parsed with its calls.
    #[serde(alias = "openai_gptoss")]
    Harmony,
}

/// Something one graph run holds once and its nodes share.
pub trait Service: Send + Sync + Sized + 'static {
    /// Start the service; `cx` is the build context of the first node that asked.
    fn start(cx: &BuildCx) -> impl Future<Output = Result<Self, BuildError>> + Send;
}

type Slot = Arc<OnceCell<Arc<dyn Any + Send + Sync>>>;

/// The services started so far, cheap to clone into every build context.
#[derive(Clone, Default)]
pub struct Services {
    slots: Arc<Mutex<HashMap<TypeId, Slot>>>,
}

impl Services {
    /// The running `S`, started by this call if nobody asked before. Concurrent first askers
    /// wait for one start; a failed start is not kept, so the next asker tries again.
    pub async fn get<S: Service>(&self, cx: &BuildCx) -> Result<Arc<S>, BuildError> {
        let slot = self
            .slots
            .lock()
            .entry(TypeId::of::<S>())
            .or_default()
            .clone();
        let any = slot
            .get_or_try_init(|| async {
                Ok::<_, BuildError>(Arc::new(S::start(cx).await?) as Arc<dyn Any + Send + Sync>)
            })
            .await?
            .clone();
        any.downcast::<S>()
            .map_err(|_| BuildError::new("service slot holds another type"))
    }
}

/// Failure to build a node at start-up (bind a port, load a model, ...).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct BuildError {
    pub message: String,
}

impl BuildError {
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }
}

/// What a kind gets to build one replica.
#[derive(Clone)]
pub struct BuildCx {
    pub graph: String,
    pub namespace: String,
    pub node: String,
    pub replica: u32,
    pub instance_id: crate::planes::InstanceId,
    /// Ids of the nodes that take this node's output, looking through routers and
    /// pass-through nodes (by their kinds' [`Role`](crate::registry::Role), like `remote_prefill`) to the workers
    /// behind them: a router watches their instances.
    pub consumers: Vec<String>,
    /// What the workers of `consumers` can serve between them, as their configs state it
    /// ([`Capabilities::any_of`]): an ingress or a preprocess refuses what none of them can.
    pub serves: crate::planes::Capabilities,
    /// The model this node serves, if any: the graph's `model`, or for a graph of several
    /// (`models:`) the one its request path serves.
    pub model: Option<ModelSpec>,
    /// Every model served through this node: for an ingress, one per request path it feeds
    /// (it sends each request down the path of the model the request names, see
    /// [`crate::payload::Payload::model_name`]); for other nodes, `model` alone.
    pub models: Vec<ModelSpec>,
    /// Directory of the graph file: relative paths in configs are resolved against it.
    pub base_dir: PathBuf,
    pub planes: Planes,
    /// The services this graph run shares among its nodes (see [`Service`]).
    pub services: Services,
    /// Whether this replica takes requests; see [`Readiness`].
    pub readiness: Readiness,
}

/// Whether a replica takes requests. A replica is ready when built, and most stay so; one
/// whose work is done elsewhere (an external engine server) reports that server's health
/// here. The runtime keeps the replica in discovery while it is ready and takes it out while
/// it is not, so routers choose only among replicas that can answer, and a request finds
/// none (503) rather than a dead one.
///
/// A replica that cannot recover (its engine thread panicked) reports [`Readiness::fail`]:
/// terminal. The runtime takes it out of discovery for good, stops serving it and starts a
/// replacement.
#[derive(Clone)]
pub struct Readiness(Arc<tokio::sync::watch::Sender<Health>>);

/// What [`Readiness`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    Ready,
    NotReady,
    /// Failed for good, with the reason.
    Failed(String),
}

impl Default for Readiness {
    fn default() -> Self {
        Self(Arc::new(tokio::sync::watch::Sender::new(Health::Ready)))
    }
}

impl Readiness {
    /// Report a change; telling the same thing twice does nothing, and nothing is heard
    /// after a failure.
    pub fn set(&self, ready: bool) {
        let now = if ready {
            Health::Ready
        } else {
            Health::NotReady
        };
        self.0.send_if_modified(|h| {
            if matches!(h, Health::Failed(_)) || *h == now {
                return false;
            }
            *h = now;
            true
        });
    }

    /// The replica is broken for good (the first reason is kept). Callable from any thread.
    pub fn fail(&self, reason: impl Into<String>) {
        let reason = reason.into();
        self.0.send_if_modified(|h| {
            if matches!(h, Health::Failed(_)) {
                return false;
            }
            *h = Health::Failed(reason);
            true
        });
    }

    pub fn is_ready(&self) -> bool {
        *self.0.borrow() == Health::Ready
    }

    /// Follow the changes (the runtime registers and deregisters on them).
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<Health> {
        self.0.subscribe()
    }
}

impl BuildCx {
    /// The running service `S`, started on first use (see [`Service`]).
    pub async fn service<S: Service>(&self) -> Result<Arc<S>, BuildError> {
        self.services.get::<S>(self).await
    }

    /// A context for building replica 0 of `node` in a one-node graph `g` (namespace `ns`)
    /// with no model: unit tests of kinds start from it.
    pub fn for_tests(node: &str, planes: Planes) -> Self {
        Self {
            graph: "g".into(),
            namespace: "ns".into(),
            node: node.into(),
            replica: 0,
            instance_id: crate::planes::InstanceId(1),
            consumers: Vec::new(),
            serves: Default::default(),
            model: None,
            models: Vec::new(),
            base_dir: ".".into(),
            planes,
            services: Services::default(),
            readiness: Readiness::default(),
        }
    }

    /// A path from the graph or a node's config: `~/…` under the home directory, relative
    /// paths against the graph file's directory.
    pub fn resolve(&self, path: &str) -> PathBuf {
        match (path.strip_prefix("~/"), std::env::var_os("HOME")) {
            (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
            _ => self.base_dir.join(path),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    static STARTS: AtomicUsize = AtomicUsize::new(0);

    struct Counter(usize);
    impl Service for Counter {
        async fn start(_cx: &BuildCx) -> Result<Self, BuildError> {
            Ok(Counter(STARTS.fetch_add(1, Ordering::SeqCst)))
        }
    }

    #[tokio::test]
    async fn a_service_starts_once_per_set_and_is_shared() {
        let cx = BuildCx::for_tests("n", crate::planes::Planes::embedded());
        let (a, b) = tokio::join!(cx.service::<Counter>(), cx.service::<Counter>());
        let (a, b) = (a.unwrap(), b.unwrap());
        assert!(Arc::ptr_eq(&a, &b));
        let other = BuildCx::for_tests("n", crate::planes::Planes::embedded());
        let c = other.service::<Counter>().await.unwrap();
        assert_ne!(a.0, c.0, "a fresh set starts its own");
    }

    #[test]
    fn adapter_names_must_be_model_names_other_than_the_model() {
        let spec: ModelSpec = serde_json::from_value(serde_json::json!({
            "name": "tiny", "path": "m",
            "loras": {"ok-1": "a", "tiny": "b", "two words": "c", "": "d"},
        }))
        .unwrap();
        let p = spec.lora_problems();
        assert_eq!(p.len(), 3, "{p:?}");
        assert!(p[0].contains("`` is not a model name"), "{p:?}");
        assert!(p[1].contains("`tiny` is the model's own name"), "{p:?}");
        assert!(p[2].contains("`two words` is not a model name"), "{p:?}");
    }
}
