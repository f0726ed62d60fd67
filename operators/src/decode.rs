//! `decode`: runs an engine. `config.engine` selects it: `mocker` (a simulated vLLM-style
//! engine) or `native` (a Llama-family model on this project's CPU or CUDA backend); both run
//! on the shared engine loop in [`crate::engine`]. The engine's stream starts with the request's output spec
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

use std::sync::Arc;

use dyn_pipeline::registry::Role;
use dyn_pipeline::{
    BuildCx, BuildError, Ctx, Input, Invalid, OpError, Operator, OperatorConfig, Output,
};
use futures::StreamExt;
use serde::Deserialize;

use crate::engine::EngineHandle;
use crate::engine::mocker::{self, MockerConfig};
use crate::engine::native::{self, NativeConfig};
use crate::llm::types::{Generated, PreprocessedRequest};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    Mocker,
    Native,
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
}

impl DecodeConfig {
    pub(crate) fn mocker(&self) -> MockerConfig {
        self.mocker.clone().unwrap_or_default()
    }

    pub(crate) fn native(&self) -> NativeConfig {
        self.native.clone().unwrap_or_default()
    }

    /// Start the configured engine's worker.
    pub(crate) async fn start(&self, cx: &BuildCx) -> Result<Arc<EngineHandle>, BuildError> {
        match self.engine {
            EngineKind::Mocker => mocker::start(&self.mocker(), cx).await,
            EngineKind::Native => native::start(&self.native(), cx).await,
        }
    }
}

impl OperatorConfig for DecodeConfig {
    const KIND: &'static str = "decode";
    const SUMMARY: &'static str = "Runs an engine on tokenized requests (engine: mocker, native)";
    const ROLE: Role = Role::Worker;
    type Op = Decode;

    fn validate(&self) -> Vec<Invalid> {
        let mut out = match self.engine {
            EngineKind::Mocker => self.mocker().validate("mocker."),
            EngineKind::Native => self.native().validate("native."),
        };
        // A section for the engine not chosen is a mistake worth naming.
        if self.engine != EngineKind::Mocker && self.mocker.is_some() {
            out.push(Invalid::field(
                "mocker",
                "set, but the engine is not mocker",
            ));
        }
        if self.engine != EngineKind::Native && self.native.is_some() {
            out.push(Invalid::field(
                "native",
                "set, but the engine is not native",
            ));
        }
        out
    }

    fn metadata(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        match self.engine {
            EngineKind::Mocker => {
                let c = self.mocker();
                m.insert("engine".into(), "mocker".into());
                m.insert("block_size".into(), c.block_size.into());
                m.insert("kv_total_blocks".into(), c.num_blocks.into());
            }
            EngineKind::Native => {
                let c = self.native();
                m.insert("engine".into(), "native".into());
                m.insert("block_size".into(), c.block_size.into());
                m.insert("kv_total_blocks".into(), c.num_blocks.into());
            }
        }
        m
    }

    async fn build(&self, cx: &BuildCx) -> Result<Decode, BuildError> {
        Ok(Decode {
            engine: self.start(cx).await?,
        })
    }
}

pub struct Decode {
    engine: Arc<EngineHandle>,
}

impl Operator for Decode {
    type In = PreprocessedRequest;
    type Out = Generated;

    fn call(&self, ctx: Ctx, mut input: Input<PreprocessedRequest>) -> Output<Generated> {
        let engine = self.engine.clone();
        async_stream::stream! {
            let Some(mut req) = input.next().await else { return };
            let kv = match req.prefilled.take() {
                Some(p) => tokio::select! {
                    kv = engine.import(&req, &p) => kv,
                    _ = ctx.killed() => return,
                },
                None => None,
            };
            let mut rx = match engine.submit(&req, kv) {
                Ok(rx) => rx,
                Err(e) => {
                    yield Err(e);
                    return;
                }
            };
            yield Ok::<_, OpError>(Generated::Start(req.output));
            // One kill future for the whole stream, not one (with its deadline timer) per batch.
            let killed = ctx.killed();
            tokio::pin!(killed);
            loop {
                tokio::select! {
                    item = rx.recv() => match item {
                        Some(g) => yield g,
                        None => break,
                    },
                    // Dropping `rx` is how the engine learns the request is gone.
                    _ = &mut killed => {
                        tracing::debug!(request_id = %ctx.id(), "Decode killed");
                        break;
                    }
                }
            }
        }
        .boxed()
    }
}
