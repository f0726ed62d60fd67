//! The engines' scheduler: continuous batching with chunked prefill and preemption, in the
//! manner of vLLM's v1 scheduler. The mocker and the native engine share it; only what runs a
//! step differs.
//!
//! Each [`Scheduler::step`] gives every running sequence its tokens for this step (one for a
//! decoding sequence, up to the remaining token budget for one still in prefill), preempting
//! the most recently admitted sequence when a block cannot be found, then admits waiting
//! sequences by precedence (priority, lower first, then arrival) while the batch has room
//! (`max_num_seqs`), tokens are left in the budget (`max_num_batched_tokens`) and blocks can
//! be found. A full batch makes way for a waiting sequence that comes strictly before a
//! running one: the running one is preempted (vLLM's priority scheduling), which is how a
//! router's interactive request, or a tenant under its share, starts at once. Prompt blocks
//! already in the prefix cache are not computed again. The planned [`Work`] goes to the
//! engine's executor, which computes it and samples a token for each sequence whose KV is
//! complete; the scheduler then ends sequences on `max_tokens` or a stop token. Tokens a
//! structured output's grammar forces after the sampled one are appended with it (see
//! [`dyn_llm::grammar::Guide::take_forced`]): the sequence then has several tokens without KV,
//! computed in its next step as a chunk, as a prompt's are, before it samples again.
//!
//! With offload tiers below the pool ([`Lower`]), a prompt's prefix continues past the pool's
//! hit into host memory: those blocks are onboarded (their bytes ride on the [`Work`] and the
//! engine copies them into the new blocks before computing) and count as computed. Blocks
//! only on disk are read first: the sequence waits aside once (`loading`) while others are
//! admitted, then takes what arrived.

use std::collections::VecDeque;

use bytes::Bytes;
use dyn_protocol::kv::{BlockHash, chain_hash, local_hash, salted_local};
use dyn_protocol::types::{FinishReason, Precedence};

use super::EngineError;
use super::pool::{BlockId, Evicted, Pool};

/// Limits of one engine's scheduler.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub block_size: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
}

/// A request as the scheduler sees it.
#[derive(Debug, Clone)]
pub struct SeqSpec {
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    /// Stop tokens (none end the output before `min_tokens`); empty with `ignore_eos`.
    pub stop_tokens: std::sync::Arc<[u32]>,
    pub min_tokens: u32,
    pub sampling: dyn_compute::sample::SamplingParams,
    /// Logit bias and penalties, when the request has any (the native engine applies them).
    pub penalties: Option<std::sync::Arc<dyn_compute::sample::Penalties>>,
    /// Log-probabilities of each sampled token with this many alternatives, and of the
    /// prompt's tokens (see [`crate::Executor::take_logprobs`]).
    pub logprobs: Option<u32>,
    pub prompt_logprobs: Option<u32>,
    /// Structured output: the grammar's state, masked before and advanced after each sampled
    /// token (shared with the executor's mask thread, hence the lock).
    pub guide: Option<Guided>,
    /// Output tokens generated before this request (a migrated request resumes at this
    /// position, so its output continues the original one exactly).
    pub offset: u32,
    pub role: SeqRole,
    /// Its place in the order for the batch: waiting sequences are admitted by it (then by
    /// arrival), and one that comes strictly before a running one takes its place when the
    /// batch is full.
    pub precedence: Precedence,
    /// The request's `cache_salt` ([`dyn_protocol::kv::salt_hash`]): its prompt shares cached
    /// blocks only with prompts of the same salt (`None`: unsalted ones), the first block's
    /// local hash being salted ([`dyn_protocol::kv::salted_local`]).
    pub salt: Option<u64>,
    /// The request's memo of its block hashes: in a graph of one process the router hashed
    /// the prompt already, and admission takes its hashes from there.
    pub hashes: dyn_protocol::kv::PromptHashes,
    /// The LoRA adapter its tokens run with (the native engine's; `salt` includes its name).
    pub lora: Option<std::sync::Arc<dyn_compute::model::lora::LoraAdapter>>,
    /// An embeddings request: its prompt's final hidden states pooled this way are its
    /// answer; the one token it "samples" is not output.
    pub embed: Option<dyn_protocol::types::Pooling>,
}

impl SeqSpec {
    /// Tokens of the prompt proper: a migrated request's earlier output (`offset` tokens at
    /// the end of `prompt`) counts as output.
    pub fn prompt_len(&self) -> usize {
        self.prompt.len().saturating_sub(self.offset as usize)
    }

