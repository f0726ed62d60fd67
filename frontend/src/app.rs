//! The state every HTTP handler is given ([`App`]): the graph's request chain, the models
//! served and how their answers are parsed ([`Served`]), the LoRA catalog, the planner's view
//! of the traffic and the Responses store. The `http` ingress ([`crate::http`]) builds it;
//! the dialects and the pipeline read it, so it lives apart from both.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use dyn_core::Chain;
use dyn_core::planes::{Bucket, KeyValue};
use dyn_llm::preprocess::Preprocess;
use dyn_planner::stats::FrontendStats;
use dyn_protocol::types::{LlmDelta, LlmRequest};

use crate::ServerConfig;
use crate::lora::Catalog;
use crate::reasoning::ReasoningFormat;
use crate::tools::ToolFormat;

/// One base model the ingress serves: how its answers are parsed (configured, or detected
/// from its chat template).
pub(crate) struct Served {
    pub(crate) name: Arc<str>,
    pub(crate) tool_format: ToolFormat,
    pub(crate) reasoning: Option<ReasoningFormat>,
    /// Its tokenizer and template (`/tokenize`, `/detokenize`).
    pub(crate) preprocess: Arc<Preprocess>,
}

pub(crate) type AppChain = Chain<LlmRequest, LlmDelta>;

#[derive(Clone)]
pub(crate) struct App {
    pub(crate) chain: AppChain,
    /// The models served, in the catalog's order.
    pub(crate) served: Arc<[Served]>,
    pub(crate) created: u64,
    /// The planner's view of this frontend's traffic.
    pub(crate) stats: Arc<FrontendStats>,
    /// The shared server settings (the request deadline's default).
    pub(crate) server: Arc<ServerConfig>,
    /// The models and their LoRA adapters: which `model` names run what.
    pub(crate) catalog: Arc<Catalog>,
    /// Where the Responses API keeps what it stores.
    pub(crate) responses: Store,
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Where the Responses API keeps what it stores (its handlers are `crate::responses`').
#[derive(Clone)]
pub(crate) struct Store {
    pub kv: Arc<dyn KeyValue>,
    pub bucket: Bucket,
}
