//! `route`'s settings: the policy and its cost model's knobs (also under Dynamo's names),
//! admission, session affinity, adapters and pools — their defaults, the `kv` policy's
//! pricing drawn from them, and what is wrong with a given set, field by field.

use dyn_core::Invalid;
use serde::Deserialize;

use crate::cost::{CostModel, Pricing};
use crate::policy::Policy;
use crate::{admission, pools, sessions};

fn yes() -> bool {
    true
}
fn ttl() -> f64 {
    120.0
}

/// A `route` node's settings. Dynamo's names for the same knobs are accepted as aliases
/// (`router_temperature`, `overlap_score_weight`, `kv_overlap_score_credit`, `busy_threshold`,
/// `router_ttl_secs`, `kv_cache_block_size`, ...), so a Dynamo router's settings carry over.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    #[serde(default)]
    pub policy: Policy,
    /// `kv`: price workers by predicted time (`time`, the default) or by blocks (`blocks`,
    /// Dynamo's cost).
    #[serde(default)]
    pub cost: CostModel,
    /// `kv`, `cost: time`: how many times its own prefill time a cache miss costs.
    #[serde(default = "two")]
    pub miss_weight: f64,
    /// `kv`, `cost: blocks`: weight of the blocks a worker would have to prefill against its
    /// decode load (default 1).
    #[serde(
        default,
        alias = "overlap_score_weight",
        alias = "kv_overlap_score_weight"
    )]
    pub overlap_weight: Option<f64>,
    /// `kv`: share of a cached block that counts as cached, 0..=1 (0: load only).
    #[serde(
        default = "one",
        alias = "overlap_score_credit",
        alias = "kv_overlap_score_credit"
    )]
    pub overlap_credit: f64,
    /// `kv`: share of a block a worker holds only in host memory (G2) that counts as cached
    /// — it costs an onboard, not a recompute — 0..=1 (Dynamo's default, 0.75).
    #[serde(default = "host_credit")]
    pub host_credit: f64,
    /// `kv`: the same for a block only on the worker's local disk (G3), 0..=1.
    #[serde(default = "disk_credit")]
    pub disk_credit: f64,
    /// `kv`: leave out workers whose requests would pass this × the mean (0: no bound)...
    #[serde(default = "two")]
    pub load_bound: f64,
    /// ... and `load_slack` more than the least loaded worker's.
    #[serde(default = "eight")]
    pub load_slack: u32,
    /// `kv`: leave out workers whose KV usage (0..=1) passes this, while any worker does not.
    #[serde(default, alias = "active_decode_blocks_threshold")]
    pub busy_threshold: Option<f64>,
    /// `kv`: leave out workers with more prompt tokens than this waiting for prefill.
    #[serde(default)]
    pub active_prefill_tokens_threshold: Option<u64>,
    /// `kv`: 0 picks the cheapest worker; above 0 samples, more evenly the higher it is.
    #[serde(default, alias = "router_temperature")]
    pub temperature: f64,
    /// `kv`: the workers publish KV events; `false` makes the router track its own decisions.
    #[serde(default = "yes", alias = "use_kv_events", alias = "router_kv_events")]
    pub kv_events: bool,
    /// `kv` without events: how long a routed prompt counts as cached on its worker.
    #[serde(default = "ttl", alias = "router_ttl_secs", alias = "router_ttl")]
    pub approx_ttl_s: f64,
    /// `kv`: tokens per KV block; by default what the workers announce (16 until they do).
    #[serde(default, alias = "kv_cache_block_size")]
    pub block_size: Option<u32>,
    /// Requests beyond the workers' room wait here, by priority and deadline, or are refused
    /// ([`admission`]); on by default, `false` sends every request on at once.
    #[serde(
        default = "admission_default",
        deserialize_with = "admission::AdmissionConfig::deserialize_option"
    )]
    pub admission: Option<admission::AdmissionConfig>,
    /// A conversation's requests stay on one worker ([`sessions`]); off without it.
    #[serde(default)]
    pub session_affinity: Option<sessions::AffinityConfig>,
    /// `kv`, `cost: time`: what sending a LoRA adapter's request to a worker that does not
    /// hold the adapter costs, in milliseconds (its first read there), so an adapter's requests
    /// stay with the workers that have it until their load outweighs a read elsewhere.
    #[serde(default = "lora_load_ms")]
    pub lora_load_ms: f64,
    /// How many adapters the router remembers per worker (the workers' `max_loras`).
    #[serde(default = "eight_usize")]
    pub lora_slots: usize,
    /// Where the node feeds several worker nodes (pools), what each takes ([`pools`]); the
    /// router chooses a pool per request, then a worker in it, each pool with the settings
    /// above.
    #[serde(default)]
    pub pools: Vec<pools::PoolRule>,
}

fn admission_default() -> Option<admission::AdmissionConfig> {
    Some(admission::AdmissionConfig::default())
}

fn lora_load_ms() -> f64 {
    200.0
}
fn eight_usize() -> usize {
    8
}

fn one() -> f64 {
    1.0
}
fn host_credit() -> f64 {
    0.75
}
fn disk_credit() -> f64 {
    0.25
}
fn two() -> f64 {
    2.0
}
fn eight() -> u32 {
    8
}

