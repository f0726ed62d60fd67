//! `remote_prefill`: decides per request whether its prompt is prefilled on a prefill worker
//! (disaggregated serving) or by the decode worker the router chose (aggregated).
//!
//! Remote when the prompt tokens the chosen decode worker does not cache exceed
//! `min_remote_tokens` and the prefill queue holds fewer than `max_queue` jobs; local when the
//! prompt is short (the transfer would cost more than it saves), the queue is full (the
//! decode worker is the faster path), or no prefill worker is up (aggregated serving goes on).
//! A remote prefill goes to the prefill worker chosen KV-aware among the pool (the `route`
//! logic, over the prefill workers' KV events), as a job on that worker's partition of the
//! work queue (JetStream in distributed mode); the worker answers on this replica's reply
//! subject with the first token and a transfer descriptor, which travel on in the request
//! ([`PreprocessedRequest::prefilled`]) to the decode worker, which pulls the KV. A prefill
//! that fails, times out, or whose worker leaves falls back to local prefill.
//!
//! A job the sender stops waiting for (the request was cancelled, timed out, or fell back to
//! local prefill) is cancelled on the worker: a [`PrefillCancel`] on the worker's cancel
//! subject kills the job if it runs, skips it if it has not started, and releases its pinned
//! KV if it is done, so the work is not done twice and the blocks are not held for the pin
//! TTL. A job carries its time budget (`timeout_ms`), counted from when the worker takes it:
//! no clock is compared across machines.
//!
//! ```yaml
//! remote_prefill:
//!   kind: remote_prefill
//!   inputs: [route]
//!   config: {pool: prefill, min_remote_tokens: 512, max_queue: 8}
//! ```

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use dyn_core::planes::{Instance, Transport};
use dyn_core::registry::Role;
use dyn_core::{
    BuildCx, BuildError, Ctx, Input, Inspect, Invalid, OpError, Operator, OperatorConfig, Output,
};
use dyn_protocol::types::{Prefilled, PreprocessedRequest};
use futures::StreamExt;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::oneshot;

use crate::metrics::DISAGG;
use crate::{Policy, Route, RouteConfig};

