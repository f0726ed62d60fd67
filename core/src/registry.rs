//! The registry of operator kinds.
//!
//! A kind is a serde config type (`deny_unknown_fields`) that validates itself and builds the
//! runtime object: [`OperatorConfig`] builds an [`Operator`], [`IngressConfig`] an [`Ingress`].
//! The config type is kept apart from what it builds (vector's `FilterConfig` / `Filter`), so the
//! compiler can check a graph without building anything. Registration is an explicit list
//! (`Registry::new().operator::<EchoConfig>()…`): no inventory, no macros, and a test can
//! register extra kinds of its own.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde::de::DeserializeOwned;

use crate::build::{BuildCx, BuildError};
use crate::operator::{DynIngress, DynOperator, Ingress, Operator, erase, erase_ingress};
use crate::payload::PayloadType;
use crate::planes::InstanceMeta;

/// A problem `validate()` found in a config; `field` points the diagnostic at that key.
#[derive(Debug, Clone, PartialEq)]
pub struct Invalid {
    pub field: Option<String>,
    pub message: String,
}

impl Invalid {
    pub fn field(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: Some(field.into()),
            message: message.into(),
        }
    }
    pub fn general(message: impl Into<String>) -> Self {
        Self {
            field: None,
            message: message.into(),
        }
    }
}

/// A config for a processing kind.
pub trait OperatorConfig: DeserializeOwned + Send + Sync + 'static {
    const KIND: &'static str;
    /// One line for `dyn graph kinds` and the docs.
    const SUMMARY: &'static str;
    /// What the node does on a request's path; see [`Role`].
    const ROLE: Role = Role::Stage;
    type Op: Operator;

    /// Semantic checks serde cannot express; every problem is reported, not just the first.
    fn validate(&self) -> Vec<Invalid> {
        Vec::new()
    }

    fn build(&self, cx: &BuildCx) -> impl Future<Output = Result<Self::Op, BuildError>> + Send;

    /// What processes that join later need to know about this node's replicas (an engine's
    /// KV block size, say); stored with each instance in discovery.
    fn metadata(&self) -> InstanceMeta {
        InstanceMeta::default()
    }

    /// Nodes this node's config names: ones it sends work to outside the request path (a
    /// remote prefill pool), or, for a router, the pools it chooses among. The compiler
    /// checks they exist (and that a router's are nodes it feeds) and counts them as reached.
    fn calls(&self) -> Vec<String> {
        Vec::new()
    }

    /// The replica count the config itself fixes (one per engine server it lists): the node's
    /// count when the graph gives none, and an error when it gives another.
    fn replicas(&self) -> Option<u32> {
        None
    }
}

/// A config for an ingress kind.
pub trait IngressConfig: DeserializeOwned + Send + Sync + 'static {
    const KIND: &'static str;
    const SUMMARY: &'static str;
    type Ingress: Ingress;

    fn validate(&self) -> Vec<Invalid> {
        Vec::new()
    }

    fn build(&self, cx: &BuildCx)
    -> impl Future<Output = Result<Self::Ingress, BuildError>> + Send;
}

/// What a node does on a request's path, declared by its kind. The compiler checks the
/// graph against it and the runtime acts on it: where a router's choice lands, which nodes a
/// migrated request runs through again. Never inferred from payload types, so a logging node
/// whose input and output types agree changes neither.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Brings requests in from outside and answers them (HTTP).
    Ingress,
    /// Turns each request into the next node's input (preprocess, postprocess). The default.
    Stage,
    /// Chooses which replica of the worker node behind it serves each request; its output is
    /// its input with the choice recorded. A migrated request is routed again.
    Router,
    /// Passes each request on, its type unchanged, toward the worker behind it, doing work on
    /// the way (remote prefill). A router looks through it; a migrated request runs it again.
    PassThrough,
    /// Serves requests (an engine): a router's choice is one of its replicas, and with
    /// `migration_limit` a request lost with its replica is resent from here.
    Worker,
}

impl Role {
    /// Roles whose output type must be their input type (they hand the request on).
    pub fn forwards(self) -> bool {
        matches!(self, Role::Router | Role::PassThrough)
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Ingress => "ingress",
            Role::Stage => "stage",
            Role::Router => "router",
            Role::PassThrough => "pass_through",
            Role::Worker => "worker",
        })
    }
}

/// The payload types a node declares: an operator's input and output, an ingress's request
/// and response.
#[derive(Debug, Clone, Copy)]
pub enum Ports {
    Operator {
        input: PayloadType,
        output: PayloadType,
    },
    Ingress {
        request: PayloadType,
        response: PayloadType,
    },
}

/// A built node replica.
pub enum Built {
    Operator(Arc<dyn DynOperator>),
    Ingress(Box<dyn DynIngress>),
}

/// A parsed config with its kind erased.
pub trait DynConfig: Send + Sync {
    fn validate(&self) -> Vec<Invalid>;
    fn metadata(&self) -> InstanceMeta {
        InstanceMeta::default()
    }
    fn calls(&self) -> Vec<String> {
        Vec::new()
    }
    fn replicas(&self) -> Option<u32> {
        None
    }
    fn build(self: Arc<Self>, cx: BuildCx) -> BoxFuture<'static, Result<Built, BuildError>>;
}

struct OpConfig<C>(C);
struct InConfig<C>(C);

impl<C: OperatorConfig> DynConfig for OpConfig<C> {
    fn validate(&self) -> Vec<Invalid> {
        self.0.validate()
    }
    fn metadata(&self) -> InstanceMeta {
        self.0.metadata()
    }
    fn calls(&self) -> Vec<String> {
        self.0.calls()
    }
    fn replicas(&self) -> Option<u32> {
        self.0.replicas()
    }
    fn build(self: Arc<Self>, cx: BuildCx) -> BoxFuture<'static, Result<Built, BuildError>> {
        async move { Ok(Built::Operator(erase(self.0.build(&cx).await?))) }.boxed()
    }
}

