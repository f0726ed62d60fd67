//! Following a graph's SLA planner during a run (`dyn bench --planner`): its decisions are
//! sampled from the server's admin endpoint (`GET /admin/planner`, the same one `dyn inspect
//! planner` reads) once a second, so a run can show replicas next to TTFT over time and count
//! the replica-seconds the load cost.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// One node's replicas at one moment of the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannerSample {
    /// Seconds since the run started.
    pub t_s: f64,
    pub node: String,
    pub desired: u32,
    pub actual: u32,
}

/// Poll `{base}/admin/planner` every second from `start` until `done`.
pub async fn sample(base: String, start: Instant, done: Arc<AtomicBool>) -> Vec<PlannerSample> {
    let http = reqwest::Client::new();
    let url = format!("{base}/admin/planner");
    let mut out = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while !done.load(Ordering::Relaxed) {
        tick.tick().await;
        let Ok(resp) = http.get(&url).send().await else {
            continue;
        };
        let Ok(v) = resp.json::<serde_json::Value>().await else {
            continue;
        };
        let t_s = start.elapsed().as_secs_f64();
        for n in v["nodes"].as_array().into_iter().flatten() {
            let count = |k: &str| n[k].as_u64().and_then(|x| u32::try_from(x).ok());
            if let (Some(node), Some(desired), Some(actual)) =
                (n["node"].as_str(), count("desired"), count("actual"))
            {
                out.push(PlannerSample {
                    t_s,
                    node: node.to_owned(),
                    desired,
                    actual,
                });
            }
        }
    }
    out
}

/// Replica-seconds over `[0, end_s]`: each sample's count held until the next sample of its
/// node (the first one from 0).
pub fn replica_seconds(samples: &[PlannerSample], end_s: f64) -> f64 {
    let mut nodes: Vec<&str> = samples.iter().map(|s| s.node.as_str()).collect();
    nodes.sort_unstable();
    nodes.dedup();
    let mut total = 0.0;
    for node in nodes {
        let mine: Vec<&PlannerSample> = samples.iter().filter(|s| s.node == node).collect();
        for (i, s) in mine.iter().enumerate() {
            let from = if i == 0 { 0.0 } else { s.t_s };
            let to = mine.get(i + 1).map_or(end_s, |n| n.t_s).min(end_s);
            total += f64::from(s.actual) * (to - from).max(0.0);
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_seconds_hold_each_count_until_the_next_sample() {
        let s = |t_s, actual| PlannerSample {
            t_s,
            node: "decode".into(),
            desired: actual,
            actual,
        };
        // 1 replica for 10 s, 3 for 5 s, 2 for the last 5 s.
        let samples = [s(1.0, 1), s(10.0, 3), s(15.0, 2)];
        assert_eq!(replica_seconds(&samples, 20.0), 10.0 + 15.0 + 10.0);
        assert_eq!(replica_seconds(&[], 20.0), 0.0);
    }
}
