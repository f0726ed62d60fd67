//! `decode`: runs an engine. `config.engine` selects it: `mocker` (a simulated vLLM-style
//! engine) or `native` (a Llama-family model on this project's CPU or CUDA backend), both on
//! the shared engine loop in [`dyn_engine`]; or an external server per replica — `vllm`,
//! `llamacpp`, `openai` — given by URL or launched by dyn ([`dyn_external`]). The engine's stream starts with the request's output spec
//! (see [`Generated`]) and then carries token batches; when the consumer drops the stream or
//! the request is killed, the engine frees the request. A request prefilled on a prefill
//! worker (`prefilled`, from `remote_prefill`) has its KV pulled first and starts decoding at
//! once; if the pull fails it is prefilled here.
//!
//! ```yaml
//! decode:
//!   kind: decode
//!   inputs: [route]
//!   replicas: 2
//!   config: {engine: mocker, mocker: {speedup: 10}}
//! ```
//!
//! ```yaml
//! decode:
//!   kind: decode
//!   inputs: [route]
//!   config: {engine: vllm, vllm: {urls: [http://10.0.0.1:8000, http://10.0.0.2:8000]}}
//! ```

use std::sync::Arc;

use dyn_core::InstanceMeta;
use dyn_core::planes::Capabilities;
use dyn_core::registry::Role;
use dyn_core::{
    BuildCx, BuildError, Ctx, Input, Invalid, OpError, Operator, OperatorConfig, Output,
};
use dyn_engine::EngineHandle;
use dyn_engine::mocker::{self, MockerConfig};
use dyn_engine::native::{self, NativeConfig};
use dyn_external::{ExternalConfig, ExternalEngine, ExternalKind};
use futures::StreamExt;
use serde::Deserialize;

use dyn_protocol::types::{Generated, PreprocessedRequest};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    Mocker,
    Native,
    Vllm,
    Llamacpp,
    Openai,
}

impl EngineKind {
    /// The external server protocol, for the engines that are one.
    fn external(self) -> Option<ExternalKind> {
        match self {
            EngineKind::Mocker | EngineKind::Native => None,
            EngineKind::Vllm => Some(ExternalKind::Vllm),
            EngineKind::Llamacpp => Some(ExternalKind::Llamacpp),
            EngineKind::Openai => Some(ExternalKind::Openai),
        }
    }
}

/// The engine, and a section of settings per engine: `{engine: mocker, mocker: {...}}`.
/// (A section per engine rather than one internally tagged enum: serde buffers tagged enums,
/// which loses YAML positions and scalar typing.)
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeConfig {
    pub engine: EngineKind,
    #[serde(default)]
    pub mocker: Option<MockerConfig>,
    #[serde(default)]
    pub native: Option<NativeConfig>,
    #[serde(default)]
    pub vllm: Option<ExternalConfig>,
    #[serde(default)]
    pub llamacpp: Option<ExternalConfig>,
    #[serde(default)]
    pub openai: Option<ExternalConfig>,
}

impl DecodeConfig {
    pub(crate) fn mocker(&self) -> MockerConfig {
        self.mocker.clone().unwrap_or_default()
    }

    pub(crate) fn native(&self) -> NativeConfig {
        self.native.clone().unwrap_or_default()
    }

    /// The section of an external engine, and which it is.
    fn external(&self) -> Option<(ExternalKind, ExternalConfig)> {
        let kind = self.engine.external()?;
        let section = match kind {
            ExternalKind::Vllm => &self.vllm,
            ExternalKind::Llamacpp => &self.llamacpp,
            ExternalKind::Openai => &self.openai,
        };
        Some((kind, section.clone().unwrap_or_default()))
    }

    /// Start the configured engine's worker (dyn's engines only; see [`Engine`]).
    pub(crate) async fn start(&self, cx: &BuildCx) -> Result<Arc<EngineHandle>, BuildError> {
        match self.engine {
            EngineKind::Mocker => mocker::start(&self.mocker(), cx).await,
            EngineKind::Native => native::start(&self.native(), cx).await,
            EngineKind::Vllm | EngineKind::Llamacpp | EngineKind::Openai => Err(BuildError::new(
                "an external engine server cannot run in this role (only `decode`)",
            )),
        }
    }
}

impl OperatorConfig for DecodeConfig {
    const KIND: &'static str = "decode";
    const SUMMARY: &'static str =
        "Runs an engine on tokenized requests (engine: mocker, native, vllm, llamacpp, openai)";
    const ROLE: Role = Role::Worker;
    type Op = Decode;

    fn validate(&self) -> Vec<Invalid> {
        let mut out = match self.external() {
            None if self.engine == EngineKind::Mocker => self.mocker().validate("mocker."),
            None => self.native().validate("native."),
            Some((kind, c)) => c.validate(kind, &format!("{}.", kind.name())),
        };
        // A section for the engine not chosen is a mistake worth naming.
        for (engine, name, given) in [
            (EngineKind::Mocker, "mocker", self.mocker.is_some()),
            (EngineKind::Native, "native", self.native.is_some()),
            (EngineKind::Vllm, "vllm", self.vllm.is_some()),
            (EngineKind::Llamacpp, "llamacpp", self.llamacpp.is_some()),
            (EngineKind::Openai, "openai", self.openai.is_some()),
        ] {
            if self.engine != engine && given {
                out.push(Invalid::field(
                    name,
                    format!("set, but the engine is not {name}"),
                ));
            }
        }
        out
    }

