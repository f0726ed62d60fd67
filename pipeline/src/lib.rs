//! dyn-pipeline: the small core every dyn graph is built on.
//!
//! It owns the operator abstraction ([`Operator`], one typed stream in and one out per request,
//! with a [`Ctx`]), the registry of operator kinds, the graph spec and its compiler (every
//! error at once, with `FILE:LINE:COL`), the planner, the three planes (discovery, events,
//! requests) and the embedded runtime. It knows nothing about LLMs and must not depend on
//! any other dyn crate: the LLM kinds live in `dyn-llm`, `dyn-router`, `dyn-engine`,
//! `dyn-external`, `dyn-frontend` and `dyn-planner`, and `dyn-kinds` lists them.

pub mod compile;
pub mod ctx;
pub mod diag;
pub mod inspect;
pub mod operator;
pub mod payload;
pub mod plan;
pub mod planes;
pub mod registry;
pub mod runtime;
pub mod scale;
pub mod services;
pub mod spec;

pub use compile::{CompiledGraph, compile, load_and_compile};
pub use ctx::{Ctx, RequestId};
pub use diag::{Diagnostic, Diagnostics, Pos, Severity};
pub use inspect::{Inspect, Inspectables};
pub use operator::{
    Chain, ErrorKind, INSTANCE_LOST, Ingress, Input, OpError, Operator, Output, ShutdownSignal,
    WORKER_BUSY,
};
pub use payload::{Codec, Payload, PayloadType, Resumable, Resume};
pub use plan::{Format, Plan};
pub use registry::{
    BuildCx, BuildError, Health, IngressConfig, Invalid, OperatorConfig, Readiness, Registry, Role,
    SectionConfig, SectionNode,
};
pub use runtime::{Attach, Placement, RunOptions, run, run_attached};
pub use scale::{Connector, ScaleError};
pub use services::{Service, Services};

/// Exit code for configuration errors (`EX_CONFIG` from sysexits.h).
pub const EXIT_CONFIG: i32 = 78;
