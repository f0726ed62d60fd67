//! The graph compiler: spec + registry → a checked graph, or every error at once.
//!
//! Phases, each reporting all it finds before the next runs on what survived:
//!
//! 1. nodes: known kind, config fields and types (serde, with positions), the kind's own
//!    `validate()`, replica counts;
//! 2. edges: inputs name real nodes, payload types agree on both ends;
//! 3. shape: no cycles, no fan-out (a request's path must be unambiguous), every ingress
//!    reaches a last node whose output is the ingress's response type;
//! 4. placement: process groups agree on replicas, calls that leave a process carry types
//!    with a wire codec.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use marked_yaml::Node;

use crate::diag::{Diagnostic, Diagnostics, Pos};
use crate::payload::PayloadType;
use crate::registry::{DynConfig, Kind, Registry, Role};
use crate::spec::{self, GraphSpec, ModelSpec, Override};

/// Where a plane lives, parsed from the `planes:` section.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PlaneAddr {
    Embedded,
    Etcd(Vec<String>),
    Nats(Vec<String>),
}

impl std::fmt::Display for PlaneAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PlaneAddr::Embedded => f.write_str("embedded"),
            PlaneAddr::Etcd(eps) => write!(f, "etcd://{}", eps.join(",")),
            PlaneAddr::Nats(eps) => write!(f, "nats://{}", eps.join(",")),
        }
    }
}

/// A node that passed every check.
#[derive(Clone)]
pub struct CompiledNode {
    pub id: String,
    pub kind: Kind,
    pub config: Arc<dyn DynConfig>,
    /// Indices into [`CompiledGraph::nodes`].
    pub inputs: Vec<usize>,
    pub replicas: u32,
    pub process: String,
    /// See [`crate::spec::NodeSpec::migration_limit`].
    pub migration_limit: u32,
}

/// The path one ingress's requests take: `path` in call order, the last one answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainPath {
    pub ingress: usize,
    pub path: Vec<usize>,
}

/// A checked graph, ready to plan and run.
#[derive(Clone)]
pub struct CompiledGraph {
    pub name: String,
    pub namespace: String,
    pub control: PlaneAddr,
    pub events: PlaneAddr,
    pub model: Option<ModelSpec>,
    pub base_dir: PathBuf,
    pub nodes: Vec<CompiledNode>,
    pub chains: Vec<ChainPath>,
    /// Warnings (never errors) found while compiling.
    pub warnings: Diagnostics,
}

impl CompiledGraph {
    pub fn node(&self, id: &str) -> Option<&CompiledNode> {
        self.nodes.iter().find(|n| n.id == id)
    }
}

/// The type a node sends downstream.
pub fn output_type(kind: &Kind) -> PayloadType {
    match kind.role {
        Role::Operator { output, .. } => output,
        Role::Ingress { request, .. } => request,
    }
}

