//! dyn-frontend: the HTTP ingresses — the OpenAI-compatible `http` kind ([`openai`]) with its
//! admin routes ([`admin`]) and `/metrics`, and the debugging `http_text` kind ([`text`]) —
//! and the frontend's metrics ([`metrics`]). It must not depend on any engine (dyn-engine,
//! dyn-external): changing an engine must not recompile the frontend.
//!
//! HTTP ingresses and the plumbing they share: binding, OpenAI-style error objects, API keys,
//! health endpoints, body limits and graceful shutdown.
//!
//! Errors that reach a client are OpenAI error objects
//! (`{"error": {"message", "type", "param", "code"}}`) with a stable `type` and `code`; detail
//! meant for operators goes to the log.

pub mod admin;
mod answer;
mod anthropic;
mod conn;
mod embeddings;
pub mod harmony;
pub mod http;
pub mod lora;
pub mod metrics;
pub mod openai;
mod pipeline;
pub mod reasoning;
mod responses;
pub mod text;
mod tokenize;
pub mod tools;

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Json;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use dyn_core::{BuildError, Chain, ErrorKind, Invalid, OpError, Payload, ShutdownSignal};
use serde::Deserialize;
use serde_json::json;
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;
use tower_http::request_id::{MakeRequestId, PropagateRequestIdLayer, SetRequestIdLayer};

/// Settings every HTTP ingress accepts (flattened into its config).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// Address to listen on. Loopback by default: exposing a server is a deliberate choice.
    #[serde(default = "default_listen")]
    pub listen: String,
    /// Largest request body accepted; bigger ones get 413.
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    /// When non-empty, requests must carry `Authorization: Bearer <one of these>`. A key
    /// may name its tenant (`{key, tenant}`); a bare key's tenant is `key-N`, N its place in
    /// this list from 1.
    #[serde(default)]
    pub api_keys: Vec<ApiKey>,
    /// A file of more API keys, so they need not be in the graph or on a command line: one
    /// per line, `KEY` or `KEY TENANT`; blank lines and `#` comments are skipped. Keys in the
    /// environment variable `DYN_API_KEYS` (same form, lines or commas) are added too.
    #[serde(default)]
    pub api_keys_file: Option<std::path::PathBuf>,
    /// A header that names the request's tenant (say `x-tenant-id`), as a gateway in front
    /// sets it; where present it wins over a bare API key's tenant, not over a key that names
    /// its own. It may not name a tenant that another API key has (a 403): a bare key is a
    /// gateway's, not a way into every tenant's stored responses and limits. `http` only.
    #[serde(default)]
    pub tenant_header: Option<String>,
    /// Names for priorities that the `x-priority` header may give instead of a number
    /// (`{interactive: 0, batch: 10}`). `http` only.
    #[serde(default)]
    pub priority_classes: std::collections::BTreeMap<String, i32>,
    /// Seconds a request may take, end to end, unless its `x-request-timeout` header asks for
    /// less; past it the request is cancelled everywhere it is (queue, router, prefill,
    /// engine). None: no limit but the client's own.
    #[serde(default)]
    pub request_timeout_s: Option<f64>,
    /// Connections served at once; one more is closed as it arrives (a flood of idle or slow
    /// connections cannot take the process's file descriptors).
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Seconds a client gets to send a request's headers (each request of a kept-alive
    /// connection too); a slower one is disconnected (slowloris).
    #[serde(default = "default_header_read_timeout_s")]
    pub header_read_timeout_s: f64,
    /// Seconds a connection's writes may make no progress (the client stopped reading and
    /// the socket stays full); past it the connection is closed, its place freed and its
    /// request cancelled. A client that keeps reading, however slowly, is never cut off.
    #[serde(default = "default_write_timeout_s")]
    pub write_timeout_s: f64,
    /// When set, `/metrics` asks for `Authorization: Bearer <this>` (also from
    /// `DYN_METRICS_KEY`).
    #[serde(default)]
    pub metrics_key: Option<String>,
    /// More `Host` names a loopback server answers (a reverse proxy on this host that passes
    /// the public name on); `"*"` answers any. A server on another address checks none.
    #[serde(default)]
    pub allowed_hosts: Vec<String>,
    /// When set, `/admin/*` asks for `Authorization: Bearer <this>` besides a loopback peer
    /// (a reverse proxy on the same host makes every peer loopback); also from
    /// `DYN_ADMIN_KEY`.
    #[serde(default)]
    pub admin_key: Option<String>,
    /// The most alternatives a request may ask with each token's log-probability
    /// (completions' `logprobs`, chat's `top_logprobs`): vLLM's `max_logprobs` default,
    /// which evaluation harnesses expect. `http` only.
    #[serde(default = "default_max_logprobs")]
    pub max_logprobs: u32,
    /// The Responses API's store (`store`, `previous_response_id`, `GET /v1/responses/{id}`):
    /// how many responses are kept, in how many bytes, how much of it one tenant may hold,
    /// and for how long. `http` only.
    #[serde(default)]
    pub responses_store: StoreBounds,
}

