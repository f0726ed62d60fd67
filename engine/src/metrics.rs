//! The workers' and their offload tiers' Prometheus series (the process's default registry,
//! rendered by [`dyn_protocol::metrics::render`]).

use std::sync::LazyLock;

use std::sync::Arc;

use dyn_protocol::metrics::{
    STEP_PARTS, Series, counter_vec, gauge, histogram, histogram_with, set_counter,
};
use prometheus::{HistogramVec, IntCounterVec, IntGaugeVec};

/// KV transfers a decode worker pulled from prefill workers: how each went and how long it
/// took.
pub struct Transfers {
    /// `outcome`: pulled, failed (the prompt is then prefilled locally); `via`: the wire that
    /// brought the blocks (inproc, tcp, ucx; `none` for a failure).
    pub count: IntCounterVec,
    pub seconds: HistogramVec,
    /// Pulls whose UCX read failed and were streamed over TCP instead.
    pub fallbacks: IntCounterVec,
}

pub static TRANSFERS: LazyLock<Transfers> = LazyLock::new(|| Transfers {
    count: counter_vec(
        "dyn_worker_kv_transfers_total",
        "KV transfers a decode worker pulled from prefill workers, by outcome (pulled|failed) and the wire that brought them (inproc|tcp|ucx)",
        &["node", "worker_id", "outcome", "via"],
    ),
    seconds: histogram(
        "dyn_worker_kv_transfer_seconds",
        "Time to receive a prompt's KV from a prefill worker (modelled transfer included)",
        &["node"],
    ),
    fallbacks: counter_vec(
        "dyn_transfer_fallbacks_total",
        "KV transfers whose UCX read failed and whose blocks came over TCP instead",
        &["node", "worker_id"],
    ),
});

/// Structured outputs on the native engine, per node: the CPU time of a step's grammar masks
/// (computed beside the forward pass) and how long the step then waited for them — the cost
/// a grammar adds to the step, zero while masks finish first.
pub struct Grammar {
    pub mask_seconds: HistogramVec,
    pub wait_seconds: HistogramVec,
}

pub static GRAMMAR: LazyLock<Grammar> = LazyLock::new(|| Grammar {
    mask_seconds: histogram_with(
        "dyn_worker_grammar_mask_seconds",
        "Time to compute one step's grammar masks (all guided sequences of the step; the longest of its helper threads)",
        &["node"],
        STEP_PARTS,
    ),
    wait_seconds: histogram_with(
        "dyn_worker_grammar_wait_seconds",
        "Time a step waited for its grammar masks after the forward pass returned",
        &["node"],
        STEP_PARTS,
    ),
});

/// LoRA adapters on the native engine, per worker: adapters read from their files, and
/// those resident now.
pub struct Lora {
    pub loads: IntCounterVec,
    pub resident: IntGaugeVec,
}

pub static LORA: LazyLock<Lora> = LazyLock::new(|| Lora {
    loads: counter_vec(
        "dyn_worker_lora_loads_total",
        "LoRA adapters loaded (read from their files, or taken from the ingress of the same process, which read them to check them): first use, or again after eviction",
        &["node", "worker_id"],
    ),
    resident: gauge(
        "dyn_worker_loras_resident",
        "LoRA adapters resident in the worker's memory",
        &["node", "worker_id"],
    ),
});

struct WorkerMetrics {
    running: IntGaugeVec,
    waiting: IntGaugeVec,
    active_blocks: IntGaugeVec,
    total_blocks: IntGaugeVec,
    prompt_blocks: IntCounterVec,
    prompt_blocks_hit: IntCounterVec,
    prefill_tokens: IntCounterVec,
    preemptions: IntCounterVec,
}

static WORKER: LazyLock<WorkerMetrics> = LazyLock::new(|| {
    let l: &[&str] = &["node", "worker_id"];
    WorkerMetrics {
        running: gauge(
            "dyn_worker_requests_running",
            "Sequences in the running batch",
            l,
        ),
        waiting: gauge(
            "dyn_worker_requests_waiting",
            "Sequences waiting to be scheduled",
            l,
        ),
        active_blocks: gauge(
            "dyn_worker_kv_active_blocks",
            "KV blocks held by sequences",
            l,
        ),
        total_blocks: gauge("dyn_worker_kv_total_blocks", "KV blocks in the pool", l),
        prompt_blocks: counter_vec(
            "dyn_worker_prompt_blocks_total",
            "Full prompt blocks looked up in the prefix cache",
            l,
        ),
        prompt_blocks_hit: counter_vec(
            "dyn_worker_prefix_cache_hit_blocks_total",
            "Full prompt blocks found in the prefix cache",
            l,
        ),
        prefill_tokens: counter_vec(
            "dyn_worker_prefill_tokens_total",
            "Prompt tokens computed (not found in the prefix cache nor onboarded from a tier)",
            l,
        ),
        preemptions: counter_vec("dyn_worker_preemptions_total", "Sequences preempted", l),
    }
});

/// One worker's series, bound to its labels once; they leave `/metrics` when the last clone
/// (the handle's, the engine thread's) is dropped.
#[derive(Clone)]
pub struct WorkerGauges {
    _owned: Arc<Series>,
    running: prometheus::IntGauge,
    waiting: prometheus::IntGauge,
    active: prometheus::IntGauge,
    total: prometheus::IntGauge,
    prompt: prometheus::IntCounter,
    hit: prometheus::IntCounter,
    prefill: prometheus::IntCounter,
    preempt: prometheus::IntCounter,
}

