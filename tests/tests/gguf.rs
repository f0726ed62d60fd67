//! The default graph (`graphs/chat.yaml`) on the real SmolLM2-135M-Instruct GGUF, through the
//! real `dyn` binary and HTTP: dequantized to f32, its greedy answers to chat and plain
//! prompts equal transformers' on the same file (models/smollm2-gguf-reference.json); kept
//! quantized (the default), it answers chat requests and streams. Needs the model, which
//! scripts/test fetches (`DYN_SMOLLM2_GGUF`); skipped visibly without it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use dyn_tests::{Graph, completion, root};
use serde_json::{Value, json};

fn model() -> Option<String> {
    let p = std::env::var("DYN_SMOLLM2_GGUF").ok()?;
    std::path::Path::new(&p).exists().then_some(p)
}

async fn chat(url: &str, messages: &Value, max_tokens: usize) -> Value {
    let r = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(
            &json!({"model": "smollm2", "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn smollm2_answers_as_transformers_does_through_the_whole_graph() {
    let Some(path) = model() else {
        dyn_tests::skip("DYN_SMOLLM2_GGUF is not set (scripts/test fetches the model)");
        return;
    };
    let text = std::fs::read_to_string(root().join("models/smollm2-gguf-reference.json")).unwrap();
    let r: Value = serde_json::from_str(&text).unwrap();
    let set_model = format!("model.path={path}");
    let g = Graph::up_with_ingress(
        "graphs/chat.yaml",
        "http",
        &["--set", &set_model, "--set", "decode.native.dtype=f32"],
    );
    let url = g.url("");
    for case in r["cases"].as_array().unwrap() {
        let n = case["greedy"].as_array().unwrap().len();
        let want = case["text"].as_str().unwrap();
        let got = if case["kind"] == "chat" {
            let v = chat(&url, &case["source"], n).await;
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_owned()
        } else {
            let body = json!({"model": "smollm2", "prompt": case["source"], "max_tokens": n,
                              "temperature": 0});
            let (status, v) = completion(&url, &body).await;
            assert_eq!(status, 200, "{v}");
            v["choices"][0]["text"].as_str().unwrap().to_owned()
        };
        assert_eq!(got, want, "{}", case["source"]);
    }
    drop(g);

    // The default: quantized weights. It answers, stops on its own end-of-turn token, and
    // the metadata's context length bounds requests.
    let g = Graph::up_with_ingress("graphs/chat.yaml", "http", &["--set", &set_model]);
    let url = g.url("");
    let v = chat(
        &url,
        &json!([{"role": "user", "content": "Name a colour of the rainbow."}]),
        48,
    )
    .await;
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!answer.trim().is_empty(), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let body = json!({"model": "smollm2", "prompt": "hi", "max_tokens": 9000});
    let (status, v) = completion(&url, &body).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
}
