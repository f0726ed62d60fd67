//! dyn-operators: every operator kind a graph can name, and the registry that lists them.
//!
//! One module per kind. Kinds are registered explicitly in [`registry`]; a kind missing from
//! that list cannot be used in a graph.

pub mod decode;
pub mod echo;
pub mod http;
pub mod llm;
pub mod metrics;
pub use dyn_planner as planner;
pub mod prefill;

use dyn_pipeline::Registry;

/// The kinds this build of dyn knows.
pub fn registry() -> Registry {
    Registry::new()
        .ingress::<http::openai::HttpConfig>()
        .ingress::<http::text::HttpTextConfig>()
        .operator::<echo::EchoConfig>()
        .operator::<llm::preprocess::PreprocessConfig>()
        .operator::<llm::route::RouteConfig>()
        .operator::<llm::remote_prefill::RemotePrefillConfig>()
        .operator::<prefill::PrefillConfig>()
        .operator::<decode::DecodeConfig>()
        .operator::<llm::postprocess::PostprocessConfig>()
        .section::<planner::PlannerConfig>()
}
