//! The runtime: run a compiled graph, or this process's share of it.
//!
//! Start-up builds every replica of every operator node placed here, serves it on the request
//! plane and registers it in discovery; then each ingress placed here is built and handed a
//! `ChainRunner` that walks its request path, calling each node through an `EdgeClient`
//! wherever its replicas run. With embedded planes everything is in this process; with etcd and
//! NATS the same code runs one process group replica per OS process ([`Placement::Group`]),
//! and the planes carry the calls between them.
//!
//! The replicas served here live in a `ReplicaSet`, which is also the embedded scaling
//! [`Connector`]: the SLA planner, attached with [`run_attached`], adds replicas the way
//! start-up does and removes one by deregistering it, waiting for the calls it holds and only
//! then stopping it. It also supervises them: a replica that reports itself failed
//! ([`Readiness::fail`], e.g. its engine thread panicked) leaves discovery, is stopped and is
//! replaced by a fresh build, with a growing pause when the replacement fails again soon.
//!
//! Shutdown is a drain: leave discovery first (no router picks this process any more), let the
//! ingresses answer 503 and finish their requests, wait for requests other processes sent
//! here, and after the grace period kill whatever is left. A request whose replica is lost
//! midway is resent elsewhere (`Migrating`), so the client never sees the loss.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use futures::future::{BoxFuture, FutureExt};
use futures::stream::{self, StreamExt};
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio_util::task::TaskTracker;

use crate::compile::{CompiledGraph, CompiledNode, PlaneAddr};
use crate::ctx::{Ctx, RequestId};
use crate::operator::{DynChain, DynOperator, ErrorKind, Input, OpError, Output, ShutdownSignal};
use crate::payload::{AnyPayload, Resume};
use crate::planes::request::EndpointTypes;
use crate::planes::{Instance, LiveInstances, PlaneError, Planes, TcpOptions, Transport};
use crate::registry::{BuildCx, BuildError, Built, Health, Ports, Readiness, Role};
use crate::scale::{Connector, ScaleError};

/// The endpoint name every node serves its requests on.
pub const ENDPOINT: &str = "generate";

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("node '{node}' replica {replica}: {source}")]
    Build {
        node: String,
        replica: u32,
        #[source]
        source: BuildError,
    },
    #[error(transparent)]
    Plane(#[from] PlaneError),
    #[error("ingress '{node}' failed: {source}")]
    Ingress {
        node: String,
        #[source]
        source: OpError,
    },
    #[error("{0}")]
    Unsupported(String),
}

/// Which part of the graph this process runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Placement {
    /// Every node, every replica.
    #[default]
    All,
    /// One replica of one process group: what a supervised process runs.
    Group { process: String, replica: u32 },
}

#[derive(Debug, Clone)]
pub struct RunOptions {
    /// How long in-flight requests may take to finish after a shutdown signal.
    pub grace: Duration,
    pub placement: Placement,
    /// Run only these nodes (another machine runs the rest).
    pub only: Option<Vec<String>>,
    /// The request plane's listener, when a plane leaves the process.
    pub tcp: TcpOptions,
    /// The discovery lease: how long a dead process stays listed at most.
    pub lease_ttl: Duration,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            grace: Duration::from_secs(30),
            placement: Placement::All,
            only: None,
            tcp: TcpOptions::default(),
            lease_ttl: Duration::from_secs(10),
        }
    }
}

impl RunOptions {
    fn runs_node(&self, n: &CompiledNode) -> bool {
        let group = match &self.placement {
            Placement::All => true,
            Placement::Group { process, .. } => &n.process == process,
        };
        group && self.only.as_ref().is_none_or(|o| o.contains(&n.id))
    }

    fn replicas(&self, n: &CompiledNode) -> std::ops::Range<u32> {
        match &self.placement {
            Placement::All => 0..n.replicas,
            Placement::Group { replica, .. } => *replica..replica + 1,
        }
    }
}

fn random_instance_id() -> u64 {
    uuid::Uuid::new_v4().as_u64_pair().0
}

/// What a process may attach to its running graph (the SLA planner): the planes, and a
/// connector that adds and removes replicas of the operator nodes running here.
pub struct Attach {
    pub planes: Planes,
    pub replicas: Arc<dyn Connector>,
}

/// A task attached to a running graph; it is stopped when the drain starts.
pub type Attached = BoxFuture<'static, ()>;

/// Run `graph` (this process's part of it) until `shutdown` resolves or an ingress fails, then
/// drain and stop. The phases, in order: `nodes_here` (what this process runs),
/// `connect_planes`, `Startup::serve_operators` (build, serve and register every operator
/// replica, so every path is servable before any ingress opens), `Startup::start_ingresses`,
/// then wait, and `Running::drain`.
pub async fn run(
    graph: &CompiledGraph,
    opts: RunOptions,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RuntimeError> {
    run_attached(graph, opts, shutdown, |_| None).await
}

/// [`run`], and once the graph is up, `attach` may start a task beside it (see [`Attach`]).
pub async fn run_attached(
    graph: &CompiledGraph,
    opts: RunOptions,
    shutdown: impl Future<Output = ()> + Send,
    attach: impl FnOnce(Attach) -> Option<Attached>,
) -> Result<(), RuntimeError> {
    let here = nodes_here(graph, &opts)?;
    let planes = connect_planes(graph, &opts).await?;
    let (failed, failures) = mpsc::channel(64);
    let replicas = Arc::new(ReplicaSet {
        graph: Arc::new(graph.clone()),
        planes: planes.clone(),
        services: crate::Services::default(),
        opts: opts.clone(),
        served: Mutex::default(),
        scaling: tokio::sync::Mutex::new(()),
        failed,
        closed: AtomicBool::new(false),
    });
    // Holds only a weak reference: the set goes with the graph, and the task with it.
    tokio::spawn(supervise(Arc::downgrade(&replicas), failures));
    let startup = Startup {
        graph,
        planes,
        root: Ctx::with_id("runtime"),
        opts,
        replicas,
    };
    startup.serve_operators(&here).await?;
    let mut running = startup.start_ingresses().await?;
    tracing::info!(graph = %graph.name, nodes = here.len(), "Graph is up");
    let attached = attach(Attach {
        planes: running.planes.clone(),
        replicas: running.replicas.clone(),
    })
    .map(|task| tokio_util::task::AbortOnDropHandle::new(tokio::spawn(task)));

    let failure = tokio::select! {
        _ = shutdown => {
            tracing::info!("Shutdown requested; draining in-flight requests");
            None
        }
        Some(done) = running.ingresses.join_next() => ingress_result(done),
    };
    drop(attached);
    running.drain(failure).await
}

/// Phase 1: the nodes this process runs, after checking the planes allow that split.
fn nodes_here<'g>(
    graph: &'g CompiledGraph,
    opts: &RunOptions,
) -> Result<Vec<&'g CompiledNode>, RuntimeError> {
    let embedded = graph.control == PlaneAddr::Embedded && graph.events == PlaneAddr::Embedded;
    if !embedded && graph.control == PlaneAddr::Embedded {
        return Err(RuntimeError::Unsupported(format!(
            "graph '{}' sends events over {} but keeps discovery embedded; processes can only find each other through etcd (control: etcd://HOST:PORT)",
            graph.name, graph.events
        )));
    }
    if graph.control != PlaneAddr::Embedded && graph.events == PlaneAddr::Embedded {
        tracing::warn!(
            "Discovery is on etcd but events are embedded: KV events and load metrics stay inside each process"
        );
    }
    if embedded && (opts.placement != Placement::All || opts.only.is_some()) {
        return Err(RuntimeError::Unsupported(
            "running part of a graph needs shared planes: give --control etcd://HOST:PORT and --events nats://HOST:PORT".into(),
        ));
    }
    let here: Vec<&CompiledNode> = graph.nodes.iter().filter(|n| opts.runs_node(n)).collect();
    if here.is_empty() {
        return Err(RuntimeError::Unsupported(format!(
            "nothing to run: no node of graph '{}' matches this process ({:?}, only {:?})",
            graph.name, opts.placement, opts.only
        )));
    }
    Ok(here)
}

