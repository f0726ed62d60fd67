//! Open-loop arrival processes: when each request is meant to be sent.
//!
//! Gaps between requests are drawn from a gamma distribution with shape `burstiness` and mean
//! `1 / rate`, as vLLM's and AIPerf's benchmarks do: shape 1 is a Poisson process, a smaller
//! shape makes bursts (more short and more long gaps), a larger one approaches a constant rate.
//! The generator is seeded, so a schedule can be replayed exactly.
//!
//! The rate may change over the run ([`Rate`], `--request-rate 0:2,60:40,90:40,100:2`:
//! piecewise linear between `SECONDS:RATE` points, flat after the last): each gap is drawn
//! with unit mean and divided by the rate at the time it starts, which follows a rate that
//! changes slowly next to the gaps (a ramp over a minute at a few requests per second).

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

/// Requests per second over time: `(seconds, rate)` points, linear between them, flat
/// before the first and after the last.
#[derive(Debug, Clone, PartialEq)]
pub struct Rate(Vec<(f64, f64)>);

impl Rate {
    pub fn constant(rate: f64) -> Self {
        Self(vec![(0.0, rate)])
    }

    /// The rate `t` seconds into the run.
    pub fn at(&self, t: f64) -> f64 {
        let pts = &self.0;
        let Some(&(t0, r0)) = pts.first() else {
            return 0.0;
        };
        if t <= t0 {
            return r0;
        }
        for w in pts.windows(2) {
            let ((a, ra), (b, rb)) = (w[0], w[1]);
            if t <= b {
                return if b > a {
                    ra + (t - a) / (b - a) * (rb - ra)
                } else {
                    rb
                };
            }
        }
        pts.last().map_or(r0, |p| p.1)
    }

    /// The points, for reports.
    pub fn points(&self) -> &[(f64, f64)] {
        &self.0
    }

    fn check(&self) -> Result<(), String> {
        for &(t, r) in &self.0 {
            if !(r.is_finite() && r > 0.0) {
                return Err(format!(
                    "the request rate must be a positive number, got {r}"
                ));
            }
            if !(t.is_finite() && t >= 0.0) {
                return Err(format!("a rate's time must be 0 or more seconds, got {t}"));
            }
        }
        if self.0.is_empty() || self.0.windows(2).any(|w| w[1].0 <= w[0].0) {
            return Err("rate points need increasing times: SECONDS:RATE,SECONDS:RATE…".into());
        }
        Ok(())
    }
}

impl std::str::FromStr for Rate {
    type Err = String;

    /// `10` (constant) or `0:2,60:40,120:2` (seconds:rate, linear between).
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("expected RATE or SECONDS:RATE,SECONDS:RATE…, got {s:?}");
        let rate = if s.contains(':') {
            Rate(
                s.split(',')
                    .map(|p| {
                        let (t, r) = p.split_once(':').ok_or_else(bad)?;
                        Ok((
                            t.trim().parse().map_err(|_| bad())?,
                            r.trim().parse().map_err(|_| bad())?,
                        ))
                    })
                    .collect::<Result<_, String>>()?,
            )
        } else {
            Rate::constant(s.trim().parse().map_err(|_| bad())?)
        };
        rate.check()?;
        Ok(rate)
    }
}

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.as_slice() {
            [(_, r)] => write!(f, "{r}"),
            pts => {
                let parts: Vec<String> = pts.iter().map(|(t, r)| format!("{t}:{r}")).collect();
                f.write_str(&parts.join(","))
            }
        }
    }
}

/// Send times (offsets from the start of the run) for an open-loop load.
#[derive(Debug)]
pub struct Schedule {
    rate: Rate,
    gap: Gap,
    rng: StdRng,
    next: f64,
}

#[derive(Debug)]
enum Gap {
    Fixed,
    /// Gamma with unit mean.
    Gamma(Gamma<f64>),
}

impl Schedule {
    /// A schedule at `rate` requests per second. Fails on a rate or burstiness that is not a
    /// positive finite number, or a Poisson process asked to be bursty.
    pub fn new(rate: f64, arrival: Arrival, burstiness: f64, seed: u64) -> Result<Self, String> {
        Self::with_rate(Rate::constant(rate), arrival, burstiness, seed)
    }

    /// A schedule following `rate` over time.
    pub fn with_rate(
        rate: Rate,
        arrival: Arrival,
        burstiness: f64,
        seed: u64,
    ) -> Result<Self, String> {
        rate.check()?;
        if !(burstiness.is_finite() && burstiness > 0.0) {
            return Err(format!(
                "burstiness must be a positive number, got {burstiness}"
            ));
        }
        let gap = match arrival {
            Arrival::Constant => Gap::Fixed,
            Arrival::Poisson if burstiness != 1.0 => {
                return Err(
                    "a Poisson process has burstiness 1; use --arrival gamma for other values"
                        .into(),
                );
            }
            Arrival::Poisson | Arrival::Gamma => {
                Gap::Gamma(Gamma::new(burstiness, 1.0 / burstiness).map_err(|e| e.to_string())?)
            }
        };
        Ok(Self {
            rate,
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
        let unit = match &self.gap {
            Gap::Fixed => 1.0,
            Gap::Gamma(d) => d.sample(&mut self.rng),
        };
        self.next += unit / self.rate.at(at);
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
    fn a_ramp_follows_its_rate() {
        let rate: Rate = "0:10,10:50".parse().unwrap();
        assert_eq!(rate.at(5.0), 30.0);
        assert_eq!(rate.at(20.0), 50.0);
        let times: Vec<f64> = Schedule::with_rate(rate, Arrival::Poisson, 1.0, 3)
            .unwrap()
            .map(|d| d.as_secs_f64())
            .take_while(|&t| t < 20.0)
            .collect();
        let count = |a: f64, b: f64| times.iter().filter(|&&t| t >= a && t < b).count() as f64;
        // ∫ rate over the ramp = 300, then 50/s: within 15 % (Poisson noise at these counts).
        assert!(
            (count(0.0, 10.0) / 300.0 - 1.0).abs() < 0.15,
            "{}",
            count(0.0, 10.0)
        );
        assert!(
            (count(10.0, 20.0) / 500.0 - 1.0).abs() < 0.15,
            "{}",
            count(10.0, 20.0)
        );
        assert!(count(0.0, 2.0) < count(8.0, 10.0));
        assert!("0:1,0:2".parse::<Rate>().is_err());
        assert!("0:1,5:0".parse::<Rate>().is_err());
        assert_eq!("0:1,5:2".parse::<Rate>().unwrap().to_string(), "0:1,5:2");
    }

    #[test]
    fn bad_parameters_are_errors() {
        assert!(Schedule::new(0.0, Arrival::Poisson, 1.0, 0).is_err());
        assert!(Schedule::new(f64::NAN, Arrival::Poisson, 1.0, 0).is_err());
        assert!(Schedule::new(1.0, Arrival::Gamma, -1.0, 0).is_err());
        assert!(Schedule::new(1.0, Arrival::Poisson, 2.0, 0).is_err());
    }
}
