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
}

impl Inner {
    fn pick(&self) -> Result<u64, OpError> {
        match self.workers.round_robin() {
            Some(i) => Ok(i.instance_id),
            None => Err(OpError::unavailable(format!(
                "no worker of '{}' is available",
                self.target
            ))),
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use dyn_pipeline::planes::{Planes, Transport};
    use futures::stream;

    fn cx(planes: &Planes) -> BuildCx {
        crate::testing::cx("route", 1, &["decode"], planes)
    }

    async fn route_once(r: &Route) -> Result<PreprocessedRequest, OpError> {
        let mut out = r.call(
            Ctx::new(),
            stream::iter([crate::testing::preprocessed(vec![1], 1)]).boxed(),
        );
        out.next().await.expect("one item")
    }

    #[tokio::test]
    async fn cycles_through_live_workers_and_is_unavailable_without_any() {
        let planes = Planes::embedded();
        let r = RouteConfig::default()
            .build(&cx(&planes))
            .await
            .expect("builds");
        let e = route_once(&r).await.expect_err("no workers");
        assert_eq!(e.kind, dyn_pipeline::ErrorKind::Unavailable);

        for id in [10, 11] {
            let i = Instance {
                namespace: "ns".into(),
                component: "decode".into(),
                endpoint: ENDPOINT.into(),
                instance_id: id,
                transport: Transport::InProcess,
            };
            planes.discovery.register(i).await.expect("register");
        }
        // The watch applies registrations asynchronously.
        for _ in 0..100 {
            if r.inner.workers.read().len() == 2 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let mut picked = Vec::new();
        for _ in 0..4 {
            picked.push(
                route_once(&r)
                    .await
                    .expect("routed")
                    .target
                    .expect("target"),
            );
        }
        picked.sort_unstable();
        assert_eq!(picked, [10, 10, 11, 11]);
    }

    #[tokio::test]
    async fn needs_exactly_one_consumer() {
        let planes = Planes::embedded();
        let mut c = cx(&planes);
        c.consumers.clear();
        assert!(RouteConfig::default().build(&c).await.is_err());
    }
}
