//! The graph spec: the YAML a user writes, loaded with the position of every value.
//!
//! All YAML parsing of the project goes through [`load`] (and [`load_str`]), so the YAML library
//! can be swapped in one place. We use `marked-yaml` rather than `serde_yaml`: it keeps a line and
//! column on every node and reports serde errors at the offending value, which the compiler
//! needs for `FILE:LINE:COL` diagnostics; `serde_yaml` only locates syntax errors.
//!
//! ```yaml
//! name: echo
//! namespace: dev
//! planes: {control: embedded, events: embedded}
//! nodes:
//!   ingress: {kind: http_text, config: {listen: "127.0.0.1:8000"}}
//!   echo:    {kind: echo, inputs: [ingress], replicas: 2}
//! ```

use std::path::Path;

use marked_yaml::{LoaderOptions, Node, Spanned};
use serde::Deserialize;

use crate::diag::{Diagnostic, Diagnostics, Pos};

/// A loaded graph, not yet checked against the registry.
#[derive(Debug, Clone)]
pub struct GraphSpec {
    pub name: String,
    pub namespace: String,
    pub planes: PlanesSpec,
    /// The models it serves: `model:` (one), or `models:` (several, each with a name that
    /// nodes' `model` fields and requests' `model` pick), in file order.
    pub models: Vec<ModelSpec>,
    pub nodes: Vec<NodeSpec>,
    /// Top-level keys other than the header's and `nodes`: sections a registry defines
    /// (`planner:`), checked by the compiler against the registry.
    pub sections: Vec<SectionSpec>,
    /// Ids of nodes whose own fields did not parse (already reported); edges to them are not
    /// reported again as dangling.
    pub broken: Vec<String>,
}

/// Where the control and event planes live, as written (`embedded`, `etcd://…`, `nats://…`),
/// and the KV transfer wire (`auto`, `ucx`, `tcp`).
#[derive(Debug, Clone)]
pub struct PlanesSpec {
    pub control: (String, Option<Pos>),
    pub events: (String, Option<Pos>),
    pub transfer: (String, Option<Pos>),
}

/// The model a graph serves (defined in `dyn-core`: every kind's build context carries it).
pub use dyn_core::ModelSpec;

/// A top-level section as written, kept as a marked node for its registered config type.
#[derive(Debug, Clone)]
pub struct SectionSpec {
    pub name: String,
    pub pos: Option<Pos>,
    pub node: Node,
}

/// The graph's own top-level keys; any other is a section (see [`SectionSpec`]).
const HEADER_KEYS: &[&str] = &["name", "namespace", "planes", "model", "models", "nodes"];

