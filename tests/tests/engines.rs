//! Real external engines behind dyn (graphs/llamacpp.yaml, graphs/vllm.yaml): token ids in
//! and out, greedy answers equal to the engine's own for the same ids, a client hang-up
//! freeing the request in the engine (its own running-requests metric), a server killed
//! mid-stream with every stream completing identically on the other, vLLM's KV events in the
//! router's index, LoRA adapters as each server applies them (vLLM's loaded at run time,
//! llama.cpp's given at start), embeddings as each server computes them, and bad
//! configurations failing clearly (503, never a hang).
//!
//! Needs the engines `scripts/engines` sets up (`scripts/test` does, and sets
//! `DYN_LLAMA_SERVER`, `DYN_VLLM_PYTHON` and `DYN_SMOLLM2_HF`); skipped visibly without them.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use std::time::{Duration, Instant};

use dyn_tests::{Graph, completion, inspect_json, scratch_dir, unprefixed};
use futures::StreamExt;
use nix::sys::signal::Signal;
use serde_json::{Value, json};

/// One engine test at a time under `cargo test` (nextest runs them with `--test-threads 1`):
/// two vLLM servers take both cores.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn env_path(var: &str) -> Option<String> {
    let p = std::env::var(var).ok()?;
    std::path::Path::new(&p).exists().then_some(p)
}

/// The engine servers dyn started: (replica, url, pid of the process group), once all `n`
/// are ready.
fn servers(g: &Graph, n: usize, timeout: Duration) -> Vec<(u64, String, u32)> {
    let start = Instant::now();
    loop {
        let logs: Vec<Value> = g
            .logs()
            .iter()
            .filter_map(|l| serde_json::from_str(unprefixed(l)).ok())
            .collect();
        let mut ready: Vec<(u64, String, u32)> = Vec::new();
        for v in &logs {
            if v["message"] == "Engine server ready" {
                let replica = v["replica"].as_u64().unwrap();
                let url = v["url"].as_str().unwrap().to_owned();
                // The latest start of this replica.
                let pid = logs
                    .iter()
                    .rev()
                    .filter(|s| {
                        s["message"] == "Started an engine server" && s["replica"] == replica
                    })
                    .find_map(|s| s["pid"].as_u64())
                    .unwrap_or(0) as u32;
                ready.retain(|(r, _, _)| *r != replica);
                ready.push((replica, url, pid));
            }
        }
        if ready.len() >= n {
            ready.sort();
            return ready;
        }
        assert!(
            start.elapsed() < timeout,
            "engine servers not ready after {timeout:?}; logs:\n{}",
            g.logs().join("\n")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

async fn get_text(url: &str) -> String {
    reqwest::get(url).await.unwrap().text().await.unwrap()
}

async fn post(url: &str, body: &Value) -> Value {
    let r = reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{url}: {}", r.status());
    r.json().await.unwrap()
}

/// A streamed completion's text and finish reason, or the error that ended it.
async fn stream_text(url: &str, body: &Value) -> Result<(String, String), String> {
    let r = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !r.status().is_success() {
        return Err(format!(
            "{}: {}",
            r.status(),
            r.text().await.unwrap_or_default()
        ));
    }
    let text = r.text().await.map_err(|e| e.to_string())?;
    let mut out = String::new();
    let mut finish = String::new();
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            return Ok((out, finish));
        }
        let v: Value = serde_json::from_str(data).map_err(|e| format!("{e}: {data}"))?;
        if v.get("error").is_some() {
            return Err(v.to_string());
        }
        out.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            finish = f.to_owned();
        }
    }
    Err(format!("stream ended without [DONE]: {out:?}"))
}

