//! The official `openai` Python package talks to `dyn graph up graphs/agg.yaml`.
//!
//! The test command (`scripts/test`) installs the package into a venv from PyPI and points
//! `DYN_TEST_PYTHON` at its interpreter. Without it this test says so and skips.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use dyn_tests::{Graph, python_lines, root};
use serde_json::{Value, json};

/// The test venv's Python and `graphs/agg.yaml` up with a fast mocker; `None` (said as a
/// skip) without the venv.
fn python_and_agg() -> Option<(std::ffi::OsString, Graph)> {
    let Some(python) = std::env::var_os("DYN_TEST_PYTHON") else {
        dyn_tests::skip(
            "DYN_TEST_PYTHON is not set (scripts/test sets it up with the openai package)",
        );
        return None;
    };
    let g = Graph::up_with_ingress(
        "graphs/agg.yaml",
        "http",
        &["--set", "decode.mocker.speedup=100"],
    );
    Some((python, g))
}

#[test]
fn openai_python_client_streams_a_chat_completion() {
    let Some((python, g)) = python_and_agg() else {
        return;
    };
    let lines = python_lines(&python, "tests/py/openai_stream.py", &[&g.url("/v1")]);
    let text = lines[0].as_str().unwrap();
    assert!(!text.is_empty());
    assert_eq!(lines[1]["finish_reason"], "length");
    assert_eq!(lines[1]["usage"]["completion_tokens"], 10);
    assert_eq!(lines[2], json!({"error": "NotFoundError", "status": 404}));
    // A field not honoured yet is refused by name, not ignored.
    assert_eq!(
        lines[3],
        json!({"error": "BadRequestError", "status": 400, "param": "logit_bias"})
    );

    // The same request through plain HTTP gives the same text.
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "Tell me a short story."}], "max_tokens": 10, "seed": 11});
    let rt = tokio::runtime::Runtime::new().unwrap();
    let v: Value = rt.block_on(async {
        reqwest::Client::new()
            .post(g.url("/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    });
    assert_eq!(v["choices"][0]["message"]["content"], text);
}

/// Tool calls (named and `required`, unary and streamed, a turn with a tool result) and
/// structured outputs (json_schema, json_object, the client's pydantic `parse`, vLLM's choice
/// and regex) from the real SmolLM2 on the native engine, each answer validated against its
/// schema by `jsonschema`; penalties, logit bias, min_p and stop tokens as the client sends
/// them; log-probabilities, streamed too, and echo with the prompt's; `n=3`
/// (tests/py/structured.py).
#[test]
fn openai_python_client_gets_valid_tool_calls_and_structured_output_from_smollm2() {
    let Some((python, g)) = dyn_tests::smollm2_for_python() else {
        return;
    };
    let checks = python_lines(
        &python,
        "tests/py/structured.py",
        &[&g.url("/v1"), "smollm2"],
    );
    assert_eq!(checks.last(), Some(&json!({"ok": true})), "{checks:?}");
    assert_eq!(checks.len(), 13, "{checks:?}");
}

/// LoRA adapters as the official client sees them (tests/py/lora.py on graphs/lora.yaml):
/// listed with their parent, selected by `model` (the answers are transformers + peft's, and
/// name the adapter), streamed chat, and a 404 `NotFoundError` for one not served.
#[test]
fn openai_python_client_lists_and_selects_lora_adapters() {
    let Some(python) = std::env::var_os("DYN_TEST_PYTHON") else {
        dyn_tests::skip("DYN_TEST_PYTHON is not set (scripts/test sets it up)");
        return;
    };
    let text = std::fs::read_to_string(root().join("models/tiny-lora/reference.json")).unwrap();
    let r: Value = serde_json::from_str(&text).unwrap();
    let g = Graph::up_with_ingress("graphs/lora.yaml", "http", &[]);
    let prompt = r["prompts"][0].to_string();
    let lines = python_lines(&python, "tests/py/lora.py", &[&g.url("/v1"), &prompt]);
    assert_eq!(
        lines[0],
        json!([["tiny", null], ["all", "tiny"], ["qv", "tiny"]])
    );
    for (line, (model, key)) in
        lines[1..4]
            .iter()
            .zip([("tiny", "base"), ("qv", "qv"), ("all", "all")])
    {
        assert_eq!(line["model"], model, "{line}");
        assert_eq!(line["ids"], r["outputs"][key][0]["greedy"], "{model}");
    }
    assert_eq!(lines[4], json!({"models": ["qv"], "text": true}));
    assert_eq!(lines[5], json!({"error": "NotFoundError", "status": 404}));
}

/// The client's `completions.create` with every prompt form OpenAI documents — a string,
/// strings, token ids, lists of token ids — and `n`: one choice per prompt and `n`, indexed
/// as vLLM does (prompt-major), streamed and not; a mixed list is a 400
/// (tests/py/completions_prompts.py).
#[test]
fn openai_python_client_sends_every_completions_prompt_form() {
    let Some((python, g)) = python_and_agg() else {
        return;
    };
    let lines = python_lines(&python, "tests/py/completions_prompts.py", &[&g.url("/v1")]);
    let indexes = |l: &Value| l["indexes"].clone();
    assert_eq!(indexes(&lines[0]), json!([0]));
    assert_eq!(indexes(&lines[1]), json!([0, 1]));
    assert_eq!(indexes(&lines[2]), json!([0]));
    assert_eq!(indexes(&lines[3]), json!([0, 1, 2, 3]));
    for l in &lines[..4] {
        let n = l["indexes"].as_array().unwrap().len();
        assert_eq!(l["finish"], json!(vec!["length"; n]), "{l}");
        assert_eq!(l["usage"]["completion_tokens"], json!(3 * n), "{l}");
        assert!(
            l["texts"]
                .as_array()
                .unwrap()
                .iter()
                .all(|t| t.as_str().is_some_and(|t| !t.is_empty())),
            "{l}"
        );
    }
    // Token ids are the prompt as sent: 4 tokens; two prompts of 4 and 3 tokens.
    assert_eq!(lines[2]["usage"]["prompt_tokens"], 4);
    assert_eq!(lines[3]["usage"]["prompt_tokens"], 7);
    assert_eq!(
        lines[4],
        json!({"indexes": [0, 1, 2, 3], "finished": [0, 1, 2, 3]})
    );
    assert_eq!(lines[5], json!({"error": "BadRequestError", "status": 400}));
}
