//! The settings every HTTP ingress shares ([`ServerConfig`]): where it listens, how big a
//! body may be, connection and time bounds, the Responses store's bounds ([`StoreBounds`]),
//! the keys it checks and the headers it reads traffic hints from.

use std::net::SocketAddr;
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use dyn_core::{BuildError, Chain, Invalid, Payload};
use serde::Deserialize;
use tokio::net::TcpListener;

use crate::error::ApiError;
use crate::keys::{API_KEYS_ENV, ApiKey, KeyTenant, TENANT_NAME_RULE, parse_keys, tenant_name_ok};
use crate::traffic::{PRIORITY, REQUEST_TIMEOUT, SESSION, SESSION_MAX, Traffic, request_id};

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
