//! `dyn inspect` through the real binary against a running `graphs/agg_kv.yaml`: workers,
//! routing decisions for a prompt, the KV index and the KV event stream, all as `--json`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use std::process::{Output, Stdio};

use dyn_tests::{Graph, dyn_cmd, inspect_json, run, scratch_dir};
use serde_json::{Value, json};

const CONTENT: &str = "the quick brown fox jumps over the lazy dog, again and again and again";

fn inspect(g: &Graph, args: &[&str]) -> Value {
    inspect_json(&g.url(""), args)
}

async fn chat(g: &Graph) {
    let r = reqwest::Client::new()
        .post(g.url("/v1/chat/completions"))
        .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": CONTENT}], "max_tokens": 4}))
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
    // Follow the event stream while a request is served.
    let events = dyn_cmd()
        .args([
            "inspect",
            "--url",
            &g.url(""),
            "--json",
            "events",
            "--wait",
            "3",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    chat(&g).await;

    // The index learns the prompt's blocks from the worker's events.
    let mut kv = Value::Null;
    for _ in 0..100 {
        kv = inspect(&g, &["kv"]);
        if kv["replicas"][0]["stored_blocks"].as_u64() > Some(0) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let kv = &kv["replicas"][0];
    let holder = kv["workers"][0]["worker_id"].as_str().unwrap().to_owned();
    assert!(kv["bytes_per_block"].as_f64().unwrap() > 0.0);
    assert_eq!(kv["block_size"], 16);

    let w = inspect(&g, &["workers"]);
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
    assert_eq!(served["kv_total_blocks"], 2048);
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

    let out: Output = events.wait_with_output().unwrap();
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l["event"]["event"]["data"]["stored"].is_object()
                && l["subject"] == "dyn.dyn.decode.kv_events"),
        "{lines:?}"
    );
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
