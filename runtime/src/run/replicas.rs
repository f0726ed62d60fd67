//! The replicas this process serves: built, served, kept in discovery while ready, scaled by
//! the embedded connector, and supervised (a failed replica is replaced).

use super::*;

/// Registers `instance` whenever its readiness turns ready and deregisters it whenever it turns
/// not ready, until aborted (at the drain) or the replica is gone. A failed replica is
/// deregistered for good and its id sent to `failed`, whose receiver replaces it.
pub(super) async fn follow_readiness(
    planes: Planes,
    instance: Instance,
    mut ready: watch::Receiver<Health>,
    failed: mpsc::Sender<InstanceId>,
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

pub(super) fn wrong_build(n: &CompiledNode, replica: u32, message: &str) -> RuntimeError {
    RuntimeError::Build {
        node: n.id.clone(),
        replica,
        source: BuildError::new(message),
    }
}

/// The operator replicas this process serves: built, served on the request plane and kept in
/// discovery while ready. Start-up fills it; the planner's embedded connector grows and
/// shrinks it while the graph runs.
pub(super) struct ReplicaSet {
    pub(super) graph: Arc<CompiledGraph>,
    pub(super) planes: Planes,
    pub(super) services: dyn_core::Services,
    pub(super) opts: RunOptions,
    pub(super) served: Mutex<Vec<ServedReplica>>,
    /// One scaling change (or the drain, or a replacement) at a time.
    pub(super) scaling: tokio::sync::Mutex<()>,
    /// Where followers send the ids of replicas that failed (see [`supervise`]).
    pub(super) failed: mpsc::Sender<InstanceId>,
    /// Set by the drain: failed replicas are no longer replaced.
    pub(super) closed: AtomicBool,
}

pub(super) struct ServedReplica {
    pub(super) node: String,
    pub(super) replica: u32,
    pub(super) instance: Instance,
    /// Keeps the replica registered while it is ready; aborted when it leaves.
    pub(super) follower: tokio::task::AbortHandle,
    /// One token per call in flight on this replica: a replica being removed waits on it.
    pub(super) calls: TaskTracker,
}

impl ReplicaSet {
    pub(super) fn cx(
        &self,
        node: &str,
        replica: u32,
        instance_id: InstanceId,
        readiness: Readiness,
    ) -> BuildCx {
        let g = &self.graph;
        let model = g
            .node(node)
            .and_then(|n| n.model.as_deref())
            .and_then(|m| g.model(m))
            .cloned();
        // An ingress serves its paths' models; any other node its own.
        let index = g.nodes.iter().position(|n| n.id == node);
        let mut models: Vec<dyn_core::ModelSpec> = g
            .chains
            .iter()
            .filter(|c| Some(c.ingress) == index)
            .filter_map(|c| c.model.as_deref().and_then(|m| g.model(m)).cloned())
            .collect();
        if models.is_empty() {
            models.extend(model.clone());
        }
        let consumers = workers_after(g, node);
        BuildCx {
            graph: g.name.clone(),
            namespace: g.namespace.clone(),
            node: node.to_owned(),
            replica,
            instance_id,
            serves: dyn_core::planes::Capabilities::any_of(
                consumers
                    .iter()
                    .filter_map(|c| g.node(c))
                    .map(|n| n.config.metadata().capabilities),
            ),
            consumers,
            model,
            models,
            base_dir: g.base_dir.clone(),
            planes: self.planes.clone(),
            services: self.services.clone(),
            readiness,
        }
    }

    pub(super) async fn build(
        &self,
        n: &CompiledNode,
        replica: u32,
        id: InstanceId,
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
    pub(super) async fn start(&self, n: &CompiledNode, replica: u32) -> Result<(), RuntimeError> {
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
        metadata.kind = Some(n.kind.name.into());
        metadata.model = n.model.clone();
        // The wire KV blocks take to and from it, when its engine started a transfer agent.
        if let (Role::Worker, Some(wire)) = (n.kind.role, self.planes.transfer_in_use.get()) {
            metadata
                .extra
                .insert("transfer".into(), serde_json::Value::from(*wire));
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
        // Listed before its follower can report it failed, so `supervise` finds it.
        let mut served = self.served.lock();
        let follower = tokio::spawn(follow_readiness(
            self.planes.clone(),
            instance.clone(),
            ready,
            self.failed.clone(),
        ))
        .abort_handle();
        tracing::info!(node = %n.id, worker_id = format_args!("{instance_id:x}"), replica, kind = n.kind.name, "Node replica started");
        served.push(ServedReplica {
            node: n.id.clone(),
            replica,
            instance,
            follower,
            calls,
        });
        Ok(())
    }

    pub(super) async fn deregister(&self, instance: &Instance) {
        if let Err(e) = self.planes.discovery.deregister(&instance.key()).await {
            tracing::warn!(error = %e, "Deregistration failed; the lease will expire instead");
        }
    }

    /// Take the newest replica of `node` out: deregister it now; in the background, wait for
    /// the calls it holds (up to the grace period), then stop serving it.
    pub(super) async fn remove_one(&self, node: &str) -> bool {
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
    pub(super) fn retire(&self, r: ServedReplica) {
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

    /// Take the failed replica `instance_id` out: stop serving it. Returns its node and
    /// number (`None`: it was already gone — removed by scaling, or the graph is draining).
    pub(super) async fn retire_failed(&self, instance_id: InstanceId) -> Option<(String, u32)> {
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
        let key = (r.node.clone(), r.replica);
        // Its requests already failed as lost (and migrated); what is left ends with it.
        self.retire(r);
        Some(key)
    }

    /// Build replica `replica` of `node` afresh, unless the graph is draining or that replica
    /// runs already (scaling started it meanwhile): `Ok(false)`.
    pub(super) async fn restart(&self, node: &str, replica: u32) -> Result<bool, RuntimeError> {
        let _one = self.scaling.lock().await;
        let running = self
            .served
            .lock()
            .iter()
            .any(|r| r.node == node && r.replica == replica);
        let Some(compiled) = self.graph.node(node).cloned() else {
            return Ok(false);
        };
        if self.closed.load(Ordering::Acquire) || running {
            return Ok(false);
        }
        self.start(&compiled, replica).await.map(|()| true)
    }

    pub(super) fn count(&self, node: &str) -> u32 {
        let n = self.served.lock().iter().filter(|r| r.node == node).count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    pub(super) fn scalable(&self, node: &str) -> Result<&CompiledNode, ScaleError> {
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
pub(super) async fn supervise(set: Weak<ReplicaSet>, mut failed: mpsc::Receiver<InstanceId>) {
    // Per replica: failures in a row (each within a minute of the last replacement) and when.
    let mut recent: HashMap<(String, u32), (u32, Instant)> = HashMap::new();
    let pause = |n: u32| Duration::from_secs(1 << n.min(5)).min(Duration::from_secs(30));
    while let Some(id) = failed.recv().await {
        let Some(set) = set.upgrade() else { return };
        let Some(key) = set.retire_failed(id).await else {
            continue;
        };
        let mut n = match recent.get(&key) {
            Some((n, at)) if at.elapsed() < Duration::from_secs(60) => n + 1,
            _ => 0,
        };
        // A replica that cannot be built (a device left unusable, a server that will not
        // start) is tried again with the same growing pause, a few times.
        for attempt in 0..RESTART_ATTEMPTS {
            if n > 0 {
                tracing::warn!(node = %key.0, replica = key.1, pause = ?pause(n - 1), "Replica failed again soon after its replacement; waiting before the next");
                tokio::time::sleep(pause(n - 1)).await;
            }
            match set.restart(&key.0, key.1).await {
                Ok(true) => {
                    tracing::info!(node = %key.0, replica = key.1, "Failed replica replaced");
                    break;
                }
                Ok(false) => break,
                Err(e) if attempt + 1 < RESTART_ATTEMPTS => {
                    tracing::error!(node = %key.0, replica = key.1, error = %e, "Cannot rebuild the failed replica; trying again");
                }
                Err(e) => {
                    tracing::error!(node = %key.0, replica = key.1, error = %e, "Cannot rebuild the failed replica; giving up (the planner or a restart must)");
                }
            }
            n += 1;
        }
        recent.insert(key, (n, Instant::now()));
    }
}

/// Builds of a failed replica's replacement tried before giving up.
const RESTART_ATTEMPTS: u32 = 8;

/// A replica's operator, counting the calls in flight on it.
pub(super) struct Counted {
    pub(super) inner: Arc<dyn DynOperator>,
    pub(super) calls: TaskTracker,
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