fn d_min_remote_tokens() -> u32 {
    512
}
fn d_max_queue() -> u64 {
    8
}
fn d_timeout_s() -> f64 {
    30.0
}
fn one() -> f64 {
    1.0
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemotePrefillConfig {
    /// The prefill node (kind `prefill`) whose workers take remote prefills.
    pub pool: String,
    /// Prefill remotely only when more prompt tokens than this are not cached on the decode
    /// worker.
    #[serde(default = "d_min_remote_tokens")]
    pub min_remote_tokens: u32,
    /// Prefill locally while this many remote prefills or more are outstanding: jobs in the
    /// work queue plus prompts the prefill engines run or hold (from their load metrics).
    #[serde(default = "d_max_queue")]
    pub max_queue: u64,
    /// Give up on a remote prefill after this long and prefill locally.
    #[serde(default = "d_timeout_s")]
    pub timeout_s: f64,
    /// KV-aware choice among the prefill workers: weight of cached blocks against load.
    #[serde(default = "one")]
    pub overlap_weight: f64,
}

impl OperatorConfig for RemotePrefillConfig {
    const KIND: &'static str = "remote_prefill";
    const SUMMARY: &'static str = "Sends long prompts to a pool of prefill workers (disaggregated serving); short ones stay with the decode worker";
    const ROLE: Role = Role::PassThrough;
    type Op = RemotePrefill;

    fn validate(&self) -> Vec<Invalid> {
        let mut out = Vec::new();
        if !(self.timeout_s.is_finite() && self.timeout_s > 0.0) {
            out.push(Invalid::field(
                "timeout_s",
                "must be a positive number of seconds",
            ));
        }
        if !(self.overlap_weight.is_finite() && self.overlap_weight >= 0.0) {
            out.push(Invalid::field("overlap_weight", "must be a number ≥ 0"));
        }
        out
    }

    fn calls(&self) -> Vec<String> {
        vec![self.pool.clone()]
    }

    async fn build(&self, cx: &BuildCx) -> Result<RemotePrefill, BuildError> {
        // The pool is routed like any worker node, but shown through this node, not on its own.
        let pool = RouteConfig {
            policy: Policy::Kv,
            cost: crate::cost::CostModel::Blocks,
            overlap_weight: Some(self.overlap_weight),
            // Prefill is best effort beside the decode worker's own: a busy pool means a
            // local prefill, never a wait or a refusal here.
            admission: None,
            ..RouteConfig::default()
        }
        .start(cx, &self.pool)
        .await?;
        let reply = format!(
            "dyn.{}.{}.prefill_replies.{:x}",
            cx.namespace, cx.node, cx.instance_id
        );
        let mut replies = cx
            .planes
            .events
            .subscribe(&reply)
            .await
            .map_err(|e| BuildError::new(format!("cannot subscribe to {reply}: {e}")))?;
        let waiting: Arc<Waiting> = Arc::default();
        let demux = waiting.clone();
        let task = tokio::spawn(async move {
            while let Some(ev) = replies.next().await {
                match serde_json::from_slice::<PrefillReply>(&ev.payload) {
                    Ok(r) => {
                        if let Some(tx) = demux.lock().remove(&r.id) {
                            let _ = tx.send(r.result);
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "Ignoring a malformed prefill reply"),
                }
            }
        });
        let inner = Arc::new(Inner {
            node: cx.node.clone(),
            namespace: cx.namespace.clone(),
            queue: queue_name(&cx.namespace, &self.pool),
            config: self.clone(),
            pool,
            planes: cx.planes.clone(),
            reply,
            waiting,
            counts: Mutex::new(HashMap::new()),
        });
        let shown: Arc<dyn Inspect> = inner.clone();
        cx.service::<dyn_core::Inspectables>()
            .await?
            .register(&cx.node, &shown);
        Ok(RemotePrefill {
            inner,
            _replies: tokio_util::task::AbortOnDropHandle::new(task),
        })
    }
}

/// The work queue of prefill node `pool`: one partition per prefill worker.
pub fn queue_name(namespace: &str, pool: &str) -> String {
    format!("{namespace}_{pool}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// A remote prefill, as it waits in a prefill worker's queue partition.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrefillJob {
    pub id: u64,
    /// Event-plane subject the worker answers on.
    pub reply: String,
    pub request: PreprocessedRequest,
    /// Milliseconds the worker may spend on the job from when it takes it; the sender waits
    /// no longer than this in all, and cancels the job when it stops waiting.
    pub timeout_ms: u64,
    /// The lock of the key that pulls the offer: the job travels on the event plane, where
    /// other members may read it, so it carries the lock and the key goes to the decode worker
    /// alone (in `Prefilled::key`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lock: Option<dyn_protocol::types::PullLock>,
}

/// The sender no longer waits for job `id` (of reply subject `reply`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PrefillCancel {
    pub reply: String,
    pub id: u64,
}

/// The subject on which prefill worker `worker_id` of node `pool` hears cancels.
pub fn cancel_subject(namespace: &str, pool: &str, worker_id: u64) -> String {
    format!("dyn.{namespace}.{pool}.prefill_cancel.{worker_id:x}")
}

/// A prefill worker's answer to a [`PrefillJob`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrefillReply {
    pub id: u64,
    /// The error keeps its kind and code (`OpError` crosses the wire as it does on the
    /// request plane), so the sender can tell a busy worker from a broken one.
    pub result: Result<Prefilled, OpError>,
}

/// Cancels a queued prefill job when dropped while armed (`inner` set): the sender stopped
/// waiting without an answer, and the future that would have said so is gone.
struct CancelOnDrop {
    inner: Option<Arc<Inner>>,
    worker: u64,
    id: u64,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else {
            return;
        };
        let (worker, id) = (self.worker, self.id);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move { inner.cancel(worker, id).await });
        }
    }
}

/// Where a prompt is prefilled, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    Remote,
    Local(Reason),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// No more uncached tokens than `min_remote_tokens`.
    BelowThreshold,
    /// The prefill queue holds `max_queue` jobs or more.
    QueueFull,
    /// No prefill worker is up.
    NoPrefillWorker,
    /// The remote prefill failed, timed out, or its worker left.
    PrefillFailed,
    /// The request wants log-probabilities: its first token's (and its prompt's) are
    /// computed where it is prefilled, so it stays with the decode worker.
    Logprobs,
    /// An embeddings request: its answer is its prefill's hidden states, computed where it
    /// is answered.
    Embedding,
    /// The event plane (the queue's and the replies' carrier) is unreachable: waiting for it
    /// would cost more than prefilling here.
    PlaneDown,
}

