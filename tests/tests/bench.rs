//! `dyn bench` through the real binary against `dyn graph up graphs/agg.yaml`: closed and
//! open loop, trace replay, failed requests, the files it writes, and `dyn bench compare`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use std::path::Path;
use std::process::Output;

use dyn_tests::{Graph, dyn_cmd, scratch_dir};
use serde_json::Value;

fn up() -> Graph {
    Graph::up_with_ingress(
        "graphs/agg.yaml",
        "http",
        &["--set", "decode.mocker.speedup=20"],
    )
}

fn bench(g: &Graph, args: &[&str]) -> Output {
    dyn_cmd()
        .args(["bench", "--url", &g.url(""), "--no-progress"])
        .args(args)
        .output()
        .unwrap()
}

fn summary(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

fn csv_rows(dir: &Path) -> Vec<Vec<String>> {
    let text = std::fs::read_to_string(dir.join("requests.csv")).unwrap();
    let mut lines = text.lines();
    assert!(
        lines
            .next()
            .unwrap()
            .starts_with("index,intended_ms,sent_ms,first_chunk_ms")
    );
    lines
        .map(|l| l.split(',').map(str::to_owned).collect())
        .collect()
}

fn ok(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "dyn bench failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn closed_loop_summary_accounts_for_every_request() {
    let g = up();
    let dir = scratch_dir("bench-closed");
    let out = bench(
        &g,
        &[
            "--concurrency",
            "4",
            "--requests",
            "40",
            "--warmup",
            "4",
            "--isl",
            "64",
            "--osl",
            "8",
            "--tokenizer",
            "models/tiny",
            "--slo",
            "ttft_ms=60000",
            "--output",
            dir.to_str().unwrap(),
        ],
    );
    let stdout = ok(&out);
    assert!(
        stdout.contains("requests: 40 sent, 40 ok, 0 failed"),
        "{stdout}"
    );
    let s = summary(&dir);
    for metric in ["ttft_ms", "itl_ms", "inter_chunk_ms", "tpot_ms", "e2e_ms"] {
        for k in ["avg", "min", "max", "p50", "p90", "p99"] {
            assert!(s[metric][k].as_f64().unwrap() >= 0.0, "{metric}.{k} in {s}");
        }
        assert!(s[metric]["min"].as_f64() <= s[metric]["p50"].as_f64());
        assert!(s[metric]["p50"].as_f64() <= s[metric]["max"].as_f64());
    }
    assert_eq!(
        s["requests"],
        serde_json::json!({"sent": 40, "ok": 40, "failed": 0, "retried": 0})
    );
    assert_eq!(s["errors"], serde_json::json!({}));
    assert!(s["request_throughput"].as_f64().unwrap() > 0.0);
    assert!(s["duration_s"].as_f64().unwrap() > 0.0);
    // 40 answers of exactly 8 tokens (usage from the server) over the run.
    let tput = s["output_token_throughput"].as_f64().unwrap();
    let want = 320.0 / s["duration_s"].as_f64().unwrap();
    assert!((tput - want).abs() < want * 1e-6, "{tput} vs {want}");
    assert_eq!(
        s["goodput"], s["request_throughput"],
        "every request meets a 60 s TTFT"
    );
    assert_eq!(
        s["input_tokens"]["min"], 64.0,
        "exact prompt length with --tokenizer"
    );
    assert_eq!(s["input_tokens"]["max"], 64.0);
    assert_eq!(s["config"]["load"]["concurrency"], 4);
    // One CSV row per measured request, each with its timestamps in order.
    let rows = csv_rows(&dir);
    assert_eq!(rows.len(), 40);
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r[0], i.to_string());
        let t: Vec<f64> = r[1..5].iter().map(|v| v.parse().unwrap()).collect();
        assert!(t[0] <= t[1] && t[1] <= t[2] && t[2] <= t[3], "{r:?}");
        assert_eq!(r[10], "8");
        assert_eq!(r[11], "");
    }
    for f in ["ttft_cdf", "itl_cdf", "throughput"] {
        for ext in ["png", "svg"] {
            assert!(dir.join(format!("{f}.{ext}")).exists(), "{f}.{ext}");
        }
    }

    // compare: the run against itself is 1.000 everywhere it is defined.
    let a = dir.join("summary.json");
    let out = dyn_cmd()
        .args(["bench", "compare", a.to_str().unwrap(), a.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = ok(&out);
    let line = stdout
        .lines()
        .find(|l| l.starts_with("output token throughput"))
        .unwrap();
    assert!(line.ends_with("1.000"), "{stdout}");
}

#[test]
fn open_loop_and_trace_replay() {
    let g = up();
    let dir = scratch_dir("bench-open");
    let out = bench(
        &g,
        &[
            "--request-rate",
            "200",
            "--arrival",
            "constant",
            "--requests",
            "30",
            "--isl",
            "32",
            "--osl",
            "4",
            "--output",
            dir.to_str().unwrap(),
        ],
    );
    ok(&out);
    let s = summary(&dir);
    assert_eq!(s["requests"]["sent"], 30);
    assert_eq!(s["config"]["load"]["mode"], "request_rate");
    assert!(s["schedule_lag_ms"]["max"].as_f64().is_some());
    // Intended send times follow the constant schedule: 5 ms apart.
    let rows = csv_rows(&dir);
    for (i, r) in rows.iter().enumerate() {
        let intended: f64 = r[1].parse().unwrap();
        assert!((intended - 5.0 * i as f64).abs() < 1e-3, "{r:?}");
    }

    // A trace: two requests sharing hash id 7's block, 50 ms apart at speed 2.
    let trace = dir.join("trace.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 1000, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [7, 8]}\n\
         {\"timestamp\": 1100, \"input_length\": 520, \"output_length\": 5, \"hash_ids\": [7, 9]}\n",
    )
    .unwrap();
    let tdir = dir.join("trace");
    let out = bench(
        &g,
        &[
            "--trace",
            trace.to_str().unwrap(),
            "--trace-speed",
            "2",
            "--tokenizer",
            "models/tiny",
            "--output",
            tdir.to_str().unwrap(),
        ],
    );
    ok(&out);
    let rows = csv_rows(&tdir);
    assert_eq!(rows.len(), 2);
    assert_eq!((rows[0][1].as_str(), rows[1][1].as_str()), ("0.0", "50.0"));
    assert_eq!((rows[0][9].as_str(), rows[1][9].as_str()), ("600", "520"));
    assert_eq!((rows[0][10].as_str(), rows[1][10].as_str()), ("3", "5"));
}

#[test]
fn failed_requests_are_counted_by_class() {
    let g = up();
    let dir = scratch_dir("bench-failed");
    let out = bench(
        &g,
        &[
            "--model",
            "nope",
            "--requests",
            "10",
            "--concurrency",
            "3",
            "--output",
            dir.to_str().unwrap(),
        ],
    );
    assert_eq!(out.status.code(), Some(1), "every request failed");
    assert!(String::from_utf8_lossy(&out.stderr).contains("every request failed"));
    let s = summary(&dir);
    assert_eq!(
        s["requests"],
        serde_json::json!({"sent": 10, "ok": 0, "failed": 10, "retried": 0})
    );
    assert_eq!(
        s["errors"],
        serde_json::json!({"http 404 model_not_found": 10})
    );
    assert_eq!(s["ttft_ms"], Value::Null);
    assert_eq!(csv_rows(&dir).len(), 10);
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dir = scratch_dir("bench-bad");
    let trace = dir.join("bad.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1}\nnot json\n",
    )
    .unwrap();
    let out = dyn_cmd()
        .args([
            "bench",
            "--url",
            "http://127.0.0.1:1",
            "--model",
            "m",
            "--trace",
        ])
        .arg(&trace)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.jsonl:2: expected ident"), "{err}");

    let out = dyn_cmd()
        .args(["bench", "--slo", "ttft=1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unknown SLO \"ttft\"; expected ttft_ms")
    );

    let out = dyn_cmd()
        .args(["bench", "--url", "http://127.0.0.1:1", "--requests", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Connection refused"));

    let missing = dir.join("missing.json");
    let out = dyn_cmd()
        .args(["bench", "compare"])
        .args([&missing, &missing])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.json: No such file"));
}

/// Ctrl-C stops new requests, lets the ones in flight finish, and still writes the summary.
#[test]
fn interrupt_summarizes_what_was_sent() {
    let g = up();
    let dir = scratch_dir("bench-interrupt");
    let child = dyn_cmd()
        .args([
            "bench",
            "--url",
            &g.url(""),
            "--no-progress",
            "--duration",
            "600",
        ])
        .args([
            "--concurrency",
            "2",
            "--isl",
            "16",
            "--osl",
            "4",
            "--output",
        ])
        .arg(&dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until the server has answered some requests, then interrupt.
    let served = || {
        g.get("/metrics")
            .lines()
            .filter(|l| l.starts_with("dyn_frontend_requests_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    while served() < 5.0 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let pid = child.id().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .unwrap()
            .success()
    );
    let out = child.wait_with_output().unwrap();
    let stdout = ok(&out);
    assert!(
        stdout.contains("interrupted: the run was stopped early"),
        "{stdout}"
    );
    let s = summary(&dir);
    assert_eq!(s["interrupted"], true);
    let sent = s["requests"]["sent"].as_u64().unwrap();
    assert!(sent >= 5, "{s}");
    assert_eq!(
        s["requests"]["ok"].as_u64().unwrap(),
        sent,
        "in-flight requests finished"
    );
}
