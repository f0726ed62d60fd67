//! Discovery: the registry of live instances.
//!
//! Keys follow Dynamo's layout, `v1/instances/{namespace}/{component}/{endpoint}/{id:x}`, so the
//! etcd implementation can share tooling with Dynamo deployments. A watch returns a snapshot and
//! then every change after it, with nothing lost in between.

use std::collections::BTreeMap;

use async_trait::async_trait;
use futures::stream::{BoxStream, StreamExt};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

use super::PlaneError;

pub use crate::ctx::InstanceId;

/// One live replica of a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    pub namespace: String,
    /// The node id in the graph.
    pub component: String,
    pub endpoint: String,
    pub instance_id: InstanceId,
    pub transport: Transport,
    /// What late joiners need to know about this replica.
    #[serde(default, skip_serializing_if = "InstanceMeta::is_empty")]
    pub metadata: InstanceMeta,
}

/// What processes that join later need to know about an instance, stored with it in
/// discovery: its kind and model (the runtime fills them), and what the kind adds — a worker's
/// engine, phase and KV cache geometry, which a router that starts after its workers reads
/// before any load metrics arrive.
///
/// On the wire it is a JSON object, read key by key: a key this version does not know, or one
/// whose value has another type than it expects (another version's or tool's record), is kept
/// in `extra` and written back unchanged, so such a record never hides its instance.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "JsonMap", into = "JsonMap")]
pub struct InstanceMeta {
    /// The node's kind (`decode`, `route`, …).
    pub kind: Option<String>,
    /// The model the graph serves.
    pub model: Option<String>,
    /// A worker that does one phase only: `prefill`.
    pub role: Option<String>,
    /// The engine behind a worker (`mocker`, `native`, `vllm`, `llamacpp`, `openai`).
    pub engine: Option<String>,
    /// Tokens per KV cache block.
    pub block_size: Option<u32>,
    /// KV cache blocks the worker holds.
    pub kv_total_blocks: Option<u64>,
    /// Sequences the worker runs at once (its batch size): the room a router's admission
    /// gives it unless told otherwise.
    pub max_num_seqs: Option<u32>,
    /// What the worker's engine can serve, as far as its config says.
    pub capabilities: Option<Capabilities>,
    pub extra: JsonMap,
}

/// What a worker's engine can serve, as its config states it: `Some(false)` where it cannot
/// (a simulated engine has no log-probabilities), `None` where only the running engine knows
/// (an external server's flags, a backend's build). An ingress refuses a request that asks
/// for what none of its path's workers can serve when it checks the request, with the
/// parameter named, rather than after the request was queued, routed and sent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embeddings: Option<bool>,
    /// Structured output (a grammar the engine enforces).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grammars: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<bool>,
}

impl Capabilities {
    /// What a request may ask of a path whose workers have these capabilities: each thing
    /// that any of them can, or may, serve (a worker of unknown capabilities may).
    pub fn any_of(all: impl IntoIterator<Item = Option<Capabilities>>) -> Capabilities {
        let either = |a: Option<bool>, b: Option<bool>| match (a, b) {
            (Some(false), Some(false)) => Some(false),
            (Some(true), _) | (_, Some(true)) => Some(true),
            _ => None,
        };
        let mut all = all.into_iter();
        let Some(first) = all.next() else {
            return Capabilities::default();
        };
        all.fold(first.unwrap_or_default(), |acc, c| {
            let c = c.unwrap_or_default();
            Capabilities {
                logprobs: either(acc.logprobs, c.logprobs),
                embeddings: either(acc.embeddings, c.embeddings),
                grammars: either(acc.grammars, c.grammars),
                lora: either(acc.lora, c.lora),
            }
        })
    }
}

type JsonMap = serde_json::Map<String, serde_json::Value>;

