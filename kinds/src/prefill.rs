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
//! Each replica keeps the jobs it knows by sender and id ([`Jobs`]), so a
//! [`PrefillCancel`] from the sender reaches the job wherever it is: a running job's context
//! is killed (its engine request ends), a finished job's offer is discarded (its pinned blocks
//! are released now, not at the pin TTL), and a job not taken yet is skipped when it comes.
//!
//! ```yaml
//! prefill:
//!   kind: prefill
//!   config: {engine: mocker, mocker: {speedup: 10}}
//! ```

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dyn_compute::transfer::{KvTransferAgent, TransferDescriptor};
use dyn_core::InstanceMeta;
use dyn_core::registry::Role;
use dyn_core::{
    BuildCx, BuildError, Ctx, Input, Invalid, OpError, Operator, OperatorConfig, Output,
};
use dyn_engine::EngineHandle;
use dyn_protocol::types::{Generated, Prefilled, PreprocessedRequest};
use dyn_router::remote_prefill::{
    PrefillCancel, PrefillJob, PrefillReply, cancel_subject, queue_name,
};
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

    fn metadata(&self) -> InstanceMeta {
        InstanceMeta {
            role: Some("prefill".into()),
            ..self.0.metadata()
        }
    }

    async fn build(&self, cx: &BuildCx) -> Result<Prefill, BuildError> {
        let engine = self.0.start(cx).await?;
        let worker_id = cx.instance_id.get();
        let queue = queue_name(&cx.namespace, &cx.node);
        let mut jobs = cx
            .planes
            .queue
            .take(&queue, &format!("{worker_id:x}"))
            .await
            .map_err(|e| BuildError::new(format!("cannot take prefill jobs from {queue}: {e}")))?;
        let mut cancels = cx
            .planes
            .events
            .subscribe(&cancel_subject(&cx.namespace, &cx.node, worker_id))
            .await
            .map_err(|e| BuildError::new(format!("cannot subscribe to prefill cancels: {e}")))?;
        let agent = cx
            .service::<dyn_engine::transfer::TransferAgent>()
            .await?
            .0
            .clone();
        let known = Arc::new(Jobs::new(engine.pin_ttl()));
        let releaser = agent.clone();
        let planes = cx.planes.clone();
        let serving = engine.clone();
        let state = known.clone();
        let task = tokio::spawn(async move {
            while let Some(body) = jobs.next().await {
                let job: PrefillJob = match serde_json::from_slice(&body) {
                    Ok(j) => j,
                    Err(e) => {
                        tracing::warn!(error = %e, "Ignoring a malformed prefill job");
                        continue;
                    }
                };
                let key = PrefillCancel {
                    reply: job.reply.clone(),
                    id: job.id,
                };
                // The budget counts from now: no clock of another machine is compared.
                let ctx = Ctx::new().with_timeout(Duration::from_millis(job.timeout_ms));
                if !state.start(&key, &ctx) {
                    tracing::debug!(job = job.id, "Skipping a cancelled prefill job");
                    continue;
                }
                let engine = serving.clone();
                let planes = planes.clone();
                let state = state.clone();
                let agent = releaser.clone();
                tokio::spawn(async move {
                    let result = prefill(&engine, &ctx, &job.request, worker_id, job.lock).await;
                    let offer = result.as_ref().ok().map(|p| &p.transfer);
                    if !state.finished(&key, &ctx, offer, agent.as_ref()) {
                        tracing::debug!(job = job.id, "Prefill job cancelled");
                        return;
                    }
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
        let state = known.clone();
        let cancels_task = tokio::spawn(async move {
            while let Some(ev) = cancels.next().await {
                match serde_json::from_slice::<PrefillCancel>(&ev.payload) {
                    Ok(c) => state.cancel(c, agent.as_ref()),
                    Err(e) => tracing::warn!(error = %e, "Ignoring a malformed prefill cancel"),
                }
            }
        });
        Ok(Prefill {
            engine,
            worker_id,
            jobs: known,
            _jobs: tokio_util::task::AbortOnDropHandle::new(task),
            _cancels: tokio_util::task::AbortOnDropHandle::new(cancels_task),
        })
    }
}

pub struct Prefill {
    engine: Arc<EngineHandle>,
    worker_id: u64,
    jobs: Arc<Jobs>,
    _jobs: tokio_util::task::AbortOnDropHandle<()>,
    _cancels: tokio_util::task::AbortOnDropHandle<()>,
}

impl Prefill {
    /// The jobs this replica knows of, for a cancel to find.
    pub fn jobs(&self) -> &Jobs {
        &self.jobs
    }
}

/// How long a cancel for a job not seen yet is remembered (the job may still be queued).
const CANCEL_MEMORY: Duration = Duration::from_secs(300);
/// Past this many entries, expired ones are dropped (at most once a second).
const JOBS_PRUNE_AT: usize = 4096;

/// Where a job a cancel may name stands.
enum Job {
    Running(Ctx),
    /// Done; its KV is offered until the instant (the pin TTL).
    Offered(TransferDescriptor, Instant),
    /// Cancelled before it was taken; skipped if it comes before the instant.
    Cancelled(Instant),
}

/// The jobs of one prefill replica, by sender and id: what a [`PrefillCancel`] has to stop.
pub struct Jobs {
    map: parking_lot::Mutex<HashMap<PrefillCancel, Job>>,
    /// When expired entries were last dropped: at most once a second, so a busy worker does
    /// not scan the map for every job.
    pruned: parking_lot::Mutex<Instant>,
    pin_ttl: Duration,
}

impl Jobs {
    fn new(pin_ttl: Duration) -> Self {
        Self {
            map: Default::default(),
            pruned: parking_lot::Mutex::new(Instant::now()),
            pin_ttl,
        }
    }

    /// A job is taken from the queue: false when it was cancelled already (skip it).
    fn start(&self, key: &PrefillCancel, ctx: &Ctx) -> bool {
        let mut map = self.map.lock();
        if let Some(Job::Cancelled(_)) = map.remove(key) {
            return false;
        }
        self.prune(&mut map);
        map.insert(key.clone(), Job::Running(ctx.clone()));
        true
    }

    /// A job ended: false when it was cancelled (or ran past its budget), and then nobody
    /// listens for the answer and an offer it made is released at once. A successful job's
    /// offer is kept for a later cancel to release. (A cancel kills the context under the
    /// same lock, so it is seen here or finds the offer kept.)
    fn finished(
        &self,
        key: &PrefillCancel,
        ctx: &Ctx,
        offer: Option<&TransferDescriptor>,
        agent: &dyn KvTransferAgent,
    ) -> bool {
        let mut map = self.map.lock();
        if ctx.is_killed() {
            map.remove(key);
            if let Some(desc) = offer {
                agent.discard(desc);
            }
            return false;
        }
        match offer {
            Some(desc) => {
                map.insert(
                    key.clone(),
                    Job::Offered(desc.clone(), Instant::now() + self.pin_ttl),
                );
            }
            None => {
                map.remove(key);
            }
        }
        true
    }

    /// The sender no longer waits for `key`.
    fn cancel(&self, key: PrefillCancel, agent: &dyn KvTransferAgent) {
        let mut map = self.map.lock();
        match map.remove(&key) {
            Some(Job::Running(ctx)) => {
                tracing::debug!(job = key.id, "Cancelling a running prefill job");
                ctx.kill();
                map.insert(key, Job::Running(ctx));
            }
            Some(Job::Offered(desc, _)) => {
                let released = agent.discard(&desc);
                tracing::debug!(
                    job = key.id,
                    released,
                    "Prefill job cancelled after it finished; its KV is released"
                );
            }
            Some(Job::Cancelled(_)) | None => {
                self.prune(&mut map);
                map.insert(key, Job::Cancelled(Instant::now() + CANCEL_MEMORY));
            }
        }
    }

    fn prune(&self, map: &mut HashMap<PrefillCancel, Job>) {
        let now = Instant::now();
        let mut pruned = self.pruned.lock();
        if map.len() < JOBS_PRUNE_AT || now.duration_since(*pruned) < Duration::from_secs(1) {
            return;
        }
        *pruned = now;
        map.retain(|_, j| match j {
            Job::Running(ctx) => !ctx.is_killed(),
            Job::Offered(_, until) | Job::Cancelled(until) => *until > now,
        });
    }

    /// How many jobs are in each state: (running, offered, cancelled before start).
    pub fn counts(&self) -> (usize, usize, usize) {
        let map = self.map.lock();
        let mut c = (0, 0, 0);
        for j in map.values() {
            match j {
                Job::Running(_) => c.0 += 1,
                Job::Offered(..) => c.1 += 1,
                Job::Cancelled(_) => c.2 += 1,
            }
        }
        c
    }
}

/// Run one prompt in the prefill role: its first token and the offer of its KV.
async fn prefill(
    engine: &EngineHandle,
    ctx: &Ctx,
    req: &PreprocessedRequest,
    worker_id: u64,
    lock: Option<dyn_compute::transfer::PullLock>,
) -> Result<Prefilled, OpError> {
    let lora = engine.adapter(req).await?;
    let (mut tokens, offer) = engine.submit_prefill(req, lora, lock).await?;
    let work = async {
        let mut first = None;
        while let Some(g) = tokens.recv().await {
            if let Generated::Tokens { ids, .. } = g? {
                first = ids.first().copied();
                break;
            }
        }
        // A channel closed early is the engine thread gone: the replica was lost.
        let first = first.ok_or_else(|| {
            OpError::instance_lost("the engine stopped before the prefill's token")
        })?;
        let transfer = offer
            .await
            .map_err(|_| OpError::instance_lost("the engine stopped before offering the KV"))?
            .map_err(|e| OpError::internal(format!("cannot offer the KV: {e}")))?;
        Ok(Prefilled {
            worker_id,
            prompt_tokens: u32::try_from(req.token_ids.len()).unwrap_or(u32::MAX),
            first_token: first,
            transfer,
            // The router adds it, for the decode worker only.
            key: None,
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
                // Called in this process: the offer stays in this process's agent too.
                async move { prefill(&engine, &ctx, &req, worker_id, None).await }
            })
            .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dyn_core::planes::Planes;
    use dyn_engine::transfer::TransferAgent;
    use tokio::time::timeout;

    const REPLY: &str = "dyn.ns.remote.prefill_replies.1";

    async fn push(planes: &Planes, id: u64, prompt: u32) {
        let job = PrefillJob {
            id,
            reply: REPLY.into(),
            request: dyn_protocol::testing::preprocessed((prompt..prompt + 40).collect(), 1),
            timeout_ms: 30_000,
            lock: None,
        };
        let body = serde_json::to_vec(&job).expect("json");
        planes
            .queue
            .push(&queue_name("ns", "prefill"), "7", body.into())
            .await
            .expect("queued");
    }

    async fn cancel(planes: &Planes, id: u64) {
        let c = PrefillCancel {
            reply: REPLY.into(),
            id,
        };
        let body = serde_json::to_vec(&c).expect("json");
        planes
            .events
            .publish(&cancel_subject("ns", "prefill", 7), body.into())
            .await
            .expect("sent");
    }

    use dyn_tests::until;

    #[tokio::test]
    async fn a_cancel_kills_a_running_job_skips_a_queued_one_and_frees_a_finished_ones_kv() {
        let planes = Planes::embedded();
        let mut replies = planes.events.subscribe(REPLY).await.expect("sub");
        // One step (a prefill) takes about half a second.
        let config: PrefillConfig = serde_json::from_value(serde_json::json!({
            "engine": "mocker",
            "mocker": {"speedup": 0.01, "num_blocks": 64}
        }))
        .expect("config");
        let cx = dyn_protocol::testing::cx("prefill", 7, &[], &planes);
        let p = config.build(&cx).await.expect("builds");
        let agent = cx
            .service::<TransferAgent>()
            .await
            .expect("agent")
            .0
            .clone();

        // Running: the cancel kills it; no answer, and its blocks come back.
        push(&planes, 1, 0).await;
        until("running", || p.jobs().counts().0 == 1).await;
        cancel(&planes, 1).await;
        until("forgotten", || p.jobs().counts() == (0, 0, 0)).await;
        until("blocks released", || p.engine.gauges.active_blocks() == 0).await;

        // Not taken yet: remembered, then skipped when it comes.
        cancel(&planes, 2).await;
        until("remembered", || p.jobs().counts() == (0, 0, 1)).await;
        push(&planes, 2, 100).await;
        until("skipped", || p.jobs().counts() == (0, 0, 0)).await;

        // Finished: answered and its offer kept; the cancel discards it at once.
        push(&planes, 3, 200).await;
        let ev = timeout(Duration::from_secs(10), replies.next())
            .await
            .expect("answered")
            .expect("open");
        let reply: PrefillReply = serde_json::from_slice(&ev.payload).expect("json");
        // Jobs 1 and 2 never answered: the first reply is job 3's.
        assert_eq!(reply.id, 3);
        let prefilled = reply.result.expect("prefilled");
        assert_eq!(p.jobs().counts(), (0, 1, 0));
        // Pinned for the pull (the gauge follows at the end of the engine's step).
        until("pinned for the pull", || {
            p.engine.gauges.active_blocks() > 0
        })
        .await;
        cancel(&planes, 3).await;
        until("discarded", || p.jobs().counts() == (0, 0, 0)).await;
        assert!(
            agent.pull(&prefilled.transfer, None).await.is_err(),
            "offer gone"
        );
        until("blocks released", || p.engine.gauges.active_blocks() == 0).await;
    }
}
