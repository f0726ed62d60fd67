//! What chooses the worker: the policy the graph names, for `kv` the same object seen as the
//! index the workers' events feed ([`KvAware`]), and the counts of how well its choices used
//! the caches ([`Quality`]). The other parts say what it chooses among and from.

use std::sync::Arc;

use crate::RouteConfig;
use crate::kv_aware::KvAware;
use crate::policy::{Policy, RoutingPolicy};
use crate::quality::Quality;

/// A router's policy and what watches it.
pub(crate) struct Placement {
    pub policy: Arc<dyn RoutingPolicy>,
    /// The `kv` policy's index (the same object as `policy`), for feeding and inspection.
    pub kv: Option<Arc<KvAware>>,
    /// How well the `kv` policy uses the caches.
    pub quality: Quality,
}

impl Placement {
    /// The policy of `config` for the router of node `node`; `announced`: the block size the
    /// workers give in discovery, where `config` sets none.
    pub fn new(config: &RouteConfig, announced: Option<u32>, node: &str) -> Self {
        let kv = (config.policy == Policy::Kv).then(|| {
            Arc::new(KvAware::new(
                config.block_size.or(announced),
                config.pricing(),
            ))
        });
        let policy: Arc<dyn RoutingPolicy> = match &kv {
            Some(kv) => kv.clone(),
            None => config.policy.build_load_only().into(),
        };
        Self {
            policy,
            kv,
            quality: Quality::new(node),
        }
    }
}