impl InstanceMeta {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

impl From<JsonMap> for InstanceMeta {
    fn from(mut extra: JsonMap) -> Self {
        // Take a key out only when its value reads as the field's type.
        fn take<T: serde::de::DeserializeOwned>(m: &mut JsonMap, key: &str) -> Option<T> {
            let v = serde_json::from_value(m.get(key)?.clone()).ok()?;
            m.remove(key);
            Some(v)
        }
        Self {
            kind: take(&mut extra, "kind"),
            model: take(&mut extra, "model"),
            role: take(&mut extra, "role"),
            engine: take(&mut extra, "engine"),
            block_size: take(&mut extra, "block_size"),
            kv_total_blocks: take(&mut extra, "kv_total_blocks"),
            max_num_seqs: take(&mut extra, "max_num_seqs"),
            capabilities: take(&mut extra, "capabilities"),
            extra,
        }
    }
}

impl From<InstanceMeta> for JsonMap {
    fn from(m: InstanceMeta) -> Self {
        let mut out = m.extra;
        let mut put = |key: &str, v: Option<serde_json::Value>| {
            if let Some(v) = v {
                out.insert(key.into(), v);
            }
        };
        put("kind", m.kind.map(Into::into));
        put("model", m.model.map(Into::into));
        put("role", m.role.map(Into::into));
        put("engine", m.engine.map(Into::into));
        put("block_size", m.block_size.map(Into::into));
        put("kv_total_blocks", m.kv_total_blocks.map(Into::into));
        put("max_num_seqs", m.max_num_seqs.map(Into::into));
        put(
            "capabilities",
            m.capabilities.and_then(|c| serde_json::to_value(c).ok()),
        );
        out
    }
}

/// How to reach an instance's request endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Transport {
    /// Same process: the embedded request plane.
    InProcess,
    /// Another process, over TCP.
    Tcp { address: String },
}

impl Instance {
    pub fn key(&self) -> String {
        format!(
            "{}{:x}",
            Self::prefix(&self.namespace, &self.component, &self.endpoint),
            self.instance_id
        )
    }

    /// The key prefix of every instance of one endpoint.
    pub fn prefix(namespace: &str, component: &str, endpoint: &str) -> String {
        format!("v1/instances/{namespace}/{component}/{endpoint}/")
    }
}

// Discovery changes are rare (a replica joins or leaves): a boxed `Put` would save nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoveryEvent {
    Put(Instance),
    Delete { key: String },
}

#[async_trait]
pub trait Discovery: Send + Sync + 'static {
    /// Publish an instance; it lives as long as this process's registration (its lease).
    async fn register(&self, instance: Instance) -> Result<(), PlaneError>;
    async fn deregister(&self, key: &str) -> Result<(), PlaneError>;
    async fn list(&self, prefix: &str) -> Result<Vec<Instance>, PlaneError>;
    /// The instances under `prefix` now, then every change after that snapshot.
    async fn watch(
        &self,
        prefix: &str,
    ) -> Result<(Vec<Instance>, BoxStream<'static, DiscoveryEvent>), PlaneError>;
}

/// The live instances under one prefix, kept current by a background watch. Edge clients
/// and routers hold one per node they send to.
pub struct LiveInstances {
    list: std::sync::Arc<parking_lot::RwLock<Vec<Instance>>>,
    next: std::sync::atomic::AtomicUsize,
    _watch: tokio_util::task::AbortOnDropHandle<()>,
}

impl LiveInstances {
    pub async fn watch(discovery: &dyn Discovery, prefix: &str) -> Result<Self, PlaneError> {
        let (snapshot, mut changes) = discovery.watch(prefix).await?;
        let list = std::sync::Arc::new(parking_lot::RwLock::new(snapshot));
        let shared = list.clone();
        let task = tokio::spawn(async move {
            while let Some(ev) = changes.next().await {
                let mut list = shared.write();
                match ev {
                    DiscoveryEvent::Put(i) => {
                        tracing::debug!(node = %i.component, worker_id = format_args!("{:x}", i.instance_id), "Instance joined");
                        list.retain(|x| x.instance_id != i.instance_id);
                        list.push(i);
                    }
                    DiscoveryEvent::Delete { key } => {
                        tracing::debug!(key, "Instance left");
                        list.retain(|x| x.key() != key);
                    }
                }
            }
        });
        Ok(Self {
            list,
            next: std::sync::atomic::AtomicUsize::new(0),
            _watch: tokio_util::task::AbortOnDropHandle::new(task),
        })
    }