impl<C: IngressConfig> DynConfig for InConfig<C> {
    fn validate(&self) -> Vec<Invalid> {
        self.0.validate()
    }
    fn build(self: Arc<Self>, cx: BuildCx) -> BoxFuture<'static, Result<Built, BuildError>> {
        async move { Ok(Built::Ingress(erase_ingress(self.0.build(&cx).await?))) }.boxed()
    }
}

type ParseFn = fn(&marked_yaml::Node) -> Result<Arc<dyn DynConfig>, marked_yaml::FromNodeError>;

/// One registered kind.
#[derive(Clone)]
pub struct Kind {
    pub name: &'static str,
    pub summary: &'static str,
    pub role: Role,
    pub ports: Ports,
    parse: ParseFn,
}

impl Kind {
    /// Parse a node's `config:` into this kind's config type (the compiler's step).
    pub fn parse(
        &self,
        config: &marked_yaml::Node,
    ) -> Result<Arc<dyn DynConfig>, marked_yaml::FromNodeError> {
        (self.parse)(config)
    }

    pub fn is_ingress(&self) -> bool {
        self.role == Role::Ingress
    }
}

/// A top-level section of a graph file that is not a node (`planner:`): a serde config type
/// (`deny_unknown_fields`) the registry knows by name, checked against the graph's nodes.
/// The compiled graph keeps the parsed value for whoever runs it
/// (`dyn_runtime::CompiledGraph::section`).
pub trait SectionConfig: DeserializeOwned + Send + Sync + 'static {
    const NAME: &'static str;
    const SUMMARY: &'static str;

    /// Checks against the compiled nodes (names it refers to, their roles).
    fn validate(&self, _nodes: &[SectionNode<'_>]) -> Vec<Invalid> {
        Vec::new()
    }
}

/// What a section's `validate` sees of a node.
#[derive(Debug, Clone, Copy)]
pub struct SectionNode<'a> {
    pub id: &'a str,
    pub kind: &'a str,
    pub role: Role,
    pub replicas: u32,
    pub process: &'a str,
    /// Nodes in this node's process group, itself included.
    pub process_nodes: usize,
}

/// A parsed section, type-erased.
pub type AnySection = Arc<dyn std::any::Any + Send + Sync>;

type SectionParseFn = fn(&marked_yaml::Node) -> Result<AnySection, marked_yaml::FromNodeError>;
type SectionCheckFn = fn(&AnySection, &[SectionNode<'_>]) -> Vec<Invalid>;

/// One registered section type.
#[derive(Clone)]
pub struct SectionKind {
    parse: SectionParseFn,
    validate: SectionCheckFn,
}

impl SectionKind {
    /// Parse the section as written into its registered type.
    pub fn parse(
        &self,
        node: &marked_yaml::Node,
    ) -> Result<AnySection, marked_yaml::FromNodeError> {
        (self.parse)(node)
    }

    /// The section's own checks against the compiled nodes.
    pub fn validate(&self, parsed: &AnySection, nodes: &[SectionNode<'_>]) -> Vec<Invalid> {
        (self.validate)(parsed, nodes)
    }
}

/// The explicit list of kinds (and sections) a graph may use.
#[derive(Clone, Default)]
pub struct Registry {
    kinds: BTreeMap<&'static str, Kind>,
    sections: BTreeMap<&'static str, SectionKind>,
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn operator<C: OperatorConfig>(mut self) -> Self {
        self.kinds.insert(
            C::KIND,
            Kind {
                name: C::KIND,
                summary: C::SUMMARY,
                role: C::ROLE,
                ports: Ports::Operator {
                    input: PayloadType::of::<<C::Op as Operator>::In>(),
                    output: PayloadType::of::<<C::Op as Operator>::Out>(),
                },
                parse: |node| {
                    marked_yaml::from_node::<C>(node)
                        .map(|c| Arc::new(OpConfig(c)) as Arc<dyn DynConfig>)
                },
            },
        );
        self
    }

    pub fn ingress<C: IngressConfig>(mut self) -> Self {
        self.kinds.insert(
            C::KIND,
            Kind {
                name: C::KIND,
                summary: C::SUMMARY,
                role: Role::Ingress,
                ports: Ports::Ingress {
                    request: PayloadType::of::<<C::Ingress as Ingress>::Request>(),
                    response: PayloadType::of::<<C::Ingress as Ingress>::Response>(),
                },
                parse: |node| {
                    marked_yaml::from_node::<C>(node)
                        .map(|c| Arc::new(InConfig(c)) as Arc<dyn DynConfig>)
                },
            },
        );
        self
    }

    pub fn section<C: SectionConfig>(mut self) -> Self {
        self.sections.insert(
            C::NAME,
            SectionKind {
                parse: |node| marked_yaml::from_node::<C>(node).map(|c| Arc::new(c) as AnySection),
                validate: |any, nodes| {
                    any.downcast_ref::<C>()
                        .map(|c| c.validate(nodes))
                        .unwrap_or_default()
                },
            },
        );
        self
    }

    pub fn get_section(&self, name: &str) -> Option<&SectionKind> {
        self.sections.get(name)
    }

    /// Names of the sections this registry knows.
    pub fn section_names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.sections.keys().copied()
    }

    pub fn get(&self, name: &str) -> Option<&Kind> {
        self.kinds.get(name)
    }

    pub fn kinds(&self) -> impl Iterator<Item = &Kind> {
        self.kinds.values()
    }
}
