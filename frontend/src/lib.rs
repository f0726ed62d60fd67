//! dyn-frontend: the HTTP ingresses — the `http` kind ([`http`], which mounts every route:
//! OpenAI's chat and completions, Responses, Anthropic's Messages, embeddings, vLLM's
//! tokenizer routes, LoRA and the admin routes ([`admin`]), `/metrics`) and the debugging
//! `http_text` kind ([`text`]) — and the frontend's metrics ([`metrics`]). It must not depend
//! on any engine (dyn-engine, dyn-external): changing an engine must not recompile the
//! frontend.
//!
//! What every HTTP ingress shares is split by what it owns: the settings ([`ServerConfig`],
//! `config.rs`), API keys and tenants (`keys.rs`), the headers a request carries
//! (`traffic.rs`), the errors clients see (`error.rs`), and serving — request ids, key checks,
//! health endpoints, body limits, graceful shutdown (`server.rs`).
//!
//! Errors that reach a client are OpenAI error objects
//! (`{"error": {"message", "type", "param", "code"}}`) with a stable `type` and `code`; detail
//! meant for operators goes to the log.

pub mod admin;
mod answer;
mod anthropic;
mod app;
mod conn;
mod embeddings;
pub mod harmony;
pub mod http;
pub mod lora;
pub mod metrics;
mod openai;
mod pieces;
mod pipeline;
pub mod reasoning;
mod responses;
pub mod text;
mod tokenize;
pub mod tools;

mod config;
mod error;
mod keys;
mod server;
mod traffic;

