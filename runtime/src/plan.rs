//! The plan: which nodes share a process, how many replicas, which edges leave a process.
//!
//! A plan is pure data derived from a [`CompiledGraph`]; `dyn graph plan` renders it as text,
//! JSON, Graphviz DOT or Mermaid, and the runtime uses the same process grouping to decide what
//! to start.

use std::fmt::Write as _;

use serde::Serialize;

use crate::compile::{CompiledGraph, PlaneAddr, output_type};
use dyn_core::registry::{Ports, Role};

#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub graph: String,
    pub namespace: String,
    pub control: String,
    pub events: String,
    /// True when every plane is embedded: `dyn graph up` runs all processes in one.
    pub embedded: bool,
    pub processes: Vec<ProcessPlan>,
    pub nodes: Vec<NodePlan>,
    pub edges: Vec<EdgePlan>,
    pub paths: Vec<PathPlan>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ProcessPlan {
    pub name: String,
    pub replicas: u32,
    pub nodes: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct NodePlan {
    pub id: String,
    pub kind: String,
    pub role: Role,
    pub process: String,
    pub replicas: u32,
    pub input: Option<&'static str>,
    pub output: &'static str,
}

#[derive(Debug, Clone, Serialize)]
pub struct EdgePlan {
    pub from: String,
    pub to: String,
    pub payload: &'static str,
    pub crosses_process: bool,
    /// Wire format used when the edge crosses a process (`json`), if the type has one.
    pub wire: Option<&'static str>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PathPlan {
    pub ingress: String,
    /// The model its requests are for, where the graph names models.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Node ids in call order; a hop where a router chooses among pools is `a|b`.
    pub path: Vec<String>,
}

impl PathPlan {
    /// The node that answers (the first pool where pools end the path).
    fn last(&self) -> Option<&str> {
        self.path.last().and_then(|h| h.split('|').next())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Text,
    Json,
    Dot,
    Mermaid,
}

impl Plan {
    pub fn new(g: &CompiledGraph) -> Plan {
        // In the order the file first names each process.
        let mut processes: Vec<ProcessPlan> = Vec::new();
        for n in &g.nodes {
            match processes.iter_mut().find(|p| p.name == n.process) {
                Some(p) => p.nodes.push(n.id.clone()),
                None => processes.push(ProcessPlan {
                    name: n.process.clone(),
                    replicas: n.replicas,
                    nodes: vec![n.id.clone()],
                }),
            }
        }
        let nodes = g
            .nodes
            .iter()
            .map(|n| {
                let input = match n.kind.ports {
                    Ports::Operator { input, .. } => Some(input.name),
                    Ports::Ingress { .. } => None,
                };
                NodePlan {
                    id: n.id.clone(),
                    kind: n.kind.name.to_owned(),
                    role: n.kind.role,
                    process: n.process.clone(),
                    replicas: n.replicas,
                    input,
                    output: output_type(&n.kind).name,
                }
            })
            .collect();
        let mut edges = Vec::new();
        for n in &g.nodes {
            for &i in &n.inputs {
                let up = &g.nodes[i];
                let ty = output_type(&up.kind);
                edges.push(EdgePlan {
                    from: up.id.clone(),
                    to: n.id.clone(),
                    payload: ty.name,
                    crosses_process: up.process != n.process,
                    wire: ty.codec.map(|c| c.format),
                });
            }
        }
        let paths = g
            .chains
            .iter()
            .map(|c| PathPlan {
                ingress: g.nodes[c.ingress].id.clone(),
                model: c.model.clone(),
                path: c
                    .path
                    .iter()
                    .enumerate()
                    .map(|(at, &i)| match c.pools.get(&at) {
                        Some(all) => all
                            .iter()
                            .map(|&p| g.nodes[p].id.as_str())
                            .collect::<Vec<_>>()
                            .join("|"),
                        None => g.nodes[i].id.clone(),
                    })
                    .collect(),
            })
            .collect();
        Plan {
            graph: g.name.clone(),
            namespace: g.namespace.clone(),
            control: g.control.to_string(),
            events: g.events.to_string(),
            embedded: g.control == PlaneAddr::Embedded && g.events == PlaneAddr::Embedded,
            processes,
            nodes,
            edges,
            paths,
        }
    }

    pub fn render(&self, format: Format) -> String {
        match format {
            Format::Text => self.text(),
            Format::Json => serde_json::to_string_pretty(self).unwrap_or_default() + "\n",
            Format::Dot => self.dot(),
            Format::Mermaid => self.mermaid(),
        }
    }

    fn node(&self, id: &str) -> Option<&NodePlan> {
        self.nodes.iter().find(|n| n.id == id)
    }

    fn text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "graph {} (namespace {})", self.graph, self.namespace);
        let _ = writeln!(s, "planes: control={} events={}", self.control, self.events);
        let _ = writeln!(
            s,
            "mode: {}",
            if self.embedded {
                "embedded (every process group runs inside one OS process)"
            } else {
                "distributed (one OS process per process replica)"
            }
        );
        let _ = writeln!(s, "\nprocesses:");
        for p in &self.processes {
            let nodes: Vec<String> = p
                .nodes
                .iter()
                .filter_map(|id| self.node(id))
                .map(|n| format!("{} ({}, {})", n.id, n.kind, n.role))
                .collect();
            let _ = writeln!(s, "  {} ×{}: {}", p.name, p.replicas, nodes.join(", "));
        }
        let _ = writeln!(s, "\nedges:");
        for e in &self.edges {
            let cross = if e.crosses_process {
                format!("  [crosses process, wire: {}]", e.wire.unwrap_or("none"))
            } else {
                String::new()
            };
            let _ = writeln!(s, "  {} → {}: {}{cross}", e.from, e.to, e.payload);
        }
        let _ = writeln!(s, "\nrequest paths:");
        for p in &self.paths {
            let back = p
                .last()
                .and_then(|id| self.node(id))
                .map(|n| n.output)
                .unwrap_or("?");
            let model = p
                .model
                .as_ref()
                .map_or(String::new(), |m| format!(" (model {m})"));
            let _ = writeln!(
                s,
                "  {} → {} ⇒ {} answers with {back}{model}",
                p.ingress,
                p.path.join(" → "),
                p.ingress
            );
        }
        s
    }

    fn dot(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "digraph \"{}\" {{\n  rankdir=LR;\n  node [shape=box];",
            self.graph
        );
        for (i, p) in self.processes.iter().enumerate() {
            let _ = writeln!(
                s,
                "  subgraph cluster_{i} {{\n    label=\"process {} ×{}\";",
                p.name, p.replicas
            );
            for id in &p.nodes {
                if let Some(n) = self.node(id) {
                    let _ = writeln!(s, "    \"{}\" [label=\"{}\\n{}\"];", n.id, n.id, n.kind);
                }
            }
            let _ = writeln!(s, "  }}");
        }
        for e in &self.edges {
            let style = if e.crosses_process {
                ", style=bold"
            } else {
                ""
            };
            let _ = writeln!(
                s,
                "  \"{}\" -> \"{}\" [label=\"{}\"{style}];",
                e.from, e.to, e.payload
            );
        }
        for p in &self.paths {
            if let Some(last) = p.last() {
                let _ = writeln!(
                    s,
                    "  \"{last}\" -> \"{}\" [style=dashed, label=\"response\"];",
                    p.ingress
                );
            }
        }
        s.push_str("}\n");
        s
    }

    fn mermaid(&self) -> String {
        // Mermaid ids may not contain `-`; labels keep the real names.
        let mid = |id: &str| id.replace('-', "_");
        let mut s = String::from("flowchart LR\n");
        for p in &self.processes {
            let _ = writeln!(
                s,
                "  subgraph proc_{}[\"process {} ×{}\"]",
                mid(&p.name),
                p.name,
                p.replicas
            );
            for id in &p.nodes {
                if let Some(n) = self.node(id) {
                    let _ = writeln!(s, "    {}[\"{}<br/>{}\"]", mid(&n.id), n.id, n.kind);
                }
            }
            let _ = writeln!(s, "  end");
        }
        for e in &self.edges {
            let arrow = if e.crosses_process { "==>" } else { "-->" };
            let _ = writeln!(
                s,
                "  {} {arrow}|{}| {}",
                mid(&e.from),
                e.payload,
                mid(&e.to)
            );
        }
        for p in &self.paths {
            if let Some(last) = p.last() {
                let _ = writeln!(s, "  {} -.->|response| {}", mid(last), mid(&p.ingress));
            }
        }
        s
    }
}
