//! The LoRA adapters a native worker keeps resident: at most `max_loras`, least recently used
//! evicted, read again from their files on demand.
//!
//! A request names its adapter by name and path ([`LoraRef`], set by the ingress from the
//! adapters it serves), so a worker needs no list of its own and a worker that starts late
//! serves every adapter at once. A miss reads the adapter on the blocking pool before the
//! request is queued, so a step never waits for a file. The sequence holds its adapter
//! (`Arc`) while it runs: an adapter evicted meanwhile finishes the requests already running
//! with it, later ones take that same copy while any sequence holds it, and its memory goes
//! with the last of them — so memory is `max_loras` adapters plus those only running
//! sequences hold. Requests missing the same adapter at once wait for one read of it.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::{Arc, Weak};
use std::time::Instant;

use dyn_compute::model::ModelConfig;
use dyn_compute::model::lora::LoraAdapter;
use dyn_core::OpError;
use dyn_protocol::types::LoraRef;
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
    /// Every copy read, while anything holds it (running sequences after an eviction).
    alive: Mutex<Vec<(LoraRef, Weak<LoraAdapter>)>>,
    /// A turn per adapter being read (by key), so that it is read once.
    reading: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// While it lives, the ingress of this process hands over the adapters it checks.
    _open: dyn_compute::model::lora::StoreOpen,
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
            alive: Mutex::new(Vec::new()),
            reading: Mutex::new(HashMap::new()),
            _open: dyn_compute::model::lora::StoreOpen::new(),
        }
    }

    /// The adapter `r` names: the resident copy, else read from its path (a different path
    /// or version under the same name is another adapter, read afresh).
    pub async fn get(&self, r: &LoraRef) -> Result<Arc<LoraAdapter>, OpError> {
        if let Some(a) = self.cached(r) {
            return Ok(a);
        }
        // One read per adapter at a time: requests missing it together wait for the first.
        let key = r.key();
        let gate = self.reading.lock().entry(key.clone()).or_default().clone();
        let turn = gate.lock().await;
        let got = match self.cached(r) {
            Some(a) => Ok(a),
            None => self.read(r).await,
        };
        drop(turn);
        let mut reading = self.reading.lock();
        // (This request's clone and the map's: nobody else waits.)
        if Arc::strong_count(&gate) <= 2 {
            reading.remove(&key);
        }
        got
    }

    /// The resident copy of `r`, or one running sequences still hold (made resident again).
    fn cached(&self, r: &LoraRef) -> Option<Arc<LoraAdapter>> {
        if let Some((at, a)) = self.resident.lock().get(&r.name)
            && at == r
        {
            return Some(a.clone());
        }
        let held = self
            .alive
            .lock()
            .iter()
            .find(|(at, _)| at == r)
            .and_then(|(_, a)| a.upgrade())?;
        self.keep(r, held.clone());
        Some(held)
    }

    /// Read `r` from its files, on the blocking pool, and make it resident; or take the copy
    /// this process's ingress read to check it, when it still holds one.
    async fn read(&self, r: &LoraRef) -> Result<Arc<LoraAdapter>, OpError> {
        let started = Instant::now();
        let key = r.key();
        if let Some(a) = dyn_compute::model::lora::handed_over(&key, &self.base) {
            return Ok(self.loaded(r, a, started, "the ingress's check"));
        }
        let (path, base) = (PathBuf::from(&r.path), self.base.clone());
        let loaded = tokio::task::spawn_blocking(move || LoraAdapter::load(&path, &base))
            .await
            .map_err(|e| OpError::internal(format!("adapter loading task failed: {e}")))?
            .map_err(|e| {
                // The details (paths, the OS's words) are the operator's, not the client's.
                tracing::warn!(node = %self.node, lora = %r.name, path = ?r.path, error = %e, "Cannot read a LoRA adapter");
                OpError::invalid(format!(
                    "LoRA adapter `{}` cannot be read on this worker (its log says why)",
                    r.name
                ))
                .with_param("model")
            })?;
        Ok(self.loaded(r, Arc::new(loaded), started, "its files"))
    }

    /// `a`, just loaded for `r` (from `from`), kept and counted.
    fn loaded(
        &self,
        r: &LoraRef,
        a: Arc<LoraAdapter>,
        started: Instant,
        from: &str,
    ) -> Arc<LoraAdapter> {
        {
            let mut alive = self.alive.lock();
            alive.retain(|(_, w)| w.strong_count() > 0);
            alive.push((r.clone(), Arc::downgrade(&a)));
        }
        self.keep(r, a.clone());
        LORA.loads
            .with_label_values(&[&self.node, &self.worker])
            .inc();
        tracing::info!(node = %self.node, lora = %r.name, rank = a.rank, bytes = a.bytes(), seconds = started.elapsed().as_secs_f64(), from, "LoRA adapter loaded");
        a
    }

    /// Make `a` resident under `r`'s name, evicting the least recently used past the bound.
    fn keep(&self, r: &LoraRef, a: Arc<LoraAdapter>) {
        let mut resident = self.resident.lock();
        if let Some((name, _)) = resident
            .push(r.name.clone(), (r.clone(), a))
            .filter(|(name, _)| *name != r.name)
        {
            tracing::debug!(node = %self.node, lora = %name, "LoRA adapter evicted");
        }
        LORA.resident
            .with_label_values(&[&self.node, &self.worker])
            .set(resident.len() as i64);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn models() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models")
    }

    /// An adapter the ingress of this process read to check it is taken, not read again
    /// (its path here reads nothing), by a worker whose base has the shape the ingress read.
    #[tokio::test]
    async fn an_adapter_the_ingress_checked_is_not_read_again() {
        let base = ModelConfig::load(&models().join("tiny")).unwrap();
        // The ingress reads the shape this way (a GGUF's header alike).
        assert_eq!(
            dyn_compute::model::shape(&models().join("tiny")).unwrap(),
            base
        );
        // Nothing is handed over while no worker store lives in the process.
        let checked = Arc::new(LoraAdapter::load(&models().join("tiny-lora/qv"), &base).unwrap());
        let lone = LoraRef {
            name: "lone".into(),
            path: "/nonexistent/lone".into(),
            id: 9,
        };
        dyn_compute::model::lora::hand_over(lone.key(), &base, checked.clone());
        let store = LoraStore::new(base.clone(), NonZeroUsize::new(2).unwrap(), "handed", 1);
        assert!(store.get(&lone).await.is_err());
        let r = LoraRef {
            name: "qv".into(),
            path: "/nonexistent/handed-over".into(),
            id: 7,
        };
        dyn_compute::model::lora::hand_over(r.key(), &base, checked.clone());
        let got = store.get(&r).await.expect("taken over");
        assert!(Arc::ptr_eq(&got, &checked));
        // Taken out: the worker's own bound holds it from now on.
        assert!(dyn_compute::model::lora::handed_over(&r.key(), &base).is_none());
        // Another version of it is not that copy.
        let other = LoraRef { id: 8, ..r };
        assert!(store.get(&other).await.is_err());
    }

    /// Sixteen requests missing one adapter together read it once; a bad directory is a 400
    /// that names the adapter and not the path.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_adapter_missed_by_many_at_once_is_read_once() {
        let base = ModelConfig::load(&models().join("tiny")).unwrap();
        let store = Arc::new(LoraStore::new(
            base,
            NonZeroUsize::new(2).unwrap(),
            "lora-test",
            0x5eed,
        ));
        let r = LoraRef {
            name: "qv".into(),
            path: models().join("tiny-lora/qv").display().to_string(),
            id: 1,
        };
        let all = (0..16).map(|_| {
            let (store, r) = (store.clone(), r.clone());
            tokio::spawn(async move { store.get(&r).await })
        });
        let got: Vec<Arc<LoraAdapter>> = futures::future::join_all(all)
            .await
            .into_iter()
            .map(|j| j.unwrap().unwrap())
            .collect();
        assert!(got.iter().all(|a| Arc::ptr_eq(a, &got[0])));
        let loads = LORA.loads.with_label_values(&["lora-test", "5eed"]).get();
        assert_eq!(loads, 1);
        assert!(store.reading.lock().is_empty());
        let bad = LoraRef {
            name: "gone".into(),
            path: "/nonexistent/adapter".into(),
            id: 2,
        };
        let e = store.get(&bad).await.unwrap_err();
        assert!(
            e.message.contains("`gone`") && !e.message.contains("/nonexistent"),
            "{}",
            e.message
        );
    }
}
