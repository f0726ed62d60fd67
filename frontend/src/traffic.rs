//! Who a request is from and how it asks to be treated: API keys and the tenants they name
//! ([`ApiKey`], [`KeyTenant`]), and the traffic headers (priority, session, request timeout)
//! read into a request's [`Traffic`].

use axum::http::{HeaderMap, StatusCode};
use serde::Deserialize;

use crate::*;

/// API keys in the environment (see [`ServerConfig::api_keys_file`]).
pub const API_KEYS_ENV: &str = "DYN_API_KEYS";

/// Keys written `KEY` or `KEY TENANT`, one per entry (entries split at `seps`); blank entries
/// and `#` comments skipped. Errors name the entry by its place, never by its text (a key).
pub(crate) fn parse_keys(text: &str, seps: &[char]) -> Result<Vec<ApiKey>, String> {
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
    pub(crate) fn tenant(&self, place: usize) -> String {
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

pub(crate) const TENANT_NAME_RULE: &str = "a tenant is 1 to 64 letters, digits, '.', '_' or '-'";

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
