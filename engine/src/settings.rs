//! The scheduler settings every dyn engine shares, defined once.
//!
//! An engine's YAML section is flat (`{num_blocks: 1024, speedup: 10}`, as vLLM's flags are),
//! and serde's `flatten` cannot build it from a shared struct: it buffers values, which loses
//! YAML positions and scalar types, and it cannot deny unknown keys. So `engine_section!`
//! declares an engine's config type with the shared fields first (documented and checked
//! here) and the engine's own after them; [`SchedulerConfig`] is the shared part as one value,
//! and [`EngineSettings`] what the engine loop runs with.

use dyn_core::Invalid;

/// The settings of dyn's engine loop and scheduler, as a graph gives them.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// KV cache blocks in the worker's pool.
    pub num_blocks: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Sequences in one batch, at most.
    pub max_num_seqs: u32,
    /// Tokens (prompt and decode) one step computes, at most.
    pub max_num_batched_tokens: u32,
    /// Requests that may wait to start before new ones are refused with 503 (load shedding).
    pub max_queued_requests: u32,
    /// Prefill role: seconds a prompt's blocks stay pinned for a decode worker to pull.
    pub pin_ttl_s: f64,
}

impl SchedulerConfig {
    /// Every problem with the settings, field names under `prefix`.
    pub fn validate(&self, prefix: &str) -> Vec<Invalid> {
        let mut out = Vec::new();
        for (name, v) in [
            ("num_blocks", self.num_blocks),
            ("block_size", self.block_size),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_queued_requests", self.max_queued_requests),
        ] {
            if v == 0 {
                out.push(Invalid::field(
                    format!("{prefix}{name}"),
                    "must be at least 1",
                ));
            }
        }
        if !(self.pin_ttl_s.is_finite() && self.pin_ttl_s > 0.0) {
            out.push(Invalid::field(
                format!("{prefix}pin_ttl_s"),
                "must be a positive number",
            ));
        }
        out
    }
}

/// What the engine loop runs with: the scheduler settings and what the engine adds.
#[derive(Debug, Clone)]
pub struct EngineSettings {
    pub scheduler: SchedulerConfig,
    /// Token ids at or above this are refused (a real model's vocabulary).
    pub vocab_size: Option<u32>,
    /// Unseeded requests are seeded by their prompt (the mocker's reproducible output)
    /// rather than at random.
    pub seed_from_prompt: bool,
    /// Offload tiers below the pool, and (the mocker's) modelled transfer times.
    pub offload: super::offload::OffloadConfig,
    pub offload_model: Option<super::offload::Modelled>,
    /// The model's tokenizer: structured output compiles its grammars over this vocabulary
    /// (requests with a constraint are refused without it).
    pub model: Option<std::sync::Arc<dyn_llm::model::ModelDir>>,
    /// The engine computes log-probabilities (requests asking for them are refused otherwise).
    pub logprobs: bool,
    /// The LoRA adapters it runs (requests naming one are refused without it).
    pub loras: Option<std::sync::Arc<crate::lora::LoraStore>>,
    /// Structured outputs append the tokens their grammar forces without sampling them
    /// ([`dyn_llm::grammar::Guide::take_forced`]).
    pub fast_forward: bool,
}

