//! The `mocker` engine: a simulated vLLM-style engine for routing, scale and framework tests
//! without GPUs.
//!
//! It runs on the shared engine loop and scheduler ([`super`]); its executor computes
//! nothing: it sleeps for the step's simulated duration ([`Timing`], divided by `speedup`)
//! and answers with tokens that are a pure function of the request's seed and position
//! (drawn from tokens that decode to visible text), so tests can predict them and
//! preemption, batching and migration do not change them. Its simulated KV blocks hold the
//! block's token ids, which really move through the transfer agent in disaggregated serving.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use dyn_compute::transfer::{BlockFormat, BlockLayout};
use dyn_core::{BuildCx, BuildError, Invalid};
use dyn_llm::model::ModelDir;
use serde::Deserialize;

use super::offload::Modelled;
use super::settings::{EngineSettings, SchedulerConfig, engine_section};

use super::pool::BlockId;
use super::scheduler::{SeqSpec, Work, token_at};
use super::{EngineError, EngineHandle, Executor, ImportCheck};

engine_section! {
    /// `config.mocker` of `decode` with `engine: mocker`. Defaults resemble a vLLM worker
    /// serving an 8B model on one large GPU.
    pub struct MockerConfig {
        scheduler: SchedulerConfig {
            num_blocks: 16384,
            block_size: 16,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_queued_requests: 4096,
            pin_ttl_s: 30.0,
        },
        /// Simulated time is divided by this; large values make the framework the bottleneck.
        pub speedup: f64 = 1.0,
        pub timing: Timing = Timing::default(),
        /// Disaggregation: bytes of KV one token takes (the default is Llama-3-8B in bf16: 32
        /// layers × K and V × 8 KV heads × 128 dims × 2 bytes). The simulated blocks that
        /// really move are much smaller; this sizes the transfer the timing model charges.
        pub kv_bytes_per_token: u64 = 32 * 2 * 8 * 128 * 2,
        /// Disaggregation: KV transfer bandwidth between workers, in GB/s (25: one 200 Gb/s NIC).
        pub transfer_gbps: f64 = 25.0,
        /// Fault injection: the engine thread panics in its Nth computed step (counted from
        /// the replica's start; a replacement counts afresh), as a kernel assert would.
        /// 0 (the default) never. For testing supervision and migration.
        pub panic_at_step: u64 = 0,
        /// Fault injection: replicas (by index) that fail every request before its first
        /// token with an internal error, as a broken worker would. For testing the router's
        /// circuit breaker and the retry on another worker.
        pub fail_replicas: Vec<u32> = Vec::new(),
    }
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

impl MockerConfig {
    /// The engine loop's settings.
    pub fn settings(&self) -> EngineSettings {
        EngineSettings {
            scheduler: self.scheduler(),
            vocab_size: None,
            seed_from_prompt: true,
            offload: self.offload.clone(),
            offload_model: Some(self.offload_model()),
            model: None,
            fast_forward: self.fast_forward,
            logprobs: false,
            loras: None,
        }
    }

    pub fn validate(&self, prefix: &str) -> Vec<Invalid> {
        let mut out = self.validate_shared(prefix);
        for (name, v) in [
            ("speedup", self.speedup),
            ("transfer_gbps", self.transfer_gbps),
        ] {
            if !(v.is_finite() && v > 0.0) {
                out.push(Invalid::field(
                    format!("{prefix}{name}"),
                    "must be a positive number",
                ));
            }
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

    /// The transfer times of its offload tiers, for blocks of a real model's size.
    pub fn offload_model(&self) -> Modelled {
        Modelled {
            block_bytes: (self.kv_bytes_per_token * u64::from(self.block_size)) as f64,
            host_gbps: self.offload.host_gbps,
            disk_gbps: self.offload.disk_gbps,
            speedup: self.speedup,
        }
    }

    /// Simulated time to move the KV of `tokens` tokens from a prefill worker.
    pub fn transfer_time(&self, tokens: usize) -> Duration {
        let secs = tokens as f64 * self.kv_bytes_per_token as f64 / (self.transfer_gbps * 1e9);
        Duration::from_secs_f64(secs / self.speedup)
    }
}

/// The ids the mocker draws output from: tokens that decode to visible text on their own (no
/// special, control or partial-character tokens), so simulated answers read as words and
/// never contain eos. Falls back to every id when a tokenizer has none. Then the other ids
/// (what a grammar may still ask for: eos, a special token).
fn text_tokens(model: &ModelDir) -> (Arc<[u32]>, Arc<[u32]>) {
    let (text, other): (Vec<u32>, Vec<u32>) = (0..model.vocab_size).partition(|&id| {
        model.tokenizer.decode(&[id], true).is_ok_and(|s| {
            !s.trim().is_empty() && s.chars().all(|c| c != '\u{FFFD}' && !c.is_control())
        })
    });
    if text.is_empty() {
        ((0..model.vocab_size).collect(), Arc::from([]))
    } else {
        (text.into(), other.into())
    }
}

/// How the mocker lays out a simulated KV block: the block's token ids, little-endian `u32`,
/// padded with `u32::MAX`. Small, and checkable by the decode worker against its prompt.
pub fn block_format(block_size: usize) -> BlockFormat {
    BlockFormat {
        block_bytes: (block_size * 4) as u32,
        layout: BlockLayout::TokenIds,
        dtype: dyn_compute::transfer::BlockDType::U32le,
    }
}

/// The simulated KV blocks of `tokens` (see [`block_format`]).
pub fn block_payloads(tokens: &[u32], block_size: usize) -> Vec<Bytes> {
    tokens
        .chunks(block_size.max(1))
        .map(|chunk| {
            let mut b = BytesMut::with_capacity(block_size * 4);
            for t in chunk {
                b.put_u32_le(*t);
            }
            b.resize(block_size * 4, 0xff);
            b.freeze()
        })
        .collect()
}

/// Below this a simulated step is not slept (the OS would oversleep it anyway).
const MIN_SLEEP: Duration = Duration::from_micros(50);

/// Start a mocker worker.
pub async fn start(config: &MockerConfig, cx: &BuildCx) -> Result<Arc<EngineHandle>, BuildError> {
    let model = ModelDir::shared(cx).await?;
    let vocab_size = model.vocab_size as usize;
    let mut settings = config.settings();
    settings.model = Some(model.clone());
    // Decoding the whole vocabulary takes a while for real tokenizers: not on the runtime.
    let (vocab, other) = tokio::task::spawn_blocking(move || text_tokens(&model))
        .await
        .map_err(|e| BuildError::new(format!("vocabulary scan failed: {e}")))?;
    let bs = config.block_size as usize;
    let exec = MockerExec {
        vocab,
        other,
        vocab_size,
        timing: config.timing.clone(),
        speedup: config.speedup,
        block_size: bs,
        offload: config.offload_model(),
        panic_at_step: config.panic_at_step,
        steps: 0,
    };
    let c = config.clone();
    let import = ImportCheck {
        format: block_format(bs),
        delay: Box::new(move |tokens| c.transfer_time(tokens)),
        verify: Box::new(move |blocks, tokens| {
            if blocks == block_payloads(tokens, bs).as_slice() {
                Ok(())
            } else {
                Err(EngineError::Mismatch(
                    "the pulled blocks do not hold this prompt".into(),
                ))
            }
        }),
    };
    EngineHandle::start(settings, import, Box::new(exec), cx, "mocker").await
}

struct MockerExec {
    vocab: Arc<[u32]>,
    /// The ids that are not text (eos, special and control tokens).
    other: Arc<[u32]>,
    /// The model's vocabulary size (grammar masks' length).
    vocab_size: usize,
    timing: Timing,
    speedup: f64,
    block_size: usize,
    offload: Modelled,
    panic_at_step: u64,
    steps: u64,
}

impl MockerExec {
    /// A structured output's token: drawn as [`token_at`] draws, among the text tokens the
    /// grammar allows, or one time in eight (and where it allows no text) among the others it
    /// allows (eos, a special token): a grammar whose text only a special token ends (harmony's
    /// `<|end|>`) ends, as a model's would.
    fn guided(&self, spec: &SeqSpec, guide: &crate::scheduler::Guided, position: u32) -> u32 {
        let mut g = guide.lock();
        let mask = g.mask(self.vocab_size);
        let text: Vec<u32> = self
            .vocab
            .iter()
            .copied()
            .filter(|&t| mask.is_allowed(t))
            .collect();
        let other: Vec<u32> = self
            .other
            .iter()
            .copied()
            .filter(|&t| mask.is_allowed(t))
            .collect();
        let coin =
            dyn_compute::sample::splitmix(spec.sampling.seed ^ u64::from(position) ^ 0x5EC1A1);
        let token = if text.is_empty() || (!other.is_empty() && coin.is_multiple_of(8)) {
            token_at(spec, &other, position)
        } else {
            token_at(spec, &text, position)
        };
        g.commit(token);
        token
    }
}

impl Executor for MockerExec {
    fn execute(&mut self, work: &[Work<'_>]) -> Result<Vec<u32>, EngineError> {
        self.steps += 1;
        // Fault injection (`panic_at_step`): what a failed kernel assert does to a real engine.
        if self.steps == self.panic_at_step {
            panic!("mocker: injected panic at step {}", self.steps);
        }
        let started = Instant::now();
        let (mut prefill, mut decode, mut context, mut onboard) = (0, 0, 0, 0);
        for w in work {
            onboard += w.onboard.len();
            if w.len == 1 && w.generated > 0 {
                decode += 1;
            } else {
                prefill += w.len;
            }
            context += w.start + w.len;
        }
        if prefill + decode > 0 {
            let ms = self.timing.step(prefill, decode, context);
            // Onboarded blocks are copied in before the step computes.
            let left = (Duration::from_secs_f64(ms / 1000.0 / self.speedup)
                + self.offload.onboard(onboard))
            .saturating_sub(started.elapsed());
            // A step's tokens exist once its compute is done, as in a real engine: delivering
            // them before the simulated time would hide the prefill from TTFT.
            if left >= MIN_SLEEP {
                std::thread::sleep(left);
            }
        }
        Ok(work
            .iter()
            .filter(|w| w.sample)
            .map(|w| {
                let position = w.spec.offset + w.generated;
                match &w.spec.guide {
                    None => token_at(w.spec, &self.vocab, position),
                    Some(g) => self.guided(w.spec, g, position),
                }
            })
            .collect())
    }

    fn export(&mut self, _blocks: &[BlockId], tokens: &[u32]) -> Result<Vec<Bytes>, EngineError> {
        Ok(block_payloads(tokens, self.block_size))
    }

    fn export_cached(
        &mut self,
        _blocks: &[BlockId],
        hashes: &[u64],
    ) -> Result<Vec<Bytes>, EngineError> {
        // A simulated block's content is its identity: the sequence hash.
        Ok(hashes
            .iter()
            .map(|h| Bytes::copy_from_slice(&h.to_le_bytes()))
            .collect())
    }

    fn import(&mut self, _blocks: &[BlockId], _data: Vec<Bytes>) -> Result<(), EngineError> {
        // Pulled blocks were checked against the prompt, onboarded ones by their tier;
        // nothing to store.
        Ok(())
    }
}
