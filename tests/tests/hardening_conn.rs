//! Connections whose clients stop reading, through the real binary: with every place under
//! `max_connections` held by streaming requests whose client never reads (answers far larger
//! than the socket buffers), the server closes each once its writes have made no
//! progress for `write_timeout_s`, cancels the request down to the engine, and serves others
//! again.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use std::time::{Duration, Instant};

use dyn_tests::{Graph, metric};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// Bounds that only end a test that would otherwise hang, sized for a loaded 2-core machine
/// running a debug build; before `write_timeout_s` existed the stalled clients held their
/// places for as long as they stayed connected.
const HANG: Duration = Duration::from_secs(120);

/// Streaming requests sent one after another on one connection (HTTP/1.1 pipelining).
const PIPELINED: usize = 4;

/// A connection of [`PIPELINED`] streaming requests whose client reads the first status line
/// and then nothing more. Each answer is megabytes (16 choices × 4000 tokens; how many tokens
/// share a chunk, and so the bytes, depends on how busy the machine is), and together they
/// are far beyond what the socket buffers on both sides (some 4 MB on Linux loopback) and
/// hyper's own hold: the server's writes stall during one of them.
async fn stalled_stream(addr: &str) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    // A small window, so the server's side fills sooner.
    socket.set_recv_buffer_size(4096).unwrap();
    let mut s = socket.connect(addr.parse().unwrap()).await.unwrap();
    let body = json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me everything."}],
        "max_tokens": 4000, "n": 16, "ignore_eos": true, "stream": true,
    })
    .to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    for _ in 0..PIPELINED {
        s.write_all(head.as_bytes()).await.unwrap();
        s.write_all(body.as_bytes()).await.unwrap();
    }
    // Only as far as the status line: the stream has begun (the ingress answers once the
    // first tokens are there), and this client stops reading here.
    let mut seen = Vec::new();
    let mut byte = [0; 1];
    tokio::time::timeout(HANG, async {
        while !seen.ends_with(b"\r\n") {
            assert_eq!(
                s.read(&mut byte).await.unwrap(),
                1,
                "closed before a status line"
            );
            seen.push(byte[0]);
        }
    })
    .await
    .expect("the stream's status line in time");
    let line = String::from_utf8_lossy(&seen);
    assert!(line.starts_with("HTTP/1.1 200"), "{line}");
    s
}

/// A small chat request through a fresh client; the server closes connections past its
/// limit as they arrive, so errors are retried until [`HANG`].
async fn answered(g: &Graph) -> serde_json::Value {
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 4});
    let deadline = Instant::now() + HANG;
    let mut last = String::new();
    while Instant::now() < deadline {
        let sent = reqwest::Client::new()
            .post(g.url("/v1/chat/completions"))
            .json(&body)
            .timeout(Duration::from_secs(30))
            .send()
            .await;
        match sent {
            Ok(r) if r.status() == 200 => return r.json().await.unwrap(),
            Ok(r) => last = format!("{}: {}", r.status(), r.text().await.unwrap_or_default()),
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "no answer in {HANG:?} beside 4 stalled clients (last: {last}); logs:\n{}",
        g.logs().join("\n")
    );
}

/// `/metrics`, or `None` when the connection is refused (the server closes one past its
/// limit at once, and places come free one by one).
async fn scrape(g: &Graph) -> Option<String> {
    let mut s = TcpStream::connect(&g.addr).await.ok()?;
    let ask = format!("GET /metrics HTTP/1.0\r\nHost: {}\r\n\r\n", g.addr);
    s.write_all(ask.as_bytes()).await.ok()?;
    let mut got = String::new();
    tokio::time::timeout(HANG, s.read_to_string(&mut got))
        .await
        .ok()?
        .ok()?;
    let (head, body) = got.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.0 200").then(|| body.to_owned())
}

/// `/metrics` once `ok` holds of it (or [`HANG`] passed: the caller's assertion says what).
async fn metrics_when(g: &Graph, ok: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + HANG;
    let mut last = None;
    while Instant::now() < deadline {
        if let Some(m) = scrape(g).await {
            if ok(&m) {
                return m;
            }
            last = Some(m);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    last.unwrap_or_else(|| panic!("/metrics never answered in {HANG:?}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn clients_that_stop_reading_are_closed_at_the_write_timeout_and_their_requests_cancelled() {
    let g = Graph::up_with_ingress(
        "graphs/agg.yaml",
        "http",
        &[
            "--set",
            "http.max_connections=4",
            "--set",
            "http.write_timeout_s=2",
            // Tokens quickly (a step in well under a millisecond), and room for 64 sequences
            // of 4000.
            "--set",
            "decode.mocker.speedup=10",
            "--set",
            "decode.mocker.num_blocks=16384",
        ],
    );
    let started = Instant::now();
    let mut stalled = Vec::new();
    for _ in 0..4 {
        stalled.push(stalled_stream(&g.addr).await);
    }
    eprintln!("4 streams under way after {:?}", started.elapsed());

    // Every place is taken; a new client is served once the stalled ones are closed.
    let v = answered(&g).await;
    assert_eq!(v["object"], "chat.completion", "{v}");
    eprintln!("another client answered after {:?}", started.elapsed());

    let cancelled = [
        "dyn_frontend_requests_total",
        "endpoint=\"chat_completions\"",
        "request_type=\"stream\"",
        "status=\"cancelled\"",
    ];
    let m = metrics_when(&g, |m| {
        metric(m, &cancelled) == 4
            && metric(m, &["dyn_frontend_inflight_requests"]) == 0
            && metric(m, &["dyn_worker_requests_running"]) == 0
            && metric(m, &["dyn_frontend_open_connections"]) == 1
    })
    .await;
    assert_eq!(
        metric(&m, &["dyn_frontend_write_timeouts_total"]),
        4,
        "each stalled connection was closed at the write timeout:\n{m}"
    );
    assert_eq!(
        metric(&m, &cancelled),
        4,
        "the stalled requests were cancelled:\n{m}"
    );
    assert_eq!(metric(&m, &["dyn_frontend_inflight_requests"]), 0, "{m}");
    assert_eq!(
        metric(&m, &["dyn_worker_requests_running"]),
        0,
        "the cancellation reached the engine:\n{m}"
    );
    // This scrape's own connection only.
    assert_eq!(metric(&m, &["dyn_frontend_open_connections"]), 1, "{m}");

    eprintln!("metrics settled after {:?}", started.elapsed());
    // The server closed them: what was buffered drains, then the end.
    for (i, s) in stalled.iter_mut().enumerate() {
        let mut sink = Vec::new();
        let ended = tokio::time::timeout(HANG, s.read_to_end(&mut sink)).await;
        // A reset is a close too (the server may drop unsent data).
        assert!(
            ended.is_ok(),
            "stalled connection {i} still open after {HANG:?}"
        );
        // Cut off mid-answer: not every answer arrived whole.
        let whole = String::from_utf8_lossy(&sink)
            .matches("data: [DONE]")
            .count();
        assert!(
            whole < PIPELINED,
            "stalled connection {i} got all its answers"
        );
        eprintln!("stalled connection {i}: {} bytes, then closed", sink.len());
    }
}