    /// Every prompt position's output is wanted (the prompt's log-probabilities, a mean
    /// pooled embedding): none may come from the prefix cache.
    pub fn every_position(&self) -> bool {
        self.prompt_logprobs.is_some() || self.embed == Some(dyn_protocol::types::Pooling::Mean)
    }
}

/// A sequence's grammar state (see [`dyn_llm::grammar`]).
pub type Guided = std::sync::Arc<parking_lot::Mutex<dyn_llm::grammar::Guide>>;

/// One sequence's part of a step, for the executor.
#[derive(Debug)]
pub struct Work<'a> {
    pub id: SeqId,
    pub spec: &'a SeqSpec,
    /// Prompt and generated tokens so far.
    pub tokens: &'a [u32],
    /// Compute the KV of `tokens[start..start + len]`.
    pub start: usize,
    pub len: usize,
    /// The sequence's blocks, covering at least `start + len` positions.
    pub blocks: &'a [BlockId],
    /// Sample the next token (the KV is complete after this step).
    pub sample: bool,
    /// The first step of an imported sequence: its blocks are to be filled with the KV
    /// pulled from the prefill worker, except the first `import_skip`, which came from this
    /// worker's prefix cache (shared with other sequences, and already holding that KV).
    pub import: bool,
    pub import_skip: usize,
    /// Output tokens so far (the position, for the mocker's deterministic output).
    pub generated: u32,
    /// KV onboarded from an offload tier, for `blocks[onboard_at..]` in order: the engine
    /// writes it before computing the step.
    pub onboard: &'a [Bytes],
    pub onboard_at: usize,
}

/// The offload tiers below the pool, as the scheduler sees them (sequence hashes in).
pub trait Lower: Send {
    /// How many leading blocks of `hashes` can be onboarded now.
    fn ready(&self, hashes: &[u64]) -> usize;
    /// The bytes of the leading blocks of `hashes` ready now (possibly fewer than `ready`
    /// said, if a tier dropped one since).
    fn take(&mut self, hashes: &[u64]) -> Vec<Bytes>;
    /// Start reading slower tiers' blocks that continue the prefix; how many are on their way.
    fn fetch(&mut self, hashes: &[u64]) -> usize;
    /// Whether a block of `hashes` is still on its way.
    fn pending(&self, hashes: &[u64]) -> bool;
}

/// What a worker does with a sequence.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SeqRole {
    /// Prefill and decode (aggregated serving).
    #[default]
    Full,
    /// Prefill only: stop after the first token and keep the prompt's blocks (they are handed
    /// over in [`StepOutcome::pinned`] for a decode worker to pull).
    Prefill,
    /// The prompt's KV was computed elsewhere and transferred: the sequence is admitted with
    /// its prompt already computed, and `first_token` is its first output.
    Imported { first_token: u32 },
}

pub type SeqId = u64;

#[derive(Debug)]
struct Seq {
    id: SeqId,
    spec: SeqSpec,
    /// Prompt plus generated tokens.
    tokens: Vec<u32>,
    generated: u32,
    /// Tokens whose KV is in `blocks`.
    computed: usize,
    blocks: Vec<BlockId>,
    /// Hashes of the full blocks registered so far.
    hashes: Vec<BlockHash>,
    preemptions: u32,
    /// Leading blocks taken from the prefix cache at admission.
    hit_blocks: usize,
    /// Offload tiers were asked for this prompt's blocks (it waits for a read only once).
    fetched: bool,
    /// Blocks it waits for, while aside in `loading`.
    loading: Vec<u64>,
    /// Onboarded KV for its first step, for the blocks after `hit_blocks`.
    onboard: Vec<Bytes>,
}

/// What one step did, for the timing model and for delivering output.
#[derive(Debug, Default)]
pub struct StepOutcome {
    pub prefill_tokens: usize,
    pub decode_seqs: usize,
    /// Sum of context lengths of the scheduled sequences.
    pub context_tokens: usize,
    /// New tokens by sequence, with a finish reason for those that ended.
    pub tokens: Vec<(SeqId, u32, Option<FinishReason>)>,
    pub preempted: usize,
    /// Prefill-only sequences that finished, with the blocks holding their prompt's KV (still
    /// referenced: release them with [`Pool::release`] once they are transferred) and the
    /// prompt tokens.
    pub pinned: Vec<(SeqId, Vec<BlockId>, Vec<u32>)>,
    /// Sequences ended without a new token: they outgrew the whole cache.
    pub ended: Vec<SeqId>,
}

