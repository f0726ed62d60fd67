//! [`EngineHandle`]: what a `decode` or `prefill` node holds of its engine. It starts the
//! engine thread (`engine_loop.rs`), queues requests to it (refusing with 503 when its
//! queue is full), pulls a prefill worker's KV for a request, and forwards routers' resync
//! requests. Dropping the last handle stops the thread.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dyn_compute::transfer::{BlockFormat, KvTransferAgent, Pulled};
use dyn_core::{BuildCx, BuildError, OpError};
use dyn_protocol::kv::{ResyncRequest, kv_events_subject, kv_resync_subject, load_metrics_subject};
use dyn_protocol::types::{Generated, Prefilled, PreprocessedRequest};
use tokio::sync::{mpsc, oneshot};

use super::command::{Command, OfferTo};
pub use super::command::{EngineItem, OfferResult};
use super::engine_loop::EngineLoop;
use super::events::KvPublisher;
use super::offload::Tiers;
use super::scheduler::{Limits, Scheduler, SeqRole, SeqSpec};
use super::settings::EngineSettings;
use super::{EngineError, Executor, transfer};
use crate::metrics::WorkerGauges;

/// How a decode worker takes KV from a prefill worker: the block format it expects, the
/// modelled delay before pulling (the mocker's), and a check of the pulled bytes.
pub struct ImportCheck {
    pub format: BlockFormat,
    pub delay: Box<dyn Fn(usize) -> Duration + Send + Sync>,
    pub verify: VerifyImport,
}

/// Checks pulled blocks against the prompt they should hold.
pub type VerifyImport = Box<dyn Fn(&[Bytes], &[u32]) -> Result<(), EngineError> + Send + Sync>;

/// A panic's message, when it has one.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("(no message)")
}

/// One request's items from the engine, ending after its last token or its error. A channel
/// that closes before either means the engine thread is gone (it panicked, or stopped): the
/// request was lost with its replica, and says so ([`OpError::instance_lost`]) so it
/// migrates.
pub fn request_items(
    mut rx: mpsc::Receiver<EngineItem>,
) -> impl futures::Stream<Item = EngineItem> + Send + 'static {
    let mut ended = false;
    futures::stream::poll_fn(move |cx| {
        if ended {
            return std::task::Poll::Ready(None);
        }
        let item = match std::task::ready!(rx.poll_recv(cx)) {
            Some(item) => item,
            None => Err(OpError::instance_lost(
                "the engine stopped before the request finished",
            )),
        };
        ended = matches!(
            item,
            Err(_)
                | Ok(Generated::Tokens {
                    finish: Some(_),
                    ..
                })
        );
        std::task::Poll::Ready(Some(item))
    })
}

/// A prompt's KV, pulled from a prefill worker, and the first token the prefill sampled.
pub struct ImportedKv {
    pub first_token: u32,
    pub blocks: Vec<Bytes>,
}

/// A sequence's LoRA adapter.
pub type Lora = std::sync::Arc<dyn_compute::model::lora::LoraAdapter>;

/// A running engine worker; dropping the last handle stops its thread.
pub struct EngineHandle {
    commands: std_mpsc::SyncSender<Command>,
    /// Requests submitted but not yet running: in the command queue or the scheduler's.
    queued: Arc<AtomicUsize>,
    settings: EngineSettings,
    next_id: AtomicU64,
    /// Gauges of this worker (also on `/metrics`).
    pub gauges: WorkerGauges,
    /// Pulls prompts' KV from prefill workers (and offers this worker's, in the prefill role).
    agent: Arc<dyn KvTransferAgent>,
    import: ImportCheck,
    node: String,
    worker_id: u64,
    tiers: Option<Arc<Tiers>>,
}

/// The queue engine events leave the engine thread through, and the task that publishes
/// them. It is bounded: if the plane cannot keep up events are dropped, and consumers see the
/// gap in event ids.
fn publish_events(cx: &BuildCx) -> mpsc::Sender<(String, Bytes)> {
    let (events_tx, mut events_rx) = mpsc::channel::<(String, Bytes)>(4096);
    let planes = cx.planes.clone();
    tokio::spawn(async move {
        while let Some((subject, payload)) = events_rx.recv().await {
            if let Err(e) = planes.events.publish(&subject, payload).await {
                tracing::warn!(error = %e, subject, "Cannot publish an engine event");
            }
        }
    });
    events_tx
}

