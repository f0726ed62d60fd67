//! The embedded runtime: run a compiled graph inside this process.
//!
//! Start-up builds every replica of every operator node, serves it on the request plane and
//! registers it in discovery; then each ingress is built and handed a [`ChainRunner`] that walks
//! its request path. Shutdown is graceful: ingresses stop accepting, in-flight requests get a
//! grace period to drain, whatever is left is killed through the root context, and the call
//! returns `Ok` so the process can exit 0.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::future::FutureExt;
use futures::stream::{self, StreamExt};
use parking_lot::Mutex;
use tokio::task::JoinSet;

use crate::compile::{CompiledGraph, PlaneAddr};
use crate::ctx::{Ctx, RequestId};
use crate::operator::{DynChain, Input, OpError, Output, ShutdownSignal};
use crate::payload::AnyPayload;
use crate::planes::request::EndpointTypes;
use crate::planes::{Instance, LiveInstances, PlaneError, Planes, Transport};
use crate::registry::{BuildCx, BuildError, Built, Role};

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

#[derive(Debug, Clone)]
pub struct RunOptions {
    /// How long in-flight requests may take to finish after a shutdown signal.
    pub grace: Duration,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            grace: Duration::from_secs(30),
        }
    }
}

fn random_instance_id() -> u64 {
    uuid::Uuid::new_v4().as_u64_pair().0
}

