//! Introspection of running nodes, behind `dyn inspect`.
//!
//! A node that has state worth showing (a router's view of its workers and their caches)
//! registers itself here at build time with [`Inspectables::register`]; an ingress exposes
//! the registry on an admin endpoint. Queries are named and take and return JSON, so the
//! registry knows no node kind and the CLI only has to know the queries of the kinds it shows.
//! Entries are weak: a node that is dropped disappears from the registry.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};

use parking_lot::RwLock;
use serde_json::Value;

use crate::build::{BuildCx, BuildError, Service};

/// A node that answers introspection queries.
pub trait Inspect: Send + Sync + 'static {
    /// Answer `query` given `args`; `Err` with a message for an unknown query or bad args.
    fn inspect(&self, query: &str, args: &Value) -> Result<Value, String>;
}

/// The inspectable nodes of one graph run: a [`Service`] every kind reaches through
/// [`crate::BuildCx::service`].
#[derive(Default)]
pub struct Inspectables {
    nodes: RwLock<BTreeMap<String, Vec<Weak<dyn Inspect>>>>,
}

impl Service for Inspectables {
    async fn start(_cx: &BuildCx) -> Result<Self, BuildError> {
        Ok(Self::default())
    }
}

impl Inspectables {
    /// Register one replica of `node`; it stays listed while `target` lives.
    pub fn register(&self, node: &str, target: &Arc<dyn Inspect>) {
        self.nodes
            .write()
            .entry(node.to_owned())
            .or_default()
            .push(Arc::downgrade(target));
    }

    /// Names of the nodes with at least one live replica.
    pub fn nodes(&self) -> Vec<String> {
        self.nodes
            .read()
            .iter()
            .filter(|(_, v)| v.iter().any(|w| w.strong_count() > 0))
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// The live replicas of `node`.
    pub fn get(&self, node: &str) -> Vec<Arc<dyn Inspect>> {
        self.nodes
            .read()
            .get(node)
            .map(|v| v.iter().filter_map(Weak::upgrade).collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo;
    impl Inspect for Echo {
        fn inspect(&self, query: &str, args: &Value) -> Result<Value, String> {
            Ok(serde_json::json!({"query": query, "args": args}))
        }
    }

    #[test]
    fn registered_nodes_answer_while_alive() {
        let reg = Inspectables::default();
        let a: Arc<dyn Inspect> = Arc::new(Echo);
        reg.register("route", &a);
        assert_eq!(reg.nodes(), ["route"]);
        let answer = reg.get("route")[0].inspect("x", &Value::Null).unwrap();
        assert_eq!(answer["query"], "x");
        drop(a);
        assert!(reg.nodes().is_empty());
        assert!(reg.get("route").is_empty());
    }
}