/// The worker's KV offload tiers, when its config asks for them.
async fn start_tiers(
    config: &EngineSettings,
    format: &BlockFormat,
    layout: String,
    cx: &BuildCx,
    kv: &Arc<KvPublisher>,
) -> Result<Option<Arc<Tiers>>, BuildError> {
    if !config.offload.enabled() {
        return Ok(None);
    }
    // What a block file must match to be read back: the engine's own layout, dtype and block
    // geometry.
    let f = format;
    let format = format!(
        "{layout}/{}/{}x{}",
        f.dtype, config.scheduler.block_size, f.block_bytes
    );
    let dir = config.offload.disk_dir.as_deref().map(|d| cx.resolve(d));
    // Opening the disk tier reads and checks every block file: a blocking scan, kept off the
    // runtime (a replica may start under load, added by the planner).
    let (offload, node, model, kv) = (
        config.offload.clone(),
        cx.node.clone(),
        config.offload_model,
        kv.clone(),
    );
    let t =
        tokio::task::spawn_blocking(move || Tiers::start(&offload, dir, &node, &format, model, kv))
            .await
            .map_err(|e| BuildError::new(format!("the KV offload tiers' start failed: {e}")))?
            .map_err(|e| BuildError::new(format!("cannot start the KV offload tiers: {e}")))?;
    tracing::info!(
        node = %cx.node,
        host_blocks = config.offload.host_blocks,
        disk_blocks = config.offload.disk_blocks,
        "KV offload tiers ready"
    );
    Ok(Some(t))
}

/// Run `engine` on its own thread, owned: a panic in it (a kernel's assert, a bug) is caught
/// there and fails the replica, which the runtime takes out of discovery and replaces. Only
/// then is the loop dropped: its requests' channels close, they end as lost and migrate, and
/// the replica is already on its way out of discovery.
fn spawn_engine_thread(
    engine: EngineLoop,
    rx: std_mpsc::Receiver<Command>,
    cx: &BuildCx,
    name: &str,
) -> Result<(), BuildError> {
    let readiness = cx.readiness.clone();
    let engine_name = name.to_owned();
    let worker_id = cx.instance_id.get();
    std::thread::Builder::new()
        .name(format!("{name}-{}", cx.replica))
        .spawn(move || {
            let mut engine = engine;
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.run(rx)));
            if let Err(panic) = run {
                let what = panic_message(panic.as_ref());
                tracing::error!(
                    worker_id = format_args!("{worker_id:x}"),
                    panic = what,
                    "Engine thread panicked; the replica is failed"
                );
                readiness.fail(format!("the {engine_name} engine thread panicked: {what}"));
            }
            drop(engine);
        })
        .map(drop)
        .map_err(|e| BuildError::new(format!("cannot start the {name} thread: {e}")))
}

/// Pass routers' requests for a full KV dump to the engine (it publishes the dump in order
/// with its other events). Holds the handle weakly: the engine thread stops when the last
/// handle goes, and this task must not be one.
fn follow_resync(
    weak: std::sync::Weak<EngineHandle>,
    worker_id: u64,
    mut resync: futures::stream::BoxStream<'static, dyn_core::planes::Event>,
) {
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
}

/// A worker's transfer counters are bound per outcome when first used; they leave `/metrics`
/// with the worker (its other series go with [`WorkerGauges`] and the tier gauges).
impl Drop for EngineHandle {
    fn drop(&mut self) {
        let id = format!("{:x}", self.worker_id);
        for outcome in ["pulled", "failed"] {
            let _ = crate::metrics::TRANSFERS.count.remove_label_values(&[
                self.node.as_str(),
                &id,
                outcome,
            ]);
        }
    }
}

impl EngineHandle {
    /// How long a prefill's offered blocks stay pinned for a decode worker to pull.
    pub fn pin_ttl(&self) -> Duration {
        Duration::from_secs_f64(self.settings.scheduler.pin_ttl_s.max(0.0))
    }

    /// The worker's offload tiers, if it has them.
    pub fn tiers(&self) -> Option<&Arc<Tiers>> {
        self.tiers.as_ref()
    }