/// Phase 2: the planes the graph names (embedded ones need no connection).
async fn connect_planes(graph: &CompiledGraph, opts: &RunOptions) -> Result<Planes, PlaneError> {
    if graph.control == PlaneAddr::Embedded && graph.events == PlaneAddr::Embedded {
        return Ok(Planes::embedded());
    }
    Planes::connect(
        &graph.control,
        &graph.events,
        opts.tcp.clone(),
        opts.lease_ttl,
    )
    .await
}

/// What start-up shares between its phases.
struct Startup<'g> {
    graph: &'g CompiledGraph,
    opts: RunOptions,
    planes: Planes,
    /// Parent of every request context: killing it aborts whatever is left after the grace.
    root: Ctx,
    replicas: Arc<ReplicaSet>,
}

impl Startup<'_> {
    /// Phase 3: build every replica of every operator node placed here, serve it on the
    /// request plane and keep it registered in discovery while it is ready (see
    /// [`Readiness`]).
    async fn serve_operators(&self, here: &[&CompiledNode]) -> Result<(), RuntimeError> {
        for n in here {
            if !matches!(n.kind.ports, Ports::Operator { .. }) {
                continue;
            }
            for replica in self.opts.replicas(n) {
                self.replicas.start(n, replica).await?;
            }
        }
        Ok(())
    }

    /// Phase 4: for each ingress placed here, the stages of its request path (one edge client
    /// per node, shared by paths through it), then the ingress itself, serving until told to stop.
    async fn start_ingresses(self) -> Result<Running, RuntimeError> {
        let graph = self.graph;
        // Replicas started here later (by the planner) are called over the planes like any
        // other; preferring the first ones in-process is only a shortcut.
        let local: Arc<HashSet<u64>> = Arc::new(
            self.replicas
                .served
                .lock()
                .iter()
                .map(|r| r.instance.instance_id)
                .collect(),
        );
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let signal: ShutdownSignal = async move {
            let _ = stop_rx.await;
        }
        .boxed()
        .shared();
        let mut ingresses = JoinSet::new();
        let mut edges: Vec<Option<Arc<EdgeClient>>> = vec![None; graph.nodes.len()];
        for chain in &graph.chains {
            let n = &graph.nodes[chain.ingress];
            if !self.opts.runs_node(n) {
                continue;
            }
            let mut stages = Vec::new();
            for &i in &chain.path {
                let node = &graph.nodes[i];
                let Ports::Operator { input, output } = node.kind.ports else {
                    continue;
                };
                let edge = match &edges[i] {
                    Some(e) => e.clone(),
                    None => {
                        let types = EndpointTypes { input, output };
                        let e = EdgeClient::start(
                            &self.planes,
                            &graph.namespace,
                            &node.id,
                            node.kind.role,
                            types,
                            local.clone(),
                        )
                        .await?;
                        edges[i].insert(Arc::new(e)).clone()
                    }
                };
                let stage = Stage::for_node(edge, node, &mut stages);
                stages.push(stage);
            }
            let replica = match &self.opts.placement {
                Placement::All => 0,
                Placement::Group { replica, .. } => *replica,
            };
            let built = self
                .replicas
                .build(n, replica, random_instance_id(), Readiness::default())
                .await?;
            let Built::Ingress(ingress) = built else {
                return Err(wrong_build(n, replica, "kind built an operator"));
            };
            let runner = Arc::new(ChainRunner {
                stages,
                root: self.root.clone(),
                in_flight: TaskTracker::new(),
            });
            let id = n.id.clone();
            let serve = ingress.serve(runner, signal.clone());
            ingresses.spawn(async move { (id, serve.await) });
        }
        Ok(Running {
            graph_name: graph.name.clone(),
            grace: self.opts.grace,
            planes: self.planes,
            root: self.root,
            replicas: self.replicas,
            ingresses,
            stop: stop_tx,
        })
    }
}

