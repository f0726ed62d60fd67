//! The other APIs clients speak, through the real binary: OpenAI's Responses API and
//! Anthropic's Messages API with their official Python clients against SmolLM2
//! (tests/py/responses.py, tests/py/anthropic_messages.py), metrics labelled by endpoint, and
//! on the tiny model: Anthropic's `x-api-key` and error shape, stored responses kept per
//! tenant. (A stored response continued through another frontend: tests/tests/scale_out.rs.)
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use dyn_tests::{Graph, metric, python_lines};
use serde_json::{Value, json};

#[test]
fn official_clients_speak_responses_and_anthropic_messages_to_smollm2() {
    let Some((python, g)) = dyn_tests::smollm2_for_python() else {
        return;
    };
    let checks = python_lines(
        &python,
        "tests/py/responses.py",
        &[&g.url("/v1"), "smollm2"],
    );
    assert_eq!(
        checks.last(),
        Some(&json!({"check": "done", "ok": true})),
        "{checks:?}"
    );
    let checks = python_lines(
        &python,
        "tests/py/anthropic_messages.py",
        &[&g.url(""), "smollm2"],
    );
    assert_eq!(
        checks.last(),
        Some(&json!({"check": "done", "ok": true})),
        "{checks:?}"
    );
    // Each endpoint counts its own requests, streamed and not.
    let m = g.get("/metrics");
    for endpoint in ["responses", "messages"] {
        for kind in ["unary", "stream"] {
            let n = metric(
                &m,
                &[
                    "dyn_frontend_requests_total",
                    &format!("endpoint=\"{endpoint}\""),
                    &format!("request_type=\"{kind}\""),
                    "status=\"success\"",
                ],
            );
            assert!(n >= 2, "{endpoint} {kind}: {n}\n{m}");
        }
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

async fn send(req: reqwest::RequestBuilder) -> (u16, Value) {
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread")]
async fn messages_take_anthropic_keys_and_stored_responses_stay_with_their_tenant() {
    let g = Graph::up_with_ingress(
        "graphs/agg.yaml",
        "http",
        &["--set", "http.api_keys=[k1, {key: k2, tenant: acme}]"],
    );
    let body =
        json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]});
    // Without a key: 401 in Anthropic's shape.
    let (status, v) = send(client().post(g.url("/v1/messages")).json(&body)).await;
    assert_eq!(status, 401, "{v}");
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "authentication_error", "{v}");
    // With Anthropic's header.
    let (status, v) = send(
        client()
            .post(g.url("/v1/messages"))
            .header("x-api-key", "k1")
            .header("anthropic-version", "2023-06-01")
            .json(&body),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["type"], "message", "{v}");
    assert!(v["usage"]["output_tokens"].as_u64().unwrap() > 0, "{v}");
    // A bad body: 400 in its shape, naming the field.
    let (status, v) = send(
        client()
            .post(g.url("/v1/messages"))
            .header("x-api-key", "k1")
            .json(&json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]})),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("messages[0].role"),
        "{v}"
    );

    // A response stored under one tenant is not there for another.
    let (status, r) = send(
        client()
            .post(g.url("/v1/responses"))
            .bearer_auth("k1")
            .json(&json!({"model": "tiny", "input": "Hello", "max_output_tokens": 4})),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    let id = r["id"].as_str().unwrap();
    let get = |key: &'static str| {
        send(
            client()
                .get(g.url(&format!("/v1/responses/{id}")))
                .bearer_auth(key),
        )
    };
    let (status, mine) = get("k1").await;
    assert_eq!((status, &mine["output"]), (200, &r["output"]), "{mine}");
    let (status, v) = get("k2").await;
    assert_eq!(status, 404, "{v}");
    let (status, v) = send(
        client()
            .post(g.url("/v1/responses"))
            .bearer_auth("k2")
            .json(&json!({"model": "tiny", "input": "More", "previous_response_id": id, "max_output_tokens": 4})),
    )
    .await;
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["error"]["param"], "previous_response_id", "{v}");
    let (status, v) = send(
        client()
            .delete(g.url(&format!("/v1/responses/{id}")))
            .bearer_auth("k2"),
    )
    .await;
    assert_eq!(status, 404, "{v}");
    let (status, v) = send(
        client()
            .delete(g.url(&format!("/v1/responses/{id}")))
            .bearer_auth("k1"),
    )
    .await;
    assert_eq!((status, &v["deleted"]), (200, &json!(true)), "{v}");
    let (status, _) = get("k1").await;
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_response_store_keeps_only_its_bound() {
    let g = Graph::up_with_ingress(
        "graphs/agg.yaml",
        "http",
        &["--set", "http.responses_store.max_responses=2"],
    );
    let mut ids = Vec::new();
    for i in 0..3 {
        let (status, r) = send(client().post(g.url("/v1/responses")).json(
            &json!({"model": "tiny", "input": format!("Hello {i}"), "max_output_tokens": 2}),
        ))
        .await;
        assert_eq!(status, 200, "{r}");
        ids.push(r["id"].as_str().unwrap().to_owned());
    }
    let status = |id: &str| {
        let url = g.url(&format!("/v1/responses/{id}"));
        async move { client().get(url).send().await.unwrap().status().as_u16() }
    };
    assert_eq!(status(&ids[0]).await, 404, "the oldest went");
    assert_eq!(status(&ids[1]).await, 200);
    assert_eq!(status(&ids[2]).await, 200);
    // A bound that makes no sense is a graph error, at its place in the file.
    let dir = dyn_tests::scratch_dir("responses-store-bound");
    let bad = dir.join("graph.yaml");
    let agg = std::fs::read_to_string(dyn_tests::root().join("graphs/agg.yaml")).unwrap();
    std::fs::write(
        &bad,
        agg.replace(
            "../models/tiny",
            &dyn_tests::root().join("models/tiny").display().to_string(),
        )
        .replace(
            "listen: 127.0.0.1:8000",
            "listen: 127.0.0.1:8000\n      responses_store: {max_age_s: 0}",
        ),
    )
    .unwrap();
    let out = dyn_tests::run(&["graph", "validate", &bad.display().to_string()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("responses_store.max_age_s"), "{err}");
}
