//! The LoRA adapters a native worker keeps resident: at most `max_loras`, least recently used
//! evicted, read again from their files on demand.
//!
//! A request names its adapter by name and path ([`LoraRef`], set by the ingress from the
//! adapters it serves), so a worker needs no list of its own and a worker that starts late
//! serves every adapter at once. A miss reads the adapter on the blocking pool before the
//! request is queued, so a step never waits for a file. The sequence holds its adapter
//! (`Arc`) while it runs: an adapter evicted or unloaded meanwhile finishes the requests
//! already running with it, and its memory goes with the last of them. Two requests missing
//! the same adapter at once may both read it; the second copy replaces the first.

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use dyn_compute::model::ModelConfig;
use dyn_compute::model::lora::LoraAdapter;
use dyn_core::OpError;
use dyn_llm::types::LoraRef;
use lru::LruCache;
use parking_lot::Mutex;

use crate::metrics::LORA;

/// The adapters of one worker.
pub struct LoraStore {
    /// The base model's shape: adapters are checked against it.
    base: ModelConfig,
    node: String,
    /// The worker's id as its metrics label it (hex).
    worker: String,
    /// name → (the reference it was read for, the adapter).
    resident: Mutex<LruCache<String, (LoraRef, Arc<LoraAdapter>)>>,
}

impl LoraStore {
    pub fn new(base: ModelConfig, max_resident: NonZeroUsize, node: &str, worker_id: u64) -> Self {
        let worker = format!("{worker_id:x}");
        LORA.resident.with_label_values(&[node, &worker]).set(0);
        LoraStore {
            base,
            node: node.to_owned(),
            worker,
            resident: Mutex::new(LruCache::new(max_resident)),
        }
    }

    /// The adapter `r` names: the resident copy, else read from its path (a different path
    /// or loading under the same name is another adapter, read afresh).
    pub async fn get(&self, r: &LoraRef) -> Result<Arc<LoraAdapter>, OpError> {
        if let Some((at, a)) = self.resident.lock().get(&r.name)
            && at == r
        {
            return Ok(a.clone());
        }
        let started = Instant::now();
        let (path, base) = (PathBuf::from(&r.path), self.base.clone());
        let loaded = tokio::task::spawn_blocking(move || LoraAdapter::load_peft(&path, &base))
            .await
            .map_err(|e| OpError::internal(format!("adapter loading task failed: {e}")))?
            .map_err(|e| {
                OpError::invalid(format!("LoRA adapter `{}`: {e}", r.name)).with_param("model")
            })?;
        let a = Arc::new(loaded);
        let evicted = {
            let mut resident = self.resident.lock();
            let evicted = resident.push(r.name.clone(), (r.clone(), a.clone()));
            LORA.resident
                .with_label_values(&[&self.node, &self.worker])
                .set(resident.len() as i64);
            evicted
        };
        LORA.loads
            .with_label_values(&[&self.node, &self.worker])
            .inc();
        tracing::info!(node = %self.node, lora = %r.name, rank = a.rank, bytes = a.bytes(), seconds = started.elapsed().as_secs_f64(), "LoRA adapter loaded");
        if let Some((name, _)) = evicted.filter(|(name, _)| *name != r.name) {
            tracing::debug!(node = %self.node, lora = %name, "LoRA adapter evicted");
        }
        Ok(a)
    }

    /// Forget the resident copy of `name` (unloaded): running requests keep theirs.
    pub fn forget(&self, name: &str) -> bool {
        let mut resident = self.resident.lock();
        let had = resident.pop(name).is_some();
        LORA.resident
            .with_label_values(&[&self.node, &self.worker])
            .set(resident.len() as i64);
        had
    }

    /// The resident adapters' names, most recently used first.
    pub fn resident(&self) -> Vec<String> {
        self.resident
            .lock()
            .iter()
            .map(|(n, _)| n.clone())
            .collect()
    }
}

impl std::fmt::Debug for LoraStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoraStore")
            .field("node", &self.node)
            .field("resident", &self.resident())
            .finish()
    }
}