/// Registers `instance` whenever its readiness turns ready and deregisters it whenever it turns
/// not ready, until aborted (at the drain) or the replica is gone. A failed replica is
/// deregistered for good and its id sent to `failed`, whose receiver replaces it.
async fn follow_readiness(
    planes: Planes,
    instance: Instance,
    mut ready: watch::Receiver<Health>,
    failed: mpsc::Sender<u64>,
) {
    while ready.changed().await.is_ok() {
        let health = ready.borrow_and_update().clone();
        let id = format!("{:x}", instance.instance_id);
        if let Health::Failed(reason) = health {
            tracing::error!(node = %instance.component, worker_id = %id, reason, "Replica failed; taking it out of discovery to replace it");
            if let Err(e) = planes.discovery.deregister(&instance.key()).await {
                tracing::warn!(node = %instance.component, worker_id = %id, error = %e, "Cannot deregister the failed replica; its lease will expire instead");
            }
            let _ = failed.send(instance.instance_id).await;
            return;
        }
        let now = health == Health::Ready;
        let result = if now {
            planes.discovery.register(instance.clone()).await
        } else {
            planes.discovery.deregister(&instance.key()).await
        };
        match result {
            Ok(()) if now => {
                tracing::info!(node = %instance.component, worker_id = %id, "Replica ready; registered")
            }
            Ok(()) => {
                tracing::warn!(node = %instance.component, worker_id = %id, "Replica not ready; deregistered until it is")
            }
            Err(e) => {
                tracing::warn!(node = %instance.component, worker_id = %id, error = %e, "Cannot follow the replica's readiness in discovery")
            }
        }
    }
}

fn wrong_build(n: &CompiledNode, replica: u32, message: &str) -> RuntimeError {
    RuntimeError::Build {
        node: n.id.clone(),
        replica,
        source: BuildError::new(message),
    }
}

/// The operator replicas this process serves: built, served on the request plane and kept in
/// discovery while ready. Start-up fills it; the planner's embedded connector grows and
/// shrinks it while the graph runs.
struct ReplicaSet {
    graph: Arc<CompiledGraph>,
    planes: Planes,
    services: crate::Services,
    opts: RunOptions,
    served: Mutex<Vec<ServedReplica>>,
    /// One scaling change (or the drain, or a replacement) at a time.
    scaling: tokio::sync::Mutex<()>,
    /// Where followers send the ids of replicas that failed (see [`supervise`]).
    failed: mpsc::Sender<u64>,
    /// Set by the drain: failed replicas are no longer replaced.
    closed: AtomicBool,
}

struct ServedReplica {
    node: String,
    replica: u32,
    instance: Instance,
    /// Keeps the replica registered while it is ready; aborted when it leaves.
    follower: tokio::task::AbortHandle,
    /// One token per call in flight on this replica: a replica being removed waits on it.
    calls: TaskTracker,
}

impl ReplicaSet {
    fn cx(&self, node: &str, replica: u32, instance_id: u64, readiness: Readiness) -> BuildCx {
        let g = &self.graph;
        BuildCx {
            graph: g.name.clone(),
            namespace: g.namespace.clone(),
            node: node.to_owned(),
            replica,
            instance_id,
            consumers: workers_after(g, node),
            model: g.model.clone(),
            base_dir: g.base_dir.clone(),
            planes: self.planes.clone(),
            services: self.services.clone(),
            readiness,
        }
    }

    async fn build(
        &self,
        n: &CompiledNode,
        replica: u32,
        id: u64,
        readiness: Readiness,
    ) -> Result<Built, RuntimeError> {
        n.config
            .clone()
            .build(self.cx(&n.id, replica, id, readiness))
            .await
            .map_err(|source| RuntimeError::Build {
                node: n.id.clone(),
                replica,
                source,
            })
    }

    /// Build replica `replica` of operator node `n`, serve it and follow its readiness.
    async fn start(&self, n: &CompiledNode, replica: u32) -> Result<(), RuntimeError> {
        let Ports::Operator { input, output } = n.kind.ports else {
            return Err(wrong_build(
                n,
                replica,
                "an ingress has no replicas to serve",
            ));
        };
        let types = EndpointTypes { input, output };
        let instance_id = random_instance_id();
        let readiness = Readiness::default();
        let built = self
            .build(n, replica, instance_id, readiness.clone())
            .await?;
        let Built::Operator(op) = built else {
            return Err(wrong_build(n, replica, "kind built an ingress"));
        };
        let calls = TaskTracker::new();
        // Workers are what scaling removes, so only their calls are counted (one more stream
        // layer per call; the other nodes do without it).
        let op: Arc<dyn DynOperator> = if n.kind.role == Role::Worker {
            Arc::new(Counted {
                inner: op,
                calls: calls.clone(),
            })
        } else {
            op
        };
        let mut metadata = n.config.metadata();
        metadata.insert("kind".into(), n.kind.name.into());
        if let Some(m) = &self.graph.model {
            metadata.insert("model".into(), m.name.clone().into());
        }
        let mut instance = Instance {
            namespace: self.graph.namespace.clone(),
            component: n.id.clone(),
            endpoint: ENDPOINT.to_owned(),
            instance_id,
            transport: Transport::InProcess,
            metadata,
        };
        instance.transport = self.planes.requests.serve(&instance, types, op).await?;
        let mut ready = readiness.subscribe();
        let health = ready.borrow_and_update().clone();
        match health {
            Health::Ready => self.planes.discovery.register(instance.clone()).await?,
            Health::NotReady => {
                tracing::warn!(node = %n.id, worker_id = format_args!("{instance_id:x}"), replica, "Replica not ready; registered once it is")
            }
            Health::Failed(reason) => {
                let _ = self.planes.requests.unserve(instance_id).await;
                return Err(wrong_build(
                    n,
                    replica,
                    &format!("failed as it started: {reason}"),
                ));
            }
        }
        let follower = tokio::spawn(follow_readiness(
            self.planes.clone(),
            instance.clone(),
            ready,
            self.failed.clone(),
        ))
        .abort_handle();
        tracing::info!(node = %n.id, worker_id = format_args!("{instance_id:x}"), replica, kind = n.kind.name, "Node replica started");
        self.served.lock().push(ServedReplica {
            node: n.id.clone(),
            replica,
            instance,
            follower,
            calls,
        });
        Ok(())
    }

    async fn deregister(&self, instance: &Instance) {
        if let Err(e) = self.planes.discovery.deregister(&instance.key()).await {
            tracing::warn!(error = %e, "Deregistration failed; the lease will expire instead");
        }
    }