impl WorkerGauges {
    pub fn new(node: &str, worker_id: u64) -> Self {
        let id = format!("{worker_id:x}");
        let l = [node, id.as_str()];
        let w: &'static WorkerMetrics = &WORKER;
        let mut s = Series::default();
        Self {
            running: s.bind(&w.running, &l),
            waiting: s.bind(&w.waiting, &l),
            active: s.bind(&w.active_blocks, &l),
            total: s.bind(&w.total_blocks, &l),
            prompt: s.bind(&w.prompt_blocks, &l),
            hit: s.bind(&w.prompt_blocks_hit, &l),
            prefill: s.bind(&w.prefill_tokens, &l),
            preempt: s.bind(&w.preemptions, &l),
            _owned: Arc::new(s),
        }
    }

    /// Update from the engine's absolute numbers.
    pub fn set(
        &self,
        running: u32,
        waiting: u32,
        active: u32,
        total: u32,
        c: &crate::scheduler::Counters,
    ) {
        self.running.set(i64::from(running));
        self.waiting.set(i64::from(waiting));
        self.active.set(i64::from(active));
        self.total.set(i64::from(total));
        for (c, v) in [
            (&self.prompt, c.prompt_blocks),
            (&self.hit, c.prompt_blocks_hit),
            (&self.prefill, c.prefill_tokens),
            (&self.preempt, c.preemptions),
        ] {
            set_counter(c, v);
        }
    }

    pub fn active_blocks(&self) -> i64 {
        self.active.get()
    }
}

struct TierMetrics {
    blocks: IntGaugeVec,
    capacity: IntGaugeVec,
    offloaded: IntCounterVec,
    onboarded: IntCounterVec,
    dropped: IntCounterVec,
    corrupt: IntCounterVec,
    bytes: IntCounterVec,
}

static TIERS: LazyLock<TierMetrics> = LazyLock::new(|| {
    let l: &[&str] = &["node", "worker_id"];
    let t: &[&str] = &["node", "worker_id", "tier"];
    TierMetrics {
        blocks: gauge(
            "dyn_worker_kv_tier_blocks",
            "KV blocks held in an offload tier (CPU: host memory, DISK: local disk)",
            t,
        ),
        capacity: gauge(
            "dyn_worker_kv_tier_capacity_blocks",
            "KV blocks an offload tier can hold",
            t,
        ),
        offloaded: counter_vec(
            "dyn_worker_kv_offload_blocks_total",
            "KV blocks written to an offload tier",
            t,
        ),
        onboarded: counter_vec(
            "dyn_worker_kv_onboard_blocks_total",
            "Prompt blocks served from an offload tier instead of computed (hits per tier)",
            t,
        ),
        dropped: counter_vec(
            "dyn_worker_kv_offload_dropped_blocks_total",
            "Evicted KV blocks dropped because the offload queue was full",
            l,
        ),
        corrupt: counter_vec(
            "dyn_worker_kv_disk_corrupt_blocks_total",
            "KV blocks on disk that failed their checks and were recomputed",
            l,
        ),
        bytes: counter_vec(
            "dyn_worker_kv_offload_bytes_total",
            "Bytes copied out of the engine's pool (out) and onboarded into it (in)",
            &["node", "worker_id", "direction"],
        ),
    }
});

/// What a worker's offload tiers hold and did, as absolute numbers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierCounts {
    /// `(blocks, capacity)` per tier: host memory, disk.
    pub occupancy: [(usize, usize); 2],
    pub offloaded: [u64; 2],
    pub hits: [u64; 2],
    pub dropped: u64,
    pub corrupt: u64,
    pub bytes_out: u64,
    pub bytes_in: u64,
}

/// One tier's series of a worker (host memory or disk).
struct TierSeries {
    blocks: prometheus::IntGauge,
    capacity: prometheus::IntGauge,
    offloaded: prometheus::IntCounter,
    onboarded: prometheus::IntCounter,
}

/// A worker's offload-tier series, bound to its labels once (the engine updates them after
/// every step).
pub struct TierGauges {
    _owned: Series,
    tiers: [TierSeries; 2],
    dropped: prometheus::IntCounter,
    corrupt: prometheus::IntCounter,
    bytes: [prometheus::IntCounter; 2],
}

impl TierGauges {
    pub fn new(node: &str, worker_id: u64) -> Self {
        let id = format!("{worker_id:x}");
        let m: &'static TierMetrics = &TIERS;
        let mut s = Series::default();
        let mut tier = |tier: &str| {
            let l = [node, id.as_str(), tier];
            TierSeries {
                blocks: s.bind(&m.blocks, &l),
                capacity: s.bind(&m.capacity, &l),
                offloaded: s.bind(&m.offloaded, &l),
                onboarded: s.bind(&m.onboarded, &l),
            }
        };
        let tiers = [tier("CPU"), tier("DISK")];
        let bytes = [
            s.bind(&m.bytes, &[node, id.as_str(), "out"]),
            s.bind(&m.bytes, &[node, id.as_str(), "in"]),
        ];
        Self {
            tiers,
            dropped: s.bind(&m.dropped, &[node, &id]),
            corrupt: s.bind(&m.corrupt, &[node, &id]),
            bytes,
            _owned: s,
        }
    }

    /// Update from the tiers' absolute numbers.
    pub fn set(&self, c: &TierCounts) {
        for (i, t) in self.tiers.iter().enumerate() {
            t.blocks.set(c.occupancy[i].0 as i64);
            t.capacity.set(c.occupancy[i].1 as i64);
            set_counter(&t.offloaded, c.offloaded[i]);
            set_counter(&t.onboarded, c.hits[i]);
        }
        set_counter(&self.dropped, c.dropped);
        set_counter(&self.corrupt, c.corrupt);
        set_counter(&self.bytes[0], c.bytes_out);
        set_counter(&self.bytes[1], c.bytes_in);
    }
}