/// One node as written.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    pub id: String,
    pub pos: Option<Pos>,
    pub kind: String,
    pub kind_pos: Option<Pos>,
    pub inputs: Vec<(String, Option<Pos>)>,
    pub inputs_pos: Option<Pos>,
    pub replicas: u32,
    pub replicas_pos: Option<Pos>,
    /// Process group; nodes sharing one run in the same OS process. Defaults to the node id.
    pub process: String,
    pub process_pos: Option<Pos>,
    /// How many times a request this node serves is resent to another replica after losing
    /// one (when its input type can be resumed).
    pub migration_limit: u32,
    /// The model this node serves (a name in `models:`); unset, the model of its inputs, or the
    /// graph's only model.
    pub model: Option<(String, Option<Pos>)>,
    /// The kind's own config; an empty mapping when absent.
    pub config: Node,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HeaderRaw {
    // Optional here so a missing name is reported beside the other errors (an unknown
    // top-level key is often a misspelt `name`).
    #[serde(default)]
    name: Option<Spanned<String>>,
    #[serde(default)]
    namespace: Option<Spanned<String>>,
    #[serde(default)]
    planes: Option<PlanesRaw>,
    #[serde(default)]
    model: Option<ModelSpec>,
    #[serde(default)]
    models: Option<Spanned<Vec<ModelSpec>>>,
    #[allow(dead_code)] // walked by hand below, to keep each node's config as a marked node
    nodes: serde::de::IgnoredAny,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanesRaw {
    #[serde(default)]
    control: Option<Spanned<String>>,
    #[serde(default)]
    events: Option<Spanned<String>>,
    #[serde(default)]
    transfer: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeRaw {
    kind: Spanned<String>,
    #[serde(default)]
    inputs: Option<Spanned<Vec<Spanned<String>>>>,
    #[serde(default)]
    replicas: Option<Spanned<u32>>,
    #[serde(default)]
    process: Option<Spanned<String>>,
    #[serde(default)]
    migration_limit: Option<Spanned<u32>>,
    #[serde(default)]
    model: Option<Spanned<String>>,
    #[allow(dead_code)] // taken as a marked node, parsed later by the node's kind
    #[serde(default)]
    config: Option<serde::de::IgnoredAny>,
}

/// Names of the node-level fields; `--set NODE.KEY=V` with any other key edits the config.
pub const NODE_FIELDS: &[&str] = &[
    "kind",
    "inputs",
    "replicas",
    "process",
    "migration_limit",
    "model",
    "config",
];

/// Sections of the graph itself that `--set SECTION.KEY=V` edits (`--set model.path=…`);
/// nodes cannot take these names.
pub const HEADER_SECTIONS: &[&str] = &["model", "planes"];

/// Resends after a lost replica, unless a node says otherwise (Dynamo's default too).
pub const DEFAULT_MIGRATION_LIMIT: u32 = 3;

fn pos_of<T>(s: &Spanned<T>) -> Option<Pos> {
    Pos::of_span(s.span())
}

/// Turn a serde error from `marked-yaml` into a diagnostic at the value it names.
pub(crate) fn from_node_diag(
    err: &marked_yaml::FromNodeError,
    fallback: Option<Pos>,
) -> (Option<Pos>, String) {
    let pos = err.start_mark().map(|m| Pos::of_marker(&m)).or(fallback);
    let inner = lower_first(&(**err).to_string());
    let msg = match (&**err, err.path()) {
        // The message already names the field.
        (marked_yaml::Error::UnknownFieldError(..), _) | (_, None) => inner,
        (_, Some(path)) => format!("field `{path}`: {inner}"),
    };
    (pos, msg)
}

fn lower_first(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(c) => c.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

/// An override given on the command line as `NODE.KEY=VALUE` (KEY may be dotted for nested
/// config keys; `replicas`, `process` and `inputs` set the node's own fields).
#[derive(Debug, Clone)]
pub struct Override {
    pub node: String,
    pub path: Vec<String>,
    pub value: String,
}

impl std::str::FromStr for Override {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (lhs, value) = s
            .split_once('=')
            .ok_or_else(|| format!("`{s}`: expected NODE.KEY=VALUE"))?;
        let mut parts = lhs.split('.').map(str::to_owned);
        let node = parts.next().unwrap_or_default();
        let path: Vec<String> = parts.collect();
        if node.is_empty() || path.is_empty() || path.iter().any(String::is_empty) {
            return Err(format!("`{s}`: expected NODE.KEY=VALUE"));
        }
        Ok(Override {
            node,
            path,
            value: value.to_owned(),
        })
    }
}

impl std::fmt::Display for Override {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "--set {}.{}={}",
            self.node,
            self.path.join("."),
            self.value
        )
    }
}

/// Read and load a graph file. Errors come back as diagnostics naming the file.
/// `Err` when nothing more can be checked (unreadable file, YAML syntax, bad top level).
/// Otherwise the spec comes with the diagnostics found so far (naming the file and each
/// override), for the compiler to add to: a broken node does not hide errors elsewhere.
pub fn load(path: &Path, overrides: &[Override]) -> Result<(GraphSpec, Diagnostics), Diagnostics> {
    let name = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => load_str(&name, &text, overrides),
        Err(e) => {
            let mut d = Diagnostics::new(name);
            d.push(Diagnostic::error(
                None,
                None,
                format!("cannot read graph: {e}"),
            ));
            Err(d)
        }
    }
}

fn loader_options() -> LoaderOptions {
    LoaderOptions::default().error_on_duplicate_keys(true)
}

fn parse(source: usize, text: &str) -> Result<Node, Diagnostic> {
    marked_yaml::parse_yaml_with_options(source, text, loader_options()).map_err(|e| {
        let (pos, msg) = load_error(&e);
        Diagnostic::error(pos, None, msg)
    })
}

