//! dyn-core: the small core every dyn graph and every operator kind is built on.
//!
//! It owns the operator abstraction ([`Operator`], one typed stream in and one out per request,
//! with a [`Ctx`]), payload types and their wire codecs, the registry of operator kinds and
//! what a kind gets when it builds ([`BuildCx`], [`Readiness`], shared [`Service`]s,
//! introspection), and the plane traits with their embedded, in-process implementations.
//! It knows nothing about LLMs, and it must not depend on etcd, NATS, protoc or any other dyn
//! crate: the kind crates (`dyn-llm`, `dyn-router`, `dyn-engine`, …) build on it alone, and
//! `dyn-runtime` (graph files, the compiler and planner, the etcd/NATS/TCP planes, running a
//! graph) sits on top.

pub mod build;
pub mod ctx;
pub mod inspect;
pub mod operator;
pub mod payload;
pub mod planes;
pub mod registry;
pub mod scale;

pub use build::{
    BuildCx, BuildError, Health, ModelSpec, Readiness, ReasoningParserName, Service, Services,
    ToolParserName, lora_name_problem,
};
pub use ctx::{Ctx, RequestId};
pub use inspect::{Inspect, Inspectables};
pub use operator::{
    Chain, DEADLINE_EXCEEDED, ErrorKind, INSTANCE_LOST, Ingress, Input, OpError, Operator, Output,
    RATE_LIMIT_EXCEEDED, ShutdownSignal, WORKER_BUSY,
};
pub use payload::{Codec, Payload, PayloadType, Resumable, Resume};
pub use planes::{InstanceId, InstanceMeta};
pub use registry::{
    IngressConfig, Invalid, OperatorConfig, Registry, Role, SectionConfig, SectionNode,
};
pub use scale::{Connector, ScaleError};