/// A store's bounds: past `max_responses` or `max_bytes` a response goes, the oldest of the
/// tenant holding the most; a tenant past `max_tenant_share` of either loses its own oldest;
/// none is kept past `max_age_s`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreBounds {
    #[serde(default = "default_max_responses")]
    pub max_responses: u64,
    /// Bytes of stored records (each at most [`MAX_STORED_RESPONSE_BYTES`]).
    #[serde(default = "default_store_max_bytes")]
    pub max_bytes: u64,
    /// The part of `max_responses` and of `max_bytes` one tenant may hold, in (0, 1].
    #[serde(default = "default_max_tenant_share")]
    pub max_tenant_share: f64,
    #[serde(default = "default_store_max_age_s")]
    pub max_age_s: f64,
}

impl Default for StoreBounds {
    fn default() -> Self {
        Self {
            max_responses: default_max_responses(),
            max_bytes: default_store_max_bytes(),
            max_tenant_share: default_max_tenant_share(),
            max_age_s: default_store_max_age_s(),
        }
    }
}

impl StoreBounds {
    /// The store bucket these bounds make, named `name`.
    pub fn bucket(&self, name: String) -> dyn_core::planes::Bucket {
        let share = |max: u64| ((max as f64 * self.max_tenant_share) as u64).max(1);
        dyn_core::planes::Bucket {
            name,
            max_entries: self.max_responses,
            max_bytes: self.max_bytes,
            max_owner_entries: share(self.max_responses),
            max_owner_bytes: share(self.max_bytes),
            max_age: Duration::from_secs_f64(self.max_age_s),
        }
    }
}

/// The largest stored response (its record: the response object and its turn of the
/// conversation, as JSON): a NATS server takes messages of up to 1 MiB by default.
pub const MAX_STORED_RESPONSE_BYTES: u64 = 960 << 10;

fn default_max_responses() -> u64 {
    10_000
}

/// 256 MiB: thousands of ordinary conversations' turns, and a bound a frontend's memory (or
/// a NATS server's disk) can afford whatever the records hold.
fn default_store_max_bytes() -> u64 {
    256 << 20
}

/// All of it: a full store already takes from the tenant holding the most, so one tenant
/// cannot push the others out; a smaller share caps each tenant below the whole.
fn default_max_tenant_share() -> f64 {
    1.0
}

/// A day: long enough to continue a conversation, short enough that a store of turns does
/// not become an archive nobody asked for.
fn default_store_max_age_s() -> f64 {
    86_400.0
}

fn default_max_connections() -> usize {
    4096
}

/// Longer than load balancers keep idle connections (60 s is common): hyper's timer also runs
/// while a kept-alive connection waits for its next request, and a balancer that finds its
/// pooled connection closed fails the request it sent on it.
fn default_header_read_timeout_s() -> f64 {
    75.0
}

/// Long enough for a client paused by a garbage collection or a congested link, short enough
/// that clients which stopped reading do not pile up against `max_connections`.
fn default_write_timeout_s() -> f64 {
    30.0
}

fn default_max_logprobs() -> u32 {
    20
}

/// The most a graph may set `max_logprobs` to: each alternative is a sort over the
/// vocabulary's head and a line of the answer, per token.
const MAX_LOGPROBS_BOUND: u32 = 1024;

fn default_listen() -> String {
    "127.0.0.1:8000".to_owned()
}

fn default_max_body() -> usize {
    4 << 20
}

