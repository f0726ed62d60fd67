//! `dyn graph up graphs/echo.yaml` end to end over loopback HTTP: requests go through the
//! graph and back, errors are OpenAI error objects, a client hanging up kills its request, and
//! SIGTERM drains in-flight work before exiting 0.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use std::time::Duration;

use dyn_tests::Graph;
use futures::StreamExt;
use serde_json::{Value, json};

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

#[tokio::test]
async fn request_goes_through_and_comes_back() {
    let g = Graph::up("graphs/echo.yaml", &["--set", "echo.delay_ms=0"]);
    let resp = client()
        .post(g.url("/v1/text"))
        .header("x-request-id", "req-1")
        .json(&json!({"text": "hello dataflow world"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-request-id"], "req-1", "echoed");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body, json!({"id": "req-1", "text": "hello dataflow world"}));
    // Without one, the ingress makes one up, answers with it, and uses it as the request's id.
    let resp = client()
        .post(g.url("/v1/text"))
        .json(&json!({"text": "hi"}))
        .send()
        .await
        .unwrap();
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    assert_eq!(id.len(), 32, "a simple UUID: {id}");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["id"], id);

    // Streaming: one SSE event per word, then [DONE].
    let text = client()
        .post(g.url("/v1/text"))
        .json(&json!({"text": "a b c", "stream": true}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.len(), 4, "{text}");
    let words: Vec<String> = data[..3]
        .iter()
        .map(|d| {
            serde_json::from_str::<Value>(d).unwrap()["text"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(words, ["a ", "b ", "c"]);
    assert_eq!(data[3], "[DONE]");

    let health: Value = client()
        .get(g.url("/health"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(health["status"], "healthy");
}

#[tokio::test]
async fn bad_requests_get_openai_errors_and_the_server_stays_up() {
    let g = Graph::up(
        "graphs/echo.yaml",
        &["--set", "ingress.max_body_bytes=1024"],
    );
    let cases: [(reqwest::RequestBuilder, u16, &str); 4] = [
        (
            client().post(g.url("/v1/text")).body("{not json"),
            400,
            "invalid_json",
        ),
        (
            client().post(g.url("/v1/text")).json(&json!({"text": 7})),
            400,
            "invalid_value",
        ),
        (
            client()
                .post(g.url("/v1/text"))
                .json(&json!({"text": "x".repeat(4096)})),
            413,
            "request_too_large",
        ),
        (client().get(g.url("/v2/nothing")), 404, "not_found"),
    ];
    for (req, status, code) in cases {
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status().as_u16(), status);
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["code"], code, "{body}");
        assert!(body["error"]["message"].is_string());
        assert!(body["error"]["type"].is_string());
    }
    let ok = client()
        .post(g.url("/v1/text"))
        .json(&json!({"text": "still up"}))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
}

#[tokio::test]
async fn api_keys_are_enforced() {
    let g = Graph::up("graphs/echo.yaml", &["--set", "ingress.api_keys=[sekret]"]);
    let denied = client()
        .post(g.url("/v1/text"))
        .json(&json!({"text": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(denied.status(), 401);
    let allowed = client()
        .post(g.url("/v1/text"))
        .bearer_auth("sekret")
        .json(&json!({"text": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(allowed.status(), 200);
    for wrong in ["sekreT", "sekre", "sekrets", ""] {
        let denied = client()
            .post(g.url("/v1/text"))
            .bearer_auth(wrong)
            .json(&json!({"text": "x"}))
            .send()
            .await
            .unwrap();
        assert_eq!(denied.status(), 401, "{wrong:?}");
    }
    // Health stays open for probes.
    assert_eq!(
        client()
            .get(g.url("/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
}

#[tokio::test]
async fn client_disconnect_kills_the_request() {
    let g = Graph::up("graphs/echo.yaml", &["--set", "echo.delay_ms=200"]);
    let resp = client()
        .post(g.url("/v1/text"))
        .json(&json!({"text": "one two three four five six seven eight nine ten", "stream": true}))
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("one"));
    drop(body);
    // The ingress's guard kills the context, which reaches every operator on the path (an
    // engine in its own task watches `ctx.killed()`; echo's stream is dropped with it).
    // Wait without blocking this runtime: the client's connection task must run to hang up.
    let mut seen = false;
    for _ in 0..500 {
        if g.logs()
            .iter()
            .any(|l| l.contains("Request killed: its consumer went away"))
        {
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        seen,
        "the operator did not observe the cancellation:\n{}",
        g.logs().join("\n")
    );
}

/// Start a streamed request and wait for its first word, so it is in flight for certain (a
/// fixed pause is not, on a loaded machine); the rest is read in the background, which
/// resolves to the text of every event.
async fn stream_in_flight(g: &Graph, text: &str) -> tokio::task::JoinHandle<Vec<String>> {
    let resp = client()
        .post(g.url("/v1/text"))
        .json(&json!({"text": text, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("\n\n") {
        let chunk = body.next().await.expect("a first word").unwrap();
        got.extend_from_slice(&chunk);
    }
    tokio::spawn(async move {
        // Cut off or not, what came is what counts.
        while let Some(Ok(chunk)) = body.next().await {
            got.extend_from_slice(&chunk);
        }
        String::from_utf8_lossy(&got)
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .map(|v| v["text"].as_str().unwrap_or_default().to_owned())
            .collect()
    })
}

/// Send SIGTERM and return the exit code (waiting off the async runtime).
async fn terminate_and_wait(g: Graph) -> Option<i32> {
    g.terminate();
    tokio::task::spawn_blocking(move || g.wait(Duration::from_secs(30)))
        .await
        .unwrap()
}

#[tokio::test]
async fn sigterm_drains_in_flight_requests_then_exits_zero() {
    let g = Graph::up(
        "graphs/echo.yaml",
        &["--set", "echo.delay_ms=100", "--grace-period", "20"],
    );
    // A request that takes about a second, under way before the signal.
    let slow = stream_in_flight(&g, "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10").await;
    let code = terminate_and_wait(g).await;
    assert_eq!(
        slow.await.unwrap().concat(),
        "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10",
        "in-flight request finished"
    );
    assert_eq!(code, Some(0));
}

#[tokio::test]
async fn sigterm_after_grace_period_kills_and_still_exits_zero() {
    let g = Graph::up(
        "graphs/echo.yaml",
        &["--set", "echo.delay_ms=500", "--grace-period", "0.5"],
    );
    let slow = stream_in_flight(&g, "a b c d e f g h i j k l m n o p").await;
    let logs = g.log_sink();
    assert_eq!(terminate_and_wait(g).await, Some(0));
    // The request was cut off at the end of the grace period, not waited for: 16 words at
    // 500 ms each would take 8 s.
    let words = slow.await.unwrap();
    let logs = logs.lock().unwrap().join("\n");
    assert!(
        logs.contains("Grace period over; aborting requests still in flight"),
        "{logs}"
    );
    assert!(words.len() < 16, "the request ran to its end: {words:?}");
}