    /// The next instance `keep` accepts, in round-robin order; `None` while there is none.
    pub fn round_robin(&self, keep: impl Fn(&Instance) -> bool) -> Option<Instance> {
        let list = self.list.read();
        let count = list.iter().filter(|i| keep(i)).count();
        if count == 0 {
            return None;
        }
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        list.iter().filter(|i| keep(i)).nth(n % count).cloned()
    }

    /// A read guard over the current list (keep it short: the watch waits on it).
    pub fn read(&self) -> parking_lot::RwLockReadGuard<'_, Vec<Instance>> {
        self.list.read()
    }
}

/// The events that take a watcher who knew `known` to `now`: deletes of what left, puts of
/// what is new or changed. Used where a watch lost events and lists again.
pub fn catch_up(
    known: &BTreeMap<String, Instance>,
    now: &BTreeMap<String, Instance>,
) -> Vec<DiscoveryEvent> {
    let gone = known
        .keys()
        .filter(|k| !now.contains_key(*k))
        .map(|key| DiscoveryEvent::Delete { key: key.clone() });
    let changed = now
        .iter()
        .filter(|(k, i)| known.get(*k) != Some(*i))
        .map(|(_, i)| DiscoveryEvent::Put(i.clone()));
    gone.chain(changed).collect()
}

/// In-process discovery.
pub struct EmbeddedDiscovery {
    state: std::sync::Arc<Mutex<BTreeMap<String, Instance>>>,
    changes: broadcast::Sender<DiscoveryEvent>,
}

impl Default for EmbeddedDiscovery {
    fn default() -> Self {
        Self::with_capacity(1024)
    }
}

impl EmbeddedDiscovery {
    /// `capacity`: changes a watcher may fall behind by before it lists again.
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            state: Default::default(),
            changes: broadcast::channel(capacity).0,
        }
    }

    fn snapshot(state: &BTreeMap<String, Instance>, prefix: &str) -> Vec<Instance> {
        state
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(_, v)| v.clone())
            .collect()
    }
}

#[async_trait]
impl Discovery for EmbeddedDiscovery {
    async fn register(&self, instance: Instance) -> Result<(), PlaneError> {
        let mut state = self.state.lock();
        state.insert(instance.key(), instance.clone());
        // No receivers is fine: nobody watches yet.
        let _ = self.changes.send(DiscoveryEvent::Put(instance));
        Ok(())
    }

    async fn deregister(&self, key: &str) -> Result<(), PlaneError> {
        let mut state = self.state.lock();
        if state.remove(key).is_some() {
            let _ = self.changes.send(DiscoveryEvent::Delete {
                key: key.to_owned(),
            });
        }
        Ok(())
    }

    async fn list(&self, prefix: &str) -> Result<Vec<Instance>, PlaneError> {
        Ok(Self::snapshot(&self.state.lock(), prefix))
    }

