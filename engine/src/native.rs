//! The `native` engine: a Llama-family model (llama, qwen2, mistral checkpoints in
//! safetensors) computed by this project's own backends in `dyn-compute` — CPU everywhere, CUDA
//! where built with the `cuda` feature and a GPU is present.
//!
//! It runs on the shared engine loop and scheduler ([`super`]): the scheduler's blocks *are*
//! the backend's KV-cache blocks, so the KV events routers index describe real cached KV,
//! prefix-cache hits skip real compute, and a prefill worker's blocks are the bytes the
//! transfer agent moves. The executor turns each planned step into one batched forward pass
//! and samples with each request's parameters, seeded per position (see
//! [`dyn_compute::sample`]), so output does not depend on batching or preemption.
//!
//! ```yaml
//! decode:
//!   kind: decode
//!   inputs: [route]
//!   config: {engine: native, native: {device: auto, dtype: auto, num_blocks: 1024}}
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dyn_compute::backend::{Backend, KvShape, SeqStep};
use dyn_compute::model::gguf::GgufWeights as _;
use dyn_compute::model::{DType, ModelConfig, ModelWeights, gguf};
use dyn_compute::transfer::{BlockFormat, BlockLayout};
use dyn_core::{BuildCx, BuildError, Invalid};
use dyn_llm::model::ModelDir;
use serde::Deserialize;

use super::pool::BlockId;
use super::scheduler::Work;
use super::settings::{EngineSettings, SchedulerConfig, engine_section};
use super::{EngineError, EngineHandle, Executor, ImportCheck, Logprob};

/// Where the model runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// CUDA when this build has it and a GPU answers; otherwise CPU, with a warning.
    #[default]
    Auto,
    Cpu,
    Cuda,
}

/// The element type weights are kept in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DtypeChoice {
    /// The checkpoint's own (`torch_dtype`), f32 when it does not say; a GGUF file's
    /// quantized matrices stay quantized.
    #[default]
    Auto,
    F32,
    F16,
    Bf16,
}

impl DtypeChoice {
    /// The dtype named, or `None` for `auto` (the checkpoint decides).
    fn fixed(self) -> Option<DType> {
        match self {
            DtypeChoice::Auto => None,
            DtypeChoice::F32 => Some(DType::F32),
            DtypeChoice::F16 => Some(DType::F16),
            DtypeChoice::Bf16 => Some(DType::Bf16),
        }
    }
}

engine_section! {
    /// `config.native` of `decode` / `prefill` with `engine: native`.
    pub struct NativeConfig {
        scheduler: SchedulerConfig {
            num_blocks: 1024,
            block_size: 16,
            max_num_seqs: 64,
            max_num_batched_tokens: 2048,
            max_queued_requests: 1024,
            pin_ttl_s: 30.0,
        },
        /// Checkpoint directory (config.json and safetensors) or GGUF file, relative to the
        /// graph file; the graph's `model.path` when absent.
        pub model: Option<String> = None,
        pub device: DeviceChoice = DeviceChoice::Auto,
        pub dtype: DtypeChoice = DtypeChoice::Auto,
        /// CUDA device ordinal.
        pub gpu: usize = 0,
        /// CPU backend: compute threads (0: one per core). Each worker has its own pool.
        pub threads: usize = 0,
        /// Threads computing structured outputs' grammar masks beside the forward pass, then
        /// drawing the batch's tokens (0: a quarter of the cores, at least one, at most eight).
        pub sampler_threads: usize = 0,
        /// LoRA adapters kept in memory at once (least recently used evicted, read again
        /// from their files on demand); which adapters exist is the graph's `model.loras`
        /// and the ingress's `/v1/load_lora_adapter`.
        pub max_loras: usize = 8,
    }
}

impl NativeConfig {
    /// The engine loop's settings, for a model with `vocab` tokens.
    pub fn settings(&self, vocab: Option<u32>) -> EngineSettings {
        EngineSettings {
            scheduler: self.scheduler(),
            vocab_size: vocab,
            seed_from_prompt: false,
            offload: self.offload.clone(),
            offload_model: None,
            model: None,
            fast_forward: self.fast_forward,
            logprobs: true,
            loras: None,
        }
    }