    fn metadata(&self) -> InstanceMeta {
        let (engine, block_size, kv_total_blocks, max_num_seqs) = match self.engine {
            EngineKind::Mocker => {
                let c = self.mocker();
                (
                    "mocker",
                    Some(c.block_size),
                    Some(c.num_blocks),
                    Some(c.max_num_seqs),
                )
            }
            EngineKind::Native => {
                let c = self.native();
                (
                    "native",
                    Some(c.block_size),
                    Some(c.num_blocks),
                    Some(c.max_num_seqs),
                )
            }
            // vLLM announces its own block size in its load metrics; an external server's
            // batch size is its own flags' (a router gives it `admission.per_worker`, or its
            // default room).
            EngineKind::Vllm | EngineKind::Llamacpp | EngineKind::Openai => match self.external() {
                Some((kind, c)) => (kind.name(), c.block_size, None, None),
                None => return InstanceMeta::default(),
            },
        };
        InstanceMeta {
            engine: Some(engine.into()),
            block_size,
            kv_total_blocks: kv_total_blocks.map(|n| n as u64),
            max_num_seqs,
            capabilities: Some(self.capabilities()),
            ..InstanceMeta::default()
        }
    }

    fn replicas(&self) -> Option<u32> {
        self.external().and_then(|(_, c)| c.replicas())
    }

    async fn build(&self, cx: &BuildCx) -> Result<Decode, BuildError> {
        let engine = match self.external() {
            Some((kind, c)) => Engine::External(ExternalEngine::start(kind, &c, cx).await?),
            None => Engine::Local(self.start(cx).await?),
        };
        let broken = matches!(self.engine, EngineKind::Mocker)
            && self.mocker().fail_replicas.contains(&cx.replica);
        Ok(Decode { engine, broken })
    }
}

impl DecodeConfig {
    /// What the engine can serve, as far as the config says: the simulated engine has no
    /// model outputs (log-probabilities, hidden states) and runs no adapters, but enforces
    /// grammars with the model's tokenizer; the native engine computes both, and whether it
    /// runs adapters is its backend's to say; an external server's flags decide for it.
    fn capabilities(&self) -> Capabilities {
        match self.engine {
            EngineKind::Mocker => Capabilities {
                logprobs: Some(false),
                embeddings: Some(false),
                grammars: Some(true),
                lora: Some(false),
            },
            EngineKind::Native => Capabilities {
                logprobs: Some(true),
                embeddings: Some(true),
                grammars: None,
                lora: None,
            },
            EngineKind::Vllm | EngineKind::Llamacpp | EngineKind::Openai => Capabilities::default(),
        }
    }
}

/// A replica's engine: dyn's own engine loop, or an external server.
enum Engine {
    Local(Arc<EngineHandle>),
    External(Arc<ExternalEngine>),
}

pub struct Decode {
    engine: Engine,
    /// The mocker's `fail_replicas` names this replica: every request fails.
    broken: bool,
}

impl Operator for Decode {
    type In = PreprocessedRequest;
    type Out = Generated;

    fn call(&self, ctx: Ctx, mut input: Input<PreprocessedRequest>) -> Output<Generated> {
        if self.broken {
            let e = OpError::internal("mocker: injected failure (fail_replicas)");
            return futures::stream::iter([Err(e)]).boxed();
        }
        let engine = match &self.engine {
            Engine::Local(e) => e.clone(),
            Engine::External(e) => return external(e.clone(), ctx, input),
        };
        async_stream::stream! {
            let Some(mut req) = input.next().await else { return };
            let lora = tokio::select! {
                lora = engine.adapter(&req) => match lora {
                    Ok(lora) => lora,
                    Err(e) => {
                        yield Err(e);
                        return;
                    }
                },
                _ = ctx.killed() => return,
            };
            let kv = match req.prefilled.take() {
                Some(p) => tokio::select! {
                    kv = engine.import(&req, &p) => kv,
                    _ = ctx.killed() => return,
                },
                None => None,
            };
            let rx = match engine.submit(&req, kv, lora).await {
                Ok(rx) => rx,
                Err(e) => {
                    yield Err(e);
                    return;
                }
            };
            yield Ok::<_, OpError>(Generated::Start(req.output));
            let out = until_killed(&ctx, dyn_engine::handle::request_items(rx));
            tokio::pin!(out);
            while let Some(g) = out.next().await {
                yield g;
            }
        }
        .boxed()
    }
}

/// A request on an external server: its stream, until the server ends it or the request is
/// killed (dropping the stream closes the server's connection, which aborts it there).
fn external(
    engine: Arc<ExternalEngine>,
    ctx: Ctx,
    mut input: Input<PreprocessedRequest>,
) -> Output<Generated> {
    async_stream::stream! {
        let Some(mut req) = input.next().await else { return };
        if req.prefilled.take().is_some() {
            tracing::debug!(request_id = %ctx.id(), "An external engine cannot import KV; prefilling on the server");
        }
        let out = until_killed(&ctx, engine.generate(req));
        tokio::pin!(out);
        while let Some(item) = out.next().await {
            yield item;
        }
    }
    .boxed()
}

/// The items of `out` until it ends or the request is killed. Either way `out` is dropped,
/// which is how an engine learns the request is gone (its channel closes; an external
/// server's connection closes). One kill future for the whole stream, not one per item.
fn until_killed<T>(
    ctx: &Ctx,
    out: impl futures::Stream<Item = T> + Send + 'static,
) -> impl futures::Stream<Item = T> + Send + 'static {
    let ctx = ctx.clone();
    out.take_until(async move {
        ctx.killed().await;
        tracing::debug!(request_id = %ctx.id(), "Decode killed");
    })
}