    async fn watch(
        &self,
        prefix: &str,
    ) -> Result<(Vec<Instance>, BoxStream<'static, DiscoveryEvent>), PlaneError> {
        // Subscribe while holding the lock so no change falls between snapshot and stream.
        let state = self.state.lock();
        let mut rx = self.changes.subscribe();
        let snapshot = Self::snapshot(&state, prefix);
        drop(state);
        let prefix = prefix.to_owned();
        let shared = self.state.clone();
        let mut known: BTreeMap<String, Instance> =
            snapshot.iter().map(|i| (i.key(), i.clone())).collect();
        let stream = async_stream::stream! {
            loop {
                let ev = match rx.recv().await {
                    Ok(ev) => ev,
                    Err(broadcast::error::RecvError::Closed) => return,
                    Err(broadcast::error::RecvError::Lagged(missed)) => {
                        // Changes were lost: list again (as the etcd watcher does after a
                        // compaction) and report the difference, so no watcher keeps a dead
                        // instance or misses a new one. The buffered changes are older than
                        // the listing: skip them, and follow from the listing on (changes are
                        // sent under the state lock, so none falls between the two).
                        tracing::warn!(missed, prefix, "Discovery watcher fell behind; listing again");
                        let now: BTreeMap<String, Instance> = {
                            let state = shared.lock();
                            rx = rx.resubscribe();
                            Self::snapshot(&state, &prefix)
                                .into_iter()
                                .map(|i| (i.key(), i))
                                .collect()
                        };
                        for ev in catch_up(&known, &now) {
                            yield ev;
                        }
                        known = now;
                        continue;
                    }
                };
                let key = match &ev {
                    DiscoveryEvent::Put(i) => i.key(),
                    DiscoveryEvent::Delete { key } => key.clone(),
                };
                if !key.starts_with(&prefix) {
                    continue;
                }
                match &ev {
                    DiscoveryEvent::Put(i) => known.insert(key, i.clone()),
                    DiscoveryEvent::Delete { .. } => known.remove(&key),
                };
                yield ev;
            }
        };
        Ok((snapshot, stream.boxed()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_may_ask_what_any_of_its_workers_can_or_may_serve() {
        let mocker = Capabilities {
            logprobs: Some(false),
            embeddings: Some(false),
            grammars: Some(true),
            lora: Some(false),
        };
        let native = Capabilities {
            logprobs: Some(true),
            lora: None,
            ..mocker
        };
        assert_eq!(Capabilities::any_of([Some(mocker)]), mocker);
        let both = Capabilities::any_of([Some(mocker), Some(native)]);
        assert_eq!(
            (both.logprobs, both.embeddings, both.lora),
            (Some(true), Some(false), None)
        );
        // A worker that states nothing may serve anything.
        assert_eq!(Capabilities::any_of([Some(mocker), None]).logprobs, None);
        assert_eq!(Capabilities::any_of([]), Capabilities::default());
        let meta = InstanceMeta {
            capabilities: Some(mocker),
            ..InstanceMeta::default()
        };
        let text = serde_json::to_string(&meta).unwrap();
        assert_eq!(serde_json::from_str::<InstanceMeta>(&text).unwrap(), meta);
    }

    #[test]
    fn an_instance_record_keeps_its_wire_form_and_keys_it_does_not_know() {
        // The record as an older dyn wrote it (untyped metadata), plus a key from a newer one.
        let text = r#"{"namespace":"ns","component":"decode","endpoint":"generate","instance_id":3054,"transport":{"type":"in_process"},"metadata":{"engine":"native","block_size":16,"kv_total_blocks":1024,"kind":"decode","model":"tiny","lora":["a"]}}"#;
        let i: Instance = serde_json::from_str(text).unwrap();
        assert_eq!(i.instance_id, InstanceId(3054));
        assert_eq!(i.key(), "v1/instances/ns/decode/generate/bee");
        assert_eq!(i.metadata.block_size, Some(16));
        assert_eq!(i.metadata.kv_total_blocks, Some(1024));
        assert_eq!(i.metadata.model.as_deref(), Some("tiny"));
        assert_eq!(i.metadata.extra["lora"], serde_json::json!(["a"]));
        // A value of another type than expected stays as written and hides nothing.
        let odd: Instance =
            serde_json::from_str(&text.replace("\"block_size\":16", "\"block_size\":\"16\""))
                .unwrap();
        assert_eq!(odd.metadata.block_size, None);
        assert_eq!(odd.metadata.extra["block_size"], serde_json::json!("16"));
        assert_eq!(odd.metadata.kv_total_blocks, Some(1024));
        let back: serde_json::Value = serde_json::to_value(&i).unwrap();
        assert_eq!(
            back,
            serde_json::from_str::<serde_json::Value>(text).unwrap()
        );
        // No metadata at all stays absent on the wire.
        let bare = Instance {
            metadata: InstanceMeta::default(),
            ..i
        };
        assert!(!serde_json::to_string(&bare).unwrap().contains("metadata"));
    }

    fn inst(component: &str, id: u64) -> Instance {
        Instance {
            namespace: "ns".into(),
            component: component.into(),
            endpoint: "generate".into(),
            instance_id: InstanceId(id),
            transport: Transport::InProcess,
            metadata: Default::default(),
        }
    }

    #[tokio::test]
    async fn watch_sees_snapshot_then_changes_under_prefix_only() {
        let d = EmbeddedDiscovery::default();
        d.register(inst("a", 1)).await.unwrap();
        let prefix = Instance::prefix("ns", "a", "generate");
        let (snap, mut changes) = d.watch(&prefix).await.unwrap();
        assert_eq!(snap, vec![inst("a", 1)]);
        d.register(inst("b", 2)).await.unwrap();
        d.register(inst("a", 0x1f)).await.unwrap();
        d.deregister(&inst("a", 1).key()).await.unwrap();
        assert_eq!(
            changes.next().await,
            Some(DiscoveryEvent::Put(inst("a", 0x1f)))
        );
        assert_eq!(
            changes.next().await,
            Some(DiscoveryEvent::Delete {
                key: "v1/instances/ns/a/generate/1".into()
            })
        );
        assert_eq!(d.list(&prefix).await.unwrap(), vec![inst("a", 0x1f)]);
        assert_eq!(inst("a", 0x1f).key(), "v1/instances/ns/a/generate/1f");
    }

    #[tokio::test]
    async fn a_watcher_that_falls_behind_lists_again_and_misses_nothing() {
        // Room for 4 changes; the watcher reads none while 40 happen.
        let d = EmbeddedDiscovery::with_capacity(4);
        for id in 0..10 {
            d.register(inst("a", id)).await.unwrap();
        }
        let prefix = Instance::prefix("ns", "a", "generate");
        let (snap, mut changes) = d.watch(&prefix).await.unwrap();
        assert_eq!(snap.len(), 10);
        for id in 0..8 {
            d.deregister(&inst("a", id).key()).await.unwrap();
        }
        for id in 100..130 {
            d.register(inst("a", id)).await.unwrap();
        }
        for id in 100..102 {
            d.deregister(&inst("a", id).key()).await.unwrap();
        }
        // The watcher's view, rebuilt from its snapshot and events, equals the registry.
        let mut view: BTreeMap<String, Instance> = snap.into_iter().map(|i| (i.key(), i)).collect();
        let want: BTreeMap<String, Instance> = d
            .list(&prefix)
            .await
            .unwrap()
            .into_iter()
            .map(|i| (i.key(), i))
            .collect();
        while view != want {
            let ev = tokio::time::timeout(std::time::Duration::from_secs(5), changes.next())
                .await
                .expect("the watcher catches up")
                .expect("open");
            match ev {
                DiscoveryEvent::Put(i) => {
                    view.insert(i.key(), i);
                }
                DiscoveryEvent::Delete { key } => {
                    view.remove(&key);
                }
            }
        }
        assert_eq!(view.len(), 30);
        // And it goes on following after catching up.
        d.register(inst("a", 7)).await.unwrap();
        loop {
            let ev = changes.next().await.expect("open");
            if ev == DiscoveryEvent::Put(inst("a", 7)) {
                break;
            }
        }
    }
}
