//! The engine thread: the busy loop a real engine runs. It takes new requests from a bounded
//! queue, plans a [`scheduler`](super::scheduler) step over the paged block pool, has the
//! [`Executor`] compute it, hands each sequence's new tokens to its request, offers finished
//! prefills' blocks to the transfer agent, and publishes KV events and load metrics. A request
//! whose consumer went away is noticed at the next step and its blocks are freed.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dyn_compute::transfer::{BlockFormat, KvTransferAgent};
use dyn_core::OpError;
use dyn_protocol::kv::{LoadMetrics, Medium, dump_events};
use dyn_protocol::types::{Generated, Logprobs, TokenLogprob};
use tokio::sync::mpsc;

use super::command::{Command, EngineItem, OfferTo};
use super::events::KvPublisher;
use super::offload::{Meta, Tiers};
use super::pool::{BlockId, Evicted};
use super::scheduler::{Scheduler, SeqId};
use super::step_model::StepModel;
use super::{EngineError, Executor, Logprob};
use crate::metrics::{TierGauges, WorkerGauges};

/// Tokens a sequence produced that its consumer has not taken yet.
pub(super) struct Outbox {
    tx: mpsc::Sender<EngineItem>,
    pending: Vec<u32>,
    /// With `logprobs`: one per pending token.
    logprobs: Vec<TokenLogprob>,
    /// With `prompt_logprobs`: the prompt's first token and the log-probabilities of the
    /// others as the executor computes them (chunk by chunk; a recompute writes the same
    /// values again), sent once, with the first tokens.
    prompt: Option<(u32, Vec<Option<TokenLogprob>>)>,
    finish: Option<dyn_protocol::types::FinishReason>,
    /// Prefill role: where the offer of the prompt's blocks goes.
    offer: Option<OfferTo>,
    /// An embeddings request: no token goes out, its vector does, with its finish.
    embeds: bool,
    embedding: Option<Vec<f32>>,
}

impl Outbox {
    pub(super) fn new(
        tx: mpsc::Sender<EngineItem>,
        spec: &crate::scheduler::SeqSpec,
        offer: Option<OfferTo>,
    ) -> Self {
        let prompt_len = spec.prompt_len();
        let prompt = match (spec.prompt_logprobs, spec.prompt.first()) {
            (Some(_), Some(&first)) if spec.offset == 0 => {
                Some((first, vec![None; prompt_len.saturating_sub(1)]))
            }
            _ => None,
        };
        Outbox {
            tx,
            pending: Vec::new(),
            logprobs: Vec::new(),
            prompt,
            finish: None,
            offer,
            embeds: spec.embed.is_some(),
            embedding: None,
        }
    }

    fn record(&mut self, lp: Logprob) {
        match lp {
            Logprob::Sampled(t) => self.logprobs.push(t),
            Logprob::Prompt { at, items } => {
                if let Some((_, slots)) = &mut self.prompt {
                    for (i, t) in items.into_iter().enumerate() {
                        if let Some(slot) = (at + i).checked_sub(1).and_then(|j| slots.get_mut(j)) {
                            *slot = Some(t);
                        }
                    }
                }
            }
        }
    }

    /// The log-probabilities to send with the pending tokens.
    fn take_logprobs(&mut self) -> Option<Box<Logprobs>> {
        let mut l = Logprobs {
            tokens: std::mem::take(&mut self.logprobs),
            ..Logprobs::default()
        };
        // Only a whole prompt's (a sequence ended mid-prefill has gaps: it sends none).
        if let Some((first, slots)) = self.prompt.take()
            && let Some(all) = slots.into_iter().collect::<Option<Vec<_>>>()
        {
            l.prompt_first = Some(first);
            l.prompt = all;
        }
        (l.prompt_first.is_some() || !l.tokens.is_empty()).then(|| Box::new(l))
    }

