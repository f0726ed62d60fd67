//! What a run leaves behind: the terminal table, `summary.json`, `requests.csv` and the plots;
//! the side-by-side comparison of two summaries; and a concurrency sweep's summary.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use crate::metrics::{Record, Stats, Summary, duration_stats, throughput_over_time};
use crate::{Error, plot};

// Re-exported: callers (the CLI) take it with the sweep functions below that use it.
pub use crate::metrics::SweepPoint;

/// The rows of the table and of `compare`: label, and how to read the stats off a summary.
type Row = (&'static str, fn(&Summary) -> Option<Stats>);

const ROWS: &[Row] = &[
    ("TTFT (ms)", |s| s.ttft_ms),
    ("ITL (ms)", |s| s.itl_ms),
    ("inter-chunk (ms)", |s| s.inter_chunk_ms),
    ("TPOT (ms)", |s| s.tpot_ms),
    ("end-to-end (ms)", |s| s.e2e_ms),
    ("tokens/s per user", |s| s.output_token_throughput_per_user),
    ("input tokens", |s| s.input_tokens),
    ("output tokens", |s| s.output_tokens),
    ("schedule lag (ms)", |s| s.schedule_lag_ms),
];

fn num(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// The summary as a terminal table.
pub fn table(s: &Summary) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<20} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "metric", "avg", "min", "max", "p50", "p90", "p99"
    );
    for (label, get) in ROWS {
        let Some(st) = get(s) else { continue };
        let _ = writeln!(
            out,
            "{label:<20} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
            num(st.avg),
            num(st.min),
            num(st.max),
            num(st.p50),
            num(st.p90),
            num(st.p99)
        );
    }
    let _ = writeln!(
        out,
        "\nrequests: {} sent, {} ok, {} failed in {:.2} s",
        s.requests.sent, s.requests.ok, s.requests.failed, s.duration_s
    );
    if s.interrupted {
        let _ = writeln!(out, "interrupted: the run was stopped early");
    }
    let _ = writeln!(
        out,
        "request throughput: {:.2} requests/s",
        s.request_throughput
    );
    let _ = writeln!(
        out,
        "output token throughput: {:.1} tokens/s",
        s.output_token_throughput
    );
    if let Some(g) = s.goodput {
        let _ = writeln!(out, "goodput: {g:.2} requests/s");
    }
    if let Some(h) = s.oracle_hit_rate {
        let _ = writeln!(out, "oracle prefix-cache hit rate: {h:.3}");
    }
    if s.requests.sent > 0 {
        let _ = writeln!(
            out,
            "client CPU: {:.3} ms per request",
            s.client_cpu_s * 1e3 / s.requests.sent as f64
        );
    }
    for (class, n) in &s.errors {
        let _ = writeln!(out, "error {class}: {n}");
    }
    if let Some(f) = s.failed_ms {
        let _ = writeln!(
            out,
            "time to fail (ms): p50 {} p99 {} max {}",
            num(f.p50),
            num(f.p99),
            num(f.max)
        );
    }
    let classes = s
        .by_priority
        .iter()
        .map(|(p, c)| (format!("priority {p}"), c))
        .chain(s.by_tenant.iter().map(|(t, c)| (format!("tenant {t}"), c)));
    for (p, c) in classes {
        let ttft = |get: fn(&Stats) -> f64| c.ttft_ms.map_or("-".into(), |t| num(get(&t)));
        let _ = write!(
            out,
            "{p}: {} sent, {} ok, {} failed; TTFT p50 {} p99 {} ms",
            c.requests.sent,
            c.requests.ok,
            c.requests.failed,
            ttft(|t| t.p50),
            ttft(|t| t.p99),
        );
        if let Some(g) = c.goodput {
            let _ = write!(out, "; goodput {g:.2} requests/s");
        }
        let _ = writeln!(out);
    }
    if s.requests.retried > 0 {
        let _ = writeln!(
            out,
            "resent on a fresh connection (nothing answered on a pooled one): {}",
            s.requests.retried
        );
    }
    out
}

