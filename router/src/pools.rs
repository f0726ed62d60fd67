//! Pools: a `route` node that feeds several worker nodes (pools of one model, say one for
//! short prompts and one for long ones, or one run for tight latency targets) chooses a pool
//! for each request, then a worker in it. The seeds' global router does this in front of
//! local routers; here it is one stage, with each pool's own router inside it.
//!
//! The choice, in order: the pools whose prompt range (`min_prompt_tokens`..=`max_prompt_tokens`)
//! holds the prompt; of those, the ones run for targets at least as tight as the request asks
//! (`ttft_ms`, `itl_ms` against its `nvext.router.ttft_target` / `itl_target`); then the first
//! in the config's order whose predicted time to first token (its best worker's, from the
//! step times its workers report: the `kv` policy's `time` cost) meets the goal (the
//! request's TTFT target, else the pool's), else the one predicted fastest. Pools with no live
//! worker are left out first. A filter that would leave no pool is skipped, so every request is
//! served somewhere. Pools the list does
//! not name take any request, after the named ones.
//!
//! ```yaml
//! route:
//!   kind: route
//!   inputs: [preprocess]
//!   config:
//!     policy: kv
//!     pools:
//!       - {node: short, max_prompt_tokens: 1024, ttft_ms: 200}
//!       - {node: long, min_prompt_tokens: 1025}
//! short: {kind: decode, inputs: [route], config: {engine: mocker}}
//! long: {kind: decode, inputs: [route], replicas: 2, config: {engine: mocker}}
//! ```

use dyn_protocol::types::SlaTargets;
use serde::Deserialize;

/// What one pool takes, and the targets it is run for.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolRule {
    /// The worker node (one the route feeds).
    pub node: String,
    /// Prompts of at least this many tokens.
    #[serde(default)]
    pub min_prompt_tokens: u32,
    /// Prompts of at most this many tokens (no bound when absent).
    #[serde(default)]
    pub max_prompt_tokens: Option<u32>,
    /// The time to first token this pool is run for, milliseconds: requests asking for a
    /// tighter one go to pools run for it, and it is the goal its predicted TTFT is held to.
    #[serde(default)]
    pub ttft_ms: Option<f64>,
    /// The inter-token latency it is run for, milliseconds.
    #[serde(default)]
    pub itl_ms: Option<f64>,
}

impl PoolRule {
    /// What is wrong with it, if anything (field, message).
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if self
            .max_prompt_tokens
            .is_some_and(|m| m < self.min_prompt_tokens)
        {
            out.push((
                "max_prompt_tokens",
                format!(
                    "must be at least min_prompt_tokens ({})",
                    self.min_prompt_tokens
                ),
            ));
        }
        for (field, v) in [("ttft_ms", self.ttft_ms), ("itl_ms", self.itl_ms)] {
            if v.is_some_and(|v| !(v.is_finite() && v > 0.0)) {
                out.push((field, "must be a positive number of milliseconds".into()));
            }
        }
        out
    }

    fn takes(&self, prompt_tokens: usize) -> bool {
        let n = u64::try_from(prompt_tokens).unwrap_or(u64::MAX);
        n >= u64::from(self.min_prompt_tokens)
            && self.max_prompt_tokens.is_none_or(|m| n <= u64::from(m))
    }

    /// Run for targets at least as tight as `asked`: a target the request does not ask for
    /// does not count, one it asks for must be stated and no looser.
    fn meets(&self, asked: &SlaTargets) -> bool {
        let ok = |promise: Option<f64>, asked: Option<f64>| match (promise, asked) {
            (Some(p), Some(a)) => p <= a,
            (None, Some(_)) => false,
            (_, None) => true,
        };
        ok(self.ttft_ms, asked.ttft_ms) && ok(self.itl_ms, asked.itl_ms)
    }
}

/// Why a pool was chosen (for the debug log and `dyn inspect`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// The only one left after the prompt range and the targets.
    Only,
    /// The first whose predicted TTFT meets its goal.
    MeetsGoal,
    /// None meets its goal: the one predicted fastest.
    Fastest,
    /// No predictions (a policy without the `time` cost): the first left.
    First,
}

