//! Discovery on etcd v3: the control plane of a graph spread over processes and machines.
//!
//! Each instance is a key `v1/instances/{namespace}/{component}/{endpoint}/{id:x}` holding its
//! [`Instance`] as JSON, attached to this process's lease. A background task keeps the lease
//! alive (every third of its TTL); when the process dies the lease expires and etcd deletes
//! its keys, which every watcher sees. If the lease is lost while the process lives (etcd was
//! unreachable for longer than the TTL, or the lease was revoked), the task grants a new one
//! and registers everything again, so a worker that was cut off comes back on its own.
//!
//! Watches start from a snapshot (`get` with prefix) and continue from the snapshot's
//! revision, so no change falls between the two. When the watch breaks (etcd restarted) or
//! its revision was compacted, the watcher lists again, reports the difference as puts and
//! deletes, and watches on from there.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{Client, EventType, GetOptions, PutOptions, WatchOptions};
use futures::FutureExt;
use futures::future::BoxFuture;
use futures::stream::{BoxStream, StreamExt};
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::PlaneError;
use super::auth::EtcdCredentials;
use super::discovery::{Discovery, DiscoveryEvent, Instance};

fn err(e: impl std::fmt::Display) -> PlaneError {
    PlaneError::Backend {
        plane: "control (etcd)",
        message: e.to_string(),
    }
}

/// Registered instances and the lease they hang on.
struct Registrations {
    lease: i64,
    instances: BTreeMap<String, Instance>,
}

/// The cluster's members and the client on the one in use. A call that fails moves to the
/// next member that answers (in order after the failed one) and is tried once more there.
struct Members {
    endpoints: Vec<String>,
    creds: EtcdCredentials,
    /// The index of the member in use, and its client.
    current: Mutex<(usize, Client)>,
}

impl Members {
    fn client(&self) -> Client {
        self.current.lock().1.clone()
    }

    /// Leave the member in use for the next that answers; the same one when none does.
    async fn fail_over(&self) -> Client {
        let at = self.current.lock().0;
        let status = |mut c: Client| async move { c.status().await.map_err(err) }.boxed();
        match first_member(
            &self.endpoints,
            &self.creds,
            at + 1,
            Duration::from_secs(2),
            status,
        )
        .await
        {
            Ok((next, client, _)) => {
                if next != at {
                    tracing::warn!(
                        from = %self.endpoints[at],
                        to = %self.endpoints[next],
                        "etcd member lost; moved to another"
                    );
                }
                *self.current.lock() = (next, client.clone());
                client
            }
            Err(_) => self.client(),
        }
    }

    /// `f` on the member in use, and once more on another when that fails.
    async fn call<'a, T>(
        &self,
        f: impl Fn(Client) -> BoxFuture<'a, Result<T, PlaneError>>,
    ) -> Result<T, PlaneError> {
        match f(self.client()).await {
            Err(_) if self.endpoints.len() > 1 => f(self.fail_over().await).await,
            done => done,
        }
    }
}

pub struct EtcdDiscovery {
    members: Arc<Members>,
    state: Arc<Mutex<Registrations>>,
    _keepalive: tokio_util::task::AbortOnDropHandle<()>,
}

/// A client on the first of `endpoints` (`http://host:port`, tried from index `from` on, in
/// a ring) that answers `first`, with its index and that answer. One client per member, tried
/// in turn: etcd-client's own balancing over several endpoints sends requests to a member
/// that is down and fails them.
async fn first_member<'a, E: AsRef<str>, T>(
    endpoints: &[E],
    creds: &EtcdCredentials,
    from: usize,
    timeout: Duration,
    first: impl Fn(Client) -> BoxFuture<'a, Result<T, PlaneError>>,
) -> Result<(usize, Client, T), PlaneError> {
    let opts = creds.options(timeout);
    let mut failures = Vec::new();
    for k in 0..endpoints.len() {
        let at = (from + k) % endpoints.len();
        let endpoint = endpoints[at].as_ref();
        let answered = match Client::connect([endpoint], Some(opts.clone())).await {
            Ok(client) => first(client.clone()).await.map(|v| (at, client, v)),
            Err(e) => Err(err(e)),
        };
        match answered {
            Ok(ok) => return Ok(ok),
            Err(e) => {
                let e = e.to_string();
                match creds.explain(&e) {
                    Some(why) => failures.push(format!("{endpoint}: {e} ({why})")),
                    None => failures.push(format!("{endpoint}: {e}")),
                }
            }
        }
    }
    Err(err(if failures.is_empty() {
        "no etcd endpoint".to_owned()
    } else {
        failures.join("; ")
    }))
}

/// The instances under `prefix`, read without taking a lease (for `dyn graph ps`), from the
/// first of `endpoints` that answers.
pub async fn list_instances<E: AsRef<str>>(
    endpoints: &[E],
    creds: &EtcdCredentials,
    prefix: &str,
) -> Result<Vec<Instance>, PlaneError> {
    let snapshot =
        |mut c: Client| async move { EtcdDiscovery::snapshot(&mut c, prefix).await }.boxed();
    Ok(
        first_member(endpoints, creds, 0, Duration::from_secs(3), snapshot)
            .await?
            .2
            .0,
    )
}

