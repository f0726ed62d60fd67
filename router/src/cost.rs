//! The `kv` policy's price of each worker for one prompt, and the choice among them.
//!
//! Two cost models ([`CostModel`]):
//!
//! - `time` (the default): the worker's predicted time to first token for this prompt —
//!   its prefill queue (prompt tokens routed or waiting there and not computed yet) and the
//!   prompt's own uncached tokens, in milliseconds from the step time and per-token prefill
//!   cost the worker measures and reports (`dyn_engine::step_model`) — with the prompt's
//!   own prefill weighted by `miss_weight`. At 1 that is the request's TTFT alone; above 1 a
//!   cache miss also pays for what it does to the others: the compute they wait behind and
//!   the cached prefix it evicts. A cached prefix thus keeps its requests home until the home
//!   worker's queue is `miss_weight × the saved prefill` longer than elsewhere, however many
//!   requests are decoding there; a load of one more request no longer outweighs it.
//! - `blocks` (Dynamo's): `overlap_weight × uncached prompt blocks + decode blocks`.
//!
//! Either way a prompt's blocks count as cached on a worker if the index says so or if this
//! router's own active requests there hold them (a burst of siblings follows the first one
//! before any KV event arrives). Then bounds apply, as in consistent hashing with bounded
//! loads, SGLang's balance thresholds and Dynamo's busy thresholds: a worker whose requests
//! would pass both `load_bound × the mean` and `load_slack` above the least loaded worker, or
//! whose KV usage or prefill queue passes a busy threshold, is left out while any worker is
//! not. [`choose`] takes the cheapest of the rest (ties: fewer requests, then fewer
//! cached blocks — the emptier cache takes new prefixes — then at random), or samples a softmax
//! over normalised costs with `temperature > 0`.

use rand::Rng;
use serde::{Deserialize, Serialize};

use super::sequences::{Load, Reported};
use dyn_protocol::kv::LoadMetrics;

/// How a worker is priced.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CostModel {
    #[default]
    Time,
    Blocks,
}

/// The `kv` policy's settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pricing {
    pub model: CostModel,
    /// `blocks`: weight of uncached prompt blocks against decode blocks.
    pub overlap_weight: f64,
    /// `time`: weight of the prompt's own uncached prefill time against queueing.
    pub miss_weight: f64,
    /// Share of a cached block that counts as cached (Dynamo's `overlap_score_credit`).
    pub overlap_credit: f64,
    /// Share of a block held only in host memory, and only on disk, that counts as cached
    /// (it is onboarded, not recomputed).
    pub tier_credit: [f64; 2],
    /// Leave out workers whose requests would pass this × the mean (0 = no bound)...
    pub load_bound: f64,
    /// ... and this many more than the least loaded worker's (small loads are not skewed).
    pub load_slack: u32,
    /// Leave out workers whose KV usage (0..1) passes this.
    pub busy_kv_usage: Option<f64>,
    /// Leave out workers with more prompt tokens than this waiting for prefill.
    pub busy_prefill_tokens: Option<u64>,
    pub temperature: f64,
    /// Step time and prefill cost for workers that report none (nor does any other).
    pub step_ms: f64,
    pub prefill_ms_per_token: f64,
    /// `time`: the cost of a LoRA adapter's request on a worker without the adapter.
    pub lora_load_ms: f64,
}

impl Default for Pricing {
    fn default() -> Self {
        Self {
            model: CostModel::Time,
            overlap_weight: 1.0,
            miss_weight: 2.0,
            overlap_credit: 1.0,
            tier_credit: [0.75, 0.25],
            load_bound: 2.0,
            load_slack: 8,
            busy_kv_usage: None,
            busy_prefill_tokens: None,
            temperature: 0.0,
            step_ms: 5.0,
            prefill_ms_per_token: 0.02,
            lora_load_ms: 200.0,
        }
    }
}

/// What the router knows of one live worker for one prompt.
#[derive(Debug, Clone, Default)]
pub struct WorkerView<'a> {
    pub worker: u64,
    /// Leading prompt blocks the KV index says it caches (in any tier)...
    pub indexed_blocks: usize,
    /// ... of which only in host memory, and only on disk.
    pub indexed_lower: [usize; 2],
    /// Leading prompt blocks this router's active requests there hold.
    pub pending_blocks: usize,
    /// This router's load there, `decode_blocks` counting the prompt's blocks it would add.
    pub load: Load,
    /// Blocks the index holds for it in all (the tie-break toward emptier caches).
    pub cached_total: usize,
    /// Its last load metrics, and this router's load there when they arrived.
    pub reported: Option<&'a Reported>,
    /// The request runs with a LoRA adapter this worker is not known to hold.
    pub lora_missing: bool,
}

