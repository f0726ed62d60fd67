//! What each frontend tells the planner about its traffic, once a second on the event plane.
//!
//! The `http` ingress counts arrivals, finished and failed requests and their token counts,
//! and keeps each request's TTFT and ITL (its mean gap between tokens, as AIPerf reports ITL
//! per request) for the current window; a task publishes the window on
//! [`stats_subject`] and starts a new one. Raw samples rather than histogram buckets: a
//! window holds at most a few thousand (past [`MAX_SAMPLES`], a uniform sample of them), so
//! the planner computes exact percentiles over its interval from every frontend at little
//! cost, and no bucket layout bounds their precision.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dyn_core::{BuildCx, BuildError, Service};
use parking_lot::Mutex;
use rand::Rng;
use serde::{Deserialize, Serialize};

/// How often a frontend publishes its window.
pub const WINDOW: Duration = Duration::from_secs(1);
/// Latency samples kept per window and series.
pub const MAX_SAMPLES: usize = 4096;

/// Event-plane subject of the frontends' windows.
pub fn stats_subject(namespace: &str) -> String {
    format!("dyn.{namespace}.frontend.stats")
}

/// One frontend's traffic over one window.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FrontendWindow {
    pub frontend_id: u64,
    pub window_ms: u64,
    pub arrivals: u64,
    pub finished: u64,
    pub errors: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Requests in flight when the window closed.
    pub inflight: u64,
    pub ttft_ms: Vec<f32>,
    pub itl_ms: Vec<f32>,
    /// Latency samples seen in the window (more than kept past [`MAX_SAMPLES`]).
    #[serde(default)]
    pub ttft_seen: u64,
    #[serde(default)]
    pub itl_seen: u64,
    /// Where a router chooses among pools: each pool's share of the window, by worker node.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pools: BTreeMap<String, PoolWindow>,
}

/// One pool's requests in a window: those that finished there, their tokens and latencies.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PoolWindow {
    pub finished: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub ttft_ms: Vec<f32>,
    pub itl_ms: Vec<f32>,
    #[serde(default)]
    pub ttft_seen: u64,
    #[serde(default)]
    pub itl_seen: u64,
}

/// The window's latency samples (its counts are filled in from [`Counts`] when it is
/// published), so only a request's first token and its end take the lock.
#[derive(Default)]
struct Window {
    w: FrontendWindow,
}

/// The window's counts, kept apart from the lock: every request adds to them.
#[derive(Default)]
struct Counts {
    arrivals: AtomicU64,
    finished: AtomicU64,
    errors: AtomicU64,
    input_tokens: AtomicU64,
    output_tokens: AtomicU64,
    inflight: AtomicU64,
}

impl Counts {
    /// Move the window's counts into `w` and start the next window (in flight carries on).
    fn take_into(&self, w: &mut FrontendWindow) {
        w.arrivals = self.arrivals.swap(0, Ordering::Relaxed);
        w.finished = self.finished.swap(0, Ordering::Relaxed);
        w.errors = self.errors.swap(0, Ordering::Relaxed);
        w.input_tokens = self.input_tokens.swap(0, Ordering::Relaxed);
        w.output_tokens = self.output_tokens.swap(0, Ordering::Relaxed);
        w.inflight = self.inflight.load(Ordering::Relaxed);
    }
}

impl Window {
    /// Reservoir sampling: every sample of the window is kept with the same probability.
    fn sample(v: &mut Vec<f32>, seen: &mut u64, x: f32) {
        *seen += 1;
        if v.len() < MAX_SAMPLES {
            v.push(x);
        } else {
            let i = rand::rng().random_range(0..*seen);
            if let Some(slot) = usize::try_from(i).ok().and_then(|i| v.get_mut(i)) {
                *slot = x;
            }
        }
    }
}

/// The recorder the `http` ingress writes into; a [`Service`], so every ingress of a process
/// shares one.
pub struct FrontendStats {
    id: u64,
    window: Arc<Mutex<Window>>,
    counts: Arc<Counts>,
}

impl Service for FrontendStats {
    async fn start(cx: &BuildCx) -> Result<Self, BuildError> {
        let window: Arc<Mutex<Window>> = Arc::default();
        let counts: Arc<Counts> = Arc::default();
        let id = cx.instance_id.get();
        tokio::spawn(publish(
            Arc::downgrade(&window),
            counts.clone(),
            id,
            cx.planes.events.clone(),
            stats_subject(&cx.namespace),
        ));
        Ok(Self { id, window, counts })
    }
}

