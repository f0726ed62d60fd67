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
use crate::planes::request::EndpointTypes;
use crate::planes::{
    Instance, InstanceId, LiveInstances, PlaneError, Planes, TcpOptions, Transport,
};
use dyn_core::build::{BuildCx, BuildError, Health, Readiness};
use dyn_core::ctx::{Ctx, RequestId};
use dyn_core::operator::{
    DynChain, DynOperator, ErrorKind, Input, OpError, Output, ShutdownSignal,
};
use dyn_core::payload::{AnyPayload, Resume};
use dyn_core::registry::{Built, Ports, Role};
use dyn_core::scale::{Connector, ScaleError};

mod chain;
mod replicas;
#[cfg(test)]
mod tests;

use chain::*;
use replicas::*;

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

fn random_instance_id() -> InstanceId {
    InstanceId(uuid::Uuid::new_v4().as_u64_pair().0)
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
    if !here.iter().any(|n| n.kind.role == Role::Worker) {
        without_huge_pages();
    }
    let planes = connect_planes(graph, &opts).await?;
    let (failed, failures) = mpsc::channel(64);
    let replicas = Arc::new(ReplicaSet {
        graph: Arc::new(graph.clone()),
        planes: planes.clone(),
        services: dyn_core::Services::default(),
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

/// A process that serves no worker (an ingress, its stages and routers) runs without
/// transparent huge pages. mimalloc advises its arenas for them and purges freed memory, so a
/// long prompt's buffers, freed and allocated again each request, faulted in whole 2 MiB pages
/// the kernel zeroed: a third of a frontend's CPU on a 32k-token turn. An engine keeps them (the
/// native engine's one-process requests took 8–12 % longer without; BENCHMARKS.md, "Frontend
/// cost per turn of a long conversation").
fn without_huge_pages() {
    #[cfg(target_os = "linux")]
    if let Err(e) = nix::sys::prctl::set_thp_disable(true) {
        tracing::debug!(error = %e, "transparent huge pages stay on");
    }
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
    let mut planes = crate::planes::connect(
        &graph.control,
        &graph.events,
        opts.tcp.clone(),
        opts.lease_ttl,
    )
    .await?;
    planes.transfer = graph.transfer;
    Ok(planes)
}

/// `here` with every node after the nodes it calls (those that take it as an input): a node
/// that watches the replicas it calls (a router its workers) then finds those of this process
/// registered when it starts, instead of learning of them from discovery's events an instant
/// later — a request that came in between would find no worker.
fn callees_first<'g>(graph: &CompiledGraph, here: &[&'g CompiledNode]) -> Vec<&'g CompiledNode> {
    let index = |n: &CompiledNode| graph.nodes.iter().position(|m| m.id == n.id);
    let at: Vec<Option<usize>> = here.iter().map(|n| index(n)).collect();
    let mut done = vec![false; here.len()];
    let mut order = Vec::with_capacity(here.len());
    while order.len() < here.len() {
        let before = order.len();
        for (i, n) in here.iter().enumerate() {
            // Ready once every node here that takes it as an input is placed.
            let ready = !done[i]
                && here.iter().enumerate().all(|(j, m)| {
                    done[j] || j == i || at[i].is_none_or(|a| !m.inputs.contains(&a))
                });
            if ready {
                done[i] = true;
                order.push(*n);
            }
        }
        if order.len() == before {
            // A cycle (the compiler refuses those): the rest in the graph's order.
            order.extend(
                here.iter()
                    .zip(&done)
                    .filter(|(_, d)| !**d)
                    .map(|(n, _)| *n),
            );
            break;
        }
    }
    order
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
        for n in callees_first(self.graph, here) {
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
        let local: Arc<HashSet<InstanceId>> = Arc::new(
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
        for (at, n) in graph.nodes.iter().enumerate() {
            if !matches!(n.kind.ports, Ports::Ingress { .. }) || !self.opts.runs_node(n) {
                continue;
            }
            let mut paths = Vec::new();
            for chain in graph.chains.iter().filter(|c| c.ingress == at) {
                let mut stages = Vec::new();
                for (hop_at, &i) in chain.path.iter().enumerate() {
                    let node = &graph.nodes[i];
                    if !matches!(node.kind.ports, Ports::Operator { .. }) {
                        continue;
                    }
                    let hop = match chain.pools.get(&hop_at) {
                        None => Hop::One(self.edge(&mut edges, i, &local).await?),
                        Some(pools) => {
                            let mut all = Vec::with_capacity(pools.len());
                            for &p in pools {
                                all.push(self.edge(&mut edges, p, &local).await?);
                            }
                            Hop::Pools(all.into())
                        }
                    };
                    let stage = Stage::for_node(hop, node, &mut stages);
                    stages.push(stage);
                }
                let worker = chain
                    .path
                    .iter()
                    .enumerate()
                    .find(|(at, i)| {
                        graph.nodes[**i].kind.role == Role::Worker && !chain.pools.contains_key(at)
                    })
                    .map(|(_, i)| graph.nodes[*i].id.clone());
                paths.push(PathStages {
                    model: chain.model.clone(),
                    stages,
                    worker,
                });
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
                paths,
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

impl Startup<'_> {
    /// The edge client calling node `i`, one per node (shared by the paths through it).
    async fn edge(
        &self,
        edges: &mut [Option<Arc<EdgeClient>>],
        i: usize,
        local: &Arc<HashSet<InstanceId>>,
    ) -> Result<Arc<EdgeClient>, RuntimeError> {
        if let Some(e) = &edges[i] {
            return Ok(e.clone());
        }
        let node = &self.graph.nodes[i];
        let Ports::Operator { input, output } = node.kind.ports else {
            return Err(wrong_build(node, 0, "an ingress is not called"));
        };
        let e = EdgeClient::start(
            &self.planes,
            &self.graph.namespace,
            &node.id,
            node.kind.role,
            EndpointTypes { input, output },
            local.clone(),
        )
        .await?;
        Ok(edges[i].insert(Arc::new(e)).clone())
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