impl ServerConfig {
    pub fn validate(&self) -> Vec<Invalid> {
        let mut out = Vec::new();
        if self.listen.parse::<SocketAddr>().is_err() {
            out.push(Invalid::field(
                "listen",
                format!("`{}` is not an address like 127.0.0.1:8000", self.listen),
            ));
        }
        if self.max_body_bytes == 0 {
            out.push(Invalid::field("max_body_bytes", "must be at least 1"));
        }
        if self.api_keys.iter().any(|k| k.key().is_empty()) {
            out.push(Invalid::field("api_keys", "keys must not be empty"));
        }
        if self
            .api_keys
            .iter()
            .any(|k| matches!(k, ApiKey::Named(n) if !tenant_name_ok(&n.tenant)))
        {
            out.push(Invalid::field("api_keys", TENANT_NAME_RULE));
        }
        if let Some(h) = &self.tenant_header
            && axum::http::HeaderName::from_bytes(h.as_bytes()).is_err()
        {
            out.push(Invalid::field(
                "tenant_header",
                format!("`{h}` is not a header name"),
            ));
        }
        if self.responses_store.max_responses == 0 {
            out.push(Invalid::field(
                "responses_store.max_responses",
                "must be at least 1",
            ));
        }
        if self.responses_store.max_bytes < 1 << 20 {
            out.push(Invalid::field(
                "responses_store.max_bytes",
                format!(
                    "must be at least 1 MiB (1048576): one stored response may take up to {} KiB",
                    MAX_STORED_RESPONSE_BYTES >> 10
                ),
            ));
        }
        let share = self.responses_store.max_tenant_share;
        if !(share > 0.0 && share <= 1.0) {
            out.push(Invalid::field(
                "responses_store.max_tenant_share",
                format!("must be more than 0 and at most 1, got {share}"),
            ));
        }
        let age = self.responses_store.max_age_s;
        if !(1.0..=365.0 * 86_400.0).contains(&age) {
            out.push(Invalid::field(
                "responses_store.max_age_s",
                format!("must be from 1 second to a year, got {age}"),
            ));
        }
        if let Some(t) = self.request_timeout_s
            && !(t.is_finite() && t > 0.0)
        {
            out.push(Invalid::field(
                "request_timeout_s",
                "must be a positive number of seconds",
            ));
        }
        if !(self.header_read_timeout_s.is_finite()
            && (0.01..=3600.0).contains(&self.header_read_timeout_s))
        {
            out.push(Invalid::field(
                "header_read_timeout_s",
                "must be between 0.01 and 3600 seconds",
            ));
        }
        if !(self.write_timeout_s.is_finite() && (0.01..=3600.0).contains(&self.write_timeout_s)) {
            out.push(Invalid::field(
                "write_timeout_s",
                "must be between 0.01 and 3600 seconds",
            ));
        }
        if self.max_logprobs > MAX_LOGPROBS_BOUND {
            out.push(Invalid::field(
                "max_logprobs",
                format!("must be at most {MAX_LOGPROBS_BOUND}"),
            ));
        }
        if !(1..=1 << 20).contains(&self.max_connections) {
            out.push(Invalid::field("max_connections", "must be 1 to 1048576"));
        }
        for (name, k) in [
            ("metrics_key", &self.metrics_key),
            ("admin_key", &self.admin_key),
        ] {
            if k.as_deref().is_some_and(str::is_empty) {
                out.push(Invalid::field(name, "must not be empty"));
            }
        }
        out
    }

    /// A new request's context: its id (`x-request-id`, else a new one) and its deadline
    /// (`x-request-timeout` in seconds, at most `request_timeout_s`). A timeout that is not a
    /// positive number is a 400.
    pub fn request_ctx<Req, Resp>(
        &self,
        chain: &Chain<Req, Resp>,
        headers: &HeaderMap,
    ) -> Result<dyn_core::Ctx, ApiError>
    where
        Req: Payload,
        Resp: Payload,
    {
        let asked = match headers.get(REQUEST_TIMEOUT) {
            None => None,
            Some(v) => match v.to_str().ok().and_then(|v| v.trim().parse::<f64>().ok()) {
                Some(t) if t.is_finite() && t > 0.0 => Some(t),
                _ => {
                    return Err(ApiError::invalid(
                        "invalid_request_timeout",
                        format!("{REQUEST_TIMEOUT} must be a positive number of seconds"),
                    )
                    .with_param(REQUEST_TIMEOUT));
                }
            },
        };
        let ctx = chain.ctx(request_id(headers));
        let limit = match (asked, self.request_timeout_s) {
            (Some(a), Some(d)) => Some(a.min(d)),
            (a, d) => a.or(d),
        };
        // Beyond a year is no limit (and would overflow the clock).
        Ok(match limit.filter(|t| *t < 3.15e7) {
            Some(t) => ctx.with_timeout(Duration::from_secs_f64(t)),
            None => ctx,
        })
    }

    /// These settings with the API keys from `api_keys_file` and `DYN_API_KEYS` added.
    pub fn resolved(&self) -> Result<ServerConfig, BuildError> {
        let mut out = self.clone();
        if let Some(path) = &self.api_keys_file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| BuildError::new(format!("api_keys_file {}: {e}", path.display())))?;
            out.api_keys.extend(
                parse_keys(&text, &['\n']).map_err(|e| {
                    BuildError::new(format!("api_keys_file {}: {e}", path.display()))
                })?,
            );
        }
        for (var, slot) in [
            ("DYN_METRICS_KEY", &mut out.metrics_key),
            ("DYN_ADMIN_KEY", &mut out.admin_key),
        ] {
            if let Some(k) = std::env::var_os(var).filter(|k| !k.is_empty()) {
                *slot = Some(k.to_string_lossy().into_owned());
            }
        }
        if let Some(text) = std::env::var_os(API_KEYS_ENV) {
            let text = text.to_string_lossy();
            out.api_keys.extend(
                parse_keys(&text, &['\n', ','])
                    .map_err(|e| BuildError::new(format!("{API_KEYS_ENV}: {e}")))?,
            );
        }
        Ok(out)
    }

    /// Bind at build time so a taken port fails start-up with a clear message.
    pub async fn bind(&self, node: &str) -> Result<TcpListener, BuildError> {
        let listener = TcpListener::bind(&self.listen)
            .await
            .map_err(|e| BuildError::new(format!("cannot listen on {}: {e}", self.listen)))?;
        let addr = listener
            .local_addr()
            .map_err(|e| BuildError::new(format!("cannot read the bound address: {e}")))?;
        tracing::info!(node, addr = %addr, "HTTP ingress listening");
        Ok(listener)
    }
}

