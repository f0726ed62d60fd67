//! A harmony model (gpt-oss's format) served end to end by the real `dyn` binary: the tiny
//! model's tokenizer with harmony's special tokens and a gpt-oss-shaped template
//! (models/tiny-harmony, scripts/make-harmony-fixture), on the mocker, which samples inside the
//! grammar's masks. Forced tool calls and `response_format` become grammars over harmony's
//! channels; postprocess keeps the special tokens for the frontend's harmony parser; the
//! client gets reasoning, content and calls apart, and never a marker.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use dyn_tests::Graph;
use serde_json::{Value, json};

fn up() -> Graph {
    Graph::up_with_ingress(
        "graphs/agg.yaml",
        "http",
        &[
            "--set",
            "decode.mocker.speedup=100",
            "--set",
            "model.path=../models/tiny-harmony",
        ],
    )
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": "tiny", "max_tokens": 800,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}]});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"], "additionalProperties": false}}}])
}

async fn post(g: &Graph, body: Value) -> Value {
    let (status, v) = dyn_tests::post_json(&g.url("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{v}");
    v
}

/// A streamed answer put back together: reasoning, content, calls (name, arguments), finish,
/// token ids (with `return_token_ids`).
async fn stream(
    g: &Graph,
    mut body: Value,
) -> (String, String, Vec<(String, String)>, String, Vec<Value>) {
    body["stream"] = json!(true);
    let (events, _) = dyn_tests::sse_events(&g.url("/v1/chat/completions"), &body).await;
    let (mut reasoning, mut content, mut calls, mut finish, mut ids) = (
        String::new(),
        String::new(),
        Vec::new(),
        String::new(),
        Vec::new(),
    );
    for v in &events {
        let c = &v["choices"][0];
        let d = &c["delta"];
        ids.extend(c["token_ids"].as_array().into_iter().flatten().cloned());
        reasoning += d["reasoning_content"].as_str().unwrap_or("");
        content += d["content"].as_str().unwrap_or("");
        for t in d["tool_calls"].as_array().into_iter().flatten() {
            calls.push((
                t["function"]["name"].as_str().unwrap().to_owned(),
                t["function"]["arguments"].as_str().unwrap().to_owned(),
            ));
        }
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.to_owned();
        }
    }
    (reasoning, content, calls, finish, ids)
}

fn no_markup(s: &str) {
    assert!(
        !s.contains("<|"),
        "harmony markup reached the client: {s:?}"
    );
}

#[tokio::test]
async fn harmony_channels_become_reasoning_content_and_calls() {
    let g = up();
    let mut reasoned = 0;
    for seed in 0..6 {
        // A forced call: the grammar's call, parsed out of the channels.
        let forced = chat(json!({"seed": seed, "tools": tools(),
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}));
        let v = post(&g, forced.clone()).await;
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
        let call = &choice["message"]["tool_calls"][0]["function"];
        assert_eq!(call["name"], "get_weather");
        let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
        assert!(args["city"].is_string(), "{args}");
        let reasoning = choice["message"]["reasoning_content"]
            .as_str()
            .unwrap_or("");
        no_markup(reasoning);
        reasoned += usize::from(!reasoning.is_empty());
        // Streamed: the same answer (same seed), in pieces; with vLLM's return_token_ids,
        // the same ids.
        let mut with_ids = forced.clone();
        with_ids["return_token_ids"] = json!(true);
        let unary_ids = post(&g, with_ids.clone()).await["choices"][0]["token_ids"].clone();
        assert_eq!(
            unary_ids.as_array().map(Vec::len),
            v["usage"]["completion_tokens"].as_u64().map(|n| n as usize)
        );
        let (_, _, _, _, streamed_ids) = stream(&g, with_ids).await;
        assert_eq!(json!(streamed_ids), unary_ids);
        let (r, c, calls, finish, _) = stream(&g, forced).await;
        assert_eq!(finish, "tool_calls");
        assert_eq!(r, reasoning);
        no_markup(&c);
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].1, call["arguments"].as_str().unwrap());

        // A JSON schema: the final channel holds it.
        let schema = json!({"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
            "required": ["answer"], "additionalProperties": false});
        let v = post(
            &g,
            chat(
                json!({"seed": seed, "response_format": {"type": "json_schema",
            "json_schema": {"name": "a", "schema": schema, "strict": true}}}),
            ),
        )
        .await;
        let m = &v["choices"][0]["message"];
        let answer: Value = serde_json::from_str(m["content"].as_str().unwrap()).unwrap();
        assert!(answer["answer"] == "yes" || answer["answer"] == "no", "{v}");
        no_markup(m["reasoning_content"].as_str().unwrap_or(""));
    }
    // Some of the answers reasoned first (the grammar lets the model), and that reasoning came
    // out apart from the call.
    assert!(reasoned > 0, "no answer took the analysis channel");

    // No grammar: the mocker writes plain text, which is the answer as it stands.
    let v = post(&g, chat(json!({"max_tokens": 12}))).await;
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!content.is_empty());
    no_markup(content);

    // A turn with the call and its result renders through the template and is served.
    let turn = json!({"model": "tiny", "max_tokens": 8, "tools": tools(), "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"}]});
    let v = post(&g, turn).await;
    assert!(v["choices"][0]["message"].is_object(), "{v}");
}