impl EtcdDiscovery {
    /// Connect to the first of a cluster's `endpoints` (`http://host:port` each, tried in
    /// order, so members that are down at start are passed over) and take a lease of `ttl`
    /// (etcd rounds up to its minimum, 2 s for etcd 3.4). A member lost later is replaced by
    /// the next that answers, for calls, the lease keep-alive and watches alike.
    pub async fn connect<E: AsRef<str>>(
        endpoints: &[E],
        ttl: Duration,
    ) -> Result<Self, PlaneError> {
        Self::connect_with(endpoints, ttl, EtcdCredentials::default()).await
    }

    /// [`connect`](Self::connect) with a user or TLS.
    pub async fn connect_with<E: AsRef<str>>(
        endpoints: &[E],
        ttl: Duration,
        creds: EtcdCredentials,
    ) -> Result<Self, PlaneError> {
        let ttl_s = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        // The first call reaches the server: a wrong address fails here, not later.
        // A read first: with authentication on, etcd grants leases to anyone but refuses
        // reads without a user, and a missing user should fail here, not at the first watch.
        let grant = |mut c: Client| {
            async move {
                let probe = GetOptions::new().with_prefix().with_count_only();
                c.get("v1/instances/", Some(probe)).await.map_err(err)?;
                c.lease_grant(ttl_s, None).await.map_err(err)
            }
            .boxed()
        };
        let (at, client, granted) =
            first_member(endpoints, &creds, 0, Duration::from_secs(5), grant).await?;
        let lease = granted.id();
        let state = Arc::new(Mutex::new(Registrations {
            lease,
            instances: BTreeMap::new(),
        }));
        let members = Arc::new(Members {
            endpoints: endpoints.iter().map(|e| e.as_ref().to_owned()).collect(),
            creds,
            current: Mutex::new((at, client)),
        });
        let task = tokio::spawn(keep_alive(members.clone(), state.clone(), ttl_s));
        Ok(Self {
            members,
            state,
            _keepalive: tokio_util::task::AbortOnDropHandle::new(task),
        })
    }

    /// The lease this process's registrations hang on (changes if it had to be re-granted).
    pub fn lease(&self) -> i64 {
        self.state.lock().lease
    }

    async fn put(client: &mut Client, lease: i64, i: &Instance) -> Result<(), PlaneError> {
        let value = serde_json::to_vec(i).map_err(err)?;
        client
            .put(i.key(), value, Some(PutOptions::new().with_lease(lease)))
            .await
            .map_err(err)?;
        Ok(())
    }