fn load_error(e: &marked_yaml::LoadError) -> (Option<Pos>, String) {
    use marked_yaml::LoadError as E;
    match e {
        E::TopLevelMustBeMapping(m) => (
            Some(Pos::of_marker(m)),
            "a graph file must be a YAML mapping".into(),
        ),
        E::TopLevelMustBeSequence(m) => {
            (Some(Pos::of_marker(m)), "expected a YAML sequence".into())
        }
        E::UnexpectedAnchor(m) => (
            Some(Pos::of_marker(m)),
            "YAML anchors and aliases are not supported".into(),
        ),
        E::MappingKeyMustBeScalar(m) => (
            Some(Pos::of_marker(m)),
            "mapping keys must be plain scalars".into(),
        ),
        E::UnexpectedTag(m) => (
            Some(Pos::of_marker(m)),
            "YAML tags are not supported".into(),
        ),
        E::ScanError(m, err) => (
            Some(Pos::of_marker(m)),
            format!("YAML syntax error: {}", err.info()),
        ),
        E::DuplicateKey(inner) => (
            inner.key.span().start().map(Pos::of_marker),
            format!("duplicate key `{}`", inner.key.as_str()),
        ),
        // `LoadError` is non-exhaustive upstream.
        #[allow(unreachable_patterns)]
        other => (None, other.to_string()),
    }
}

/// Load a graph from text; `file` is only used to name it in diagnostics.
pub fn load_str(
    file: &str,
    text: &str,
    overrides: &[Override],
) -> Result<(GraphSpec, Diagnostics), Diagnostics> {
    let mut diags = Diagnostics::new(file);
    for o in overrides {
        diags.sources.push(o.to_string());
    }
    let mut root = match parse(0, text) {
        Ok(root) => root,
        Err(d) => {
            diags.push(d);
            return Err(diags);
        }
    };
    for (i, o) in overrides.iter().enumerate() {
        if let Err(d) = apply_override(&mut root, i + 1, o) {
            diags.push(d);
        }
    }
    let sections = take_sections(&mut root);
    let Some(mut spec) = header(&root, sections, &mut diags) else {
        return Err(diags);
    };
    let Some(nodes) = root.as_mapping().and_then(|m| m.get_node("nodes")) else {
        return Ok((spec, diags));
    };
    let Some(nodes) = nodes.as_mapping() else {
        diags.push(Diagnostic::error(
            Pos::of_span(nodes.span()),
            None,
            "`nodes` must be a mapping from node id to node",
        ));
        return Err(diags);
    };
    for (key, value) in nodes.iter() {
        let id = key.as_str().to_owned();
        let pos = Pos::of_span(key.span());
        check_node_id(&id, pos, &mut diags);
        match node(id.clone(), pos, value) {
            Ok(n) => spec.nodes.push(n),
            Err(d) => {
                diags.push(d);
                spec.broken.push(id);
            }
        }
    }
    Ok((spec, diags))
}

/// Take the top-level sections out of the tree before the header is parsed with
/// `deny_unknown_fields`; the compiler reports the ones no registered config claims.
fn take_sections(root: &mut Node) -> Vec<SectionSpec> {
    let mut sections = Vec::new();
    if let Some(map) = root.as_mapping_mut() {
        let names: Vec<(String, Option<Pos>)> = map
            .keys()
            .filter(|k| !HEADER_KEYS.contains(&k.as_str()))
            .map(|k| (k.as_str().to_owned(), Pos::of_span(k.span())))
            .collect();
        for (name, pos) in names {
            if let Some(node) = map.remove(name.as_str()) {
                sections.push(SectionSpec { name, pos, node });
            }
        }
    }
    sections
}