/// Choose among `rules` (in the config's order) for a prompt of `prompt_tokens` asking for
/// `asked`; `live(i)`: whether pool `i` has a live worker; `predicted(i)`: its predicted TTFT
/// in milliseconds, where known.
pub fn choose(
    rules: &[&PoolRule],
    prompt_tokens: usize,
    asked: &SlaTargets,
    live: impl Fn(usize) -> bool,
    predicted: impl Fn(usize) -> Option<f64>,
) -> (usize, Why) {
    let all: Vec<usize> = (0..rules.len()).collect();
    let narrow = |from: Vec<usize>, keep: &dyn Fn(usize) -> bool| -> Vec<usize> {
        let kept: Vec<usize> = from.iter().copied().filter(|&i| keep(i)).collect();
        if kept.is_empty() { from } else { kept }
    };
    let left = narrow(all, &live);
    let left = narrow(left, &|i| rules[i].takes(prompt_tokens));
    let left = narrow(left, &|i| rules[i].meets(asked));
    if let [only] = left.as_slice() {
        return (*only, Why::Only);
    }
    let times: Vec<(usize, f64)> = left
        .iter()
        .filter_map(|&i| predicted(i).map(|t| (i, t)))
        .collect();
    for &(i, t) in &times {
        if asked
            .ttft_ms
            .or(rules[i].ttft_ms)
            .is_some_and(|goal| t <= goal)
        {
            return (i, Why::MeetsGoal);
        }
    }
    match times.iter().min_by(|a, b| a.1.total_cmp(&b.1)) {
        Some(&(i, _)) => (i, Why::Fastest),
        None => (left[0], Why::First),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(min: u32, max: Option<u32>, ttft: Option<f64>) -> PoolRule {
        PoolRule {
            node: "n".into(),
            min_prompt_tokens: min,
            max_prompt_tokens: max,
            ttft_ms: ttft,
            itl_ms: None,
        }
    }

    #[test]
    fn prompt_ranges_then_targets_then_predicted_time() {
        let short = rule(0, Some(512), Some(100.0));
        let long = rule(513, None, Some(2000.0));
        let rules = [&short, &long];
        let none = SlaTargets::default();
        let no_times = |_| None;
        let up = |_| true;
        assert_eq!(choose(&rules, 10, &none, up, no_times), (0, Why::Only));
        assert_eq!(choose(&rules, 4000, &none, up, no_times), (1, Why::Only));
        // A pool with no live worker takes nothing while another can.
        assert_eq!(
            choose(&rules, 10, &none, |i| i == 1, no_times),
            (1, Why::Only)
        );
        // A range no pool holds leaves both; without predictions, the first.
        let gap = [&rule(0, Some(10), None), &rule(20, None, None)];
        assert_eq!(choose(&gap, 15, &none, up, no_times), (0, Why::First));

        // Two pools for any prompt: the targets decide, then the predictions.
        let fast = rule(0, None, Some(100.0));
        let batch = rule(0, None, Some(5000.0));
        let rules = [&batch, &fast];
        let tight = SlaTargets {
            ttft_ms: Some(150.0),
            itl_ms: None,
        };
        assert_eq!(choose(&rules, 10, &tight, up, no_times), (1, Why::Only));
        // Asking for less than any pool promises keeps both; the first meeting the goal wins.
        let times = |i: usize| Some([300.0, 50.0][i]);
        let impossible = SlaTargets {
            ttft_ms: Some(10.0),
            itl_ms: None,
        };
        assert_eq!(
            choose(&rules, 10, &impossible, up, times),
            (1, Why::Fastest)
        );
        assert_eq!(choose(&rules, 10, &none, up, times), (0, Why::MeetsGoal));
        let slow = |i: usize| Some([9000.0, 700.0][i]);
        assert_eq!(choose(&rules, 10, &none, up, slow), (1, Why::Fastest));
    }

    #[test]
    fn bad_rules_are_named() {
        let p = rule(100, Some(10), Some(-1.0)).problems();
        assert_eq!(p.len(), 2, "{p:?}");
        assert_eq!(p[0].0, "max_prompt_tokens");
        assert_eq!(p[1].0, "ttft_ms");
    }
}