    /// Take the newest replica of `node` out: deregister it now; in the background, wait for
    /// the calls it holds (up to the grace period), then stop serving it.
    async fn remove_one(&self, node: &str) -> bool {
        let r = {
            let mut served = self.served.lock();
            let newest = served
                .iter()
                .enumerate()
                .filter(|(_, r)| r.node == node)
                .max_by_key(|(_, r)| r.replica)
                .map(|(i, _)| i);
            match newest {
                Some(i) => served.remove(i),
                None => return false,
            }
        };
        r.follower.abort();
        self.deregister(&r.instance).await;
        tracing::info!(
            node,
            worker_id = format_args!("{:x}", r.instance.instance_id),
            replica = r.replica,
            in_flight = r.calls.len(),
            "Replica deregistered; draining"
        );
        self.retire(r);
        true
    }

    /// In the background, wait for the calls `r` holds (up to the grace period), then stop
    /// serving it. It must already be out of discovery.
    fn retire(&self, r: ServedReplica) {
        let requests = self.planes.requests.clone();
        let grace = self.opts.grace;
        tokio::spawn(async move {
            // Routers that chose it a moment before it left still reach it: their calls are
            // counted from the first, so waiting on the tracker covers them.
            r.calls.close();
            if tokio::time::timeout(grace, r.calls.wait()).await.is_err() {
                tracing::warn!(node = %r.node, replica = r.replica, "Replica still busy after the grace period; stopping it");
            }
            if let Err(e) = requests.unserve(r.instance.instance_id).await {
                tracing::warn!(error = %e, "Cannot stop serving the replica");
            }
            tracing::info!(node = %r.node, worker_id = format_args!("{:x}", r.instance.instance_id), replica = r.replica, "Replica stopped");
        });
    }

    /// Replace the failed replica `instance_id`: stop serving it and build the same replica
    /// afresh. Returns the replaced replica's node and number (`None`: it was already gone —
    /// removed by scaling, or the graph is draining).
    async fn replace(&self, instance_id: u64) -> Option<(String, u32)> {
        let _one = self.scaling.lock().await;
        if self.closed.load(Ordering::Acquire) {
            return None;
        }
        let r = {
            let mut served = self.served.lock();
            let i = served
                .iter()
                .position(|r| r.instance.instance_id == instance_id)?;
            served.remove(i)
        };
        r.follower.abort();
        let (node, replica) = (r.node.clone(), r.replica);
        // Its requests already failed as lost (and migrated); what is left ends with it.
        self.retire(r);
        let compiled = self.graph.node(&node).cloned()?;
        match self.start(&compiled, replica).await {
            Ok(()) => tracing::info!(node, replica, "Failed replica replaced"),
            Err(e) => {
                tracing::error!(node, replica, error = %e, "Cannot replace the failed replica; the planner or a restart must")
            }
        }
        Some((node, replica))
    }

    fn count(&self, node: &str) -> u32 {
        let n = self.served.lock().iter().filter(|r| r.node == node).count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    fn scalable(&self, node: &str) -> Result<&CompiledNode, ScaleError> {
        self.graph
            .node(node)
            .filter(|n| n.kind.role == Role::Worker && self.opts.runs_node(n))
            .ok_or_else(|| ScaleError::UnknownNode(node.to_owned()))
    }
}

#[async_trait::async_trait]
impl Connector for ReplicaSet {
    fn name(&self) -> &'static str {
        "embedded"
    }

    async fn replicas(&self, node: &str) -> Result<u32, ScaleError> {
        self.scalable(node)?;
        Ok(self.count(node))
    }

    async fn set_replicas(&self, node: &str, n: u32) -> Result<(), ScaleError> {
        let compiled = self.scalable(node)?.clone();
        let _one = self.scaling.lock().await;
        while self.count(node) < n {
            let next = self
                .served
                .lock()
                .iter()
                .filter(|r| r.node == node)
                .map(|r| r.replica + 1)
                .max()
                .unwrap_or(0);
            self.start(&compiled, next)
                .await
                .map_err(|e| ScaleError::Failed {
                    node: node.to_owned(),
                    message: e.to_string(),
                })?;
        }
        while self.count(node) > n {
            if !self.remove_one(node).await {
                break;
            }
        }
        Ok(())
    }
}

/// Replace the replicas whose followers report them failed, one at a time. A replica that
/// fails again within a minute of its replacement waits longer before the next (1 s, 2 s, …
/// 30 s), so a replica that cannot start sanely does not spin.
async fn supervise(set: Weak<ReplicaSet>, mut failed: mpsc::Receiver<u64>) {
    let mut recent: HashMap<(String, u32), (u32, Instant)> = HashMap::new();
    while let Some(id) = failed.recv().await {
        let Some(set) = set.upgrade() else { return };
        let key = set
            .served
            .lock()
            .iter()
            .find(|r| r.instance.instance_id == id)
            .map(|r| (r.node.clone(), r.replica));
        let Some(key) = key else { continue };
        let pause = match recent.get(&key) {
            Some((n, at)) if at.elapsed() < Duration::from_secs(60) => {
                Duration::from_secs(1 << (*n).min(5)).min(Duration::from_secs(30))
            }
            _ => Duration::ZERO,
        };
        if !pause.is_zero() {
            tracing::warn!(node = %key.0, replica = key.1, pause = ?pause, "Replica failed again soon after its replacement; waiting before the next");
            tokio::time::sleep(pause).await;
        }
        if set.replace(id).await.is_some() {
            let n = match recent.get(&key) {
                Some((n, at)) if at.elapsed() < Duration::from_secs(60) => n + 1,
                _ => 0,
            };
            recent.insert(key, (n, Instant::now()));
        }
    }
}

/// A replica's operator, counting the calls in flight on it.
struct Counted {
    inner: Arc<dyn DynOperator>,
    calls: TaskTracker,
}

impl DynOperator for Counted {
    fn call(&self, ctx: Ctx, input: Input<AnyPayload>) -> Output<AnyPayload> {
        let token = self.calls.token();
        let mut out = self.inner.call(ctx, input);
        async_stream::stream! {
            let _token = token;
            while let Some(item) = out.next().await {
                yield item;
            }
        }
        .boxed()
    }
}

/// A graph that is up: what the drain needs.
struct Running {
    graph_name: String,
    grace: Duration,
    planes: Planes,
    root: Ctx,
    replicas: Arc<ReplicaSet>,
    ingresses: JoinSet<(String, Result<(), OpError>)>,
    stop: tokio::sync::oneshot::Sender<()>,
}