/// Run `graph` until `shutdown` resolves (or an ingress fails), then drain and stop.
pub async fn run(
    graph: &CompiledGraph,
    opts: RunOptions,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RuntimeError> {
    if graph.control != PlaneAddr::Embedded || graph.events != PlaneAddr::Embedded {
        return Err(RuntimeError::Unsupported(format!(
            "graph '{}' asks for control={} events={}; this build runs embedded planes only (etcd and NATS planes are not implemented yet)",
            graph.name, graph.control, graph.events
        )));
    }
    let planes = Planes::embedded();
    let inspect = Arc::new(crate::Inspectables::default());
    let root = Ctx::with_id("runtime");
    let cx = |node: &str, replica: u32, instance_id: u64| BuildCx {
        graph: graph.name.clone(),
        namespace: graph.namespace.clone(),
        node: node.to_owned(),
        replica,
        instance_id,
        consumers: graph
            .nodes
            .iter()
            .filter(|c| c.inputs.iter().any(|&i| graph.nodes[i].id == node))
            .map(|c| c.id.clone())
            .collect(),
        model: graph.model.clone(),
        base_dir: graph.base_dir.clone(),
        planes: planes.clone(),
        inspect: inspect.clone(),
    };
    let build_err = |node: &str, replica: u32, source| RuntimeError::Build {
        node: node.to_owned(),
        replica,
        source,
    };

    // Operators first, so every path is servable before any ingress opens.
    let mut served = Vec::new();
    let mut edges = Vec::with_capacity(graph.nodes.len());
    for n in &graph.nodes {
        let Role::Operator { input, output } = n.kind.role else {
            edges.push(None);
            continue;
        };
        let types = EndpointTypes { input, output };
        for replica in 0..n.replicas {
            let instance_id = random_instance_id();
            let built = n
                .config
                .clone()
                .build(cx(&n.id, replica, instance_id))
                .await
                .map_err(|e| build_err(&n.id, replica, e))?;
            let Built::Operator(op) = built else {
                return Err(build_err(
                    &n.id,
                    replica,
                    BuildError::new("kind built an ingress"),
                ));
            };
            let mut instance = Instance {
                namespace: graph.namespace.clone(),
                component: n.id.clone(),
                endpoint: ENDPOINT.to_owned(),
                instance_id,
                transport: Transport::InProcess,
            };
            instance.transport = planes.requests.serve(&instance, types, op).await?;
            planes.discovery.register(instance.clone()).await?;
            tracing::info!(node = %n.id, worker_id = format_args!("{instance_id:x}"), replica, kind = n.kind.name, "Node replica started");
            served.push(instance);
        }
        edges.push(Some(Arc::new(
            EdgeClient::start(&planes, &graph.namespace, &n.id, types).await?,
        )));
    }

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let signal: ShutdownSignal = async move {
        let _ = stop_rx.await;
    }
    .boxed()
    .shared();
    let mut ingresses = JoinSet::new();
    for chain in &graph.chains {
        let n = &graph.nodes[chain.ingress];
        let built = n
            .config
            .clone()
            .build(cx(&n.id, 0, random_instance_id()))
            .await
            .map_err(|e| build_err(&n.id, 0, e))?;
        let Built::Ingress(ingress) = built else {
            return Err(build_err(
                &n.id,
                0,
                BuildError::new("kind built an operator"),
            ));
        };
        let steps = chain
            .path
            .iter()
            .filter_map(|&i| edges[i].clone())
            .collect();
        let runner = Arc::new(ChainRunner {
            steps,
            root: root.clone(),
        });
        let id = n.id.clone();
        let serve = ingress.serve(runner, signal.clone());
        ingresses.spawn(async move { (id, serve.await) });
    }
    tracing::info!(graph = %graph.name, nodes = graph.nodes.len(), "Graph is up");

    let mut failure = None;
    tokio::select! {
        _ = shutdown => tracing::info!("Shutdown requested; draining in-flight requests"),
        Some(done) = ingresses.join_next() => {
            failure = ingress_result(done);
        }
    }
    let _ = stop_tx.send(());
    let drain = async {
        while let Some(done) = ingresses.join_next().await {
            if let Some(e) = ingress_result(done) {
                failure.get_or_insert(e);
            }
        }
    };
    if tokio::time::timeout(opts.grace, drain).await.is_err() {
        tracing::warn!(grace = ?opts.grace, "Grace period over; aborting requests still in flight");
        root.kill();
        if tokio::time::timeout(Duration::from_secs(5), async {
            while ingresses.join_next().await.is_some() {}
        })
        .await
        .is_err()
        {
            ingresses.abort_all();
        }
    }
    for instance in served {
        planes.requests.unserve(instance.instance_id).await?;
        planes.discovery.deregister(&instance.key()).await?;
    }
    tracing::info!(graph = %graph.name, "Graph stopped");
    failure.map_or(Ok(()), Err)
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
/// one a router chose when the payload names it, round-robin otherwise.
struct EdgeClient {
    node: String,
    types: EndpointTypes,
    planes: Planes,
    instances: LiveInstances,
}

impl EdgeClient {
    async fn start(
        planes: &Planes,
        namespace: &str,
        node: &str,
        types: EndpointTypes,
    ) -> Result<Self, PlaneError> {
        let prefix = Instance::prefix(namespace, node, ENDPOINT);
        Ok(Self {
            node: node.to_owned(),
            types,
            planes: planes.clone(),
            instances: LiveInstances::watch(planes.discovery.as_ref(), &prefix).await?,
        })
    }

    fn pick(&self, target: Option<u64>) -> Result<Instance, OpError> {
        match target {
            Some(t) => self
                .instances
                .read()
                .iter()
                .find(|i| i.instance_id == t)
                .cloned()
                .ok_or_else(|| {
                    OpError::unavailable(format!("instance {t:x} of '{}' is gone", self.node))
                }),
            None => self.instances.round_robin().ok_or_else(|| {
                OpError::unavailable(format!("no live instance of '{}'", self.node))
            }),
        }
    }

    fn call(self: &Arc<Self>, ctx: Ctx, input: Input<AnyPayload>) -> Output<AnyPayload> {
        let this = self.clone();
        // The target is a property of the first item (a routed request); peek at it.
        async_stream::stream! {
            let mut input = input.peekable();
            let target = Pin::new(&mut input).peek().await.and_then(|p| p.target_instance());
            match this.pick(target) {
                Ok(instance) => {
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

/// Walks one ingress's request path: the output stream of each node is the input stream of
/// the next, and the last node's outputs go back to the ingress. An error from a node in the
/// middle ends its downstream's input and is delivered to the ingress as the final item.
struct ChainRunner {
    steps: Vec<Arc<EdgeClient>>,
    root: Ctx,
}

impl DynChain for ChainRunner {
    fn new_ctx(&self, id: RequestId) -> Ctx {
        self.root.child(id)
    }

    fn call(&self, ctx: Ctx, request: AnyPayload) -> Output<AnyPayload> {
        let failed: Arc<Mutex<Option<OpError>>> = Arc::default();
        let mut input: Input<AnyPayload> = stream::iter([request]).boxed();
        let Some((last, middle)) = self.steps.split_last() else {
            return stream::iter([Err(OpError::internal("empty request path"))]).boxed();
        };
        for step in middle {
            let slot = failed.clone();
            input = step
                .call(ctx.clone(), input)
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
        let mut out = last.call(ctx.clone(), input);
        async_stream::stream! {
            // Only the first item fires the hooks; later ones skip the context's lock.
            let mut first = true;
            while let Some(item) = out.next().await {
                let upstream_error = failed.lock().take();
                if let Some(e) = upstream_error {
                    yield Err(e);
                    return;
                }
                if first && item.is_ok() {
                    first = false;
                    ctx.first_output();
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operator::{Operator, erase};
    use crate::payload::{Payload, downcast};

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
        };
        planes
            .requests
            .serve(&instance, types, erase(op))
            .await
            .unwrap();
        planes.discovery.register(instance).await.unwrap();
        Arc::new(EdgeClient::start(planes, "t", node, types).await.unwrap())
    }

    #[tokio::test]
    async fn error_in_the_middle_of_a_path_reaches_the_ingress_last() {
        let planes = Planes::embedded();
        let runner = ChainRunner {
            steps: vec![
                serve(&planes, "a", Step { fail: true }).await,
                serve(&planes, "b", Step { fail: false }).await,
            ],
            root: Ctx::new(),
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
            steps: vec![serve(&planes, "a", Step { fail: false }).await],
            root: Ctx::new(),
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
            EdgeClient::start(&planes, "t", "ghost", types)
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
}