/// The graph's own keys (`name`, `namespace`, `planes`, `model`), with no nodes yet; `None`
/// when the header cannot be read at all.
fn header(root: &Node, sections: Vec<SectionSpec>, diags: &mut Diagnostics) -> Option<GraphSpec> {
    let root_pos = Pos::of_span(root.span());
    let header = match marked_yaml::from_node::<HeaderRaw>(root) {
        Ok(h) => h,
        Err(e) => {
            let (pos, msg) = from_node_diag(&e, root_pos);
            diags.push(Diagnostic::error(pos, None, msg));
            return None;
        }
    };
    let planes = header.planes.unwrap_or(PlanesRaw {
        control: None,
        events: None,
        transfer: None,
    });
    let plane = |p: Option<Spanned<String>>| match p {
        Some(s) => (s.to_string(), pos_of(&s)),
        None => ("embedded".to_owned(), None),
    };
    let name = match &header.name {
        Some(n) => n.to_string(),
        None => {
            diags.push(Diagnostic::error(root_pos, None, "missing field `name`"));
            String::new()
        }
    };
    let models = match (header.model, header.models) {
        (Some(_), Some(list)) => {
            diags.push(Diagnostic::error(
                pos_of(&list),
                None,
                "give `model` (one) or `models` (several), not both",
            ));
            Vec::new()
        }
        (Some(m), None) => vec![m],
        (None, Some(list)) => {
            let at = pos_of(&list);
            let list: Vec<ModelSpec> = (*list).clone();
            if list.is_empty() {
                diags.push(Diagnostic::error(at, None, "`models` lists no model"));
            }
            for (i, m) in list.iter().enumerate() {
                if list[..i].iter().any(|o| o.name == m.name) {
                    diags.push(Diagnostic::error(
                        at,
                        None,
                        format!("models: `{}` is named twice", m.name),
                    ));
                }
                // A request's `model` picks a base model or an adapter: one name, one meaning.
                for other in &list[..i] {
                    for name in m.loras.keys().filter(|n| other.loras.contains_key(*n)) {
                        diags.push(Diagnostic::error(
                            at,
                            None,
                            format!(
                                "models: adapter `{name}` is named in `{}` and `{}`",
                                other.name, m.name
                            ),
                        ));
                    }
                }
                for other in &list {
                    if other.loras.contains_key(&m.name) {
                        diags.push(Diagnostic::error(
                            at,
                            None,
                            format!(
                                "models: `{}` is a model and an adapter of `{}`",
                                m.name, other.name
                            ),
                        ));
                    }
                }
            }
            list
        }
        (None, None) => Vec::new(),
    };
    for problem in models.iter().flat_map(ModelSpec::lora_problems) {
        diags.push(Diagnostic::error(root_pos, None, problem));
    }
    Some(GraphSpec {
        name,
        namespace: header
            .namespace
            .map(|n| n.to_string())
            .unwrap_or_else(|| "dyn".to_owned()),
        planes: PlanesSpec {
            control: plane(planes.control),
            events: plane(planes.events),
            transfer: match planes.transfer {
                Some(s) => (s.to_string(), pos_of(&s)),
                None => ("auto".to_owned(), None),
            },
        },
        models,
        nodes: Vec::new(),
        sections,
        broken: Vec::new(),
    })
}

/// Node ids name processes, metrics and discovery keys: letters, digits, `_` and `-`, and
/// not the name of one of the graph's sections (`--set model.…` would be ambiguous).
fn check_node_id(id: &str, pos: Option<Pos>, diags: &mut Diagnostics) {
    if id.is_empty()
        || !id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        diags.push(Diagnostic::error(
            pos,
            Some(id),
            "node ids may use only letters, digits, `_` and `-`",
        ));
    }
    if HEADER_SECTIONS.contains(&id) {
        diags.push(Diagnostic::error(
            pos,
            Some(id),
            format!("`{id}` names a section of the graph (`--set {id}.KEY=…` edits it); choose another node id"),
        ));
    }
}

