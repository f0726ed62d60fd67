//! `http`: the HTTP ingress, and the one place its routes are mounted.
//!
//! Each dialect owns its handlers and how its bodies translate into an [`LlmRequest`]:
//! OpenAI's chat and completions ([`crate::openai`]), Responses ([`crate::responses`]),
//! Anthropic's Messages ([`crate::anthropic`]), embeddings ([`crate::embeddings`]), vLLM's
//! tokenizer routes ([`crate::tokenize`]) and the LoRA and operator routes
//! ([`crate::lora`], [`crate::admin`]). They share one pipeline ([`crate::pipeline`]) and one
//! [`App`], the state every handler is given. Here the ingress is built from the graph's
//! models and the routes are put together.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use dyn_core::{
    BuildCx, BuildError, Ingress, IngressConfig, Invalid, OpError, ReasoningParserName,
    ShutdownSignal,
};
use dyn_llm::model::ModelDir;
use dyn_llm::preprocess::Preprocess;
use dyn_planner::state::PlannerView;
use dyn_planner::stats::FrontendStats;
use dyn_protocol::types::{LlmDelta, LlmRequest};
use futures::FutureExt;
use futures::future::BoxFuture;
use serde::Deserialize;
use serde_json::Value;
use tokio::net::TcpListener;

use super::ServerConfig;
use super::admin::Admin;
use super::lora::{Adapters, Catalog};
use super::reasoning::ReasoningFormat;
use super::tools::ToolFormat;
use crate::app::{App, AppChain, Served, unix_now};

/// Only the shared server settings ([`ServerConfig`]: listen address, body limit, keys, traffic
/// headers).
#[derive(Debug, Clone, Deserialize)]
#[serde(transparent)]
pub struct HttpConfig {
    pub server: ServerConfig,
}

impl IngressConfig for HttpConfig {
    const KIND: &'static str = "http";
    const SUMMARY: &'static str = "OpenAI-compatible HTTP ingress: /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages (Anthropic), /v1/embeddings, /v1/models, /tokenize, /detokenize, /tokenizer_info, /metrics";
    type Ingress = Http;

    fn validate(&self) -> Vec<Invalid> {
        self.server.validate()
    }

    async fn build(&self, cx: &BuildCx) -> Result<Http, BuildError> {
        if cx.models.is_empty() {
            return Err(BuildError::new(
                "the http ingress serves the graph's model: add `model: {name, path}`",
            ));
        }
        let mut served = Vec::with_capacity(cx.models.len());
        let mut catalog = Vec::with_capacity(cx.models.len());
        let mut tokenizers = Vec::with_capacity(cx.models.len());
        for model in &cx.models {
            let dir = ModelDir::shared_spec(cx, model).await?;
            let adapters = Adapters::start(cx, model, dir.path.clone()).await?;
            let template = dir.chat_template.clone();
            let preprocess = Preprocess::new(dir)?;
            let (tool_format, reasoning) = formats(model, template.as_deref(), &preprocess)
                .map_err(|e| BuildError::new(format!("{}: {e}", model.name)))?;
            tracing::info!(node = %cx.node, model = %model.name, tools = ?tool_format, reasoning = ?reasoning, "Chat answers parsed");
            let preprocess = Arc::new(preprocess);
            tokenizers.push((model.name.clone(), preprocess.clone()));
            served.push(Served {
                name: model.name.as_str().into(),
                tool_format,
                reasoning,
                preprocess,
            });
            catalog.push(adapters);
        }
        let catalog = Arc::new(Catalog(catalog));
        let admin = Admin {
            inspect: cx.service::<dyn_core::Inspectables>().await?,
            events: cx.planes.events.clone(),
            namespace: cx.namespace.clone(),
            models: tokenizers,
            planner: cx.service::<PlannerView>().await?,
            catalog: catalog.clone(),
        };
        Ok(Http {
            listener: self.server.bind(&cx.node).await?,
            config: self.server.resolved()?,
            served: served.into(),
            admin,
            stats: cx.service::<FrontendStats>().await?,
            catalog,
            responses: crate::app::Store {
                kv: cx.planes.store.clone(),
                // Graphs sharing a NATS server keep apart by namespace.
                bucket: self.server.responses_store.bucket(format!(
                    "responses_{}",
                    cx.namespace.replace(
                        |c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'),
                        "_"
                    )
                )),
            },
        })
    }
}

