//! The decision: how many replicas each scaled node should run next, and why. Pure: the
//! same observation, prediction and state give the same answer, which is how it is tested.
//!
//! With a profile, replicas follow the model (Dynamo's planner does the same): prompt tokens
//! per second predicted ÷ what one replica prefills per second, output tokens per second ÷
//! what one replica decodes per second with its ITL under the target, each at
//! `utilization` of the profiled figure; an aggregated worker does both, so it needs the
//! sum. Requests queued at the workers count as load to serve within the next interval
//! (Dynamo's planner sizes for the arrival rate alone, so a burst's backlog lingers). When the targets are missed although the model says the current count suffices, one
//! more replica is added anyway: the profile is a model, the latencies are what users see.
//! Without a profile the planner is reactive: a missed target adds a replica (half the
//! current count again when missed by more than twice); targets met with room to spare (TTFT
//! under half its target, ITL under 70 %, nothing queued, the load not rising) remove one.
//! Either way scale-downs wait `cooldown_s` after any change and never happen while a target
//! is missed; counts stay within `[min, max]`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::config::{Bounds, PlannerConfig};
use super::profile::Profile;

/// What a scaled node does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Prompt only (a `prefill` worker of a disaggregated graph): bound by TTFT.
    Prefill,
    /// Generation only (a decode worker behind remote prefill): bound by ITL.
    Decode,
    /// Both (an aggregated worker).
    Both,
}

/// One interval's traffic, as the planner saw it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    pub interval_s: f64,
    /// Requests arriving per second.
    pub request_rate: f64,
    pub finished: u64,
    pub errors: u64,
    /// Mean prompt and output tokens of the requests that finished.
    pub isl: Option<f64>,
    pub osl: Option<f64>,
    /// TTFT and per-request ITL at the planner's percentile.
    pub ttft_ms: Option<f64>,
    pub itl_ms: Option<f64>,
    /// Requests in the frontends at the end of the interval.
    pub inflight: u64,
    /// Per scaled node: what its workers reported last.
    pub nodes: BTreeMap<String, NodeLoad>,
    /// Per pool (a worker node a router chooses among others): its own share of the traffic.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pools: BTreeMap<String, PoolObservation>,
}

/// One pool's traffic over an interval: the requests that finished there (their rate stands
/// for its arrivals: the pool is chosen after a request arrives), their mean prompt and output
/// tokens and their latencies at the planner's percentile.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PoolObservation {
    pub request_rate: f64,
    pub isl: Option<f64>,
    pub osl: Option<f64>,
    pub ttft_ms: Option<f64>,
    pub itl_ms: Option<f64>,
}

/// What the planner weighs for `node`: the graph's targets unless the node names its own
/// (`nodes.NODE.ttft_ms` / `itl_ms`), and, for a pool, the pool's own traffic and latencies
/// in place of the whole frontend's (`pool`: its observation this interval, or an empty one
/// once it has been seen as a pool), so each pool is scaled on its own targets.
pub fn node_view(
    cfg: &PlannerConfig,
    obs: &Observation,
    node: &str,
    pool: Option<&PoolObservation>,
) -> (PlannerConfig, Observation) {
    let mut cfg = cfg.clone();
    if let Some(b) = cfg.nodes.get(node).copied() {
        cfg.ttft_ms = b.ttft_ms.unwrap_or(cfg.ttft_ms);
        cfg.itl_ms = b.itl_ms.unwrap_or(cfg.itl_ms);
    }
    let mut obs = obs.clone();
    if let Some(p) = pool {
        obs.request_rate = p.request_rate;
        obs.isl = p.isl;
        obs.osl = p.osl;
        obs.ttft_ms = p.ttft_ms;
        obs.itl_ms = p.itl_ms;
        // Requests in flight are the frontends', not the pool's: its own queue says more.
        obs.inflight = obs
            .nodes
            .get(node)
            .map_or(0, |l| u64::from(l.running + l.waiting));
    }
    (cfg, obs)
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeLoad {
    pub workers: u32,
    pub running: u32,
    pub waiting: u32,
    /// KV blocks in use over blocks, over the node's workers.
    pub kv_usage: f64,
}

/// The next interval's load.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    pub request_rate: f64,
    pub isl: f64,
    pub osl: f64,
}

