//! `decode`: runs an engine. `config.engine` selects it; this build has `mocker` (a
//! simulated vLLM-style engine). The engine's stream starts with the request's output spec
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

use dyn_pipeline::{
    BuildCx, BuildError, Ctx, Input, Invalid, OpError, Operator, OperatorConfig, Output,
};
use futures::StreamExt;
use serde::Deserialize;

use crate::llm::types::{Generated, PreprocessedRequest};
use crate::mocker::scheduler::SeqRole;
use crate::mocker::{Mocker, MockerConfig};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Engine {
    Mocker,
}

/// The engine, and a section of settings per engine: `{engine: mocker, mocker: {...}}`.
/// (A section per engine rather than one internally tagged enum: serde buffers tagged enums,
/// which loses YAML positions and scalar typing.)
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeConfig {
    pub engine: Engine,
    #[serde(default)]
    pub mocker: Option<MockerConfig>,
}

impl DecodeConfig {
    pub(crate) fn mocker(&self) -> MockerConfig {
        self.mocker.clone().unwrap_or_default()
    }
}

impl OperatorConfig for DecodeConfig {
    const KIND: &'static str = "decode";
    const SUMMARY: &'static str = "Runs an engine on tokenized requests (engine: mocker)";
    type Op = Decode;

    fn validate(&self) -> Vec<Invalid> {
        match self.engine {
            Engine::Mocker => self.mocker().validate("mocker."),
        }
    }

    fn metadata(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        match self.engine {
            Engine::Mocker => {
                let c = self.mocker();
                m.insert("engine".into(), "mocker".into());
                m.insert("block_size".into(), c.block_size.into());
                m.insert("kv_total_blocks".into(), c.num_blocks.into());
            }
        }
        m
    }

    async fn build(&self, cx: &BuildCx) -> Result<Decode, BuildError> {
        let engine = match self.engine {
            Engine::Mocker => Mocker::start(&self.mocker(), cx).await?,
        };
        Ok(Decode { engine })
    }
}

pub struct Decode {
    engine: Arc<Mocker>,
}

impl Operator for Decode {
    type In = PreprocessedRequest;
    type Out = Generated;

    fn call(&self, ctx: Ctx, mut input: Input<PreprocessedRequest>) -> Output<Generated> {
        let engine = self.engine.clone();
        async_stream::stream! {
            let Some(mut req) = input.next().await else { return };
            let role = match req.prefilled.take() {
                Some(p) => tokio::select! {
                    role = engine.import(&req, &p) => role,
                    _ = ctx.killed() => return,
                },
                None => SeqRole::Full,
            };
            let mut rx = match engine.submit(&req, role) {
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
                        Some(g) => yield Ok(g),
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