    /// Start the engine thread for `exec` and the tasks that carry its events.
    pub async fn start(
        config: EngineSettings,
        import: ImportCheck,
        exec: Box<dyn Executor>,
        cx: &BuildCx,
        name: &str,
    ) -> Result<Arc<EngineHandle>, BuildError> {
        let sched = &config.scheduler;
        if let Some(m) = config.model.clone() {
            // The vocabulary for grammars, compiled now off the runtime rather than by the
            // first structured request.
            if let Ok(Err(e)) = tokio::task::spawn_blocking(move || m.grammars().map(drop)).await {
                tracing::warn!(node = %cx.node, error = %e, "Structured output is unavailable on this worker");
            }
        }
        let (commands, rx) = std_mpsc::sync_channel(sched.max_queued_requests as usize);
        let worker_id = cx.instance_id.get();
        let gauges = WorkerGauges::new(&cx.node, worker_id);
        // Visible on /metrics from the start, not only after the first request.
        gauges.set(0, 0, 0, sched.num_blocks, &Default::default());
        let events_tx = publish_events(cx);
        let queued = Arc::new(AtomicUsize::new(0));
        let agent = cx.service::<transfer::TransferAgent>().await?.0.clone();
        let kv = Arc::new(KvPublisher::new(
            worker_id,
            kv_events_subject(&cx.namespace, &cx.node),
            events_tx.clone(),
        ));
        let tiers = start_tiers(&config, &import.format, exec.offload_layout(), cx, &kv).await?;
        let mut scheduler = Scheduler::new(
            Limits {
                block_size: sched.block_size as usize,
                max_num_seqs: sched.max_num_seqs as usize,
                max_num_batched_tokens: sched.max_num_batched_tokens as usize,
            },
            sched.num_blocks,
        );
        if let Some(t) = &tiers {
            scheduler = scheduler.with_lower(Box::new(t.clone()));
        }
        let (unpin_tx, unpin_rx) = std_mpsc::channel();
        let engine = EngineLoop {
            agent: agent.clone(),
            pin_ttl: Duration::from_secs_f64(sched.pin_ttl_s),
            pinned: HashMap::new(),
            unpin_tx,
            unpin_rx,
            queued: queued.clone(),
            received_unadmitted: 0,
            sched: scheduler,
            outboxes: HashMap::new(),
            exec,
            imports: HashMap::new(),
            format: import.format.clone(),
            worker_id,
            kv,
            tiers: tiers
                .clone()
                .map(|t| (t, crate::metrics::TierGauges::new(&cx.node, worker_id))),
            load_subject: load_metrics_subject(&cx.namespace, &cx.node),
            events: events_tx,
            gauges: gauges.clone(),
            last_load: None,
            step_model: Default::default(),
            runtime: tokio::runtime::Handle::current(),
        };
        // Routers that lost events ask for a full dump; the engine publishes it in order
        // with its other events.
        let resync = cx
            .planes
            .events
            .subscribe(&kv_resync_subject(&cx.namespace, &cx.node))
            .await
            .map_err(|e| BuildError::new(format!("cannot subscribe to resync requests: {e}")))?;
        spawn_engine_thread(engine, rx, cx, name)?;
        let worker = Arc::new(EngineHandle {
            commands,
            queued,
            settings: config,
            next_id: AtomicU64::new(1),
            gauges,
            agent,
            import,
            node: cx.node.clone(),
            worker_id,
            tiers,
        });
        follow_resync(Arc::downgrade(&worker), worker_id, resync);
        Ok(worker)
    }

    /// The LoRA adapter `req` runs with ([`Routing::lora`](dyn_protocol::types::Routing)),
    /// loaded if it is not resident: what [`EngineHandle::submit`] and
    /// [`EngineHandle::submit_prefill`] take with it.
    pub async fn adapter(&self, req: &PreprocessedRequest) -> Result<Option<Lora>, OpError> {
        let Some(r) = &req.routing.lora else {
            return Ok(None);
        };
        let store = self.settings.loras.as_ref().ok_or_else(|| {
            OpError::invalid(format!(
                "model `{}` is a LoRA adapter; this worker's engine runs none",
                r.name
            ))
            .with_param("model")
        })?;
        store.get(r).await.map(Some)
    }

