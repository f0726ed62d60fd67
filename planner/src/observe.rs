//! Gathering one interval's observation from the event plane: the frontends' windows
//! ([`super::stats`]) and the scaled nodes' workers' load metrics.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dyn_core::planes::EventBus;
use dyn_protocol::kv::{LoadMetrics, load_metrics_subject};
use futures::StreamExt;
use parking_lot::Mutex;

use super::decide::{NodeLoad, Observation, PoolObservation};
use super::stats::{FrontendWindow, PoolWindow, stats_subject};

/// A worker that has not reported for this long is not counted.
const STALE: Duration = Duration::from_secs(10);

#[derive(Default)]
struct Acc {
    arrivals: u64,
    finished: u64,
    errors: u64,
    input_tokens: u64,
    output_tokens: u64,
    ttft: Vec<f32>,
    itl: Vec<f32>,
    /// Per frontend: when it last published and its requests in flight then.
    inflight: HashMap<u64, (Instant, u64)>,
    /// Per node and worker: the latest load report.
    workers: HashMap<(String, u64), (Instant, LoadMetrics)>,
    /// Per pool (worker node): its requests' share, where a router chooses among pools.
    pools: BTreeMap<String, PoolWindow>,
}

impl Acc {
    fn add(&mut self, w: FrontendWindow) {
        self.arrivals += w.arrivals;
        self.finished += w.finished;
        self.errors += w.errors;
        self.input_tokens += w.input_tokens;
        self.output_tokens += w.output_tokens;
        self.ttft.extend(w.ttft_ms);
        self.itl.extend(w.itl_ms);
        self.inflight
            .insert(w.frontend_id, (Instant::now(), w.inflight));
        for (node, p) in w.pools {
            let a = self.pools.entry(node).or_default();
            a.finished += p.finished;
            a.input_tokens += p.input_tokens;
            a.output_tokens += p.output_tokens;
            a.ttft_ms.extend(p.ttft_ms);
            a.itl_ms.extend(p.itl_ms);
        }
    }
}

/// Follows the event plane and hands out one [`Observation`] per interval.
pub struct Observer {
    acc: Arc<Mutex<Acc>>,
    nodes: Vec<String>,
    quantile: f64,
    _tasks: Vec<tokio_util::task::AbortOnDropHandle<()>>,
}

impl Observer {
    pub async fn start(
        events: Arc<dyn EventBus>,
        namespace: &str,
        nodes: Vec<String>,
        quantile: f64,
    ) -> Result<Self, dyn_core::planes::PlaneError> {
        let acc: Arc<Mutex<Acc>> = Arc::default();
        let mut tasks = Vec::new();
        let mut frontends = events.subscribe(&stats_subject(namespace)).await?;
        let a = acc.clone();
        tasks.push(tokio_util::task::AbortOnDropHandle::new(tokio::spawn(
            async move {
                while let Some(ev) = frontends.next().await {
                    match serde_json::from_slice::<FrontendWindow>(&ev.payload) {
                        Ok(w) => a.lock().add(w),
                        Err(e) => tracing::debug!(error = %e, "Bad frontend stats message"),
                    }
                }
            },
        )));
        for node in &nodes {
            let mut loads = events
                .subscribe(&load_metrics_subject(namespace, node))
                .await?;
            let a = acc.clone();
            let node = node.clone();
            tasks.push(tokio_util::task::AbortOnDropHandle::new(tokio::spawn(
                async move {
                    while let Some(ev) = loads.next().await {
                        if let Ok(m) = serde_json::from_slice::<LoadMetrics>(&ev.payload) {
                            a.lock()
                                .workers
                                .insert((node.clone(), m.worker_id), (Instant::now(), m));
                        }
                    }
                },
            )));
        }
        Ok(Self {
            acc,
            nodes,
            quantile,
            _tasks: tasks,
        })
    }