/// API keys in the environment (see [`ServerConfig::api_keys_file`]).
pub const API_KEYS_ENV: &str = "DYN_API_KEYS";

/// Keys written `KEY` or `KEY TENANT`, one per entry (entries split at `seps`); blank entries
/// and `#` comments skipped. Errors name the entry by its place, never by its text (a key).
fn parse_keys(text: &str, seps: &[char]) -> Result<Vec<ApiKey>, String> {
    let mut out = Vec::new();
    for (n, entry) in text.split(seps).enumerate() {
        let entry = entry.trim();
        if entry.is_empty() || entry.starts_with('#') {
            continue;
        }
        let mut words = entry.split_whitespace();
        let key = words.next().unwrap_or_default().to_owned();
        match (words.next(), words.next()) {
            (None, _) => out.push(ApiKey::Bare(key)),
            (Some(t), None) if tenant_name_ok(t) => out.push(ApiKey::Named(NamedKey {
                key,
                tenant: t.to_owned(),
            })),
            (Some(_), None) => return Err(format!("entry {}: {TENANT_NAME_RULE}", n + 1)),
            (Some(_), Some(_)) => {
                return Err(format!("entry {}: write `KEY` or `KEY TENANT`", n + 1));
            }
        }
    }
    Ok(out)
}

/// An API key, bare or naming its tenant.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a key, or {key, tenant}")]
pub enum ApiKey {
    Bare(String),
    Named(NamedKey),
}

/// A key naming its tenant (a struct of its own, so that an unknown field is an error).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedKey {
    pub key: String,
    pub tenant: String,
}

impl ApiKey {
    pub fn key(&self) -> &str {
        match self {
            ApiKey::Bare(k) | ApiKey::Named(NamedKey { key: k, .. }) => k,
        }
    }

    /// Its tenant; `place` is its index in `api_keys`.
    fn tenant(&self, place: usize) -> String {
        match self {
            ApiKey::Bare(_) => format!("key-{}", place + 1),
            ApiKey::Named(n) => n.tenant.clone(),
        }
    }
}

/// The tenant of the API key a request carried (set by [`require_api_key`]), and whether the
/// key names it (then no header may say otherwise).
#[derive(Debug, Clone)]
pub struct KeyTenant(pub String, pub bool);

const TENANT_NAME_RULE: &str = "a tenant is 1 to 64 letters, digits, '.', '_' or '-'";

