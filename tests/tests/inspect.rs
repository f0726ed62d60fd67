//! `dyn inspect` through the real binary against a running `graphs/agg_kv.yaml`: workers,
//! routing decisions for a prompt, the KV index and the KV event stream, all as `--json`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use dyn_tests::{Graph, dyn_cmd, inspect_json, run, scratch_dir};
use serde_json::{Value, json};

const CONTENT: &str = "the quick brown fox jumps over the lazy dog, again and again and again";

fn inspect(g: &Graph, args: &[&str]) -> Value {
    inspect_json(&g.url(""), args)
}

async fn chat(g: &Graph, content: &str) {
    let r = reqwest::Client::new()
        .post(g.url("/v1/chat/completions"))
        .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.bytes().await.unwrap();
}

#[tokio::test]
async fn workers_route_kv_and_events() {
    let g = Graph::up_with_ingress(
        "graphs/agg_kv.yaml",
        "http",
        &["--set", "decode.mocker.speedup=100"],
    );
    chat(&g, CONTENT).await;

    // The index learns the prompt's blocks from the worker's events.
    let mut kv = Value::Null;
    // A bound that only ends a hang (each look runs the binary: slow on a loaded machine).
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        kv = inspect(&g, &["kv"]);
        if kv["replicas"][0]["stored_blocks"].as_u64() > Some(0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let kv = &kv["replicas"][0];
    let holder = kv["workers"][0]["worker_id"].as_str().unwrap().to_owned();
    assert!(kv["bytes_per_block"].as_f64().unwrap() > 0.0);
    assert_eq!(kv["block_size"], 16);

    // A worker's load (its block counts among it) is published as it works, and reaches the
    // router only once the router follows it, which on a loaded machine may be after the
    // first request: ask again (the same prompt goes to the same worker) until the holder's
    // load is there (a bound that only ends a hang).
    let deadline = Instant::now() + Duration::from_secs(60);
    let w = loop {
        let w = inspect(&g, &["workers"]);
        let reported = w["replicas"][0]["workers"].as_array().is_some_and(|ws| {
            ws.iter()
                .any(|w| w["worker_id"] == holder.as_str() && !w["kv_total_blocks"].is_null())
        });
        if reported || Instant::now() > deadline {
            break w;
        }
        chat(&g, CONTENT).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let workers = w["replicas"][0]["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 4);
    assert!(
        workers
            .iter()
            .all(|w| w["live"] == true && w["active_requests"] == 0)
    );
    let served = workers
        .iter()
        .find(|w| w["worker_id"] == holder.as_str())
        .unwrap();
    assert_eq!(served["kv_total_blocks"], 2048, "{w}");
    assert!(served["indexed_blocks"].as_u64().unwrap() >= 1);

    // The same conversation would go back to that worker, its blocks all matched.
    let dir = scratch_dir("inspect");
    let messages = dir.join("messages.json");
    std::fs::write(
        &messages,
        json!([{"role": "user", "content": CONTENT}]).to_string(),
    )
    .unwrap();
    let r = inspect(&g, &["route", "--messages", messages.to_str().unwrap()]);
    let r = &r["replicas"][0];
    assert_eq!(r["worker_id"], holder.as_str());
    assert_eq!(r["policy"], "kv");
    let chosen = r["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["worker_id"] == holder.as_str())
        .unwrap();
    let full_blocks = r["prompt_tokens"].as_u64().unwrap() / 16;
    assert_eq!(chosen["matched_blocks"].as_u64().unwrap(), full_blocks);
    assert_eq!(r["candidates"].as_array().unwrap().len(), 4);
    // In the `time` cost's terms: why, and each candidate's predicted times.
    assert!(
        r["reason"].as_str().unwrap().starts_with("holds the most"),
        "{r}"
    );
    assert_eq!(r["pricing"]["model"], "time");
    assert!(chosen["prefill_ms"].as_f64().unwrap() > 0.0, "{chosen}");
    assert!(chosen["excluded"].is_null());
    // The router's quality figures count the decisions it made.
    let w = inspect(&g, &["workers"]);
    let q = &w["replicas"][0]["quality"];
    assert!(q["decisions"].as_u64().unwrap() > 0, "{w}");
    assert!(q["prompt_blocks"].as_u64().unwrap() > 0, "{w}");

    // Follow the event stream while requests are served. The follower subscribes in its own
    // time (a fixed pause is not enough on a loaded machine), so prompts never seen before —
    // new blocks, each stored — go on until it has printed one, within a bound that only
    // ends a hang.
    let mut events = dyn_cmd()
        .args([
            "inspect",
            "--url",
            &g.url(""),
            "--json",
            "events",
            "--follow",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = events.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let stored = |l: &Value| {
        l["event"]["event"]["data"]["stored"].is_object()
            && l["subject"] == "dyn.dyn.decode.kv_events"
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut lines: Vec<Value> = Vec::new();
    for i in 0.. {
        chat(&g, &format!("{i} {CONTENT}")).await;
        lines.extend(rx.try_iter().map(|l| serde_json::from_str(&l).unwrap()));
        if lines.iter().any(stored) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the follower printed no stored blocks in 60 s: {lines:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = events.kill();
    let _ = events.wait();
}

#[test]
fn clear_errors() {
    let out = run(&["inspect", "--url", "http://127.0.0.1:1", "workers"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach"));
    let out = run(&["inspect", "route"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "--prompt or --messages is required"
    );
}

#[tokio::test]
async fn unknown_node_and_non_kv_policies() {
    let g = Graph::up_with_ingress("graphs/agg.yaml", "http", &[]);
    let url = g.url("");
    let out = run(&["inspect", "--url", &url, "--node", "nope", "workers"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no inspectable node 'nope'"));
    // round_robin keeps no KV index: a clear 400, not a crash.
    let out = run(&["inspect", "--url", &url, "kv"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("policy round_robin keeps no KV index"));
    let w = inspect(&g, &["workers"]);
    assert_eq!(w["replicas"][0]["workers"].as_array().unwrap().len(), 2);
}