#[derive(Debug, Default, Clone, Copy)]
pub struct Counters {
    pub prompt_blocks: u64,
    pub prompt_blocks_hit: u64,
    /// Prompt blocks onboarded from an offload tier instead of computed.
    pub prompt_blocks_onboarded: u64,
    /// Prompt tokens computed (recomputation after a preemption included, and the chunks of
    /// tokens a grammar forced, which are computed as a prompt's are).
    pub prefill_tokens: u64,
    pub preemptions: u64,
}

pub struct Scheduler {
    limits: Limits,
    pub pool: Pool,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    pub counters: Counters,
    /// Sequences added but never admitted to the batch yet (the engine's queue depth).
    unadmitted: usize,
    lower: Option<Box<dyn Lower>>,
    /// Sequences waiting aside for blocks read from a slower tier.
    loading: Vec<Seq>,
}

/// The mocker's deterministic output: splitmix64 over seed and position, into `vocab`.
pub fn token_at(spec: &SeqSpec, vocab: &[u32], position: u32) -> u32 {
    let z = dyn_compute::sample::splitmix(
        spec.sampling.seed ^ u64::from(position).wrapping_mul(0x9E37_79B9_7F4A_7C15),
    );
    match vocab.len() {
        0 => 0,
        n => vocab[(z % n as u64) as usize],
    }
}

/// Prompt tokens whose logits a step returns for one sequence at most, when its prompt's
/// log-probabilities are wanted (every position's logits: a vocabulary of floats each, so the
/// prompt goes in chunks of this many).
const PROMPT_LOGPROBS_CHUNK: usize = 256;

/// The most tokens `seq` may compute in one step.
fn chunk_limit(seq: &Seq) -> usize {
    if seq.spec.prompt_logprobs.is_some() && seq.generated == 0 {
        PROMPT_LOGPROBS_CHUNK
    } else {
        usize::MAX
    }
}

impl Scheduler {
    pub fn new(limits: Limits, num_blocks: u32) -> Self {
        Self {
            limits,
            pool: Pool::new(num_blocks),
            waiting: VecDeque::new(),
            running: Vec::new(),
            counters: Counters::default(),
            unadmitted: 0,
            lower: None,
            loading: Vec::new(),
        }
    }

    /// Offload tiers below the pool: evicted blocks are reported to the executor, and
    /// prompts onboard from the tiers.
    pub fn with_lower(mut self, lower: Box<dyn Lower>) -> Self {
        self.pool.track_evictions();
        self.lower = Some(lower);
        self
    }

    pub fn block_size(&self) -> usize {
        self.limits.block_size
    }

    pub fn add(&mut self, id: SeqId, spec: SeqSpec) {
        self.unadmitted += 1;
        self.enqueue(
            Seq {
                id,
                tokens: spec.prompt.clone(),
                spec,
                generated: 0,
                computed: 0,
                blocks: Vec::new(),
                hashes: Vec::new(),
                preemptions: 0,
                hit_blocks: 0,
                fetched: false,
                loading: Vec::new(),
                onboard: Vec::new(),
            },
            false,
        );
    }

    /// Puts `seq` in the waiting queue, which stays ordered by precedence: after the waiting
    /// sequences of its precedence, or (`first`: one that was running, or is taken up again)
    /// before them.
    fn enqueue(&mut self, seq: Seq, first: bool) {
        let p = seq.spec.precedence;
        let at = if first {
            self.waiting.partition_point(|s| s.spec.precedence < p)
        } else {
            self.waiting.partition_point(|s| s.spec.precedence <= p)
        };
        self.waiting.insert(at, seq);
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len() + self.loading.len()
    }

    /// Prompt tokens not computed yet, waiting or in the batch (prefix-cache hits of waiting
    /// requests are not known before admission: they count).
    pub fn pending_prefill_tokens(&self) -> usize {
        let prompt_left = |s: &Seq| s.spec.prompt.len().saturating_sub(s.computed);
        self.waiting.iter().map(prompt_left).sum::<usize>()
            + self.running.iter().map(prompt_left).sum::<usize>()
            + self.loading.iter().map(prompt_left).sum::<usize>()
    }

    /// Requests that have not started running yet.
    pub fn unadmitted(&self) -> usize {
        self.unadmitted
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty() && self.loading.is_empty()
    }

