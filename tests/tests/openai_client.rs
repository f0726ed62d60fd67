//! The official `openai` Python package talks to `dyn graph up graphs/agg.yaml`.
//!
//! The test command (`scripts/test`) installs the package into a venv from PyPI and points
//! `DYN_TEST_PYTHON` at its interpreter. Without it this test says so and skips.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use std::process::Command;

use dyn_tests::{Graph, root};
use serde_json::{Value, json};

#[test]
fn openai_python_client_streams_a_chat_completion() {
    let Some(python) = std::env::var_os("DYN_TEST_PYTHON") else {
        dyn_tests::skip(
            "DYN_TEST_PYTHON is not set (scripts/test sets it up with the openai package)",
        );
        return;
    };
    let g = Graph::up_with_ingress(
        "graphs/agg.yaml",
        "http",
        &["--set", "decode.mocker.speedup=100"],
    );
    let out = Command::new(python)
        .arg(root().join("tests/py/openai_stream.py"))
        .arg(g.url("/v1"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let text = lines[0].as_str().unwrap();
    assert!(!text.is_empty());
    assert_eq!(lines[1]["finish_reason"], "length");
    assert_eq!(lines[1]["usage"]["completion_tokens"], 10);
    assert_eq!(lines[2], json!({"error": "NotFoundError", "status": 404}));
    // A request for a tool call is refused by name, not answered with plain text.
    assert_eq!(
        lines[3],
        json!({"error": "BadRequestError", "status": 400, "param": "tools"})
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
