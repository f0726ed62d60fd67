//! The passes over what the file configures: each node's kind and config (parsed with
//! positions, then the kind's own `validate()` and the replica count a config implies), and
//! the top-level sections (`planner:`), checked against the nodes that compiled. What a
//! `validate()` finds is reported at the field it names.

use std::collections::BTreeMap;

use marked_yaml::Node;

use super::Compiler;
use crate::diag::{Diagnostic, Pos};
use crate::spec;
use dyn_core::registry::SectionNode;

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

impl Compiler<'_> {
    /// Known kind, config fields and types (serde, with positions), the kind's own
    /// `validate()`, replica counts.
    pub(super) fn parse_nodes(&mut self) {
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

    /// Top-level sections: a registered name, a config that parses, and its own checks
    /// against the nodes that compiled.
    pub(super) fn check_sections(&mut self) {
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
}