    async fn snapshot(
        client: &mut Client,
        prefix: &str,
    ) -> Result<(Vec<Instance>, i64), PlaneError> {
        let resp = client
            .get(prefix, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(err)?;
        let revision = resp.header().map_or(0, |h| h.revision());
        let instances = resp
            .kvs()
            .iter()
            .filter_map(|kv| match serde_json::from_slice::<Instance>(kv.value()) {
                Ok(i) => Some(i),
                Err(e) => {
                    tracing::warn!(key = %String::from_utf8_lossy(kv.key()), error = %e, "Ignoring a malformed instance record");
                    None
                }
            })
            .collect();
        Ok((instances, revision))
    }
}

/// Refresh the lease every third of its TTL; grant a new one and register again when it is
/// gone; retry with backoff (and on another member) while etcd is unreachable.
async fn keep_alive(members: Arc<Members>, state: Arc<Mutex<Registrations>>, ttl_s: i64) {
    let period = Duration::from_millis((ttl_s as u64 * 1000 / 3).max(500));
    let mut backoff = Duration::from_millis(200);
    let mut client = members.client();
    loop {
        let lease = state.lock().lease;
        let alive = match client.lease_keep_alive(lease).await {
            Ok((mut keeper, mut stream)) => loop {
                if let Err(e) = keeper.keep_alive().await {
                    tracing::warn!(error = %e, "etcd lease keep-alive failed");
                    break true;
                }
                match stream.message().await {
                    Ok(Some(r)) if r.ttl() > 0 => {
                        backoff = Duration::from_millis(200);
                        tokio::time::sleep(period).await;
                    }
                    Ok(Some(_)) => break false, // TTL 0: the lease is gone
                    Ok(None) => break true,
                    Err(e) => {
                        tracing::warn!(error = %e, "etcd lease keep-alive failed");
                        break true;
                    }
                }
            },
            Err(e) => {
                // A member that answers may simply not know the lease (it expired, or this
                // member's cluster never had it): ask it, rather than read the message.
                match client.lease_time_to_live(lease, None).await {
                    Ok(r) if r.ttl() <= 0 => false,
                    _ => {
                        tracing::warn!(error = %e, "Cannot reach etcd to keep the lease alive");
                        true
                    }
                }
            }
        };
        if alive {
            // Unreachable or a broken stream: try again, on another member if this one does
            // not answer; if the lease expired meanwhile (or that member's cluster never had
            // it) the next keep-alive answers TTL 0 and it is replaced below.
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
            client = members.fail_over().await;
            continue;
        }
        tracing::warn!(lease, "etcd lease lost; registering again under a new one");
        match client.lease_grant(ttl_s, None).await {
            Ok(g) => {
                let instances: Vec<Instance> = {
                    let mut st = state.lock();
                    st.lease = g.id();
                    st.instances.values().cloned().collect()
                };
                for i in &instances {
                    if let Err(e) = EtcdDiscovery::put(&mut client, g.id(), i).await {
                        tracing::warn!(key = %i.key(), error = %e, "Cannot register again");
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "Cannot grant a new etcd lease");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                client = members.fail_over().await;
            }
        }
    }
}

#[async_trait]
impl Discovery for EtcdDiscovery {
    async fn register(&self, instance: Instance) -> Result<(), PlaneError> {
        let lease = {
            let mut st = self.state.lock();
            st.instances.insert(instance.key(), instance.clone());
            st.lease
        };
        let put = |mut c: Client| {
            let i = &instance;
            async move { Self::put(&mut c, lease, i).await }.boxed()
        };
        self.members.call(put).await
    }

    async fn deregister(&self, key: &str) -> Result<(), PlaneError> {
        self.state.lock().instances.remove(key);
        let delete =
            |mut c: Client| async move { c.delete(key, None).await.map(drop).map_err(err) }.boxed();
        self.members.call(delete).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<Instance>, PlaneError> {
        let snapshot = |mut c: Client| async move { Self::snapshot(&mut c, prefix).await }.boxed();
        Ok(self.members.call(snapshot).await?.0)
    }

    async fn watch(
        &self,
        prefix: &str,
    ) -> Result<(Vec<Instance>, BoxStream<'static, DiscoveryEvent>), PlaneError> {
        let get = |mut c: Client| async move { Self::snapshot(&mut c, prefix).await }.boxed();
        let (snapshot, revision) = self.members.call(get).await?;
        let known: BTreeMap<String, Instance> =
            snapshot.iter().map(|i| (i.key(), i.clone())).collect();
        let (tx, rx) = mpsc::channel(256);
        let members = self.members.clone();
        tokio::spawn(follow(members, prefix.to_owned(), known, revision, tx));
        Ok((snapshot, ReceiverStream::new(rx).boxed()))
    }
}

/// Turn etcd watch responses into discovery events until the receiver is dropped,
/// re-listing and re-watching (on another member if this one is lost) whenever the watch
/// breaks.
async fn follow(
    members: Arc<Members>,
    prefix: String,
    mut known: BTreeMap<String, Instance>,
    mut revision: i64,
    tx: mpsc::Sender<DiscoveryEvent>,
) {
    let mut backoff = Duration::from_millis(200);
    let mut client = members.client();
    loop {
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        match client.watch(prefix.as_str(), Some(opts)).await {
            Ok(mut stream) => loop {
                let resp = match stream.message().await {
                    Ok(Some(r)) => r,
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, prefix, "etcd watch broke");
                        break;
                    }
                };
                if resp.canceled() || resp.compact_revision() > 0 {
                    break; // compacted past us: list again below
                }
                backoff = Duration::from_millis(200);
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    revision = revision.max(kv.mod_revision());
                    let key = String::from_utf8_lossy(kv.key()).into_owned();
                    let out = match ev.event_type() {
                        EventType::Put => match serde_json::from_slice::<Instance>(kv.value()) {
                            Ok(i) => {
                                known.insert(key, i.clone());
                                DiscoveryEvent::Put(i)
                            }
                            Err(e) => {
                                tracing::warn!(key, error = %e, "Ignoring a malformed instance record");
                                continue;
                            }
                        },
                        EventType::Delete => {
                            known.remove(&key);
                            DiscoveryEvent::Delete { key }
                        }
                    };
                    if tx.send(out).await.is_err() {
                        return;
                    }
                }
            },
            Err(e) => tracing::warn!(error = %e, prefix, "Cannot watch etcd"),
        }
        if tx.is_closed() {
            return;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
        // Catch up: whatever changed while the watch was down becomes puts and deletes.
        let get = |mut c: Client| {
            let prefix = &prefix;
            async move { EtcdDiscovery::snapshot(&mut c, prefix).await }.boxed()
        };
        let Ok((now, rev)) = members.call(get).await else {
            continue;
        };
        client = members.client();
        let now: BTreeMap<String, Instance> = now.into_iter().map(|i| (i.key(), i)).collect();
        for ev in dyn_core::planes::discovery::catch_up(&known, &now) {
            if tx.send(ev).await.is_err() {
                return;
            }
        }
        known = now;
        revision = rev;
    }
}
