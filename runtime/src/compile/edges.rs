//! The passes over the graph's wiring: `inputs` name real nodes, once each, with payload
//! types that agree on both ends; nodes named in configs exist (calls); each node feeds one
//! node but for the two choosers (an ingress by model, a router among pools); no cycles.

use super::{Compiler, input_type, output_type};
use crate::diag::{Diagnostic, Diagnostics, Pos};
use crate::spec::GraphSpec;
use dyn_core::registry::Role;

impl Compiler<'_> {
    /// Inputs name real nodes, once each, and payload types agree on both ends.
    pub(super) fn link_edges(&mut self) {
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
    pub(super) fn resolve_calls(&mut self) {
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
    pub(super) fn check_fan_out(&mut self) {
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

    pub(super) fn check_cycles(&mut self) {
        report_cycles(self.spec, &self.inputs, &mut self.diags);
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