impl Running {
    /// Phase 6: leave discovery first (routers stop choosing this process while it finishes
    /// its work), tell the ingresses to drain, wait for them and for requests other processes
    /// sent here; after the grace period kill whatever is left.
    async fn drain(mut self, mut failure: Option<RuntimeError>) -> Result<(), RuntimeError> {
        // The scaling lock is held to the end: no replica starts or stops during the drain.
        let _scaling = self.replicas.scaling.lock().await;
        self.replicas.closed.store(true, Ordering::Release);
        let served = std::mem::take(&mut *self.replicas.served.lock());
        for r in &served {
            r.follower.abort();
        }
        for r in &served {
            self.replicas.deregister(&r.instance).await;
        }
        let _ = self.stop.send(());
        let ingresses = &mut self.ingresses;
        let requests = self.planes.requests.clone();
        let drain = async {
            while let Some(done) = ingresses.join_next().await {
                if let Some(e) = ingress_result(done) {
                    failure.get_or_insert(e);
                }
            }
            requests.drained().await;
        };
        if tokio::time::timeout(self.grace, drain).await.is_err() {
            tracing::warn!(grace = ?self.grace, in_flight = self.planes.requests.in_flight(), "Grace period over; aborting requests still in flight");
            self.root.kill();
            if tokio::time::timeout(Duration::from_secs(5), async {
                while self.ingresses.join_next().await.is_some() {}
            })
            .await
            .is_err()
            {
                self.ingresses.abort_all();
            }
        }
        for r in served {
            self.planes.requests.unserve(r.instance.instance_id).await?;
        }
        tracing::info!(graph = %self.graph_name, "Graph stopped");
        failure.map_or(Ok(()), Err)
    }
}

/// The nodes taking `node`'s output, with routers and pass-through nodes replaced by the
/// nodes after them: the workers a router chooses among.
fn workers_after(graph: &CompiledGraph, node: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![node.to_owned()];
    let mut seen = HashSet::new();
    while let Some(n) = stack.pop() {
        for c in graph
            .nodes
            .iter()
            .filter(|c| c.inputs.iter().any(|&i| graph.nodes[i].id == n))
        {
            if !seen.insert(c.id.clone()) {
                continue;
            }
            if c.kind.role.forwards() {
                stack.push(c.id.clone());
            } else {
                out.push(c.id.clone());
            }
        }
    }
    out
}

fn ingress_result(
    done: Result<(String, Result<(), OpError>), tokio::task::JoinError>,
) -> Option<RuntimeError> {
    match done {
        Ok((_, Ok(()))) => None,
        Ok((node, Err(source))) => Some(RuntimeError::Ingress { node, source }),
        Err(e) => Some(RuntimeError::Ingress {
            node: "?".into(),
            source: OpError::internal(format!("ingress task failed: {e}")),
        }),
    }
}

/// Calls one node: keeps its live instances from discovery and picks one per request, the
/// one a router chose when the payload names it; otherwise one in this process if there is
/// one, else the next in round-robin order, skipping instances the request plane saw fail.
struct EdgeClient {
    node: String,
    role: Role,
    types: EndpointTypes,
    planes: Planes,
    instances: Arc<LiveInstances>,
    local: Arc<HashSet<u64>>,
}

impl EdgeClient {
    async fn start(
        planes: &Planes,
        namespace: &str,
        node: &str,
        role: Role,
        types: EndpointTypes,
        local: Arc<HashSet<u64>>,
    ) -> Result<Self, PlaneError> {
        let prefix = Instance::prefix(namespace, node, ENDPOINT);
        Ok(Self {
            node: node.to_owned(),
            role,
            types,
            planes: planes.clone(),
            instances: planes.live(&prefix).await?,
            local,
        })
    }

    fn pick(&self, target: Option<u64>) -> Result<Instance, OpError> {
        if let Some(t) = target {
            return self
                .instances
                .read()
                .iter()
                .find(|i| i.instance_id == t && !self.planes.is_down(t))
                .cloned()
                .ok_or_else(|| {
                    OpError::instance_lost(format!("instance {t:x} of '{}' is gone", self.node))
                });
        }
        self.instances
            .round_robin(|i| self.local.contains(&i.instance_id))
            .or_else(|| {
                self.instances
                    .round_robin(|i| !self.planes.is_down(i.instance_id))
            })
            .ok_or_else(|| OpError::unavailable(format!("no live instance of '{}'", self.node)))
    }

    fn call(self: &Arc<Self>, ctx: Ctx, input: Input<AnyPayload>) -> Output<AnyPayload> {
        let this = self.clone();
        // The target is a property of the first item (a routed request); peek at it.
        async_stream::stream! {
            let mut input = input.peekable();
            // A router's choice is for the worker behind it, not the nodes on the way.
            let target = if this.role == Role::Worker {
                Pin::new(&mut input).peek().await.and_then(|p| p.target_instance())
            } else {
                None
            };
            let picked = this.pick(target);
            match picked {
                Ok(instance) => {
                    tracing::debug!(request_id = %ctx.id(), node = %this.node, worker_id = format_args!("{:x}", instance.instance_id), "Calling");
                    let mut out = this.planes.requests.call(&instance, this.types, ctx, input.boxed());
                    while let Some(item) = out.next().await {
                        yield item;
                    }
                }
                Err(e) => yield Err(e),
            }
        }
        .boxed()
    }
}

/// One step of a request path: a node, or a node with the router in front of it wrapped in
/// request migration.
enum Stage {
    Node(Arc<EdgeClient>),
    Migrating(Arc<Migrating>),
}

impl Stage {
    /// The stage for `node`; a migrating worker takes the routers and pass-through nodes right
    /// before it into its segment, so a resent request is routed and prefilled afresh.
    fn for_node(edge: Arc<EdgeClient>, node: &CompiledNode, stages: &mut Vec<Stage>) -> Stage {
        let resume = match (
            node.kind.role,
            node.migration_limit,
            edge.types.input.resume,
        ) {
            (Role::Worker, limit, Some(resume)) if limit > 0 => resume,
            _ => return Stage::Node(edge),
        };
        let mut steps = vec![edge];
        while let Some(Stage::Node(prev)) = stages.last()
            && prev.role.forwards()
        {
            steps.insert(0, prev.clone());
            stages.pop();
        }
        Stage::Migrating(Arc::new(Migrating {
            steps,
            resume,
            limit: node.migration_limit,
        }))
    }