/// A scaled node's state going into a decision.
#[derive(Debug, Clone, Copy)]
pub struct NodeState<'a> {
    pub node: &'a str,
    pub phase: Phase,
    pub bounds: Bounds,
    pub current: u32,
    /// Seconds since this node's count last changed (`f64::INFINITY` if never).
    pub since_change_s: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeDecision {
    pub node: String,
    pub phase: Phase,
    pub min: u32,
    pub max: u32,
    pub current: u32,
    pub desired: u32,
    /// Replicas the profile says the predicted load needs (fractional); none when reactive.
    pub needed: Option<f64>,
    pub reason: String,
}

/// Replicas (fractional) the predicted load needs, from the profile. `queued` requests
/// waiting at the node's workers are work for the next interval too: they count as
/// `queued / interval_s` more requests per second, so a backlog left by a burst is drained
/// within an interval instead of being carried while TTFT stays over its target.
pub fn needed(
    cfg: &PlannerConfig,
    profile: &Profile,
    pred: &Prediction,
    queued: u32,
    phase: Phase,
) -> f64 {
    let u = cfg.utilization;
    let rate = pred.request_rate + f64::from(queued) / cfg.interval_s;
    let prefill = rate * pred.isl / (profile.prefill_tps(pred.isl) * u);
    let decode = match profile.decode_tps(cfg.itl_ms, cfg.quantile()) {
        Some(tps) => rate * pred.osl / (tps * u),
        // No batch meets the ITL target: as many replicas as there may be.
        None if rate > 0.0 => f64::INFINITY,
        None => 0.0,
    };
    match phase {
        Phase::Prefill => prefill,
        Phase::Decode => decode,
        Phase::Both => prefill + decode,
    }
}

pub fn decide(
    cfg: &PlannerConfig,
    profile: Option<&Profile>,
    obs: &Observation,
    pred: &Prediction,
    st: &NodeState<'_>,
) -> NodeDecision {
    let missed = Missed::of(cfg, obs, st.phase);
    let queued = obs.nodes.get(st.node).map_or(0, |l| l.waiting);
    let mut proposal = match profile {
        Some(p) => by_profile(cfg, p, pred, queued, st, &missed),
        None => reactive(cfg, obs, pred, queued, st, &missed),
    };
    proposal.hold_scale_down(cfg, st, &missed);
    let desired = proposal.bounded(st);
    NodeDecision {
        node: st.node.to_owned(),
        phase: st.phase,
        min: st.bounds.min,
        max: st.bounds.max,
        current: st.current,
        desired,
        needed: proposal.needed,
        reason: proposal.reason,
    }
}

/// The targets this node answers for that the interval missed.
struct Missed {
    /// The first one missed (TTFT before ITL), as the reason says it.
    first: Option<String>,
    /// How far over its target the worst one was (1 when none was missed).
    how_far: f64,
}

impl Missed {
    fn of(cfg: &PlannerConfig, obs: &Observation, phase: Phase) -> Self {
        let pct = cfg.percentile;
        let ttft = obs
            .ttft_ms
            .filter(|t| phase != Phase::Decode && *t > cfg.ttft_ms)
            .map(|t| {
                (
                    format!("TTFT p{pct} {t:.0} ms > {} ms", cfg.ttft_ms),
                    t / cfg.ttft_ms,
                )
            });
        let itl = obs
            .itl_ms
            .filter(|t| phase != Phase::Prefill && *t > cfg.itl_ms)
            .map(|t| {
                (
                    format!("ITL p{pct} {t:.1} ms > {} ms", cfg.itl_ms),
                    t / cfg.itl_ms,
                )
            });
        let how_far = [&ttft, &itl]
            .into_iter()
            .flatten()
            .fold(1.0, |far: f64, (_, x)| far.max(*x));
        Missed {
            first: ttft.or(itl).map(|(m, _)| m),
            how_far,
        }
    }
}

/// A count proposed for the next interval, before the cool-down and the bounds have their say.
struct Proposal {
    desired: u32,
    needed: Option<f64>,
    reason: String,
}