impl Choice {
    pub fn labels(self) -> (&'static str, &'static str) {
        match self {
            Choice::Remote => ("remote", "remote"),
            Choice::Local(r) => (
                "local",
                match r {
                    Reason::BelowThreshold => "below_threshold",
                    Reason::QueueFull => "queue_full",
                    Reason::NoPrefillWorker => "no_prefill_worker",
                    Reason::PrefillFailed => "prefill_failed",
                    Reason::Logprobs => "logprobs",
                    Reason::Embedding => "embedding",
                    Reason::PlaneDown => "plane_down",
                },
            ),
        }
    }
}

/// The decision rule. `uncached`: prompt tokens the decode worker does not cache;
/// `prefill_workers`: live workers in the pool; `queue`: jobs waiting in the prefill queue
/// (only looked at when the other terms allow a remote prefill).
pub fn decide(
    c: &RemotePrefillConfig,
    uncached: usize,
    prefill_workers: usize,
    queue: u64,
) -> Choice {
    if prefill_workers == 0 {
        Choice::Local(Reason::NoPrefillWorker)
    } else if uncached <= c.min_remote_tokens as usize {
        Choice::Local(Reason::BelowThreshold)
    } else if queue >= c.max_queue {
        Choice::Local(Reason::QueueFull)
    } else {
        Choice::Remote
    }
}

/// Whether a prefill reply may be acted on: it comes from `worker`, the worker the job went to,
/// and its KV waits at an agent on that worker's host as discovery (`record`) has it. A reply
/// arrives on the event plane; a decode worker connects to whatever agent it names.
fn believe(worker: u64, record: Option<&Instance>, p: &Prefilled) -> Result<(), String> {
    if p.worker_id != worker {
        return Err(format!(
            "a reply for worker {worker:x} came from {:x}",
            p.worker_id
        ));
    }
    let agent = &p.transfer.agent;
    let ok = match record.map(|r| &r.transport) {
        Some(Transport::Tcp { address }) => agent
            .strip_prefix("tcp://")
            .is_some_and(|a| dyn_trust::host_of(a) == dyn_trust::host_of(address)),
        Some(Transport::InProcess) => agent.starts_with("inproc://"),
        None => false,
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "worker {worker:x} named agent {agent}, which is not on its host"
        ))
    }
}

/// Remote prefills waiting for their reply, by job id.
type Waiting = Mutex<HashMap<u64, oneshot::Sender<Result<Prefilled, OpError>>>>;

pub struct RemotePrefill {
    inner: Arc<Inner>,
    _replies: tokio_util::task::AbortOnDropHandle<()>,
}

struct Inner {
    node: String,
    namespace: String,
    queue: String,
    config: RemotePrefillConfig,
    /// KV-aware routing among the prefill workers.
    pool: Route,
    planes: dyn_core::planes::Planes,
    /// This replica's reply subject.
    reply: String,
    waiting: Arc<Waiting>,
    /// Decisions so far, for `dyn inspect`.
    counts: Mutex<HashMap<&'static str, u64>>,
}

impl Inner {
    fn count(&self, choice: Choice) {
        let (decision, reason) = choice.labels();
        DISAGG
            .decisions
            .with_label_values(&[self.node.as_str(), decision, reason])
            .inc();
        *self.counts.lock().entry(reason).or_default() += 1;
    }

    /// The decision for a prompt of `tokens` tokens of which `cached` are cached on the decode
    /// worker; the queue is only read when the other terms allow a remote prefill.
    async fn choose(&self, tokens: usize, cached: usize) -> Choice {
        let uncached = tokens.saturating_sub(cached);
        let workers = self.pool.live().len();
        let quick = decide(&self.config, uncached, workers, 0);
        if quick != Choice::Remote {
            return quick;
        }
        // Not even asked while the event plane is down: the question would wait for it.
        if !self.planes.events.connected() {
            return Choice::Local(Reason::PlaneDown);
        }
        // Jobs not taken yet, plus those the prefill engines run or hold in their schedulers
        // (a prefill engine batches prompts, so running ones are a backlog too).
        match self.planes.queue.depth(&self.queue).await {
            Ok(depth) => decide(&self.config, uncached, workers, depth + self.pool.busy()),
            Err(e) => {
                tracing::warn!(error = %e, "Cannot read the prefill queue's depth; prefilling locally");
                Choice::Local(Reason::QueueFull)
            }
        }
    }

