//! dyn-kinds: every operator kind a graph can name, and the registry that lists them.
//!
//! One module per kind. Kinds are registered explicitly in [`registry`]; a kind missing from
//! that list cannot be used in a graph.
//!
//! It owns only the glue: the `decode` and `prefill` kinds choose an engine (`dyn-engine`'s
//! mocker or native, or a `dyn-external` server) and `echo` debugs a graph. Everything else
//! lives in the crate that owns it; nothing but the `dyn` binary (and tests) should depend on
//! this crate. Like every kind crate it needs `dyn-core` alone, not `dyn-runtime`: whoever runs
//! the graph builds the kinds.

pub mod decode;
pub mod echo;
pub mod prefill;

use dyn_core::Registry;

/// The kinds this build of dyn knows.
pub fn registry() -> Registry {
    Registry::new()
        .ingress::<dyn_frontend::http::HttpConfig>()
        .ingress::<dyn_frontend::text::HttpTextConfig>()
        .operator::<echo::EchoConfig>()
        .operator::<dyn_llm::preprocess::PreprocessConfig>()
        .operator::<dyn_router::RouteConfig>()
        .operator::<dyn_router::remote_prefill::RemotePrefillConfig>()
        .operator::<prefill::PrefillConfig>()
        .operator::<decode::DecodeConfig>()
        .operator::<dyn_llm::postprocess::PostprocessConfig>()
        .section::<dyn_planner::PlannerConfig>()
}