/// Declares an engine's config section: the [`SchedulerConfig`] fields (with the engine's
/// defaults, given as a `SchedulerConfig` value), then the engine's own fields, each with its
/// default. Missing keys take the defaults; unknown keys are errors with their position.
macro_rules! engine_section {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            scheduler: $defaults:expr,
            $(
                $(#[$fmeta:meta])*
                pub $field:ident : $ty:ty = $default:expr
            ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, serde::Deserialize)]
        #[serde(deny_unknown_fields, default)]
        pub struct $name {
            /// KV cache blocks in the worker's pool.
            pub num_blocks: u32,
            /// Tokens per KV block.
            pub block_size: u32,
            /// Sequences in one batch, at most.
            pub max_num_seqs: u32,
            /// Tokens (prompt and decode) one step computes, at most.
            pub max_num_batched_tokens: u32,
            /// Requests that may wait to start before new ones are refused with 503.
            pub max_queued_requests: u32,
            /// Prefill role: seconds a prompt's blocks stay pinned for a decode worker to pull.
            pub pin_ttl_s: f64,
            /// KV offload tiers below the pool (host memory, disk); off by default.
            pub offload: $crate::offload::OffloadConfig,
            /// Structured output: text the grammar forces (a forced tool call's opening, a
            /// schema's keys) is appended in the tokenizer's own tokens without sampling
            /// them (fast-forward); on by default.
            pub fast_forward: bool,
            $( $(#[$fmeta])* pub $field: $ty, )*
        }

        impl Default for $name {
            fn default() -> Self {
                let d: $crate::settings::SchedulerConfig = $defaults;
                Self {
                    num_blocks: d.num_blocks,
                    block_size: d.block_size,
                    max_num_seqs: d.max_num_seqs,
                    max_num_batched_tokens: d.max_num_batched_tokens,
                    max_queued_requests: d.max_queued_requests,
                    pin_ttl_s: d.pin_ttl_s,
                    offload: Default::default(),
                    fast_forward: true,
                    $( $field: $default, )*
                }
            }
        }

        impl $name {
            /// Problems with the shared settings (scheduler and offload), under `prefix`.
            pub fn validate_shared(&self, prefix: &str) -> Vec<dyn_core::Invalid> {
                let mut out = self.scheduler().validate(prefix);
                out.extend(self.offload.validate(&format!("{prefix}offload.")));
                out
            }

            /// The scheduler settings, shared by every engine.
            pub fn scheduler(&self) -> $crate::settings::SchedulerConfig {
                $crate::settings::SchedulerConfig {
                    num_blocks: self.num_blocks,
                    block_size: self.block_size,
                    max_num_seqs: self.max_num_seqs,
                    max_num_batched_tokens: self.max_num_batched_tokens,
                    max_queued_requests: self.max_queued_requests,
                    pin_ttl_s: self.pin_ttl_s,
                }
            }
        }
    };
}
pub(crate) use engine_section;

#[cfg(test)]
mod tests {
    use super::*;

    engine_section! {
        /// A test engine.
        pub struct TestSection {
            scheduler: SchedulerConfig {
                num_blocks: 8,
                block_size: 4,
                max_num_seqs: 2,
                max_num_batched_tokens: 16,
                max_queued_requests: 3,
                pin_ttl_s: 1.0,
            },
            /// Its own knob.
            pub knob: f64 = 0.5,
        }
    }

    fn parse(yaml: &str) -> Result<TestSection, String> {
        let node = marked_yaml::parse_yaml(0, yaml).map_err(|e| e.to_string())?;
        marked_yaml::from_node(&node).map_err(|e| format!("{e} at {:?}", e.start_mark()))
    }

    #[test]
    fn missing_keys_take_the_engines_defaults_and_unknown_keys_are_errors() {
        let s = parse("num_blocks: 100\nknob: 2\n").unwrap();
        assert_eq!((s.num_blocks, s.block_size, s.knob), (100, 4, 2.0));
        assert_eq!(s.scheduler().max_queued_requests, 3);
        let e = parse("num_blocks: 100\nbogus: 1\n").unwrap_err();
        assert!(e.contains("bogus") && e.contains("line: 2"), "{e}");
        let e = parse("num_blocks: many\n").unwrap_err();
        assert!(e.contains("line: 1"), "{e}");
        assert_eq!(
            TestSection {
                num_blocks: 0,
                ..TestSection::default()
            }
            .scheduler()
            .validate("x.")[0]
                .field
                .as_deref(),
            Some("x.num_blocks")
        );
        // The offload section is shared too, and checked with the rest.
        let s = parse("offload: {disk_blocks: 10, host_gbps: 0}\n").unwrap();
        let fields: Vec<String> = s
            .validate_shared("x.")
            .into_iter()
            .filter_map(|i| i.field)
            .collect();
        assert_eq!(fields, ["x.offload.host_blocks", "x.offload.host_gbps"]);
        assert!(
            parse("offload: {host_block: 1}\n").is_err(),
            "typos are errors"
        );
    }
}