/// Whether `t` may name a tenant (`TENANT_NAME_RULE`).
pub fn tenant_name_ok(t: &str) -> bool {
    (1..=64).contains(&t.len())
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The header that gives a request's priority: a number (lower first) or a class named in
/// `priority_classes`.
pub const PRIORITY: &str = "x-priority";

/// The header that names a request's session (its conversation), for session affinity.
pub const SESSION: &str = "x-session-id";

/// The longest session id taken (header or `user`).
pub const SESSION_MAX: usize = 256;

/// What a request's headers say of its traffic class.
#[derive(Debug, Default)]
pub struct Traffic {
    pub tenant: Option<String>,
    pub priority: Option<i32>,
    pub session: Option<String>,
}

impl ServerConfig {
    /// A request's tenant, priority and session from its headers: a key that names its tenant
    /// decides (a header cannot move its holder to another tenant's share and limits), else
    /// the tenant header where configured and present (a gateway's word), else the key's;
    /// `x-priority` and `x-session-id` where present. A malformed one is a 400 naming the
    /// header; a tenant header naming another key's tenant is a 403.
    pub fn traffic(
        &self,
        headers: &HeaderMap,
        key: Option<&KeyTenant>,
    ) -> Result<Traffic, ApiError> {
        let bad = |name: &str, why: String| {
            ApiError::invalid("invalid_header", why).with_param(name.to_string())
        };
        let header = match key {
            Some(KeyTenant(_, true)) => None,
            _ => self.tenant_header.as_deref(),
        };
        let tenant = match header.and_then(|h| Some((h, headers.get(h)?))) {
            Some((h, v)) => match v.to_str().ok().filter(|t| tenant_name_ok(t)) {
                // Another key's tenant is that key's holder's alone: naming it would read its
                // stored responses and spend its limits.
                Some(t) if key.is_some_and(|k| k.0 != t) && self.key_owns(t) => {
                    return Err(ApiError::new(
                        StatusCode::FORBIDDEN,
                        "invalid_request_error",
                        "permission_denied",
                        format!(
                            "{h} names tenant `{t}`, which belongs to another API key; \
                             use that tenant's key, or a tenant no key has"
                        ),
                    )
                    .with_param(h));
                }
                Some(t) => Some(t.to_string()),
                None => return Err(bad(h, format!("{h}: {TENANT_NAME_RULE}"))),
            },
            None => key.map(|k| k.0.clone()),
        };
        let priority = match headers.get(PRIORITY) {
            None => None,
            Some(v) => {
                let v = v.to_str().unwrap_or_default().trim();
                match v
                    .parse::<i32>()
                    .ok()
                    .or_else(|| self.priority_classes.get(v).copied())
                {
                    Some(p) => Some(p),
                    None => {
                        let names: Vec<&str> =
                            self.priority_classes.keys().map(String::as_str).collect();
                        return Err(bad(
                            PRIORITY,
                            format!(
                                "{PRIORITY} must be an integer or one of the graph's classes ({})",
                                names.join(", ")
                            ),
                        ));
                    }
                }
            }
        };
        let session = match headers.get(SESSION) {
            None => None,
            Some(v) => match v
                .to_str()
                .ok()
                .filter(|s| (1..=SESSION_MAX).contains(&s.len()))
            {
                Some(s) => Some(s.to_string()),
                None => {
                    return Err(bad(
                        SESSION,
                        format!("{SESSION} must be 1 to {SESSION_MAX} visible ASCII characters"),
                    ));
                }
            },
        };
        Ok(Traffic {
            tenant,
            priority,
            session,
        })
    }
}

impl ServerConfig {
    /// Whether an API key has `tenant` as its own: one naming it, or the bare key whose
    /// place makes it (`key-N`).
    fn key_owns(&self, tenant: &str) -> bool {
        let bare = tenant
            .strip_prefix("key-")
            .and_then(|n| n.parse::<usize>().ok())
            .and_then(|n| self.api_keys.get(n.checked_sub(1)?))
            .is_some_and(|k| matches!(k, ApiKey::Bare(_)));
        bare || self
            .api_keys
            .iter()
            .any(|k| matches!(k, ApiKey::Named(n) if n.tenant == tenant))
    }
}

/// The header that sets a request's deadline, in seconds from its arrival.
pub const REQUEST_TIMEOUT: &str = "x-request-timeout";

/// An error response in OpenAI's shape.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: Cow<'static, str>,
    pub message: String,
    pub param: Option<String>,
    /// Seconds for `Retry-After` (a 503 says 1 unless told).
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: impl Into<Cow<'static, str>>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            kind,
            code: code.into(),
            message: message.into(),
            param: None,
            retry_after_s: None,
        }
    }

    pub fn invalid(code: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message,
        )
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

/// What a failure is for the client when it came as the request's deadline passed (`late`):
/// the deadline's (504), unless it is a refusal for want of room or workers, which keeps its
/// 503 and `Retry-After`. Both ingresses answer so.
pub(crate) fn at_deadline(e: ApiError, late: bool) -> ApiError {
    if late && e.status != StatusCode::SERVICE_UNAVAILABLE {
        OpError::deadline_exceeded().into()
    } else {
        e
    }
}

impl From<OpError> for ApiError {
    fn from(e: OpError) -> Self {
        let param = e.param;
        let retry_after_s = e.retry_after_s;
        let mut api = match e.kind {
            ErrorKind::InvalidRequest => ApiError::invalid(
                e.code.unwrap_or(Cow::Borrowed("invalid_request")),
                e.message,
            ),
            ErrorKind::Unavailable => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                e.code.unwrap_or(Cow::Borrowed("no_worker_available")),
                e.message,
            ),
            ErrorKind::Overloaded => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                e.code.unwrap_or(Cow::Borrowed(dyn_core::WORKER_BUSY)),
                e.message,
            ),
            ErrorKind::RateLimited => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                e.code
                    .unwrap_or(Cow::Borrowed(dyn_core::RATE_LIMIT_EXCEEDED)),
                e.message,
            ),
            ErrorKind::InstanceLost => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                e.code.unwrap_or(Cow::Borrowed(dyn_core::INSTANCE_LOST)),
                e.message,
            ),
            ErrorKind::Cancelled if e.code.as_deref() == Some(dyn_core::DEADLINE_EXCEEDED) => {
                ApiError::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "timeout_error",
                    dyn_core::DEADLINE_EXCEEDED,
                    e.message,
                )
            }
            ErrorKind::Cancelled => ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "request_cancelled",
                "cancelled",
                e.message,
            ),
            ErrorKind::Internal => {
                tracing::error!(error = %e.message, "Internal error answered as 500");
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal_error",
                    "internal_error",
                    "internal error",
                )
            }
        };
        api.param = param;
        api.retry_after_s = retry_after_s;
        api
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        // A refusal for want of room (or over a rate limit) may be asked again; say when
        // (RFC 9110 §10.2.3).
        let retry = match self.status {
            StatusCode::SERVICE_UNAVAILABLE => Some(self.retry_after_s.unwrap_or(1)),
            StatusCode::TOO_MANY_REQUESTS => self.retry_after_s,
            _ => None,
        };
        if let Some(s) = retry {
            return (
                self.status,
                [(axum::http::header::RETRY_AFTER, s.max(1).to_string())],
                Json(self.body()),
            )
                .into_response();
        }
        (self.status, Json(self.body())).into_response()
    }
}

