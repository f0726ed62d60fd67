//! LoRA adapters on external servers.
//!
//! vLLM: dyn loads an adapter into a replica's server through vLLM's
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
//!
//! llama.cpp: llama-server reads its adapters only when it starts (`--lora FILE`, GGUF LoRA
//! files; dyn adds the graph's to the servers it launches) and lists them at
//! `GET /lora-adapters`; a request applies them by id and scale in its `lora` field. dyn reads
//! each server's list once per start and matches adapters by file ([`Listed`]).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dyn_core::OpError;
use dyn_protocol::types::LoraRef;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::sync::OnceCell;

use super::server::{Endpoint, Server};

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

/// A llama.cpp server's adapters: id and file (made absolute where it exists).
type List = Arc<Vec<(u64, PathBuf)>>;

/// A server (URL and start), and its list once read.
type Start = (ServerKey, Arc<OnceCell<List>>);

/// The adapters of one replica's llama.cpp server, as it lists them (see the module's
/// documentation).
#[derive(Default)]
pub(crate) struct Listed {
    /// The server's latest start seen (a restarted one may list others).
    list: Mutex<Option<Start>>,
}

impl Listed {
    /// The `lora` field of a request to the server at `ep`: `lora` at scale 1, or for the model
    /// itself every adapter at scale 0 — a request that names none gets the server's global
    /// scales, which `--lora` sets to 1 (this llama-server keeps 1 even with
    /// `--lora-init-without-apply`). `None` for the model on a server without adapters.
    pub(crate) async fn field(
        &self,
        client: &reqwest::Client,
        (server, ep): (&Server, &Endpoint),
        lora: Option<&LoraRef>,
        timeout: Duration,
    ) -> Result<Option<Value>, OpError> {
        let key: ServerKey = (ep.base.clone(), ep.generation);
        let cell = {
            let mut list = self.list.lock();
            match &*list {
                Some((k, cell)) if *k == key => cell.clone(),
                _ => {
                    let cell = Arc::<OnceCell<List>>::default();
                    *list = Some((key, cell.clone()));
                    cell
                }
            }
        };
        let list = cell
            .get_or_try_init(|| read_list(client, server, ep, timeout))
            .await?;
        Ok(match lora {
            None if list.is_empty() => None,
            None => Some(Value::Array(
                list.iter()
                    .map(|(id, _)| json!({"id": id, "scale": 0.0}))
                    .collect(),
            )),
            Some(l) => match list
                .iter()
                .find(|(_, p)| p.as_path() == std::path::Path::new(&l.path))
            {
                Some((id, _)) => Some(json!([{"id": id, "scale": 1.0}])),
                None => {
                    return Err(OpError::invalid(format!(
                        "model `{}` is a LoRA adapter this worker's llama.cpp server was not started \
                         with: llama-server reads adapters only when it starts (`--lora`); declare \
                         it in the graph's model.loras (dyn adds those to the servers it launches)",
                        l.name
                    ))
                    .with_param("model"));
                }
            },
        })
    }
}

/// llama-server's `GET /lora-adapters`: `[{"id", "path", "scale", …}]`. A server without the
/// route (404) has no adapters; one that does not answer is suspect (the request migrates),
/// and other refusals read as a request's ([`crate::refused`]).
async fn read_list(
    client: &reqwest::Client,
    server: &Server,
    ep: &Endpoint,
    timeout: Duration,
) -> Result<List, OpError> {
    let url = format!("{}/lora-adapters", ep.base);
    let what = |e: String| {
        format!(
            "the engine server at {} did not list its LoRA adapters: {e}",
            ep.base
        )
    };
    let resp = match client.get(&url).timeout(timeout).send().await {
        Ok(r) => r,
        Err(e) => {
            server.suspect();
            return Err(OpError::instance_lost(what(e.to_string())));
        }
    };
    let status = resp.status();
    if status == reqwest::StatusCode::NOT_FOUND {
        return Ok(Arc::default());
    }
    // (The request's timeout bounds its body too.)
    let body = resp
        .text()
        .await
        .map_err(|e| OpError::instance_lost(what(e.to_string())))?;
    if !status.is_success() {
        return Err(crate::refused(server, status, &body));
    }
    let listed: Vec<Value> =
        serde_json::from_str(&body).map_err(|e| OpError::internal(what(e.to_string())))?;
    let mut list = Vec::with_capacity(listed.len());
    for a in listed {
        let (Some(id), Some(path)) = (a["id"].as_u64(), a["path"].as_str()) else {
            return Err(OpError::internal(what(format!(
                "an entry without an id and a path: {a}"
            ))));
        };
        // As the ingress names adapters (absolute, links resolved); a server started from
        // another directory with a relative path matches only where it resolves the same here.
        let path = tokio::fs::canonicalize(path)
            .await
            .unwrap_or_else(|_| PathBuf::from(path));
        list.push((id, path));
    }
    tracing::info!(server = %ep.base, adapters = list.len(), "Read the engine server's LoRA adapters");
    Ok(Arc::new(list))
}
