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
