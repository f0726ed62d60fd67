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
use tokio_stream::wrappers::BroadcastStream;

use super::PlaneError;

/// One live replica of a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    pub namespace: String,
    /// The node id in the graph.
    pub component: String,
    pub endpoint: String,
    pub instance_id: u64,
    pub transport: Transport,
    /// What late joiners need to know about this replica: its kind, the model, and what the
    /// kind adds (an engine's `block_size`, `kv_total_blocks`, …).
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub metadata: serde_json::Map<String, serde_json::Value>,
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

/// In-process discovery.
pub struct EmbeddedDiscovery {
    state: Mutex<BTreeMap<String, Instance>>,
    changes: broadcast::Sender<DiscoveryEvent>,
}

impl Default for EmbeddedDiscovery {
    fn default() -> Self {
        Self {
            state: Mutex::new(BTreeMap::new()),
            changes: broadcast::channel(1024).0,
        }
    }
}

impl EmbeddedDiscovery {
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
        let rx = self.changes.subscribe();
        let snapshot = Self::snapshot(&state, prefix);
        drop(state);
        let prefix = prefix.to_owned();
        let stream = BroadcastStream::new(rx).filter_map(move |ev| {
            let keep = match &ev {
                Ok(DiscoveryEvent::Put(i)) => i.key().starts_with(&prefix),
                Ok(DiscoveryEvent::Delete { key }) => key.starts_with(&prefix),
                Err(e) => {
                    tracing::warn!(error = %e, "discovery watcher fell behind");
                    false
                }
            };
            futures::future::ready(if keep { ev.ok() } else { None })
        });
        Ok((snapshot, stream.boxed()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inst(component: &str, id: u64) -> Instance {
        Instance {
            namespace: "ns".into(),
            component: component.into(),
            endpoint: "generate".into(),
            instance_id: id,
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
}