/// Open a long streamed completion, read a few chunks, and hang up.
async fn hang_up_after_a_few_tokens(url: &str) {
    let r = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&json!({"model": "smollm2", "prompt": "Count from one to a thousand:", "max_tokens": 1500,
                      "ignore_eos": true, "temperature": 0, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    let mut chunks = 0;
    while chunks < 5 {
        body.next().await.unwrap().unwrap();
        chunks += 1;
    }
    drop(body);
}

/// Poll `metric` (summed) on every server until it is 0.
async fn until_idle(servers: &[(u64, String, u32)], metric: &str) {
    let start = Instant::now();
    loop {
        let mut busy = 0.0;
        for (_, url, _) in servers {
            busy += dyn_tests::metric_sum(&get_text(&format!("{url}/metrics")).await, metric, &[]);
        }
        if busy == 0.0 {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{metric} still {busy} 20 s after the client hung up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Long greedy streams, `n` at once: their texts, or the errors that ended them.
async fn streams(url: &str, n: usize, max_tokens: u32) -> Vec<Result<(String, String), String>> {
    let all = (0..n).map(|i| {
        let body = json!({"model": "smollm2", "prompt": format!("Story {i}: once upon a time"),
                          "max_tokens": max_tokens, "ignore_eos": true, "temperature": 0, "stream": true});
        async move { stream_text(url, &body).await }
    });
    futures::future::join_all(all).await
}

/// Kill the process group of a server that is busy (by `running`), while `n` streams run; every
/// stream must finish with the text it has without the kill.
async fn kill_one_mid_stream(
    g: &Graph,
    servers: &[(u64, String, u32)],
    running: &str,
    max_tokens: u32,
) {
    signal_one_mid_stream(g, servers, running, max_tokens, Signal::SIGKILL).await;
}

/// Send `signal` to the process group of a server that is busy (by `running`) while `n`
/// streams run; every stream must finish with the text it has without it. The time from the
/// signal until the last stream finished.
async fn signal_one_mid_stream(
    g: &Graph,
    servers: &[(u64, String, u32)],
    running: &str,
    max_tokens: u32,
    signal: Signal,
) -> Duration {
    let url = g.url("");
    let n = 2;
    let want = streams(&url, n, max_tokens).await;
    for w in &want {
        assert!(w.is_ok(), "{w:?}");
    }
    let killer = async {
        let start = Instant::now();
        loop {
            for (_, surl, pid) in servers {
                let m = get_text(&format!("{surl}/metrics")).await;
                if dyn_tests::metric_sum(&m, running, &[]) > 0.0 {
                    // Let it stream a little first.
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    // The server's whole process group (dyn runs it under `sh`). Not with
                    // procps' `kill -KILL -PID`, which takes `-PID` for something else.
                    assert!(*pid > 1, "no pid for {surl}");
                    let group = nix::unistd::Pid::from_raw(i32::try_from(*pid).unwrap());
                    nix::sys::signal::killpg(group, signal).unwrap();
                    return Instant::now();
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "no server got busy"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let (got, signalled) = tokio::join!(streams(&url, n, max_tokens), killer);
    let after = signalled.elapsed();
    assert_eq!(
        got, want,
        "streams after the kill differ from the same streams without it"
    );
    let migrated = g
        .logs()
        .iter()
        .filter(|l| l.contains("Replica lost; migrating the request"))
        .count();
    assert!(migrated >= 1, "no request migrated");
    after
}

// --- llama.cpp -------------------------------------------------------------------------------

/// A JSON object `{city, unit}` as the tool's arguments and the structured output below.
fn weather_schema() -> Value {
    json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": false})
}

/// `v` is a `{city, unit}` object as [`weather_schema`] wants.
fn is_weather(v: &Value) -> bool {
    v.as_object().is_some_and(|o| o.len() == 2)
        && v["city"].as_str().is_some_and(|c| c.chars().count() <= 24)
        && matches!(v["unit"].as_str(), Some("celsius" | "fahrenheit"))
}

/// Structured output through an external worker: a `json_schema` answer, unary and streamed,
/// that parses and fits its schema; the server's own dialect carries it (vLLM's
/// `structured_outputs`, llama.cpp's `json_schema`).
async fn structured_output_passes_through(url: &str) {
    let ask = json!({"model": "smollm2", "max_tokens": 96, "temperature": 0,
        "messages": [{"role": "user", "content": "The weather in Paris, as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": weather_schema()}}});
    let v = post(&format!("{url}/v1/chat/completions"), &ask).await;
    let content = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default();
    let parsed: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {v}"));
    assert!(is_weather(&parsed), "{v}");
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let (events, _) = dyn_tests::sse_events(&format!("{url}/v1/chat/completions"), &streamed).await;
    let joined: String = events
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(joined, content, "greedy: streamed as unary");
}

/// A call forced through an external worker (`tool_choice` naming the function): the server
/// gets the call's grammar in its own dialect (vLLM: Lark; llama.cpp: GBNF), dyn parses the
/// call out of the answer. Its arguments.
async fn forced_call(url: &str, name: &str, parameters: Value) -> Value {
    let tools = json!([{"type": "function", "function": {"name": name,
        "description": "The weather in a city", "parameters": parameters}}]);
    let forced = json!({"model": "smollm2", "max_tokens": 128, "temperature": 0, "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": name}},
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}]});
    let v = post(&format!("{url}/v1/chat/completions"), &forced).await;
    let call = &v["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], name, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    serde_json::from_str(call["arguments"].as_str().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}: {v}"))
}

/// Parameters that use what dyn's GBNF for llama.cpp writes by itself (optional keys in any
/// subset, bounded arrays, non-negative numbers, alternatives, a nested object), and whether
/// `v` fits them.
fn forecast_schema() -> (Value, fn(&Value) -> bool) {
    let schema = json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "days": {"type": "integer", "minimum": 1},
        "hours": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 3},
        "unit": {"anyOf": [{"enum": ["celsius", "fahrenheit"]}, {"type": "null"}]},
        "at": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}},
        "required": ["city"], "additionalProperties": false});
    fn fits(v: &Value) -> bool {
        let Some(o) = v.as_object() else { return false };
        o.keys()
            .all(|k| ["city", "days", "hours", "unit", "at"].contains(&k.as_str()))
            && v["city"].as_str().is_some_and(|c| c.chars().count() <= 24)
            && o.get("days")
                .is_none_or(|d| d.as_u64().is_some_and(|d| d >= 1))
            && o.get("hours").is_none_or(|h| {
                h.as_array()
                    .is_some_and(|h| h.len() <= 3 && h.iter().all(|x| x.as_u64().is_some()))
            })
            && o.get("unit")
                .is_none_or(|u| u.is_null() || matches!(u.as_str(), Some("celsius" | "fahrenheit")))
            && o.get("at").is_none_or(|a| a["lat"].is_number())
    }
    (schema, fits)
}

fn llamacpp_graph(extra: &[&str]) -> Option<(Graph, String)> {
    let (Some(server), Some(model)) = (env_path("DYN_LLAMA_SERVER"), env_path("DYN_SMOLLM2_GGUF"))
    else {
        dyn_tests::skip(
            "DYN_LLAMA_SERVER or DYN_SMOLLM2_GGUF is not set (scripts/engines llamacpp builds llama-server)",
        );
        return None;
    };
    let set_model = format!("model.path={model}");
    let mut args = vec!["--set", set_model.as_str()];
    args.extend_from_slice(extra);
    let g = Graph::start(
        "graphs/llamacpp.yaml",
        "http",
        &args,
        &[("DYN_LLAMA_SERVER", server.as_str())],
    );
    Some((g, server))
}

