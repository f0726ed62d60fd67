//! LoRA adapters behind the real `dyn` binary and HTTP (`graphs/lora.yaml`: models/tiny with
//! PEFT adapters from scripts/make-lora-fixtures): each adapter's greedy answers equal
//! transformers + peft's while requests of three adapters and the base run at once (mixed
//! batches, and prefix-cache hits kept apart per adapter); `/v1/models` lists the adapters;
//! vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` at run time, with clear errors;
//! streams of an adapter unloaded mid-stream finish; 100 load/unload cycles leave the worker
//! holding no more than `max_loras` adapters.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use std::collections::BTreeMap;
use std::time::Duration;

use dyn_tests::{Graph, completion, metric, post_json, root};
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::oneshot;

struct Reference {
    prompts: Vec<Vec<u32>>,
    /// Greedy answers by adapter (`base`: none), one per prompt.
    greedy: BTreeMap<String, Vec<Vec<u32>>>,
}

fn reference() -> Reference {
    let text = std::fs::read_to_string(root().join("models/tiny-lora/reference.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let prompts = serde_json::from_value(v["prompts"].clone()).unwrap();
    let greedy = v["outputs"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, outs)| {
            let g = outs
                .as_array()
                .unwrap()
                .iter()
                .map(|o| serde_json::from_value(o["greedy"].clone()).unwrap())
                .collect();
            (name.clone(), g)
        })
        .collect();
    Reference { prompts, greedy }
}

/// `model`'s greedy answer to `prompt` (token ids), 12 tokens.
async fn greedy(url: &str, model: &str, prompt: &[u32]) -> Result<Vec<u32>, Value> {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                      "ignore_eos": true, "return_token_ids": true});
    let (status, v) = completion(url, &body).await;
    if status != 200 {
        return Err(v);
    }
    assert_eq!(v["model"], model, "{v}");
    Ok(serde_json::from_value(v["choices"][0]["token_ids"].clone()).unwrap())
}

/// Every prompt under each of `models` (graph names; `tiny` is the base), all at once; each
/// answer must be transformers + peft's.
async fn all_at_once_match(url: &str, r: &Reference, models: &[&str]) {
    let asks: Vec<(&str, usize)> = models
        .iter()
        .flat_map(|m| (0..r.prompts.len()).map(move |p| (*m, p)))
        .collect();
    let got =
        futures::future::join_all(asks.iter().map(|(m, p)| greedy(url, m, &r.prompts[*p]))).await;
    for ((m, p), got) in asks.iter().zip(got) {
        let key = if *m == "tiny" { "base" } else { m };
        assert_eq!(got.unwrap(), r.greedy[key][*p], "{m} prompt {p}");
    }
}

fn load_body(name: &str, path: &str) -> Value {
    json!({"lora_name": name, "lora_path": path})
}

/// POST `body` to `path`; the status and the text of the answer.
async fn post_text(url: &str, body: &Value) -> (u16, String) {
    let r = reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// A streamed completion at `url`: its status and the token ids of all its chunks (or what
/// went wrong). `started` is told once the first token came, or the request failed.
async fn streamed_ids(
    url: &str,
    body: &Value,
    started: oneshot::Sender<()>,
) -> (u16, Result<Vec<u32>, String>) {
    let resp = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    if status != 200 {
        let _ = started.send(());
        return (status, Err(resp.text().await.unwrap_or_default()));
    }
    let mut started = Some(started);
    let (mut ids, mut pending) = (Vec::new(), Vec::<u8>::new());
    let mut chunks = resp.bytes_stream();
    while let Some(chunk) = chunks.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => return (status, Err(format!("the stream broke after {ids:?}: {e}"))),
        };
        pending.extend_from_slice(&chunk);
        while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data).unwrap();
            if v.get("error").is_some() {
                return (status, Err(format!("an error event after {ids:?}: {v}")));
            }
            let got: Vec<u32> =
                serde_json::from_value(v["choices"][0]["token_ids"].clone()).unwrap_or_default();
            ids.extend_from_slice(&got);
            if !got.is_empty()
                && let Some(tell) = started.take()
            {
                let _ = tell.send(());
            }
        }
    }
    (status, Ok(ids))
}

