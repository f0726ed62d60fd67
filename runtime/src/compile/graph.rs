//! What the compiler hands on: the checked graph (its nodes, each with its kind, config,
//! inputs, replicas, process and model; the paths each ingress's requests take; the parsed
//! sections and the warnings), which the planner and the runtime read.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use super::PlaneAddr;
use crate::diag::Diagnostics;
use crate::spec::ModelSpec;
use dyn_core::registry::{AnySection, DynConfig, Kind, SectionConfig};

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
    /// The model it serves (a name in [`CompiledGraph::models`]), if the graph has any.
    pub model: Option<String>,
}

/// A path an ingress's requests take: `path` in call order, the last one answers. An ingress
/// has one path per model it serves (each request goes down its model's); a router may feed
/// several worker nodes, pools of one model, choosing one per request (`pools`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainPath {
    pub ingress: usize,
    /// The model of this path's requests, if the graph names models.
    pub model: Option<String>,
    /// The hops; where a router chooses among pools, the first pool.
    pub path: Vec<usize>,
    /// Hops whose node a router chooses per request: position in `path` → every pool there
    /// (`path[position]` first).
    pub pools: BTreeMap<usize, Vec<usize>>,
}

impl ChainPath {
    /// Every node a request of this path may visit: the hops and the other pools.
    pub fn nodes(&self) -> impl Iterator<Item = usize> + '_ {
        self.path
            .iter()
            .enumerate()
            .flat_map(|(at, &i)| match self.pools.get(&at) {
                Some(all) => all.clone(),
                None => vec![i],
            })
    }
}

/// A checked graph, ready to plan and run.
#[derive(Clone)]
pub struct CompiledGraph {
    pub name: String,
    pub namespace: String,
    pub control: PlaneAddr,
    pub events: PlaneAddr,
    /// How KV blocks move between its processes (`planes.transfer`).
    pub transfer: dyn_core::planes::TransferWire,
    /// The models the graph serves (`model:`, or `models:`).
    pub models: Vec<ModelSpec>,
    pub base_dir: PathBuf,
    pub nodes: Vec<CompiledNode>,
    pub chains: Vec<ChainPath>,
    /// Parsed sections (`planner:`), by name; see [`dyn_core::registry::SectionConfig`].
    pub sections: BTreeMap<String, AnySection>,
    /// Warnings (never errors) found while compiling.
    pub warnings: Diagnostics,
}

impl CompiledGraph {
    pub fn node(&self, id: &str) -> Option<&CompiledNode> {
        self.nodes.iter().find(|n| n.id == id)
    }

    /// The model named `name`.
    pub fn model(&self, name: &str) -> Option<&ModelSpec> {
        self.models.iter().find(|m| m.name == name)
    }

    /// The graph's section of type `C`, if the file has one.
    pub fn section<C: SectionConfig>(&self) -> Option<&C> {
        self.sections.get(C::NAME)?.downcast_ref::<C>()
    }
}
