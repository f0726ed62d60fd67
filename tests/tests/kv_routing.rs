//! KV-aware routing in a running `dyn graph up graphs/agg_kv.yaml` (four mocker workers):
//! repeated prompts go to the worker that caches them, where round-robin spreads them.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use std::collections::HashMap;

use dyn_tests::Graph;
use serde_json::json;

/// Prompt blocks looked up per worker, from the workers' Prometheus counters.
fn lookups_per_worker(g: &Graph) -> HashMap<String, f64> {
    g.get("/metrics")
        .lines()
        .filter(|l| l.starts_with("dyn_worker_prompt_blocks_total{"))
        .filter_map(|l| {
            let (labels, value) = l.rsplit_once(' ')?;
            Some((labels.to_owned(), value.parse().ok()?))
        })
        .filter(|(_, v): &(String, f64)| *v > 0.0)
        .collect()
}

async fn send_same_prompt(g: &Graph, times: usize) {
    // Long enough for many full blocks after the chat template.
    let content = "the quick brown fox jumps over the lazy dog ".repeat(40);
    let client = reqwest::Client::new();
    for _ in 0..times {
        let r = client
            .post(g.url("/v1/chat/completions"))
            .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap();
        // The worker's KV events reach the router's index asynchronously; give them time so
        // the next request is routed on them (nothing here measures time).
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn kv_policy_keeps_a_repeated_prompt_on_one_worker() {
    let g = Graph::up_with_ingress(
        "graphs/agg_kv.yaml",
        "http",
        &["--set", "decode.mocker.speedup=100"],
    );
    send_same_prompt(&g, 6).await;
    let per_worker = lookups_per_worker(&g);
    assert_eq!(
        per_worker.len(),
        1,
        "one worker served all six: {per_worker:?}"
    );
}

#[tokio::test]
async fn round_robin_spreads_the_same_prompt() {
    let g = Graph::up_with_ingress(
        "graphs/agg_kv.yaml",
        "http",
        &[
            "--set",
            "decode.mocker.speedup=100",
            "--set",
            "route.policy=round_robin",
        ],
    );
    send_same_prompt(&g, 4).await;
    assert_eq!(lookups_per_worker(&g).len(), 4);
}