    /// Prefill `req` on a prefill worker; `Err` says why it did not happen.
    async fn remote(
        self: &Arc<Self>,
        ctx: &Ctx,
        req: &PreprocessedRequest,
    ) -> Result<Prefilled, String> {
        // The prefill worker's load counts this request until its prefill is over.
        let pctx = ctx.child(format!("{}-prefill", ctx.id()));
        let lora = req
            .routing
            .lora
            .as_ref()
            .map(dyn_protocol::types::LoraRef::key);
        let worker = self
            .pool
            .choose(
                &pctx,
                crate::PromptRef::new(
                    &req.token_ids,
                    dyn_protocol::kv::request_salt(&req.routing),
                    &req.hashes,
                ),
                lora.as_deref(),
            )
            .map_err(|e| e.message)?;
        // Random: a reply is matched by this id, and nobody can guess one to answer first.
        let id = rand::random::<u64>();
        let (tx, rx) = oneshot::channel();
        self.waiting.lock().insert(id, tx);
        // Whatever happens below, the slot goes.
        struct Slot<'a>(&'a Inner, u64);
        impl Drop for Slot<'_> {
            fn drop(&mut self) {
                self.0.waiting.lock().remove(&self.1);
            }
        }
        let _slot = Slot(self, id);
        let timeout = Duration::from_secs_f64(self.config.timeout_s);
        let mut request = req.clone();
        // `target` stays: the decode worker the router chose is the only one that may pull
        // the offer.
        request.prefilled = None;
        let key = dyn_protocol::types::PullKey::random();
        let job = PrefillJob {
            id,
            reply: self.reply.clone(),
            request,
            timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            lock: Some(key.lock()),
        };
        let body = serde_json::to_vec(&job).map_err(|e| e.to_string())?;
        self.planes
            .queue
            .push(&self.queue, &format!("{worker:x}"), body.into())
            .await
            .map_err(|e| e.to_string())?;
        tracing::debug!(request_id = %ctx.id(), prefill_worker = format_args!("{worker:x}"), "Remote prefill queued");
        // From here the worker has the job: unless it answers, it is cancelled, also when this
        // future is dropped unfinished (a client that hangs up drops the whole request).
        let mut cancel = CancelOnDrop {
            inner: Some(self.clone()),
            worker,
            id,
        };
        // The worker left, or the plane its answer would come on dropped (an answer sent
        // meanwhile is lost): either way no answer is coming, and the request prefills here
        // now rather than after the whole timeout.
        let gone = async {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if !self.pool.live().contains(&worker) {
                    return format!("prefill worker {worker:x} left");
                }
                if !self.planes.events.connected() {
                    return "the event plane disconnected".to_owned();
                }
            }
        };
        let result = tokio::select! {
            r = rx => match r {
                // The worker answered (a failure included): it holds nothing to cancel.
                // The worker failed: it holds nothing to cancel.
                Ok(Err(e)) => {
                    cancel.inner = None;
                    Err(format!("the prefill worker failed ({:?}): {}", e.kind, e.message))
                }
                // A reply not believed leaves the job armed: the cancel below releases
                // whatever the worker pinned for it.
                Ok(Ok(p)) => believe(worker, self.pool.instance(worker).as_ref(), &p).map(|()| {
                    cancel.inner = None;
                    Prefilled { key: Some(key), ..p }
                }),
                Err(_) => Err("the reply channel closed".to_owned()),
            },
            _ = tokio::time::sleep(timeout) => Err(format!("no answer within {timeout:?}")),
            why = gone => Err(why),
            _ = ctx.killed() => Err("request cancelled".to_owned()),
        };
        pctx.first_output();
        if let Some(inner) = cancel.inner.take() {
            inner.cancel(worker, id).await;
        }
        result
    }

    /// Tell prefill worker `worker` that nobody waits for job `id` any more.
    async fn cancel(&self, worker: u64, id: u64) {
        let cancel = PrefillCancel {
            reply: self.reply.clone(),
            id,
        };
        let subject = cancel_subject(&self.namespace, &self.config.pool, worker);
        let sent = match serde_json::to_vec(&cancel) {
            Ok(body) => self.planes.events.publish(&subject, body.into()).await,
            Err(e) => {
                tracing::error!(error = %e, "Cannot encode a prefill cancel");
                return;
            }
        };
        if let Err(e) = sent {
            // The job then runs to its budget and its KV to the pin TTL: wasted, not wrong.
            tracing::warn!(error = %e, job = id, "Cannot cancel a remote prefill");
        }
    }
}