/// Turn an axum body rejection (too large, unreadable) into an OpenAI error.
pub fn body_error(rejection: axum::extract::rejection::BytesRejection) -> ApiError {
    let status = rejection.status();
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::new(
            status,
            "invalid_request_error",
            "request_too_large",
            "request body is too large",
        )
    } else {
        ApiError::new(
            status,
            "invalid_request_error",
            "invalid_body",
            rejection.body_text(),
        )
    }
}

/// A 400 for a field whose value is wrong (`invalid_value`), naming the field.
pub(crate) fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
    ApiError::invalid("invalid_value", message).with_param(param)
}

/// Parse a JSON body with serde's message (line, column, field) as the client's error: code
/// `invalid_json` where the body is not JSON, `invalid_value` where it is JSON of the wrong
/// shape (a field missing, of another type, a value out of its set).
pub fn parse_json<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let code = match e.classify() {
            serde_json::error::Category::Data => "invalid_value",
            _ => "invalid_json",
        };
        ApiError::invalid(code, format!("invalid request body: {e}"))
    })
}

/// The request's `x-request-id` (the client's, or one [`app`]'s layer generated), if it is
/// usable as ours.
pub fn request_id(headers: &HeaderMap) -> Option<dyn_core::RequestId> {
    headers
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| request_id_ok(v))
        .map(dyn_core::RequestId::from)
}

const REQUEST_ID: &str = "x-request-id";

/// The longest client request id taken.
pub const REQUEST_ID_MAX: usize = 128;

/// Whether a client's request id is taken as it is: 1 to [`REQUEST_ID_MAX`] letters, digits,
/// `-`, `_`, `.` or `:` (UUIDs, ULIDs, trace ids). Anything else — quotes, `=`, spaces,
/// control characters — could forge fields or lines in the logs that carry the id, so it is
/// replaced by a new one.
pub fn request_id_ok(id: &str) -> bool {
    (1..=REQUEST_ID_MAX).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

/// Middleware: drop an `x-request-id` that [`request_id_ok`] refuses, so the id layer makes
/// a new one (the response then carries that, and the logs never show the client's).
async fn replace_unsafe_request_id(mut req: Request, next: Next) -> Response {
    let unsafe_id = req
        .headers()
        .get_all(REQUEST_ID)
        .iter()
        .any(|v| !v.to_str().is_ok_and(request_id_ok));
    // Several ids are one too many as well: which one is meant is not the server's guess.
    if unsafe_id || req.headers().get_all(REQUEST_ID).iter().count() > 1 {
        req.headers_mut().remove(REQUEST_ID);
    }
    next.run(req).await
}

/// OpenAI's bounds on `metadata` (Responses, chat completions): at most 16 pairs, keys of at
/// most 64 characters, values strings of at most 512. A stored response keeps it, so
/// without them one request could store megabytes.
pub(crate) fn check_metadata(metadata: Option<&serde_json::Value>) -> Result<(), ApiError> {
    const PAIRS: usize = 16;
    const KEY: usize = 64;
    const VALUE: usize = 512;
    let bad = |param: String, why: String| invalid(param, why);
    let m = match metadata {
        None | Some(serde_json::Value::Null) => return Ok(()),
        Some(serde_json::Value::Object(m)) => m,
        Some(_) => {
            return Err(bad(
                "metadata".into(),
                "metadata must be an object of strings".into(),
            ));
        }
    };
    if m.len() > PAIRS {
        return Err(bad(
            "metadata".into(),
            format!("metadata may have at most {PAIRS} pairs, got {}", m.len()),
        ));
    }
    for (k, v) in m {
        // The key is not repeated back: it may be the long one.
        if k.chars().count() > KEY {
            return Err(bad(
                "metadata".into(),
                format!("metadata keys may be at most {KEY} characters"),
            ));
        }
        match v {
            serde_json::Value::String(v) if v.chars().count() <= VALUE => {}
            serde_json::Value::String(_) => {
                return Err(bad(
                    format!("metadata.{k}"),
                    format!("metadata values may be at most {VALUE} characters"),
                ));
            }
            _ => {
                return Err(bad(
                    format!("metadata.{k}"),
                    "metadata values must be strings".into(),
                ));
            }
        }
    }
    Ok(())
}

/// The id of a request that comes without `x-request-id`: dyn's usual form (32 hex digits).
#[derive(Clone, Copy)]
struct NewRequestId;

impl MakeRequestId for NewRequestId {
    fn make_request_id<B>(
        &mut self,
        _request: &axum::http::Request<B>,
    ) -> Option<tower_http::request_id::RequestId> {
        axum::http::HeaderValue::from_str(dyn_core::RequestId::random().as_str())
            .ok()
            .map(tower_http::request_id::RequestId::new)
    }
}

/// Middleware: require `Authorization: Bearer KEY` when keys are configured.
pub async fn require_api_key(
    State(keys): State<std::sync::Arc<Vec<ApiKey>>>,
    mut req: Request,
    next: Next,
) -> Response {
    if keys.is_empty() {
        return next.run(req).await;
    }
    let given = bearer(req.headers()).unwrap_or_default();
    // Every key is compared, each in constant time, and the match is picked without a
    // branch: how long the check takes says nothing about how much of a key was right.
    let (hit, place) =
        keys.iter()
            .enumerate()
            .fold((subtle::Choice::from(0), 0u64), |(hit, place), (i, key)| {
                let eq = key.key().as_bytes().ct_eq(given.as_bytes());
                (
                    hit | eq,
                    subtle::ConditionallySelectable::conditional_select(&place, &(i as u64), eq),
                )
            });
    if bool::from(hit) && !given.is_empty() {
        let place = usize::try_from(place).unwrap_or_default();
        if let Some(k) = keys.get(place) {
            let named = matches!(k, ApiKey::Named(_));
            req.extensions_mut()
                .insert(KeyTenant(k.tenant(place), named));
        }
        return next.run(req).await;
    }
    let e = ApiError::new(
        StatusCode::UNAUTHORIZED,
        "invalid_request_error",
        "invalid_api_key",
        "missing or invalid API key",
    );
    // Anthropic's clients read their own error shape.
    if req.uri().path().starts_with("/v1/messages") {
        return anthropic::error_response(e);
    }
    e.into_response()
}

pub async fn health() -> Json<serde_json::Value> {
    Json(json!({"status": "healthy"}))
}

pub async fn live() -> Json<serde_json::Value> {
    Json(json!({"status": "live"}))
}

pub async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "not_found",
        "no such route",
    )
}