fn input_type(kind: &Kind) -> Option<PayloadType> {
    match kind.role {
        Role::Operator { input, .. } => Some(input),
        Role::Ingress { .. } => None,
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

fn parse_plane(
    addr: &(String, Option<Pos>),
    scheme: &str,
    which: &str,
    diags: &mut Diagnostics,
) -> PlaneAddr {
    let (text, pos) = addr;
    match PlaneAddr::parse(text, scheme) {
        Ok(a) => a,
        Err(message) => {
            diags.push(Diagnostic::error(
                *pos,
                None,
                format!("{which} plane {message}"),
            ));
            PlaneAddr::Embedded
        }
    }
}

impl PlaneAddr {
    /// `embedded`, or `SCHEME://HOST:PORT[,HOST:PORT…]` with `scheme` `etcd` or `nats`.
    pub fn parse(text: &str, scheme: &str) -> Result<PlaneAddr, String> {
        if text == "embedded" {
            return Ok(PlaneAddr::Embedded);
        }
        let endpoints: Option<Vec<String>> = text
            .strip_prefix(&format!("{scheme}://"))
            .map(|rest| rest.split(',').map(str::to_owned).collect());
        match endpoints {
            Some(eps)
                if eps.iter().all(|e| {
                    e.rsplit_once(':')
                        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
                }) =>
            {
                Ok(if scheme == "etcd" {
                    PlaneAddr::Etcd(eps)
                } else {
                    PlaneAddr::Nats(eps)
                })
            }
            _ => Err(format!(
                "`{text}`: expected `embedded` or `{scheme}://HOST:PORT[,HOST:PORT…]`"
            )),
        }
    }
}

/// Position of `field` (dotted for nested keys) inside a node's config.
fn field_pos(config: &Node, field: &str) -> Option<Pos> {
    let mut node = config;
    for key in field.split('.') {
        node = node.as_mapping()?.get_node(key)?;
    }
    Pos::of_span(node.span())
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

    // Phase 1: nodes.
    let mut parsed: Vec<Option<(Kind, Arc<dyn DynConfig>)>> = Vec::with_capacity(spec.nodes.len());
    for n in &spec.nodes {
        let id = Some(n.id.as_str());
        if n.replicas == 0 {
            diags.push(Diagnostic::error(
                n.replicas_pos,
                id,
                "`replicas` must be at least 1",
            ));
        }
        let Some(kind) = registry.get(&n.kind) else {
            let known: Vec<&str> = registry.kinds().map(|k| k.name).collect();
            diags.push(Diagnostic::error(
                n.kind_pos,
                id,
                format!(
                    "unknown kind `{}`; known kinds: {}",
                    n.kind,
                    known.join(", ")
                ),
            ));
            parsed.push(None);
            continue;
        };
        let config = match kind.parse(&n.config) {
            Ok(c) => c,
            Err(e) => {
                let (pos, msg) = spec::from_node_diag(&e, n.pos);
                diags.push(Diagnostic::error(
                    pos,
                    id,
                    format!("{} config: {msg}", kind.name),
                ));
                parsed.push(None);
                continue;
            }
        };
        for inv in config.validate() {
            let pos = inv
                .field
                .as_deref()
                .and_then(|f| field_pos(&n.config, f))
                .or(Pos::of_span(n.config.span()))
                .or(n.pos);
            let msg = match &inv.field {
                Some(f) => format!("{} config: field `{f}`: {}", kind.name, inv.message),
                None => format!("{} config: {}", kind.name, inv.message),
            };
            diags.push(Diagnostic::error(pos, id, msg));
        }
        if kind.is_ingress() && !n.inputs.is_empty() {
            diags.push(Diagnostic::error(
                n.inputs_pos,
                id,
                format!("kind `{}` is an ingress and takes no inputs", kind.name),
            ));
        }
        parsed.push(Some((kind.clone(), config)));
    }

    // Phase 2: edges.
    let index: HashMap<&str, usize> = spec
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.id.as_str(), i))
        .collect();
    let mut inputs: Vec<Vec<usize>> = vec![Vec::new(); spec.nodes.len()];
    // consumers[u] = (consumer, position of the input entry naming u)
    let mut consumers: Vec<Vec<(usize, Option<Pos>)>> = vec![Vec::new(); spec.nodes.len()];
    for (j, n) in spec.nodes.iter().enumerate() {
        let id = Some(n.id.as_str());
        for (input, pos) in &n.inputs {
            let Some(&i) = index.get(input.as_str()) else {
                if spec.broken.contains(input) {
                    continue;
                }
                diags.push(Diagnostic::error(
                    *pos,
                    id,
                    format!("input '{input}' does not name a node in this graph"),
                ));
                continue;
            };
            if inputs[j].contains(&i) {
                diags.push(Diagnostic::error(
                    *pos,
                    id,
                    format!("input '{input}' is listed twice"),
                ));
                continue;
            }
            inputs[j].push(i);
            consumers[i].push((j, *pos));
            if let (Some((up, _)), Some((down, _))) = (&parsed[i], &parsed[j]) {
                let produced = output_type(up);
                if let Some(expected) = input_type(down)
                    && produced != expected
                {
                    diags.push(Diagnostic::error(
                            *pos,
                            id,
                            format!(
                                "edge '{input}' → '{}': '{input}' ({}) yields {produced} but '{}' ({}) takes {expected}",
                                n.id, up.name, n.id, down.name
                            ),
                        ));
                }
            }
        }
    }

    // Nodes named in other nodes' configs (a remote prefill's pool).
    let mut called = vec![false; spec.nodes.len()];
    for (j, n) in spec.nodes.iter().enumerate() {
        let Some((_, config)) = &parsed[j] else {
            continue;
        };
        for name in config.calls() {
            match index.get(name.as_str()) {
                Some(&i) => called[i] = true,
                None if spec.broken.contains(&name) => {}
                None => diags.push(Diagnostic::error(
                    Pos::of_span(n.config.span()).or(n.pos),
                    Some(&n.id),
                    format!("config names node '{name}', which is not in this graph"),
                )),
            }
        }
    }

    // Phase 3: shape.
    for (i, cs) in consumers.iter().enumerate() {
        if cs.len() > 1 {
            let names: Vec<String> = cs
                .iter()
                .map(|(c, _)| format!("'{}'", spec.nodes[*c].id))
                .collect();
            diags.push(Diagnostic::error(
                cs[1].1,
                Some(&spec.nodes[cs[1].0].id),
                format!(
                    "node '{}' feeds {} nodes ({}); each node may feed one, so that every request has one path",
                    spec.nodes[i].id,
                    cs.len(),
                    names.join(", ")
                ),
            ));
        }
    }
    report_cycles(spec, &inputs, &mut diags);

    let mut chains = Vec::new();
    let mut on_chain = vec![false; spec.nodes.len()];
    for (i, p) in parsed.iter().enumerate() {
        let Some((kind, _)) = p else { continue };
        let Role::Ingress { response, .. } = kind.role else {
            continue;
        };
        on_chain[i] = true;
        let mut path = Vec::new();
        let mut cur = i;
        while let [(next, _)] = consumers[cur].as_slice() {
            if on_chain[*next] && path.contains(next) || *next == i {
                break; // a cycle, reported above
            }
            path.push(*next);
            on_chain[*next] = true;
            cur = *next;
        }
        let node = &spec.nodes[i];
        match path.last() {
            None if consumers[i].is_empty() => diags.push(Diagnostic::error(
                node.pos,
                Some(&node.id),
                "ingress has no node taking its requests; name it in another node's `inputs`",
            )),
            None => {}
            Some(&last) => {
                if let Some((last_kind, _)) = &parsed[last] {
                    let produced = output_type(last_kind);
                    if produced != response {
                        diags.push(Diagnostic::error(
                            spec.nodes[last].pos,
                            Some(&spec.nodes[last].id),
                            format!(
                                "ends the path of ingress '{}', which answers with {response}, but '{}' ({}) yields {produced}",
                                node.id, spec.nodes[last].id, last_kind.name
                            ),
                        ));
                    }
                }
            }
        }
        chains.push(ChainPath { ingress: i, path });
    }
    for (i, n) in spec.nodes.iter().enumerate() {
        if !on_chain[i]
            && !called[i]
            && parsed[i].is_some()
            && consumers[i].is_empty()
            && n.inputs.is_empty()
        {
            diags.push(Diagnostic::warning(
                n.pos,
                Some(&n.id),
                "no ingress reaches this node; it is started, but only other nodes' configs can call it",
            ));
        }
    }

    // Phase 4: placement.
    let mut groups: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, n) in spec.nodes.iter().enumerate() {
        let first = *groups.entry(n.process.as_str()).or_insert(i);
        let f = &spec.nodes[first];
        if f.replicas != n.replicas {
            diags.push(Diagnostic::error(
                n.replicas_pos.or(n.process_pos).or(n.pos),
                Some(&n.id),
                format!(
                    "process '{}' holds '{}' ×{} and '{}' ×{}; nodes sharing a process share its replica count",
                    n.process, f.id, f.replicas, n.id, n.replicas
                ),
            ));
        }
        if let Some((kind, _)) = &parsed[i]
            && kind.is_ingress()
            && n.replicas > 1
        {
            diags.push(Diagnostic::error(
                    n.replicas_pos,
                    Some(&n.id),
                    "an ingress cannot have replicas (each would bind the same address); run another graph instead",
                ));
        }
    }
    for chain in &chains {
        let ingress = &spec.nodes[chain.ingress];
        for &j in &chain.path {
            let n = &spec.nodes[j];
            let Some((kind, _)) = &parsed[j] else {
                continue;
            };
            if n.process == ingress.process {
                continue;
            }
            let types = [
                ("input", input_type(kind)),
                ("output", Some(output_type(kind))),
            ];
            for (side, ty) in types {
                if let Some(ty) = ty.filter(|t| t.codec.is_none()) {
                    diags.push(Diagnostic::error(
                        n.process_pos.or(n.pos),
                        Some(&n.id),
                        format!(
                            "runs in process '{}' but is called from process '{}' (ingress '{}'); its {side} type {ty} has no wire codec, so the node must share the caller's process",
                            n.process, ingress.process, ingress.id
                        ),
                    ));
                }
            }
        }
    }

    diags.sort();
    if diags.has_errors() {
        return Err(diags);
    }
    let nodes = spec
        .nodes
        .iter()
        .zip(parsed)
        .zip(inputs)
        .filter_map(|((n, p), inputs)| {
            p.map(|(kind, config)| CompiledNode {
                id: n.id.clone(),
                kind,
                config,
                inputs,
                replicas: n.replicas,
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
        model: spec.model.clone(),
        base_dir,
        nodes,
        chains,
        warnings: diags,
    })
}

/// Find every cycle once (iterative DFS over input edges) and report it at its first node.
fn report_cycles(spec: &GraphSpec, inputs: &[Vec<usize>], diags: &mut Diagnostics) {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Active,
        Done,
    }
    let n = spec.nodes.len();
    let mut mark = vec![Mark::New; n];
    let mut outputs: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (j, ins) in inputs.iter().enumerate() {
        for &i in ins {
            outputs[i].push(j);
        }
    }
    for start in 0..n {
        if mark[start] != Mark::New {
            continue;
        }
        // (node, next child index)
        let mut stack = vec![(start, 0usize)];
        mark[start] = Mark::Active;
        while let Some(&mut (node, ref mut next)) = stack.last_mut() {
            if let Some(&child) = outputs[node].get(*next) {
                *next += 1;
                match mark[child] {
                    Mark::New => {
                        mark[child] = Mark::Active;
                        stack.push((child, 0));
                    }
                    Mark::Active => {
                        let from = stack.iter().position(|(s, _)| *s == child).unwrap_or(0);
                        let cycle: Vec<&str> = stack[from..]
                            .iter()
                            .map(|(s, _)| spec.nodes[*s].id.as_str())
                            .chain(std::iter::once(spec.nodes[child].id.as_str()))
                            .collect();
                        let first = &spec.nodes[child];
                        diags.push(Diagnostic::error(
                            first.inputs_pos.or(first.pos),
                            Some(&first.id),
                            format!("cycle: {}", cycle.join(" → ")),
                        ));
                    }
                    Mark::Done => {}
                }
            } else {
                mark[node] = Mark::Done;
                stack.pop();
            }
        }
    }
}