/// Replicas by the profile's model of the predicted load; one more than it says when the
/// targets are missed anyway (the latencies are what users see).
fn by_profile(
    cfg: &PlannerConfig,
    p: &Profile,
    pred: &Prediction,
    queued: u32,
    st: &NodeState<'_>,
    missed: &Missed,
) -> Proposal {
    let load = format!(
        "predicted {:.1} req/s × {:.0} in / {:.0} out tokens",
        pred.request_rate, pred.isl, pred.osl
    );
    let load = if queued > 0 {
        format!("{load} and {queued} queued")
    } else {
        load
    };
    let current = st.current;
    let need = needed(cfg, p, pred, queued, st.phase);
    let by_model = if need.is_finite() {
        (need - 1e-9).ceil().max(0.0) as u32
    } else {
        u32::MAX
    };
    let (desired, reason) = match &missed.first {
        Some(m) if by_model <= current => (
            current + 1,
            format!(
                "{m} although the profile says {need:.2} replicas suffice for the {load}: one more"
            ),
        ),
        _ => (
            by_model,
            format!(
                "{load} need {need:.2} replicas by the profile (at {:.0} % of its capacity)",
                cfg.utilization * 100.0
            ),
        ),
    };
    Proposal {
        desired,
        needed: Some(need),
        reason,
    }
}

/// Without a profile: up when a target is missed (more when missed badly), down to the
/// minimum when idle, one down when the targets are met with room to spare.
fn reactive(
    cfg: &PlannerConfig,
    obs: &Observation,
    pred: &Prediction,
    queued: u32,
    st: &NodeState<'_>,
    missed: &Missed,
) -> Proposal {
    let current = st.current;
    let roomy = obs.ttft_ms.is_none_or(|t| t <= 0.5 * cfg.ttft_ms)
        && obs.itl_ms.is_none_or(|t| t <= 0.7 * cfg.itl_ms)
        && queued == 0
        && pred.request_rate <= obs.request_rate * 1.05;
    let (desired, reason) = if let Some(m) = &missed.first {
        let step = if missed.how_far > 2.0 {
            current.div_ceil(2).max(1)
        } else {
            1
        };
        (
            current + step,
            format!("{m}: +{step} (reactive, no profile)"),
        )
    } else if obs.request_rate == 0.0 && obs.inflight == 0 && pred.request_rate == 0.0 {
        (st.bounds.min, "no requests: down to min".into())
    } else if roomy {
        (
            current.saturating_sub(1),
            "targets met with room (TTFT under half its target, ITL under 70 %, nothing queued, load not rising): one less".into(),
        )
    } else {
        (current, "targets met".into())
    };
    Proposal {
        desired,
        needed: None,
        reason,
    }
}

impl Proposal {
    /// Scale-downs never happen while a target is missed, nor within the cool-down of the
    /// last change.
    fn hold_scale_down(&mut self, cfg: &PlannerConfig, st: &NodeState<'_>, missed: &Missed) {
        let current = st.current;
        if self.desired < current {
            if missed.first.is_some() {
                self.desired = current;
                self.reason
                    .push_str("; no scale-down while a target is missed");
            } else if st.since_change_s < cfg.cooldown_s {
                self.desired = current;
                self.reason.push_str(&format!(
                    "; scale-down held for the cool-down ({:.0} s left)",
                    cfg.cooldown_s - st.since_change_s
                ));
            }
        }
    }