fn adapter_path(name: &str) -> String {
    root()
        .join("models/tiny-lora")
        .join(name)
        .display()
        .to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn adapters_answer_as_peft_does_and_load_and_unload_at_run_time() {
    let g = Graph::up_with_ingress("graphs/lora.yaml", "http", &[]);
    let url = g.url("");
    let r = reference();

    // The graph's adapters are listed after the model, with their parent.
    let models = dyn_tests::get_json(&format!("{url}/v1/models")).await;
    let ids: Vec<(&str, &Value)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap(), &m["parent"]))
        .collect();
    assert_eq!(
        ids,
        [
            ("tiny", &Value::Null),
            ("all", &json!("tiny")),
            ("qv", &json!("tiny"))
        ],
        "{models}"
    );

    // Base and two adapters at once, twice: the second round hits the prefix cache, which
    // must keep each adapter's KV its own.
    all_at_once_match(&url, &r, &["tiny", "qv", "all"]).await;
    all_at_once_match(&url, &r, &["all", "tiny", "qv"]).await;
    // Counted by adapter, under their model.
    let m = g.get("/metrics");
    for lora in ["qv", "all"] {
        let label = format!("lora=\"{lora}\"");
        let n = metric(
            &m,
            &["dyn_frontend_lora_requests_total", &label, "model=\"tiny\""],
        );
        assert_eq!(n, 2 * r.prompts.len() as u64, "{lora}");
    }

    // Not served yet: a 404 naming what is.
    let e = greedy(&url, "mlp", &r.prompts[0]).await.unwrap_err();
    assert_eq!(e["error"]["code"], "model_not_found", "{e}");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("serves `tiny`, `all`, `qv`"), "{msg}");

    // Loaded at run time (vLLM's endpoint and answers).
    let load = g.url("/v1/load_lora_adapter");
    let (status, text) = post_text(&load, &load_body("mlp", &adapter_path("mlp"))).await;
    assert_eq!(
        (status, text.as_str()),
        (200, "Success: LoRA adapter 'mlp' added successfully.")
    );
    all_at_once_match(&url, &r, &["mlp", "qv", "tiny", "all"]).await;

    // A GGUF LoRA file (llama.cpp's converter's, from qv's directory) serves as qv does.
    let gguf = root()
        .join("models/tiny-lora/qv.gguf")
        .display()
        .to_string();
    let (status, text) = post_text(&load, &load_body("qv-gguf", &gguf)).await;
    assert_eq!(status, 200, "{text}");
    for (p, prompt) in r.prompts.iter().enumerate() {
        let got = greedy(&url, "qv-gguf", prompt).await.unwrap();
        assert_eq!(got, r.greedy["qv"][p], "qv.gguf prompt {p}");
    }

    // Loading it again, a missing directory, a bad name, a bad body: 400s that say why.
    let (status, v) = post_json(&load, &load_body("mlp", &adapter_path("mlp"))).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("has already been loaded"),
        "{v}"
    );
    let (status, v) = post_json(&load, &load_body("x", "/nonexistent/adapter")).await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("lora_path")),
        "{v}"
    );
    // The same words whatever is wrong with the path (tests/tests/hardening_files.rs).
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("lora_path is not a LoRA adapter this server can read"),
        "{v}"
    );
    let (status, v) = post_json(&load, &load_body("tiny", &adapter_path("qv"))).await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("lora_name")),
        "{v}"
    );
    let (status, v) = post_json(&load, &json!({"lora_name": "y"})).await;
    assert_eq!(status, 400, "{v}");
    // An adapter of the model's own directory is no adapter at all.
    let base = root().join("models/tiny").display().to_string();
    let (status, v) = post_json(&load, &load_body("z", &base)).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("adapter_config.json"),
        "{v}"
    );

    // Unloaded: no longer served, no longer listed; a second unload is a 404.
    let unload = g.url("/v1/unload_lora_adapter");
    let (status, text) = post_text(&unload, &json!({"lora_name": "mlp"})).await;
    assert_eq!(
        (status, text.as_str()),
        (200, "Success: LoRA adapter 'mlp' removed successfully.")
    );
    let e = greedy(&url, "mlp", &r.prompts[0]).await.unwrap_err();
    assert_eq!(e["error"]["code"], "model_not_found", "{e}");
    let (status, v) = post_json(&unload, &json!({"lora_name": "mlp"})).await;
    assert_eq!(status, 404, "{v}");
    let (status, v) = post_json(&unload, &json!({"lora_name": "qv", "lora_int_id": 1})).await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("lora_int_id")),
        "{v}"
    );
}