    pub fn validate(&self, prefix: &str) -> Vec<Invalid> {
        let mut out = self.validate_shared(prefix);
        if self.max_loras == 0 {
            out.push(Invalid::field(
                format!("{prefix}max_loras"),
                "must be at least 1",
            ));
        }
        if self.device == DeviceChoice::Cuda && !dyn_compute::cuda_compiled() {
            out.push(Invalid::field(
                format!("{prefix}device"),
                "`cuda` needs a dyn built with `--features cuda` (or use `auto`)",
            ));
        }
        out
    }

    fn model_dir(&self, cx: &BuildCx) -> Result<PathBuf, BuildError> {
        match (&self.model, &cx.model) {
            (Some(p), _) => Ok(cx.resolve(p)),
            (None, Some(m)) => Ok(cx.resolve(&m.path)),
            (None, None) => Err(BuildError::new(
                "engine native needs a model: set `native.model` or the graph's `model.path`",
            )),
        }
    }
}

/// Load the model (on the blocking pool: it reads and converts every weight) and start a
/// worker on it.
pub async fn start(config: &NativeConfig, cx: &BuildCx) -> Result<Arc<EngineHandle>, BuildError> {
    let dir = config.model_dir(cx)?;
    let (c, d) = (config.clone(), dir.clone());
    let backend = tokio::task::spawn_blocking(move || load(&c, &d))
        .await
        .map_err(|e| BuildError::new(format!("model loading task failed: {e}")))??;
    tracing::info!(node = %cx.node, backend = %backend.describe(), "Native engine loaded");
    let format = BlockFormat {
        block_bytes: u32::try_from(backend.block_bytes())
            .map_err(|_| BuildError::new("a KV block is over 4 GiB: lower block_size"))?,
        layout: BlockLayout::LayerKvHeadSlotDim,
        dtype: backend.kv_dtype().into(),
    };
    let mut settings = config.settings(u32::try_from(backend.config().vocab).ok());
    settings.model = tokenizer(cx, &dir).await;
    if backend.lora() {
        let max =
            std::num::NonZeroUsize::new(config.max_loras).unwrap_or(std::num::NonZeroUsize::MIN);
        settings.loras = Some(Arc::new(crate::lora::LoraStore::new(
            backend.config().clone(),
            max,
            &cx.node,
            cx.instance_id.get(),
        )));
    } else {
        tracing::info!(node = %cx.node, "this backend runs no LoRA adapters: requests for one are refused here");
    }
    let import = ImportCheck {
        format,
        delay: Box::new(|_| Duration::ZERO),
        // Sizes, layout and dtype are checked against the offer; the bytes are KV.
        verify: Box::new(|_, _| Ok(())),
    };
    let g = &crate::metrics::GRAMMAR;
    let exec = NativeExec {
        backend,
        mask_seconds: g.mask_seconds.with_label_values(&[cx.node.as_str()]),
        wait_seconds: g.wait_seconds.with_label_values(&[cx.node.as_str()]),
        logprobs: Vec::new(),
        pooled: Default::default(),
        embeddings: Vec::new(),
        // A quarter of the cores by default: on a GPU machine they are idle during the
        // forward pass; on a small CPU one the backend's own threads need them.
        sampler_threads: match config.sampler_threads {
            0 => std::thread::available_parallelism()
                .map_or(1, |n| n.get() / 4)
                .clamp(1, 8),
            n => n,
        },
    };
    EngineHandle::start(settings, import, Box::new(exec), cx, "native").await
}

/// The model's tokenizer, for structured output: the graph's shared copy when the engine runs
/// the graph's model, else read from `dir`. `None` (structured requests refused) where it
/// cannot be read.
async fn tokenizer(cx: &BuildCx, dir: &std::path::Path) -> Option<Arc<ModelDir>> {
    if cx
        .model
        .as_ref()
        .is_some_and(|m| cx.resolve(&m.path) == dir)
    {
        return ModelDir::shared(cx).await.ok();
    }
    let d = dir.to_owned();
    match tokio::task::spawn_blocking(move || ModelDir::load("native", &d)).await {
        Ok(Ok(m)) => Some(Arc::new(m)),
        Ok(Err(e)) => {
            tracing::warn!(node = %cx.node, error = %e, "No tokenizer: structured output is unavailable on this worker");
            None
        }
        Err(_) => None,
    }
}

