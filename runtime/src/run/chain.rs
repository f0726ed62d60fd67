//! The request path: the edge client that calls one node, the hops of a path (a node, or the
//! pools a router chooses among), its stages (with request migration around a worker and its
//! router) and the chain runner the ingress holds (one path per model it serves).

use super::*;

/// Calls one node: keeps its live instances from discovery and picks one per request, the
/// one a router chose when the payload names it; otherwise one in this process if there is
/// one, else the next in round-robin order, skipping instances the request plane saw fail.
pub(super) struct EdgeClient {
    pub(super) node: String,
    pub(super) role: Role,
    pub(super) types: EndpointTypes,
    pub(super) planes: Planes,
    pub(super) instances: Arc<LiveInstances>,
    pub(super) local: Arc<HashSet<InstanceId>>,
}

impl EdgeClient {
    pub(super) async fn start(
        planes: &Planes,
        namespace: &str,
        node: &str,
        role: Role,
        types: EndpointTypes,
        local: Arc<HashSet<InstanceId>>,
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

    pub(super) fn pick(&self, target: Option<InstanceId>) -> Result<Instance, OpError> {
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

    /// Whether `id` is one of this node's live instances.
    fn holds(&self, id: InstanceId) -> bool {
        self.instances.read().iter().any(|i| i.instance_id == id)
    }

    pub(super) fn call(self: &Arc<Self>, ctx: Ctx, input: Input<AnyPayload>) -> Output<AnyPayload> {
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

/// One hop of a request path: a node, or the worker nodes (pools) a router in front chooses
/// among; the router names a worker, and the hop calls the pool that has it.
#[derive(Clone)]
pub(super) enum Hop {
    One(Arc<EdgeClient>),
    Pools(Arc<[Arc<EdgeClient>]>),
}

impl Hop {
    fn role(&self) -> Role {
        match self {
            Hop::One(e) => e.role,
            Hop::Pools(_) => Role::Worker,
        }
    }

    fn types(&self) -> EndpointTypes {
        match self {
            Hop::One(e) => e.types,
            Hop::Pools(p) => p[0].types,
        }
    }

    fn call(&self, ctx: Ctx, input: Input<AnyPayload>) -> Output<AnyPayload> {
        let pools = match self {
            Hop::One(e) => return e.call(ctx, input),
            Hop::Pools(p) => p.clone(),
        };
        async_stream::stream! {
            let mut input = input.peekable();
            let target = Pin::new(&mut input).peek().await.and_then(|p| p.target_instance());
            let Some(t) = target else {
                yield Err(OpError::internal("the router in front of several pools chose no worker"));
                return;
            };
            let Some(edge) = pools.iter().find(|e| e.holds(t)) else {
                yield Err(OpError::instance_lost(format!("instance {t:x} is in none of the pools")));
                return;
            };
            ctx.set_pool(&edge.node);
            let mut out = edge.call(ctx, input.boxed());
            while let Some(item) = out.next().await {
                yield item;
            }
        }
        .boxed()
    }
}

/// One step of a request path: a hop, or a worker hop with the router in front of it wrapped
/// in request migration.
pub(super) enum Stage {
    Node(Hop),
    Migrating(Arc<Migrating>),
}

impl Stage {
    /// The stage for `hop` (whose first node is `node`); a migrating worker takes the routers
    /// and pass-through nodes right before it into its segment, so a resent request is routed
    /// and prefilled afresh.
    pub(super) fn for_node(hop: Hop, node: &CompiledNode, stages: &mut Vec<Stage>) -> Stage {
        let resume = match (
            node.kind.role,
            node.migration_limit,
            hop.types().input.resume,
        ) {
            (Role::Worker, limit, Some(resume)) if limit > 0 => resume,
            _ => return Stage::Node(hop),
        };
        let mut steps = vec![hop];
        while let Some(Stage::Node(prev)) = stages.last()
            && prev.role().forwards()
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

    pub(super) fn call(&self, ctx: Ctx, input: Input<AnyPayload>) -> Output<AnyPayload> {
        match self {
            Stage::Node(h) => h.call(ctx, input),
            Stage::Migrating(m) => m.call(ctx, input),
        }
    }
}

/// Something a request path calls: a node, or a migrating segment.
pub(super) trait Step {
    fn call(&self, ctx: Ctx, input: Input<AnyPayload>) -> Output<AnyPayload>;
}

impl Step for Hop {
    fn call(&self, ctx: Ctx, input: Input<AnyPayload>) -> Output<AnyPayload> {
        Hop::call(self, ctx, input)
    }
}

impl Step for Stage {
    fn call(&self, ctx: Ctx, input: Input<AnyPayload>) -> Output<AnyPayload> {
        Stage::call(self, ctx, input)
    }
}

/// Chain `steps` so each one's outputs are the next one's inputs. An error from a step in the
/// middle ends its downstream's input and comes out last.
pub(super) fn run_path<S: Step>(
    steps: &[S],
    ctx: &Ctx,
    input: Input<AnyPayload>,
) -> Output<AnyPayload> {
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
/// continuing where the caller's stream stopped. The caller sees one stream. A worker's
/// internal failure before the caller got a token is resent once too (the router leaves
/// that worker out of the resend); every failure is told to the request's failure hooks
/// first (`Ctx::on_failure`: the router's circuit breaker). A fresh request is resent for
/// nothing else: a busy replica's refusal ([`ErrorKind::Overloaded`]) or an
/// empty pool ([`ErrorKind::Unavailable`]) reaches the client at once, since resending would
/// only add load where there is too much already. A request already being resent (its
/// client holds part of the stream) also waits those out, within the same `limit`: the
/// survivors of a lost replica are briefly full, and discovery briefly empty.
pub(super) struct Migrating {
    pub(super) steps: Vec<Hop>,
    pub(super) resume: Resume,
    pub(super) limit: u32,
}

impl Migrating {
    pub(super) fn call(self: &Arc<Self>, ctx: Ctx, input: Input<AnyPayload>) -> Output<AnyPayload> {
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
            // The caller got something past the header (a token).
            let mut answered = false;
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
                            } else {
                                answered = true;
                            }
                            (this.resume.absorb)(kept.as_mut(), v.as_ref());
                            yield Ok(v);
                        }
                        Err(e) => {
                            // Who routed the attempt learns how it went (a circuit breaker).
                            ctx.failed(&e);
                            if retried(&e, attempt, answered) && attempt < this.limit && !ctx.is_killed() {
                                lost = Some(e);
                                break;
                            }
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

/// Whether a request that failed with `e` after `attempt` resends is sent again (see
/// [`Migrating`]): a failure of the worker (an internal error) before the caller got a token
/// is retried once, elsewhere (the router leaves the failed worker out of the resend).
fn retried(e: &OpError, attempt: u32, answered: bool) -> bool {
    match e.kind {
        ErrorKind::InstanceLost => true,
        ErrorKind::Overloaded | ErrorKind::Unavailable => attempt > 0,
        ErrorKind::Internal => attempt == 0 && !answered,
        _ => false,
    }
}

/// One request path of an ingress: its model, its stages, and its worker node (where the
/// path has one that is not a choice among pools).
pub(super) struct PathStages {
    pub(super) model: Option<String>,
    pub(super) stages: Vec<Stage>,
    pub(super) worker: Option<String>,
}

/// Walks one ingress's request paths: a request goes down the path of its model (the only one
/// when there is one), the output stream of each stage is the input stream of the next, and
/// the last stage's outputs go back to the ingress.
pub(super) struct ChainRunner {
    pub(super) paths: Vec<PathStages>,
    pub(super) root: Ctx,
    /// One token per request whose response stream is open: the ingress drains on it.
    pub(super) in_flight: TaskTracker,
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
        let stages = match self.paths.as_slice() {
            [only] => &only.stages,
            paths => {
                let model = request.model_name();
                let Some(path) = paths.iter().find(|p| p.model.as_deref() == model) else {
                    let msg = match model {
                        Some(m) => format!("no path of this graph serves model `{m}`"),
                        None => {
                            "this graph serves several models, and the request names none".into()
                        }
                    };
                    return stream::iter([Err(OpError::invalid(msg))]).boxed();
                };
                // Each model's worker is a pool of its own to the planner.
                if let Some(w) = &path.worker {
                    ctx.set_pool(w);
                }
                &path.stages
            }
        };
        let mut out = run_path(stages, &ctx, stream::iter([request]).boxed());
        async_stream::stream! {
            let _token = token;
            // Only the first item fires the hooks; later ones skip the context's lock.
            let mut first = true;
            while let Some(item) = out.next().await {
                match &item {
                    Ok(_) if first => {
                        first = false;
                        ctx.first_output();
                    }
                    // Who routed the request learns how it went (a circuit breaker), with
                    // migration or without; hooks already told by a resend are gone.
                    Err(e) => ctx.failed(e),
                    Ok(_) => {}
                }
                yield item;
            }
        }
        .boxed()
    }
}
