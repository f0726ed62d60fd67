//! The engine loop the `decode` and `prefill` kinds run, shared by the engines: the
//! simulated [`mocker`] and the [`native`] model.
//!
//! Each worker runs its scheduler loop on a dedicated OS thread, as a real engine's busy loop
//! would: it takes new requests from a bounded queue, plans a [`scheduler`] step over the
//! paged block [`pool`], has the engine's [`Executor`] compute it, and hands each sequence's
//! new tokens to its request. A request whose consumer went away (client disconnect, stop
//! string, kill) is noticed at the next step and its blocks are freed — that is how
//! cancellation reaches the engine. KV events and load metrics go to the event plane; block
//! and request gauges go to `/metrics`. In the prefill role a finished prompt's blocks are
//! exported by the executor and offered to the transfer agent; a decode worker pulls them,
//! and its executor writes them into the blocks the scheduler gives the sequence.

pub mod mocker;
pub mod native;
pub mod pool;
pub mod scheduler;
pub mod transfer;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dyn_gpu::transfer::{BlockFormat, KvTransferAgent, TransferDescriptor};
use dyn_pipeline::{BuildCx, BuildError, OpError};
use tokio::sync::{mpsc, oneshot};

use crate::llm::kv::{
    KvCacheEvent, KvEventData, LoadMetrics, ResyncRequest, RouterEvent, kv_events_subject,
    kv_resync_subject, load_metrics_subject,
};
use crate::llm::types::{Generated, Prefilled, PreprocessedRequest};
use crate::metrics::WorkerGauges;
use pool::BlockId;
use scheduler::{Limits, Scheduler, SeqId, SeqRole, SeqSpec, Work};