/// One row of `requests.csv`; times in milliseconds from the start of the run.
#[derive(Serialize)]
struct CsvRow<'a> {
    index: usize,
    intended_ms: f64,
    sent_ms: f64,
    first_chunk_ms: Option<f64>,
    end_ms: f64,
    ttft_ms: Option<f64>,
    itl_ms: Option<f64>,
    e2e_ms: f64,
    chunks: usize,
    input_tokens: Option<usize>,
    output_tokens: usize,
    error: &'a str,
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// Write `summary.json`, `requests.csv` and the plots into `dir` (created if missing).
pub fn write(dir: &Path, summary: &Summary, records: &[Record]) -> Result<(), Error> {
    create_dir(dir)?;
    write_json(&dir.join("summary.json"), summary)?;
    let csv_path = dir.join("requests.csv");
    let fail = |e: &dyn std::fmt::Display| Error::Output {
        path: csv_path.clone(),
        message: e.to_string(),
    };
    let mut w = csv::Writer::from_path(&csv_path).map_err(|e| fail(&e))?;
    for r in records {
        let ok = r.error.is_none();
        w.serialize(CsvRow {
            index: r.index,
            intended_ms: ms(r.intended),
            sent_ms: ms(r.sent),
            first_chunk_ms: r.chunks.first().map(|&d| ms(d)),
            end_ms: ms(r.end),
            ttft_ms: r.ttft().filter(|_| ok).map(ms),
            itl_ms: r.itl().filter(|_| ok).map(ms),
            e2e_ms: ms(r.e2e()),
            chunks: r.chunks.len(),
            input_tokens: r.input_tokens,
            output_tokens: r.output_tokens,
            error: r.error.as_deref().unwrap_or(""),
        })
        .map_err(|e| fail(&e))?;
    }
    w.flush().map_err(|e| fail(&e))?;

    let ok: Vec<&Record> = records.iter().filter(|r| r.error.is_none()).collect();
    let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft()).map(ms).collect();
    let itl: Vec<f64> = ok.iter().filter_map(|r| r.itl()).map(ms).collect();
    let width = Duration::from_secs_f64((summary.duration_s / 40.0).clamp(0.25, 10.0));
    let series = throughput_over_time(records, width);
    plot::cdf(dir, "ttft_cdf", "Time to first token", "TTFT (ms)", &ttft)?;
    plot::cdf(dir, "itl_cdf", "Inter-token latency", "ITL (ms)", &itl)?;
    plot::throughput(dir, "throughput", &series)?;
    Ok(())
}

/// With `--planner`: `planner.csv` (the sampled replicas) and `timeline.png/svg` (TTFT p90
/// per time bin by send time, against the TTFT SLO if given, over replicas).
pub fn write_planner(
    dir: &Path,
    summary: &Summary,
    records: &[Record],
    samples: &[crate::planner::PlannerSample],
) -> Result<(), Error> {
    create_dir(dir)?;
    let path = dir.join("planner.csv");
    let fail = |e: &dyn std::fmt::Display| Error::Output {
        path: path.clone(),
        message: e.to_string(),
    };
    let mut w = csv::Writer::from_path(&path).map_err(|e| fail(&e))?;
    for s in samples {
        w.serialize(s).map_err(|e| fail(&e))?;
    }
    w.flush().map_err(|e| fail(&e))?;
    let width = (summary.duration_s / 60.0).clamp(1.0, 10.0);
    let mut bins: std::collections::BTreeMap<u64, Vec<Duration>> = Default::default();
    for r in records.iter().filter(|r| r.error.is_none()) {
        if let Some(t) = r.ttft() {
            let bin = (r.intended.as_secs_f64() / width) as u64;
            bins.entry(bin).or_default().push(t);
        }
    }
    let p90: Vec<(f64, f64)> = bins
        .into_iter()
        .filter_map(|(b, v)| Some(((b as f64 + 0.5) * width, duration_stats(v)?.p90)))
        .collect();
    let target = summary.slo.as_ref().and_then(|s| s.ttft_ms);
    plot::timeline(dir, "timeline", &p90, target, samples)
}

/// `sweep.json` and the tokens/s/user against tokens/s plot.
pub fn write_sweep(dir: &Path, points: &[SweepPoint]) -> Result<(), Error> {
    create_dir(dir)?;
    write_json(&dir.join("sweep.json"), points)?;
    plot::sweep(dir, "sweep", points)
}

/// The sweep as a terminal table.
pub fn sweep_table(points: &[SweepPoint]) -> String {
    let mut out = format!(
        "{:>11} {:>12} {:>16} {:>14} {:>12}\n",
        "concurrency", "tokens/s", "tokens/s/user", "TTFT p50 ms", "requests/s"
    );
    for p in points {
        let _ = writeln!(
            out,
            "{:>11} {:>12.1} {:>16.1} {:>14.2} {:>12.2}",
            p.concurrency,
            p.output_token_throughput,
            p.output_token_throughput_per_user,
            p.ttft_p50_ms,
            p.request_throughput
        );
    }
    out
}

