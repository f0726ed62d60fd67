//! Per-request records and the summary computed from them, with AIPerf's definitions:
//!
//! - TTFT: first chunk with content − request start.
//! - end-to-end latency: last response − request start.
//! - ITL (per request): (latency − TTFT) / (output tokens − 1).
//! - inter-chunk latency: gaps between consecutive content chunks, pooled over requests.
//! - TPOT: latency / output tokens (prefill and queueing included, unlike ITL).
//! - output token throughput: output tokens / (last response − first request sent).
//! - goodput: requests meeting every SLO / the same duration.
//!
//! "Request start" is the *intended* send time: in open-loop runs a request that went out
//! late because the client fell behind is charged for the wait (no coordinated omission). In
//! closed-loop runs the intended time is the send time. Percentiles come from HDR histograms
//! (three significant digits); averages, minima and maxima are exact.
//!
//! A concurrency sweep's points ([`SweepPoint`]) are read off summaries here too, so that
//! [`crate::report`] (which writes them, and calls the plots) and [`crate::plot`] (which draws
//! them) share the type, and the plots do not depend on the report.

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// What happened to one request; times are offsets from the start of the run (monotonic).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Record {
    pub index: usize,
    /// When the schedule meant to send it.
    pub intended: Duration,
    /// When it was actually handed to the HTTP client.
    pub sent: Duration,
    /// Arrival of each response chunk that carried content.
    pub chunks: Vec<Duration>,
    /// The last response (or the failure).
    pub end: Duration,
    pub input_tokens: Option<usize>,
    pub output_tokens: usize,
    /// The error class when the request failed.
    pub error: Option<String>,
    /// It was sent a second time, on a fresh connection, after the first failed with nothing
    /// answered (a pooled connection the server had closed).
    pub retried: bool,
    /// Its `priority` (`--priority-mix`).
    pub priority: Option<i32>,
    /// Its tenant (`--tenants`).
    pub tenant: Option<String>,
}

impl Record {
    fn ok(&self) -> bool {
        self.error.is_none()
    }
    pub fn ttft(&self) -> Option<Duration> {
        Some(self.chunks.first()?.saturating_sub(self.intended))
    }
    pub fn e2e(&self) -> Duration {
        self.end.saturating_sub(self.intended)
    }
    pub fn itl(&self) -> Option<Duration> {
        let ttft = self.ttft()?;
        (self.output_tokens > 1)
            .then(|| self.e2e().saturating_sub(ttft) / (self.output_tokens as u32 - 1).max(1))
    }
    pub fn tpot(&self) -> Option<Duration> {
        (self.output_tokens > 0).then(|| self.e2e() / self.output_tokens as u32)
    }
}

/// avg, min, max, p50, p90, p99 of one metric.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub avg: f64,
    pub min: f64,
    pub max: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

/// Collects samples; exact avg/min/max, percentiles from an HDR histogram.
struct Samples {
    hist: Histogram<u64>,
    sum: f64,
    min: u64,
    max: u64,
}

impl Samples {
    fn new() -> Self {
        Self {
            // Auto-resizing, three significant digits: 0.1 % worst-case percentile error.
            hist: Histogram::new(3).unwrap_or_else(|_| unreachable!("3 sigfigs is valid")),
            sum: 0.0,
            min: u64::MAX,
            max: 0,
        }
    }
    fn add(&mut self, v: u64) {
        // Auto-resize makes recording infallible for any u64.
        let _ = self.hist.record(v);
        self.sum += v as f64;
        self.min = self.min.min(v);
        self.max = self.max.max(v);
    }
    /// Stats in the unit of `scale` (value / scale); None without samples.
    fn stats(&self, scale: f64) -> Option<Stats> {
        let n = self.hist.len();
        if n == 0 {
            return None;
        }
        let q = |q: f64| self.hist.value_at_quantile(q) as f64 / scale;
        Some(Stats {
            avg: self.sum / n as f64 / scale,
            min: self.min as f64 / scale,
            max: self.max as f64 / scale,
            p50: q(0.50),
            p90: q(0.90),
            p99: q(0.99),
        })
    }
}

const NS_PER_MS: f64 = 1e6;

/// Stats in milliseconds of `values`, computed as the summary's are; `None` when empty.
pub fn duration_stats(values: impl IntoIterator<Item = Duration>) -> Option<Stats> {
    let mut s = Samples::new();
    for v in values {
        s.add(ns(v));
    }
    s.stats(NS_PER_MS)
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Service-level objectives for goodput, in milliseconds; a request is "good" when it
/// succeeded and meets every one that is set.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub itl_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tpot_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub e2e_ms: Option<f64>,
}