#[tokio::test(flavor = "multi_thread")]
async fn llamacpp_serves_token_ids_as_its_own_server_answers_them() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some((g, _)) = llamacpp_graph(&[]) else {
        return;
    };
    let servers = servers(&g, 2, Duration::from_secs(60));
    let url = g.url("");
    // Greedy through dyn equals llama.cpp's own answer to the same token ids.
    let prompt = "The capital of France is";
    let direct = &servers[0].1;
    let ids = post(
        &format!("{direct}/tokenize"),
        &json!({"content": prompt, "add_special": false}),
    )
    .await["tokens"]
        .clone();
    let own = post(
        &format!("{direct}/completion"),
        &json!({"prompt": ids, "n_predict": 24, "temperature": 0, "return_tokens": true}),
    )
    .await;
    let own_text = post(
        &format!("{direct}/detokenize"),
        &json!({"tokens": own["tokens"]}),
    )
    .await["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let body = json!({"model": "smollm2", "prompt": prompt, "max_tokens": 24, "temperature": 0});
    let (status, v) = completion(&url, &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], own_text.as_str(), "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 24, "{v}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    assert_eq!(
        stream_text(&url, &streamed).await,
        Ok((own_text.clone(), "length".into()))
    );
    // Log-probabilities come from llama.cpp: its own for the same token ids.
    let own = post(
        &format!("{direct}/completion"),
        &json!({"prompt": ids, "n_predict": 4, "temperature": 0, "n_probs": 2}),
    )
    .await;
    let own_lps: Vec<f64> = own["completion_probabilities"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["logprob"].as_f64().unwrap())
        .collect();
    let body = json!({"model": "smollm2", "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2});
    let (status, v) = completion(&url, &body).await;
    assert_eq!(status, 200, "{v}");
    let lps = v["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap();
    assert_eq!(lps.len(), own_lps.len(), "{v} vs {own}");
    for (a, b) in lps.iter().zip(&own_lps) {
        assert!((a.as_f64().unwrap() - b).abs() < 1e-4, "{v} vs {own}");
    }
    assert_eq!(
        v["choices"][0]["logprobs"]["top_logprobs"][0]
            .as_object()
            .unwrap()
            .len(),
        2,
        "{v}"
    );
    // Chat, unary and streamed: the same shape as dyn's own engines give; the answer ends at the
    // model's end-of-turn token.
    let chat = json!({"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}],
                      "max_tokens": 60, "temperature": 0});
    let v = post(&g.url("/v1/chat/completions"), &chat).await;
    assert!(
        !v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .trim()
            .is_empty(),
        "{v}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let short = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(short < 30, "{v}");
    let mut chat_stream = chat.clone();
    chat_stream["stream"] = json!(true);
    let text = reqwest::Client::new()
        .post(g.url("/v1/chat/completions"))
        .json(&chat_stream)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    // min_tokens holds the end-of-turn token off (llama.cpp has no such parameter: dyn runs
    // that many tokens with eos ignored first, then the rest).
    let mut held = chat.clone();
    held["min_tokens"] = json!(30);
    let v = post(&g.url("/v1/chat/completions"), &held).await;
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap() >= 30,
        "{v}"
    );

    structured_output_passes_through(&url).await;
    // Forced calls: llama.cpp gets them in GBNF.
    let args = forced_call(&url, "get_weather", weather_schema()).await;
    assert!(is_weather(&args), "{args}");
    let (schema, fits) = forecast_schema();
    let args = forced_call(&url, "get_forecast", schema).await;
    assert!(fits(&args), "{args}");
    // A grammar llama.cpp has no dialect for (a regex; a call whose parameters use what dyn's
    // GBNF does not say) is a 400 naming the field, not an unconstrained answer.
    let regex = json!({"model": "smollm2", "prompt": "x", "max_tokens": 4,
                       "structured_outputs": {"regex": "[a-z]+"}});
    let (status, v) = completion(&url, &regex).await;
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("response_format")),
        "{v}"
    );
    let patterned =
        json!({"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z]"}}});
    let ask = json!({"model": "smollm2", "max_tokens": 16,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": patterned}}],
        "tool_choice": "required", "messages": [{"role": "user", "content": "Paris?"}]});
    let (status, v) = dyn_tests::post_json(&g.url("/v1/chat/completions"), &ask).await;
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("tool_choice")),
        "{v}"
    );
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("\"pattern\""), "{v}");

    // A client hang-up frees the request in the server.
    hang_up_after_a_few_tokens(&url).await;
    until_idle(&servers, "llamacpp:requests_processing").await;

    // The servers' load reaches the router (`dyn inspect workers`).
    let w = inspect_json(&url, &["workers"]);
    let workers = w["replicas"][0]["workers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(workers.len(), 2, "{w}");
    assert!(
        workers.iter().all(|w| w["requests_running"].is_number()),
        "{w}"
    );
}

