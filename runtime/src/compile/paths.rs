//! The passes that follow requests: each ingress's paths, traced to a last node answering
//! its response type (through the pools a router chooses among, which must be workers
//! feeding the same node); the nodes no path reaches; and the roles along the way (a node
//! that forwards keeps its type, a router has a worker behind it).

use std::collections::BTreeMap;

use super::{ChainPath, Compiler, output_type};
use crate::diag::Diagnostic;
use dyn_core::registry::{Ports, Role};

impl Compiler<'_> {
    /// Every ingress reaches, down each path, a last node whose output is the ingress's
    /// response type; pools behind a router are workers that feed the same node.
    pub(super) fn trace_paths(&mut self) {
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

    /// A node no ingress reaches and no config calls is started but idle: worth a warning.
    pub(super) fn warn_unreached(&mut self) {
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
    pub(super) fn check_roles(&mut self) {
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
}