impl std::str::FromStr for Slo {
    type Err = String;

    /// `ttft_ms=200,itl_ms=20`.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut slo = Slo::default();
        for part in s.split(',').filter(|p| !p.trim().is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("expected KEY=MILLISECONDS, got {part:?}"))?;
            let v: f64 = v
                .trim()
                .parse()
                .ok()
                .filter(|v: &f64| v.is_finite() && *v > 0.0)
                .ok_or_else(|| format!("{k}: expected a positive number of milliseconds"))?;
            let slot = match k.trim() {
                "ttft_ms" => &mut slo.ttft_ms,
                "itl_ms" => &mut slo.itl_ms,
                "tpot_ms" => &mut slo.tpot_ms,
                "e2e_ms" => &mut slo.e2e_ms,
                other => {
                    return Err(format!(
                        "unknown SLO {other:?}; expected ttft_ms, itl_ms, tpot_ms or e2e_ms"
                    ));
                }
            };
            *slot = Some(v);
        }
        if slo == Slo::default() {
            return Err("no SLO given".into());
        }
        Ok(slo)
    }
}

impl Slo {
    fn met(&self, r: &Record) -> bool {
        let ok = |limit: Option<f64>, v: Option<Duration>| match (limit, v) {
            (Some(limit), Some(v)) => v.as_secs_f64() * 1e3 <= limit,
            // A metric a request does not have (ITL of a one-token answer) cannot miss.
            _ => true,
        };
        // A request whose answer carried no text (a server that sends it all at the end)
        // had its first token by its end, no sooner as far as the client saw: it cannot pass
        // a TTFT objective for want of a measurement.
        r.ok()
            && ok(self.ttft_ms, r.ttft().or(Some(r.e2e())))
            && ok(self.itl_ms, r.itl())
            && ok(self.tpot_ms, r.tpot())
            && ok(self.e2e_ms, Some(r.e2e()))
    }
}

/// How many requests went out and how they ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Requests {
    pub sent: u64,
    pub ok: u64,
    pub failed: u64,
    /// Requests sent again on a fresh connection after nothing was answered (see
    /// [`Record::retried`]); each counts once, as ok or failed by how its retry ended.
    #[serde(default)]
    pub retried: u64,
}

/// `summary.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Successful requests per second.
    pub request_throughput: f64,
    /// Output tokens per second over the run.
    pub output_token_throughput: f64,
    pub ttft_ms: Option<Stats>,
    pub itl_ms: Option<Stats>,
    pub inter_chunk_ms: Option<Stats>,
    pub tpot_ms: Option<Stats>,
    pub e2e_ms: Option<Stats>,
    /// Tokens per second one user sees while tokens stream (1 / ITL), per request.
    pub output_token_throughput_per_user: Option<Stats>,
    pub input_tokens: Option<Stats>,
    pub output_tokens: Option<Stats>,
    /// How late requests went out compared to the schedule (open loop; 0 in closed loop).
    pub schedule_lag_ms: Option<Stats>,
    pub requests: Requests,
    /// Failed requests by error class.
    pub errors: BTreeMap<String, u64>,
    /// How long failed requests took to fail (a refusal should come at once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_ms: Option<Stats>,
    /// With `--priority-mix`: the same figures for each priority's requests alone.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub by_priority: BTreeMap<String, Summary>,
    /// With `--tenants`: the same figures for each tenant's requests alone.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub by_tenant: BTreeMap<String, Summary>,
    /// First request sent → last response.
    pub duration_s: f64,
    /// Requests meeting every SLO per second; null without `--slo`.
    pub goodput: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo: Option<Slo>,
    /// The run was stopped early with Ctrl-C; the figures cover what was sent.
    #[serde(default)]
    pub interrupted: bool,
    /// CPU seconds the benchmark client itself used during the measured run.
    #[serde(default)]
    pub client_cpu_s: f64,
    /// What was run: endpoint, load, dataset.
    #[serde(default)]
    pub config: serde_json::Value,
    /// With `--oracle`: the prefix-cache hit rate of a cache-perfect router on this workload
    /// ([`crate::oracle`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oracle_hit_rate: Option<f64>,
    /// With `--planner`: replicas × seconds of the scaled nodes over the run, from the
    /// planner's decisions sampled once a second ([`crate::planner`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_seconds: Option<f64>,
}