/// An ingress's routes and the limits of the connections that reach them.
pub struct HttpApp {
    router: axum::Router,
    max_connections: usize,
    header_read_timeout: Duration,
    write_timeout: Duration,
}

/// The whole app of an HTTP ingress: its `api` routes behind the API-key check, its `open`
/// routes (metrics and the like, each behind its own key when set) and the probes without
/// it, a JSON 404 and the body limit. Every request has an `x-request-id` (the client's when
/// [`request_id_ok`], else a new one), echoed on the response. A server on loopback answers only requests addressed to
/// a loopback name (`Host`), so a web page cannot reach it through DNS rebinding.
pub fn app(config: &ServerConfig, api: axum::Router, open: axum::Router) -> HttpApp {
    let keys = std::sync::Arc::new(config.api_keys.clone());
    let ops = Arc::new(OpsKeys {
        metrics: config.metrics_key.clone(),
        admin: config.admin_key.clone(),
    });
    let mut router = axum::Router::new()
        .merge(api.route_layer(axum::middleware::from_fn_with_state(keys, require_api_key)))
        // `layer`, not `route_layer`: an ingress may have no open routes at all.
        .merge(open.layer(axum::middleware::from_fn_with_state(ops, require_ops_key)))
        .route("/health", axum::routing::get(health))
        .route("/live", axum::routing::get(live))
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(config.max_body_bytes));
    if config
        .listen
        .parse::<SocketAddr>()
        .is_ok_and(|a| a.ip().is_loopback())
        && !config.allowed_hosts.iter().any(|h| h == "*")
    {
        let allowed: Arc<Vec<String>> = Arc::new(
            config
                .allowed_hosts
                .iter()
                .map(|h| h.to_ascii_lowercase())
                .collect(),
        );
        router = router.layer(axum::middleware::from_fn_with_state(
            allowed,
            loopback_host_only,
        ));
    }
    HttpApp {
        router: router
            .layer(PropagateRequestIdLayer::x_request_id())
            .layer(SetRequestIdLayer::x_request_id(NewRequestId))
            // Outermost: an unsafe id is gone before the id layer looks for one.
            .layer(axum::middleware::from_fn(replace_unsafe_request_id)),
        max_connections: config.max_connections,
        header_read_timeout: Duration::from_secs_f64(config.header_read_timeout_s),
        write_timeout: Duration::from_secs_f64(config.write_timeout_s),
    }
}

/// The keys of the operators' routes.
struct OpsKeys {
    metrics: Option<String>,
    admin: Option<String>,
}

async fn require_ops_key(State(keys): State<Arc<OpsKeys>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let want = if path == "/metrics" {
        keys.metrics.as_deref()
    } else if path.starts_with("/admin") || path.ends_with("_lora_adapter") {
        keys.admin.as_deref()
    } else {
        None
    };
    let Some(want) = want else {
        return next.run(req).await;
    };
    let given = bearer(req.headers()).unwrap_or_default();
    if bool::from(given.as_bytes().ct_eq(want.as_bytes())) {
        return next.run(req).await;
    }
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "invalid_request_error",
        "invalid_api_key",
        "missing or invalid key for this endpoint",
    )
    .into_response()
}

