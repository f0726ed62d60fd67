//! `route`'s `admission` settings as a graph gives them: the places per worker, the queue's
//! bound and longest wait, the tenants' weights and rate limits, the reserve and preemption —
//! and `admission` itself as a switch (`false`, `true`, `null`) as well as a map.

use std::collections::BTreeMap;

use serde::Deserialize;

/// `route`'s `admission` settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Requests in flight per live worker before new ones wait; by default the batch size
    /// each worker advertises.
    #[serde(default)]
    pub per_worker: Option<u32>,
    /// Requests that may wait at once.
    #[serde(default = "queue")]
    pub queue: usize,
    /// How long a request may wait before it is refused.
    #[serde(default = "max_wait_s")]
    pub max_wait_s: f64,
    /// Named tenants' weights and limits.
    #[serde(default)]
    pub tenants: BTreeMap<String, TenantConfig>,
    /// Those of every other tenant, and of requests without one (each tenant counted on its
    /// own).
    #[serde(default)]
    pub tenant_default: TenantConfig,
    /// Places per live worker that no one tenant may take: kept free for the others, so a
    /// light tenant's request starts at once while a heavy one fills the rest (0: none; a
    /// single tenant then gets `per_worker - reserve`).
    #[serde(default)]
    pub reserve: u32,
    /// A request that comes before some in flight (a better priority, or a tenant under its
    /// share against one over it: [`Precedence`](dyn_protocol::types::Precedence)) goes at
    /// once, beyond the room, to a worker where one of those runs, and the engine preempts
    /// that one for it (the native engine and the mocker do). Off: priorities and tenants only
    /// order the queue, for engines that would queue such a request instead (external workers
    /// do not get the priority).
    #[serde(default = "yes")]
    pub preempt: bool,
}

fn yes() -> bool {
    true
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            per_worker: None,
            queue: queue(),
            max_wait_s: max_wait_s(),
            tenants: BTreeMap::new(),
            tenant_default: TenantConfig::default(),
            reserve: 0,
            preempt: true,
        }
    }
}

/// The places of a worker that advertises no batch size (an external server) when
/// `per_worker` is not set: vLLM's default `max_num_seqs`, so such a worker's own queue
/// still decides, as it did before admission was on by default.
pub const UNADVERTISED_PLACES: u32 = 256;

impl AdmissionConfig {
    /// The places of a worker that advertises `max_num_seqs` (`per_worker` where set).
    pub fn places(&self, max_num_seqs: Option<u32>) -> u32 {
        self.per_worker
            .or(max_num_seqs)
            .unwrap_or(UNADVERTISED_PLACES)
            .max(1)
    }

    /// `admission` in a graph: `false` (or `null`) for none, `true` for the defaults, or the
    /// settings; absent, the defaults.
    pub fn deserialize_option<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Self>, D::Error> {
        // A visitor rather than an untagged enum: a mistake inside the settings keeps its own
        // error (an unknown field, with its position), and a switch read from YAML as text
        // (`--set route.admission=false`) is still a switch.
        struct Switch;
        impl<'de> serde::de::Visitor<'de> for Switch {
            type Value = Option<AdmissionConfig>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("`false`, `true` or the admission settings")
            }
            fn visit_bool<E: serde::de::Error>(self, on: bool) -> Result<Self::Value, E> {
                Ok(on.then(AdmissionConfig::default))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                match v {
                    "true" => self.visit_bool(true),
                    "false" => self.visit_bool(false),
                    // marked-yaml reads `null`, `~` and an empty value as text.
                    "null" | "~" | "" => Ok(None),
                    _ => Err(E::invalid_value(serde::de::Unexpected::Str(v), &self)),
                }
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_some<D: serde::Deserializer<'de>>(
                self,
                d: D,
            ) -> Result<Self::Value, D::Error> {
                d.deserialize_any(self)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                m: A,
            ) -> Result<Self::Value, A::Error> {
                AdmissionConfig::deserialize(serde::de::value::MapAccessDeserializer::new(m))
                    .map(Some)
            }
        }
        d.deserialize_any(Switch)
    }
}

/// One tenant's share and limits.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// Its share of the room relative to the others' (1 by default).
    #[serde(default = "one")]
    pub weight: f64,
    #[serde(default)]
    pub requests_per_minute: Option<u32>,
    /// Prompt + `max_tokens` per minute.
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
}

impl Default for TenantConfig {
    fn default() -> Self {
        Self {
            weight: 1.0,
            requests_per_minute: None,
            tokens_per_minute: None,
        }
    }
}

fn one() -> f64 {
    1.0
}

fn queue() -> usize {
    256
}
fn max_wait_s() -> f64 {
    2.0
}