    fn call(&self, ctx: Ctx, input: Input<AnyPayload>) -> Output<AnyPayload> {
        match self {
            Stage::Node(e) => e.call(ctx, input),
            Stage::Migrating(m) => m.call(ctx, input),
        }
    }
}

/// Something a request path calls: a node, or a migrating segment.
trait Step {
    fn call(&self, ctx: Ctx, input: Input<AnyPayload>) -> Output<AnyPayload>;
}

impl Step for Arc<EdgeClient> {
    fn call(&self, ctx: Ctx, input: Input<AnyPayload>) -> Output<AnyPayload> {
        EdgeClient::call(self, ctx, input)
    }
}

impl Step for Stage {
    fn call(&self, ctx: Ctx, input: Input<AnyPayload>) -> Output<AnyPayload> {
        Stage::call(self, ctx, input)
    }
}

/// Chain `steps` so each one's outputs are the next one's inputs. An error from a step in the
/// middle ends its downstream's input and comes out last.
fn run_path<S: Step>(steps: &[S], ctx: &Ctx, input: Input<AnyPayload>) -> Output<AnyPayload> {
    let failed: Arc<Mutex<Option<OpError>>> = Arc::default();
    let mut input = input;
    let mut calls = steps.iter().peekable();
    let mut last = None;
    while let Some(step) = calls.next() {
        let out = step.call(ctx.clone(), input);
        if calls.peek().is_none() {
            last = Some(out);
            break;
        }
        let slot = failed.clone();
        input = out
            .scan((), move |_, item| {
                futures::future::ready(match item {
                    Ok(v) => Some(v),
                    Err(e) => {
                        slot.lock().get_or_insert(e);
                        None
                    }
                })
            })
            .boxed();
    }
    let Some(mut out) = last else {
        return stream::iter([Err(OpError::internal("empty request path"))]).boxed();
    };
    async_stream::stream! {
        while let Some(item) = out.next().await {
            let upstream_error = failed.lock().take();
            if let Some(e) = upstream_error {
                yield Err(e);
                return;
            }
            yield item;
        }
        let upstream_error = failed.lock().take();
        if let Some(e) = upstream_error {
            yield Err(e);
        }
    }
    .boxed()
}

/// Request migration: the segment's (unary) request is kept, every output the caller gets is
/// folded into it, and when the replica is lost (an [`ErrorKind::InstanceLost`] error: it
/// died, was unreachable, or was leaving) the request is sent again, up to `limit` times,
/// continuing where the caller's stream stopped. The caller sees one stream. Nothing else is
/// resent: a busy replica's refusal ([`ErrorKind::Overloaded`]) or an empty pool
/// ([`ErrorKind::Unavailable`]) reaches the client at once, since resending would only add
/// load where there is too much already.
struct Migrating {
    steps: Vec<Arc<EdgeClient>>,
    resume: Resume,
    limit: u32,
}

impl Migrating {
    fn call(self: &Arc<Self>, ctx: Ctx, input: Input<AnyPayload>) -> Output<AnyPayload> {
        let this = self.clone();
        async_stream::stream! {
            let mut input = input;
            let Some(first) = input.next().await else { return };
            let Some(mut kept) = (this.resume.copy)(first.as_ref()) else {
                yield Err(OpError::internal("request cannot be copied for migration"));
                return;
            };
            let mut request = Some(first);
            let mut attempt = 0;
            // A resent request repeats its header; the caller needs exactly one.
            let mut header_sent = false;
            loop {
                let Some(req) = request.take() else { return };
                let mut out = run_path(&this.steps, &ctx, stream::iter([req]).boxed());
                let mut lost = None;
                while let Some(item) = out.next().await {
                    match item {
                        Ok(v) => {
                            if (this.resume.is_repeat)(v.as_ref()) {
                                if header_sent {
                                    continue;
                                }
                                header_sent = true;
                            }
                            (this.resume.absorb)(kept.as_mut(), v.as_ref());
                            yield Ok(v);
                        }
                        Err(e) if e.kind == ErrorKind::InstanceLost && attempt < this.limit && !ctx.is_killed() => {
                            lost = Some(e);
                            break;
                        }
                        Err(e) => {
                            yield Err(e);
                            return;
                        }
                    }
                }
                let Some(e) = lost else { return };
                attempt += 1;
                tracing::warn!(request_id = %ctx.id(), attempt, limit = this.limit, error = %e.message, "Replica lost; migrating the request");
                // Give discovery a moment when nothing else is left to pick (50, 100, 200 ms…),
                // unless the client leaves first.
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(50 << (attempt - 1).min(4))) => {}
                    _ = ctx.killed() => {
                        yield Err(OpError::cancelled());
                        return;
                    }
                }
                let Some(mut again) = (this.resume.copy)(kept.as_ref()) else { return };
                (this.resume.clear_target)(again.as_mut());
                request = Some(again);
            }
        }
        .boxed()
    }
}

/// Walks one ingress's request path: the output stream of each stage is the input stream of
/// the next, and the last stage's outputs go back to the ingress.
struct ChainRunner {
    stages: Vec<Stage>,
    root: Ctx,
    /// One token per request whose response stream is open: the ingress drains on it.
    in_flight: TaskTracker,
}

impl DynChain for ChainRunner {
    fn new_ctx(&self, id: RequestId) -> Ctx {
        self.root.child(id)
    }

    fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    fn drained(&self) -> BoxFuture<'static, ()> {
        let tracker = self.in_flight.clone();
        tracker.close();
        async move { tracker.wait().await }.boxed()
    }

    fn call(&self, ctx: Ctx, request: AnyPayload) -> Output<AnyPayload> {
        let token = self.in_flight.token();
        let mut out = run_path(&self.stages, &ctx, stream::iter([request]).boxed());
        async_stream::stream! {
            let _token = token;
            // Only the first item fires the hooks; later ones skip the context's lock.
            let mut first = true;
            while let Some(item) = out.next().await {
                if first && item.is_ok() {
                    first = false;
                    ctx.first_output();
                }
                yield item;
            }
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operator::{Operator, erase};
    use crate::payload::{Payload, downcast};
    use std::sync::atomic::Ordering;

    struct N(u32);
    impl Payload for N {
        const NAME: &'static str = "N";
    }

    /// Emits each input, then fails if `fail` is set.
    struct Step {
        fail: bool,
    }
    impl Operator for Step {
        type In = N;
        type Out = N;
        fn call(&self, _ctx: Ctx, input: Input<N>) -> Output<N> {
            let fail = self.fail;
            input
                .map(Ok)
                .chain(stream::iter(
                    fail.then(|| Err(OpError::invalid("step failed"))),
                ))
                .boxed()
        }
    }

    fn n_types() -> EndpointTypes {
        EndpointTypes {
            input: crate::PayloadType::of::<N>(),
            output: crate::PayloadType::of::<N>(),
        }
    }

    async fn serve(planes: &Planes, node: &str, op: Step) -> Arc<EdgeClient> {
        let types = n_types();
        let instance = Instance {
            namespace: "t".into(),
            component: node.into(),
            endpoint: ENDPOINT.into(),
            instance_id: random_instance_id(),
            transport: Transport::InProcess,
            metadata: Default::default(),
        };
        planes
            .requests
            .serve(&instance, types, erase(op))
            .await
            .unwrap();
        planes.discovery.register(instance).await.unwrap();
        Arc::new(
            EdgeClient::start(planes, "t", node, Role::Stage, types, Arc::default())
                .await
                .unwrap(),
        )
    }

    #[tokio::test]
    async fn a_replica_is_in_discovery_exactly_while_it_is_ready() {
        let planes = Planes::embedded();
        let instance = Instance {
            namespace: "t".into(),
            component: "w".into(),
            endpoint: ENDPOINT.into(),
            instance_id: 7,
            transport: Transport::InProcess,
            metadata: Default::default(),
        };
        let readiness = Readiness::default();
        readiness.set(false);
        let mut ready = readiness.subscribe();
        ready.borrow_and_update();
        let (failed, mut failures) = mpsc::channel(1);
        let follower = tokio::spawn(follow_readiness(planes.clone(), instance, ready, failed));
        let registered = || async { planes.discovery.list("").await.unwrap().len() };
        let until = |want: usize| async move {
            for _ in 0..200 {
                if registered().await == want {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            panic!("never {want} registered");
        };
        assert_eq!(registered().await, 0);
        readiness.set(true);
        until(1).await;
        readiness.set(false);
        until(0).await;
        readiness.set(true);
        until(1).await;
        // A failure is for good: out of discovery, reported, and nothing after it counts.
        readiness.fail("engine thread panicked");
        assert_eq!(failures.recv().await, Some(7));
        until(0).await;
        readiness.set(true);
        assert!(!readiness.is_ready());
        assert!(follower.await.is_ok(), "the follower ends after a failure");
        assert_eq!(registered().await, 0);
    }

    #[tokio::test]
    async fn error_in_the_middle_of_a_path_reaches_the_ingress_last() {
        let planes = Planes::embedded();
        let runner = ChainRunner {
            stages: vec![
                Stage::Node(serve(&planes, "a", Step { fail: true }).await),
                Stage::Node(serve(&planes, "b", Step { fail: false }).await),
            ],
            root: Ctx::new(),
            in_flight: TaskTracker::new(),
        };
        let ctx = runner.new_ctx("r".into());
        let out: Vec<_> = runner.call(ctx, Box::new(N(7))).collect().await;
        assert_eq!(out.len(), 2);
        let mut out = out.into_iter();
        let first = out.next().unwrap().unwrap();
        assert_eq!(downcast::<N>(first).ok().map(|n| n.0), Some(7));
        let err = out.next().unwrap().err().unwrap();
        assert_eq!(err.message, "step failed");
    }

    #[tokio::test]
    async fn runtime_root_kill_reaches_request_contexts() {
        let planes = Planes::embedded();
        let runner = ChainRunner {
            stages: vec![Stage::Node(serve(&planes, "a", Step { fail: false }).await)],
            root: Ctx::new(),
            in_flight: TaskTracker::new(),
        };
        let ctx = runner.new_ctx("r".into());
        runner.root.kill();
        assert!(ctx.is_killed());
    }

    #[tokio::test]
    async fn no_live_instance_is_unavailable() {
        let planes = Planes::embedded();
        let types = n_types();
        let edge = Arc::new(
            EdgeClient::start(&planes, "t", "ghost", Role::Worker, types, Arc::default())
                .await
                .unwrap(),
        );
        let out: Vec<_> = edge
            .call(
                Ctx::new(),
                stream::iter([Box::new(N(1)) as AnyPayload]).boxed(),
            )
            .collect()
            .await;
        assert!(matches!(&out[..], [Err(e)] if e.kind == crate::ErrorKind::Unavailable));
    }
    #[derive(Clone)]
    struct Req {
        pos: u32,
        left: u32,
    }
    impl Payload for Req {
        const NAME: &'static str = "Req";
        fn resume() -> Option<Resume> {
            Some(Resume::of::<Self>())
        }
    }
    const HEADER: u32 = u32::MAX;
    impl crate::payload::Resumable for Req {
        type Output = N;
        fn absorb(&mut self, out: &N) {
            if out.0 != HEADER {
                self.pos += 1;
                self.left -= 1;
            }
        }
        fn is_repeat(out: &N) -> bool {
            out.0 == HEADER
        }
        fn clear_target(&mut self) {}
    }

    /// Streams a header, then positions `pos..pos+left`; the first call to get 3 tokens out
    /// dies with `InstanceLost`, as a lost replica does.
    struct Flaky {
        died: Arc<std::sync::atomic::AtomicBool>,
    }
    impl Operator for Flaky {
        type In = Req;
        type Out = N;
        fn call(&self, _ctx: Ctx, input: Input<Req>) -> Output<N> {
            let died = self.died.clone();
            async_stream::stream! {
                let mut input = input;
                let Some(req) = input.next().await else { return };
                yield Ok(N(HEADER));
                for (i, p) in (req.pos..req.pos + req.left).enumerate() {
                    if i == 3 && !died.swap(true, Ordering::SeqCst) {
                        yield Err(OpError::instance_lost("replica lost"));
                        return;
                    }
                    yield Ok(N(p));
                }
            }
            .boxed()
        }
    }

    #[tokio::test]
    async fn a_lost_replica_is_migrated_without_gaps_or_repeats() {
        let planes = Planes::embedded();
        let types = EndpointTypes {
            input: crate::PayloadType::of::<Req>(),
            output: crate::PayloadType::of::<N>(),
        };
        let died = Arc::new(std::sync::atomic::AtomicBool::new(false));
        for id in [1, 2] {
            let instance = Instance {
                namespace: "t".into(),
                component: "decode".into(),
                endpoint: ENDPOINT.into(),
                instance_id: id,
                transport: Transport::InProcess,
                metadata: Default::default(),
            };
            let op = erase(Flaky { died: died.clone() });
            planes.requests.serve(&instance, types, op).await.unwrap();
            planes.discovery.register(instance).await.unwrap();
        }
        let edge = Arc::new(
            EdgeClient::start(&planes, "t", "decode", Role::Worker, types, Arc::default())
                .await
                .unwrap(),
        );
        let migrating = |limit| ChainRunner {
            stages: vec![Stage::Migrating(Arc::new(Migrating {
                steps: vec![edge.clone()],
                resume: Resume::of::<Req>(),
                limit,
            }))],
            root: Ctx::new(),
            in_flight: TaskTracker::new(),
        };
        let runner = migrating(3);
        let out: Vec<u32> = runner
            .call(Ctx::new(), Box::new(Req { pos: 0, left: 10 }))
            .map(|r| downcast::<N>(r.unwrap()).ok().unwrap().0)
            .collect()
            .await;
        assert!(died.load(Ordering::SeqCst), "a replica was lost");
        let mut want = vec![HEADER];
        want.extend(0..10);
        assert_eq!(out, want);
        assert_eq!(runner.in_flight(), 0);

        // Without migration the loss reaches the caller.
        died.store(false, Ordering::SeqCst);
        let out: Vec<_> = migrating(0)
            .call(Ctx::new(), Box::new(Req { pos: 0, left: 10 }))
            .collect()
            .await;
        assert!(matches!(out.last(), Some(Err(e)) if e.kind == ErrorKind::InstanceLost));
    }

    /// Answers every call with `error` and counts the calls.
    struct Refusing {
        error: OpError,
        calls: Arc<std::sync::atomic::AtomicUsize>,
    }
    impl Operator for Refusing {
        type In = Req;
        type Out = N;
        fn call(&self, _ctx: Ctx, _input: Input<Req>) -> Output<N> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            stream::iter([Err(self.error.clone())]).boxed()
        }
    }

    /// A migrating segment over `replicas` workers that all answer with `error`.
    async fn refused_by(
        replicas: u64,
        error: OpError,
    ) -> (ChainRunner, Arc<std::sync::atomic::AtomicUsize>) {
        let planes = Planes::embedded();
        let types = EndpointTypes {
            input: crate::PayloadType::of::<Req>(),
            output: crate::PayloadType::of::<N>(),
        };
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for id in 1..=replicas {
            let instance = Instance {
                namespace: "t".into(),
                component: "decode".into(),
                endpoint: ENDPOINT.into(),
                instance_id: id,
                transport: Transport::InProcess,
                metadata: Default::default(),
            };
            let op = erase(Refusing {
                error: error.clone(),
                calls: calls.clone(),
            });
            planes.requests.serve(&instance, types, op).await.unwrap();
            planes.discovery.register(instance).await.unwrap();
        }
        let edge = Arc::new(
            EdgeClient::start(&planes, "t", "decode", Role::Worker, types, Arc::default())
                .await
                .unwrap(),
        );
        let runner = ChainRunner {
            stages: vec![Stage::Migrating(Arc::new(Migrating {
                steps: vec![edge],
                resume: Resume::of::<Req>(),
                limit: 3,
            }))],
            root: Ctx::new(),
            in_flight: TaskTracker::new(),
        };
        (runner, calls)
    }

    // Paused clocks: a back-off slept shows as virtual time passed, with nothing timed for real.
    #[tokio::test(start_paused = true)]
    async fn busy_workers_refuse_once_and_are_not_retried() {
        let (runner, calls) = refused_by(3, OpError::overloaded("the worker is busy")).await;
        let started = tokio::time::Instant::now();
        let out: Vec<_> = runner
            .call(Ctx::new(), Box::new(Req { pos: 0, left: 10 }))
            .collect()
            .await;
        assert!(
            matches!(&out[..], [Err(e)] if e.kind == ErrorKind::Overloaded && e.code.as_deref() == Some(crate::WORKER_BUSY)),
            "{out:?}"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 1, "one call, no resends");
        // No back-off was slept (the old path slept 50 + 100 + 200 ms).
        assert_eq!(started.elapsed(), Duration::ZERO);

        // An empty pool is not retried either.
        let (runner, calls) = refused_by(2, OpError::unavailable("no worker")).await;
        let out: Vec<_> = runner
            .call(Ctx::new(), Box::new(Req { pos: 0, left: 10 }))
            .collect()
            .await;
        assert!(matches!(&out[..], [Err(e)] if e.kind == ErrorKind::Unavailable));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_leaves_during_the_back_off_ends_the_migration_at_once() {
        let (runner, calls) = refused_by(2, OpError::instance_lost("gone")).await;
        let ctx = Ctx::new();
        let killer = ctx.clone();
        let mut out = runner.call(ctx, Box::new(Req { pos: 0, left: 10 }));
        // The first loss starts a 50 ms back-off; the client leaves inside it.
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            killer.kill();
        });
        let started = tokio::time::Instant::now();
        let last = out.next().await;
        assert!(
            matches!(&last, Some(Err(e)) if e.kind == ErrorKind::Cancelled),
            "{last:?}"
        );
        assert!(out.next().await.is_none());
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "nothing resent after the kill"
        );
        assert_eq!(
            started.elapsed(),
            Duration::from_millis(10),
            "not the 50 ms back-off"
        );

        // Left alone, a lost request is resent up to the limit (1 + 3 calls).
        let (runner, calls) = refused_by(2, OpError::instance_lost("gone")).await;
        let out: Vec<_> = runner
            .call(Ctx::new(), Box::new(Req { pos: 0, left: 10 }))
            .collect()
            .await;
        assert!(matches!(&out[..], [Err(e)] if e.kind == ErrorKind::InstanceLost));
        assert_eq!(calls.load(Ordering::SeqCst), 4);
    }
}
