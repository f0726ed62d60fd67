//! LoRA adapters on vLLM servers: dyn loads an adapter into a replica's server through vLLM's
//! own `POST /v1/load_lora_adapter` the first time a request of it lands there, then names it
//! in the request's `model`, so vLLM batches it with whatever else it runs (`--enable-lora`).
//!
//! Each adapter version gets its own name on the server (`NAME-VERSION`, the version the
//! ingress took from its files), so files changed in place are loaded again rather than
//! served from vLLM's old copy. Per server (its URL and start: a restarted server has lost
//! what it held) one load at a time per adapter, however many requests wait for it; at most
//! `keep` adapters stay loaded, the least recently used that no running request holds unloaded
//! past that (vLLM's own `--max-loras` / `--max-cpu-loras` bound what it keeps in memory; this
//! bounds its list).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use dyn_core::OpError;
use dyn_llm::types::LoraRef;
use parking_lot::Mutex;
use serde_json::json;
use tokio::sync::OnceCell;

use super::server::Endpoint;

/// Which server: its URL and its start.
type ServerKey = (String, u64);

/// One adapter on one server: the server, its name there, and its load (once).
type Held = (ServerKey, String, Arc<OnceCell<()>>);

/// The adapters dyn loaded into one replica's servers.
pub(crate) struct Loaded {
    /// Most recently used last.
    held: Mutex<VecDeque<Held>>,
    keep: usize,
}

/// The adapter's name on the server: its name and version.
pub(crate) fn served_name(lora: &LoraRef) -> String {
    format!("{}-{:x}", lora.name, lora.id)
}

/// The adapter key ([`LoraRef::key`]) of a name [`served_name`] gave; `None` for others.
pub(crate) fn key_of(served: &str) -> Option<String> {
    let (name, version) = served.rsplit_once('-')?;
    u64::from_str_radix(version, 16).ok()?;
    Some(format!("{name}\0{version}"))
}

impl Loaded {
    pub(crate) fn new(keep: usize) -> Self {
        Self {
            held: Mutex::new(VecDeque::new()),
            keep: keep.max(1),
        }
    }

    /// Load `lora` into the server at `ep` unless it is there already; its name there, and a
    /// hold on it: while a request keeps that, the adapter is not unloaded.
    pub(crate) async fn ensure(
        &self,
        client: &reqwest::Client,
        ep: &Endpoint,
        lora: &LoraRef,
        timeout: Duration,
    ) -> Result<(String, Arc<OnceCell<()>>), OpError> {
        let name = served_name(lora);
        let server: ServerKey = (ep.base.clone(), ep.generation);
        let (cell, evicted) = {
            let mut held = self.held.lock();
            let cell = match held.iter().position(|(s, n, _)| *s == server && *n == name) {
                Some(i) => held.remove(i).map(|(_, _, c)| c).unwrap_or_default(),
                None => Arc::default(),
            };
            held.push_back((server.clone(), name.clone(), cell.clone()));
            // The least recently used past `keep`, of those no request holds (the list's own
            // reference is the only one).
            let mut evicted = Vec::new();
            let mut i = 0;
            while held.len() > self.keep && i + 1 < held.len() {
                if Arc::strong_count(&held[i].2) == 1 {
                    evicted.extend(held.remove(i));
                } else {
                    i += 1;
                }
            }
            (cell, evicted)
        };
        for ((base, generation), old, cell) in evicted {
            // Only what was loaded, and only into the server still running.
            if cell.initialized() && generation == ep.generation && base == ep.base {
                let client = client.clone();
                tokio::spawn(async move {
                    let url = format!("{base}/v1/unload_lora_adapter");
                    let r = client
                        .post(&url)
                        .json(&json!({"lora_name": old}))
                        .timeout(timeout)
                        .send()
                        .await;
                    if let Err(e) = r {
                        tracing::debug!(lora = %old, error = %e, "Could not unload an adapter from the engine server");
                    }
                });
            }
        }
        cell.get_or_try_init(|| load(client, ep, &name, lora, timeout))
            .await?;
        Ok((name, cell))
    }

    /// The server at `ep` no longer has `lora` (it said so): load it again next time.
    pub(crate) fn forget(&self, ep: &Endpoint, lora: &LoraRef) {
        let name = served_name(lora);
        self.held.lock().retain(|((base, generation), n, _)| {
            !(*base == ep.base && *generation == ep.generation && *n == name)
        });
    }
}

/// vLLM's `POST /v1/load_lora_adapter`; a name it already holds counts as loaded.
async fn load(
    client: &reqwest::Client,
    ep: &Endpoint,
    name: &str,
    lora: &LoraRef,
    timeout: Duration,
) -> Result<(), OpError> {
    let url = format!("{}/v1/load_lora_adapter", ep.base);
    let resp = client
        .post(&url)
        .json(&json!({"lora_name": name, "lora_path": lora.path}))
        .timeout(timeout)
        .send()
        .await
        .map_err(|e| {
            OpError::instance_lost(format!(
                "the engine server at {} did not take adapter `{}`: {e}",
                ep.base, lora.name
            ))
        })?;
    let status = resp.status();
    let body = resp.text().await.unwrap_or_default();
    if status.is_success() || body.contains("already been loaded") {
        tracing::info!(lora = %lora.name, server = %ep.base, "LoRA adapter loaded into the engine server");
        return Ok(());
    }
    let detail: String = body.chars().take(300).collect();
    let msg = format!(
        "the engine server refused LoRA adapter `{}` ({status}): {detail}",
        lora.name
    );
    Err(if status.is_server_error() {
        OpError::instance_lost(msg)
    } else {
        OpError::invalid(msg).with_param("model")
    })
}