fn load(c: &NativeConfig, dir: &std::path::Path) -> Result<Box<dyn Backend>, BuildError> {
    let weights = if gguf::is_gguf(dir) {
        // A GGUF file: `auto` keeps quantized matrices quantized (the CPU backend multiplies
        // them as they are; CUDA widens them to f32), with f32 for the rest and the cache; a
        // dtype widens everything to it.
        let g = gguf::Gguf::open(dir).map_err(|e| BuildError::new(e.to_string()))?;
        let shape = g.config().map_err(|e| BuildError::new(e.to_string()))?;
        let (dtype, keep) = match c.dtype.fixed() {
            None => (DType::F32, true),
            Some(d) => (d, false),
        };
        g.weights(shape, dtype, keep)
            .map_err(|e| BuildError::new(e.to_string()))?
    } else {
        let shape = ModelConfig::load(dir).map_err(|e| BuildError::new(e.to_string()))?;
        let dtype = c.dtype.fixed().unwrap_or_else(|| {
            shape
                .torch_dtype
                .as_deref()
                .and_then(DType::from_torch)
                .unwrap_or(DType::F32)
        });
        // The shape read above decides the dtype; the checkpoint is read against it
        // (config.json once).
        dyn_compute::model::Checkpoint::open(dir)
            .and_then(|ck| ModelWeights::from_checkpoint(shape, &ck, dtype))
            .map_err(|e| BuildError::new(format!("{}: {e}", dir.display())))?
    };
    let kv = KvShape {
        num_blocks: c.num_blocks as usize,
        block_size: c.block_size as usize,
    };
    let cpu = |weights| -> Result<Box<dyn Backend>, BuildError> {
        Ok(Box::new(
            dyn_compute::cpu::CpuBackend::with_threads(weights, kv, c.threads)
                .map_err(|e| BuildError::new(e.to_string()))?,
        ))
    };
    match c.device {
        DeviceChoice::Cpu => cpu(weights),
        DeviceChoice::Cuda => cuda(&weights, kv, c.gpu).map_err(BuildError::new),
        DeviceChoice::Auto => {
            if !dyn_compute::cuda_compiled() {
                return cpu(weights);
            }
            match cuda(&weights, kv, c.gpu) {
                Ok(b) => Ok(b),
                Err(e) => {
                    tracing::warn!(error = %e, "No usable CUDA device; the native engine runs on CPU");
                    cpu(weights)
                }
            }
        }
    }
}