impl Operator for RemotePrefill {
    type In = PreprocessedRequest;
    type Out = PreprocessedRequest;

    fn call(&self, ctx: Ctx, input: Input<PreprocessedRequest>) -> Output<PreprocessedRequest> {
        let inner = self.inner.clone();
        input
            .then(move |mut req| {
                let inner = inner.clone();
                let ctx = ctx.clone();
                async move {
                    let s = &req.sampling;
                    let choice = if s.logprobs.is_some() || s.prompt_logprobs.is_some() {
                        Choice::Local(Reason::Logprobs)
                    } else if s.embed.is_some() {
                        Choice::Local(Reason::Embedding)
                    } else {
                        inner
                            .choose(req.token_ids.len(), req.cached_tokens as usize)
                            .await
                    };
                    let choice = match choice {
                        Choice::Remote => match inner.remote(&ctx, &req).await {
                            Ok(p) => {
                                tracing::debug!(request_id = %ctx.id(), prefill_worker = format_args!("{:x}", p.worker_id), "Prefilled remotely");
                                req.prefilled = Some(p);
                                Choice::Remote
                            }
                            Err(e) => {
                                if ctx.is_killed() {
                                    return Err(OpError::cancelled());
                                }
                                tracing::warn!(request_id = %ctx.id(), error = %e, "Remote prefill failed; prefilling locally");
                                Choice::Local(Reason::PrefillFailed)
                            }
                        },
                        local => local,
                    };
                    inner.count(choice);
                    Ok(req)
                }
            })
            .boxed()
    }
}

/// `dyn inspect route` on a `remote_prefill` node: whether the prompt would be prefilled
/// remotely, and why.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrefillRouteAnswer {
    pub prompt_tokens: usize,
    pub cached_on_decode_worker: usize,
    pub uncached_tokens: usize,
    pub min_remote_tokens: u32,
    pub max_queue: u64,
    pub prefill_workers: usize,
    pub decision: String,
    pub reason: String,
    /// The prefill worker the pool's router would choose (remote decisions only).
    pub prefill_worker: Option<String>,
    pub decisions: BTreeMap<String, u64>,
}

impl Inner {
    fn decisions(&self) -> BTreeMap<String, u64> {
        self.counts
            .lock()
            .iter()
            .map(|(k, v)| ((*k).to_owned(), *v))
            .collect()
    }
}