    /// Queue a request; its tokens arrive on the returned channel. `kv`: the prompt's KV
    /// imported from a prefill worker (decode role), or none (aggregated); `lora`: its
    /// adapter ([`EngineHandle::adapter`]).
    pub async fn submit(
        &self,
        req: &PreprocessedRequest,
        kv: Option<ImportedKv>,
        lora: Option<Lora>,
    ) -> Result<mpsc::Receiver<EngineItem>, OpError> {
        let compiled = self.compiled(req).await?;
        match kv {
            Some(kv) => self.enqueue(
                req,
                SeqRole::Imported {
                    first_token: kv.first_token,
                },
                Some(kv.blocks),
                None,
                (lora, compiled),
            ),
            None => self.enqueue(req, SeqRole::Full, None, None, (lora, compiled)),
        }
    }

    /// The request's structured output compiled, before it is queued: on a compile thread
    /// (or from the cache, when this process's preprocess compiled it), never in a step.
    async fn compiled(
        &self,
        req: &PreprocessedRequest,
    ) -> Result<Option<std::sync::Arc<dyn_llm::grammar::Compiled>>, OpError> {
        let Some(c) = &req.sampling.constraint else {
            return Ok(None);
        };
        self.grammars()?
            .compile(c)
            .await
            .map(Some)
            .map_err(dyn_llm::preprocess::grammar_error)
    }

    /// Receive the KV a prefill worker computed for `req`: the modelled transfer time (if
    /// any) passes first and then the blocks are pulled through the transfer agent, so a
    /// prefill worker lost during the transfer fails the pull (as a read from a dead peer
    /// would). `None` when the transfer failed or does not match the prompt: the request is
    /// then prefilled here.
    pub async fn import(&self, req: &PreprocessedRequest, p: &Prefilled) -> Option<ImportedKv> {
        let started = Instant::now();
        let want = &self.import.format;
        let bs = self.settings.scheduler.block_size as usize;
        let result = async {
            // Checked before anything is connected to or allocated: the descriptor came over
            // the network.
            if p.prompt_tokens as usize != req.token_ids.len()
                || p.transfer.block_ids.len() != req.token_ids.len().div_ceil(bs)
                || p.transfer.block_bytes != want.block_bytes
                || p.transfer.layout != want.layout
                || p.transfer.dtype != want.dtype
            {
                return Err(EngineError::Mismatch(format!(
                    "the offer covers {} tokens in {} blocks of {} bytes ({}, {}); this worker has a {}-token prompt and blocks of {} bytes ({}, {})",
                    p.prompt_tokens,
                    p.transfer.block_ids.len(),
                    p.transfer.block_bytes,
                    p.transfer.layout,
                    p.transfer.dtype,
                    req.token_ids.len(),
                    want.block_bytes,
                    want.layout,
                    want.dtype,
                )));
            }
            tokio::time::sleep((self.import.delay)(req.token_ids.len())).await;
            let pulled = self.agent.pull(&p.transfer, p.key).await?;
            let blocks = &pulled.blocks;
            if blocks.len() != req.token_ids.len().div_ceil(bs) {
                return Err(EngineError::Mismatch(format!(
                    "{} blocks pulled for a {}-token prompt",
                    blocks.len(),
                    req.token_ids.len()
                )));
            }
            (self.import.verify)(blocks, &req.token_ids)?;
            Ok(pulled)
        }
        .await;
        let id = format!("{:x}", self.worker_id);
        let m = &crate::metrics::TRANSFERS;
        match result {
            Ok(Pulled {
                blocks,
                via,
                fallback,
            }) => {
                m.count
                    .with_label_values(&[self.node.as_str(), &id, "pulled", via.as_str()])
                    .inc();
                // Which wire the blocks take, said once per wire and process (the metric
                // counts them; a worker's metrics stay in its own process).
                static FIRST: [std::sync::Once; 3] = [const { std::sync::Once::new() }; 3];
                FIRST[via as usize].call_once(|| {
                    tracing::info!(worker_id = %id, via = via.as_str(), "KV transfer: first blocks pulled over {via}");
                });
                if let Some(why) = fallback {
                    m.fallbacks
                        .with_label_values(&[self.node.as_str(), &id])
                        .inc();
                    // Once per process at warn (a broken wire would say it on every
                    // request), then at debug.
                    static TOLD: std::sync::atomic::AtomicBool =
                        std::sync::atomic::AtomicBool::new(false);
                    if !TOLD.swap(true, std::sync::atomic::Ordering::Relaxed) {
                        tracing::warn!(worker_id = %id, reason = %why, "KV transfer: the UCX read failed, the blocks came over TCP (said once)");
                    } else {
                        tracing::debug!(worker_id = %id, reason = %why, "KV transfer over TCP after a failed UCX read");
                    }
                }
                let took = started.elapsed();
                m.seconds
                    .with_label_values(&[self.node.as_str()])
                    .observe(took.as_secs_f64());
                tracing::debug!(
                    worker_id = %id,
                    via = via.as_str(),
                    bytes = blocks.iter().map(|b| b.len()).sum::<usize>(),
                    ms = took.as_secs_f64() * 1e3,
                    "KV blocks pulled"
                );
                Some(ImportedKv {
                    first_token: p.first_token,
                    blocks,
                })
            }
            Err(e) => {
                m.count
                    .with_label_values(&[self.node.as_str(), &id, "failed", "none"])
                    .inc();
                tracing::warn!(worker_id = %id, prefill_worker = format_args!("{:x}", p.worker_id), error = %e, "KV transfer failed; prefilling locally");
                None
            }
        }
    }