/// How `model` writes tool calls and reasoning: the graph's word, else what its chat
/// template shows.
fn formats(
    model: &dyn_core::ModelSpec,
    template: Option<&str>,
    preprocess: &Preprocess,
) -> Result<(ToolFormat, Option<ReasoningFormat>), &'static str> {
    let tool_format = match (model.tool_parser, model.reasoning_parser) {
        (Some(n), _) => ToolFormat::from(n),
        (None, Some(ReasoningParserName::Harmony)) => ToolFormat::Harmony,
        (None, _) => ToolFormat::detect(template),
    };
    let harmony = tool_format == ToolFormat::Harmony;
    let reasoning = match model.reasoning_parser {
        // Harmony's reasoning is a channel, parsed with the calls.
        Some(ReasoningParserName::None | ReasoningParserName::Harmony) | None if harmony => None,
        Some(_) if harmony => {
            return Err(
                "reasoning_parser: a harmony model (tool_parser: harmony) reasons in its analysis channel; leave reasoning_parser out or set it to harmony",
            );
        }
        Some(ReasoningParserName::Harmony) => {
            return Err(
                "reasoning_parser: harmony is parsed together with its tool calls; set tool_parser: harmony too",
            );
        }
        Some(ReasoningParserName::None) => None,
        Some(ReasoningParserName::Qwen3) => Some(ReasoningFormat::Qwen3),
        Some(ReasoningParserName::DeepseekR1) => Some(ReasoningFormat::DeepseekR1),
        None => ReasoningFormat::detect(template, preprocess.generation_prompt().as_deref()),
    };
    Ok((tool_format, reasoning))
}

pub struct Http {
    listener: TcpListener,
    config: ServerConfig,
    /// The models served, in the catalog's order.
    served: Arc<[Served]>,
    admin: Admin,
    stats: Arc<FrontendStats>,
    catalog: Arc<Catalog>,
    responses: crate::app::Store,
}

impl Ingress for Http {
    type Request = LlmRequest;
    type Response = LlmDelta;

    fn serve(
        self: Box<Self>,
        chain: AppChain,
        shutdown: ShutdownSignal,
    ) -> BoxFuture<'static, Result<(), OpError>> {
        let state = App {
            chain: chain.clone(),
            served: self.served,
            created: unix_now(),
            stats: self.stats,
            server: Arc::new(self.config.clone()),
            catalog: self.catalog.clone(),
            responses: self.responses,
        };
        let api = axum::Router::new()
            .route("/v1/chat/completions", post(crate::openai::chat))
            .route("/v1/completions", post(crate::openai::completions))
            .route("/v1/models", get(models))
            .route("/tokenize", post(crate::tokenize::tokenize))
            .route("/detokenize", post(crate::tokenize::detokenize))
            .route("/tokenizer_info", get(crate::tokenize::tokenizer_info))
            .route("/v1/responses", post(super::responses::create))
            .route(
                "/v1/responses/{id}",
                get(super::responses::get).delete(super::responses::delete),
            )
            .route("/v1/embeddings", post(super::embeddings::create))
            .route("/v1/messages", post(super::anthropic::messages))
            .route(
                "/v1/messages/count_tokens",
                post(super::anthropic::count_tokens),
            )
            .with_state(state);
        // Operators' routes: behind `admin_key` (not the tenants' API keys), loopback only.
        let open = axum::Router::new()
            .route("/metrics", get(metrics))
            .merge(super::lora::routes(self.catalog))
            .merge(super::admin::router(self.admin));
        let app = super::app(&self.config, api, open);
        super::serve(self.listener, app, shutdown, chain).boxed()
    }
}

async fn metrics() -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        dyn_protocol::metrics::render(),
    )
        .into_response()
}

async fn models(State(app): State<App>) -> Json<Value> {
    app.catalog.models_body(app.created)
}