impl FrontendStats {
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn arrived(&self) {
        self.counts.inflight.fetch_add(1, Ordering::Relaxed);
        self.counts.arrivals.fetch_add(1, Ordering::Relaxed);
    }

    /// A request's first token came `ttft` after it arrived; `pool`: the pool serving it,
    /// where a router chose one.
    pub fn first_token(&self, ttft: Duration, pool: Option<&str>) {
        let ms = ttft.as_secs_f32() * 1000.0;
        let mut g = self.window.lock();
        let w = &mut g.w;
        Window::sample(&mut w.ttft_ms, &mut w.ttft_seen, ms);
        if let Some(p) = pool {
            with_pool(&mut w.pools, p, |p| {
                Window::sample(&mut p.ttft_ms, &mut p.ttft_seen, ms);
            });
        }
    }

    /// A request ended: `ok` or failed, its token counts (when known), and its mean gap
    /// between tokens (when it had two or more); `pool` as for [`Self::first_token`].
    pub fn finished(
        &self,
        ok: bool,
        tokens: Option<(u32, u32)>,
        itl: Option<Duration>,
        pool: Option<&str>,
    ) {
        let c = &self.counts;
        c.inflight.fetch_sub(1, Ordering::Relaxed);
        let done = if ok { &c.finished } else { &c.errors };
        done.fetch_add(1, Ordering::Relaxed);
        if let Some((input, output)) = tokens {
            c.input_tokens
                .fetch_add(u64::from(input), Ordering::Relaxed);
            c.output_tokens
                .fetch_add(u64::from(output), Ordering::Relaxed);
        }
        let itl_ms = itl.map(|d| d.as_secs_f32() * 1000.0);
        if itl_ms.is_none() && pool.is_none() {
            return;
        }
        let mut g = self.window.lock();
        let w = &mut g.w;
        if let Some(ms) = itl_ms {
            Window::sample(&mut w.itl_ms, &mut w.itl_seen, ms);
        }
        if let Some(p) = pool {
            with_pool(&mut w.pools, p, |p| {
                p.finished += u64::from(ok);
                if let Some((input, output)) = tokens {
                    p.input_tokens += u64::from(input);
                    p.output_tokens += u64::from(output);
                }
                if let Some(ms) = itl_ms {
                    Window::sample(&mut p.itl_ms, &mut p.itl_seen, ms);
                }
            });
        }
    }
}

/// `f` on pool `name`'s share of the window, made on its first request (the name copied then
/// only).
fn with_pool(
    pools: &mut BTreeMap<String, PoolWindow>,
    name: &str,
    f: impl FnOnce(&mut PoolWindow),
) {
    match pools.get_mut(name) {
        Some(p) => f(p),
        None => f(pools.entry(name.to_owned()).or_default()),
    }
}

async fn publish(
    window: Weak<Mutex<Window>>,
    counts: Arc<Counts>,
    id: u64,
    events: Arc<dyn dyn_core::planes::EventBus>,
    subject: String,
) {
    let mut tick = tokio::time::interval(WINDOW);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let mut opened = Instant::now();
    loop {
        tick.tick().await;
        let Some(window) = window.upgrade() else {
            return;
        };
        // A request ending at the cut may be counted in one window and sampled in the next:
        // the planner sums several windows, so that does not matter.
        let mut w = std::mem::take(&mut window.lock().w);
        counts.take_into(&mut w);
        drop(window);
        let now = Instant::now();
        w.frontend_id = id;
        w.window_ms = u64::try_from((now - opened).as_millis()).unwrap_or(u64::MAX);
        opened = now;
        match serde_json::to_vec(&w) {
            Ok(body) => {
                if let Err(e) = events.publish(&subject, Bytes::from(body)).await {
                    tracing::debug!(error = %e, "Cannot publish the frontend's stats");
                }
            }
            Err(e) => tracing::warn!(error = %e, "Cannot encode the frontend's stats"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_window_keeps_a_uniform_sample() {
        let mut v = Vec::new();
        let mut seen = 0;
        for i in 0..(MAX_SAMPLES * 4) {
            Window::sample(&mut v, &mut seen, i as f32);
        }
        assert_eq!(v.len(), MAX_SAMPLES);
        assert_eq!(seen as usize, MAX_SAMPLES * 4);
        // A uniform sample of 0..4N has a mean near 2N.
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64;
        let want = (MAX_SAMPLES * 2) as f64;
        assert!((mean / want - 1.0).abs() < 0.05, "mean {mean}");
    }
}
