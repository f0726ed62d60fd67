//! Building a `route` node: a router per worker node it feeds (a pool each, when it feeds
//! several), each assembled from its parts, with the background tasks that keep them current
//! — the workers' events and load metrics, admission's tick and the tenants' charges, and the
//! other routers' session bindings — held by the [`Route`] so they end with it.

use std::sync::Arc;

use dyn_core::planes::{ENDPOINT, Instance};
use dyn_core::registry::Role;
use dyn_core::{BuildCx, BuildError, Inspect, Inspectables, Invalid, OperatorConfig};

use crate::adapters::Adapters;
use crate::affinity::Affinity;
use crate::avoidance::Avoidance;
use crate::loads::Loads;
use crate::placement::Placement;
use crate::workers::Workers;
use crate::{Inner, Policy, Pools, Route, RouteConfig, admission, follow, pools};

impl OperatorConfig for RouteConfig {
    const KIND: &'static str = "route";
    const SUMMARY: &'static str = "Chooses the worker for each request (policy: kv, round_robin, random, least_loaded, power_of_two)";
    const ROLE: Role = Role::Router;
    type Op = Route;

    fn validate(&self) -> Vec<Invalid> {
        self.problems()
    }

    fn calls(&self) -> Vec<String> {
        self.pools.iter().map(|p| p.node.clone()).collect()
    }

    async fn build(&self, cx: &BuildCx) -> Result<Route, BuildError> {
        let route = match cx.consumers.as_slice() {
            [] => {
                return Err(BuildError::new(
                    "route needs a node taking its output (the workers to choose from)",
                ));
            }
            [target] => {
                if let Some(p) = self.pools.first() {
                    return Err(BuildError::new(format!(
                        "pools names '{}', but the route feeds one node ('{target}'); pools are the worker nodes it feeds",
                        p.node
                    )));
                }
                self.start(cx, target).await?
            }
            many => self.start_pools(cx, many).await?,
        };
        let shown: Arc<dyn Inspect> = route.inner.clone();
        cx.service::<Inspectables>()
            .await?
            .register(&cx.node, &shown);
        Ok(route)
    }
}

impl RouteConfig {
    /// A router over several pools (the worker nodes `targets`): one router per pool, the
    /// first shown in `dyn inspect`.
    async fn start_pools(&self, cx: &BuildCx, targets: &[String]) -> Result<Route, BuildError> {
        if let Some(p) = self.pools.iter().find(|p| !targets.contains(&p.node)) {
            return Err(BuildError::new(format!(
                "pools names '{}', which the route does not feed (it feeds {})",
                p.node,
                targets.join(", ")
            )));
        }
        // Named pools in the list's order, then the others.
        let mut rules = self.pools.clone();
        for t in targets {
            if !rules.iter().any(|p| &p.node == t) {
                rules.push(pools::PoolRule {
                    node: t.clone(),
                    ..Default::default()
                });
            }
        }
        let mut routes = Vec::with_capacity(rules.len());
        for r in &rules {
            routes.push(self.start(cx, &r.node).await?);
        }
        let shared: Pools = rules
            .into_iter()
            .zip(&routes)
            .map(|(rule, r)| (rule, r.inner.clone()))
            .collect();
        let mut top = routes.remove(0);
        top.pools = Some(shared);
        top._pool_routes = routes;
        Ok(top)
    }

    /// A router among the instances of node `target`, not shown in `dyn inspect` on its own
    /// (kinds that route a pool of their own, like `remote_prefill`, show it through themselves).
    pub async fn start(&self, cx: &BuildCx, target: &str) -> Result<Route, BuildError> {
        let prefix = Instance::prefix(&cx.namespace, target, ENDPOINT);
        let workers =
            cx.planes.live(&prefix).await.map_err(|e| {
                BuildError::new(format!("cannot watch the workers of '{target}': {e}"))
            })?;
        // A router that starts after its workers learns their block size from discovery, before
        // any load metrics arrive.
        let announced = workers.read().iter().find_map(|i| i.metadata.block_size);
        let placement = Placement::new(self, announced, &cx.node);
        let inner = Arc::new_cyclic(|me: &std::sync::Weak<Inner>| Inner {
            // Room is per live worker, as the router sees them.
            admission: self.admission.clone().map(|a| {
                let me = me.clone();
                admission::Admission::new(a, &cx.node, move || {
                    me.upgrade()
                        .map_or_else(Vec::new, |inner| inner.live_places())
                })
            }),
            workers: Workers {
                target: target.to_owned(),
                instances: workers,
                planes: cx.planes.clone(),
            },
            config: self.clone(),
            loads: Loads::default(),
            placement,
            sessions: self
                .session_affinity
                .as_ref()
                .map(|a| Affinity::new(a, &cx.namespace, target)),
            avoidance: Avoidance::default(),
            adapters: Adapters::new(self.lora_slots),
        });
        let follow = follow::follow_workers(
            inner.clone(),
            cx.planes.events.clone(),
            cx.namespace.clone(),
            self.policy == Policy::Kv && self.kv_events,
        )
        .await
        .map_err(|e| BuildError::new(format!("cannot follow the workers' events: {e}")))?;
        let task = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(follow));
        // Workers that join make room for waiting requests without one finishing; the tenants'
        // charges go to the node's other routers.
        let charges = admission::charges_subject(&cx.namespace, target);
        let tick = inner
            .admission
            .as_ref()
            .map(|a| a.keep_ticking(cx.planes.events.clone(), charges.clone()));
        let heard =
            match &inner.admission {
                Some(a) => Some(a.hear_charges(&cx.planes.events, &charges).await.map_err(
                    |e| BuildError::new(format!("cannot follow tenants' charges: {e}")),
                )?),
                None => None,
            };
        // Other routers' session bindings.
        let shared =
            match &inner.sessions {
                Some(a) => Some(a.hear_others(&cx.planes.events).await.map_err(|e| {
                    BuildError::new(format!("cannot follow session bindings: {e}"))
                })?),
                None => None,
            };
        Ok(Route {
            inner,
            _task: task,
            _tick: tick,
            _sessions: shared,
            _charges: heard,
            pools: None,
            _pool_routes: Vec::new(),
        })
    }
}