    /// The count within the node's `[min, max]`, saying so in the reason when it was held.
    fn bounded(&mut self, st: &NodeState<'_>) -> u32 {
        let bounded = self.desired.clamp(st.bounds.min, st.bounds.max);
        if bounded != self.desired {
            let which = if bounded == st.bounds.max {
                "max"
            } else {
                "min"
            };
            self.reason
                .push_str(&format!("; held at {which} {bounded}"));
        }
        bounded
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PredictorKind;
    use crate::predict::{Predictor, Smoothed};
    use crate::profile::tests::mocker_like;

    fn cfg() -> PlannerConfig {
        PlannerConfig {
            ttft_ms: 200.0,
            itl_ms: 15.0,
            percentile: 90.0,
            interval_s: 5.0,
            cooldown_s: 15.0,
            predictor: PredictorKind::Holt,
            profile: None,
            utilization: 0.8,
            nodes: BTreeMap::from([(
                "decode".into(),
                Bounds {
                    min: 1,
                    max: 6,
                    ttft_ms: None,
                    itl_ms: None,
                },
            )]),
        }
    }

    /// One recorded interval: arrivals per second, TTFT and ITL p90, requests queued.
    #[derive(Clone, Copy)]
    struct Rec(f64, f64, f64, u32);

    fn observation(r: Rec, interval_s: f64) -> Observation {
        Observation {
            interval_s,
            request_rate: r.0,
            finished: (r.0 * interval_s) as u64,
            errors: 0,
            isl: Some(512.0),
            osl: Some(64.0),
            ttft_ms: (r.0 > 0.0).then_some(r.1),
            itl_ms: (r.0 > 0.0).then_some(r.2),
            inflight: 0,
            pools: BTreeMap::new(),
            nodes: BTreeMap::from([(
                "decode".into(),
                NodeLoad {
                    workers: 1,
                    running: 0,
                    waiting: r.3,
                    kv_usage: 0.0,
                },
            )]),
        }
    }

    /// Replay a recorded series through the predictor and the decision, applying each
    /// decision at once; the replica counts after each interval.
    fn replay(cfg: &PlannerConfig, profile: Option<&Profile>, series: &[Rec]) -> Vec<u32> {
        let mut rate = Predictor::new(cfg.predictor);
        let (mut isl, mut osl) = (Smoothed::default(), Smoothed::default());
        let mut current = 1;
        let mut since = f64::INFINITY;
        let mut out = Vec::new();
        for &r in series {
            let obs = observation(r, cfg.interval_s);
            rate.observe(obs.request_rate);
            isl.observe(512.0);
            osl.observe(64.0);
            let pred = Prediction {
                request_rate: rate.predict().unwrap_or(0.0),
                isl: isl.get().unwrap_or(0.0),
                osl: osl.get().unwrap_or(0.0),
            };
            let st = NodeState {
                node: "decode",
                phase: Phase::Both,
                bounds: cfg.nodes["decode"],
                current,
                since_change_s: since,
            };
            let d = decide(cfg, profile, &obs, &pred, &st);
            since = if d.desired != current {
                cfg.interval_s
            } else {
                since + cfg.interval_s
            };
            current = d.desired;
            out.push(current);
        }
        out
    }

    #[test]
    fn profile_ramp_grows_ahead_and_drop_shrinks_after_the_cooldown() {
        let mut cfg = cfg();
        let p = mocker_like();
        cfg.profile = Some("p.json".into());
        cfg.cooldown_s = 30.0;
        // Rate rising 3 → 45 req/s (latencies fine: the model leads), then down to 5.
        let ramp: Vec<Rec> = (1..=15)
            .map(|i| Rec(3.0 * f64::from(i), 50.0, 8.0, 0))
            .chain((0..8).map(|_| Rec(5.0, 30.0, 6.0, 0)))
            .collect();
        let counts = replay(&cfg, Some(&p), &ramp);
        // At 45 req/s: prefill 45 × 512 / (32 583 × 0.8) ≈ 0.88 replicas; decode at ITL p90
        // ≤ 15 ms (2600 + 0.6/9.6 · 500 ≈ 2631 tokens/s) 45 × 64 / (2631 × 0.8) ≈ 1.37.
        let at = |rate| Prediction {
            request_rate: rate,
            isl: 512.0,
            osl: 64.0,
        };
        let need_45 = needed(&cfg, &p, &at(45.0), 0, Phase::Both);
        assert!((need_45 - 2.25).abs() < 0.01, "{need_45}");
        assert!(counts[..15].windows(2).all(|w| w[1] >= w[0]), "{counts:?}");
        assert_eq!(counts[14], 3, "{counts:?}");
        // Holt leads the ramp: each count is reached no later than with the last interval's
        // rate, and some earlier.
        let mut flat = cfg.clone();
        flat.predictor = PredictorKind::Constant;
        let lagging = replay(&flat, Some(&p), &ramp);
        assert!(
            counts[..15].iter().zip(&lagging[..15]).all(|(h, c)| h >= c),
            "{counts:?} vs {lagging:?}"
        );
        assert!(
            counts[..15].iter().zip(&lagging[..15]).any(|(h, c)| h > c),
            "{counts:?} vs {lagging:?}"
        );
        // After the drop: held for the cool-down (6 intervals of 5 s since the last change),
        // then down to 1.
        assert!(counts[15] > 1, "not at once: {counts:?}");
        assert_eq!(*counts.last().unwrap(), 1, "{counts:?}");
    }

    #[test]
    fn reactive_spike_scales_up_fast_and_holds_while_missed() {
        let cfg = cfg();
        // Quiet, a spike missing the TTFT target by 5× for three intervals, then quiet.
        let quiet = Rec(5.0, 40.0, 6.0, 0);
        let series: Vec<Rec> = [
            quiet,
            Rec(60.0, 1000.0, 9.0, 40),
            Rec(60.0, 1000.0, 9.0, 30),
            Rec(60.0, 300.0, 9.0, 5),
            Rec(60.0, 90.0, 8.0, 0),
        ]
        .into_iter()
        .chain(std::iter::repeat_n(quiet, 8))
        .collect();
        let counts = replay(&cfg, None, &series);
        // 5× over: +1 (half of 1, at least 1) → 2; 5× over again: +1 → 3; 1.5× over: +1 → 4.
        assert_eq!(&counts[..4], &[1, 2, 3, 4], "{counts:?}");
        // Met but not roomy (90 ms > half of 200): held.
        assert_eq!(counts[4], 4);
        // Quiet: one less per interval once the cool-down since the last change is over.
        assert!(counts[5..].windows(2).all(|w| w[1] <= w[0]));
        assert_eq!(*counts.last().unwrap(), 1, "{counts:?}");
        let max = cfg.nodes["decode"].max;
        assert!(counts.iter().all(|&c| (1..=max).contains(&c)));
    }

    #[test]
    fn a_drop_to_nothing_goes_to_min_after_the_cooldown_and_max_caps() {
        let mut cfg = cfg();
        cfg.nodes.insert(
            "decode".into(),
            Bounds {
                min: 2,
                max: 3,
                ttft_ms: None,
                itl_ms: None,
            },
        );
        let st = NodeState {
            node: "decode",
            phase: Phase::Both,
            bounds: cfg.nodes["decode"],
            current: 3,
            since_change_s: 5.0,
        };
        let idle = Observation::default();
        let none = Prediction {
            request_rate: 0.0,
            isl: 512.0,
            osl: 64.0,
        };
        let d = decide(&cfg, None, &idle, &none, &st);
        assert_eq!(d.desired, 3, "{}", d.reason);
        assert!(d.reason.contains("cool-down"), "{}", d.reason);
        let d = decide(
            &cfg,
            None,
            &idle,
            &none,
            &NodeState {
                since_change_s: 20.0,
                ..st
            },
        );
        assert_eq!(d.desired, 2, "{}", d.reason);
        // Missed by far at max: stays at max, says so.
        let over = observation(Rec(50.0, 2000.0, 9.0, 100), 5.0);
        let d = decide(&cfg, None, &over, &none, &st);
        assert_eq!(d.desired, 3);
        assert!(d.reason.contains("held at max"), "{}", d.reason);
    }

    #[test]
    fn a_backlog_is_work_for_the_next_interval() {
        let mut cfg = cfg();
        cfg.profile = Some("p.json".into());
        let p = mocker_like();
        let pred = Prediction {
            request_rate: 5.0,
            isl: 512.0,
            osl: 64.0,
        };
        let st = NodeState {
            node: "decode",
            phase: Phase::Both,
            bounds: Bounds {
                min: 1,
                max: 6,
                ttft_ms: None,
                itl_ms: None,
            },
            current: 1,
            since_change_s: f64::INFINITY,
        };
        // 5 req/s alone: 0.25 replicas. With 100 requests queued and a 5 s interval, 25 req/s
        // of work: 1.25 → 2 (its TTFT is fine: the model, not the miss, asks for it).
        let mut obs = observation(Rec(5.0, 100.0, 6.0, 0), 5.0);
        assert_eq!(decide(&cfg, Some(&p), &obs, &pred, &st).desired, 1);
        obs.nodes.get_mut("decode").unwrap().waiting = 100;
        let d = decide(&cfg, Some(&p), &obs, &pred, &st);
        assert_eq!(d.desired, 2, "{}", d.reason);
        assert!((d.needed.unwrap() - 1.25).abs() < 0.01, "{:?}", d.needed);
        assert!(d.reason.contains("100 queued"), "{}", d.reason);
    }

    #[test]
    fn disaggregated_nodes_answer_for_their_own_target() {
        let cfg = cfg();
        // TTFT missed, ITL fine: the prefill node grows, the decode node does not.
        let obs = observation(Rec(20.0, 900.0, 8.0, 0), 5.0);
        let pred = Prediction {
            request_rate: 20.0,
            isl: 512.0,
            osl: 64.0,
        };
        let st = |phase| NodeState {
            node: "decode",
            phase,
            bounds: Bounds {
                min: 1,
                max: 4,
                ttft_ms: None,
                itl_ms: None,
            },
            current: 2,
            since_change_s: f64::INFINITY,
        };
        assert_eq!(
            decide(&cfg, None, &obs, &pred, &st(Phase::Prefill)).desired,
            3
        );
        assert_eq!(
            decide(&cfg, None, &obs, &pred, &st(Phase::Decode)).desired,
            2
        );
        // With the profile, decode needs 20 × 64 / (2631 × 0.8) ≈ 0.61 → 1 replica.
        let p = mocker_like();
        let d = decide(&cfg, Some(&p), &obs, &pred, &st(Phase::Decode));
        assert_eq!(d.desired, 1, "{}", d.reason);
        // …and prefill 20 × 512 / (32 583 × 0.8) ≈ 0.39, but its TTFT is missed: one more.
        let d = decide(&cfg, Some(&p), &obs, &pred, &st(Phase::Prefill));
        assert_eq!(d.desired, 3, "{}", d.reason);
    }

    #[test]
    fn each_pool_is_scaled_on_its_own_traffic_and_targets() {
        // Two pools: `short` run for a 100 ms TTFT, `long` on the graph's 200 ms. Over the
        // whole frontend p90 TTFT is 900 ms (the long prompts'); per pool, short's is 80 ms
        // (met) and long's 900 ms (missed).
        let mut cfg = cfg();
        cfg.nodes = BTreeMap::from([
            (
                "short".into(),
                Bounds {
                    min: 1,
                    max: 4,
                    ttft_ms: Some(100.0),
                    itl_ms: None,
                },
            ),
            (
                "long".into(),
                Bounds {
                    min: 1,
                    max: 4,
                    ttft_ms: None,
                    itl_ms: None,
                },
            ),
        ]);
        let mut obs = observation(Rec(20.0, 900.0, 8.0, 0), 5.0);
        let load = obs.nodes["decode"].clone();
        obs.nodes = BTreeMap::from([("short".into(), load.clone()), ("long".into(), load)]);
        let pool = |rate: f64, isl: f64, ttft: f64| PoolObservation {
            request_rate: rate,
            isl: Some(isl),
            osl: Some(64.0),
            ttft_ms: Some(ttft),
            itl_ms: Some(8.0),
        };
        obs.pools = BTreeMap::from([
            ("short".into(), pool(15.0, 100.0, 80.0)),
            ("long".into(), pool(5.0, 4000.0, 900.0)),
        ]);
        let pred = Prediction {
            request_rate: 20.0,
            isl: 512.0,
            osl: 64.0,
        };
        fn st<'a>(cfg: &PlannerConfig, node: &'a str) -> NodeState<'a> {
            NodeState {
                node,
                phase: Phase::Both,
                bounds: cfg.nodes[node],
                current: 2,
                since_change_s: f64::INFINITY,
            }
        }
        let desired = |node: &str| {
            let (c, o) = node_view(&cfg, &obs, node, obs.pools.get(node));
            assert_eq!(c.ttft_ms, if node == "short" { 100.0 } else { 200.0 });
            decide(&c, None, &o, &pred, &st(&cfg, node)).desired
        };
        assert_eq!(desired("long"), 3, "long misses its target");
        assert_eq!(desired("short"), 2, "short meets its own");
        // On the whole frontend's latencies both would have grown.
        assert_eq!(
            decide(&cfg, None, &obs, &pred, &st(&cfg, "short")).desired,
            3
        );
        // A pool with no request this interval is idle, whatever the others do.
        let (c, o) = node_view(&cfg, &obs, "short", Some(&PoolObservation::default()));
        assert_eq!((o.request_rate, o.ttft_ms), (0.0, None));
        assert_eq!(c.ttft_ms, 100.0);
    }
}