/// What computes a step: the mocker's timing model, or a model on a backend.
pub trait Executor: Send + 'static {
    /// Compute the planned work; one token per [`Work`] with `sample` set, in order.
    fn execute(&mut self, work: &[Work<'_>]) -> Result<Vec<u32>, String>;
    /// The bytes of `blocks` (holding `tokens`' KV), for a prefill offer.
    fn export(&mut self, blocks: &[BlockId], tokens: &[u32]) -> Result<Vec<Bytes>, String>;
    /// Write KV pulled from a prefill worker into `blocks`.
    fn import(&mut self, blocks: &[BlockId], data: Vec<Bytes>) -> Result<(), String>;
}

/// The scheduler and queue settings every engine has.
#[derive(Debug, Clone)]
pub struct Settings {
    pub num_blocks: u32,
    pub block_size: u32,
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: u32,
    pub max_queued_requests: u32,
    pub pin_ttl_s: f64,
    /// Token ids at or above this are refused (a real model's vocabulary).
    pub vocab_size: Option<u32>,
    /// Unseeded requests are seeded by their prompt (the mocker's reproducible output)
    /// rather than at random.
    pub seed_from_prompt: bool,
}

impl Settings {
    /// The checks every engine's settings need, field names under `prefix`.
    pub fn validate(&self, prefix: &str) -> Vec<dyn_pipeline::Invalid> {
        let mut out = Vec::new();
        for (name, v) in [
            ("num_blocks", self.num_blocks),
            ("block_size", self.block_size),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_queued_requests", self.max_queued_requests),
        ] {
            if v == 0 {
                out.push(dyn_pipeline::Invalid::field(
                    format!("{prefix}{name}"),
                    "must be at least 1",
                ));
            }
        }
        if !(self.pin_ttl_s.is_finite() && self.pin_ttl_s > 0.0) {
            out.push(dyn_pipeline::Invalid::field(
                format!("{prefix}pin_ttl_s"),
                "must be a positive number",
            ));
        }
        out
    }
}

/// How a decode worker takes KV from a prefill worker: the block format it expects, the
/// modelled delay before pulling (the mocker's), and a check of the pulled bytes.
pub struct ImportCheck {
    pub format: BlockFormat,
    pub delay: Box<dyn Fn(usize) -> Duration + Send + Sync>,
    pub verify: VerifyImport,
}

/// Checks pulled blocks against the prompt they should hold.
pub type VerifyImport = Box<dyn Fn(&[Bytes], &[u32]) -> Result<(), String> + Send + Sync>;

/// A prompt's KV, pulled from a prefill worker, and the first token the prefill sampled.
pub struct ImportedKv {
    pub first_token: u32,
    pub blocks: Vec<Bytes>,
}

/// What a request's channel carries: tokens, or the engine's failure.
pub type EngineItem = Result<Generated, OpError>;

/// Where a prefill-only request's blocks went: the offer to pull them, or why there is none.
pub type OfferResult = Result<TransferDescriptor, String>;

enum Command {
    Add {
        id: SeqId,
        spec: SeqSpec,
        /// Imported KV for the sequence's blocks.
        kv: Option<Vec<Bytes>>,
        tx: mpsc::Sender<EngineItem>,
        /// Prefill role: where to send the offer of the prompt's blocks.
        offer: Option<oneshot::Sender<OfferResult>>,
    },
    /// Publish the whole cache (a router lost events).
    Dump,
}

/// A running engine worker; dropping the last handle stops its thread.
pub struct Worker {
    commands: std_mpsc::SyncSender<Command>,
    /// Requests submitted but not yet running: in the command queue or the scheduler's.
    queued: Arc<AtomicUsize>,
    settings: Settings,
    next_id: AtomicU64,
    /// Gauges of this worker (also on `/metrics`).
    pub gauges: WorkerGauges,
    /// Pulls prompts' KV from prefill workers (and offers this worker's, in the prefill role).
    agent: Arc<dyn KvTransferAgent>,
    import: ImportCheck,
    node: String,
    worker_id: u64,
}

/// Tokens a sequence produced that its consumer has not taken yet.
struct Outbox {
    tx: mpsc::Sender<EngineItem>,
    pending: Vec<u32>,
    finish: Option<crate::llm::types::FinishReason>,
    /// Prefill role: where the offer of the prompt's blocks goes.
    offer: Option<oneshot::Sender<OfferResult>>,
}

impl Outbox {
    /// Hand over what is pending; `false` when the consumer is gone.
    fn flush(&mut self) -> bool {
        if self.pending.is_empty() && self.finish.is_none() {
            return !self.tx.is_closed();
        }
        let item = Generated::Tokens {
            ids: std::mem::take(&mut self.pending),
            finish: self.finish,
        };
        match self.tx.try_send(Ok(item)) {
            Ok(()) => {
                self.finish = None;
                true
            }
            Err(mpsc::error::TrySendError::Full(Ok(Generated::Tokens { ids, .. }))) => {
                // The consumer lags: keep the tokens and send them together later.
                self.pending = ids;
                true
            }
            Err(_) => false,
        }
    }
}

impl Worker {
    /// Start the engine thread for `exec` and the tasks that carry its events.
    pub async fn start(
        config: Settings,
        import: ImportCheck,
        exec: Box<dyn Executor>,
        cx: &BuildCx,
        name: &str,
    ) -> Result<Arc<Worker>, BuildError> {
        let (commands, rx) = std_mpsc::sync_channel(config.max_queued_requests as usize);
        let worker_id = cx.instance_id;
        let gauges = WorkerGauges::new(&cx.node, worker_id);
        // Visible on /metrics from the start, not only after the first request.
        gauges.set(0, 0, 0, config.num_blocks, 0, 0, 0);
        // Events leave the engine thread through a bounded queue; if the plane cannot keep
        // up they are dropped, and consumers see the gap in event ids.
        let (events_tx, mut events_rx) = mpsc::channel::<(String, Bytes)>(4096);
        let planes = cx.planes.clone();
        tokio::spawn(async move {
            while let Some((subject, payload)) = events_rx.recv().await {
                if let Err(e) = planes.events.publish(&subject, payload).await {
                    tracing::warn!(error = %e, subject, "Cannot publish an engine event");
                }
            }
        });
        let queued = Arc::new(AtomicUsize::new(0));
        let agent = cx.service::<transfer::TransferAgent>().await?.0.clone();
        let (unpin_tx, unpin_rx) = std_mpsc::channel();
        let engine = Engine {
            agent: agent.clone(),
            pin_ttl: Duration::from_secs_f64(config.pin_ttl_s),
            pinned: HashMap::new(),
            unpin_tx,
            unpin_rx,
            queued: queued.clone(),
            received_unadmitted: 0,
            sched: Scheduler::new(
                Limits {
                    block_size: config.block_size as usize,
                    max_num_seqs: config.max_num_seqs as usize,
                    max_num_batched_tokens: config.max_num_batched_tokens as usize,
                },
                config.num_blocks,
            ),
            outboxes: HashMap::new(),
            exec,
            imports: HashMap::new(),
            format: import.format.clone(),
            worker_id,
            event_id: 0,
            kv_subject: kv_events_subject(&cx.namespace, &cx.node),
            load_subject: load_metrics_subject(&cx.namespace, &cx.node),
            events: events_tx,
            gauges: gauges.clone(),
            last_load: None,
        };
        // Routers that lost events ask for a full dump; the engine publishes it in order
        // with its other events.
        let mut resync = cx
            .planes
            .events
            .subscribe(&kv_resync_subject(&cx.namespace, &cx.node))
            .await
            .map_err(|e| BuildError::new(format!("cannot subscribe to resync requests: {e}")))?;
        std::thread::Builder::new()
            .name(format!("{name}-{}", cx.replica))
            .spawn(move || engine.run(rx))
            .map_err(|e| BuildError::new(format!("cannot start the {name} thread: {e}")))?;
        let worker = Arc::new(Worker {
            commands,
            queued,
            settings: config,
            next_id: AtomicU64::new(1),
            gauges,
            agent,
            import,
            node: cx.node.clone(),
            worker_id,
        });
        // Weak: the engine thread stops when the last handle goes, and this task must not be
        // one.
        let weak = Arc::downgrade(&worker);
        tokio::spawn(async move {
            use futures::StreamExt;
            while let Some(ev) = resync.next().await {
                let Some(m) = weak.upgrade() else { break };
                let Ok(req) = serde_json::from_slice::<ResyncRequest>(&ev.payload) else {
                    tracing::warn!("Ignoring a malformed KV resync request");
                    continue;
                };
                // A full command queue drops the request; the router asks again.
                if req.worker_id == worker_id && m.commands.try_send(Command::Dump).is_err() {
                    tracing::warn!("Engine busy; KV resync request dropped");
                }
            }
        });
        Ok(worker)
    }

    /// Queue a request; its tokens arrive on the returned channel. `kv`: the prompt's KV
    /// imported from a prefill worker (decode role), or none (aggregated).
    pub fn submit(
        &self,
        req: &PreprocessedRequest,
        kv: Option<ImportedKv>,
    ) -> Result<mpsc::Receiver<EngineItem>, OpError> {
        match kv {
            Some(kv) => self.enqueue(
                req,
                SeqRole::Imported {
                    first_token: kv.first_token,
                },
                Some(kv.blocks),
                None,
            ),
            None => self.enqueue(req, SeqRole::Full, None, None),
        }
    }

    /// Receive the KV a prefill worker computed for `req`: the modelled transfer time (if
    /// any) passes first and then the blocks are pulled through the transfer agent, so a
    /// prefill worker lost during the transfer fails the pull (as a read from a dead peer
    /// would). `None` when the transfer failed or does not match the prompt: the request is
    /// then prefilled here.
    pub async fn import(&self, req: &PreprocessedRequest, p: &Prefilled) -> Option<ImportedKv> {
        let started = Instant::now();
        let want = &self.import.format;
        let result = async {
            if p.prompt_tokens as usize != req.token_ids.len()
                || p.transfer.block_bytes != want.block_bytes
                || p.transfer.layout != want.layout
                || p.transfer.dtype != want.dtype
            {
                return Err(format!(
                    "the offer covers {} tokens in blocks of {} bytes ({}, {}); this worker has a {}-token prompt and blocks of {} bytes ({}, {})",
                    p.prompt_tokens,
                    p.transfer.block_bytes,
                    p.transfer.layout,
                    p.transfer.dtype,
                    req.token_ids.len(),
                    want.block_bytes,
                    want.layout,
                    want.dtype,
                ));
            }
            tokio::time::sleep((self.import.delay)(req.token_ids.len())).await;
            let blocks = self.agent.pull(&p.transfer).await.map_err(|e| e.to_string())?;
            let bs = self.settings.block_size as usize;
            if blocks.len() != req.token_ids.len().div_ceil(bs) {
                return Err(format!(
                    "{} blocks pulled for a {}-token prompt",
                    blocks.len(),
                    req.token_ids.len()
                ));
            }
            (self.import.verify)(&blocks, &req.token_ids)?;
            Ok(blocks)
        }
        .await;
        let id = format!("{:x}", self.worker_id);
        let m = &crate::metrics::DISAGG;
        match result {
            Ok(blocks) => {
                m.transfers
                    .with_label_values(&[self.node.as_str(), &id, "pulled"])
                    .inc();
                m.transfer_seconds
                    .with_label_values(&[self.node.as_str()])
                    .observe(started.elapsed().as_secs_f64());
                Some(ImportedKv {
                    first_token: p.first_token,
                    blocks,
                })
            }
            Err(e) => {
                m.transfers
                    .with_label_values(&[self.node.as_str(), &id, "failed"])
                    .inc();
                tracing::warn!(worker_id = %id, prefill_worker = format_args!("{:x}", p.worker_id), error = %e, "KV transfer failed; prefilling locally");
                None
            }
        }
    }

    /// Queue a prefill-only request: its first token arrives on the first channel, the offer
    /// of its prompt's KV blocks on the second.
    pub fn submit_prefill(
        &self,
        req: &PreprocessedRequest,
    ) -> Result<(mpsc::Receiver<EngineItem>, oneshot::Receiver<OfferResult>), OpError> {
        let (otx, orx) = oneshot::channel();
        Ok((self.enqueue(req, SeqRole::Prefill, None, Some(otx))?, orx))
    }

    fn enqueue(
        &self,
        req: &PreprocessedRequest,
        role: SeqRole,
        kv: Option<Vec<Bytes>>,
        offer: Option<oneshot::Sender<OfferResult>>,
    ) -> Result<mpsc::Receiver<EngineItem>, OpError> {
        if req.token_ids.is_empty() {
            return Err(OpError::invalid("the prompt has no tokens"));
        }
        if let Some(vocab) = self.settings.vocab_size
            && let Some(t) = req.token_ids.iter().find(|t| **t >= vocab)
        {
            return Err(OpError::invalid(format!(
                "token id {t} is outside the model's vocabulary ({vocab} tokens)"
            )));
        }
        let blocks = req
            .token_ids
            .len()
            .div_ceil(self.settings.block_size as usize);
        if blocks > self.settings.num_blocks as usize {
            return Err(OpError::invalid(format!(
                "the prompt needs {blocks} KV blocks; this worker has {}",
                self.settings.num_blocks
            )));
        }
        let (tx, rx) = mpsc::channel(64);
        // A migrated request carries the tokens already generated after its prompt; seeding
        // by the original prompt and counting positions from it makes it continue exactly.
        let prompt_len = (req.output.prompt_tokens as usize).min(req.token_ids.len());
        let prompt_len = if prompt_len == 0 {
            req.token_ids.len()
        } else {
            prompt_len
        };
        let seed = req.sampling.seed.unwrap_or_else(|| {
            if self.settings.seed_from_prompt {
                crate::llm::kv::local_hash(&req.token_ids[..prompt_len])
            } else {
                rand::random()
            }
        });
        let s = &req.sampling;
        let spec = SeqSpec {
            prompt: req.token_ids.clone(),
            max_tokens: req.stop.max_tokens,
            stop_tokens: if req.stop.ignore_eos {
                Vec::new().into()
            } else {
                req.stop.eos_token_ids.clone().into()
            },
            min_tokens: req.stop.min_tokens,
            sampling: dyn_gpu::sample::SamplingParams {
                temperature: s.temperature.unwrap_or(1.0),
                top_k: s.top_k.unwrap_or(0) as usize,
                top_p: s.top_p.unwrap_or(1.0),
                seed,
            },
            offset: u32::try_from(req.token_ids.len() - prompt_len).unwrap_or(u32::MAX),
            role,
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let max_queued = self.settings.max_queued_requests as usize;
        if self.queued.fetch_add(1, Ordering::AcqRel) >= max_queued {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(OpError::unavailable(format!(
                "the worker is busy: {max_queued} requests are already waiting"
            ))
            .with_code("worker_busy"));
        }
        match self.commands.try_send(Command::Add {
            id,
            spec,
            kv,
            tx,
            offer,
        }) {
            Ok(()) => Ok(rx),
            Err(e) => {
                self.queued.fetch_sub(1, Ordering::AcqRel);
                Err(OpError::unavailable(match e {
                    std_mpsc::TrySendError::Full(_) => "the engine's request queue is full",
                    std_mpsc::TrySendError::Disconnected(_) => "the engine has stopped",
                }))
            }
        }
    }
}

/// Sent back to the engine when an offer ends (pulled, expired or dropped).
struct Unpin {
    tx: std_mpsc::Sender<SeqId>,
    id: SeqId,
}

impl Drop for Unpin {
    fn drop(&mut self) {
        let _ = self.tx.send(self.id);
    }
}

/// While blocks are pinned an idle engine wakes this often to release them.
const PIN_POLL: Duration = Duration::from_millis(5);

struct Engine {
    agent: Arc<dyn KvTransferAgent>,
    pin_ttl: Duration,
    /// Blocks of finished prefill-only requests, until pulled or the TTL passes.
    pinned: HashMap<SeqId, (Vec<BlockId>, Instant)>,
    unpin_tx: std_mpsc::Sender<SeqId>,
    unpin_rx: std_mpsc::Receiver<SeqId>,
    queued: Arc<AtomicUsize>,
    /// What this thread last counted in `queued` for requests it received.
    received_unadmitted: usize,
    sched: Scheduler,
    outboxes: HashMap<SeqId, Outbox>,
    exec: Box<dyn Executor>,
    /// KV pulled for sequences not yet admitted.
    imports: HashMap<SeqId, Vec<Bytes>>,
    /// How exported blocks are described to the transfer agent.
    format: BlockFormat,
    worker_id: u64,
    event_id: u64,
    kv_subject: String,
    load_subject: String,
    events: mpsc::Sender<(String, Bytes)>,
    gauges: WorkerGauges,
    last_load: Option<((u32, u32, u32), Instant)>,
}

/// Load metrics are published when they change, at most this often (and always on idle).
const LOAD_INTERVAL: Duration = Duration::from_millis(50);

impl Engine {
    fn run(mut self, rx: std_mpsc::Receiver<Command>) {
        tracing::debug!(
            worker_id = format_args!("{:x}", self.worker_id),
            "Engine started"
        );
        // Routers and `dyn inspect` see the worker's capacity before its first request.
        self.publish();
        loop {
            // Idle: block until work arrives (or every handle is gone).
            if self.sched.is_idle() && self.outboxes.is_empty() {
                if self.pinned.is_empty() {
                    match rx.recv() {
                        Ok(cmd) => self.command(cmd),
                        Err(_) => break,
                    }
                } else {
                    match rx.recv_timeout(PIN_POLL) {
                        Ok(cmd) => self.command(cmd),
                        Err(std_mpsc::RecvTimeoutError::Timeout) => {}
                        Err(std_mpsc::RecvTimeoutError::Disconnected) => break,
                    }
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                self.command(cmd);
            }
            self.reap_cancelled();
            self.unpin();
            let (exec, imports) = (&mut self.exec, &mut self.imports);
            let stepped = self.sched.step(|work| {
                for w in work.iter().filter(|w| w.import) {
                    if let Some(mut data) = imports.remove(&w.id) {
                        let skip = w.import_skip.min(data.len());
                        let blocks = &w.blocks[skip.min(w.blocks.len())..];
                        exec.import(blocks, data.split_off(skip))?;
                    }
                }
                exec.execute(work)
            });
            let mut out = match stepped {
                Ok(out) => out,
                Err((e, ids)) => {
                    self.fail(&e, &ids);
                    continue;
                }
            };
            if out.prefill_tokens == 0 && out.decode_seqs == 0 && out.tokens.is_empty() {
                // Nothing could run (waiting for blocks, or only undelivered output).
                std::thread::sleep(Duration::from_millis(1));
            }
            for (id, token, finish) in out.tokens {
                if let Some(o) = self.outboxes.get_mut(&id) {
                    o.pending.push(token);
                    o.finish = finish;
                }
            }
            for id in std::mem::take(&mut out.ended) {
                if let Some(o) = self.outboxes.get_mut(&id) {
                    o.finish = Some(crate::llm::types::FinishReason::Length);
                }
            }
            for (id, blocks, tokens) in std::mem::take(&mut out.pinned) {
                self.offer(id, blocks, &tokens);
            }
            self.deliver();
            self.account();
            self.publish();
        }
        tracing::debug!(
            worker_id = format_args!("{:x}", self.worker_id),
            "Engine stopped"
        );
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Add {
                id,
                spec,
                kv,
                tx,
                offer,
            } => {
                // Counted in `queued` by `submit`; it stays counted while the scheduler holds
                // it unadmitted, and is released in `account`.
                self.received_unadmitted += 1;
                self.sched.add(id, spec);
                if let Some(kv) = kv {
                    self.imports.insert(id, kv);
                }
                self.outboxes.insert(
                    id,
                    Outbox {
                        tx,
                        pending: Vec::new(),
                        finish: None,
                        offer,
                    },
                );
            }
            Command::Dump => {
                let events = self.sched.pool.dump();
                tracing::debug!(
                    worker_id = format_args!("{:x}", self.worker_id),
                    events = events.len(),
                    "Publishing a full KV dump"
                );
                self.publish_kv(events);
            }
        }
    }

    /// Offer a finished prefill's blocks to the transfer agent; they stay pinned until the
    /// offer ends.
    fn offer(&mut self, id: SeqId, blocks: Vec<BlockId>, tokens: &[u32]) {
        let reply = match self.outboxes.get_mut(&id).and_then(|o| o.offer.take()) {
            Some(r) if !r.is_closed() => r,
            _ => {
                // Nobody waits for this offer any more.
                self.release(&blocks);
                return;
            }
        };
        let payloads = match self.exec.export(&blocks, tokens) {
            Ok(p) => p,
            Err(e) => {
                self.release(&blocks);
                let _ = reply.send(Err(e));
                return;
            }
        };
        let hold = Unpin {
            tx: self.unpin_tx.clone(),
            id,
        };
        match self.agent.offer_held(
            blocks.clone(),
            payloads,
            self.format.clone(),
            self.pin_ttl,
            Some(Box::new(hold)),
        ) {
            Ok(desc) => {
                self.pinned
                    .insert(id, (blocks, Instant::now() + self.pin_ttl));
                let _ = reply.send(Ok(desc));
            }
            Err(e) => {
                self.release(&blocks);
                let _ = reply.send(Err(e.to_string()));
            }
        }
    }

    fn release(&mut self, blocks: &[BlockId]) {
        for b in blocks {
            self.sched.pool.release(*b);
        }
    }

    /// Release the blocks of offers that ended, and of those past their TTL.
    fn unpin(&mut self) {
        let mut done: Vec<SeqId> = self.unpin_rx.try_iter().collect();
        let now = Instant::now();
        done.extend(
            self.pinned
                .iter()
                .filter(|(_, (_, until))| *until <= now)
                .map(|(id, _)| *id),
        );
        for id in done {
            if let Some((blocks, _)) = self.pinned.remove(&id) {
                self.release(&blocks);
            }
        }
    }

    /// Release from `queued` the requests that started running (or left) since last time.
    fn account(&mut self) {
        let now = self.sched.unadmitted();
        if now < self.received_unadmitted {
            self.queued
                .fetch_sub(self.received_unadmitted - now, Ordering::AcqRel);
        }
        self.received_unadmitted = now;
    }

    /// A step failed (a backend error): end the requests it held with the error.
    fn fail(&mut self, e: &str, ids: &[SeqId]) {
        tracing::error!(
            worker_id = format_args!("{:x}", self.worker_id),
            error = %e,
            requests = ids.len(),
            "Engine step failed; ending its requests"
        );
        for id in ids {
            self.sched.remove(*id);
            self.imports.remove(id);
            if let Some(o) = self.outboxes.remove(id) {
                let _ =
                    o.tx.try_send(Err(OpError::internal(format!("the engine failed: {e}"))));
            }
        }
    }

    /// Requests whose consumer went away: free their blocks.
    fn reap_cancelled(&mut self) {
        let gone: Vec<SeqId> = self
            .outboxes
            .iter()
            .filter(|(_, o)| o.tx.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.outboxes.remove(&id);
            self.imports.remove(&id);
            if self.sched.remove(id) {
                tracing::debug!(
                    worker_id = format_args!("{:x}", self.worker_id),
                    seq = id,
                    "Request cancelled; its blocks are freed"
                );
            }
        }
    }

    fn deliver(&mut self) {
        let mut done = Vec::new();
        for (id, o) in &mut self.outboxes {
            let finishing = o.finish.is_some();
            let ok = o.flush();
            if !ok {
                done.push((*id, true));
            } else if finishing && o.finish.is_none() {
                done.push((*id, false));
            }
        }
        for (id, cancelled) in done {
            self.outboxes.remove(&id);
            if cancelled {
                self.sched.remove(id);
            }
        }
    }

    fn publish_kv(&mut self, events: Vec<KvEventData>) {
        for data in events {
            let ev = RouterEvent {
                worker_id: self.worker_id,
                event: KvCacheEvent {
                    event_id: self.event_id,
                    dp_rank: 0,
                    data,
                },
            };
            self.event_id += 1;
            self.send(self.kv_subject.clone(), &ev);
        }
    }

    fn publish(&mut self) {
        let events = self.sched.pool.take_events();
        self.publish_kv(events);
        let (running, waiting) = (self.sched.running() as u32, self.sched.waiting() as u32);
        let active = self.sched.pool.active();
        let c = self.sched.counters;
        self.gauges.set(
            running,
            waiting,
            active,
            self.sched.pool.total(),
            c.prompt_blocks,
            c.prompt_blocks_hit,
            c.preemptions,
        );
        let now = (running, waiting, active);
        let due = match self.last_load {
            None => true,
            Some((last, at)) => {
                last != now && (at.elapsed() >= LOAD_INTERVAL || running + waiting == 0)
            }
        };
        if due {
            self.last_load = Some((now, Instant::now()));
            let m = LoadMetrics {
                worker_id: self.worker_id,
                requests_running: running,
                requests_waiting: waiting,
                kv_active_blocks: active,
                kv_total_blocks: self.sched.pool.total(),
                prefix_cache_hit_rate: if c.prompt_blocks == 0 {
                    0.0
                } else {
                    c.prompt_blocks_hit as f64 / c.prompt_blocks as f64
                },
                block_size: self.sched.block_size() as u32,
            };
            self.send(self.load_subject.clone(), &m);
        }
    }

    fn send(&self, subject: String, value: &impl serde::Serialize) {
        match serde_json::to_vec(value) {
            Ok(bytes) => {
                if self.events.try_send((subject, Bytes::from(bytes))).is_err() {
                    tracing::warn!("Engine event queue is full; dropping an event");
                }
            }
            Err(e) => tracing::error!(error = %e, "Cannot encode an engine event"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::kv::KvEventData;
    use dyn_pipeline::planes::Planes;
    use futures::StreamExt;

    async fn run(m: &Worker, req: &PreprocessedRequest) -> Vec<u32> {
        let mut rx = m.submit(req, None).expect("submitted");
        let mut out = Vec::new();
        while let Some(Ok(Generated::Tokens { ids, finish })) = rx.recv().await {
            out.extend(ids);
            if finish.is_some() {
                break;
            }
        }
        out
    }

    #[tokio::test]
    async fn publishes_kv_events_with_consecutive_ids_and_load_metrics() {
        let planes = Planes::embedded();
        let mut events = planes
            .events
            .subscribe("dyn.ns.decode.kv_events")
            .await
            .expect("sub");
        let mut load = planes
            .events
            .subscribe("dyn.ns.decode.load_metrics")
            .await
            .expect("sub");
        // Two blocks of 16: a 40-token prompt fills two and the answer fills more.
        let config = mocker::MockerConfig {
            num_blocks: 4,
            speedup: 1000.0,
            ..mocker::MockerConfig::default()
        };
        let m = mocker::start(&config, &crate::testing::cx("decode", 0xabc, &[], &planes))
            .await
            .expect("starts");
        let a = run(&m, &crate::testing::preprocessed((0..40).collect(), 10)).await;
        assert_eq!(a.len(), 10);
        // Same seed and prompt again: same output, and the prompt's blocks come from the cache.
        assert_eq!(
            run(&m, &crate::testing::preprocessed((0..40).collect(), 10)).await,
            a
        );
        // A different prompt needs the blocks back: the cached ones are evicted.
        run(&m, &crate::testing::preprocessed((100..140).collect(), 10)).await;

        let mut seen = Vec::new();
        while seen.len() < 3 {
            let e = tokio::time::timeout(Duration::from_secs(5), events.next())
                .await
                .expect("event")
                .expect("open");
            let ev: RouterEvent = serde_json::from_slice(&e.payload).expect("json");
            assert_eq!(ev.worker_id, 0xabc);
            seen.push(ev.event);
        }
        let ids: Vec<u64> = seen.iter().map(|e| e.event_id).collect();
        assert_eq!(ids, [0, 1, 2]);
        let KvEventData::Stored {
            parent_hash: None,
            blocks,
        } = &seen[0].data
        else {
            panic!("first event stores the prompt's blocks: {:?}", seen[0]);
        };
        let expected = crate::llm::kv::block_hashes(&(0..40).collect::<Vec<_>>(), 16);
        assert_eq!(blocks[..2], expected[..]);
        assert!(
            seen.iter()
                .any(|e| matches!(e.data, KvEventData::Removed { .. })),
            "{seen:?}"
        );

        let l = tokio::time::timeout(Duration::from_secs(5), load.next())
            .await
            .expect("metrics")
            .expect("open");
        let l: LoadMetrics = serde_json::from_slice(&l.payload).expect("json");
        assert_eq!((l.worker_id, l.kv_total_blocks), (0xabc, 4));
        // The gauges are set after the last token is handed out: give the engine a moment.
        for _ in 0..500 {
            if m.gauges.active_blocks() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(m.gauges.active_blocks() == 0);
        assert_eq!(l.block_size, 16);

        // A router that lost events asks for a dump: cleared, then what the cache holds, with
        // the event ids carrying on.
        let req = serde_json::to_vec(&ResyncRequest { worker_id: 0xabc }).expect("json");
        planes
            .events
            .publish("dyn.ns.decode.kv_resync", req.into())
            .await
            .expect("publish");
        let mut dump = Vec::new();
        loop {
            let e = tokio::time::timeout(Duration::from_secs(5), events.next())
                .await
                .expect("event")
                .expect("open");
            let ev: RouterEvent = serde_json::from_slice(&e.payload).expect("json");
            if ev.event.data == KvEventData::Cleared {
                dump.push(ev.event);
                break;
            }
        }
        while let Ok(Some(e)) =
            tokio::time::timeout(Duration::from_millis(200), events.next()).await
        {
            let ev: RouterEvent = serde_json::from_slice(&e.payload).expect("json");
            dump.push(ev.event);
        }
        assert!(dump.len() >= 2, "{dump:?}");
        for w in dump.windows(2) {
            assert_eq!(w[1].event_id, w[0].event_id + 1);
        }
        let mut ix = crate::llm::route::indexer::Indexer::new();
        for e in &dump {
            assert_eq!(ix.apply(0xabc, e), crate::llm::route::indexer::Applied::Ok);
        }
        // The last prompt's first two blocks are what the cache holds now.
        let last = crate::llm::kv::block_hashes(&(100..140).collect::<Vec<_>>(), 16);
        let seqs: Vec<u64> = last.iter().map(|b| b.block_hash).collect();
        assert_eq!(ix.find_matches(&seqs), vec![(0xabc, 2)]);
    }
}
