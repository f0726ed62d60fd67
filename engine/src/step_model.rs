//! What a worker tells routers about its speed: a line fitted to its recent steps.
//!
//! The KV router prices a candidate worker in time (queueing plus prefill), so it needs each
//! worker's step time and prefill cost per token. The engine loop times every step and feeds
//! [`StepModel`], an exponentially weighted least-squares fit of
//! `step ms = base + per_token × prefill tokens`. Old steps fade (half-life of
//! [`HALF_LIFE_STEPS`]), so the fit follows the batch as it grows or shrinks. Until the steps
//! have carried enough different prefill sizes the slope is unknown (0), and routers fall back
//! to the pool's other workers or their defaults.

/// Steps after which an observation weighs half as much.
const HALF_LIFE_STEPS: f64 = 200.0;

/// Exponentially weighted sums for `y = a + b·x`.
#[derive(Debug, Clone, Default)]
pub struct StepModel {
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
    /// The latest decode-only step (no prefill), which `base` falls back to without a slope.
    last_decode_ms: f64,
}

impl StepModel {
    /// One step took `ms` and computed `prefill_tokens` prompt tokens.
    pub fn observe(&mut self, prefill_tokens: usize, ms: f64) {
        if !ms.is_finite() || ms < 0.0 {
            return;
        }
        let decay = 0.5f64.powf(1.0 / HALF_LIFE_STEPS);
        let x = prefill_tokens as f64;
        self.w = self.w * decay + 1.0;
        self.x = self.x * decay + x;
        self.y = self.y * decay + ms;
        self.xx = self.xx * decay + x * x;
        self.xy = self.xy * decay + x * ms;
        if prefill_tokens == 0 {
            self.last_decode_ms = ms;
        }
    }

    /// `(step ms without prefill, ms per prefill token)`; zeros where not known yet.
    pub fn fit(&self) -> (f64, f64) {
        if self.w <= 0.0 {
            return (0.0, 0.0);
        }
        let (mx, my) = (self.x / self.w, self.y / self.w);
        let var = self.xx / self.w - mx * mx;
        let cov = self.xy / self.w - mx * my;
        // Needs spread in prefill sizes: at least a few tokens' standard deviation.
        if var < 16.0 {
            return (self.last_decode_ms.max(0.0), 0.0);
        }
        let slope = (cov / var).max(0.0);
        let base = (my - slope * mx).max(0.0);
        (base, slope)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovers_a_linear_step_time() {
        let mut m = StepModel::default();
        assert_eq!(m.fit(), (0.0, 0.0));
        for i in 0..400 {
            m.observe(0, 5.0);
            let tokens = (i % 7) * 300;
            m.observe(tokens, 5.0 + 0.02 * tokens as f64);
        }
        let (base, slope) = m.fit();
        assert!((base - 5.0).abs() < 1e-6, "{base}");
        assert!((slope - 0.02).abs() < 1e-9, "{slope}");
    }

    #[test]
    fn without_prefill_spread_the_slope_is_unknown() {
        let mut m = StepModel::default();
        for _ in 0..50 {
            m.observe(0, 7.5);
        }
        assert_eq!(m.fit(), (7.5, 0.0));
        m.observe(0, f64::NAN);
        assert_eq!(m.fit(), (7.5, 0.0));
    }
}
