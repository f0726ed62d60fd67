//! The `mocker` engine: a simulated vLLM-style engine for routing, scale and framework tests
//! without GPUs.
//!
//! Each worker runs its scheduler loop on a dedicated OS thread, as a real engine's busy loop
//! would: it takes new requests from a bounded queue, runs a [`scheduler`] step, sleeps for
//! the step's simulated duration ([`Timing`], divided by `speedup`) and hands each sequence's
//! new tokens to its request. A request whose consumer went away (client disconnect, stop
//! string, kill) is noticed at the next step and its blocks are freed. KV events and load
//! metrics go to the event plane; block and request gauges go to `/metrics`.

pub mod pool;
pub mod scheduler;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dyn_pipeline::{BuildCx, BuildError, Invalid, OpError};
use serde::Deserialize;
use tokio::sync::mpsc;

use crate::llm::kv::{
    KvCacheEvent, KvEventData, LoadMetrics, ResyncRequest, RouterEvent, kv_events_subject,
    kv_resync_subject, load_metrics_subject,
};
use crate::llm::model::ModelDir;
use crate::llm::types::{Generated, PreprocessedRequest};
use crate::metrics::WorkerGauges;
use scheduler::{Limits, Scheduler, SeqId, SeqSpec};

/// `config.mocker` of `decode` with `engine: mocker`. Defaults resemble a vLLM worker serving
/// an 8B model on one large GPU.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MockerConfig {
    #[serde(default = "d_num_blocks")]
    pub num_blocks: u32,
    #[serde(default = "d_block_size")]
    pub block_size: u32,
    #[serde(default = "d_max_num_seqs")]
    pub max_num_seqs: u32,
    #[serde(default = "d_max_num_batched_tokens")]
    pub max_num_batched_tokens: u32,
    /// Simulated time is divided by this; large values make the framework the bottleneck.
    #[serde(default = "d_speedup")]
    pub speedup: f64,
    /// Requests that may wait to start before new ones are refused with 503 (load shedding).
    #[serde(default = "d_queue")]
    pub max_queued_requests: u32,
    #[serde(default)]
    pub timing: Timing,
}

fn d_num_blocks() -> u32 {
    16384
}
fn d_block_size() -> u32 {
    16
}
fn d_max_num_seqs() -> u32 {
    256
}
fn d_max_num_batched_tokens() -> u32 {
    8192
}
fn d_speedup() -> f64 {
    1.0
}
fn d_queue() -> u32 {
    4096
}

/// The timing model, in milliseconds: a step costs `step_ms`, plus `prefill_ms_per_token` per
/// prompt token computed, plus `decode_ms_per_seq` per decoding sequence, plus
/// `ms_per_1k_context` per thousand tokens of context the batch attends over.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timing {
    pub step_ms: f64,
    pub prefill_ms_per_token: f64,
    pub decode_ms_per_seq: f64,
    pub ms_per_1k_context: f64,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            step_ms: 5.0,
            prefill_ms_per_token: 0.02,
            decode_ms_per_seq: 0.05,
            ms_per_1k_context: 0.02,
        }
    }
}

impl Timing {
    pub fn step(&self, prefill_tokens: usize, decode_seqs: usize, context: usize) -> f64 {
        self.step_ms
            + self.prefill_ms_per_token * prefill_tokens as f64
            + self.decode_ms_per_seq * decode_seqs as f64
            + self.ms_per_1k_context * context as f64 / 1000.0
    }
}

impl Default for MockerConfig {
    fn default() -> Self {
        Self {
            num_blocks: d_num_blocks(),
            block_size: d_block_size(),
            max_num_seqs: d_max_num_seqs(),
            max_num_batched_tokens: d_max_num_batched_tokens(),
            speedup: d_speedup(),
            max_queued_requests: d_queue(),
            timing: Timing::default(),
        }
    }
}

impl MockerConfig {
    pub fn validate(&self, prefix: &str) -> Vec<Invalid> {
        let mut out = Vec::new();
        let mut positive = |name: &str, v: u32| {
            if v == 0 {
                out.push(Invalid::field(
                    format!("{prefix}{name}"),
                    "must be at least 1",
                ));
            }
        };
        positive("num_blocks", self.num_blocks);
        positive("block_size", self.block_size);
        positive("max_num_seqs", self.max_num_seqs);
        positive("max_num_batched_tokens", self.max_num_batched_tokens);
        positive("max_queued_requests", self.max_queued_requests);
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            out.push(Invalid::field(
                format!("{prefix}speedup"),
                "must be a positive number",
            ));
        }
        let t = &self.timing;
        if [
            t.step_ms,
            t.prefill_ms_per_token,
            t.decode_ms_per_seq,
            t.ms_per_1k_context,
        ]
        .iter()
        .any(|v| !(v.is_finite() && *v >= 0.0))
        {
            out.push(Invalid::field(
                format!("{prefix}timing"),
                "times must be zero or positive",
            ));
        }
        out
    }
}