    /// Remove a sequence (finished or cancelled) and free its blocks.
    pub fn remove(&mut self, id: SeqId) -> bool {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let seq = self.running.remove(i);
            self.free(seq);
            true
        } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            if let Some(seq) = self.waiting.remove(i) {
                if seq.preemptions == 0 {
                    self.unadmitted -= 1;
                }
                self.free(seq);
            }
            true
        } else if let Some(i) = self.loading.iter().position(|s| s.id == id) {
            let seq = self.loading.remove(i);
            if seq.preemptions == 0 {
                self.unadmitted -= 1;
            }
            self.free(seq);
            true
        } else {
            false
        }
    }

    fn free(&mut self, seq: Seq) {
        for b in seq.blocks {
            self.pool.release(b);
        }
    }

    /// Make sure `seq` has blocks for `tokens` tokens.
    fn grow(pool: &mut Pool, seq: &mut Seq, tokens: usize, block_size: usize) -> bool {
        while seq.blocks.len() * block_size < tokens {
            match pool.allocate() {
                Some(b) => seq.blocks.push(b),
                None => return false,
            }
        }
        true
    }

    /// Register blocks that became full (the KV of their tokens is computed).
    fn register_full(pool: &mut Pool, seq: &mut Seq, block_size: usize) {
        let full = seq.computed / block_size;
        while seq.hashes.len() < full {
            let i = seq.hashes.len();
            let parent = seq.hashes.last().map(|h| h.block_hash);
            let mut local = local_hash(&seq.tokens[i * block_size..(i + 1) * block_size]);
            if i == 0 {
                local = salted_local(seq.spec.salt, local);
            }
            let hash = BlockHash {
                block_hash: chain_hash(parent, local),
                tokens_hash: local,
            };
            pool.register(seq.blocks[i], parent, hash);
            seq.hashes.push(hash);
        }
    }

    fn preempt(&mut self, mut seq: Seq) {
        for b in seq.blocks.drain(..) {
            self.pool.release(b);
        }
        seq.computed = 0;
        seq.hashes.clear();
        seq.onboard.clear();
        seq.preemptions += 1;
        // Transferred KV is gone with the blocks: the prompt is computed here from now on.
        if matches!(seq.spec.role, SeqRole::Imported { .. }) {
            seq.spec.role = SeqRole::Full;
        }
        self.counters.preemptions += 1;
        tracing::debug!(
            seq = seq.id,
            preemptions = seq.preemptions,
            "Preempted a sequence"
        );
        self.enqueue(seq, true);
    }

    /// Plan one step, have `exec` compute it (it returns a token for each [`Work`] with
    /// `sample` set, in order), and advance the sequences. `exec` also gets the cached blocks
    /// evicted for this step (with offload tiers): their bytes are still there, to be copied
    /// out before anything is written. When `exec` fails nothing advances, and the error is
    /// returned with the ids of the sequences the step held.
    ///
    /// The steps, in order: [`Self::schedule_running`], [`Self::return_loaded`],
    /// [`Self::admit_waiting`], the executor over [`Self::work`], [`Self::advance`] and
    /// [`Self::retire_finished`].
    pub fn step(
        &mut self,
        exec: impl FnOnce(&[Work<'_>], &[Evicted]) -> Result<Vec<u32>, EngineError>,
    ) -> Result<StepOutcome, (EngineError, Vec<SeqId>)> {
        let mut out = StepOutcome::default();
        let mut budget = self.limits.max_num_batched_tokens;
        let mut scheduled: Vec<(usize, usize)> = Vec::new(); // (index in running, tokens)
        self.give_way(&mut out);
        self.schedule_running(&mut budget, &mut scheduled, &mut out);
        self.return_loaded();
        self.admit_waiting(&mut budget, &mut scheduled);
        // The sequences of one LoRA adapter side by side (stably, so the order is unchanged
        // where none has one): a backend then multiplies each adapter's rows as one run
        // instead of one product per sequence (the CUDA backend's cuBLAS calls).
        if scheduled
            .iter()
            .any(|&(i, _)| self.running[i].spec.lora.is_some())
        {
            scheduled.sort_by_key(|&(i, _)| self.running[i].spec.lora.as_ref().map(|a| a.id));
        }

        // Run: the executor computes the KV and samples where a sequence's KV is complete.
        let evicted = self.pool.take_evicted();
        let work = self.work(&scheduled);
        let wanted = work.iter().filter(|w| w.sample).count();
        let sampled = match exec(&work, &evicted) {
            Ok(t) if t.len() == wanted => t,
            result => {
                let e = match result {
                    Err(e) => e,
                    Ok(t) => EngineError::Internal(format!(
                        "the executor sampled {} tokens for {wanted} sequences",
                        t.len()
                    )),
                };
                let ids = work.iter().map(|w| w.id).collect();
                return Err((e, ids));
            }
        };
        drop(work);
        let finished = self.advance(scheduled, sampled, &mut out);
        self.retire_finished(finished, &mut out);
        Ok(out)
    }

    /// Preempts running sequences for waiting ones that come before them (vLLM's priority
    /// scheduling): with the batch full, each waiting sequence, best first, takes the place of
    /// the running one that comes last (the newest of equals) if that one comes strictly after
    /// it. Done before anything is scheduled, so that the
    /// places freed are filled in this step.
    fn give_way(&mut self, out: &mut StepOutcome) {
        let max = self.limits.max_num_seqs;
        let Some(best) = self.waiting.front() else {
            return;
        };
        if self.running.len() < max
            || self
                .running
                .iter()
                .all(|r| r.spec.precedence <= best.spec.precedence)
        {
            return;
        }
        // Running sequences, the first to give way first: the last in precedence, then the
        // newest (admitted last, so further back in `running`).
        let mut order: Vec<usize> = (0..self.running.len()).collect();
        order.sort_by(|&a, &b| {
            let (pa, pb) = (
                self.running[a].spec.precedence,
                self.running[b].spec.precedence,
            );
            pb.cmp(&pa).then(b.cmp(&a))
        });
        let mut order = order.into_iter();
        let mut victims = Vec::new();
        for w in self.waiting.iter().take(max) {
            match order.next() {
                Some(i) if self.running[i].spec.precedence > w.spec.precedence => victims.push(i),
                _ => break,
            }
        }
        // From the back, so that the indices left stay valid.
        victims.sort_unstable_by(|a, b| b.cmp(a));
        for i in victims {
            let seq = self.running.remove(i);
            out.preempted += 1;
            self.preempt(seq);
        }
    }

    /// Running sequences first, oldest first, within `budget`; the newest is preempted when
    /// blocks run out.
    fn schedule_running(
        &mut self,
        budget: &mut usize,
        scheduled: &mut Vec<(usize, usize)>,
        out: &mut StepOutcome,
    ) {
        let block_size = self.limits.block_size;
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let seq = &self.running[i];
            let want = (seq.tokens.len() - seq.computed).min((*budget).min(chunk_limit(seq)));
            let target = self.running[i].computed + want;
            loop {
                let seq = &mut self.running[i];
                if Self::grow(&mut self.pool, seq, target, block_size) {
                    scheduled.push((i, want));
                    *budget -= want;
                    i += 1;
                    break;
                }
                // Preempt from the back; if that is this sequence, it stops here.
                let victim = self.running.len() - 1;
                if victim == 0 && self.pool.active() as usize == self.running[0].blocks.len() {
                    // Alone, holding every block in use, and still short of one: the cache
                    // is smaller than this sequence. Preempting it would only recompute it
                    // into the same wall, forever; it ends here (`length`).
                    let seq = self.running.remove(0);
                    tracing::warn!(
                        seq = seq.id,
                        tokens = seq.tokens.len(),
                        "A sequence outgrew the whole KV cache; ending it"
                    );
                    out.ended.push(seq.id);
                    self.free(seq);
                    break;
                }
                let seq = self.running.remove(victim);
                out.preempted += 1;
                self.preempt(seq);
                if victim == i {
                    break;
                }
            }
        }
    }

    /// Sequences whose blocks arrived from a slower tier go back to the head of the queue.
    fn return_loaded(&mut self) {
        if let Some(lower) = &self.lower
            && !self.loading.is_empty()
        {
            let (ready, still): (Vec<Seq>, Vec<Seq>) = std::mem::take(&mut self.loading)
                .into_iter()
                .partition(|s| !lower.pending(&s.loading));
            self.loading = still;
            for seq in ready.into_iter().rev() {
                self.enqueue(seq, true);
            }
        }
    }

    /// Admit waiting sequences while the budget and the batch have room.
    fn admit_waiting(&mut self, budget: &mut usize, scheduled: &mut Vec<(usize, usize)>) {
        while *budget > 0 && self.running.len() < self.limits.max_num_seqs {
            let Some(seq) = self.waiting.pop_front() else {
                break;
            };
            match self.admit(seq, *budget) {
                Admitted::Running(want) => {
                    *budget -= want;
                    scheduled.push((self.running.len() - 1, want));
                }
                Admitted::Aside => {}
                Admitted::Blocked => break,
            }
        }
    }

    /// Admit `seq` with `budget` tokens left: its cached prefix (from the pool, or onboarded
    /// from a tier below it) and blocks for what it computes in this step.
    fn admit(&mut self, mut seq: Seq, budget: usize) -> Admitted {
        let budget = budget.min(chunk_limit(&seq));
        let block_size = self.limits.block_size;
        // Reuse cached full blocks, but always compute at least the last token — and none
        // when every position's output is wanted (the prompt's log-probabilities, a mean).
        let full = if seq.spec.every_position() && seq.generated == 0 {
            0
        } else {
            (seq.tokens.len() - 1) / block_size
        };
        let hashes =
            seq.spec
                .hashes
                .get(&seq.tokens[..full * block_size], block_size, seq.spec.salt);
        let seq_hashes: Vec<u64> = hashes.iter().map(|h| h.block_hash).collect();
        let hit = self.pool.cached_prefix(&seq_hashes);
        // Imported KV costs no compute, only blocks for the whole prompt.
        let imported = matches!(seq.spec.role, SeqRole::Imported { .. });
        // The prefix may go on in the tiers below the pool.
        let mut lower_ready = 0;
        if !imported
            && hit < full
            && let Some(lower) = self.lower.as_mut()
        {
            let rest = &seq_hashes[hit..];
            if !seq.fetched {
                seq.fetched = true;
                let coming = lower.fetch(rest);
                if coming > 0 {
                    seq.loading = rest.to_vec();
                    self.loading.push(seq);
                    return Admitted::Aside;
                }
            }
            lower_ready = lower.ready(rest);
        }
        if seq.preemptions == 0 {
            self.counters.prompt_blocks += full as u64;
            self.counters.prompt_blocks_hit += hit as u64;
        }
        let len = seq.tokens.len();
        let plan = |cached: usize| {
            let want = if imported {
                0
            } else {
                (len - cached * block_size).min(budget)
            };
            let reach = if imported {
                len
            } else {
                cached * block_size + want
            };
            (want, reach)
        };
        let (mut want, mut reach) = plan(hit + lower_ready);
        let new_blocks = reach.div_ceil(block_size) - hit;
        if new_blocks as u32 > self.pool.available() {
            self.enqueue(seq, true);
            return Admitted::Blocked;
        }
        let mut onboarded = 0;
        if lower_ready > 0
            && let Some(lower) = self.lower.as_mut()
        {
            seq.onboard = lower.take(&seq_hashes[hit..hit + lower_ready]);
            onboarded = seq.onboard.len();
            if onboarded < lower_ready {
                // A tier dropped a block since: compute from there (needs fewer blocks).
                (want, reach) = plan(hit + onboarded);
            }
            if seq.preemptions == 0 {
                self.counters.prompt_blocks_onboarded += onboarded as u64;
            }
        }
        for h in &hashes[..hit] {
            if let Some(b) = self.pool.acquire_cached(h.block_hash) {
                seq.blocks.push(b);
            }
        }
        seq.hashes = hashes[..hit].to_vec();
        seq.hit_blocks = hit;
        seq.computed = hit * block_size;
        if !Self::grow(&mut self.pool, &mut seq, reach, block_size) {
            // `available` said yes; only a bug gets here. Undo and wait.
            for b in seq.blocks.drain(..) {
                self.pool.release(b);
            }
            seq.hashes.clear();
            seq.computed = 0;
            seq.onboard.clear();
            self.enqueue(seq, true);
            return Admitted::Blocked;
        }
        if onboarded > 0 {
            // The onboarded blocks are written before this step computes anything: they
            // count as computed, and are findable from now on.
            seq.computed = (hit + onboarded) * block_size;
            Self::register_full(&mut self.pool, &mut seq, block_size);
        }
        if imported {
            seq.computed = reach;
            Self::register_full(&mut self.pool, &mut seq, block_size);
        }
        if seq.preemptions == 0 {
            self.unadmitted -= 1;
        }
        self.running.push(seq);
        Admitted::Running(want)
    }

    /// What the executor computes for the scheduled sequences.
    fn work(&self, scheduled: &[(usize, usize)]) -> Vec<Work<'_>> {
        scheduled
            .iter()
            .map(|&(i, n)| {
                let seq = &self.running[i];
                let import =
                    matches!(seq.spec.role, SeqRole::Imported { .. }) && seq.generated == 0;
                Work {
                    id: seq.id,
                    spec: &seq.spec,
                    tokens: &seq.tokens,
                    start: seq.computed,
                    len: n,
                    blocks: &seq.blocks,
                    sample: seq.computed + n == seq.tokens.len() && !import,
                    import,
                    import_skip: if import { seq.hit_blocks } else { 0 },
                    generated: seq.generated,
                    onboard: &seq.onboard,
                    onboard_at: seq.hit_blocks,
                }
            })
            .collect()
    }

    /// Advance the scheduled sequences by what was computed, append the sampled tokens and
    /// decide who finished; returns the ids of those.
    fn advance(
        &mut self,
        scheduled: Vec<(usize, usize)>,
        sampled: Vec<u32>,
        out: &mut StepOutcome,
    ) -> Vec<SeqId> {
        let block_size = self.limits.block_size;
        let mut sampled = sampled.into_iter();
        let mut finished = Vec::new();
        for (i, n) in scheduled {
            let seq = &mut self.running[i];
            if n == 1 && seq.generated > 0 {
                out.decode_seqs += 1;
            } else {
                out.prefill_tokens += n;
                self.counters.prefill_tokens += n as u64;
            }
            seq.computed += n;
            seq.onboard.clear();
            out.context_tokens += seq.computed;
            Self::register_full(&mut self.pool, seq, block_size);
            if seq.computed == seq.tokens.len() {
                let t = match seq.spec.role {
                    SeqRole::Imported { first_token } if seq.generated == 0 => first_token,
                    // Counted by the caller: one per sampling entry.
                    _ => sampled.next().unwrap_or_default(),
                };
                // Then what the grammar forced after it (fast-forward): output as sampled
                // tokens are, each checked for the end; their KV is computed next step.
                let forced = match &seq.spec.guide {
                    Some(g) => g.lock().take_forced(),
                    None => Vec::new(),
                };
                for t in std::iter::once(t).chain(forced) {
                    seq.tokens.push(t);
                    seq.generated += 1;
                    let finish = Self::finish(seq, t);
                    out.tokens.push((seq.id, t, finish));
                    if finish.is_some() {
                        finished.push(seq.id);
                        break;
                    }
                }
            }
        }
        finished
    }

    /// Whether `seq` ends with its latest token `t`, and why.
    fn finish(seq: &Seq, t: u32) -> Option<FinishReason> {
        let stopped = seq.spec.stop_tokens.contains(&t)
            && seq.spec.offset + seq.generated > seq.spec.min_tokens;
        if stopped {
            // A structured output its budget steered to an end was cut by it.
            let steered = seq.spec.guide.as_ref().is_some_and(|g| g.lock().steered());
            Some(if steered {
                FinishReason::Length
            } else {
                FinishReason::Stop
            })
        } else {
            (seq.generated >= seq.spec.max_tokens || seq.spec.role == SeqRole::Prefill)
                .then_some(FinishReason::Length)
        }
    }

    /// Finished sequences leave the batch; a prefill-only one keeps its blocks, pinned for the
    /// decode worker to pull.
    fn retire_finished(&mut self, finished: Vec<SeqId>, out: &mut StepOutcome) {
        for id in finished {
            if let Some(i) = self
                .running
                .iter()
                .position(|s| s.id == id && s.spec.role == SeqRole::Prefill)
            {
                // The blocks stay referenced until the decode worker has pulled them.
                let mut seq = self.running.remove(i);
                seq.tokens.truncate(seq.computed);
                out.pinned
                    .push((id, std::mem::take(&mut seq.blocks), seq.tokens));
            } else {
                self.remove(id);
            }
        }
    }
}

/// What admitting one waiting sequence came to.
enum Admitted {
    /// It runs in this step, computing this many tokens.
    Running(usize),
    /// It waits aside for blocks read from a slower tier.
    Aside,
    /// Not enough blocks: it is back at the head of the queue, and admission stops.
    Blocked,
}

#[cfg(test)]
mod fast_forward_tests;
#[cfg(test)]
mod tests;