#[cfg(feature = "cuda")]
fn cuda(weights: &ModelWeights, kv: KvShape, ordinal: usize) -> Result<Box<dyn Backend>, String> {
    dyn_compute::cuda::load(weights, kv, ordinal).map_err(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &ModelWeights, _: KvShape, _: usize) -> Result<Box<dyn Backend>, String> {
    Err("this dyn was built without the `cuda` feature".into())
}

struct NativeExec {
    backend: Box<dyn Backend>,
    /// `dyn_worker_grammar_{mask,wait}_seconds` of this node.
    mask_seconds: prometheus::Histogram,
    wait_seconds: prometheus::Histogram,
    /// What the last step computed for sequences asking for log-probabilities.
    logprobs: Vec<(crate::scheduler::SeqId, Logprob)>,
    /// Threads that compute grammar masks beside the forward pass and draw tokens after it.
    sampler_threads: usize,
    /// Mean-pooled embeddings part way: the sum of the hidden states so far and their count.
    pooled: std::collections::HashMap<crate::scheduler::SeqId, (Vec<f32>, usize)>,
    /// The embeddings the last step finished.
    embeddings: Vec<(crate::scheduler::SeqId, Vec<f32>)>,
}

/// One sampled sequence's part of a step: its work, its logits, its grammar mask.
type Job<'a, 'w> = (
    &'a Work<'w>,
    Vec<f32>,
    Option<llguidance::toktrie::SimpleVob>,
);

/// The token for one sequence: its penalties and mask applied to its logits, the draw, the
/// grammar advanced; with its log-probability where the request asked (the model's own,
/// taken before anything adjusts the logits).
fn sample_one((w, mut l, mask): Job<'_, '_>) -> (u32, Option<Logprob>) {
    let raw = w.spec.logprobs.map(|top| (l.clone(), top));
    if let Some(p) = &w.spec.penalties {
        // The prompt is what came before the request's own output (a migrated request's
        // earlier tokens count as output).
        let prompt = w.spec.prompt_len();
        let (prompt, output) = w.tokens.split_at(prompt.min(w.tokens.len()));
        p.apply(&mut l, prompt, output);
    }
    if let Some(mask) = &mask {
        dyn_llm::grammar::apply(mask, &mut l);
    }
    let t = dyn_compute::sample::sample(&l, &w.spec.sampling, w.tokens.len() as u64);
    if let Some(g) = &w.spec.guide {
        g.lock().commit(t);
    }
    let lp = raw.map(|(raw, top)| Logprob::Sampled(token_logprob(&raw, t, top)));
    (t, lp)
}

/// `guided` (which sampled sequences have a grammar) cut into at most `threads` contiguous
/// ranges with as many guided sequences each as can be, covering every sequence in order.
fn mask_groups(guided: &[bool], threads: usize) -> Vec<std::ops::Range<usize>> {
    let total = guided.iter().filter(|g| **g).count();
    let per = total.div_ceil(threads.clamp(1, total.max(1))).max(1);
    let mut groups = Vec::new();
    let (mut start, mut count) = (0, 0);
    for (i, g) in guided.iter().enumerate() {
        count += usize::from(*g);
        if count == per || i + 1 == guided.len() {
            groups.push(start..i + 1);
            (start, count) = (i + 1, 0);
        }
    }
    groups
}

/// `token`'s log-probability under `logits` and the `top` most likely tokens', best first
/// (ties by id); floored at -9999, as vLLM reports an impossible token.
fn token_logprob(logits: &[f32], token: u32, top: u32) -> dyn_protocol::types::TokenLogprob {
    let lse = dyn_compute::sample::logsumexp(logits);
    let lp = |x: f32| (x - lse).max(-9999.0);
    dyn_protocol::types::TokenLogprob {
        token,
        logprob: lp(logits
            .get(token as usize)
            .copied()
            .unwrap_or(f32::NEG_INFINITY)),
        top: dyn_compute::sample::top_n(logits, top as usize)
            .into_iter()
            .map(|i| (i, lp(logits[i as usize])))
            .collect(),
    }
}

/// Per sampled sequence, the grammar's mask of allowed tokens (`None`: unconstrained).
type Masks = Vec<Option<llguidance::toktrie::SimpleVob>>;

impl NativeExec {
    /// The forward pass, with the structured outputs' masks computed on helper threads
    /// meanwhile (a mask takes tens of microseconds to milliseconds of CPU, a step's forward
    /// pass longer): the masks are ready when the logits are.
    fn forward_masked(
        &mut self,
        batch: &[SeqStep<'_>],
        sampled: &[&Work<'_>],
    ) -> Result<(Vec<Vec<f32>>, Masks), EngineError> {
        if sampled.iter().all(|w| w.spec.guide.is_none()) {
            return Ok((self.backend.forward(batch)?, vec![None; sampled.len()]));
        }
        let vocab = self.backend.config().vocab;
        let backend = &mut self.backend;
        // Guided sequences in as many groups as there are helper threads, each group's masks
        // on its own thread.
        let flags: Vec<bool> = sampled.iter().map(|w| w.spec.guide.is_some()).collect();
        let groups: Vec<&[&Work<'_>]> = mask_groups(&flags, self.sampler_threads)
            .into_iter()
            .map(|r| &sampled[r])
            .collect();
        let (logits, masks) = std::thread::scope(|s| {
            let helpers: Vec<_> = groups
                .into_iter()
                .map(|group| {
                    s.spawn(move || {
                        let started = std::time::Instant::now();
                        let masks = group
                            .iter()
                            .map(|w| w.spec.guide.as_ref().map(|g| g.lock().mask(vocab)))
                            .collect::<Masks>();
                        (masks, started.elapsed())
                    })
                })
                .collect();
            let logits = backend.forward(batch);
            let waited = std::time::Instant::now();
            let mut masks: Option<Masks> = Some(Vec::with_capacity(sampled.len()));
            let mut longest = std::time::Duration::ZERO;
            for h in helpers {
                match (h.join(), &mut masks) {
                    (Ok((m, took)), Some(all)) => {
                        all.extend(m);
                        longest = longest.max(took);
                    }
                    _ => masks = None,
                }
            }
            self.wait_seconds.observe(waited.elapsed().as_secs_f64());
            self.mask_seconds.observe(longest.as_secs_f64());
            (logits, masks)
        });
        let masks =
            masks.ok_or_else(|| EngineError::Internal("a grammar mask thread panicked".into()))?;
        Ok((logits?, masks))
    }
}

impl Executor for NativeExec {
    fn execute(&mut self, work: &[Work<'_>]) -> Result<Vec<u32>, EngineError> {
        use dyn_protocol::types::Pooling;
        // What a failed step left is not this step's.
        self.logprobs.clear();
        self.embeddings.clear();
        // A sequence whose prompt's log-probabilities are wanted gets the logits after every
        // prompt token it computes this step (chunk by chunk), not only the last.
        let prompt_rows = |w: &Work<'_>| {
            w.spec.prompt_logprobs.is_some()
                && w.spec.embed.is_none()
                && w.generated == 0
                && !w.import
                && w.len > 0
        };
        // A mean-pooled embedding wants every prompt position's hidden state, chunk by chunk.
        let mean_rows = |w: &Work<'_>| w.spec.embed == Some(Pooling::Mean) && w.len > 0;
        let computed: Vec<&Work<'_>> = work.iter().filter(|w| w.len > 0).collect();
        let batch: Vec<SeqStep<'_>> = computed
            .iter()
            .map(|w| SeqStep {
                tokens: &w.tokens[w.start..w.start + w.len],
                start: w.start,
                blocks: w.blocks,
                logits: w.sample || prompt_rows(w) || mean_rows(w),
                all_logits: prompt_rows(w) || mean_rows(w),
                hidden: w.spec.embed.is_some(),
                lora: w.spec.lora.as_deref(),
            })
            .collect();
        // Logits come in batch order: a row for each sampling entry (which all have new
        // tokens), after the rows of its prompt positions where those were asked for. An
        // embeddings sequence gets hidden states instead, and samples nothing.
        let sampled: Vec<&Work<'_>> = work
            .iter()
            .filter(|w| w.sample && w.spec.embed.is_none())
            .collect();
        let (rows, masks) = self.forward_masked(&batch, &sampled)?;
        let mut rows = rows.into_iter();
        let too_few = || EngineError::Internal("the backend returned too few rows".into());
        let mut logits = Vec::with_capacity(sampled.len());
        for w in &computed {
            if let Some(pooling) = w.spec.embed {
                let last = match pooling {
                    Pooling::Last => match w.sample {
                        true => Some(rows.next().ok_or_else(too_few)?),
                        false => None,
                    },
                    Pooling::Mean => {
                        let (sum, n) = self.pooled.entry(w.id).or_default();
                        if w.start == 0 {
                            // The first chunk, or a recompute from the start.
                            sum.clear();
                            *n = 0;
                        }
                        for _ in 0..w.len {
                            let r = rows.next().ok_or_else(too_few)?;
                            if sum.is_empty() {
                                sum.resize(r.len(), 0.0);
                            }
                            sum.iter_mut().zip(&r).for_each(|(s, x)| *s += x);
                            *n += 1;
                        }
                        match w.sample {
                            true => self.pooled.remove(&w.id).map(|(mut sum, n)| {
                                let n = n.max(1) as f32;
                                sum.iter_mut().for_each(|s| *s /= n);
                                sum
                            }),
                            false => None,
                        }
                    }
                };
                if let Some(v) = last {
                    self.embeddings
                        .push((w.id, dyn_protocol::types::normalized(v)));
                }
                continue;
            }
            if prompt_rows(w) {
                let prompt = w.spec.prompt_len();
                let top = w.spec.prompt_logprobs.unwrap_or(0);
                // Row j predicts position start + j + 1; the last row of the prompt's last
                // chunk predicts the first output token, sampled below.
                let n = if w.sample { w.len - 1 } else { w.len };
                let mut items = Vec::with_capacity(n);
                for pos in w.start + 1..w.start + 1 + n {
                    let l = rows.next();
                    let t = w.tokens.get(pos).filter(|_| pos < prompt);
                    if let (Some(l), Some(&t)) = (l, t) {
                        items.push(token_logprob(&l, t, top));
                    }
                }
                self.logprobs.push((
                    w.id,
                    Logprob::Prompt {
                        at: w.start + 1,
                        items,
                    },
                ));
            }
            if w.sample {
                logits.push(rows.next().ok_or_else(too_few)?);
            }
        }
        let guided = masks.iter().any(Option::is_some);
        let mut jobs: Vec<Job<'_, '_>> = sampled
            .iter()
            .copied()
            .zip(logits)
            .zip(masks)
            .map(|((w, l), m)| (w, l, m))
            .collect();
        // A draw over the vocabulary takes tens of microseconds, with a grammar's mask and
        // advance up to a millisecond: a batch's are spread over the sampler threads.
        let threads = if guided || jobs.len() >= 4 {
            self.sampler_threads
        } else {
            1
        };
        let per = jobs.len().div_ceil(threads.max(1)).max(1);
        let mut groups = Vec::new();
        while jobs.len() > per {
            let rest = jobs.split_off(per);
            groups.push(std::mem::replace(&mut jobs, rest));
        }
        groups.push(jobs);
        let done: Vec<(u32, Option<Logprob>)> = if groups.len() == 1 {
            groups.into_iter().flatten().map(sample_one).collect()
        } else {
            std::thread::scope(|s| {
                let helpers: Vec<_> = groups
                    .into_iter()
                    .map(|g| s.spawn(move || g.into_iter().map(sample_one).collect::<Vec<_>>()))
                    .collect();
                helpers
                    .into_iter()
                    .map(|h| h.join())
                    .collect::<Result<Vec<_>, _>>()
            })
            .map_err(|_| EngineError::Internal("a sampling thread panicked".into()))?
            .into_iter()
            .flatten()
            .collect()
        };
        // One token per sampling work, in order; an embeddings sequence's is a placeholder
        // that goes nowhere (its answer is its vector).
        let mut done = done.into_iter();
        let mut out = Vec::with_capacity(sampled.len());
        for w in work.iter().filter(|w| w.sample) {
            if w.spec.embed.is_some() {
                out.push(0);
                continue;
            }
            let (t, lp) = done.next().ok_or_else(too_few)?;
            if let Some(lp) = lp {
                self.logprobs.push((w.id, lp));
            }
            out.push(t);
        }
        Ok(out)
    }

    fn take_logprobs(&mut self) -> Vec<(crate::scheduler::SeqId, Logprob)> {
        std::mem::take(&mut self.logprobs)
    }

    fn take_embeddings(&mut self) -> Vec<(crate::scheduler::SeqId, Vec<f32>)> {
        std::mem::take(&mut self.embeddings)
    }

    fn forget(&mut self, id: crate::scheduler::SeqId) {
        self.pooled.remove(&id);
    }

    fn export(&mut self, blocks: &[BlockId], _tokens: &[u32]) -> Result<Vec<Bytes>, EngineError> {
        // One buffer, split: the blocks lie back to back, as a UCX transfer registers them.
        let bb = self.backend.block_bytes();
        let mut all = Bytes::from(self.backend.export_blocks_packed(blocks)?);
        if all.len() != blocks.len() * bb {
            return Err(EngineError::Mismatch(format!(
                "{} bytes exported for {} blocks of {bb}",
                all.len(),
                blocks.len()
            )));
        }
        Ok(blocks.iter().map(|_| all.split_to(bb)).collect())
    }

    fn import(&mut self, blocks: &[BlockId], data: Vec<Bytes>) -> Result<(), EngineError> {
        let data: Vec<&[u8]> = data.iter().map(|b| b.as_ref()).collect();
        Ok(self.backend.import_blocks(blocks, &data)?)
    }

    fn export_cached(&mut self, blocks: &[BlockId], _: &[u64]) -> Result<Vec<Bytes>, EngineError> {
        let data = self.backend.save_blocks(blocks)?;
        Ok(data.into_iter().map(Bytes::from).collect())
    }

    fn onboard(&mut self, blocks: &[BlockId], data: Vec<Bytes>) -> Result<(), EngineError> {
        let data: Vec<&[u8]> = data.iter().map(|b| b.as_ref()).collect();
        Ok(self.backend.load_blocks(blocks, &data)?)
    }

    fn offload_layout(&self) -> String {
        self.backend.saved_layout().into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu_here() -> bool {
        #[cfg(feature = "cuda")]
        return dyn_compute::cuda::driver_present();
        #[cfg(not(feature = "cuda"))]
        false
    }

    #[test]
    fn auto_falls_back_to_cpu_and_cuda_without_a_gpu_is_a_clean_error() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tiny");
        let small = NativeConfig {
            num_blocks: 8,
            ..NativeConfig::default()
        };
        let auto = load(&small, &dir).expect("auto always finds a device");
        if !gpu_here() {
            assert!(auto.describe().starts_with("cpu"), "{}", auto.describe());
            let cuda = NativeConfig {
                device: DeviceChoice::Cuda,
                ..small
            };
            let Err(e) = load(&cuda, &dir) else {
                panic!("device: cuda without a GPU must fail");
            };
            let e = e.to_string();
            assert!(
                e.contains("no CUDA driver") || e.contains("without the `cuda` feature"),
                "{e}"
            );
        }
    }

    /// An embeddings request through the engine (on whichever device `auto` finds): its one
    /// item, with the vector and no tokens.
    async fn embed(
        engine: &crate::EngineHandle,
        prompt: &[u32],
        pooling: dyn_protocol::types::Pooling,
    ) -> Vec<f32> {
        use dyn_protocol::types::Generated;
        use futures::StreamExt;
        let mut req = dyn_protocol::testing::preprocessed(prompt.to_vec(), 1);
        req.sampling.embed = Some(pooling);
        let rx = engine.submit(&req, None, None).await.expect("submitted");
        let items: Vec<_> = crate::handle::request_items(rx).collect().await;
        let mut found = None;
        for item in items {
            if let Generated::Tokens { ids, embedding, .. } = item.expect("no error") {
                assert!(ids.is_empty(), "an embedding outputs no tokens: {ids:?}");
                found = found.or(embedding);
            }
        }
        found.expect("an embedding came back")
    }

    fn close(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// Embeddings are the same however the prompt is computed: in one step or in chunks,
    /// from the prefix cache (last token) or not (mean), alone or sharing batches with
    /// generation, which itself is unchanged by them; and they are unit vectors of the model's
    /// width.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn embeddings_agree_across_chunks_cache_hits_and_shared_batches() {
        use dyn_protocol::types::{Generated, Pooling};
        use futures::StreamExt;
        let planes = dyn_core::planes::Planes::embedded();
        let cx = dyn_protocol::testing::cx("decode", 7, &[], &planes);
        let whole = start(&NativeConfig::default(), &cx).await.expect("starts");
        let chunked = start(
            &NativeConfig {
                max_num_batched_tokens: 16,
                ..NativeConfig::default()
            },
            &cx,
        )
        .await
        .expect("starts");
        let prompt: Vec<u32> = (0..45u32).map(|t| 1 + t * 7 % 200).collect();
        for pooling in [Pooling::Last, Pooling::Mean] {
            let a = embed(&whole, &prompt, pooling).await;
            let norm: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
            assert!((norm - 1.0).abs() < 1e-5, "{norm}");
            // Again: its blocks are cached now (a last-token embedding computes only the
            // last token; a mean one computes all again).
            let again = embed(&whole, &prompt, pooling).await;
            assert!(close(&a, &again) < 1e-5, "{pooling:?} from the cache");
            let chunks = embed(&chunked, &prompt, pooling).await;
            assert!(close(&a, &chunks) < 1e-5, "{pooling:?} in chunks");
        }
        let last = embed(&whole, &prompt, Pooling::Last).await;
        let mean = embed(&whole, &prompt, Pooling::Mean).await;
        assert!(close(&last, &mean) > 1e-3, "last and mean pool differently");

        // Generation beside embeddings: the same tokens as alone.
        async fn generate(engine: &crate::EngineHandle) -> Vec<u32> {
            let mut req = dyn_protocol::testing::preprocessed(vec![5, 9, 13, 2], 24);
            req.sampling.temperature = Some(0.0);
            req.stop.ignore_eos = true;
            let rx = engine.submit(&req, None, None).await.expect("submitted");
            crate::handle::request_items(rx)
                .filter_map(|i| async move {
                    match i.expect("no error") {
                        Generated::Tokens { ids, .. } => Some(ids),
                        _ => None,
                    }
                })
                .concat()
                .await
        }
        let alone = generate(&whole).await;
        let prompts: Vec<Vec<u32>> = (0..6u32)
            .map(|i| (0..30 + i).map(|t| 2 + (t * 11 + i) % 190).collect())
            .collect();
        let (beside, vectors) = tokio::join!(
            generate(&whole),
            futures::future::join_all(prompts.iter().map(|p| embed(&whole, p, Pooling::Last)))
        );
        assert_eq!(alone, beside);
        for (p, v) in prompts.iter().zip(&vectors) {
            assert!(close(v, &embed(&chunked, p, Pooling::Last).await) < 1e-5);
        }
    }

    /// Structured outputs on whichever device `auto` finds (the GPU in `scripts/gpu-check`):
    /// guided and free sequences share batches, and every guided answer is valid.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn guided_and_free_sequences_share_a_batch_and_guided_answers_are_valid() {
        use dyn_protocol::types::{Constraint, Generated};
        use futures::StreamExt;
        let planes = dyn_core::planes::Planes::embedded();
        let cx = dyn_protocol::testing::cx("decode", 7, &[], &planes);
        // Three grammar threads: masks and draws spread over helpers, as on a GPU machine.
        let config = NativeConfig {
            sampler_threads: 3,
            ..NativeConfig::default()
        };
        let engine = start(&config, &cx).await.expect("starts");
        let dir = dyn_llm::model::ModelDir::load(
            "tiny",
            std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../models/tiny")),
        )
        .expect("tokenizer");
        let schema = serde_json::json!({
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
            "required": ["name", "n"], "additionalProperties": false
        });
        let constraints = [
            Some(Constraint::JsonSchema(schema)),
            None,
            Some(Constraint::Choice(vec![
                "over the hills".into(),
                "under the sea".into(),
            ])),
            None,
            Some(Constraint::Regex("[0-9]{3}-[a-z]{2,5}".into())),
            Some(Constraint::JsonObject),
        ];
        let streams: Vec<_> = constraints
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let prompt: Vec<u32> = (0..20 + 7 * i as u32).map(|t| 1 + t * 3 % 200).collect();
                let mut req = dyn_protocol::testing::preprocessed(prompt, 48);
                req.stop.eos_token_ids = dir.eos_token_ids.clone();
                req.sampling.temperature = Some(0.8);
                req.sampling.constraint = c.clone();
                req.stop.ignore_eos = c.is_none();
                let engine = &engine;
                async move {
                    let rx = engine.submit(&req, None, None).await.expect("submitted");
                    crate::handle::request_items(rx).collect::<Vec<_>>().await
                }
            })
            .collect();
        for (c, items) in constraints
            .iter()
            .zip(futures::future::join_all(streams).await)
        {
            let mut ids = Vec::new();
            for item in items {
                if let Generated::Tokens { ids: t, .. } = item.expect("no error") {
                    ids.extend(t);
                }
            }
            if c.is_none() {
                assert_eq!(ids.len(), 48);
                continue;
            }
            ids.retain(|t| !dir.eos_token_ids.contains(t));
            let text = dir.tokenizer.decode(&ids, true).expect("decodes");
            match c {
                Some(Constraint::JsonSchema(_)) => {
                    let v: serde_json::Value = serde_json::from_str(&text).expect(&text);
                    assert!(v["name"].is_string() && v["n"].is_i64(), "{text}");
                    assert_eq!(v.as_object().map(|o| o.len()), Some(2), "{text}");
                }
                Some(Constraint::Choice(cs)) => assert!(cs.contains(&text), "{text:?}"),
                Some(Constraint::Regex(_)) => {
                    let (num, word) = text.split_once('-').expect(&text);
                    assert!(
                        num.len() == 3 && num.bytes().all(|b| b.is_ascii_digit()),
                        "{text}"
                    );
                    assert!(word.bytes().all(|b| b.is_ascii_lowercase()), "{text}");
                }
                Some(Constraint::JsonObject) => {
                    // 48 tokens may cut a free-form object short; what there is must be a
                    // prefix of an object.
                    assert!(text.starts_with('{'), "{text}");
                    if text.ends_with('}') {
                        serde_json::from_str::<serde_json::Value>(&text).expect(&text);
                    }
                }
                None | Some(Constraint::Lark(_) | Constraint::Calls(_)) => unreachable!(),
            }
        }
    }

    #[test]
    fn mask_groups_split_the_guided_sequences_evenly_and_cover_all() {
        let g = [true, false, true, true, false, true, true];
        assert_eq!(mask_groups(&g, 1), vec![0..7]);
        assert_eq!(mask_groups(&g, 2), vec![0..4, 4..7]);
        assert_eq!(mask_groups(&g, 5), vec![0..1, 1..3, 3..4, 4..6, 6..7]);
        assert_eq!(mask_groups(&g, 64), mask_groups(&g, 5));
        assert_eq!(mask_groups(&[false, true], 4), vec![0..2]);
    }

    #[test]
    fn a_bad_model_directory_is_an_error() {
        let Err(e) = load(
            &NativeConfig::default(),
            std::path::Path::new("/nonexistent"),
        ) else {
            panic!("no model there");
        };
        assert!(e.to_string().contains("config.json"), "{e}");
    }
}