/// The token of an `Authorization: Bearer` header, else of an `x-api-key` header (what
/// Anthropic's clients send).
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let bearer = || {
        headers
            .get(header::AUTHORIZATION)?
            .to_str()
            .ok()?
            .strip_prefix("Bearer ")
    };
    bearer().or_else(|| headers.get("x-api-key")?.to_str().ok())
}

/// Whether `host` (a `Host` header or an address: name or IP, maybe a port) names this
/// machine's loopback interface.
pub fn loopback_host(host: &str) -> bool {
    let name = dyn_trust::host_of(host);
    name.eq_ignore_ascii_case("localhost")
        || name.to_ascii_lowercase().ends_with(".localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

async fn loopback_host_only(
    State(allowed): State<Arc<Vec<String>>>,
    req: Request,
    next: Next,
) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .map(|h| h.to_str().unwrap_or("?"));
    let named = |h: &str| {
        let h = h.to_ascii_lowercase();
        let name = dyn_trust::host_of(&h);
        allowed.iter().any(|a| *a == h || *a == name)
    };
    if host.is_none_or(|h| loopback_host(h) || named(h)) {
        return next.run(req).await;
    }
    ApiError::new(
        StatusCode::MISDIRECTED_REQUEST,
        "invalid_request_error",
        "misdirected_request",
        "this server listens on loopback and answers requests for localhost only (Host header)",
    )
    .into_response()
}

/// Serve `app` until shutdown, then drain: while requests sent down `chain` are still
/// streaming, the listener stays open so load balancers can see `/health`
/// answer 503 and new API requests get a 503 `draining` error; once nothing is in flight the
/// server closes (the runtime bounds how long all this may take).
pub async fn serve<Req: Payload, Resp: Payload>(
    listener: TcpListener,
    app: HttpApp,
    shutdown: ShutdownSignal,
    chain: Chain<Req, Resp>,
) -> Result<(), OpError> {
    let draining = Arc::new(AtomicBool::new(false));
    let router = app.router.layer(axum::middleware::from_fn_with_state(
        draining.clone(),
        refuse_while_draining,
    ));
    let closed = async move {
        shutdown.await;
        draining.store(true, Ordering::Release);
        tracing::info!(
            in_flight = chain.in_flight(),
            "Draining: /health answers 503, new requests are refused"
        );
        chain.drained().await;
    };
    // hyper's own connection loop rather than `axum::serve`, which installs no timer: without
    // one hyper cannot time out a client that never finishes its headers.
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(app.header_read_timeout);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(app.max_connections));
    tokio::pin!(closed);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "HTTP accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut closed => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!(peer = %peer, "Connection limit reached; closing a new connection");
            continue;
        };
        // Streamed tokens are small writes: with Nagle's algorithm on, each one after the
        // first waits for the client's (delayed) ACK, ~40 ms on Linux, which paced every
        // stream.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
        // Peer addresses reach the handlers: the admin routes answer loopback clients only.
        let router = router.clone();
        let service =
            hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                req.extensions_mut()
                    .insert(axum::extract::ConnectInfo(peer));
                tower::ServiceExt::oneshot(router.clone(), req)
            });
        // hyper times out reading headers but not writing: a client that stops reading
        // would hold its place and its request for ever (`conn`).
        let io = conn::WriteDeadline::new(tcp, app.write_timeout, peer);
        let conn = graceful.watch(http.serve_connection(hyper_util::rt::TokioIo::new(io), service));
        let open = metrics::FRONTEND.connections.clone();
        open.inc();
        tokio::spawn(async move {
            // Ending here drops the connection's response body, and with it the request's
            // stream: cancellation reaches the engine.
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "HTTP connection ended with an error");
            }
            open.dec();
            drop(slot);
        });
    }
    // The requests sent down the chain are answered by now (the drain waited for them);
    // others (metrics, admin, the end of a stream being written) get a few seconds more, then
    // their connections are dropped with the process.
    let _ = tokio::time::timeout(Duration::from_secs(5), graceful.shutdown()).await;
    Ok(())
}

async fn refuse_while_draining(
    State(draining): State<Arc<AtomicBool>>,
    req: Request,
    next: Next,
) -> Response {
    if !draining.load(Ordering::Acquire) {
        return next.run(req).await;
    }
    match req.uri().path() {
        // Liveness and metrics still answer: the process is alive and finishing its work.
        "/live" | "/metrics" => next.run(req).await,
        "/health" => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "draining"})),
        )
            .into_response(),
        _ => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "draining",
            "the server is shutting down; retry on another replica",
        )
        .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
        let param = |m: serde_json::Value| check_metadata(Some(&m)).err().and_then(|e| e.param);
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
