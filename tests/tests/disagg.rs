//! Disaggregated serving in one process (`graphs/disagg.yaml`, embedded planes): long prompts
//! are prefilled on the prefill worker and their KV pulled by the decode worker, short ones
//! stay local, every request completes, the output equals aggregated serving's token for
//! token, and the decisions show in `/metrics` and `dyn inspect route`. The same with the
//! native engine: real KV blocks move, and greedy output equals `graphs/agg_native.yaml`'s,
//! with a structured output too (the grammar continues on the decode worker).
//! The multi-process version (etcd, NATS JetStream, a prefill worker killed mid-transfer) is
//! in `scale_out.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use dyn_tests::{Graph, completion, inspect_json, long_prompt, metric};
use serde_json::{Value, json};

/// Completions of 12 tokens for `prompts`, all at once; `extra` fields join each body.
async fn complete_all(url: &str, prompts: &[String], extra: &Value) -> Vec<Value> {
    let tasks: Vec<_> = prompts
        .iter()
        .map(|p| {
            let mut body = json!({"model": "tiny", "prompt": p, "max_tokens": 12});
            for (k, v) in extra.as_object().into_iter().flatten() {
                body[k] = v.clone();
            }
            let url = url.to_owned();
            tokio::spawn(async move {
                let (status, v) = completion(&url, &body).await;
                assert_eq!(status, 200, "{v}");
                v
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// Each completion's text, checking it has 12 tokens.
fn texts(vs: &[Value]) -> Vec<String> {
    vs.iter()
        .map(|v| {
            assert_eq!(v["usage"]["completion_tokens"], 12, "{v}");
            v["choices"][0]["text"].as_str().unwrap().to_owned()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_prompts_are_prefilled_remotely_and_outputs_match_aggregated() {
    let fast = [
        "--set",
        "decode.config.mocker.speedup=10",
        "--set",
        "prefill.config.mocker.speedup=10",
        "--set",
        "remote_prefill.max_queue=1000",
    ];
    let disagg = Graph::up_with_ingress("graphs/disagg.yaml", "http", &fast);
    let agg = Graph::up_with_ingress("graphs/agg.yaml", "http", &[]);
    let mut prompts: Vec<String> = (0..6).map(long_prompt).collect();
    prompts.extend((0..6).map(|i| format!("a short question, number {i}")));

    let got = texts(&complete_all(&disagg.url(""), &prompts, &json!({})).await);
    let want = texts(&complete_all(&agg.url(""), &prompts, &json!({})).await);
    assert_eq!(got, want, "disaggregated output differs from aggregated");

    let m = disagg.get("/metrics");
    let decisions = "dyn_remote_prefill_decisions_total";
    assert_eq!(metric(&m, &[decisions, "decision=\"remote\""]), 6, "{m}");
    assert_eq!(
        metric(&m, &[decisions, "reason=\"below_threshold\""]),
        6,
        "{m}"
    );
    assert_eq!(
        metric(&m, &["dyn_worker_kv_transfers_total", "outcome=\"pulled\""]),
        6
    );
    assert_eq!(
        metric(&m, &["dyn_worker_kv_transfers_total", "outcome=\"failed\""]),
        0
    );
    // The prefill worker held the blocks only until they were pulled.
    let prefill_blocks = |m: &str| metric(m, &["dyn_worker_kv_active_blocks", "node=\"prefill\""]);
    dyn_tests::until("the prefill worker releases its blocks", || {
        prefill_blocks(&disagg.get("/metrics")) == 0
    })
    .await;

    // `dyn inspect route` explains both steps: the decode worker, then the prefill decision.
    let url = disagg.url("");
    let ask = |prompt: String| {
        let url = url.clone();
        move || inspect_json(&url, &["route", "--prompt", &prompt])
    };
    let v = tokio::task::spawn_blocking(ask(long_prompt(99)))
        .await
        .unwrap();
    let p = &v["prefill"]["replicas"][0];
    assert_eq!(
        (p["decision"].as_str(), p["reason"].as_str()),
        (Some("remote"), Some("remote")),
        "{v}"
    );
    // A prompt the decode worker already caches stays local.
    let v = tokio::task::spawn_blocking(ask(long_prompt(0)))
        .await
        .unwrap();
    let p = &v["prefill"]["replicas"][0];
    assert_eq!(p["reason"], "below_threshold", "{v}");
    let v = tokio::task::spawn_blocking(ask("hello".into()))
        .await
        .unwrap();
    let text = serde_json::to_string_pretty(&v).unwrap();
    assert!(text.contains("\"decision\": \"local\""), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_engine_disaggregated_greedy_output_equals_aggregated() {
    let disagg = Graph::up_with_ingress("graphs/disagg_native.yaml", "http", &[]);
    let agg = Graph::up_with_ingress("graphs/agg_native.yaml", "http", &[]);
    let mut prompts: Vec<String> = (0..4).map(long_prompt).collect();
    prompts.extend((0..4).map(|i| format!("a short question, number {i}")));
    let greedy = json!({"temperature": 0, "ignore_eos": true});
    let got = texts(&complete_all(&disagg.url(""), &prompts, &greedy).await);
    let want = texts(&complete_all(&agg.url(""), &prompts, &greedy).await);
    assert_eq!(got, want, "disaggregated output differs from aggregated");
    let m = disagg.get("/metrics");
    let decisions = "dyn_remote_prefill_decisions_total";
    assert_eq!(metric(&m, &[decisions, "decision=\"remote\""]), 4, "{m}");
    assert_eq!(
        metric(
            &m,
            &[
                "dyn_worker_kv_transfers_total",
                "outcome=\"pulled\"",
                "via=\"inproc\""
            ]
        ),
        4,
        "{m}"
    );
    assert_eq!(
        metric(&m, &["dyn_worker_kv_transfers_total", "outcome=\"failed\""]),
        0
    );

    // A structured output across the split: the prefill worker samples the first token
    // within the grammar and the decode worker's grammar starts after it, so the answer is
    // one of the choices, as aggregated serving gives it.
    let choices = ["over the hills and far away", "under the sea"];
    let guided = json!({"temperature": 0, "structured_outputs": {"choice": choices}});
    let texts = |vs: Vec<Value>| -> Vec<String> {
        vs.iter()
            .map(|v| {
                let text = v["choices"][0]["text"].as_str().unwrap();
                assert!(choices.contains(&text), "{text:?} is not a choice: {v}");
                assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
                text.to_owned()
            })
            .collect()
    };
    let long: Vec<String> = (10..14).map(long_prompt).collect();
    let got = texts(complete_all(&disagg.url(""), &long, &guided).await);
    let want = texts(complete_all(&agg.url(""), &long, &guided).await);
    assert_eq!(got, want, "disaggregated output differs from aggregated");
    let m = disagg.get("/metrics");
    assert_eq!(
        metric(&m, &["dyn_worker_kv_transfers_total", "outcome=\"pulled\""]),
        8,
        "{m}"
    );
}
