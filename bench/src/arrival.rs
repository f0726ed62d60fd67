//! Open-loop arrival processes: when each request is meant to be sent.
//!
//! Gaps between requests are drawn from a gamma distribution with shape `burstiness` and mean
//! `1 / rate`, as vLLM's and AIPerf's benchmarks do: shape 1 is a Poisson process, a smaller
//! shape makes bursts (more short and more long gaps), a larger one approaches a constant rate.
//! The generator is seeded, so a schedule can be replayed exactly.

use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Gamma};

/// The distribution of gaps between requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// Exponential gaps (gamma with shape 1); `burstiness` must be 1.
    Poisson,
    /// Gamma gaps with shape `burstiness`.
    Gamma,
    /// Every gap is exactly `1 / rate`.
    Constant,
}

/// Send times (offsets from the start of the run) for an open-loop load.
#[derive(Debug)]
pub struct Schedule {
    gap: Gap,
    rng: StdRng,
    next: f64,
}

#[derive(Debug)]
enum Gap {
    Fixed(f64),
    Gamma(Gamma<f64>),
}

impl Schedule {
    /// A schedule at `rate` requests per second. Fails on a rate or burstiness that is not a
    /// positive finite number, or a Poisson process asked to be bursty.
    pub fn new(rate: f64, arrival: Arrival, burstiness: f64, seed: u64) -> Result<Self, String> {
        if !(rate.is_finite() && rate > 0.0) {
            return Err(format!(
                "the request rate must be a positive number, got {rate}"
            ));
        }
        if !(burstiness.is_finite() && burstiness > 0.0) {
            return Err(format!(
                "burstiness must be a positive number, got {burstiness}"
            ));
        }
        let gap = match arrival {
            Arrival::Constant => Gap::Fixed(1.0 / rate),
            Arrival::Poisson if burstiness != 1.0 => {
                return Err(
                    "a Poisson process has burstiness 1; use --arrival gamma for other values"
                        .into(),
                );
            }
            Arrival::Poisson | Arrival::Gamma => Gap::Gamma(
                Gamma::new(burstiness, 1.0 / (rate * burstiness)).map_err(|e| e.to_string())?,
            ),
        };
        Ok(Self {
            gap,
            rng: StdRng::seed_from_u64(seed),
            next: 0.0,
        })
    }
}

impl Iterator for Schedule {
    type Item = Duration;

    /// The first request goes at 0; each later one a drawn gap after the previous.
    fn next(&mut self) -> Option<Duration> {
        let at = self.next;
        self.next += match &self.gap {
            Gap::Fixed(g) => *g,
            Gap::Gamma(d) => d.sample(&mut self.rng),
        };
        // A vanishing rate can push the offset past what a Duration holds: never, in practice.
        Some(Duration::try_from_secs_f64(at).unwrap_or(Duration::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaps(arrival: Arrival, rate: f64, burstiness: f64, n: usize) -> Vec<f64> {
        let times: Vec<f64> = Schedule::new(rate, arrival, burstiness, 42)
            .unwrap()
            .take(n + 1)
            .map(|d| d.as_secs_f64())
            .collect();
        times.windows(2).map(|w| w[1] - w[0]).collect()
    }

    fn mean_var(x: &[f64]) -> (f64, f64) {
        let n = x.len() as f64;
        let mean = x.iter().sum::<f64>() / n;
        let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        (mean, var)
    }

    #[test]
    fn poisson_mean_rate_and_exponential_variance() {
        let g = gaps(Arrival::Poisson, 200.0, 1.0, 100_000);
        let (mean, var) = mean_var(&g);
        // Rate within 1 %: the standard error of the mean over 1e5 exponential gaps is 0.3 %.
        assert!((1.0 / mean - 200.0).abs() < 2.0, "rate {}", 1.0 / mean);
        // Exponential: variance = mean², i.e. coefficient of variation 1.
        let cv = var.sqrt() / mean;
        assert!((cv - 1.0).abs() < 0.02, "cv {cv}");
    }

    #[test]
    fn gamma_burstiness_sets_the_spread_not_the_rate() {
        for k in [0.25, 4.0] {
            let g = gaps(Arrival::Gamma, 50.0, k, 100_000);
            let (mean, var) = mean_var(&g);
            assert!(
                (1.0 / mean - 50.0).abs() < 1.0,
                "k={k}: rate {}",
                1.0 / mean
            );
            // Gamma(k, θ): cv² = 1/k.
            let cv2 = var / (mean * mean);
            assert!((cv2 - 1.0 / k).abs() < 0.1 / k, "k={k}: cv² {cv2}");
        }
    }

    #[test]
    fn constant_is_exact() {
        let times: Vec<Duration> = Schedule::new(4.0, Arrival::Constant, 1.0, 0)
            .unwrap()
            .take(3)
            .collect();
        assert_eq!(times, [0, 250, 500].map(Duration::from_millis).to_vec());
    }

    #[test]
    fn same_seed_same_schedule() {
        let a: Vec<_> = Schedule::new(10.0, Arrival::Gamma, 0.5, 7)
            .unwrap()
            .take(50)
            .collect();
        let b: Vec<_> = Schedule::new(10.0, Arrival::Gamma, 0.5, 7)
            .unwrap()
            .take(50)
            .collect();
        assert_eq!(a, b);
    }

    #[test]
    fn bad_parameters_are_errors() {
        assert!(Schedule::new(0.0, Arrival::Poisson, 1.0, 0).is_err());
        assert!(Schedule::new(f64::NAN, Arrival::Poisson, 1.0, 0).is_err());
        assert!(Schedule::new(1.0, Arrival::Gamma, -1.0, 0).is_err());
        assert!(Schedule::new(1.0, Arrival::Poisson, 2.0, 0).is_err());
    }
}