/// One worker's terms for one prompt: the decision and what `dyn inspect route` shows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// `worker_id` in JSON, a hex string as logs and `/metrics` print worker ids.
    #[serde(rename = "worker_id", with = "hex_id")]
    pub worker: u64,
    /// Leading prompt blocks counted as cached: the larger of `indexed` and `pending`.
    pub matched_blocks: usize,
    pub indexed_blocks: usize,
    /// Of the indexed blocks, those only in host memory and only on disk (onboarded, credited
    /// at `host_credit` / `disk_credit`).
    #[serde(default)]
    pub host_blocks: usize,
    #[serde(default)]
    pub disk_blocks: usize,
    pub pending_blocks: usize,
    /// Prompt blocks and tokens it would have to prefill.
    pub prefill_blocks: usize,
    pub prefill_tokens: usize,
    /// This router's outstanding work there.
    pub load: Load,
    /// Requests there: the other routers' as last reported (running + waiting less this
    /// router's then) plus this router's now.
    pub requests: u32,
    /// Prompt tokens queued for prefill there, counted the same way.
    pub queued_tokens: u64,
    /// Predicted wait before this prompt's prefill, and the prefill itself (`time` model),
    /// a LoRA adapter's first read there included.
    pub queue_ms: f64,
    pub prefill_ms: f64,
    /// Of `prefill_ms`, the adapter's read (`time` model; 0 where it holds the adapter).
    #[serde(default)]
    pub lora_ms: f64,
    pub cost: f64,
    /// Why it was left out, if it was.
    pub excluded: Option<String>,
}

impl Candidate {
    /// Predicted time to first token, milliseconds (`time` model).
    pub fn ttft_ms(&self) -> f64 {
        self.queue_ms + self.prefill_ms
    }
}

