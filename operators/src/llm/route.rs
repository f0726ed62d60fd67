//! `route`: picks the worker that will serve each request, and records it in the request
//! (`target`) so the runtime sends it there.
//!
//! The router watches discovery for the instances of the node that takes its output, so
//! workers joining or leaving are seen at once. Policy `round_robin` cycles through them;
//! KV-aware policies build on the same skeleton.
//!
//! ```yaml
//! route: {kind: route, inputs: [preprocess], config: {policy: round_robin}}
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use dyn_pipeline::planes::{Instance, LiveInstances};
use dyn_pipeline::runtime::ENDPOINT;
use dyn_pipeline::{BuildCx, BuildError, Ctx, Input, OpError, Operator, OperatorConfig, Output};
use futures::StreamExt;
use serde::Deserialize;

use super::types::PreprocessedRequest;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    #[default]
    RoundRobin,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    #[serde(default)]
    pub policy: Policy,
}

impl OperatorConfig for RouteConfig {
    const KIND: &'static str = "route";
    const SUMMARY: &'static str = "Chooses the worker for each request (policy: round_robin)";
    type Op = Route;

    async fn build(&self, cx: &BuildCx) -> Result<Route, BuildError> {
        let [target] = cx.consumers.as_slice() else {
            return Err(BuildError::new(
                "route needs exactly one node taking its output (the workers to choose from)",
            ));
        };
        let prefix = Instance::prefix(&cx.namespace, target, ENDPOINT);
        let workers = LiveInstances::watch(cx.planes.discovery.as_ref(), &prefix)
            .await
            .map_err(|e| BuildError::new(format!("cannot watch the workers of '{target}': {e}")))?;
        Ok(Route {
            inner: Arc::new(Inner {
                target: target.clone(),
                workers,
                next: AtomicUsize::new(0),
            }),
        })
    }
}

pub struct Route {
    inner: Arc<Inner>,
}

struct Inner {
    target: String,
    workers: LiveInstances,
    next: AtomicUsize,
}

impl Inner {
    fn pick(&self) -> Result<u64, OpError> {
        let list = self.workers.read();
        if list.is_empty() {
            return Err(OpError::unavailable(format!(
                "no worker of '{}' is available",
                self.target
            )));
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        Ok(list[n % list.len()].instance_id)
    }
}

impl Operator for Route {
    type In = PreprocessedRequest;
    type Out = PreprocessedRequest;

    fn call(&self, ctx: Ctx, input: Input<PreprocessedRequest>) -> Output<PreprocessedRequest> {
        let inner = self.inner.clone();
        input
            .map(move |mut req| {
                let worker = inner.pick()?;
                tracing::debug!(request_id = %ctx.id(), worker_id = format_args!("{worker:x}"), "Routed");
                req.target = Some(worker);
                Ok(req)
            })
            .boxed()
    }
}