/// Compute the summary of a run's measured records, and of each priority's and each
/// tenant's when they carry one.
pub fn summarize(records: &[Record], slo: Option<&Slo>) -> Summary {
    let mut s = summarize_flat(records, slo);
    let split = |class: &dyn Fn(&Record) -> Option<String>| {
        let mut classes: BTreeMap<String, Vec<Record>> = BTreeMap::new();
        for r in records {
            if let Some(c) = class(r) {
                classes.entry(c).or_default().push(r.clone());
            }
        }
        classes
            .into_iter()
            .map(|(c, rs)| (c, summarize_flat(&rs, slo)))
            .collect()
    };
    s.by_priority = split(&|r| r.priority.map(|p| p.to_string()));
    s.by_tenant = split(&|r| r.tenant.clone());
    s
}

fn summarize_flat(records: &[Record], slo: Option<&Slo>) -> Summary {
    let mut ttft = Samples::new();
    let mut itl = Samples::new();
    let mut chunk = Samples::new();
    let mut tpot = Samples::new();
    let mut e2e = Samples::new();
    let mut per_user = Samples::new();
    let mut isl = Samples::new();
    let mut osl = Samples::new();
    let mut lag = Samples::new();
    let mut errors = BTreeMap::new();
    let mut failed = Samples::new();
    let mut req = Requests::default();
    let mut out_tokens = 0u64;
    let mut good = 0u64;
    let first = records.iter().map(|r| r.sent).min().unwrap_or_default();
    let last = records.iter().map(|r| r.end).max().unwrap_or_default();
    for r in records {
        req.sent += 1;
        req.retried += u64::from(r.retried);
        lag.add(ns(r.sent.saturating_sub(r.intended)));
        if let Some(class) = &r.error {
            req.failed += 1;
            *errors.entry(class.clone()).or_insert(0) += 1;
            failed.add(ns(r.e2e()));
            continue;
        }
        req.ok += 1;
        out_tokens += r.output_tokens as u64;
        osl.add(r.output_tokens as u64);
        if let Some(n) = r.input_tokens {
            isl.add(n as u64);
        }
        e2e.add(ns(r.e2e()));
        if let Some(t) = r.ttft() {
            ttft.add(ns(t));
        }
        if let Some(t) = r.itl() {
            itl.add(ns(t));
            if !t.is_zero() {
                // tokens/s, kept in milli-tokens/s for the histogram's integer resolution.
                per_user.add((1e3 / t.as_secs_f64()) as u64);
            }
        }
        if let Some(t) = r.tpot() {
            tpot.add(ns(t));
        }
        for w in r.chunks.windows(2) {
            chunk.add(ns(w[1].saturating_sub(w[0])));
        }
        if slo.is_some_and(|s| s.met(r)) {
            good += 1;
        }
    }
    let duration = last.saturating_sub(first).as_secs_f64();
    let per_s = |n: u64| {
        if duration > 0.0 {
            n as f64 / duration
        } else {
            0.0
        }
    };
    Summary {
        request_throughput: per_s(req.ok),
        output_token_throughput: per_s(out_tokens),
        ttft_ms: ttft.stats(NS_PER_MS),
        itl_ms: itl.stats(NS_PER_MS),
        inter_chunk_ms: chunk.stats(NS_PER_MS),
        tpot_ms: tpot.stats(NS_PER_MS),
        e2e_ms: e2e.stats(NS_PER_MS),
        output_token_throughput_per_user: per_user.stats(1e3),
        input_tokens: isl.stats(1.0),
        output_tokens: osl.stats(1.0),
        schedule_lag_ms: lag.stats(NS_PER_MS),
        requests: req,
        errors,
        failed_ms: failed.stats(NS_PER_MS),
        by_priority: BTreeMap::new(),
        by_tenant: BTreeMap::new(),
        duration_s: duration,
        goodput: slo.map(|_| per_s(good)),
        slo: slo.cloned(),
        interrupted: false,
        client_cpu_s: 0.0,
        config: serde_json::Value::Null,
        oracle_hit_rate: None,
        replica_seconds: None,
    }
}

/// One level of a concurrency sweep.
#[derive(Debug, Clone, Serialize)]
pub struct SweepPoint {
    pub concurrency: usize,
    pub output_token_throughput: f64,
    /// Average tokens/s one user sees (1 / ITL).
    pub output_token_throughput_per_user: f64,
    pub ttft_p50_ms: f64,
    pub request_throughput: f64,
}