    /// Hand over what is pending; `false` when the consumer is gone.
    fn flush(&mut self) -> bool {
        if self.pending.is_empty() && self.finish.is_none() {
            return !self.tx.is_closed();
        }
        let item = Generated::Tokens {
            ids: std::mem::take(&mut self.pending),
            finish: self.finish,
            logprobs: self.take_logprobs(),
            embedding: self.embedding.take(),
        };
        match self.tx.try_send(Ok(item)) {
            Ok(()) => {
                self.finish = None;
                true
            }
            Err(mpsc::error::TrySendError::Full(Ok(Generated::Tokens {
                ids,
                logprobs,
                embedding,
                ..
            }))) => {
                // The consumer lags: keep the tokens and send them together later.
                self.pending = ids;
                self.embedding = embedding;
                if let Some(l) = logprobs {
                    self.logprobs = l.tokens;
                    if let Some(first) = l.prompt_first {
                        self.prompt = Some((first, l.prompt.into_iter().map(Some).collect()));
                    }
                }
                true
            }
            Err(_) => false,
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

pub(super) struct EngineLoop {
    pub(super) agent: Arc<dyn KvTransferAgent>,
    pub(super) pin_ttl: Duration,
    /// Blocks of finished prefill-only requests, until pulled or the TTL passes.
    pub(super) pinned: HashMap<SeqId, (Vec<BlockId>, Instant)>,
    pub(super) unpin_tx: std_mpsc::Sender<SeqId>,
    pub(super) unpin_rx: std_mpsc::Receiver<SeqId>,
    pub(super) queued: Arc<AtomicUsize>,
    /// What this thread last counted in `queued` for requests it received.
    pub(super) received_unadmitted: usize,
    pub(super) sched: Scheduler,
    pub(super) outboxes: HashMap<SeqId, Outbox>,
    pub(super) exec: Box<dyn Executor>,
    /// KV pulled for sequences not yet admitted.
    pub(super) imports: HashMap<SeqId, Vec<Bytes>>,
    /// How exported blocks are described to the transfer agent.
    pub(super) format: BlockFormat,
    pub(super) worker_id: u64,
    pub(super) kv: Arc<KvPublisher>,
    /// Offload tiers below the pool, if configured, and their series on `/metrics`.
    pub(super) tiers: Option<(Arc<Tiers>, TierGauges)>,
    pub(super) load_subject: String,
    pub(super) events: mpsc::Sender<(String, Bytes)>,
    pub(super) gauges: WorkerGauges,
    pub(super) last_load: Option<((u32, u32, u32), Instant)>,
    /// Step times, for the speed the load metrics report.
    pub(super) step_model: StepModel,
    /// The runtime the handle was started on: errors a lagging consumer has no room for are
    /// sent from there, never dropped (a channel closed without one reads as a lost engine).
    pub(super) runtime: tokio::runtime::Handle,
}

/// Load metrics are published when they change, at most this often (and always on idle).
const LOAD_INTERVAL: Duration = Duration::from_millis(50);

impl EngineLoop {
    /// Serve until every handle is gone. By `&mut self`: after a panic the caller still holds
    /// the loop, and so its requests' channels, until the replica is marked failed.
    pub(super) fn run(&mut self, rx: std_mpsc::Receiver<Command>) {
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
            let tiers = self.tiers.as_ref().map(|(t, _)| t);
            let started = Instant::now();
            let stepped = self.sched.step(|work, evicted| {
                // Evicted blocks leave before anything is written over them.
                if let Some(t) = tiers {
                    offload(t, exec.as_mut(), evicted);
                }
                for w in work.iter().filter(|w| w.import) {
                    if let Some(mut data) = imports.remove(&w.id) {
                        let skip = w.import_skip.min(data.len());
                        let blocks = &w.blocks[skip.min(w.blocks.len())..];
                        exec.import(blocks, data.split_off(skip))?;
                    }
                }
                for w in work.iter().filter(|w| !w.onboard.is_empty()) {
                    let end = (w.onboard_at + w.onboard.len()).min(w.blocks.len());
                    exec.onboard(&w.blocks[w.onboard_at..end], w.onboard.to_vec())?;
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
            } else {
                let ms = started.elapsed().as_secs_f64() * 1e3;
                self.step_model.observe(out.prefill_tokens, ms);
            }
            for (id, token, finish) in out.tokens {
                if let Some(o) = self.outboxes.get_mut(&id) {
                    if !o.embeds {
                        o.pending.push(token);
                    }
                    o.finish = finish;
                }
            }
            for (id, v) in self.exec.take_embeddings() {
                if let Some(o) = self.outboxes.get_mut(&id) {
                    o.embedding = Some(v);
                }
            }
            for (id, lp) in self.exec.take_logprobs() {
                if let Some(o) = self.outboxes.get_mut(&id) {
                    o.record(lp);
                }
            }
            for id in std::mem::take(&mut out.ended) {
                if let Some(o) = self.outboxes.get_mut(&id) {
                    o.finish = Some(dyn_protocol::types::FinishReason::Length);
                }
            }
            for (id, blocks, tokens) in std::mem::take(&mut out.pinned) {
                self.offer(id, blocks, &tokens);
            }
            // Requests admitted by this step leave the queue count before their first tokens
            // go out: a client that sees its tokens and sends again finds the room it left.
            self.account();
            self.deliver();
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
                let outbox = Outbox::new(tx, &spec, offer);
                self.sched.add(id, *spec);
                if let Some(kv) = kv {
                    self.imports.insert(id, kv);
                }
                self.outboxes.insert(id, outbox);
            }
            Command::Dump => {
                let g1 = self
                    .sched
                    .pool
                    .held()
                    .map(|(h, p, t)| (Medium::Gpu, h, p, t));
                let lower = self
                    .tiers
                    .as_ref()
                    .map(|(t, _)| t.held())
                    .unwrap_or_default();
                let events = dump_events(g1.chain(lower));
                tracing::debug!(
                    worker_id = format_args!("{:x}", self.worker_id),
                    events = events.len(),
                    "Publishing a full KV dump"
                );
                self.kv.publish_mixed(events);
            }
        }
    }

    /// Offer a finished prefill's blocks to the transfer agent; they stay pinned until the
    /// offer ends.
    fn offer(&mut self, id: SeqId, blocks: Vec<BlockId>, tokens: &[u32]) {
        let (reply, lock) = match self.outboxes.get_mut(&id).and_then(|o| o.offer.take()) {
            Some(OfferTo { reply, lock }) if !reply.is_closed() => (reply, lock),
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
            lock,
        ) {
            Ok(desc) => {
                self.pinned
                    .insert(id, (blocks, Instant::now() + self.pin_ttl));
                let _ = reply.send(Ok(desc));
            }
            Err(e) => {
                self.release(&blocks);
                let _ = reply.send(Err(e.into()));
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
    fn fail(&mut self, e: &EngineError, ids: &[SeqId]) {
        tracing::error!(
            worker_id = format_args!("{:x}", self.worker_id),
            error = %e,
            requests = ids.len(),
            "Engine step failed; ending its requests"
        );
        for id in ids {
            self.sched.remove(*id);
            self.imports.remove(id);
            self.exec.forget(*id);
            if let Some(o) = self.outboxes.remove(id) {
                let err = Err(OpError::internal(format!("the engine failed: {e}")));
                if let Err(mpsc::error::TrySendError::Full(err)) = o.tx.try_send(err) {
                    self.runtime.spawn(async move {
                        let _ = o.tx.send(err).await;
                    });
                }
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
            self.exec.forget(id);
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
            self.exec.forget(id);
            if cancelled {
                self.sched.remove(id);
            }
        }
    }

    fn publish(&mut self) {
        self.kv.publish(Medium::Gpu, self.sched.pool.take_events());
        let (running, waiting) = (self.sched.running() as u32, self.sched.waiting() as u32);
        let active = self.sched.pool.active();
        let c = self.sched.counters;
        self.gauges
            .set(running, waiting, active, self.sched.pool.total(), &c);
        if let Some((t, gauges)) = &self.tiers {
            gauges.set(&t.counts());
        }
        let now = (running, waiting, active);
        let due = match self.last_load {
            None => true,
            Some((last, at)) => {
                last != now && (at.elapsed() >= LOAD_INTERVAL || running + waiting == 0)
            }
        };
        if due {
            self.last_load = Some((now, Instant::now()));
            let (step_ms, prefill_ms_per_token) = self.step_model.fit();
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
                pending_prefill_tokens: self.sched.pending_prefill_tokens() as u64,
                step_ms,
                prefill_ms_per_token,
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

/// Copy evicted blocks out for the offload tiers (those host memory lacks), before the step
/// writes over them. A failed copy loses the blocks, not the step.
fn offload(tiers: &Tiers, exec: &mut dyn Executor, evicted: &[Evicted]) {
    let fresh = tiers.lacking(evicted, |e| e.hash);
    if fresh.is_empty() {
        return;
    }
    let ids: Vec<BlockId> = fresh.iter().map(|e| e.id).collect();
    let hashes: Vec<u64> = fresh.iter().map(|e| e.hash).collect();
    match exec.export_cached(&ids, &hashes) {
        Ok(data) => tiers.offload(
            fresh
                .iter()
                .zip(data)
                .map(|(e, d)| {
                    let meta = Meta {
                        parent: e.parent,
                        tokens_hash: e.tokens_hash,
                    };
                    (e.hash, meta, d)
                })
                .collect(),
        ),
        Err(e) => {
            tracing::warn!(error = %e, blocks = ids.len(), "Cannot copy evicted KV blocks out; dropped")
        }
    }
}