/// A GGUF LoRA file in the graph (models/smollm2-lora/qv.gguf: peft's adapter, converted by
/// llama.cpp's own convert_lora_to_gguf.py in scripts/make-lora-fixtures) on a llama.cpp
/// worker: dyn starts the server with it, and dyn's greedy answers with the adapter and
/// without it equal the server's own for the same token ids with the adapter applied and
/// not. Adapters the server was not started with are refused by name.
#[tokio::test(flavor = "multi_thread")]
async fn llamacpp_applies_the_graph_s_gguf_adapters_as_its_server_does() {
    let _one = ONE_AT_A_TIME.lock().await;
    let models = dyn_tests::root().join("models/smollm2-lora");
    let set = format!("model.loras.qv={}", models.join("qv.gguf").display());
    let Some((g, _)) = llamacpp_graph(&["--set", &set, "--set", "decode.replicas=1"]) else {
        return;
    };
    let servers = servers(&g, 1, Duration::from_secs(60));
    let direct = &servers[0].1;
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(models.join("reference.json")).unwrap())
            .unwrap();
    let case = &reference["cases"][0];
    let ask = |model: &str| {
        json!({"model": model, "prompt": case["prompt"], "max_tokens": 16, "temperature": 0,
               "ignore_eos": true, "return_token_ids": true})
    };
    let ours = |model: &'static str| {
        let (url, body) = (g.url(""), ask(model));
        async move {
            let (status, v) = completion(&url, &body).await;
            assert_eq!(status, 200, "{v}");
            v["choices"][0]["token_ids"].clone()
        }
    };
    let own = |scale: f64| {
        let body = json!({"prompt": case["prompt"], "n_predict": 16, "temperature": 0,
                          "ignore_eos": true, "return_tokens": true,
                          "lora": [{"id": 0, "scale": scale}]});
        let url = format!("{direct}/completion");
        async move { post(&url, &body).await["tokens"].clone() }
    };
    let (with, without) = (ours("qv").await, ours("smollm2").await);
    assert_eq!(
        with,
        own(1.0).await,
        "the adapter, as the server applies it"
    );
    assert_eq!(without, own(0.0).await, "the model alone");
    assert_ne!(with, without, "the adapter changes the answer");
    let peft = case["greedy"].as_array().unwrap();
    let same = with
        .as_array()
        .unwrap()
        .iter()
        .zip(peft)
        .take_while(|(a, b)| a == b)
        .count();
    println!(
        "llama.cpp, Q4_1 + qv.gguf: {same} of {} greedy tokens as transformers + peft (f32) before the first divergence",
        peft.len()
    );

    // llama-server's prompt cache across slots keys KV by tokens alone: without the
    // `--cache-ram 0` dyn adds, a prompt computed under the adapter and pushed out of its slot
    // was restored for the model's own request of it (seen by hand: a different answer).
    let long: Vec<u32> = (0..3)
        .flat_map(|_| {
            [
                504, 3575, 282, 4649, 314, 253, 1345, 28, 354, 4108, 282, 7042, 30, 198,
            ]
        })
        .collect();
    let greedy = |model: &'static str, prompt: Vec<u32>| {
        let url = g.url("");
        async move {
            let body = json!({"model": model, "prompt": prompt, "max_tokens": 12,
                              "temperature": 0, "return_token_ids": true});
            let (status, v) = completion(&url, &body).await;
            assert_eq!(status, 200, "{v}");
            v["choices"][0]["token_ids"].clone()
        }
    };
    let before = greedy("smollm2", long.clone()).await;
    greedy("qv", long.clone()).await;
    for i in 0..6u32 {
        greedy("smollm2", (0..30).map(|k| 700 + i * 13 + k).collect()).await;
    }
    assert_eq!(
        greedy("smollm2", long).await,
        before,
        "the adapter's KV was reused"
    );

    // Adapters the server lacks, loaded through dyn at run time: a PEFT directory, and a GGUF
    // file it was not started with.
    let late = dyn_tests::scratch_dir("llamacpp-lora").join("late.gguf");
    std::fs::copy(models.join("qv.gguf"), &late).unwrap();
    for (name, path, says) in [
        ("peft", models.join("qv"), "GGUF LoRA files"),
        ("late", late, "not started"),
    ] {
        let body = json!({"lora_name": name, "lora_path": path.display().to_string()});
        let r = reqwest::Client::new()
            .post(g.url("/v1/load_lora_adapter"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
        let (status, v) = completion(&g.url(""), &ask(name)).await;
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert_eq!(
            (status, v["error"]["param"].as_str()),
            (400, Some("model")),
            "{v}"
        );
        assert!(message.contains(says) && message.contains(name), "{v}");
    }
    // Embeddings would get the adapters applied (llama-server takes none per request there).
    let (status, v) = dyn_tests::post_json(
        &g.url("/v1/embeddings"),
        &json!({"model": "smollm2", "input": "Hello"}),
    )
    .await;
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert_eq!(status, 400, "{v}");
    assert!(message.contains("without adapters"), "{v}");
}

#[tokio::test(flavor = "multi_thread")]
async fn llamacpp_server_killed_mid_stream_streams_finish_on_the_other() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some((g, _)) = llamacpp_graph(&[]) else {
        return;
    };
    let servers = servers(&g, 2, Duration::from_secs(60));
    kill_one_mid_stream(&g, &servers, "llamacpp:requests_processing", 160).await;
    // The killed server is started again and the replica comes back.
    let again = servers_restarted(&g, Duration::from_secs(60));
    assert!(again, "the killed server was not restarted");
}