    /// What arrived since the last call, over `interval`; starts the next interval.
    pub fn take(&self, interval: Duration) -> Observation {
        let mut acc = self.acc.lock();
        let now = Instant::now();
        acc.inflight.retain(|_, (at, _)| now - *at < STALE);
        acc.workers.retain(|_, (at, _)| now - *at < STALE);
        let secs = interval.as_secs_f64().max(1e-3);
        let pooled = std::mem::take(&mut acc.pools);
        let per = |total: u64| (acc.finished > 0).then(|| total as f64 / acc.finished as f64);
        let mut nodes = BTreeMap::new();
        for node in &self.nodes {
            let mut load = NodeLoad::default();
            let (mut used, mut total) = (0u64, 0u64);
            for ((n, _), (_, m)) in &acc.workers {
                if n != node {
                    continue;
                }
                load.workers += 1;
                load.running += m.requests_running;
                load.waiting += m.requests_waiting;
                used += u64::from(m.kv_active_blocks);
                total += u64::from(m.kv_total_blocks);
            }
            load.kv_usage = if total > 0 {
                used as f64 / total as f64
            } else {
                0.0
            };
            nodes.insert(node.clone(), load);
        }
        let q = self.quantile;
        let pools = pooled
            .into_iter()
            .map(|(node, mut p)| {
                let per = |total: u64| (p.finished > 0).then(|| total as f64 / p.finished as f64);
                let o = PoolObservation {
                    request_rate: p.finished as f64 / secs,
                    isl: per(p.input_tokens),
                    osl: per(p.output_tokens),
                    ttft_ms: quantile(&mut p.ttft_ms, q),
                    itl_ms: quantile(&mut p.itl_ms, q),
                };
                (node, o)
            })
            .collect();
        let obs = Observation {
            pools,
            interval_s: secs,
            request_rate: acc.arrivals as f64 / secs,
            finished: acc.finished,
            errors: acc.errors,
            isl: per(acc.input_tokens),
            osl: per(acc.output_tokens),
            ttft_ms: quantile(&mut acc.ttft, self.quantile),
            itl_ms: quantile(&mut acc.itl, self.quantile),
            inflight: acc.inflight.values().map(|(_, n)| n).sum(),
            nodes,
        };
        let keep = (
            std::mem::take(&mut acc.inflight),
            std::mem::take(&mut acc.workers),
        );
        *acc = Acc {
            inflight: keep.0,
            workers: keep.1,
            ..Acc::default()
        };
        obs
    }
}

/// The `q` quantile (nearest rank) of `v`, reordering it; `None` when empty.
pub fn quantile(v: &mut [f32], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    let (_, x, _) = v.select_nth_unstable_by(rank, f32::total_cmp);
    Some(f64::from(*x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let mut v: Vec<f32> = (1..=100).map(|i| i as f32).collect();
        assert_eq!(quantile(&mut v, 0.9), Some(90.0));
        assert_eq!(quantile(&mut v, 0.5), Some(50.0));
        assert_eq!(quantile(&mut [], 0.9), None);
    }

    #[tokio::test]
    async fn an_interval_sums_the_frontends_and_the_latest_worker_reports() {
        let bus: Arc<dyn EventBus> = Arc::new(dyn_core::planes::EmbeddedEventBus::default());
        let obs = Observer::start(bus.clone(), "ns", vec!["decode".into()], 0.9)
            .await
            .unwrap();
        for (id, arrivals) in [(1, 30), (2, 10)] {
            let w = FrontendWindow {
                frontend_id: id,
                window_ms: 1000,
                arrivals,
                finished: arrivals,
                input_tokens: arrivals * 100,
                output_tokens: arrivals * 10,
                inflight: 3,
                ttft_ms: (1..=10).map(|i| i as f32 * 10.0).collect(),
                itl_ms: vec![5.0; 10],
                ..Default::default()
            };
            bus.publish(&stats_subject("ns"), serde_json::to_vec(&w).unwrap().into())
                .await
                .unwrap();
        }
        for (worker, waiting) in [(7, 2), (8, 5), (7, 4)] {
            let m = LoadMetrics {
                worker_id: worker,
                requests_waiting: waiting,
                kv_active_blocks: 10,
                kv_total_blocks: 100,
                ..Default::default()
            };
            bus.publish(
                &load_metrics_subject("ns", "decode"),
                serde_json::to_vec(&m).unwrap().into(),
            )
            .await
            .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let o = obs.take(Duration::from_secs(2));
        assert_eq!(o.request_rate, 20.0);
        assert_eq!(o.isl, Some(100.0));
        assert_eq!(o.osl, Some(10.0));
        assert_eq!(o.ttft_ms, Some(90.0));
        assert_eq!(o.inflight, 6);
        let d = &o.nodes["decode"];
        assert_eq!(
            (d.workers, d.waiting),
            (2, 9),
            "the latest report per worker"
        );
        assert!((d.kv_usage - 0.1).abs() < 1e-9);
        // The next interval starts empty, but keeps what the workers last said.
        let o = obs.take(Duration::from_secs(2));
        assert_eq!(o.request_rate, 0.0);
        assert_eq!(o.nodes["decode"].workers, 2);
    }
}
