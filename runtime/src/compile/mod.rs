//! The graph compiler: spec + registry → a checked graph, or every error at once.
//!
//! A sequence of named passes over one `Compiler` state (`Compiler::PASSES`, in order), each
//! reporting all it finds before the next runs on what survived: nodes (kind, config,
//! `validate()`), edges (names and payload types), calls (nodes named in configs), fan-out,
//! cycles, paths (each ingress reaches a node answering its response type), reach, roles (a
//! router has a worker behind it), process groups (replica counts) and wire codecs (calls that
//! leave a process). A new check is a new method and a line in `PASSES`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use marked_yaml::Node;

use crate::diag::{Diagnostic, Diagnostics, Pos};
use crate::spec::{self, GraphSpec, Override};
use dyn_core::payload::PayloadType;
use dyn_core::registry::{AnySection, DynConfig, Kind, Ports, Registry, Role, SectionNode};

mod graph;
mod plane;

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

/// Position of `field` (dotted for nested keys) inside a node's config.
fn field_pos(config: &Node, field: &str) -> Option<Pos> {
    let mut node = config;
    for key in field.split('.') {
        node = node.as_mapping()?.get_node(key)?;
    }
    Pos::of_span(node.span())
}

/// Where and how to report what a config's `validate()` found: at the field it names (else
/// the config, else `fallback`), the message prefixed with `what` (`echo config`, `planner`).
fn invalid_at(
    config: &Node,
    inv: &dyn_core::registry::Invalid,
    fallback: Option<Pos>,
    what: &str,
) -> (Option<Pos>, String) {
    let pos = inv
        .field
        .as_deref()
        .and_then(|f| field_pos(config, f))
        .or(Pos::of_span(config.span()))
        .or(fallback);
    let msg = match &inv.field {
        Some(f) => format!("{what}: field `{f}`: {}", inv.message),
        None => format!("{what}: {}", inv.message),
    };
    (pos, msg)
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
    let mut c = Compiler::new(spec, registry, diags);
    for (name, pass) in Compiler::PASSES {
        tracing::trace!(pass = name, "Compiler pass");
        pass(&mut c);
    }
    c.finish(control, events, base_dir)
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

    /// Known kind, config fields and types (serde, with positions), the kind's own
    /// `validate()`, replica counts.
    fn parse_nodes(&mut self) {
        for (i, n) in self.spec.nodes.iter().enumerate() {
            if n.replicas == 0 {
                self.error(n.replicas_pos, i, "`replicas` must be at least 1");
            }
            let Some(kind) = self.registry.get(&n.kind) else {
                let known: Vec<&str> = self.registry.kinds().map(|k| k.name).collect();
                let msg = format!(
                    "unknown kind `{}`; known kinds: {}",
                    n.kind,
                    known.join(", ")
                );
                self.error(n.kind_pos, i, msg);
                self.parsed.push(None);
                continue;
            };
            let config = match kind.parse(&n.config) {
                Ok(c) => c,
                Err(e) => {
                    let (pos, msg) = spec::from_node_diag(&e, n.pos);
                    self.error(pos, i, format!("{} config: {msg}", kind.name));
                    self.parsed.push(None);
                    continue;
                }
            };
            for inv in config.validate() {
                let (pos, msg) =
                    invalid_at(&n.config, &inv, n.pos, &format!("{} config", kind.name));
                self.error(pos, i, msg);
            }
            if let Some(k) = config.replicas() {
                if n.replicas_pos.is_none() {
                    self.replicas[i] = k;
                } else if n.replicas != k {
                    let msg = format!(
                        "`replicas: {}`, but the {} config names {k} engine servers (one replica each)",
                        n.replicas, kind.name
                    );
                    self.error(n.replicas_pos, i, msg);
                }
            }
            if kind.is_ingress() && !n.inputs.is_empty() {
                let msg = format!("kind `{}` is an ingress and takes no inputs", kind.name);
                self.error(n.inputs_pos, i, msg);
            }
            self.parsed.push(Some((kind.clone(), config)));
        }
    }

    /// Inputs name real nodes, once each, and payload types agree on both ends.
    fn link_edges(&mut self) {
        for (j, n) in self.spec.nodes.iter().enumerate() {
            for (input, pos) in &n.inputs {
                let Some(&i) = self.index.get(input.as_str()) else {
                    if !self.spec.broken.contains(input) {
                        let msg = format!("input '{input}' does not name a node in this graph");
                        self.error(*pos, j, msg);
                    }
                    continue;
                };
                if self.inputs[j].contains(&i) {
                    self.error(*pos, j, format!("input '{input}' is listed twice"));
                    continue;
                }
                self.inputs[j].push(i);
                self.consumers[i].push((j, *pos));
                if let (Some((up, _)), Some((down, _))) = (&self.parsed[i], &self.parsed[j]) {
                    let produced = output_type(up);
                    if let Some(expected) = input_type(down)
                        && produced != expected
                    {
                        let msg = format!(
                            "edge '{input}' → '{}': '{input}' ({}) yields {produced} but '{}' ({}) takes {expected}",
                            n.id, up.name, n.id, down.name
                        );
                        self.error(*pos, j, msg);
                    }
                }
            }
        }
    }

    /// Nodes named in other nodes' configs exist, and count as reached.
    fn resolve_calls(&mut self) {
        for (j, n) in self.spec.nodes.iter().enumerate() {
            let Some((_, config)) = &self.parsed[j] else {
                continue;
            };
            for name in config.calls() {
                match self.index.get(name.as_str()) {
                    Some(&i) => {
                        self.called[i] = true;
                        self.callers[i].push(j);
                    }
                    None if self.spec.broken.contains(&name) => {}
                    None => self.error(
                        Pos::of_span(n.config.span()).or(n.pos),
                        j,
                        format!("config names node '{name}', which is not in this graph"),
                    ),
                }
            }
        }
    }

    /// Each node feeds at most one, so a request's path is unambiguous, but for two choosers:
    /// an ingress feeds one path per model (a request names its model), and a router may feed
    /// several pools (it names the worker); [`Self::trace_paths`] checks those.
    fn check_fan_out(&mut self) {
        for (i, cs) in self.consumers.iter().enumerate() {
            // An ingress chooses by model only where the graph has several.
            let several = self.spec.models.len() > 1;
            let chooses = self.parsed[i]
                .as_ref()
                .is_some_and(|(k, _)| (k.is_ingress() && several) || k.role == Role::Router);
            if let Some((k, c)) = &self.parsed[i]
                && k.role == Role::Router
                && cs.len() == 1
                && let Some(named) = c.calls().first()
            {
                let msg = format!(
                    "pools names '{named}', but router '{}' feeds one node; pools are the worker nodes a router feeds",
                    self.spec.nodes[i].id
                );
                self.diags.push(Diagnostic::error(
                    self.spec.nodes[i].pos,
                    Some(&self.spec.nodes[i].id),
                    msg,
                ));
            }
            if cs.len() > 1 && !chooses {
                let names: Vec<String> = cs
                    .iter()
                    .map(|(c, _)| format!("'{}'", self.spec.nodes[*c].id))
                    .collect();
                self.diags.push(Diagnostic::error(
                    cs[1].1,
                    Some(&self.spec.nodes[cs[1].0].id),
                    format!(
                        "node '{}' feeds {} nodes ({}); each node may feed one, so that every request has one path",
                        self.spec.nodes[i].id,
                        cs.len(),
                        names.join(", ")
                    ),
                ));
            }
        }
    }

    fn check_cycles(&mut self) {
        report_cycles(self.spec, &self.inputs, &mut self.diags);
    }

    /// Every ingress reaches, down each path, a last node whose output is the ingress's
    /// response type; pools behind a router are workers that feed the same node.
    fn trace_paths(&mut self) {
        for i in 0..self.parsed.len() {
            let Some((kind, _)) = &self.parsed[i] else {
                continue;
            };
            let Ports::Ingress { response, .. } = kind.ports else {
                continue;
            };
            self.on_chain[i] = true;
            let node = &self.spec.nodes[i];
            if self.consumers[i].is_empty() {
                self.error(
                    node.pos,
                    i,
                    "ingress has no node taking its requests; name it in another node's `inputs`",
                );
                self.chains.push(ChainPath {
                    ingress: i,
                    model: None,
                    path: Vec::new(),
                    pools: BTreeMap::new(),
                });
                continue;
            }
            let firsts: Vec<usize> = self.consumers[i].iter().map(|&(c, _)| c).collect();
            for first in firsts {
                let chain = self.trace_one(i, first);
                if let Some(&last) = chain.path.last()
                    && let Some((last_kind, _)) = &self.parsed[last]
                {
                    let produced = output_type(last_kind);
                    if produced != response {
                        let msg = format!(
                            "ends the path of ingress '{}', which answers with {response}, but '{}' ({}) yields {produced}",
                            node.id, self.spec.nodes[last].id, last_kind.name
                        );
                        self.error(self.spec.nodes[last].pos, last, msg);
                    }
                }
                self.chains.push(chain);
            }
        }
    }

    /// The path of ingress `ingress` that starts at `first`.
    fn trace_one(&mut self, ingress: usize, first: usize) -> ChainPath {
        let mut path = vec![first];
        let mut pools = BTreeMap::new();
        self.on_chain[first] = true;
        let mut cur = first;
        loop {
            let next: Vec<usize> = self.consumers[cur].iter().map(|&(c, _)| c).collect();
            let Some(&one) = next.first() else { break };
            if next.iter().any(|n| path.contains(n) || *n == ingress) {
                break; // a cycle, reported already
            }
            if next.len() > 1 {
                // Only a router chooses among several (the fan-out pass reported any other).
                let router = matches!(&self.parsed[cur], Some((k, _)) if k.role == Role::Router);
                if !router {
                    break;
                }
                // Reported if wrong; the path goes on through the first pool either way, so
                // its end is still checked.
                self.check_pools(cur, &next);
                pools.insert(path.len(), next.clone());
                for &n in &next {
                    self.on_chain[n] = true;
                }
            }
            path.push(one);
            self.on_chain[one] = true;
            cur = one;
        }
        ChainPath {
            ingress,
            model: None,
            path,
            pools,
        }
    }

    /// Router `router`'s pools: workers (a router chooses a worker) that all feed the same
    /// node, so the path goes on the same way whichever the router picks.
    fn check_pools(&mut self, router: usize, pools: &[usize]) {
        // Once per router, however many paths pass it.
        if !self.pools_checked.insert(router) {
            return;
        }
        // The pools its config names are pools it feeds.
        let named = self.parsed[router]
            .as_ref()
            .map(|(_, c)| c.calls())
            .unwrap_or_default();
        for name in named {
            if !pools.iter().any(|&p| self.spec.nodes[p].id == name) {
                let fed: Vec<String> = pools
                    .iter()
                    .map(|&p| format!("'{}'", self.spec.nodes[p].id))
                    .collect();
                let msg = format!(
                    "pools names '{name}', which router '{}' does not feed (it feeds {})",
                    self.spec.nodes[router].id,
                    fed.join(", ")
                );
                self.error(self.spec.nodes[router].pos, router, msg);
            }
        }
        // A resend goes through the router again, to any pool: one limit for all.
        let limits: Vec<u32> = pools
            .iter()
            .map(|&p| self.spec.nodes[p].migration_limit)
            .collect();
        if limits.iter().any(|l| *l != limits[0]) {
            let msg = format!(
                "pools of router '{}' have different migration_limit values; a resent request may go to any pool, so give them one",
                self.spec.nodes[router].id
            );
            self.error(self.spec.nodes[pools[0]].pos, pools[0], msg);
        }
        let feeds = |c: &Self, p: usize| -> Vec<usize> {
            let mut v: Vec<usize> = c.consumers[p].iter().map(|&(n, _)| n).collect();
            v.sort_unstable();
            v
        };
        let first = feeds(self, pools[0]);
        for &p in pools {
            if let Some((k, _)) = &self.parsed[p]
                && k.role != Role::Worker
            {
                let msg = format!(
                    "router '{}' feeds several nodes, pools it chooses among, but '{}' ({}) is a {}, not a worker",
                    self.spec.nodes[router].id, self.spec.nodes[p].id, k.name, k.role
                );
                self.error(self.spec.nodes[p].pos, p, msg);
            }
            if feeds(self, p) != first {
                let names = |v: Vec<usize>| -> String {
                    let v: Vec<String> = v
                        .iter()
                        .map(|&n| format!("'{}'", self.spec.nodes[n].id))
                        .collect();
                    if v.is_empty() {
                        "nothing".into()
                    } else {
                        v.join(", ")
                    }
                };
                let msg = format!(
                    "pools of router '{}' must feed the same node: '{}' feeds {} but '{}' feeds {}",
                    self.spec.nodes[router].id,
                    self.spec.nodes[pools[0]].id,
                    names(first.clone()),
                    self.spec.nodes[p].id,
                    names(feeds(self, p))
                );
                self.error(self.spec.nodes[p].pos, p, msg);
            }
        }
    }

    /// The model of every path and node: the one a node on the path names (`model:`), else
    /// the graph's only model; a node serves one model, and an ingress one path per model.
    /// Nodes off every path (a prefill pool a config calls) take their callers' model.
    fn assign_models(&mut self) {
        let spec = self.spec;
        for (i, n) in spec.nodes.iter().enumerate() {
            if let Some((name, pos)) = &n.model {
                if spec.models.iter().all(|m| &m.name != name) {
                    let known: Vec<String> = spec
                        .models
                        .iter()
                        .map(|m| format!("`{}`", m.name))
                        .collect();
                    let msg = if known.is_empty() {
                        format!("`model: {name}`, but the graph names no model")
                    } else {
                        format!(
                            "`model: {name}` is not one of the graph's models ({})",
                            known.join(", ")
                        )
                    };
                    self.error(*pos, i, msg);
                    continue;
                }
                if self.parsed[i].as_ref().is_some_and(|(k, _)| k.is_ingress()) {
                    self.error(*pos, i, "an ingress serves the models of its paths; name the model on the first node of each path");
                    continue;
                }
                self.model[i] = Some(name.clone());
            }
        }
        let only = match spec.models.as_slice() {
            [m] => Some(m.name.clone()),
            _ => None,
        };
        for c in 0..self.chains.len() {
            let nodes: Vec<usize> = self.chains[c].nodes().collect();
            let named: Vec<(usize, String)> = nodes
                .iter()
                .filter_map(|&j| self.model[j].clone().map(|m| (j, m)))
                .collect();
            let model = match named.first() {
                Some((_, m)) => Some(m.clone()),
                None if spec.models.len() > 1 => {
                    if let Some(&first) = self.chains[c].path.first() {
                        let ingress = &spec.nodes[self.chains[c].ingress].id;
                        let msg = format!(
                            "the graph serves several models: name this path's (from ingress '{ingress}') with `model:` on its first node"
                        );
                        self.error(spec.nodes[first].pos, first, msg);
                    }
                    None
                }
                None => only.clone(),
            };
            for (j, m) in &named {
                if Some(m) != model.as_ref() {
                    let msg = format!(
                        "serves `{m}` but is on a path of `{}` (from '{}')",
                        model.as_deref().unwrap_or_default(),
                        spec.nodes[named[0].0].id
                    );
                    self.error(spec.nodes[*j].model.as_ref().and_then(|m| m.1), *j, msg);
                }
            }
            self.chains[c].model = model;
        }
        // Each node on paths: their model, one.
        let mut seen: Vec<Option<(String, usize)>> = vec![None; spec.nodes.len()];
        for c in 0..self.chains.len() {
            let Some(m) = self.chains[c].model.clone() else {
                continue;
            };
            for j in self.chains[c].nodes().collect::<Vec<_>>() {
                match &seen[j] {
                    Some((other, _)) if *other != m => {
                        let msg = format!(
                            "is on paths of two models (`{other}` and `{m}`); a node serves one: give each model nodes of its own"
                        );
                        self.error(spec.nodes[j].pos, j, msg);
                    }
                    _ => {
                        seen[j] = Some((m.clone(), c));
                        self.model[j] = Some(m.clone());
                    }
                }
            }
        }
        // An ingress: one path per model (with fewer models, the fan-out pass said it).
        for a in (0..self.chains.len()).filter(|_| spec.models.len() > 1) {
            for b in 0..a {
                let (x, y) = (&self.chains[a], &self.chains[b]);
                if x.ingress == y.ingress && x.model == y.model && x.path.first() != y.path.first()
                {
                    let (ingress, first) =
                        (x.ingress, x.path.first().copied().unwrap_or(x.ingress));
                    let msg = format!(
                        "ingress '{}' feeds two paths of {} ('{}' and '{}'); it picks a path by the request's model, so each path serves another (`model:` on its first node)",
                        spec.nodes[ingress].id,
                        x.model
                            .as_ref()
                            .map_or("no model".to_owned(), |m| format!("model `{m}`")),
                        y.path.first().map_or("", |&f| spec.nodes[f].id.as_str()),
                        spec.nodes[first].id,
                    );
                    self.error(spec.nodes[first].pos, first, msg);
                }
            }
        }
        // Off every path: the callers' model (a prefill pool serves its caller's model).
        for i in 0..spec.nodes.len() {
            let callers: Vec<String> = self.callers[i]
                .iter()
                .filter_map(|&c| self.model[c].clone())
                .collect();
            match (&self.model[i], callers.first()) {
                (None, _) => {
                    self.model[i] = callers.first().cloned().or_else(|| only.clone());
                }
                (Some(m), Some(c)) if m != c && !self.on_chain[i] => {
                    let msg = format!("serves `{m}` but is called by a node of `{c}`");
                    self.error(spec.nodes[i].model.as_ref().and_then(|m| m.1), i, msg);
                }
                _ => {}
            }
        }
    }

    /// A node no ingress reaches and no config calls is started but idle: worth a warning.
    fn warn_unreached(&mut self) {
        for (i, n) in self.spec.nodes.iter().enumerate() {
            if !self.on_chain[i]
                && !self.called[i]
                && self.parsed[i].is_some()
                && self.consumers[i].is_empty()
                && n.inputs.is_empty()
            {
                self.diags.push(Diagnostic::warning(
                    n.pos,
                    Some(&n.id),
                    "no ingress reaches this node; it is started, but only other nodes' configs can call it",
                ));
            }
        }
    }

    /// Nodes that forward requests keep their type, and a router has a worker behind it
    /// (past any pass-through nodes): the runtime sends a router's choice there.
    fn check_roles(&mut self) {
        for i in 0..self.parsed.len() {
            let Some((kind, _)) = &self.parsed[i] else {
                continue;
            };
            let (role, name) = (kind.role, kind.name);
            if role.forwards()
                && let Ports::Operator { input, output } = kind.ports
                && input != output
            {
                let msg = format!(
                    "kind `{name}` is a {role} but takes {input} and yields {output}; a {role} hands on what it takes"
                );
                self.error(self.spec.nodes[i].kind_pos, i, msg);
            }
            if role != Role::Router {
                continue;
            }
            let Some(behind) = self.behind_router(i) else {
                continue; // a cycle, reported by its own pass
            };
            let router = &self.spec.nodes[i];
            let Some(w) = behind else {
                let msg = format!(
                    "router '{}' has no worker behind it; name it in a worker node's `inputs`",
                    router.id
                );
                self.error(router.pos, i, msg);
                continue;
            };
            // A node whose config did not parse has been reported already.
            if let Some((k, _)) = &self.parsed[w]
                && k.role != Role::Worker
            {
                let msg = format!(
                    "router '{}' chooses among the replicas of the node behind it, but '{}' ({}) is a {}, not a worker",
                    router.id, self.spec.nodes[w].id, k.name, k.role
                );
                self.error(self.spec.nodes[w].pos, w, msg);
            }
        }
    }

    /// The first node behind router `i` that is not a pass-through node (`Some(None)`: none
    /// takes its output); `None` when the walk meets a cycle.
    fn behind_router(&self, i: usize) -> Option<Option<usize>> {
        let mut cur = i;
        for _ in 0..self.parsed.len() {
            let Some(&(next, _)) = self.consumers[cur].first() else {
                return Some(None);
            };
            if next == i {
                return None;
            }
            match &self.parsed[next] {
                Some((k, _)) if k.role == Role::PassThrough => cur = next,
                _ => return Some(Some(next)),
            }
        }
        None
    }

    /// Nodes sharing a process share its replica count; an ingress has one replica.
    fn check_process_groups(&mut self) {
        let mut groups: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, n) in self.spec.nodes.iter().enumerate() {
            let first = *groups.entry(n.process.as_str()).or_insert(i);
            let f = &self.spec.nodes[first];
            let (fr, nr) = (self.replicas[first], self.replicas[i]);
            if fr != nr {
                let msg = format!(
                    "process '{}' holds '{}' ×{fr} and '{}' ×{nr}; nodes sharing a process share its replica count",
                    n.process, f.id, n.id
                );
                self.error(n.replicas_pos.or(n.process_pos).or(n.pos), i, msg);
            }
            if let Some((kind, _)) = &self.parsed[i]
                && kind.is_ingress()
                && self.replicas[i] > 1
            {
                self.error(
                    n.replicas_pos,
                    i,
                    "an ingress cannot have replicas (each would bind the same address); run another graph instead",
                );
            }
        }
    }

    /// Calls that leave the ingress's process carry types with a wire codec.
    fn check_wire_codecs(&mut self) {
        for chain in &self.chains {
            let ingress = &self.spec.nodes[chain.ingress];
            for j in chain.nodes() {
                let n = &self.spec.nodes[j];
                let Some((kind, _)) = &self.parsed[j] else {
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
                        self.diags.push(Diagnostic::error(
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
    }

    /// Top-level sections: a registered name, a config that parses, and its own checks
    /// against the nodes that compiled.
    fn check_sections(&mut self) {
        let spec = self.spec;
        let mut groups: BTreeMap<&str, usize> = BTreeMap::new();
        for n in &spec.nodes {
            *groups.entry(n.process.as_str()).or_default() += 1;
        }
        let nodes: Vec<SectionNode<'_>> = spec
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| {
                let (kind, _) = self.parsed[i].as_ref()?;
                Some(SectionNode {
                    id: &n.id,
                    kind: kind.name,
                    role: kind.role,
                    replicas: self.replicas[i],
                    process: &n.process,
                    process_nodes: groups.get(n.process.as_str()).copied().unwrap_or(1),
                })
            })
            .collect();
        for s in &spec.sections {
            let Some(kind) = self.registry.get_section(&s.name) else {
                let mut known = vec!["name", "namespace", "planes", "model", "models", "nodes"];
                known.extend(self.registry.section_names());
                self.diags.push(Diagnostic::error(
                    s.pos,
                    None,
                    format!(
                        "unknown top-level key `{}`; expected one of: {}",
                        s.name,
                        known.join(", ")
                    ),
                ));
                continue;
            };
            let parsed = match kind.parse(&s.node) {
                Ok(p) => p,
                Err(e) => {
                    let (pos, msg) = spec::from_node_diag(&e, s.pos);
                    self.diags
                        .push(Diagnostic::error(pos, None, format!("{}: {msg}", s.name)));
                    continue;
                }
            };
            for inv in kind.validate(&parsed, &nodes) {
                let (pos, msg) = invalid_at(&s.node, &inv, s.pos, &s.name);
                self.diags.push(Diagnostic::error(pos, None, msg));
            }
            self.sections.insert(s.name.clone(), parsed);
        }
    }

    fn finish(
        mut self,
        control: PlaneAddr,
        events: PlaneAddr,
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
            models: spec.models.clone(),
            base_dir,
            nodes,
            chains: self.chains,
            sections: self.sections,
            warnings: self.diags,
        })
    }
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
