//! The request plane: carry one request's input stream to an instance and its outputs back.
//!
//! The embedded plane calls the instance's operator directly: no copy, no serialization, no
//! task hop, so a one-process graph costs little more than the operators themselves. A remote
//! plane encodes with the payload types' wire codecs, which is why `call` is told the types.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::stream::{self, StreamExt};
use parking_lot::RwLock;

use super::{Instance, InstanceId, PlaneError, Transport};
use crate::ctx::Ctx;
use crate::operator::{DynOperator, Input, OpError, Output};
use crate::payload::{AnyPayload, PayloadType};

/// The payload types of an endpoint, for planes that must encode them.
#[derive(Debug, Clone, Copy)]
pub struct EndpointTypes {
    pub input: PayloadType,
    pub output: PayloadType,
}

/// Limits and timeouts of the TCP request plane (`dyn-runtime`); plain settings, here so
/// [`super::Planes`] can say how its process is reached.
#[derive(Debug, Clone)]
pub struct TcpOptions {
    /// Address the server binds to; port 0 picks a free one.
    pub bind: String,
    /// Host other processes use to reach this one (defaults to the bound IP).
    pub advertise_host: Option<String>,
    pub connect_timeout: Duration,
    /// Largest frame either side accepts: one payload item plus a tag byte.
    pub max_message_bytes: usize,
    /// A server whose handler has nothing to send says it is alive this often.
    pub heartbeat: Duration,
    /// A caller that hears nothing from the server for this long (no item, no heartbeat)
    /// fails the call as an instance lost: the process froze or its host went dark, which
    /// leaves TCP connections established and silent.
    pub silence: Duration,
    /// Who may connect, and whom this process connects to: the cluster identity (TLS with
    /// mutual authentication), or none (plain TCP). The KV transfer agent uses it too.
    pub trust: dyn_trust::Trust,
}

impl Default for TcpOptions {
    fn default() -> Self {
        Self {
            bind: "127.0.0.1:0".into(),
            advertise_host: None,
            connect_timeout: Duration::from_secs(3),
            max_message_bytes: 16 << 20,
            heartbeat: Duration::from_secs(1),
            silence: Duration::from_secs(5),
            trust: dyn_trust::Trust::plain(),
        }
    }
}

/// Instances this process saw fail, so routing can avoid them until discovery catches up.
#[derive(Default)]
pub struct InstanceHealth {
    down: RwLock<HashMap<InstanceId, Instant>>,
}

impl InstanceHealth {
    /// How long a failed instance is avoided; its lease expires well within this.
    pub const AVOID_FOR: Duration = Duration::from_secs(30);

    pub fn report_down(&self, instance_id: InstanceId) {
        tracing::warn!(
            worker_id = format_args!("{instance_id:x}"),
            "Instance unreachable; avoiding it"
        );
        let mut down = self.down.write();
        // Forget instances reported long enough ago, so the map stays small.
        down.retain(|_, at| at.elapsed() < Self::AVOID_FOR);
        down.insert(instance_id, Instant::now());
    }

    pub fn is_down(&self, instance_id: InstanceId) -> bool {
        let down = self.down.read();
        match down.get(&instance_id) {
            Some(at) => at.elapsed() < Self::AVOID_FOR,
            None => false,
        }
    }
}

#[async_trait]
pub trait RequestPlane: Send + Sync + 'static {
    /// Start serving `handler` as `instance`; returns how peers reach it.
    async fn serve(
        &self,
        instance: &Instance,
        types: EndpointTypes,
        handler: Arc<dyn DynOperator>,
    ) -> Result<Transport, PlaneError>;

    /// Stop serving an instance (new calls fail; calls in flight go on).
    async fn unserve(&self, instance_id: InstanceId) -> Result<(), PlaneError>;

    /// Requests from other processes being served right now.
    fn in_flight(&self) -> usize {
        0
    }

    /// Resolves once no request from another process is being served (graceful drain).
    fn drained(&self) -> futures::future::BoxFuture<'static, ()> {
        Box::pin(std::future::ready(()))
    }

    /// What this plane learnt about unreachable instances, for routers to avoid them.
    fn health(&self) -> Option<&InstanceHealth> {
        None
    }

    /// Send one request to an instance.
    fn call(
        &self,
        instance: &Instance,
        types: EndpointTypes,
        ctx: Ctx,
        input: Input<AnyPayload>,
    ) -> Output<AnyPayload>;
}

/// In-process request plane.
#[derive(Default)]
pub struct EmbeddedRequestPlane {
    handlers: RwLock<HashMap<InstanceId, Arc<dyn DynOperator>>>,
}

#[async_trait]
impl RequestPlane for EmbeddedRequestPlane {
    async fn serve(
        &self,
        instance: &Instance,
        _types: EndpointTypes,
        handler: Arc<dyn DynOperator>,
    ) -> Result<Transport, PlaneError> {
        self.handlers.write().insert(instance.instance_id, handler);
        Ok(Transport::InProcess)
    }

    async fn unserve(&self, instance_id: InstanceId) -> Result<(), PlaneError> {
        self.handlers.write().remove(&instance_id);
        Ok(())
    }

    fn call(
        &self,
        instance: &Instance,
        _types: EndpointTypes,
        ctx: Ctx,
        input: Input<AnyPayload>,
    ) -> Output<AnyPayload> {
        let handler = self.handlers.read().get(&instance.instance_id).cloned();
        match handler {
            Some(h) => h.call(ctx, input),
            None => stream::once(futures::future::ready(Err(OpError::instance_lost(
                format!(
                    "instance {:x} of '{}' is gone",
                    instance.instance_id, instance.component
                ),
            ))))
            .boxed(),
        }
    }
}