    /// Queue a prefill-only request: its first token arrives on the first channel, the offer
    /// of its prompt's KV blocks on the second. The offer opens only to the key `lock` locks
    /// (sent by the router to the decode worker it chose) when there is a lock.
    pub async fn submit_prefill(
        &self,
        req: &PreprocessedRequest,
        lora: Option<Lora>,
        lock: Option<dyn_compute::transfer::PullLock>,
    ) -> Result<(mpsc::Receiver<EngineItem>, oneshot::Receiver<OfferResult>), OpError> {
        let compiled = self.compiled(req).await?;
        let (reply, orx) = oneshot::channel();
        let to = OfferTo { reply, lock };
        Ok((
            self.enqueue(req, SeqRole::Prefill, None, Some(to), (lora, compiled))?,
            orx,
        ))
    }

    /// The grammar state of a structured output (`compiled`) whose output so far is
    /// `generated` and that may write `max_tokens` more, fast-forwarding forced text or not.
    fn guide(
        &self,
        compiled: &dyn_llm::grammar::Compiled,
        generated: &[u32],
        max_tokens: u32,
        fast_forward: bool,
    ) -> Result<crate::scheduler::Guided, OpError> {
        Ok(std::sync::Arc::new(parking_lot::Mutex::new(
            self.grammars()?
                .guide(compiled, generated.to_vec(), max_tokens)
                .with_fast_forward(fast_forward),
        )))
    }

    /// The model's vocabulary compiled for grammars: built when the worker started (see
    /// `EngineHandle::start`), so this is a lookup.
    fn grammars(&self) -> Result<std::sync::Arc<dyn_llm::grammar::Grammars>, OpError> {
        let model = self.settings.model.as_ref().ok_or_else(|| {
            OpError::invalid("this worker cannot enforce a structured output: it has no tokenizer")
                .with_param("response_format")
        })?;
        model
            .grammars()
            .map_err(|e| OpError::invalid(e).with_param("response_format"))
    }

