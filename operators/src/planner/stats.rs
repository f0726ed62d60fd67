//! What each frontend tells the planner about its traffic, once a second on the event plane.
//!
//! The `http` ingress counts arrivals, finished and failed requests and their token counts,
//! and keeps each request's TTFT and ITL (its mean gap between tokens, as AIPerf reports ITL
//! per request) for the current window; a task publishes the window on
//! [`stats_subject`] and starts a new one. Raw samples rather than histogram buckets: a
//! window holds at most a few thousand (past [`MAX_SAMPLES`], a uniform sample of them), so
//! the planner computes exact percentiles over its interval from every frontend at little
//! cost, and no bucket layout bounds their precision.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dyn_pipeline::{BuildCx, BuildError, Service};
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
}

#[derive(Default)]
struct Window {
    w: FrontendWindow,
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
    inflight: Arc<AtomicU64>,
}

impl Service for FrontendStats {
    async fn start(cx: &BuildCx) -> Result<Self, BuildError> {
        let window: Arc<Mutex<Window>> = Arc::default();
        let inflight = Arc::new(AtomicU64::new(0));
        let id = cx.instance_id;
        tokio::spawn(publish(
            Arc::downgrade(&window),
            inflight.clone(),
            id,
            cx.planes.events.clone(),
            stats_subject(&cx.namespace),
        ));
        Ok(Self {
            id,
            window,
            inflight,
        })
    }
}

impl FrontendStats {
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn arrived(&self) {
        self.inflight.fetch_add(1, Ordering::Relaxed);
        self.window.lock().w.arrivals += 1;
    }

    pub fn first_token(&self, ttft: Duration) {
        let mut g = self.window.lock();
        let w = &mut g.w;
        Window::sample(
            &mut w.ttft_ms,
            &mut w.ttft_seen,
            ttft.as_secs_f32() * 1000.0,
        );
    }

    /// A request ended: `ok` or failed, its token counts (when known), and its mean gap
    /// between tokens (when it had two or more).
    pub fn finished(&self, ok: bool, tokens: Option<(u32, u32)>, itl: Option<Duration>) {
        self.inflight.fetch_sub(1, Ordering::Relaxed);
        let mut g = self.window.lock();
        let w = &mut g.w;
        if ok {
            w.finished += 1;
        } else {
            w.errors += 1;
        }
        if let Some((input, output)) = tokens {
            w.input_tokens += u64::from(input);
            w.output_tokens += u64::from(output);
        }
        if let Some(itl) = itl {
            Window::sample(&mut w.itl_ms, &mut w.itl_seen, itl.as_secs_f32() * 1000.0);
        }
    }
}

async fn publish(
    window: Weak<Mutex<Window>>,
    inflight: Arc<AtomicU64>,
    id: u64,
    events: Arc<dyn dyn_pipeline::planes::EventBus>,
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
        let mut w = std::mem::take(&mut window.lock().w);
        drop(window);
        let now = Instant::now();
        w.frontend_id = id;
        w.window_ms = u64::try_from((now - opened).as_millis()).unwrap_or(u64::MAX);
        w.inflight = inflight.load(Ordering::Relaxed);
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