/// A and B side by side with the ratio B / A, for the headline figures and each metric's
/// avg, p50 and p99.
pub fn compare(a: &Summary, b: &Summary) -> String {
    let mut out = format!("{:<34} {:>12} {:>12} {:>8}\n", "metric", "A", "B", "B/A");
    let mut line = |label: &str, x: f64, y: f64| {
        let ratio = if x != 0.0 {
            format!("{:.3}", y / x)
        } else {
            "-".into()
        };
        let _ = writeln!(out, "{label:<34} {:>12} {:>12} {ratio:>8}", num(x), num(y));
    };
    line(
        "request throughput (req/s)",
        a.request_throughput,
        b.request_throughput,
    );
    line(
        "output token throughput (tok/s)",
        a.output_token_throughput,
        b.output_token_throughput,
    );
    if let (Some(x), Some(y)) = (a.goodput, b.goodput) {
        line("goodput (req/s)", x, y);
    }
    for (label, get) in ROWS {
        if let (Some(x), Some(y)) = (get(a), get(b)) {
            line(&format!("{label} avg"), x.avg, y.avg);
            line(&format!("{label} p50"), x.p50, y.p50);
            line(&format!("{label} p99"), x.p99, y.p99);
        }
    }
    line(
        "failed requests",
        a.requests.failed as f64,
        b.requests.failed as f64,
    );
    line(
        "client CPU (ms/request)",
        a.client_cpu_s * 1e3 / a.requests.sent.max(1) as f64,
        b.client_cpu_s * 1e3 / b.requests.sent.max(1) as f64,
    );
    out
}

/// Read a `summary.json`.
pub fn load(path: &Path) -> Result<Summary, Error> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| Error::Line {
        path: path.to_path_buf(),
        line: e.line(),
        message: format!("not a dyn bench summary: {e}"),
    })
}

fn create_dir(dir: &Path) -> Result<(), Error> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        source,
    })
}

fn write_json(path: &Path, v: &(impl Serialize + ?Sized)) -> Result<(), Error> {
    let fail = |message: String| Error::Output {
        path: path.to_path_buf(),
        message,
    };
    let text = serde_json::to_string_pretty(v).map_err(|e| fail(e.to_string()))?;
    std::fs::write(path, text + "\n").map_err(|e| fail(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::summarize;

    fn record(i: usize, ttft: u64, tokens: usize) -> Record {
        let ms = Duration::from_millis;
        Record {
            index: i,
            intended: ms(0),
            sent: ms(0),
            chunks: (0..tokens as u64).map(|k| ms(ttft + 10 * k)).collect(),
            end: ms(ttft + 10 * tokens as u64),
            input_tokens: Some(16),
            output_tokens: tokens,
            error: None,
            retried: false,
            priority: None,
            tenant: None,
        }
    }

    #[test]
    fn compare_prints_ratios() {
        let a = summarize(&[record(0, 100, 4)], None);
        let b = summarize(&[record(0, 50, 4)], None);
        let out = compare(&a, &b);
        let ttft = out
            .lines()
            .find(|l| l.starts_with("TTFT (ms) p50"))
            .unwrap();
        assert!(ttft.trim_end().ends_with("0.500"), "{ttft}");
    }

    #[test]
    fn writes_summary_csv_and_plots() {
        let dir = std::env::temp_dir().join(format!("dyn-bench-report-{}", std::process::id()));
        let mut recs: Vec<Record> = (0..20).map(|i| record(i, 20 + i as u64, 5)).collect();
        recs[3].error = Some("http 503 worker_busy".into());
        let s = summarize(&recs, None);
        write(&dir, &s, &recs).unwrap();
        let back = load(&dir.join("summary.json")).unwrap();
        assert_eq!(back.requests.failed, 1);
        let csv = std::fs::read_to_string(dir.join("requests.csv")).unwrap();
        assert_eq!(csv.lines().count(), 21);
        assert!(
            csv.lines()
                .nth(4)
                .unwrap()
                .ends_with(",http 503 worker_busy")
        );
        for f in ["ttft_cdf", "itl_cdf", "throughput"] {
            for ext in ["png", "svg"] {
                let len = std::fs::metadata(dir.join(format!("{f}.{ext}")))
                    .unwrap()
                    .len();
                assert!(len > 1000, "{f}.{ext} is {len} bytes");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_summary_file_is_a_clear_error() {
        let path = std::env::temp_dir().join(format!("dyn-bench-bad-{}.json", std::process::id()));
        std::fs::write(&path, "{\n\"request_throughput\": 1\n}").unwrap();
        let err = load(&path).unwrap_err().to_string();
        assert!(
            err.contains("not a dyn bench summary: missing field"),
            "{err}"
        );
    }
}