/// Streams of an adapter unloaded while they run finish with its answer; load/unload cycles,
/// each with a request, leave the worker with at most `max_loras` adapters in memory.
#[tokio::test(flavor = "multi_thread")]
async fn unloading_under_load_finishes_streams_and_cycles_leak_nothing() {
    let g = Graph::up_with_ingress(
        "graphs/lora.yaml",
        "http",
        &["--set", "decode.native.max_loras=2"],
    );
    let url = g.url("");
    let r = reference();
    let load = g.url("/v1/load_lora_adapter");
    let unload = g.url("/v1/unload_lora_adapter");
    let (status, _) = post_text(&load, &load_body("mlp", &adapter_path("mlp"))).await;
    assert_eq!(status, 200);

    // Sixteen long streams of `mlp`, unloaded once every one of them has streamed a token:
    // a request still on its way to the worker when the adapter goes would rightly get 404
    // `model_not_found`, which is not what this checks.
    let long = |i: usize| {
        json!({"model": "mlp", "prompt": r.prompts[i % 3], "max_tokens": 400, "temperature": 0,
               "ignore_eos": true, "return_token_ids": true, "stream": true})
    };
    let (tells, started): (Vec<_>, Vec<_>) = (0..16).map(|_| oneshot::channel()).unzip();
    let streams = futures::future::join_all(tells.into_iter().enumerate().map(|(i, tell)| {
        let (url, body) = (url.clone(), long(i));
        async move { streamed_ids(&url, &body, tell).await }
    }));
    let unloader = async {
        for (i, started) in started.into_iter().enumerate() {
            // A bound that only ends a hang: a loaded 2-core machine runs 16 streams slowly.
            tokio::time::timeout(Duration::from_secs(300), started)
                .await
                .unwrap_or_else(|_| panic!("stream {i} streamed no token in 300 s"))
                .unwrap_or_else(|_| panic!("stream {i} ended before saying it started"));
        }
        post_text(&unload, &json!({"lora_name": "mlp"})).await
    };
    let (done, (status, text)) = tokio::join!(streams, unloader);
    assert_eq!(status, 200, "unloading under load: {text}");
    for (i, (status, ids)) in done.into_iter().enumerate() {
        let ids = ids.unwrap_or_else(|e| panic!("stream {i}: status {status}: {e}"));
        assert_eq!(status, 200, "stream {i}");
        // The adapter's answer, not the base's.
        assert_eq!(ids[..12], r.greedy["mlp"][i % 3][..], "stream {i}");
        assert_eq!(ids.len(), 400, "stream {i}");
    }

    // The same files loaded again under the same name: the worker's copy serves them.
    let loads = || metric(&g.get("/metrics"), &["dyn_worker_lora_loads_total"]);
    let before = loads();
    let (status, _) = post_text(&load, &load_body("mlp", &adapter_path("mlp"))).await;
    assert_eq!(status, 200);
    assert_eq!(
        greedy(&url, "mlp", &r.prompts[0]).await.unwrap(),
        r.greedy["mlp"][0]
    );
    assert_eq!(loads(), before, "identical files were read again");
    let (status, _) = post_text(&unload, &json!({"lora_name": "mlp"})).await;
    assert_eq!(status, 200);

    // A hundred cycles, each loading an adapter under a new name (each a new adapter for the
    // worker), running it, and unloading it.
    let rss = || {
        let status = std::fs::read_to_string(format!("/proc/{}/status", g.pid())).unwrap();
        let kb = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap();
        kb * 1024
    };
    let mut warm = 0;
    for cycle in 0..100 {
        if cycle == 10 {
            warm = rss();
        }
        let (name, dir) = (format!("c{cycle}"), ["qv", "all", "mlp"][cycle % 3]);
        let (status, text) = post_text(&load, &load_body(&name, &adapter_path(dir))).await;
        assert_eq!(status, 200, "cycle {cycle}: {text}");
        let p = cycle % 3;
        let got = greedy(&url, &name, &r.prompts[p]).await.unwrap();
        assert_eq!(got, r.greedy[dir][p], "cycle {cycle}");
        let (status, text) = post_text(&unload, &json!({"lora_name": name})).await;
        assert_eq!(status, 200, "cycle {cycle}: {text}");
    }
    // The process holds no more after ninety cycles than after ten (within allocator noise).
    let after = rss();
    eprintln!(
        "RSS after 10 cycles {} MiB, after 100 {} MiB",
        warm >> 20,
        after >> 20
    );
    assert!(after < warm + (16 << 20), "{warm} → {after} bytes");
    let m = g.get("/metrics");
    // Each was read once, and no more than two were ever kept.
    assert!(loads() >= before + 100, "{m}");
    assert!(metric(&m, &["dyn_worker_loras_resident"]) <= 2, "{m}");
    let listed = dyn_tests::get_json(&format!("{url}/v1/models")).await;
    assert_eq!(listed["data"].as_array().unwrap().len(), 3, "{listed}");
    // The graph's adapters still answer after all that.
    all_at_once_match(&url, &r, &["qv", "tiny"]).await;
}