impl Inspect for Inner {
    fn inspect(&self, query: &str, args: &Value) -> Result<Value, String> {
        let to_value = |v| serde_json::to_value(v).map_err(|e: serde_json::Error| e.to_string());
        match crate::inspect::Query::parse(query, args)? {
            crate::inspect::Query::Workers => {
                let mut answer = self.pool.workers_answer();
                answer.decisions = Some(self.decisions());
                answer.queue = Some(self.queue.clone());
                to_value(json!(answer))
            }
            crate::inspect::Query::Kv(a) => to_value(json!(self.pool.kv_answer(&a)?)),
            crate::inspect::Query::Queue => Err(format!(
                "a remote_prefill node has {}; ask its route node",
                crate::inspect::NO_QUEUE
            )),
            crate::inspect::Query::Route(a) => {
                // The queue's depth is not read: an admin query does not wait on the queue's
                // server. The decision shown assumes the queue has room.
                let workers = self.pool.live().len();
                let uncached = a.tokens.len().saturating_sub(a.cached_tokens);
                let choice = decide(&self.config, uncached, workers, 0);
                let (decision, reason) = choice.labels();
                let prefill_worker = match choice {
                    Choice::Remote => Some(
                        self.pool
                            .route_answer(&a.tokens, a.lora.as_deref())?
                            .worker_id,
                    ),
                    Choice::Local(_) => None,
                };
                to_value(json!(PrefillRouteAnswer {
                    prompt_tokens: a.tokens.len(),
                    cached_on_decode_worker: a.cached_tokens,
                    uncached_tokens: uncached,
                    min_remote_tokens: self.config.min_remote_tokens,
                    max_queue: self.config.max_queue,
                    prefill_workers: workers,
                    decision: decision.into(),
                    reason: reason.into(),
                    prefill_worker,
                    decisions: self.decisions(),
                }))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reply names its worker and its agent: both must be those the job went to.
    #[test]
    fn a_reply_is_believed_only_from_the_chosen_worker_and_its_host() {
        let reply = |worker_id: u64, agent: &str| -> Prefilled {
            serde_json::from_value(json!({
                "worker_id": worker_id, "prompt_tokens": 4, "first_token": 1,
                "transfer": {"agent": agent, "transfer_id": "9", "block_ids": [0],
                    "block_bytes": 16, "layout": "token_ids", "dtype": "u32le"},
            }))
            .unwrap()
        };
        let record = |transport| Instance {
            namespace: "ns".into(),
            component: "prefill".into(),
            endpoint: "generate".into(),
            instance_id: dyn_core::InstanceId(7),
            transport,
            metadata: Default::default(),
        };
        let tcp = record(Transport::Tcp {
            address: "10.0.0.5:4100".into(),
        });
        assert!(believe(7, Some(&tcp), &reply(7, "tcp://10.0.0.5:4200")).is_ok());
        for (worker, agent) in [
            (8, "tcp://10.0.0.5:4200"),      // another worker's reply
            (7, "tcp://169.254.169.254:80"), // an agent elsewhere
            (7, "tcp://10.0.0.55:4200"),     // a host that starts alike
            (7, "inproc://1"),
        ] {
            let e = believe(7, Some(&tcp), &reply(worker, agent));
            assert!(e.is_err(), "{worker} {agent}");
        }
        assert!(believe(7, None, &reply(7, "tcp://10.0.0.5:4200")).is_err());
        let v6 = record(Transport::Tcp {
            address: "[fd00::5]:4100".into(),
        });
        assert!(believe(7, Some(&v6), &reply(7, "tcp://[fd00::5]:4200")).is_ok());
        assert!(believe(7, Some(&v6), &reply(7, "tcp://[fd00::6]:4200")).is_err());
        let local = record(Transport::InProcess);
        assert!(believe(7, Some(&local), &reply(7, "inproc://3")).is_ok());
        assert!(believe(7, Some(&local), &reply(7, "tcp://10.0.0.5:1")).is_err());
    }

    fn config() -> RemotePrefillConfig {
        RemotePrefillConfig {
            pool: "prefill".into(),
            min_remote_tokens: 512,
            max_queue: 4,
            timeout_s: 1.0,
            overlap_weight: 1.0,
        }
    }

    #[test]
    fn long_uncached_prompts_go_remote_while_the_queue_has_room() {
        let c = config();
        assert_eq!(decide(&c, 2000, 1, 0), Choice::Remote);
        assert_eq!(decide(&c, 513, 1, 3), Choice::Remote);
    }

    #[test]
    fn the_threshold_counts_only_tokens_the_decode_worker_lacks() {
        let c = config();
        assert_eq!(decide(&c, 512, 1, 0), Choice::Local(Reason::BelowThreshold));
        assert_eq!(decide(&c, 10, 1, 0), Choice::Local(Reason::BelowThreshold));
    }

    #[test]
    fn a_full_queue_keeps_prefill_local() {
        let c = config();
        assert_eq!(decide(&c, 2000, 1, 4), Choice::Local(Reason::QueueFull));
        assert_eq!(decide(&c, 2000, 3, 100), Choice::Local(Reason::QueueFull));
    }

    #[test]
    fn no_prefill_worker_falls_back_to_aggregated() {
        let c = config();
        assert_eq!(
            decide(&c, 2000, 0, 0),
            Choice::Local(Reason::NoPrefillWorker)
        );
    }

    #[test]
    fn a_prefill_failure_keeps_its_kind_across_the_wire() {
        let reply = PrefillReply {
            id: 4,
            result: Err(OpError::overloaded("the worker is busy")),
        };
        let back: PrefillReply =
            serde_json::from_slice(&serde_json::to_vec(&reply).unwrap()).unwrap();
        let e = back.result.unwrap_err();
        assert_eq!(e.kind, dyn_core::ErrorKind::Overloaded);
        assert_eq!(e.code.as_deref(), Some(dyn_core::WORKER_BUSY));
    }

    #[test]
    fn queue_names_are_subject_tokens() {
        assert_eq!(queue_name("dyn", "prefill"), "dyn_prefill");
        assert_eq!(queue_name("a.b", "p q"), "a_b_p_q");
    }
}
