//! KV offload tiers through the real binary (`graphs/offload.yaml`, two mocker workers with
//! host-memory and disk tiers): evicted prompts show up per tier in `dyn inspect kv` (from the
//! workers' KV events, which name the tier), the router credits a worker that holds a prompt
//! below its pool, a repeated prompt is onboarded rather than recomputed, and `/metrics`
//! counts it all.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use dyn_tests::{Graph, completion, inspect_json, long_prompt, metric_sum, scratch_dir};
use serde_json::{Value, json};

async fn ask(url: &str, i: usize) {
    let body = json!({"model": "tiny", "prompt": long_prompt(i), "max_tokens": 2});
    let (status, v) = completion(url, &body).await;
    assert_eq!(status, 200, "{v}");
}

async fn metrics(url: &str) -> String {
    reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn evicted_prompts_live_on_per_tier_are_routed_to_and_onboarded() {
    let disk = scratch_dir("offload-graph");
    let disk_dir = format!("decode.mocker.offload.disk_dir={}", disk.display());
    // Pools of 2k tokens and host memory of 2k: a ~1k-token prompt is pushed from the pool
    // to host memory and on to disk by the prompts after it.
    let g = Graph::up_with_ingress(
        "graphs/offload.yaml",
        "http",
        &[
            "--set",
            "decode.mocker.num_blocks=128",
            "--set",
            "decode.mocker.offload.host_blocks=128",
            "--set",
            &disk_dir,
            "--set",
            "decode.mocker.speedup=100",
            // Room in the offload queue for every block the prompts evict: on a loaded machine
            // the offload thread falls behind the simulated engine, and a full queue drops
            // blocks (as it should), which would cut the prompt's chain short.
            "--set",
            "decode.mocker.offload.queue_blocks=4096",
            // Prices in blocks, not in the step times the router learns from the workers: a
            // simulated step at 100× speed measures mostly the machine's noise, and on a busy
            // machine the holder could price itself out of its own prefix.
            "--set",
            "route.cost=blocks",
        ],
    );
    let url = g.url("");
    for i in 0..8 {
        ask(&url, i).await;
    }
    let mut kv = Value::Null;
    // A bound that only ends a hang (each look runs the binary: slow on a loaded machine).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::time::Instant::now() < deadline {
        kv = inspect_json(&url, &["kv"]);
        let workers = kv["replicas"][0]["workers"].as_array().unwrap();
        let sum = |tier: &str| {
            workers
                .iter()
                .map(|w| w[tier].as_u64().unwrap())
                .sum::<u64>()
        };
        if sum("cpu") > 0 && sum("disk") > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let workers = kv["replicas"][0]["workers"].as_array().unwrap();
    assert!(
        workers.iter().any(|w| w["disk"].as_u64() > Some(0)),
        "blocks reached disk: {kv}"
    );
    assert!(
        workers
            .iter()
            .all(|w| w["gpu"].as_u64().unwrap() <= 128 && w["cpu"].as_u64().unwrap() <= 128),
        "capacities: {kv}"
    );

    // The first prompt is gone from every pool, but the router still sees it below one, and
    // goes where it is. The workers' load and their offload events reach the router on their
    // own schedule: until they have, the holder may still look busy ("its queue outweighs the
    // saved prefill") or hold only the head of the prompt below its pool (the offload thread
    // writes the rest), so this waits for the whole prompt to be seen (a bound that only ends
    // a hang).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let (r, chosen, lower) = loop {
        let r = inspect_json(&url, &["route", "--prompt", &long_prompt(0)])["replicas"][0].clone();
        let chosen = r["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["worker_id"] == r["worker_id"])
            .unwrap()
            .clone();
        let lower =
            chosen["host_blocks"].as_u64().unwrap() + chosen["disk_blocks"].as_u64().unwrap();
        // Every full block of the prompt, in the pool or below it.
        let whole =
            chosen["matched_blocks"].as_u64().unwrap() + 1 >= r["prompt_blocks"].as_u64().unwrap();
        if (lower > 0 && whole) || std::time::Instant::now() > deadline {
            break (r, chosen, lower);
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert!(lower > 0, "{r}");
    assert!(
        chosen["prefill_tokens"].as_u64().unwrap() < r["prompt_tokens"].as_u64().unwrap(),
        "an onboard is credited: {chosen}"
    );

    // Asked again, it is onboarded, not recomputed.
    let text = metrics(&url).await;
    let before = metric_sum(&text, "dyn_worker_kv_onboard_blocks_total", &[]);
    let computed_before = metric_sum(&text, "dyn_worker_prefill_tokens_total", &[]);
    ask(&url, 0).await;
    let text = metrics(&url).await;
    let onboarded = metric_sum(&text, "dyn_worker_kv_onboard_blocks_total", &[]) - before;
    let computed = metric_sum(&text, "dyn_worker_prefill_tokens_total", &[]) - computed_before;
    assert!(onboarded >= lower as f64 - 1.0, "{onboarded} of {lower}");
    assert!(
        computed < r["prompt_tokens"].as_f64().unwrap() / 2.0,
        "{computed} tokens computed"
    );
    for series in [
        "dyn_worker_kv_offload_blocks_total",
        "dyn_worker_kv_tier_blocks",
        "dyn_worker_kv_offload_bytes_total",
    ] {
        assert!(metric_sum(&text, series, &[]) > 0.0, "{series}");
    }
    assert!(
        metric_sum(
            &text,
            "dyn_worker_kv_tier_capacity_blocks",
            &["tier=\"DISK\""]
        ) >= 8192.0
    );
}