/// A worker's step time and prefill cost per token: its own report, else the mean of the
/// others' reports, else the configured defaults.
fn speeds(workers: &[WorkerView<'_>], p: &Pricing) -> Vec<(f64, f64)> {
    let mean = |f: fn(&LoadMetrics) -> f64, default: f64| {
        let (sum, n) = workers
            .iter()
            .filter_map(|w| w.reported.map(|r| f(&r.metrics)))
            .filter(|v| *v > 0.0)
            .fold((0.0, 0.0), |(s, n), v| (s + v, n + 1.0));
        if n > 0.0 { sum / n } else { default }
    };
    let step = mean(|m| m.step_ms, p.step_ms);
    let per_token = mean(|m| m.prefill_ms_per_token, p.prefill_ms_per_token);
    workers
        .iter()
        .map(|w| {
            let own = |f: fn(&LoadMetrics) -> f64, fallback| {
                w.reported
                    .map(|r| f(&r.metrics))
                    .filter(|v| *v > 0.0)
                    .unwrap_or(fallback)
            };
            (
                own(|m| m.step_ms, step),
                own(|m| m.prefill_ms_per_token, per_token),
            )
        })
        .collect()
}

/// Price every live worker for a prompt of `prompt_tokens` tokens (`prompt_blocks` blocks of
/// `block_size`, counting a last partial one).
pub fn candidates(
    workers: &[WorkerView<'_>],
    prompt_tokens: usize,
    prompt_blocks: usize,
    block_size: usize,
    p: &Pricing,
) -> Vec<Candidate> {
    let speeds = speeds(workers, p);
    let mut out: Vec<Candidate> = workers
        .iter()
        .zip(speeds)
        .map(|(w, (step_ms, per_token))| {
            let matched = w.indexed_blocks.max(w.pending_blocks).min(prompt_blocks);
            // Blocks below the pool cost an onboard: each counts for its tier's credit. This
            // router's own requests' blocks are in the pool.
            let [host, disk] = w.indexed_lower;
            let onboard_cost =
                host as f64 * (1.0 - p.tier_credit[0]) + disk as f64 * (1.0 - p.tier_credit[1]);
            let effective = (w.indexed_blocks as f64 - onboard_cost)
                .max(w.pending_blocks as f64)
                .min(matched as f64);
            let credited = (effective * p.overlap_credit).floor() as usize;
            let prefill_blocks = prompt_blocks - credited;
            let prefill_tokens = prompt_tokens.saturating_sub(credited * block_size);
            // The worker's report counts every router's requests as of then: the others' are
            // the report less this router's then, to which this router's now are added (with
            // several routers, each sees the others' through the reports). Never less than
            // this router's own count.
            let own = w.load;
            let requests = w.reported.map_or(own.requests, |r| {
                let (m, then) = (&r.metrics, r.own_then);
                let reported = m.requests_running.saturating_add(m.requests_waiting);
                reported
                    .saturating_sub(then.requests)
                    .saturating_add(own.requests)
            });
            let queued_tokens = w.reported.map_or(own.prefill_tokens, |r| {
                r.metrics
                    .pending_prefill_tokens
                    .saturating_sub(r.own_then.prefill_tokens)
                    .saturating_add(own.prefill_tokens)
            });
            // A busy worker is mid-step: half a step on average before this prompt joins.
            let in_step = if requests > 0 { step_ms / 2.0 } else { 0.0 };
            let queue_ms = in_step + queued_tokens as f64 * per_token;
            let own_ms = prefill_tokens as f64 * per_token;
            let lora_ms = if w.lora_missing { p.lora_load_ms } else { 0.0 };
            let cost = match p.model {
                CostModel::Time => queue_ms + step_ms + p.miss_weight * own_ms + lora_ms,
                CostModel::Blocks => {
                    p.overlap_weight * prefill_blocks as f64 + w.load.decode_blocks as f64
                }
            };
            Candidate {
                worker: w.worker,
                matched_blocks: matched,
                indexed_blocks: w.indexed_blocks,
                host_blocks: host,
                disk_blocks: disk,
                pending_blocks: w.pending_blocks,
                prefill_blocks,
                prefill_tokens,
                load: w.load,
                requests,
                queued_tokens,
                queue_ms,
                prefill_ms: step_ms + own_ms + lora_ms,
                lora_ms,
                cost,
                excluded: None,
            }
        })
        .collect();
    exclude(&mut out, workers, p);
    out
}

/// Mark the workers over a bound.
fn exclude(c: &mut [Candidate], workers: &[WorkerView<'_>], p: &Pricing) {
    let n = c.len().max(1) as f64;
    let total: u64 = c.iter().map(|c| u64::from(c.requests)).sum();
    // Bounded loads: with this request, no worker above `load_bound` × the mean, nor
    // `load_slack` above the least loaded (the mean's bound alone would send the second
    // request on an idle pool of four away from its prefix). The least loaded worker is
    // always within it for a bound of at least 1.
    let least = c.iter().map(|c| c.requests).min().unwrap_or(0);
    let cap = (p.load_bound * (total + 1) as f64 / n)
        .ceil()
        .max(f64::from(least.saturating_add(p.load_slack)));
    for (c, w) in c.iter_mut().zip(workers) {
        let kv_usage = w.reported.map(|r| &r.metrics).and_then(|m| {
            (m.kv_total_blocks > 0)
                .then(|| f64::from(m.kv_active_blocks) / f64::from(m.kv_total_blocks))
        });
        c.excluded = if p.load_bound > 0.0 && f64::from(c.requests) + 1.0 > cap {
            Some(format!("{} requests + 1 > load bound {cap}", c.requests))
        } else if let (Some(limit), Some(u)) = (p.busy_kv_usage, kv_usage)
            && u > limit
        {
            Some(format!("KV usage {u:.2} > busy threshold {limit}"))
        } else if let Some(limit) = p.busy_prefill_tokens
            && c.queued_tokens > limit
        {
            Some(format!(
                "{} queued prefill tokens > busy threshold {limit}",
                c.queued_tokens
            ))
        } else {
            None
        };
    }
    // Every worker busy: none is left out (the request waits where it is cheapest rather
    // than failing).
    if c.iter().all(|c| c.excluded.is_some()) {
        for c in c.iter_mut() {
            c.excluded = None;
        }
    }
}

/// The chosen candidate's index; `None` without candidates.
pub fn choose(
    c: &[Candidate],
    cached_total: &[usize],
    temperature: f64,
    rng: &mut impl Rng,
) -> Option<usize> {
    let eligible: Vec<usize> = (0..c.len()).filter(|&i| c[i].excluded.is_none()).collect();
    if eligible.is_empty() {
        return None;
    }
    Some(if temperature > 0.0 {
        sample(c, &eligible, temperature, rng)
    } else {
        cheapest(c, cached_total, &eligible, rng)
    })
}

fn cheapest(
    c: &[Candidate],
    cached_total: &[usize],
    eligible: &[usize],
    rng: &mut impl Rng,
) -> usize {
    let best = eligible.iter().map(|&i| c[i].cost).fold(f64::MAX, f64::min);
    // Costs within a microsecond (or a thousandth of a block) are a tie.
    let tied: Vec<usize> = eligible
        .iter()
        .copied()
        .filter(|&i| c[i].cost <= best + 1e-3)
        .collect();
    let key = |i: usize| (c[i].requests, cached_total.get(i).copied().unwrap_or(0));
    let fewest = tied.iter().map(|&i| key(i)).min().unwrap_or_default();
    let tied: Vec<usize> = tied.into_iter().filter(|&i| key(i) == fewest).collect();
    tied[rng.random_range(0..tied.len())]
}

fn sample(c: &[Candidate], eligible: &[usize], temperature: f64, rng: &mut impl Rng) -> usize {
    let (lo, hi) = eligible.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &i| {
        (lo.min(c[i].cost), hi.max(c[i].cost))
    });
    let span = if hi > lo { hi - lo } else { 1.0 };
    let weights: Vec<f64> = eligible
        .iter()
        .map(|&i| (-((c[i].cost - lo) / span) / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut r = rng.random::<f64>() * total;
    for (k, w) in weights.iter().enumerate() {
        if r < *w {
            return eligible[k];
        }
        r -= w;
    }
    eligible[eligible.len() - 1]
}

/// Why candidate `i` won, in terms of the worker holding the most of the prompt (for
/// `dyn inspect route`; not built per request).
pub fn reason(c: &[Candidate], i: usize) -> String {
    let most = c.iter().map(|c| c.matched_blocks).max().unwrap_or(0);
    if most == 0 {
        return "no worker caches the prompt: the cheapest".into();
    }
    if c[i].matched_blocks == most {
        return format!(
            "holds the most of the prompt ({most} blocks) and is the cheapest of those"
        );
    }
    let Some(best) = c
        .iter()
        .filter(|b| b.matched_blocks == most)
        .min_by(|a, b| a.cost.total_cmp(&b.cost))
    else {
        return "the cheapest".into();
    };
    match &best.excluded {
        Some(why) => format!(
            "{:x} holds {most} blocks but is left out: {why}",
            best.worker
        ),
        None => format!(
            "{:x} holds {most} blocks but costs more ({:.3} > {:.3}): its queue outweighs the saved prefill",
            best.worker, best.cost, c[i].cost
        ),
    }
}

/// Worker ids as hex strings.
mod hex_id {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(id: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{id:x}"))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let s = String::deserialize(d)?;
        u64::from_str_radix(&s, 16).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_onboard_is_priced_between_a_pool_hit_and_a_recompute() {
        // Ten prompt blocks of 16, all indexed on three workers: in the pool, only in host
        // memory, only on disk; a fourth holds none.
        let view = |worker, lower| WorkerView {
            worker,
            indexed_blocks: if worker == 4 { 0 } else { 10 },
            indexed_lower: lower,
            ..WorkerView::default()
        };
        let workers = [
            view(1, [0, 0]),
            view(2, [10, 0]),
            view(3, [0, 10]),
            view(4, [0, 0]),
        ];
        let c = candidates(&workers, 160, 10, 16, &Pricing::default());
        let tokens: Vec<usize> = c.iter().map(|c| c.prefill_tokens).collect();
        // Credit 0.75 in host memory, 0.25 on disk: 7 and 2 of the 10 blocks count.
        assert_eq!(tokens, [0, 48, 128, 160]);
        assert!(c[0].cost < c[1].cost && c[1].cost < c[2].cost && c[2].cost < c[3].cost);
        assert_eq!((c[1].host_blocks, c[2].disk_blocks), (10, 10));
        assert_eq!(choose(&c, &[10, 10, 10, 0], 0.0, &mut rand::rng()), Some(0));
        // With full credit a host block is as good as a pool block.
        let p = Pricing {
            tier_credit: [1.0, 1.0],
            ..Pricing::default()
        };
        let c = candidates(&workers, 160, 10, 16, &p);
        assert_eq!(c[1].prefill_tokens, 0);
    }
}
