//! The passes over the cut into processes: nodes sharing a process share its replica
//! count, an ingress has one replica, and a call that leaves the ingress's process carries
//! types with a wire codec.

use std::collections::BTreeMap;

use super::{Compiler, input_type, output_type};
use crate::diag::Diagnostic;

impl Compiler<'_> {
    /// Nodes sharing a process share its replica count; an ingress has one replica.
    pub(super) fn check_process_groups(&mut self) {
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
    pub(super) fn check_wire_codecs(&mut self) {
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
}