impl Default for RouteConfig {
    fn default() -> Self {
        Self {
            policy: Policy::default(),
            cost: CostModel::default(),
            miss_weight: two(),
            overlap_weight: None,
            overlap_credit: one(),
            host_credit: host_credit(),
            disk_credit: disk_credit(),
            load_bound: two(),
            load_slack: eight(),
            busy_threshold: None,
            active_prefill_tokens_threshold: None,
            temperature: 0.0,
            kv_events: true,
            approx_ttl_s: ttl(),
            block_size: None,
            admission: admission_default(),
            session_affinity: None,
            lora_load_ms: lora_load_ms(),
            lora_slots: eight_usize(),
            pools: Vec::new(),
        }
    }
}

impl RouteConfig {
    /// The `kv` policy's runtime settings.
    pub fn pricing(&self) -> Pricing {
        Pricing {
            model: self.cost,
            overlap_weight: self.overlap_weight.unwrap_or(1.0),
            miss_weight: self.miss_weight,
            overlap_credit: self.overlap_credit,
            tier_credit: [self.host_credit, self.disk_credit],
            load_bound: self.load_bound,
            load_slack: self.load_slack,
            busy_kv_usage: self.busy_threshold,
            busy_prefill_tokens: self.active_prefill_tokens_threshold,
            temperature: self.temperature,
            lora_load_ms: self.lora_load_ms,
            ..Pricing::default()
        }
    }

    /// What is wrong with these settings, one entry per field and fault (none: they are
    /// good).
    pub(crate) fn problems(&self) -> Vec<Invalid> {
        let mut out = Vec::new();
        for (i, p) in self.pools.iter().enumerate() {
            if self.pools[..i].iter().any(|o| o.node == p.node) {
                out.push(Invalid::field(
                    "pools",
                    format!("pool '{}' is listed twice", p.node),
                ));
            }
            for (field, what) in p.problems() {
                out.push(Invalid::field(
                    "pools",
                    format!("pool '{}': {field} {what}", p.node),
                ));
            }
        }
        let mut check = |name: &str, ok: bool, what: &str| {
            if !ok {
                out.push(Invalid::field(name, what));
            }
        };
        let number = |v: f64, lo: f64| v.is_finite() && v >= lo;
        check(
            "overlap_weight",
            self.overlap_weight.is_none_or(|w| number(w, 0.0)),
            "must be a number ≥ 0",
        );
        check(
            "overlap_weight",
            self.overlap_weight.is_none() || self.cost == CostModel::Blocks,
            "weighs blocks in `cost: blocks` only; with `cost: time` use miss_weight \
             (or overlap_credit: 0 to ignore caches)",
        );
        check(
            "miss_weight",
            number(self.miss_weight, 0.0),
            "must be a number ≥ 0",
        );
        check(
            "lora_load_ms",
            number(self.lora_load_ms, 0.0) && self.lora_load_ms <= 1e7,
            "must be a number of milliseconds from 0 to 1e7",
        );
        check("lora_slots", self.lora_slots > 0, "must be at least 1");
        for (name, v) in [
            ("overlap_credit", self.overlap_credit),
            ("host_credit", self.host_credit),
            ("disk_credit", self.disk_credit),
        ] {
            check(name, (0.0..=1.0).contains(&v), "must be between 0 and 1");
        }
        check(
            "load_bound",
            self.load_bound == 0.0 || number(self.load_bound, 1.0),
            "must be 0 (no bound) or a number ≥ 1",
        );
        check(
            "busy_threshold",
            self.busy_threshold.is_none_or(|t| (0.0..=1.0).contains(&t)),
            "must be a KV usage between 0 and 1",
        );
        check(
            "temperature",
            number(self.temperature, 0.0),
            "must be a number ≥ 0",
        );
        check(
            "approx_ttl_s",
            self.approx_ttl_s.is_finite() && self.approx_ttl_s > 0.0,
            "must be a positive number of seconds",
        );
        check(
            "block_size",
            self.block_size != Some(0),
            "must be at least 1",
        );
        if let Some(a) = &self.admission {
            check(
                "admission.per_worker",
                a.per_worker != Some(0),
                "must be at least 1",
            );
            check(
                "admission.max_wait_s",
                a.max_wait_s.is_finite() && (0.0..=86_400.0).contains(&a.max_wait_s),
                "must be a number of seconds from 0 to 86400",
            );
            check(
                "admission.reserve",
                a.per_worker.is_none_or(|n| n == 0 || a.reserve < n),
                "must be below per_worker",
            );
            let tenants = a
                .tenants
                .iter()
                .map(|(name, t)| (format!("admission.tenants.{name}"), t))
                .chain([("admission.tenant_default".to_string(), &a.tenant_default)]);
            for (at, t) in tenants {
                check(
                    &format!("{at}.weight"),
                    t.weight.is_finite() && t.weight > 0.0,
                    "must be a positive number",
                );
                check(
                    &format!("{at}.requests_per_minute"),
                    t.requests_per_minute != Some(0),
                    "must be at least 1",
                );
                check(
                    &format!("{at}.tokens_per_minute"),
                    t.tokens_per_minute != Some(0),
                    "must be at least 1",
                );
            }
        }
        if let Some(a) = &self.session_affinity {
            check(
                "session_affinity.ttl_s",
                a.ttl_s.is_finite() && a.ttl_s > 0.0 && a.ttl_s <= 1e6,
                "must be a positive number of seconds, at most 1000000",
            );
            check(
                "session_affinity.max_active",
                a.max_active != Some(0),
                "must be at least 1",
            );
        }
        out
    }
}
