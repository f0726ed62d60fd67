//! One request must never take the server down, nor reach another tenant's data, through the
//! real binary on the tiny model: `metadata` past OpenAI's bounds is refused (Responses, chat,
//! Anthropic's), the Responses store keeps its byte bound and each tenant's share, a bare API
//! key cannot claim a named key's tenant through the tenant header, `/v1/models` shows no
//! server path, and a request id that could forge log fields is replaced.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use dyn_tests::Graph;
use serde_json::{Map, Value, json};

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

async fn send(req: reqwest::RequestBuilder) -> (u16, Value) {
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// The graph up with fast mocker workers and `extra`.
fn graph(extra: &[&str]) -> Graph {
    let mut args = vec!["--set", "decode.mocker.speedup=100"];
    args.extend_from_slice(extra);
    Graph::up_with_ingress("graphs/agg.yaml", "http", &args)
}

/// Resident memory of the graph's process (one process: frontend, store and workers).
fn rss(g: &Graph) -> u64 {
    dyn_tests::rss_bytes(g.pid())
}

/// The largest `metadata` OpenAI allows: 16 pairs, 64-character keys, 512-character values
/// (about 9 KiB as JSON).
fn largest_metadata(tag: &str) -> Value {
    let m: Map<String, Value> = (0..16)
        .map(|i| {
            (
                format!("{tag}{i:02}{}", "k".repeat(60 - tag.len())),
                json!("v".repeat(512)),
            )
        })
        .collect();
    Value::Object(m)
}

const METADATA_BYTES: u64 = 16 * (64 + 512);

/// `POST /v1/responses` with `body` (model and a short answer added), as `key`.
async fn respond(
    g: &Graph,
    key: Option<&str>,
    headers: &[(&str, &str)],
    body: Value,
) -> (u16, Value) {
    let mut body = body;
    body["model"] = json!("tiny");
    body["max_output_tokens"] = json!(2);
    if body.get("input").is_none() {
        body["input"] = json!("Hello");
    }
    let mut r = client().post(g.url("/v1/responses")).json(&body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    for (h, v) in headers {
        r = r.header(*h, *v);
    }
    send(r).await
}

/// `GET /v1/responses/{id}`'s status, as `key` with `headers`.
async fn stored(g: &Graph, key: Option<&str>, headers: &[(&str, &str)], id: &str) -> u16 {
    let mut r = client().get(g.url(&format!("/v1/responses/{id}")));
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    for (h, v) in headers {
        r = r.header(*h, *v);
    }
    r.send().await.unwrap().status().as_u16()
}

#[tokio::test(flavor = "multi_thread")]
async fn metadata_past_its_bounds_is_refused_and_the_store_keeps_its_byte_bound() {
    let g = graph(&["--set", "http.responses_store.max_bytes=1048576"]);
    // Past OpenAI's bounds: a 400 naming the field.
    let many: Map<String, Value> = (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
    for (metadata, param) in [
        (Value::Object(many), "metadata"),
        (json!({"k".repeat(65): "v"}), "metadata"),
        (json!({"k": "v".repeat(513)}), "metadata.k"),
        (json!({"k": 1}), "metadata.k"),
        (json!("text"), "metadata"),
    ] {
        let (status, v) = respond(&g, None, &[], json!({"metadata": metadata})).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], param, "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    }
    // Chat completions take `metadata` under the same bounds.
    let (status, v) = send(client().post(g.url("/v1/chat/completions")).json(&json!({
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
        "metadata": {"k": "v".repeat(513)},
    })))
    .await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("metadata.k")),
        "{v}"
    );
    // Anthropic's holds `user_id` (at most 256 characters) and nothing else.
    for (metadata, starts) in [
        (json!({"user_id": "u", "note": "x"}), "metadata:"),
        (json!({"user_id": "u".repeat(257)}), "metadata.user_id:"),
    ] {
        let (status, v) = send(client().post(g.url("/v1/messages")).json(&json!({
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
            "metadata": metadata,
        })))
        .await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().starts_with(starts),
            "{v}"
        );
    }
    // `user` is stored with the response: bounded too.
    let (status, v) = respond(&g, None, &[], json!({"user": "u".repeat(257)})).await;
    assert_eq!((status, &v["error"]["param"]), (400, &json!("user")), "{v}");

    // The report's flood: requests carrying megabytes of metadata each. Before, each was
    // stored (16 of them took 147 MiB); now each is refused and nothing stays.
    let before = rss(&g);
    let huge = json!({"notes": "x".repeat(3 << 20)});
    for _ in 0..32 {
        let (status, v) = respond(&g, None, &[], json!({"metadata": huge})).await;
        assert_eq!(
            (status, &v["error"]["param"]),
            (400, &json!("metadata.notes")),
            "{v}"
        );
    }
    // Megabytes of instructions are no way around it: what a response would store before its
    // answer is bounded as a whole.
    let (status, v) = respond(
        &g,
        None,
        &[],
        json!({"instructions": "i".repeat(900 << 10)}),
    )
    .await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("input")),
        "{v}"
    );

    // Records as large as the bounds allow, many times what the store may hold: the oldest go,
    // the newest stay, and what is still stored fits the byte bound.
    let mut ids = Vec::new();
    for i in 0..160 {
        let (status, r) = respond(
            &g,
            None,
            &[],
            json!({"metadata": largest_metadata("t"), "user": "u".repeat(256), "input": format!("Hello {i}")}),
        )
        .await;
        assert_eq!(status, 200, "{r}");
        assert_eq!(r["store"], true, "{r}");
        ids.push(r["id"].as_str().unwrap().to_owned());
    }
    let mut kept = Vec::new();
    for id in &ids {
        kept.push(stored(&g, None, &[], id).await == 200);
    }
    assert!(!kept[0], "the oldest went");
    assert!(kept[159], "the newest stays");
    let n = kept.iter().filter(|k| **k).count() as u64;
    assert!(
        n * METADATA_BYTES <= 1 << 20,
        "{n} records of over {METADATA_BYTES} bytes each are stored under a bound of 1 MiB"
    );
    assert!(n >= 50, "only {n} kept: the bound is 1 MiB");

    // The server still answers, and took no more memory than a generous bound: the refused
    // flood is 96 MiB of metadata, all of it stored before (16 such requests took 147 MiB).
    let (status, v) = send(client().post(g.url("/v1/chat/completions")).json(&json!({
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
    })))
    .await;
    assert_eq!(status, 200, "{v}");
    let (status, v) = respond(&g, None, &[], json!({"metadata": {"a": "b"}})).await;
    assert_eq!(status, 200, "{v}");
    let grown = rss(&g).saturating_sub(before);
    assert!(
        grown < 128 << 20,
        "resident memory grew by {} MiB",
        grown >> 20
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn one_tenant_filling_the_store_leaves_other_tenants_their_responses() {
    let g = graph(&[
        "--set",
        "http.api_keys=[{key: ka, tenant: tenant-a}, {key: kb, tenant: tenant-b}]",
        "--set",
        "http.responses_store.max_bytes=1048576",
        "--set",
        "http.responses_store.max_tenant_share=0.5",
    ]);
    let (status, r) = respond(
        &g,
        Some("kb"),
        &[],
        json!({"metadata": largest_metadata("b")}),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    let theirs = r["id"].as_str().unwrap().to_owned();
    let mut ids = Vec::new();
    for i in 0..120 {
        let (status, r) = respond(
            &g,
            Some("ka"),
            &[],
            json!({"metadata": largest_metadata("a"), "input": format!("Hello {i}")}),
        )
        .await;
        assert_eq!(status, 200, "{r}");
        ids.push(r["id"].as_str().unwrap().to_owned());
    }
    // tenant-b's response is still there; tenant-a lost its own oldest, keeping at most its
    // half of the store.
    assert_eq!(stored(&g, Some("kb"), &[], &theirs).await, 200);
    let mut n = 0u64;
    for id in &ids {
        n += u64::from(stored(&g, Some("ka"), &[], id).await == 200);
    }
    assert_eq!(stored(&g, Some("ka"), &[], &ids[0]).await, 404);
    assert_eq!(stored(&g, Some("ka"), &[], &ids[119]).await, 200);
    assert!(
        n * METADATA_BYTES <= 1 << 19,
        "tenant-a holds {n} records of over {METADATA_BYTES} bytes, past its half of 1 MiB"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bare_key_cannot_claim_a_named_keys_tenant_by_header() {
    let g = graph(&[
        "--set",
        "http.api_keys=[{key: ka, tenant: tenant-a}, kc]",
        "--set",
        "http.tenant_header=x-tenant-id",
    ]);
    let (status, r) = respond(&g, Some("ka"), &[], json!({})).await;
    assert_eq!(status, 200, "{r}");
    let id = r["id"].as_str().unwrap().to_owned();
    let claim = [("x-tenant-id", "tenant-a")];
    // The bare key naming tenant-a: refused, whatever it asks.
    let (status, v) = respond(&g, Some("kc"), &claim, json!({"previous_response_id": id})).await;
    assert_eq!(status, 403, "{v}");
    assert_eq!(v["error"]["code"], "permission_denied", "{v}");
    assert_eq!(v["error"]["param"], "x-tenant-id", "{v}");
    assert_eq!(stored(&g, Some("kc"), &claim, &id).await, 403);
    let (status, v) = send(
        client()
            .post(g.url("/v1/chat/completions"))
            .bearer_auth("kc")
            .header("x-tenant-id", "tenant-a")
            .json(&json!({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})),
    )
    .await;
    assert_eq!(
        (status, &v["error"]["code"]),
        (403, &json!("permission_denied")),
        "{v}"
    );
    let (status, v) = send(
        client()
            .post(g.url("/v1/messages"))
            .header("x-api-key", "kc")
            .header("x-tenant-id", "tenant-a")
            .json(&json!({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})),
    )
    .await;
    assert_eq!(
        (status, &v["error"]["type"]),
        (403, &json!("permission_error")),
        "{v}"
    );
    // Nor is it there for the bare key without the header: another tenant's.
    assert_eq!(stored(&g, Some("kc"), &[], &id).await, 404);
    // tenant-a's own key, with or without its own name in the header, reads it.
    assert_eq!(stored(&g, Some("ka"), &claim, &id).await, 200);
    assert_eq!(stored(&g, Some("ka"), &[], &id).await, 200);
    // A tenant no key has is a gateway's to name, with its bare key.
    let gw = [("x-tenant-id", "gw-7")];
    let (status, r) = respond(&g, Some("kc"), &gw, json!({})).await;
    assert_eq!(status, 200, "{r}");
    let id = r["id"].as_str().unwrap().to_owned();
    assert_eq!(stored(&g, Some("kc"), &gw, &id).await, 200);
    assert_eq!(stored(&g, Some("kc"), &[], &id).await, 404);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_model_list_shows_names_not_server_paths() {
    let g = graph(&[]);
    let r = client().get(g.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let models = v["data"].as_array().unwrap();
    assert!(!models.is_empty(), "{v}");
    for m in models {
        assert_eq!(m["root"], m["id"], "{m}");
    }
    let root = dyn_tests::root().display().to_string();
    assert!(
        !text.contains(&root) && !text.contains("models/tiny"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn request_ids_that_could_forge_log_fields_are_replaced() {
    let g = graph(&[]);
    let chat =
        json!({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]});
    let id_of = |r: &reqwest::Response| r.headers()["x-request-id"].to_str().unwrap().to_owned();
    let long = format!("forged{}", "a".repeat(128));
    for forged in [
        r#"forged" level="ERROR"#,
        "forged=1",
        "forged id",
        long.as_str(),
    ] {
        let r = client()
            .post(g.url("/v1/chat/completions"))
            .header("x-request-id", forged)
            .json(&chat)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let id = id_of(&r);
        assert!(
            id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()),
            "{forged:?} answered as {id:?}: a new id was expected"
        );
    }
    // A safe one is the request's own, echoed.
    for good in ["req-1", "trace:4bf92f35.span_00f067aa-1"] {
        let r = client()
            .post(g.url("/v1/chat/completions"))
            .header("x-request-id", good)
            .json(&chat)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(id_of(&r), good);
    }
    // The logs never carried the forged ones.
    assert!(
        !g.logs().iter().any(|l| l.contains("forged")),
        "a forged request id reached the logs"
    );
}