/// Two workers behind the `kv` router: an adapter's requests, one after another with prompts
/// that share nothing, all go to the worker that read it first, so it is read once (with
/// `route.lora_load_ms=0` they alternate and both read it).
#[tokio::test(flavor = "multi_thread")]
async fn the_router_keeps_an_adapter_s_requests_where_it_is_held() {
    let g = Graph::up_with_ingress("graphs/lora.yaml", "http", &["--set", "decode.replicas=2"]);
    let url = g.url("");
    dyn_tests::until("both workers serve", || {
        g.get("/metrics")
            .lines()
            .filter(|l| l.starts_with("dyn_worker_loras_resident{"))
            .count()
            == 2
    })
    .await;
    for i in 0..8u32 {
        let prompt: Vec<u32> = (0..20).map(|t| 7 + (i * 37 + t * 11) % 600).collect();
        greedy(&url, "qv", &prompt).await.unwrap();
    }
    let m = g.get("/metrics");
    assert_eq!(
        metric(&m, &["dyn_worker_lora_loads_total"]),
        1,
        "the adapter was read on more than one worker:\n{m}"
    );
    // `dyn inspect route --model ADAPTER` prices the adapter's read on the worker without it
    // and picks the one with it; the model itself costs no read anywhere.
    let lora_ms = |model: &str| -> (String, Vec<(String, f64)>) {
        let r = dyn_tests::inspect_json(&url, &["route", "--model", model, "--prompt", "Hi"]);
        let r = &r["replicas"][0];
        let c = r["candidates"].as_array().unwrap();
        let ms = c
            .iter()
            .map(|c| {
                (
                    c["worker_id"].as_str().unwrap().to_owned(),
                    c["lora_ms"].as_f64().unwrap(),
                )
            })
            .collect();
        (r["worker_id"].as_str().unwrap().to_owned(), ms)
    };
    let (chosen, ms) = lora_ms("qv");
    let held: Vec<&str> = ms
        .iter()
        .filter(|(_, m)| *m == 0.0)
        .map(|(w, _)| w.as_str())
        .collect();
    assert_eq!(held, [chosen.as_str()], "{ms:?}");
    assert_eq!(ms.len(), 2, "{ms:?}");
    let (_, ms) = lora_ms("tiny");
    assert!(ms.iter().all(|(_, m)| *m == 0.0), "{ms:?}");
}

/// Loading and unloading are the operators': behind `admin_key` where one is set (a tenant's
/// API key does not open them), and only for JSON bodies.
#[tokio::test(flavor = "multi_thread")]
async fn loading_adapters_takes_the_admin_key_and_a_json_body() {
    let g = Graph::start(
        "graphs/lora.yaml",
        "http",
        &["--set", "http.api_keys=[api-key]"],
        &[("DYN_ADMIN_KEY", "admin-key")],
    );
    let load = g.url("/v1/load_lora_adapter");
    let send = |key: &str, json: bool| {
        let r = reqwest::Client::new().post(&load).bearer_auth(key);
        let body = load_body("mlp", &adapter_path("mlp")).to_string();
        let r = if json {
            r.header("content-type", "application/json")
        } else {
            r.header("content-type", "text/plain")
        };
        r.body(body).send()
    };
    assert_eq!(send("api-key", true).await.unwrap().status(), 401);
    assert_eq!(send("admin-key", false).await.unwrap().status(), 415);
    assert_eq!(send("admin-key", true).await.unwrap().status(), 200);
    // Served to the tenants with their own key.
    let r = reqwest::Client::new()
        .post(g.url("/v1/completions"))
        .bearer_auth("api-key")
        .json(&json!({"model": "mlp", "prompt": "hi", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}
