//! Predicting the next interval's load from the intervals seen so far.
//!
//! The default is Holt's linear method (double exponential smoothing): a level and a trend,
//! each smoothed. On a ramp the trend carries the prediction one interval ahead of the last
//! observation, so replicas are started before TTFT climbs rather than after; on a flat load
//! it reduces to a smoothed mean. It needs no history to fit and no parameters per
//! deployment, where ARIMA or Prophet (Dynamo's other predictors) need tens of intervals —
//! minutes at a 10 s interval — before they say anything. Prompt and output lengths change
//! slowly and are smoothed without a trend.

use super::config::PredictorKind;

/// Smoothing of the level: weight of the newest observation.
const ALPHA: f64 = 0.6;
/// Smoothing of the trend.
const BETA: f64 = 0.4;

/// One series' predictor.
#[derive(Debug, Clone)]
pub struct Predictor {
    kind: PredictorKind,
    level: Option<f64>,
    trend: f64,
    last: f64,
}

impl Predictor {
    pub fn new(kind: PredictorKind) -> Self {
        Self {
            kind,
            level: None,
            trend: 0.0,
            last: 0.0,
        }
    }

    pub fn observe(&mut self, x: f64) {
        self.last = x;
        self.level = Some(match self.level {
            None => x,
            Some(prev) => {
                let level = ALPHA * x + (1.0 - ALPHA) * (prev + self.trend);
                self.trend = BETA * (level - prev) + (1.0 - BETA) * self.trend;
                level
            }
        });
    }

    /// The next interval's value (never negative); `None` before any observation.
    pub fn predict(&self) -> Option<f64> {
        let level = self.level?;
        Some(match self.kind {
            PredictorKind::Constant => self.last,
            PredictorKind::Holt => (level + self.trend).max(0.0),
        })
    }
}

/// An exponentially weighted mean, for prompt and output lengths.
#[derive(Debug, Clone, Default)]
pub struct Smoothed(Option<f64>);

impl Smoothed {
    pub fn observe(&mut self, x: f64) {
        self.0 = Some(match self.0 {
            None => x,
            Some(m) => ALPHA * x + (1.0 - ALPHA) * m,
        });
    }

    pub fn get(&self) -> Option<f64> {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holt_leads_a_ramp_and_settles_on_a_flat_load() {
        let mut p = Predictor::new(PredictorKind::Holt);
        for x in [2.0, 4.0, 6.0, 8.0, 10.0] {
            p.observe(x);
        }
        let next = p.predict().unwrap();
        assert!(next > 10.0, "a ramp is extrapolated: {next}");
        for _ in 0..20 {
            p.observe(10.0);
        }
        assert!((p.predict().unwrap() - 10.0).abs() < 0.1);
        let mut c = Predictor::new(PredictorKind::Constant);
        c.observe(3.0);
        c.observe(7.0);
        assert_eq!(c.predict(), Some(7.0));
    }

    #[test]
    fn a_drop_never_predicts_below_zero() {
        let mut p = Predictor::new(PredictorKind::Holt);
        for x in [20.0, 20.0, 0.0, 0.0] {
            p.observe(x);
        }
        assert!(p.predict().unwrap() >= 0.0);
    }
}
