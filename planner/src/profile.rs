//! A worker's measured performance, written by `dyn graph profile` and read by the planner.
//!
//! Two sweeps of one replica with `dyn bench`, as Dynamo's pre-deployment profiling does:
//! prefill — TTFT against prompt length, one request at a time, which gives prompt tokens a
//! replica computes per second; decode — ITL and output tokens per second against
//! concurrency, which gives the output tokens per second a replica sustains while its ITL
//! stays under a target. The planner divides the predicted token rates by these.

use std::path::Path;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// The node profiled, its kind and the graph file.
    pub node: String,
    pub kind: String,
    pub graph: String,
    pub prefill: Vec<PrefillPoint>,
    pub decode: Vec<DecodePoint>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PrefillPoint {
    pub isl: f64,
    /// Median TTFT of lone requests of that length.
    pub ttft_ms: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DecodePoint {
    pub concurrency: f64,
    pub isl: f64,
    pub osl: f64,
    pub itl_p50_ms: f64,
    pub itl_p90_ms: f64,
    pub itl_p99_ms: f64,
    pub ttft_p90_ms: f64,
    /// Output tokens per second of the one replica.
    pub output_tps: f64,
}

impl DecodePoint {
    /// ITL at the percentile nearest `q` (0.5, 0.9, 0.99).
    fn itl(&self, q: f64) -> f64 {
        if q < 0.7 {
            self.itl_p50_ms
        } else if q < 0.95 {
            self.itl_p90_ms
        } else {
            self.itl_p99_ms
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("cannot read profile {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("profile {path}: {message}")]
    Invalid { path: String, message: String },
}

impl Profile {
    pub fn load(path: &Path) -> Result<Self, ProfileError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ProfileError::Read {
            path: name.clone(),
            source,
        })?;
        let p: Profile = serde_json::from_str(&text).map_err(|e| ProfileError::Invalid {
            path: name.clone(),
            message: e.to_string(),
        })?;
        let bad = |m: &str| ProfileError::Invalid {
            path: name.clone(),
            message: m.into(),
        };
        if p.prefill.is_empty() || p.decode.is_empty() {
            return Err(bad("needs prefill and decode points"));
        }
        let finite = |v: f64| v.is_finite() && v > 0.0;
        if !p.prefill.iter().all(|x| finite(x.isl) && finite(x.ttft_ms))
            || !p
                .decode
                .iter()
                .all(|x| finite(x.concurrency) && finite(x.output_tps) && finite(x.itl(0.5)))
        {
            return Err(bad("every point needs positive, finite figures"));
        }
        Ok(p)
    }

    /// Median TTFT of a lone prompt of `isl` tokens: linear between the measured lengths,
    /// extended along the last segment past them.
    pub fn lone_ttft_ms(&self, isl: f64) -> f64 {
        let mut pts: Vec<(f64, f64)> = self.prefill.iter().map(|p| (p.isl, p.ttft_ms)).collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        interpolate(&pts, isl).max(f64::MIN_POSITIVE)
    }

    /// Prompt tokens per second one replica computes at prompts of `isl` tokens.
    pub fn prefill_tps(&self, isl: f64) -> f64 {
        let isl = isl.max(1.0);
        isl / (self.lone_ttft_ms(isl) / 1000.0)
    }

    /// Output tokens per second one replica sustains with its ITL at quantile `q` under
    /// `itl_ms`: the best measured point under the target, and between it and the first
    /// over, linear in ITL. `None` when even one request at a time misses the target.
    pub fn decode_tps(&self, itl_ms: f64, q: f64) -> Option<f64> {
        let mut pts: Vec<&DecodePoint> = self.decode.iter().collect();
        pts.sort_by(|a, b| a.concurrency.total_cmp(&b.concurrency));
        let mut best: Option<&DecodePoint> = None;
        for p in pts {
            if p.itl(q) <= itl_ms {
                if best.is_none_or(|b| p.output_tps > b.output_tps) {
                    best = Some(p);
                }
                continue;
            }
            // The first point over the target: interpolate from the last one under it.
            return best.map(|b| {
                let span = p.itl(q) - b.itl(q);
                let f = if span > 0.0 {
                    ((itl_ms - b.itl(q)) / span).clamp(0.0, 1.0)
                } else {
                    0.0
                };
                b.output_tps + f * (p.output_tps - b.output_tps).max(0.0)
            });
        }
        best.map(|b| b.output_tps)
    }
}

/// Piecewise-linear through `pts` (sorted by x), extrapolated along the end segments.
fn interpolate(pts: &[(f64, f64)], x: f64) -> f64 {
    match pts {
        [] => 0.0,
        [(_, y)] => *y,
        _ => {
            let i = pts
                .windows(2)
                .position(|w| x <= w[1].0)
                .unwrap_or(pts.len() - 2);
            let ((x0, y0), (x1, y1)) = (pts[i], pts[i + 1]);
            if x1 == x0 {
                return y1;
            }
            y0 + (x - x0) * (y1 - y0) / (x1 - x0)
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A worker like the mocker's defaults: 5 ms steps, 0.02 ms per prompt token, ITL growing
    /// with the batch.
    pub fn mocker_like() -> Profile {
        Profile {
            node: "decode".into(),
            kind: "decode".into(),
            graph: "agg.yaml".into(),
            prefill: vec![
                PrefillPoint {
                    isl: 128.0,
                    ttft_ms: 8.0,
                },
                PrefillPoint {
                    isl: 1024.0,
                    ttft_ms: 26.0,
                },
            ],
            decode: [
                (1.0, 5.5, 180.0),
                (8.0, 7.0, 1100.0),
                (32.0, 12.0, 2600.0),
                (64.0, 20.0, 3100.0),
            ]
            .iter()
            .map(|&(c, itl, tps)| DecodePoint {
                concurrency: c,
                isl: 128.0,
                osl: 64.0,
                itl_p50_ms: itl,
                itl_p90_ms: itl * 1.2,
                itl_p99_ms: itl * 1.5,
                ttft_p90_ms: 20.0,
                output_tps: tps,
            })
            .collect(),
        }
    }

    #[test]
    fn capacities_interpolate_between_measured_points() {
        let p = mocker_like();
        // 512 tokens: 8 + (384/896)·18 ms.
        let ttft = p.lone_ttft_ms(512.0);
        assert!((ttft - 15.714).abs() < 0.01, "{ttft}");
        assert!((p.prefill_tps(512.0) - 512.0 / 0.015714).abs() < 1.0);
        // p90 ITLs are 6.6, 8.4, 14.4, 24: a 14.4 ms target is exactly the third point.
        assert_eq!(p.decode_tps(14.4, 0.9), Some(2600.0));
        // Halfway between 14.4 and 24 ms: halfway between 2600 and 3100 tokens/s.
        assert!((p.decode_tps(19.2, 0.9).unwrap() - 2850.0).abs() < 1e-6);
        assert_eq!(p.decode_tps(5.0, 0.9), None, "even one request misses 5 ms");
        assert_eq!(p.decode_tps(100.0, 0.9), Some(3100.0));
    }
}
