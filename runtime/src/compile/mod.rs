//! The graph compiler: spec + registry → a checked graph, or every error at once.
//!
//! A sequence of named passes over one `Compiler` state (`Compiler::PASSES`, in order), each
//! reporting all it finds before the next runs on what survived: nodes (kind, config,
//! `validate()`), edges (names and payload types), calls (nodes named in configs), fan-out,
//! cycles, paths (each ingress reaches a node answering its response type), reach, roles (a
//! router has a worker behind it), process groups (replica counts) and wire codecs (calls that
//! leave a process). A new check is a new method and a line in `PASSES`.
//!
//! This module holds the compiler's state, its pass list and the entry points. The passes
//! live in submodules by what they check: `configs` (nodes and sections), `edges` (inputs,
//! calls, fan-out, cycles), `paths` (paths, reach, roles), `models` (the model of each path
//! and node) and `processes` (process groups, wire codecs); the compiler's output is in
//! `graph`, plane addresses in `plane`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::diag::{Diagnostic, Diagnostics, Pos};
use crate::spec::{self, GraphSpec, Override};
use dyn_core::payload::PayloadType;
use dyn_core::planes::TransferWire;
use dyn_core::registry::{AnySection, DynConfig, Kind, Ports, Registry};

mod configs;
mod edges;
mod graph;
mod models;
mod paths;
mod plane;
mod processes;

pub use graph::{ChainPath, CompiledGraph, CompiledNode};
pub use plane::PlaneAddr;

use plane::parse_plane;

/// The type a node sends downstream.
pub fn output_type(kind: &Kind) -> PayloadType {
    match kind.ports {
        Ports::Operator { output, .. } => output,
        Ports::Ingress { request, .. } => request,
    }
}

fn input_type(kind: &Kind) -> Option<PayloadType> {
    match kind.ports {
        Ports::Operator { input, .. } => Some(input),
        Ports::Ingress { .. } => None,
    }
}

/// Load a graph file and compile it: the one call the CLI makes.
pub fn load_and_compile(
    path: &Path,
    overrides: &[Override],
    registry: &Registry,
) -> Result<CompiledGraph, Diagnostics> {
    let (spec, diags) = spec::load(path, overrides)?;
    let base_dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    compile(&spec, diags, base_dir, registry)
}

/// Compile a loaded spec, adding to the diagnostics its loading produced.
pub fn compile(
    spec: &GraphSpec,
    mut diags: Diagnostics,
    base_dir: PathBuf,
    registry: &Registry,
) -> Result<CompiledGraph, Diagnostics> {
    let control = parse_plane(&spec.planes.control, "etcd", "control", &mut diags);
    let events = parse_plane(&spec.planes.events, "nats", "events", &mut diags);
    let (wire, pos) = &spec.planes.transfer;
    let transfer = wire.parse().unwrap_or_else(|message: String| {
        diags.push(Diagnostic::error(*pos, None, message));
        TransferWire::Auto
    });
    let mut c = Compiler::new(spec, registry, diags);
    for (name, pass) in Compiler::PASSES {
        tracing::trace!(pass = name, "Compiler pass");
        pass(&mut c);
    }
    c.finish(control, events, transfer, base_dir)
}

/// One compiler pass: reads and adds to what the earlier ones found.
type Pass<'a> = fn(&mut Compiler<'a>);

/// What the passes know so far about one spec.
struct Compiler<'a> {
    spec: &'a GraphSpec,
    registry: &'a Registry,
    diags: Diagnostics,
    /// Per node: its kind and config, `None` when either was wrong.
    parsed: Vec<Option<(Kind, Arc<dyn DynConfig>)>>,
    index: HashMap<&'a str, usize>,
    inputs: Vec<Vec<usize>>,
    /// consumers[u] = (consumer, position of the input entry naming u)
    consumers: Vec<Vec<(usize, Option<Pos>)>>,
    /// Nodes named in other nodes' configs (a remote prefill's pool).
    called: Vec<bool>,
    /// Per node: the nodes whose configs name it.
    callers: Vec<Vec<usize>>,
    /// Per node: the model it serves, once the paths are traced.
    model: Vec<Option<String>>,
    /// Routers whose pools were checked.
    pools_checked: std::collections::HashSet<usize>,
    chains: Vec<ChainPath>,
    on_chain: Vec<bool>,
    /// Per node: its replica count, from `replicas` or else from its config (see
    /// [`dyn_core::OperatorConfig::replicas`]).
    replicas: Vec<u32>,
    sections: BTreeMap<String, AnySection>,
}

impl<'a> Compiler<'a> {
    /// The passes, in order. Each reports everything it finds; later passes look only at what
    /// earlier ones let through (a node whose config failed to parse has no type to check).
    const PASSES: [(&'static str, Pass<'a>); 12] = [
        ("nodes", Self::parse_nodes),
        ("edges", Self::link_edges),
        ("calls", Self::resolve_calls),
        ("fan-out", Self::check_fan_out),
        ("cycles", Self::check_cycles),
        ("paths", Self::trace_paths),
        ("models", Self::assign_models),
        ("reach", Self::warn_unreached),
        ("roles", Self::check_roles),
        ("process groups", Self::check_process_groups),
        ("wire codecs", Self::check_wire_codecs),
        ("sections", Self::check_sections),
    ];

    fn new(spec: &'a GraphSpec, registry: &'a Registry, diags: Diagnostics) -> Self {
        let n = spec.nodes.len();
        Self {
            spec,
            registry,
            diags,
            parsed: Vec::with_capacity(n),
            index: spec
                .nodes
                .iter()
                .enumerate()
                .map(|(i, n)| (n.id.as_str(), i))
                .collect(),
            inputs: vec![Vec::new(); n],
            consumers: vec![Vec::new(); n],
            called: vec![false; n],
            callers: vec![Vec::new(); n],
            model: vec![None; n],
            pools_checked: Default::default(),
            chains: Vec::new(),
            on_chain: vec![false; n],
            replicas: spec.nodes.iter().map(|n| n.replicas).collect(),
            sections: BTreeMap::new(),
        }
    }

    fn error(&mut self, pos: Option<Pos>, node: usize, message: impl Into<String>) {
        let id = Some(self.spec.nodes[node].id.as_str());
        self.diags.push(Diagnostic::error(pos, id, message));
    }

    fn finish(
        mut self,
        control: PlaneAddr,
        events: PlaneAddr,
        transfer: TransferWire,
        base_dir: PathBuf,
    ) -> Result<CompiledGraph, Diagnostics> {
        self.diags.sort();
        if self.diags.has_errors() {
            return Err(self.diags);
        }
        let spec = self.spec;
        let nodes = spec
            .nodes
            .iter()
            .zip(self.parsed)
            .zip(self.inputs)
            .zip(self.replicas)
            .zip(self.model)
            .filter_map(|((((n, p), inputs), replicas), model)| {
                p.map(|(kind, config)| CompiledNode {
                    model,
                    id: n.id.clone(),
                    kind,
                    config,
                    inputs,
                    replicas,
                    process: n.process.clone(),
                    migration_limit: n.migration_limit,
                })
            })
            .collect();
        Ok(CompiledGraph {
            name: spec.name.clone(),
            namespace: spec.namespace.clone(),
            control,
            events,
            transfer,
            models: spec.models.clone(),
            base_dir,
            nodes,
            chains: self.chains,
            sections: self.sections,
            warnings: self.diags,
        })
    }
}
