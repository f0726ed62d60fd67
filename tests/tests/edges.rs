//! The HTTP ingress's edges against misbehaving clients, through the real binary: slow and idle
//! connections cannot starve it, a loopback server answers only for loopback names, and the
//! operators' endpoints take their own keys.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use std::time::{Duration, Instant};

use dyn_tests::Graph;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn text(g: &Graph) -> reqwest::RequestBuilder {
    reqwest::Client::new()
        .post(g.url("/v1/text"))
        .json(&json!({"text": "hello"}))
}

/// Reads until the server closes the connection (or 60 s pass, a bound that only ends a
/// hang): what it sent.
async fn until_closed(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut got))
        .await
        .ok()
        .map(|_| got)
}

/// 200 slowloris connections (headers begun, never finished) take nothing from a normal
/// request; each is dropped at the header timeout.
#[tokio::test]
async fn slow_clients_do_not_starve_the_server_and_are_dropped_at_the_header_timeout() {
    let g = Graph::up(
        "graphs/echo.yaml",
        &[
            "--set",
            "echo.delay_ms=0",
            "--set",
            "ingress.header_read_timeout_s=10",
        ],
    );
    let mut slow = Vec::new();
    for _ in 0..200 {
        let mut s = TcpStream::connect(&g.addr).await.unwrap();
        s.write_all(b"POST /v1/text HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            .await
            .unwrap();
        slow.push(s);
    }
    let started = Instant::now();
    // Within the header timeout, so while the slow clients still hold their connections (a
    // server they starved would answer only once they are dropped); 8 s is ample on a loaded
    // machine for a request that takes milliseconds.
    let resp = text(&g)
        .timeout(Duration::from_secs(8))
        .send()
        .await
        .expect("answered within 8 s while 200 slow clients hold connections");
    assert_eq!(resp.status(), 200);
    eprintln!(
        "answered in {:?} beside 200 slow clients",
        started.elapsed()
    );
    // The slow ones are disconnected (hyper answers 408 or just closes).
    for s in slow.iter_mut().take(5) {
        let got = until_closed(s).await.expect("closed at the header timeout");
        let got = String::from_utf8_lossy(&got);
        assert!(got.is_empty() || got.starts_with("HTTP/1.1 408"), "{got}");
    }
}

/// Past `max_connections` a new connection is closed at once; a freed place is taken again.
#[tokio::test]
async fn connections_beyond_the_limit_are_closed() {
    let g = Graph::up(
        "graphs/echo.yaml",
        &[
            "--set",
            "echo.delay_ms=0",
            "--set",
            "ingress.max_connections=4",
        ],
    );
    // Each held connection is known to be served (it got an answer, and stays open), rather
    // than guessed to be after a pause.
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut s = TcpStream::connect(&g.addr).await.unwrap();
        s.write_all(b"GET /live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            .await
            .unwrap();
        let mut got = Vec::new();
        let mut buf = [0; 1024];
        tokio::time::timeout(Duration::from_secs(60), async {
            while !String::from_utf8_lossy(&got).contains("\"live\"") {
                let n = s.read(&mut buf).await.unwrap();
                assert!(
                    n > 0,
                    "a held connection closed: {:?}",
                    String::from_utf8_lossy(&got)
                );
                got.extend_from_slice(&buf[..n]);
            }
        })
        .await
        .expect("a held connection answered");
        held.push(s);
    }
    let mut extra = TcpStream::connect(&g.addr).await.unwrap();
    let _ = extra
        .write_all(b"GET /live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await;
    assert_eq!(until_closed(&mut extra).await.map(|b| b.len()), Some(0));
    drop(held);
    let mut ok = false;
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if text(&g).send().await.is_ok_and(|r| r.status() == 200) {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        ok,
        "not served again in 60 s once the held connections closed"
    );
}

/// A loopback server answers requests for loopback names only: a page on another origin
/// that rebinds its name to 127.0.0.1 gets an error object, not an answer.
#[tokio::test]
async fn a_loopback_server_refuses_other_host_names() {
    let g = Graph::up("graphs/echo.yaml", &["--set", "echo.delay_ms=0"]);
    let port = g.addr.rsplit_once(':').unwrap().1.to_owned();
    for (host, status) in [
        (format!("localhost:{port}"), 200),
        (format!("127.0.0.1:{port}"), 200),
        (format!("[::1]:{port}"), 200),
        (format!("evil.example:{port}"), 421),
        ("evil.example".to_owned(), 421),
    ] {
        let resp = text(&g).header("host", &host).send().await.unwrap();
        assert_eq!(resp.status(), status, "{host}");
        if status != 200 {
            let body: Value = resp.json().await.unwrap();
            assert_eq!(body["error"]["code"], "misdirected_request", "{body}");
        }
    }
    // A reverse proxy on this host that passes its public name on: named in `allowed_hosts`.
    let g = Graph::up(
        "graphs/echo.yaml",
        &[
            "--set",
            "echo.delay_ms=0",
            "--set",
            "ingress.allowed_hosts=[api.example.com]",
        ],
    );
    for (host, status) in [
        ("api.example.com", 200),
        ("API.example.com:443", 200),
        ("evil.example", 421),
    ] {
        let resp = text(&g).header("host", host).send().await.unwrap();
        assert_eq!(resp.status(), status, "{host}");
    }
}

/// `/metrics` and `/admin` behind their own keys; the API's keys do not open them.
#[tokio::test]
async fn metrics_and_admin_take_their_own_keys() {
    let g = Graph::start(
        "graphs/agg.yaml",
        "http",
        &[
            "--set",
            "decode.mocker.speedup=100",
            "--set",
            "http.api_keys=[api-key]",
            "--set",
            "http.metrics_key=scrape-key",
        ],
        &[("DYN_ADMIN_KEY", "admin-key")],
    );
    let get = |path: &str, key: Option<&str>| {
        let mut r = reqwest::Client::new().get(g.url(path));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    for (path, key, status) in [
        ("/metrics", None, 401),
        ("/metrics", Some("api-key"), 401),
        ("/metrics", Some("scrape-key"), 200),
        ("/admin/nodes", None, 401),
        ("/admin/nodes", Some("scrape-key"), 401),
        ("/admin/nodes", Some("admin-key"), 200),
        ("/health", None, 200),
    ] {
        let status_got = get(path, key).await.unwrap().status();
        assert_eq!(status_got, status, "{path} with {key:?}");
    }
}
