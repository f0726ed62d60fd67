//! API keys and the tenants they name: read from the graph, a file or the environment
//! ([`ApiKey`], [`parse_keys`]), and the tenant a request's key gave it ([`KeyTenant`]).

use serde::Deserialize;

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