    fn enqueue(
        &self,
        req: &PreprocessedRequest,
        role: SeqRole,
        kv: Option<Vec<Bytes>>,
        offer: Option<OfferTo>,
        (lora, compiled): (
            Option<Lora>,
            Option<std::sync::Arc<dyn_llm::grammar::Compiled>>,
        ),
    ) -> Result<mpsc::Receiver<EngineItem>, OpError> {
        if req.token_ids.is_empty() {
            return Err(OpError::invalid("the prompt has no tokens"));
        }
        if req.routing.lora.is_some() != lora.is_some() {
            // Never the base model's tokens for an adapter's request, nor the reverse.
            return Err(OpError::internal(
                "a request's LoRA adapter was not resolved before it was queued",
            ));
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
            .div_ceil(self.settings.scheduler.block_size as usize);
        if blocks > self.settings.scheduler.num_blocks as usize {
            return Err(OpError::invalid(format!(
                "the prompt needs {blocks} KV blocks; this worker has {}",
                self.settings.scheduler.num_blocks
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
                dyn_protocol::kv::local_hash(&req.token_ids[..prompt_len])
            } else {
                rand::random()
            }
        });
        let s = &req.sampling;
        if (s.logprobs.is_some() || s.prompt_logprobs.is_some()) && !self.settings.logprobs {
            return Err(OpError::invalid(
                "log-probabilities are not available from this worker's engine (a simulated one)",
            )
            .with_param("logprobs"));
        }
        // A simulated engine has no hidden states to embed with (the same want as above: a
        // model's real outputs).
        if s.embed.is_some() && !self.settings.logprobs {
            return Err(OpError::invalid(
                "embeddings are not available from this worker's engine (a simulated one)",
            )
            .with_param("model"));
        }
        let guide = match &compiled {
            None => None,
            Some(c) => {
                // The grammar replays what was generated: a migrated request's tokens after
                // its prompt, and an imported one's first token, sampled by the prefill worker.
                let mut generated = req.token_ids[prompt_len..].to_vec();
                let mut budget = req.stop.max_tokens;
                if let SeqRole::Imported { first_token } = role {
                    generated.push(first_token);
                    // The first token counts against max_tokens here too.
                    budget = budget.saturating_sub(1);
                }
                // Forced tokens are not sampled, so they have no log-probability of the
                // model's: with `logprobs` every token is sampled (masked to the tokenizer's
                // own first token of forced text), as vLLM does, which has no fast-forward;
                // SGLang, whose jump-forward has, computes the skipped tokens' log-probabilities
                // with another pass rather than report made-up ones.
                let ff = self.settings.fast_forward && s.logprobs.is_none();
                Some(self.guide(c, &generated, budget, ff)?)
            }
        };
        let drawn = s.drawn();
        let spec = SeqSpec {
            prompt: req.token_ids.clone(),
            max_tokens: req.stop.max_tokens,
            stop_tokens: req.stop.stop_tokens(req.stop.ignore_eos).into(),
            min_tokens: req.stop.min_tokens,
            sampling: dyn_compute::sample::SamplingParams {
                temperature: drawn.temperature,
                top_k: drawn.top_k as usize,
                top_p: drawn.top_p,
                min_p: drawn.min_p,
                seed,
            },
            penalties: dyn_compute::sample::Penalties {
                logit_bias: s.logit_bias.clone(),
                repetition: drawn.repetition,
                frequency: drawn.frequency,
                presence: drawn.presence,
            }
            .any()
            .map(std::sync::Arc::new),
            logprobs: s.logprobs,
            prompt_logprobs: s.prompt_logprobs,
            guide,
            offset: u32::try_from(req.token_ids.len() - prompt_len).unwrap_or(u32::MAX),
            role,
            precedence: req.routing.precedence(),
            salt: dyn_protocol::kv::request_salt(&req.routing),
            hashes: req.hashes.share(),
            lora,
            embed: s.embed,
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let max_queued = self.settings.scheduler.max_queued_requests as usize;
        if self.queued.fetch_add(1, Ordering::AcqRel) >= max_queued {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(OpError::overloaded(format!(
                "the worker is busy: {max_queued} requests are already waiting"
            )));
        }
        match self.commands.try_send(Command::Add {
            id,
            spec: Box::new(spec),
            kv,
            tx,
            offer,
        }) {
            Ok(()) => Ok(rx),
            Err(e) => {
                self.queued.fetch_sub(1, Ordering::AcqRel);
                Err(match e {
                    std_mpsc::TrySendError::Full(_) => {
                        OpError::overloaded("the engine's request queue is full")
                    }
                    std_mpsc::TrySendError::Disconnected(_) => {
                        OpError::instance_lost("the engine has stopped")
                    }
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mocker;
    use dyn_core::planes::Planes;
    use dyn_protocol::kv::{KvEventData, LoadMetrics, RouterEvent};
    use dyn_protocol::types::Generated;
    use futures::StreamExt;

    #[tokio::test]
    async fn a_panicking_engine_fails_its_replica_and_its_requests_as_lost() {
        let planes = Planes::embedded();
        let config = mocker::MockerConfig {
            speedup: 1000.0,
            panic_at_step: 4,
            ..mocker::MockerConfig::default()
        };
        let cx = dyn_protocol::testing::cx("decode", 0xabc, &[], &planes);
        let readiness = cx.readiness.clone();
        let mut health = readiness.subscribe();
        let m = mocker::start(&config, &cx).await.expect("starts");
        let rx = m
            .submit(
                &dyn_protocol::testing::preprocessed((0..40).collect(), 20),
                None,
                None,
            )
            .await
            .expect("submitted");
        let items: Vec<EngineItem> = request_items(rx).collect().await;
        // Three steps of tokens (prefill, two decodes), then the loss, and nothing after.
        let (last, tokens) = items.split_last().expect("items");
        assert!(tokens.iter().all(Result::is_ok), "{items:?}");
        assert_eq!(tokens.len(), 3, "{items:?}");
        let lost = last.as_ref().expect_err("ends in an error");
        assert_eq!(lost.kind, dyn_core::ErrorKind::InstanceLost, "{lost:?}");
        // The replica is failed for good (the runtime replaces it), with the panic's message.
        let failed = tokio::time::timeout(
            Duration::from_secs(5),
            health.wait_for(|h| matches!(h, dyn_core::Health::Failed(_))),
        )
        .await
        .expect("fails in time")
        .expect("open")
        .clone();
        let dyn_core::Health::Failed(reason) = failed else {
            unreachable!()
        };
        assert!(reason.contains("injected panic at step 4"), "{reason}");
        assert!(!readiness.is_ready());
        // What still reaches it is refused as lost, so routers' picks migrate.
        let e = m
            .submit(
                &dyn_protocol::testing::preprocessed((0..40).collect(), 20),
                None,
                None,
            )
            .await
            .expect_err("refused");
        assert_eq!(e.kind, dyn_core::ErrorKind::InstanceLost, "{e:?}");
    }

    #[tokio::test]
    async fn a_full_queue_is_overloaded_not_lost() {
        let planes = Planes::embedded();
        let config = mocker::MockerConfig {
            speedup: 0.01,
            max_num_seqs: 1,
            max_queued_requests: 1,
            ..mocker::MockerConfig::default()
        };
        let m = mocker::start(
            &config,
            &dyn_protocol::testing::cx("decode", 1, &[], &planes),
        )
        .await
        .expect("starts");
        let req = dyn_protocol::testing::preprocessed((0..40).collect(), 50);
        let _running = m.submit(&req, None, None).await.expect("runs");
        let mut refused = None;
        let mut held = Vec::new();
        for _ in 0..3 {
            match m.submit(&req, None, None).await {
                Ok(rx) => held.push(rx),
                Err(e) => {
                    refused = Some(e);
                    break;
                }
            }
        }
        let e = refused.expect("one is refused");
        assert_eq!(
            (e.kind, e.code.as_deref()),
            (dyn_core::ErrorKind::Overloaded, Some(dyn_core::WORKER_BUSY)),
            "{e:?}"
        );
    }

    async fn run(m: &EngineHandle, req: &PreprocessedRequest) -> Vec<u32> {
        let mut rx = m.submit(req, None, None).await.expect("submitted");
        let mut out = Vec::new();
        while let Some(Ok(Generated::Tokens { ids, finish, .. })) = rx.recv().await {
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
        let m = mocker::start(
            &config,
            &dyn_protocol::testing::cx("decode", 0xabc, &[], &planes),
        )
        .await
        .expect("starts");
        let a = run(
            &m,
            &dyn_protocol::testing::preprocessed((0..40).collect(), 10),
        )
        .await;
        assert_eq!(a.len(), 10);
        // Same seed and prompt again: same output, and the prompt's blocks come from the cache.
        assert_eq!(
            run(
                &m,
                &dyn_protocol::testing::preprocessed((0..40).collect(), 10)
            )
            .await,
            a
        );
        // A different prompt needs the blocks back: the cached ones are evicted.
        run(
            &m,
            &dyn_protocol::testing::preprocessed((100..140).collect(), 10),
        )
        .await;

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
        let expected = dyn_protocol::kv::block_hashes(&(0..40).collect::<Vec<_>>(), 16);
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
        // A router rebuilds the cache from the dump: every stored block chains onto one stored
        // before it, and the last prompt's first two blocks are what the cache holds now.
        let mut stored = std::collections::HashSet::new();
        for e in &dump {
            if let KvEventData::Stored {
                parent_hash,
                blocks,
            } = &e.data
            {
                assert!(parent_hash.is_none_or(|p| stored.contains(&p)), "{e:?}");
                stored.extend(blocks.iter().map(|b| b.block_hash));
            }
        }
        let last = dyn_protocol::kv::block_hashes(&(100..140).collect::<Vec<_>>(), 16);
        let seqs: Vec<u64> = last.iter().map(|b| b.block_hash).collect();
        assert!(
            stored.contains(&seqs[0]) && stored.contains(&seqs[1]),
            "{dump:?}"
        );
    }
}