/// One node as written; its `config:` is kept as a marked node for its kind's config type.
fn node(id: String, pos: Option<Pos>, value: &Node) -> Result<NodeSpec, Diagnostic> {
    let raw = marked_yaml::from_node::<NodeRaw>(value).map_err(|e| {
        let (p, msg) = from_node_diag(&e, pos);
        Diagnostic::error(p, Some(&id), msg)
    })?;
    let config = value
        .as_mapping()
        .and_then(|m| m.get_node("config"))
        .cloned()
        .unwrap_or_else(|| {
            Node::Mapping(marked_yaml::types::MarkedMappingNode::new_empty(
                *value.span(),
            ))
        });
    let (inputs, inputs_pos) = match raw.inputs {
        Some(list) => {
            let p = pos_of(&list);
            (list.iter().map(|i| (i.to_string(), pos_of(i))).collect(), p)
        }
        None => (Vec::new(), None),
    };
    Ok(NodeSpec {
        pos,
        kind: raw.kind.to_string(),
        kind_pos: pos_of(&raw.kind),
        inputs,
        inputs_pos,
        replicas: raw.replicas.as_ref().map_or(1, |r| **r),
        replicas_pos: raw.replicas.as_ref().and_then(pos_of),
        process: raw
            .process
            .as_ref()
            .map_or_else(|| id.clone(), |p| p.to_string()),
        process_pos: raw.process.as_ref().and_then(pos_of),
        migration_limit: raw
            .migration_limit
            .as_ref()
            .map_or(DEFAULT_MIGRATION_LIMIT, |m| **m),
        model: raw.model.as_ref().map(|m| (m.to_string(), pos_of(m))),
        config,
        id,
    })
}

/// Write one `--set` into the YAML tree before anything reads it, so the value is checked
/// exactly as if it had been in the file (and diagnostics point at the `--set`).
fn apply_override(root: &mut Node, source: usize, o: &Override) -> Result<(), Diagnostic> {
    let err = |msg: String| {
        Diagnostic::error(
            Some(Pos {
                source,
                line: 1,
                col: 1,
            }),
            Some(&o.node),
            msg,
        )
    };
    // Parse the value as YAML so `--set echo.delay_ms=5` is a number and `[a, b]` a list.
    let doc = parse(source, &format!("v: {}", o.value)).map_err(|d| Diagnostic {
        node: Some(o.node.clone()),
        ..d
    })?;
    let value = doc
        .as_mapping()
        .and_then(|m| m.get_node("v"))
        .cloned()
        .ok_or_else(|| err("empty value".into()))?;
    let span = marked_yaml::Span::new_start(marked_yaml::Marker::new(source, 0, 1, 1));
    let mut path: Vec<&str> = o.path.iter().map(String::as_str).collect();
    let Some(first) = path.first() else {
        return Err(err("expected NODE.KEY=VALUE".into()));
    };
    let root = root
        .as_mapping_mut()
        .ok_or_else(|| err("a graph file must be a YAML mapping".into()))?;
    let is_node = root
        .get_node("nodes")
        .and_then(Node::as_mapping)
        .is_some_and(|m| m.get_node(o.node.as_str()).is_some());
    let is_section = !is_node
        && !HEADER_KEYS.contains(&o.node.as_str())
        && root.get_node(o.node.as_str()).is_some();
    let node = if HEADER_SECTIONS.contains(&o.node.as_str()) || is_section {
        // The graph's own sections (`model.path`, `planes.control`), made if absent, and the
        // registered sections the file has (`planner.ttft_ms`).
        let k = marked_yaml::types::MarkedScalarNode::new(span, o.node.as_str());
        root.entry(k)
            .or_insert_with(|| {
                Node::Mapping(marked_yaml::types::MarkedMappingNode::new_empty(span))
            })
            .as_mapping_mut()
            .ok_or_else(|| err(format!("`{}` is not a mapping", o.node)))?
    } else {
        if !NODE_FIELDS.contains(first) {
            path.insert(0, "config");
        }
        root.get_mut("nodes")
            .and_then(Node::as_mapping_mut)
            .and_then(|m| m.get_mut(o.node.as_str()))
            .and_then(Node::as_mapping_mut)
            .ok_or_else(|| err(format!("no node '{}' to override", o.node)))?
    };
    let mut map = node;
    let last = path.len() - 1;
    for (i, key) in path.iter().enumerate() {
        let k = marked_yaml::types::MarkedScalarNode::new(span, *key);
        if i == last {
            map.insert(k, value);
            return Ok(());
        }
        let entry = map.entry(k).or_insert_with(|| {
            Node::Mapping(marked_yaml::types::MarkedMappingNode::new_empty(span))
        });
        map = entry
            .as_mapping_mut()
            .ok_or_else(|| err(format!("`{key}` is not a mapping")))?;
    }
    Ok(())
}