enum Command {
    Add {
        id: SeqId,
        spec: SeqSpec,
        tx: mpsc::Sender<Generated>,
    },
    /// Publish the whole cache (a router lost events).
    Dump,
}

/// A running mocker worker; dropping the last handle stops its thread.
pub struct Mocker {
    commands: std_mpsc::SyncSender<Command>,
    /// Requests submitted but not yet running: in the command queue or the scheduler's.
    queued: Arc<AtomicUsize>,
    max_queued: usize,
    vocab: Arc<[u32]>,
    next_id: AtomicU64,
    /// Gauges of this worker (also on `/metrics`).
    pub gauges: WorkerGauges,
}

/// Tokens a sequence produced that its consumer has not taken yet.
struct Outbox {
    tx: mpsc::Sender<Generated>,
    pending: Vec<u32>,
    finish: Option<crate::llm::types::FinishReason>,
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
        match self.tx.try_send(item) {
            Ok(()) => {
                self.finish = None;
                true
            }
            Err(mpsc::error::TrySendError::Full(Generated::Tokens { ids, .. })) => {
                // The consumer lags: keep the tokens and send them together later.
                self.pending = ids;
                true
            }
            Err(_) => false,
        }
    }
}

impl Mocker {
    pub async fn start(config: &MockerConfig, cx: &BuildCx) -> Result<Arc<Mocker>, BuildError> {
        let model = ModelDir::shared(cx).await?;
        // Decoding the whole vocabulary takes a while for real tokenizers: not on the runtime.
        let vocab = tokio::task::spawn_blocking(move || text_tokens(&model))
            .await
            .map_err(|e| BuildError::new(format!("vocabulary scan failed: {e}")))?;
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
        let engine = Engine {
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
            timing: config.timing.clone(),
            speedup: config.speedup,
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
            .name(format!("mocker-{}", cx.replica))
            .spawn(move || engine.run(rx))
            .map_err(|e| BuildError::new(format!("cannot start the mocker thread: {e}")))?;
        let mocker = Arc::new(Mocker {
            commands,
            queued,
            max_queued: config.max_queued_requests as usize,
            vocab,
            next_id: AtomicU64::new(1),
            gauges,
        });
        // Weak: the engine thread stops when the last handle goes, and this task must not be
        // one.
        let weak = Arc::downgrade(&mocker);
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
        Ok(mocker)
    }

    /// Queue a request; its tokens arrive on the returned channel.
    pub fn submit(&self, req: &PreprocessedRequest) -> Result<mpsc::Receiver<Generated>, OpError> {
        let (tx, rx) = mpsc::channel(64);
        // A migrated request carries the tokens already generated after its prompt; seeding
        // by the original prompt and counting positions from it makes it continue exactly.
        let prompt_len = (req.output.prompt_tokens as usize).min(req.token_ids.len());
        let prompt_len = if prompt_len == 0 {
            req.token_ids.len()
        } else {
            prompt_len
        };
        let seed = req
            .sampling
            .seed
            .unwrap_or_else(|| crate::llm::kv::local_hash(&req.token_ids[..prompt_len]));
        let spec = SeqSpec {
            prompt: req.token_ids.clone(),
            max_tokens: req.stop.max_tokens,
            seed,
            offset: u32::try_from(req.token_ids.len() - prompt_len).unwrap_or(u32::MAX),
            vocab: self.vocab.clone(),
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        if self.queued.fetch_add(1, Ordering::AcqRel) >= self.max_queued {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(OpError::unavailable(format!(
                "the worker is busy: {} requests are already waiting",
                self.max_queued
            ))
            .with_code("worker_busy"));
        }
        match self.commands.try_send(Command::Add { id, spec, tx }) {
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

/// The ids the mocker draws output from: tokens that decode to visible text on their own (no
/// special, control or partial-character tokens), so simulated answers read as words and
/// never contain eos. Falls back to every id when a tokenizer has none.
fn text_tokens(model: &ModelDir) -> Arc<[u32]> {
    let ids: Vec<u32> = (0..model.vocab_size)
        .filter(|&id| {
            model.tokenizer.decode(&[id], true).is_ok_and(|s| {
                !s.trim().is_empty() && s.chars().all(|c| c != '\u{FFFD}' && !c.is_control())
            })
        })
        .collect();
    if ids.is_empty() {
        (0..model.vocab_size).collect()
    } else {
        ids.into()
    }
}

struct Engine {
    queued: Arc<AtomicUsize>,
    /// What this thread last counted in `queued` for requests it received.
    received_unadmitted: usize,
    sched: Scheduler,
    outboxes: HashMap<SeqId, Outbox>,
    timing: Timing,
    speedup: f64,
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

/// Below this a simulated step is not slept (the OS would oversleep it anyway).
const MIN_SLEEP: Duration = Duration::from_micros(50);

impl Engine {
    fn run(mut self, rx: std_mpsc::Receiver<Command>) {
        tracing::debug!(
            worker_id = format_args!("{:x}", self.worker_id),
            "Mocker engine started"
        );
        // Routers and `dyn inspect` see the worker's capacity before its first request.
        self.publish();
        loop {
            // Idle: block until work arrives (or every handle is gone).
            if self.sched.is_idle() && self.outboxes.is_empty() {
                match rx.recv() {
                    Ok(cmd) => self.command(cmd),
                    Err(_) => break,
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                self.command(cmd);
            }
            let started = Instant::now();
            self.reap_cancelled();
            let out = self.sched.step();
            let busy = out.prefill_tokens > 0 || out.decode_seqs > 0;
            let simulated = if busy {
                let ms = self
                    .timing
                    .step(out.prefill_tokens, out.decode_seqs, out.context_tokens);
                Duration::from_secs_f64(ms / 1000.0 / self.speedup)
            } else {
                // Nothing could run (waiting for blocks, or only undelivered output).
                Duration::from_millis(1)
            };
            let left = simulated.saturating_sub(started.elapsed());
            if left >= MIN_SLEEP {
                std::thread::sleep(left);
            }
            // A step's tokens exist once its compute is done, as in a real engine: delivering
            // them before the simulated time would hide the prefill from TTFT.
            for (id, token, finish) in out.tokens {
                if let Some(o) = self.outboxes.get_mut(&id) {
                    o.pending.push(token);
                    o.finish = finish;
                }
            }
            self.deliver();
            self.account();
            self.publish();
        }
        tracing::debug!(
            worker_id = format_args!("{:x}", self.worker_id),
            "Mocker engine stopped"
        );
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Add { id, spec, tx } => {
                // Counted in `queued` by `submit`; it stays counted while the scheduler holds
                // it unadmitted, and is released in `account`.
                self.received_unadmitted += 1;
                self.sched.add(id, spec);
                self.outboxes.insert(
                    id,
                    Outbox {
                        tx,
                        pending: Vec::new(),
                        finish: None,
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

    /// Release from `queued` the requests that started running (or left) since last time.
    fn account(&mut self) {
        let now = self.sched.unadmitted();
        if now < self.received_unadmitted {
            self.queued
                .fetch_sub(self.received_unadmitted - now, Ordering::AcqRel);
        }
        self.received_unadmitted = now;
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

    async fn run(m: &Mocker, req: &PreprocessedRequest) -> Vec<u32> {
        let mut rx = m.submit(req).expect("submitted");
        let mut out = Vec::new();
        while let Some(Generated::Tokens { ids, finish }) = rx.recv().await {
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
        let config = MockerConfig {
            num_blocks: 4,
            speedup: 1000.0,
            ..MockerConfig::default()
        };
        let m = Mocker::start(&config, &crate::testing::cx("decode", 0xabc, &[], &planes))
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
        let mut ix = crate::llm::indexer::Indexer::new();
        for e in &dump {
            assert_eq!(ix.apply(0xabc, e), crate::llm::indexer::Applied::Ok);
        }
        // The last prompt's first two blocks are what the cache holds now.
        let last = crate::llm::kv::block_hashes(&(100..140).collect::<Vec<_>>(), 16);
        let seqs: Vec<u64> = last.iter().map(|b| b.block_hash).collect();
        assert_eq!(ix.find_matches(&seqs), vec![(0xabc, 2)]);
    }
}
