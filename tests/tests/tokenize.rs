//! vLLM's `/tokenize` and `/detokenize` through the real binary (`graphs/agg.yaml`, the tiny
//! model): a prompt and chat messages tokenize exactly as a real request's prompt is
//! (`return_token_ids`), with vLLM's shapes and options, and tokens come back as text; bad
//! bodies get OpenAI-style 4xx errors. (The same endpoints against vLLM's own answers:
//! `tests/tests/engines.rs`.)
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use dyn_tests::{Graph, completion, post_json};
use serde_json::{Value, json};

fn ids(v: &Value) -> Vec<u64> {
    serde_json::from_value(v.clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn tokenize_and_detokenize_read_prompts_as_requests_do() {
    let g = Graph::up_with_ingress("graphs/agg.yaml", "http", &[]);
    let tok = g.url("/tokenize");

    // A completion prompt: the tokens a completion of it is given.
    let (status, v) = post_json(&tok, &json!({"model": "tiny", "prompt": "Hello world"})).await;
    assert_eq!(status, 200, "{v}");
    let (_, done) = completion(
        &g.url(""),
        &json!({"model": "tiny", "prompt": "Hello world", "max_tokens": 1, "return_token_ids": true}),
    )
    .await;
    let want = ids(&done["choices"][0]["prompt_token_ids"]);
    assert_eq!(ids(&v["tokens"]), want, "{v}");
    assert_eq!(v["count"], want.len(), "{v}");
    assert_eq!(v["max_model_len"], 4096, "{v}");
    assert_eq!(v["token_strs"], Value::Null, "{v}");
    // Without special tokens, and with the vocabulary's strings.
    let (_, plain) = post_json(
        &tok,
        &json!({"prompt": "Hello world", "add_special_tokens": false, "return_token_strs": true}),
    )
    .await;
    let plain_ids = ids(&plain["tokens"]);
    assert!(
        want.ends_with(&plain_ids) && plain_ids.len() < want.len(),
        "{plain} vs {v}"
    );
    assert_eq!(
        plain["token_strs"].as_array().unwrap().len(),
        plain_ids.len()
    );

    // Chat messages: through the template, as a chat request's prompt.
    let messages =
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]);
    let (status, chat) = post_json(&tok, &json!({"model": "tiny", "messages": messages})).await;
    assert_eq!(status, 200, "{chat}");
    let r = reqwest::Client::new()
        .post(g.url("/v1/chat/completions"))
        .json(&json!({"model": "tiny", "messages": messages, "max_tokens": 1, "return_token_ids": true}))
        .send()
        .await
        .unwrap();
    let answer: Value = r.json().await.unwrap();
    assert_eq!(
        ids(&chat["tokens"]),
        ids(&answer["prompt_token_ids"]),
        "{answer}"
    );
    // Without the generation prompt: the same turns, without the assistant's opening.
    let (_, open) = post_json(
        &tok,
        &json!({"messages": messages, "add_generation_prompt": false}),
    )
    .await;
    let (with, without) = (ids(&chat["tokens"]), ids(&open["tokens"]));
    assert!(
        with.starts_with(&without) && without.len() < with.len(),
        "{open}"
    );

    // Back to text.
    let (status, text) = post_json(&g.url("/detokenize"), &json!({"tokens": plain_ids})).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(text["prompt"], "Hello world", "{text}");

    // Bad bodies.
    let (status, e) = post_json(&tok, &json!({"prompt": "x", "messages": messages})).await;
    assert_eq!(status, 400, "{e}");
    let (status, e) = post_json(&tok, &json!({"model": "other", "prompt": "x"})).await;
    assert_eq!(
        (status, &e["error"]["code"]),
        (404, &json!("model_not_found")),
        "{e}"
    );
    let (status, e) = post_json(&g.url("/detokenize"), &json!({"tokens": [1, 99999999]})).await;
    assert_eq!(
        (status, &e["error"]["param"]),
        (400, &json!("tokens")),
        "{e}"
    );
    let (status, e) = post_json(&tok, &json!({"prompt": "x", "chat_template": "{{x}}"})).await;
    assert_eq!(
        (status, &e["error"]["param"]),
        (400, &json!("chat_template")),
        "{e}"
    );
    let body = json!({"messages": messages, "chat_template_kwargs": {"enable_thinking": false}});
    let (status, e) = post_json(&tok, &body).await;
    assert_eq!(
        (status, &e["error"]["param"]),
        (400, &json!("chat_template_kwargs")),
        "{e}"
    );
}

/// vLLM's `GET /tokenizer_info`, as lm-evaluation-harness's remote tokenizer reads it: the
/// special tokens' text (each one token through `/tokenize` without special tokens added) and
/// the chat template the server applies.
#[tokio::test(flavor = "multi_thread")]
async fn tokenizer_info_gives_what_a_remote_tokenizer_needs() {
    let g = Graph::up_with_ingress("graphs/agg.yaml", "http", &[]);
    let info: Value = reqwest::get(g.url("/tokenizer_info"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(info.get("eos_token").is_some(), "{info}");
    let eos = info["eos_token"]
        .as_str()
        .expect("the tiny model has an eos token");
    let (status, v) = post_json(
        &g.url("/tokenize"),
        &json!({"prompt": eos, "add_special_tokens": false}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["tokens"].as_array().map(Vec::len), Some(1), "{v}");
    assert!(
        info["chat_template"]
            .as_str()
            .is_some_and(|t| t.contains("messages")),
        "{info}"
    );
    assert_eq!(info["model"], "tiny");
    // An unknown model is a 404, as on the other endpoints.
    let r = reqwest::get(g.url("/tokenizer_info?model=nope"))
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
}
