//! `prefill`: workers that compute prompts' KV for decode workers (disaggregated serving).
//!
//! Each replica takes jobs from its partition of the node's work queue (put there by a
//! `remote_prefill` node), runs the prompt through its engine in the prefill role (the first
//! token, then the prompt's blocks stay pinned), offers the blocks to this process's KV
//! transfer agent, and answers on the job's reply subject with the first token and the
//! transfer descriptor. It is also an ordinary operator (a prompt in, [`Prefilled`] out) for
//! graphs that call it on the request path. It emits KV events and load metrics like a decode
//! worker, so the pool can be routed KV-aware.
//!
//! ```yaml
//! prefill:
//!   kind: prefill
//!   config: {engine: mocker, mocker: {speedup: 10}}
//! ```

use std::sync::Arc;

use dyn_engine::EngineHandle;
use dyn_llm::types::{Generated, Prefilled, PreprocessedRequest};
use dyn_pipeline::registry::Role;
use dyn_pipeline::{
    BuildCx, BuildError, Ctx, Input, Invalid, OpError, Operator, OperatorConfig, Output,
};
use dyn_router::remote_prefill::{PrefillJob, PrefillReply, queue_name, unix_ms};
use futures::StreamExt;
use serde::Deserialize;

use crate::decode::DecodeConfig;

/// `{engine: mocker|native, mocker|native: {...}}`, exactly as for `decode`.
#[derive(Debug, Clone, Deserialize)]
#[serde(transparent)]
pub struct PrefillConfig(pub DecodeConfig);

impl OperatorConfig for PrefillConfig {
    const KIND: &'static str = "prefill";
    const SUMMARY: &'static str =
        "Prefill worker: computes prompts' KV for decode workers to pull (engine: mocker, native)";
    const ROLE: Role = Role::Worker;
    type Op = Prefill;

    fn validate(&self) -> Vec<Invalid> {
        self.0.validate()
    }

    fn metadata(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut m = self.0.metadata();
        m.insert("role".into(), "prefill".into());
        m
    }

    async fn build(&self, cx: &BuildCx) -> Result<Prefill, BuildError> {
        let engine = self.0.start(cx).await?;
        let worker_id = cx.instance_id;
        let queue = queue_name(&cx.namespace, &cx.node);
        let mut jobs = cx
            .planes
            .queue
            .take(&queue, &format!("{worker_id:x}"))
            .await
            .map_err(|e| BuildError::new(format!("cannot take prefill jobs from {queue}: {e}")))?;
        let planes = cx.planes.clone();
        let serving = engine.clone();
        let task = tokio::spawn(async move {
            while let Some(body) = jobs.next().await {
                let job: PrefillJob = match serde_json::from_slice(&body) {
                    Ok(j) => j,
                    Err(e) => {
                        tracing::warn!(error = %e, "Ignoring a malformed prefill job");
                        continue;
                    }
                };
                if job.deadline_unix_ms <= unix_ms() {
                    tracing::debug!(job = job.id, "Skipping a prefill job past its deadline");
                    continue;
                }
                let engine = serving.clone();
                let planes = planes.clone();
                tokio::spawn(async move {
                    let left = job.deadline_unix_ms.saturating_sub(unix_ms());
                    let ctx = Ctx::new().with_timeout(std::time::Duration::from_millis(left));
                    let result = prefill(&engine, &ctx, &job.request, worker_id)
                        .await
                        .map_err(|e| e.message);
                    let reply = PrefillReply { id: job.id, result };
                    match serde_json::to_vec(&reply) {
                        Ok(b) => {
                            if let Err(e) = planes.events.publish(&job.reply, b.into()).await {
                                tracing::warn!(error = %e, "Cannot answer a prefill job");
                            }
                        }
                        Err(e) => tracing::error!(error = %e, "Cannot encode a prefill reply"),
                    }
                });
            }
        });
        Ok(Prefill {
            engine,
            worker_id,
            _jobs: tokio_util::task::AbortOnDropHandle::new(task),
        })
    }
}

pub struct Prefill {
    engine: Arc<EngineHandle>,
    worker_id: u64,
    _jobs: tokio_util::task::AbortOnDropHandle<()>,
}

/// Run one prompt in the prefill role: its first token and the offer of its KV.
async fn prefill(
    engine: &EngineHandle,
    ctx: &Ctx,
    req: &PreprocessedRequest,
    worker_id: u64,
) -> Result<Prefilled, OpError> {
    let (mut tokens, offer) = engine.submit_prefill(req)?;
    let work = async {
        let mut first = None;
        while let Some(g) = tokens.recv().await {
            if let Generated::Tokens { ids, .. } = g? {
                first = ids.first().copied();
                break;
            }
        }
        let first = first.ok_or_else(|| OpError::internal("the prefill ended without a token"))?;
        let transfer = offer
            .await
            .map_err(|_| OpError::internal("the engine stopped before offering the KV"))?
            .map_err(|e| OpError::internal(format!("cannot offer the KV: {e}")))?;
        Ok(Prefilled {
            worker_id,
            prompt_tokens: u32::try_from(req.token_ids.len()).unwrap_or(u32::MAX),
            first_token: first,
            transfer,
        })
    };
    tokio::select! {
        r = work => r,
        _ = ctx.killed() => Err(OpError::cancelled()),
    }
}

impl Operator for Prefill {
    type In = PreprocessedRequest;
    type Out = Prefilled;

    fn call(&self, ctx: Ctx, input: Input<PreprocessedRequest>) -> Output<Prefilled> {
        let engine = self.engine.clone();
        let worker_id = self.worker_id;
        input
            .then(move |req| {
                let engine = engine.clone();
                let ctx = ctx.clone();
                async move { prefill(&engine, &ctx, &req, worker_id).await }
            })
            .boxed()
    }
}