impl SweepPoint {
    pub fn new(concurrency: usize, s: &Summary) -> Self {
        Self {
            concurrency,
            output_token_throughput: s.output_token_throughput,
            output_token_throughput_per_user: s
                .output_token_throughput_per_user
                .map_or(0.0, |st| st.avg),
            ttft_p50_ms: s.ttft_ms.map_or(0.0, |st| st.p50),
            request_throughput: s.request_throughput,
        }
    }
}

/// Output tokens per second over time: `(bucket start s, tokens/s)` in buckets of `width`,
/// from the first request sent. A request's tokens are spread evenly over its chunks (a chunk
/// may carry several tokens).
pub fn throughput_over_time(records: &[Record], width: Duration) -> Vec<(f64, f64)> {
    let width = width.max(Duration::from_millis(1));
    let first = records.iter().map(|r| r.sent).min().unwrap_or_default();
    let mut buckets: Vec<f64> = Vec::new();
    for r in records.iter().filter(|r| r.ok() && !r.chunks.is_empty()) {
        let per_chunk = r.output_tokens as f64 / r.chunks.len() as f64;
        for c in &r.chunks {
            let i = (c.saturating_sub(first).as_nanos() / width.as_nanos()) as usize;
            if buckets.len() <= i {
                buckets.resize(i + 1, 0.0);
            }
            buckets[i] += per_chunk;
        }
    }
    let w = width.as_secs_f64();
    buckets
        .into_iter()
        .enumerate()
        .map(|(i, n)| (i as f64 * w, n / w))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    /// A request started at `start`, with content chunks at the given times and `tokens`
    /// output tokens, ending at the last chunk + 1 ms.
    fn rec(start: u64, chunks: &[u64], tokens: usize) -> Record {
        Record {
            intended: ms(start),
            sent: ms(start),
            chunks: chunks.iter().map(|&c| ms(c)).collect(),
            end: ms(chunks.last().copied().unwrap_or(start) + 1),
            input_tokens: Some(100),
            output_tokens: tokens,
            ..Default::default()
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= b.abs() * 1e-3 + 1e-9
    }

    #[test]
    fn each_priority_and_tenant_gets_its_own_figures_and_failures_their_time_to_fail() {
        let mut interactive = rec(0, &[10, 20], 2);
        interactive.priority = Some(0);
        interactive.tenant = Some("light".into());
        let mut batch = rec(0, &[500, 510], 2);
        batch.priority = Some(1);
        batch.tenant = Some("heavy".into());
        let mut refused = rec(0, &[], 0);
        refused.priority = Some(1);
        refused.tenant = Some("heavy".into());
        refused.error = Some("http 503 queue_full".into());
        refused.end = ms(3);
        let s = summarize(&[interactive, batch, refused], None);
        assert_eq!(s.by_priority.len(), 2);
        assert!(close(s.by_priority["0"].ttft_ms.unwrap().p99, 10.0));
        assert_eq!(s.by_priority["1"].requests.failed, 1);
        assert!(close(s.by_priority["1"].ttft_ms.unwrap().max, 500.0));
        assert!(close(s.failed_ms.unwrap().max, 3.0));
        assert!(s.by_priority["0"].by_priority.is_empty());
        assert_eq!(s.by_tenant["heavy"].requests.failed, 1);
        assert!(close(s.by_tenant["light"].ttft_ms.unwrap().p99, 10.0));
    }

    #[test]
    fn hand_computed_metrics() {
        // TTFT 10, 20, 30 ms; latencies 41, 61, 81 ms; 4, 5, 1 tokens.
        let records = vec![
            rec(0, &[10, 20, 30, 40], 4),
            rec(100, &[120, 140, 160], 5), // 3 chunks, 5 tokens: multi-token chunks
            rec(200, &[230, 250, 280], 1),
        ];
        let s = summarize(&records, None);
        let ttft = s.ttft_ms.unwrap();
        assert!(close(ttft.avg, 20.0) && close(ttft.min, 10.0) && close(ttft.max, 30.0));
        assert!(close(ttft.p50, 20.0) && close(ttft.p99, 30.0), "{ttft:?}");
        let e2e = s.e2e_ms.unwrap();
        assert!(close(e2e.avg, (41.0 + 61.0 + 81.0) / 3.0), "{e2e:?}");
        // ITL: (41-10)/3 = 10.333, (61-20)/4 = 10.25; the 1-token request has none.
        let itl = s.itl_ms.unwrap();
        assert!(close(itl.avg, (31.0 / 3.0 + 41.0 / 4.0) / 2.0), "{itl:?}");
        assert!(close(itl.min, 10.25) && close(itl.max, 31.0 / 3.0));
        // Inter-chunk gaps: 10,10,10, 20,20, 20,30.
        let ic = s.inter_chunk_ms.unwrap();
        assert!(close(ic.avg, 120.0 / 7.0) && close(ic.min, 10.0) && close(ic.max, 30.0));
        assert!(close(ic.p50, 20.0), "{ic:?}");
        // TPOT: 41/4, 61/5, 81/1.
        let tpot = s.tpot_ms.unwrap();
        assert!(close(tpot.max, 81.0) && close(tpot.min, 10.25));
        // Duration: first sent 0 → last response 281 ms; 10 tokens, 3 requests.
        assert!(close(s.duration_s, 0.281));
        assert!(close(s.output_token_throughput, 10.0 / 0.281));
        assert!(close(s.request_throughput, 3.0 / 0.281));
        assert_eq!(
            s.requests,
            Requests {
                sent: 3,
                ok: 3,
                failed: 0,
                retried: 0
            }
        );
        assert!(close(s.output_tokens.unwrap().avg, 10.0 / 3.0));
        assert_eq!(s.goodput, None);
        assert!(close(s.schedule_lag_ms.unwrap().max, 0.0));
    }

    #[test]
    fn errors_are_counted_by_class_and_excluded_from_latency() {
        let mut bad = rec(0, &[], 0);
        bad.error = Some("http 503 worker_busy".into());
        let mut bad2 = bad.clone();
        bad2.error = Some("connect".into());
        let mut resent = rec(0, &[10, 20], 2);
        resent.retried = true;
        let records = vec![resent, bad.clone(), bad, bad2];
        let s = summarize(&records, None);
        assert_eq!(
            s.requests,
            Requests {
                sent: 4,
                ok: 1,
                failed: 3,
                retried: 1
            }
        );
        assert_eq!(s.errors["http 503 worker_busy"], 2);
        assert_eq!(s.errors["connect"], 1);
        assert_eq!(s.ttft_ms.unwrap().max, 10.0);
    }

    #[test]
    fn open_loop_latency_counts_from_the_intended_time() {
        let mut r = rec(0, &[50, 60], 2);
        r.sent = ms(30); // the client was 30 ms late
        let s = summarize(&[r], None);
        assert!(close(s.ttft_ms.unwrap().avg, 50.0));
        assert!(close(s.schedule_lag_ms.unwrap().avg, 30.0));
    }

    #[test]
    fn goodput_counts_requests_meeting_every_slo() {
        let records = vec![
            rec(0, &[10, 20], 2),  // ttft 10, itl 11
            rec(0, &[50, 60], 2),  // ttft 50: misses ttft
            rec(0, &[10, 100], 2), // itl 91: misses itl
            rec(0, &[5], 1),       // no itl: cannot miss it
        ];
        // No text until the end, 500 ms in: its first token counts as then, and misses.
        let mut silent = rec(0, &[], 2);
        silent.end = ms(500);
        let records = [records, vec![silent]].concat();
        let slo: Slo = "ttft_ms=20, itl_ms=50".parse().unwrap();
        let s = summarize(&records, Some(&slo));
        assert!(
            close(s.goodput.unwrap(), 2.0 / s.duration_s),
            "{:?}",
            s.goodput
        );
        assert!("ttft=1".parse::<Slo>().is_err());
        assert!("ttft_ms=-1".parse::<Slo>().is_err());
        assert!("".parse::<Slo>().is_err());
    }

    #[test]
    fn throughput_buckets_spread_tokens_over_chunks() {
        let records = vec![rec(0, &[100, 1100], 4), rec(0, &[1500], 2)];
        let t = throughput_over_time(&records, Duration::from_secs(1));
        assert_eq!(t, vec![(0.0, 2.0), (1.0, 4.0)]);
    }

    #[test]
    fn empty_run_has_no_stats_and_no_nan() {
        let s = summarize(&[], None);
        assert_eq!(s.ttft_ms, None);
        assert_eq!(s.output_token_throughput, 0.0);
        let json = serde_json::to_string(&s).unwrap();
        assert!(!json.contains("NaN"));
    }
}