pub use config::*;
pub use error::*;
pub use keys::*;
pub use server::*;
pub use traffic::*;

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{HeaderMap, StatusCode};
    use serde_json::json;

    #[test]
    fn loopback_names_are_told_from_others() {
        for h in [
            "localhost",
            "LOCALHOST:8000",
            "app.localhost:1",
            "127.0.0.1",
            "127.1.2.3:80",
            "[::1]:8000",
            "[::1]",
            "::1",
        ] {
            assert!(loopback_host(h), "{h}");
        }
        for h in [
            "evil.example",
            "evil.example:8000",
            "localhost.evil.example",
            "10.0.0.1:8000",
            "[::2]:1",
            "",
        ] {
            assert!(!loopback_host(h), "{h}");
        }
    }

    #[test]
    fn keys_from_a_file_or_the_environment_are_read_line_by_line() {
        let keys = parse_keys("# ops\nk1\n\n  k2 acme  \n", &['\n']).unwrap();
        let got: Vec<_> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (k.key().to_owned(), k.tenant(i)))
            .collect();
        assert_eq!(
            got,
            [("k1".into(), "key-1".into()), ("k2".into(), "acme".into())]
        );
        assert_eq!(parse_keys("a,b x", &['\n', ',']).unwrap().len(), 2);
        // Errors point at the entry, never show the key.
        let e = parse_keys("s3cret a b", &['\n']).unwrap_err();
        assert!(e.contains("entry 1") && !e.contains("s3cret"), "{e}");
        let e = parse_keys("ok\ns3cret bad/tenant", &['\n']).unwrap_err();
        assert!(e.contains("entry 2") && !e.contains("s3cret"), "{e}");
    }

    #[test]
    fn an_api_key_is_bare_or_names_its_tenant_and_nothing_else() {
        let keys: Vec<ApiKey> =
            serde_json::from_value(json!(["k1", {"key": "k2", "tenant": "acme"}])).unwrap();
        assert_eq!(
            (keys[0].tenant(0), keys[1].tenant(1)),
            ("key-1".into(), "acme".into())
        );
        // A field it does not know is an error, not a limit quietly dropped.
        let extra = json!([{"key": "k", "tenant": "acme", "requests_per_minute": 60}]);
        assert!(serde_json::from_value::<Vec<ApiKey>>(extra).is_err());
    }

    #[test]
    fn a_tenant_header_cannot_name_another_keys_tenant() {
        let config: ServerConfig = serde_json::from_value(json!({
            "api_keys": [{"key": "ka", "tenant": "tenant-a"}, "kc", "kd"],
            "tenant_header": "x-tenant-id",
        }))
        .unwrap();
        let tenant = |key: &KeyTenant, header: &str| {
            let mut h = HeaderMap::new();
            h.insert("x-tenant-id", header.parse().unwrap());
            config.traffic(&h, Some(key)).map(|t| t.tenant)
        };
        let (ka, kc) = (
            KeyTenant("tenant-a".into(), true),
            KeyTenant("key-2".into(), false),
        );
        // A bare key naming a named key's tenant, or another bare key's: refused.
        for other in ["tenant-a", "key-3"] {
            let e = tenant(&kc, other).unwrap_err();
            assert_eq!(
                (e.status, e.code.as_ref(), e.param.as_deref()),
                (
                    StatusCode::FORBIDDEN,
                    "permission_denied",
                    Some("x-tenant-id")
                ),
                "{other}"
            );
        }
        // Its own, or a tenant no key has (a gateway's): taken.
        assert_eq!(tenant(&kc, "key-2").unwrap().as_deref(), Some("key-2"));
        assert_eq!(tenant(&kc, "gw-1").unwrap().as_deref(), Some("gw-1"));
        // `key-N` past the list, or the place of a named key, is no bare key's tenant.
        assert_eq!(tenant(&kc, "key-9").unwrap().as_deref(), Some("key-9"));
        assert_eq!(tenant(&kc, "key-1").unwrap().as_deref(), Some("key-1"));
        // A named key's own tenant decides, whatever the header says.
        assert_eq!(
            tenant(&ka, "tenant-a").unwrap().as_deref(),
            Some("tenant-a")
        );
        assert_eq!(tenant(&ka, "key-2").unwrap().as_deref(), Some("tenant-a"));
        // Without keys, the header is the gateway's word.
        let open: ServerConfig =
            serde_json::from_value(json!({"tenant_header": "x-tenant-id"})).unwrap();
        let mut h = HeaderMap::new();
        h.insert("x-tenant-id", "tenant-a".parse().unwrap());
        assert_eq!(
            open.traffic(&h, None).unwrap().tenant.as_deref(),
            Some("tenant-a")
        );
    }

    #[test]
    fn only_safe_request_ids_are_taken() {
        for ok in [
            "req-1",
            "0f8fad5b-d9cb-469f-a165-70867728950e",
            "trace:span.1_a",
        ] {
            assert!(request_id_ok(ok), "{ok}");
        }
        let long = "a".repeat(REQUEST_ID_MAX + 1);
        for bad in ["", "a\"b", "x=1", "a b", "a\tb", "é", long.as_str()] {
            assert!(!request_id_ok(bad), "{bad:?}");
        }
        let mut h = HeaderMap::new();
        h.insert(REQUEST_ID, "id\" level=error".parse().unwrap());
        assert!(request_id(&h).is_none());
    }

    #[test]
    fn metadata_is_bounded_as_openai_bounds_it() {
        let param = |m: serde_json::Value| {
            crate::openai::request::check_metadata(Some(&m))
                .err()
                .and_then(|e| e.param)
        };
        assert_eq!(param(json!({"a": "b"})), None);
        assert_eq!(param(json!(null)), None);
        let pairs: serde_json::Map<String, serde_json::Value> =
            (0..16).map(|i| (format!("k{i}"), json!("v"))).collect();
        assert_eq!(param(json!(pairs)), None);
        let mut many = pairs.clone();
        many.insert("k16".into(), json!("v"));
        assert_eq!(param(json!(many)).as_deref(), Some("metadata"));
        assert_eq!(
            param(json!({"k".repeat(65): "v"})).as_deref(),
            Some("metadata")
        );
        assert_eq!(param(json!({"k".repeat(64): "v".repeat(512)})), None);
        assert_eq!(
            param(json!({"k": "v".repeat(513)})).as_deref(),
            Some("metadata.k")
        );
        assert_eq!(param(json!({"k": 1})).as_deref(), Some("metadata.k"));
        assert_eq!(
            param(json!({"k": {"nested": "x"}})).as_deref(),
            Some("metadata.k")
        );
        assert_eq!(param(json!(["a"])).as_deref(), Some("metadata"));
    }

    #[test]
    fn store_bounds_give_each_tenant_its_share() {
        let b: StoreBounds = serde_json::from_value(json!({
            "max_responses": 100, "max_bytes": 1 << 20, "max_tenant_share": 0.25
        }))
        .unwrap();
        let bucket = b.bucket("r".into());
        assert_eq!((bucket.max_entries, bucket.max_owner_entries), (100, 25));
        assert_eq!(
            (bucket.max_bytes, bucket.max_owner_bytes),
            (1 << 20, 1 << 18)
        );
        let d = StoreBounds::default();
        assert_eq!((d.max_bytes, d.max_tenant_share), (256 << 20, 1.0));
        let bad: ServerConfig = serde_json::from_value(json!({
            "responses_store": {"max_bytes": 1000, "max_tenant_share": 0}
        }))
        .unwrap();
        let fields: Vec<Option<String>> = bad.validate().into_iter().map(|i| i.field).collect();
        for f in [
            "responses_store.max_bytes",
            "responses_store.max_tenant_share",
        ] {
            assert!(fields.contains(&Some(f.to_owned())), "{fields:?}");
        }
    }
}