/// A server that still holds its connections but sends nothing (frozen with SIGSTOP; health
/// checks far apart, so only the stall timeout can tell): its streams fail at the stall bound
/// and finish on the other server.
#[tokio::test(flavor = "multi_thread")]
async fn llamacpp_server_frozen_mid_stream_streams_finish_on_the_other_at_the_stall_bound() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some((g, _)) = llamacpp_graph(&[
        "--set",
        "decode.llamacpp.stall_timeout_s=3",
        "--set",
        "decode.llamacpp.health_interval_s=3600",
    ]) else {
        return;
    };
    let servers = servers(&g, 2, Duration::from_secs(60));
    let after = signal_one_mid_stream(
        &g,
        &servers,
        "llamacpp:requests_processing",
        160,
        Signal::SIGSTOP,
    )
    .await;
    eprintln!("streams finished {after:?} after the freeze (stall bound 3 s)");
    let stalled = g
        .logs()
        .iter()
        .any(|l| l.contains("sent nothing for 3s mid-stream"));
    assert!(stalled, "no stream failed at the stall bound");
    // The frozen server fails the health check the stall asked for and is started again.
    assert!(
        servers_restarted(&g, Duration::from_secs(60)),
        "the frozen server was not restarted"
    );
}

fn servers_restarted(g: &Graph, timeout: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        let ready = g
            .logs()
            .iter()
            .filter(|l| l.contains("Engine server ready"))
            .count();
        if ready >= 3 {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    false
}

/// A graph of one llama.cpp replica with its own `decode` section, in a scratch directory.
fn one_replica_graph(name: &str, model: &str, section: &str) -> String {
    graph_with_engine(name, model, "llamacpp", section)
}

/// A graph of one replica of `engine` with its own section, in a scratch directory.
fn graph_with_engine(name: &str, model: &str, engine: &str, section: &str) -> String {
    let dir = scratch_dir(name);
    let path = dir.join("graph.yaml");
    std::fs::write(
        &path,
        format!(
            "name: {name}\nmodel: {{name: smollm2, path: {model}}}\nnodes:\n  http: {{kind: http, config: {{listen: 127.0.0.1:0}}}}\n  \
             preprocess: {{kind: preprocess, inputs: [http]}}\n  \
             decode: {{kind: decode, inputs: [preprocess], config: {{engine: {engine}, {engine}: {section}}}}}\n  \
             postprocess: {{kind: postprocess, inputs: [decode]}}\n"
        ),
    )
    .unwrap();
    path.display().to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn an_openai_server_gets_text_and_answers_as_it_does_directly() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (Some(server), Some(model)) = (env_path("DYN_LLAMA_SERVER"), env_path("DYN_SMOLLM2_GGUF"))
    else {
        dyn_tests::skip("DYN_LLAMA_SERVER or DYN_SMOLLM2_GGUF is not set");
        return;
    };
    // llama.cpp's own OpenAI endpoints stand for any OpenAI-compatible server.
    let path = graph_with_engine(
        "openai",
        &model,
        "openai",
        &format!("{{launch: '{server} -m {model} --host {{host}} --port {{port}} -c 2048 -t 1'}}"),
    );
    let g = Graph::start(&path, "http", &[], &[]);
    let servers = servers(&g, 1, Duration::from_secs(60));
    let body = json!({"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0});
    let own = post(&format!("{}/v1/completions", servers[0].1), &body).await;
    let (status, v) = completion(&g.url(""), &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["choices"][0]["text"], own["choices"][0]["text"],
        "{v} {own}"
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (text, finish) = stream_text(&g.url(""), &streamed).await.unwrap();
    assert_eq!(
        (text.as_str(), finish.as_str()),
        (own["choices"][0]["text"].as_str().unwrap(), "length")
    );
}

/// Embeddings through a llama.cpp worker started with `--embeddings`: dyn's answer is the
/// server's own vector for the same token ids, and points the way the native engine's does on
/// the same GGUF (their quantized kernels differ).
#[tokio::test(flavor = "multi_thread")]
async fn llamacpp_embeddings_are_its_servers_own() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (Some(server), Some(model)) = (env_path("DYN_LLAMA_SERVER"), env_path("DYN_SMOLLM2_GGUF"))
    else {
        dyn_tests::skip("DYN_LLAMA_SERVER or DYN_SMOLLM2_GGUF is not set");
        return;
    };
    let path = one_replica_graph(
        "llamacpp-embed",
        &model,
        &format!(
            "{{launch: '{server} -m {model} --host {{host}} --port {{port}} --metrics -c 2048 -t 1 --embeddings --pooling last'}}"
        ),
    );
    let g = Graph::start(&path, "http", &[], &[]);
    let servers = servers(&g, 1, Duration::from_secs(60));
    let text = "The capital of France is Paris.";
    let (status, v) = dyn_tests::post_json(
        &g.url("/v1/embeddings"),
        &json!({"model": "smollm2", "input": text}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let got: Vec<f64> = serde_json::from_value(v["data"][0]["embedding"].clone()).unwrap();
    let (_, tok) = dyn_tests::post_json(&g.url("/tokenize"), &json!({"prompt": text})).await;
    let own = post(
        &format!("{}/v1/embeddings", servers[0].1),
        &json!({"model": "smollm2", "input": tok["tokens"]}),
    )
    .await;
    let own: Vec<f64> = serde_json::from_value(own["data"][0]["embedding"].clone()).unwrap();
    let norm = own.iter().map(|x| x * x).sum::<f64>().sqrt();
    let diff = got
        .iter()
        .zip(&own)
        .map(|(a, b)| (a - b / norm).abs())
        .fold(0.0, f64::max);
    assert!(diff < 1e-6, "{diff}");
    drop(g);
    // The native engine on the same GGUF.
    let n = native_embeddings(&model, json!(text)).await;
    let n: Vec<f64> = serde_json::from_value(n["data"][0]["embedding"].clone()).unwrap();
    let cos: f64 = got.iter().zip(&n).map(|(a, b)| a * b).sum();
    println!("llama.cpp vs native on the Q4_1 GGUF: cosine {cos:.5}");
    assert!(cos > 0.99, "{cos}");
}

/// Embeddings through a vLLM worker whose server runs vLLM's pooling runner (`--runner pooling
/// --convert embed`, last-token pooling for this decoder model): dyn's answer is the server's
/// own vector for the same token ids, and the native engine's on the same f32 weights.
#[tokio::test(flavor = "multi_thread")]
async fn vllm_embeddings_are_its_servers_own_and_the_native_engine_s() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (Some(python), Some(hf)) = (env_path("DYN_VLLM_PYTHON"), env_path("DYN_SMOLLM2_HF")) else {
        dyn_tests::skip("DYN_VLLM_PYTHON or DYN_SMOLLM2_HF is not set");
        return;
    };
    let path = graph_with_engine(
        "vllm-embed",
        &hf,
        "vllm",
        &format!(
            "{{launch: '{python} -m vllm.entrypoints.openai.api_server --model {{model}} \
             --served-model-name {{model_name}} --host {{host}} --port {{port}} --dtype float32 \
             --max-model-len 2048 --runner pooling --convert embed', env: {{VLLM_CPU_KVCACHE_SPACE: \"1\"}}}}"
        ),
    );
    let g = Graph::start(&path, "http", &[], &[]);
    let servers = servers(&g, 1, Duration::from_secs(600));
    let texts = [
        "The capital of France is Paris.",
        "Embeddings point the way.",
    ];
    let (status, v) = dyn_tests::post_json(
        &g.url("/v1/embeddings"),
        &json!({"model": "smollm2", "input": texts}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let vector = |v: &Value, i: usize| -> Vec<f64> {
        serde_json::from_value(v["data"][i]["embedding"].clone()).unwrap()
    };
    let largest = |a: &[f64], b: &[f64]| {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    };
    let mut got = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        let ours = vector(&v, i);
        let (_, tok) = dyn_tests::post_json(&g.url("/tokenize"), &json!({"prompt": text})).await;
        let own = post(
            &format!("{}/v1/embeddings", servers[0].1),
            &json!({"model": "smollm2", "input": tok["tokens"]}),
        )
        .await;
        let d = largest(&ours, &vector(&own, 0));
        assert!(d < 1e-6, "input {i}: {d}");
        got.push(ours);
    }
    drop(g);
    // The native engine on the same HF directory (f32).
    let n = native_embeddings(&hf, json!(texts)).await;
    for (i, ours) in got.iter().enumerate() {
        let d = largest(ours, &vector(&n, i));
        println!("vLLM vs native on the f32 weights, input {i}: largest difference {d:.2e}");
        assert!(d < 1e-4, "input {i}: {d}");
    }
}

/// The native engine's embeddings of `input` with the model at `path` (graphs/chat.yaml).
async fn native_embeddings(path: &str, input: Value) -> Value {
    let native = Graph::up_with_ingress(
        "graphs/chat.yaml",
        "http",
        &["--set", &format!("model.path={path}")],
    );
    let (status, v) = dyn_tests::post_json(
        &native.url("/v1/embeddings"),
        &json!({"model": "smollm2", "input": input}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    v
}

/// Requests get 503 `no_worker_available` at once, several times over `for_s` seconds.
async fn refused_while_down(g: &Graph, for_s: u64) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(for_s) {
        let t = Instant::now();
        let (status, v) = completion(
            &g.url(""),
            &json!({"model": "smollm2", "prompt": "hi", "max_tokens": 2}),
        )
        .await;
        assert_eq!(status, 503, "{v}");
        assert_eq!(v["error"]["code"], "no_worker_available", "{v}");
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "a refusal took {:?}",
            t.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// A one-replica llama.cpp graph with `section`, up, and refusing requests for `for_s` seconds.
async fn up_but_refusing(name: &str, model: &str, section: &str, for_s: u64) -> Graph {
    let g = Graph::start(&one_replica_graph(name, model, section), "http", &[], &[]);
    refused_while_down(&g, for_s).await;
    g
}

fn wait_log(g: &Graph, needle: &str, timeout: Duration) -> String {
    let start = Instant::now();
    loop {
        if let Some(l) = g.logs().into_iter().find(|l| l.contains(needle)) {
            return l;
        }
        assert!(
            start.elapsed() < timeout,
            "no log line with {needle:?}; logs:\n{}",
            g.logs().join("\n")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_engine_configurations_fail_clearly_and_never_hang() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some(model) = env_path("DYN_SMOLLM2_GGUF") else {
        dyn_tests::skip("DYN_SMOLLM2_GGUF is not set");
        return;
    };
    // Validation: positions and reasons.
    let bad = one_replica_graph("bad-section", &model, "{url: 'ftp://x', launch: 'serve'}");
    let out = dyn_tests::run(&["graph", "validate", &bad]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("give only one of `url`, `urls` and `launch`"),
        "{err}"
    );
    assert!(err.contains("graph.yaml:6:"), "{err}");

    // Nothing listens at the URL: the graph is up, requests are refused at once.
    let port = dyn_tests::servers::free_port();
    let section = format!("{{url: 'http://127.0.0.1:{port}', health_interval_s: 0.2}}");
    let g = up_but_refusing("unreachable", &model, &section, 2).await;
    let line = wait_log(
        &g,
        "Engine server not answering its health check",
        Duration::from_secs(30),
    );
    assert!(line.contains(&format!("127.0.0.1:{port}")), "{line}");
    drop(g);

    // A server that never becomes healthy is restarted after its startup timeout.
    let section = "{launch: 'sleep 600 # {port}', startup_timeout_s: 1}";
    let g = up_but_refusing("never-healthy", &model, section, 2).await;
    wait_log(
        &g,
        "not healthy 1s after its start",
        Duration::from_secs(20),
    );
    drop(g);

    // A server that exits at once: its last lines are in the log, and it is restarted.
    let section = "{launch: 'echo no such model >&2; exit 3 # {port}'}";
    let g = up_but_refusing("exits", &model, section, 1).await;
    let line = wait_log(&g, "the launched server exited", Duration::from_secs(20));
    assert!(
        line.contains("exit status: 3") && line.contains("no such model"),
        "{line}"
    );
    drop(g);

    // The wrong model: a server whose tokenizer is not the graph's is never used.
    let Some(server) = env_path("DYN_LLAMA_SERVER") else {
        dyn_tests::skip("DYN_LLAMA_SERVER is not set");
        return;
    };
    let tiny = dyn_tests::root().join("models/tiny").display().to_string();
    let wrong = one_replica_graph(
        "wrong-model",
        &tiny,
        &format!("{{launch: '{server} -m {model} --host {{host}} --port {{port}} -c 512 -t 1'}}"),
    );
    let g = Graph::start(&wrong, "http", &[], &[]);
    let line = wait_log(&g, "it serves another model", Duration::from_secs(60));
    assert!(line.contains("tokenizer splits"), "{line}");
    refused_while_down(&g, 1).await;
}

// --- vLLM ------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn vllm_workers_serve_token_ids_follow_kv_events_cancel_and_migrate() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (Some(python), Some(hf)) = (env_path("DYN_VLLM_PYTHON"), env_path("DYN_SMOLLM2_HF")) else {
        dyn_tests::skip(
            "DYN_VLLM_PYTHON or DYN_SMOLLM2_HF is not set (scripts/engines vllm sets up vLLM CPU)",
        );
        return;
    };
    let set_model = format!("model.path={hf}");
    let g = Graph::start(
        "graphs/vllm.yaml",
        "http",
        // The servers serve adapters dyn loads into them (vLLM's --enable-lora).
        &["--set", &set_model, "--set", "decode.vllm.lora={}"],
        &[("DYN_VLLM_PYTHON", python.as_str())],
    );
    // Two vLLM servers compile their models at once on two cores: minutes.
    let servers = servers(&g, 2, Duration::from_secs(600));
    let url = g.url("");

    // Greedy through dyn equals vLLM's own answer to the same token ids.
    let direct = &servers[0].1;
    let prompt = "The capital of France is";
    let ids = post(
        &format!("{direct}/tokenize"),
        &json!({"model": "smollm2", "prompt": prompt}),
    )
    .await["tokens"]
        .clone();
    let own = post(
        &format!("{direct}/v1/completions"),
        &json!({"model": "smollm2", "prompt": ids, "max_tokens": 24, "temperature": 0}),
    )
    .await;
    let own_text = own["choices"][0]["text"].as_str().unwrap().to_owned();
    let body = json!({"model": "smollm2", "prompt": prompt, "max_tokens": 24, "temperature": 0});
    let (status, v) = completion(&url, &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], own_text.as_str(), "{v}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (text, _) = stream_text(&url, &streamed).await.unwrap();
    assert_eq!(text, own_text);
    let chat = json!({"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                      "max_tokens": 32, "temperature": 0});
    let v = post(&g.url("/v1/chat/completions"), &chat).await;
    assert!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .contains("Paris"),
        "{v}"
    );

    structured_output_passes_through(&url).await;
    // A forced tool call: vLLM gets the call's Lark grammar, dyn parses the call.
    let args = forced_call(&url, "get_weather", weather_schema()).await;
    assert!(is_weather(&args), "{args}");

    // Log-probabilities come from vLLM: the same as its own answer's to the same token ids.
    let own = post(
        &format!("{direct}/v1/completions"),
        &json!({"model": "smollm2", "prompt": ids, "max_tokens": 6, "temperature": 0,
                "logprobs": 2}),
    )
    .await;
    let own_lps = &own["choices"][0]["logprobs"];
    let v = post(
        &format!("{url}/v1/completions"),
        &json!({"model": "smollm2", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2}),
    )
    .await;
    let lps = &v["choices"][0]["logprobs"];
    assert_eq!(lps["tokens"], own_lps["tokens"], "{v} vs {own}");
    for (a, b) in lps["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .zip(own_lps["token_logprobs"].as_array().unwrap())
    {
        assert!(
            (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-4,
            "{v} vs {own}"
        );
    }
    assert_eq!(lps["top_logprobs"][0].as_object().unwrap().len(), 2, "{v}");
    let chat_lps = json!({"model": "smollm2", "max_tokens": 4, "temperature": 0, "logprobs": true,
        "top_logprobs": 3, "messages": [{"role": "user", "content": "Hi"}]});
    let v = post(&g.url("/v1/chat/completions"), &chat_lps).await;
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert!(!content.is_empty(), "{v}");
    for t in content {
        // Greedy: the token is the most likely one.
        assert_eq!(t["top_logprobs"].as_array().unwrap().len(), 3, "{v}");
        assert_eq!(t["token"], t["top_logprobs"][0]["token"], "{v}");
        assert!(t["logprob"].as_f64().unwrap() <= 0.0, "{v}");
    }

    // A repeated long prompt stays where vLLM's KV events say its prefix is cached.
    let long = "the quick brown fox jumps over the lazy dog ".repeat(60);
    let long_body = json!({"model": "smollm2", "prompt": long, "max_tokens": 2, "temperature": 0});
    let (status, _) = completion(&url, &long_body).await;
    assert_eq!(status, 200);
    let start = Instant::now();
    let holder = loop {
        let kv = inspect_json(&url, &["kv"]);
        let per_worker = kv["replicas"][0]["workers"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if let Some(w) = per_worker
            .iter()
            .find(|w| w["blocks"].as_u64().unwrap_or(0) >= 10)
        {
            break w["worker_id"].clone();
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no vLLM KV blocks in the index after 60 s: {kv}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let hits_before = hit_tokens(&servers).await;
    for _ in 0..4 {
        let (status, _) = completion(&url, &long_body).await;
        assert_eq!(status, 200);
    }
    let route = inspect_json(&url, &["route", "--prompt", &long]);
    assert_eq!(route["replicas"][0]["worker_id"], holder, "{route}");
    let hits_after = hit_tokens(&servers).await;
    // One server's prefix cache hit every repeat (vLLM's own counter).
    let gained: Vec<f64> = hits_after
        .iter()
        .zip(&hits_before)
        .map(|(a, b)| a - b)
        .collect();
    assert!(
        gained.iter().filter(|g| **g > 0.0).count() == 1,
        "hits per server: {gained:?}"
    );

    // dyn's /tokenize reads prompts and chats as vLLM's own does.
    for body in [
        json!({"model": "smollm2", "prompt": "The capital of France is"}),
        json!({"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}]}),
        json!({"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": false}),
    ] {
        let ours = post(&g.url("/tokenize"), &body).await;
        let theirs = post(&format!("{direct}/tokenize"), &body).await;
        assert_eq!(ours["tokens"], theirs["tokens"], "{body}");
        assert_eq!(ours["count"], theirs["count"], "{body}");
        let text = post(&g.url("/detokenize"), &json!({"tokens": ours["tokens"]})).await;
        let own = post(
            &format!("{direct}/detokenize"),
            &json!({"tokens": ours["tokens"]}),
        )
        .await;
        assert_eq!(text["prompt"], own["prompt"], "{body}");
    }

    // A LoRA adapter loaded through dyn is loaded into vLLM by dyn and answers as vLLM
    // answers with it directly.
    lora_through_dyn_is_vllms_own(&g, direct, &ids).await;

    // A client hang-up frees the request in vLLM.
    hang_up_after_a_few_tokens(&url).await;
    until_idle(&servers, "vllm:num_requests_running").await;

    // One server SIGKILLed mid-stream: every stream completes identically on the other.
    kill_one_mid_stream(&g, &servers, "vllm:num_requests_running", 160).await;
}

/// models/smollm2-lora/qv (peft's, made by scripts/make-lora-fixtures) loaded through dyn's
/// `/v1/load_lora_adapter`: dyn's greedy answer with it equals the answer vLLM gives to the same
/// token ids with the same adapter loaded directly, and differs from the base's.
async fn lora_through_dyn_is_vllms_own(g: &Graph, direct: &str, ids: &Value) {
    let path = dyn_tests::root()
        .join("models/smollm2-lora/qv")
        .display()
        .to_string();
    let load = |url: String, name: &'static str| {
        let body = json!({"lora_name": name, "lora_path": path});
        async move {
            let r = reqwest::Client::new()
                .post(&url)
                .json(&body)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    let (status, text) = load(g.url("/v1/load_lora_adapter"), "qv").await;
    assert_eq!(status, 200, "{text}");
    let ask = |model: &str, prompt: Value| {
        json!({"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
               "ignore_eos": true})
    };
    let v = post(
        &g.url("/v1/completions"),
        &ask("qv", json!("The capital of France is")),
    )
    .await;
    let through_dyn = v["choices"][0]["text"].as_str().unwrap().to_owned();
    assert_eq!(v["model"], "qv", "{v}");
    let (status, text) = load(format!("{direct}/v1/load_lora_adapter"), "direct-qv").await;
    assert_eq!(status, 200, "{text}");
    let own = post(
        &format!("{direct}/v1/completions"),
        &ask("direct-qv", ids.clone()),
    )
    .await;
    assert_eq!(
        through_dyn,
        own["choices"][0]["text"].as_str().unwrap(),
        "{own}"
    );
    let base = post(
        &format!("{direct}/v1/completions"),
        &ask("smollm2", ids.clone()),
    )
    .await;
    assert_ne!(through_dyn, base["choices"][0]["text"].as_str().unwrap());
}

async fn hit_tokens(servers: &[(u64, String, u32)]) -> Vec<f64> {
    let mut out = Vec::new();
    for (_, url, _) in servers {
        out.push(dyn_tests::metric_sum(
            &get_text(&format!("{url}/metrics")).await,
            "vllm:prefix_cache_hits_total",
            &[],
        ));
    }
    out
}
