//! `http`: the OpenAI-compatible ingress.
//!
//! `POST /v1/chat/completions` and `POST /v1/completions` (streaming as server-sent events
//! ending in `data: [DONE]`, or one JSON answer), `GET /v1/models`, vLLM's `POST /tokenize`
//! and `POST /detokenize`, `GET /health`, `GET /live` and `GET /metrics` (Prometheus). Requests are parsed here into an
//! [`LlmRequest`]; range checks on sampling parameters happen in `preprocess`, which knows the
//! model. A streaming response is committed only once the first delta (or an error) is back,
//! so a request the graph rejects still gets its 4xx status. A client that disconnects drops
//! the response stream, which kills the request's context, which reaches the engine.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use dyn_core::{
    BuildCx, BuildError, Chain, Ctx, Ingress, IngressConfig, Invalid, OpError, ReasoningParserName,
    ShutdownSignal,
};
use dyn_llm::model::ModelDir;
use dyn_llm::preprocess::Preprocess;
use dyn_planner::state::PlannerView;
use dyn_planner::stats::FrontendStats;
use dyn_protocol::types::{
    ChatMessage, Constraint, Endpoint, FinishReason, Limits, LlmDelta, LlmRequest, Prompt,
    Sampling, SlaTargets, TextLogprob, Usage,
};
use futures::future::BoxFuture;
use futures::{FutureExt, Stream, StreamExt};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;

use super::admin::Admin;
use super::lora::{Adapters, Catalog};
use super::reasoning::{ReasoningFormat, ReasoningParser};
use super::tools::{Piece, ToolCall, ToolFormat, ToolParser, ToolRequest};
use super::{ApiError, KeyTenant, ServerConfig, invalid};
use crate::metrics::FRONTEND;

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
            responses: super::responses::Store {
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
    responses: super::responses::Store,
}

/// One base model the ingress serves: how its answers are parsed (configured, or detected
/// from its chat template).
struct Served {
    name: Arc<str>,
    tool_format: ToolFormat,
    reasoning: Option<ReasoningFormat>,
    /// Its tokenizer and template (`/tokenize`, `/detokenize`).
    preprocess: Arc<Preprocess>,
}

type AppChain = Chain<LlmRequest, LlmDelta>;

#[derive(Clone)]
pub(crate) struct App {
    chain: AppChain,
    /// The models served, in the catalog's order.
    served: Arc<[Served]>,
    created: u64,
    /// The planner's view of this frontend's traffic.
    stats: Arc<FrontendStats>,
    /// The shared server settings (the request deadline's default).
    pub(crate) server: Arc<ServerConfig>,
    /// The models and their LoRA adapters: which `model` names run what.
    catalog: Arc<Catalog>,
    /// Where the Responses API keeps what it stores.
    pub(crate) responses: super::responses::Store,
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
            .route("/v1/chat/completions", post(chat))
            .route("/v1/completions", post(completions))
            .route("/v1/models", get(models))
            .route("/tokenize", post(tokenize))
            .route("/detokenize", post(detokenize))
            .route("/tokenizer_info", get(tokenizer_info))
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

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
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

// ---- request bodies ------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or a list of strings")]
enum StopIn {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Dynamo's request extensions (`nvext`): the ones read here.
#[derive(Debug, Default, Deserialize)]
struct NvExt {
    #[serde(default)]
    router: Option<RouterHints>,
}

/// `nvext.router`: the latency the client asks for, milliseconds; a router choosing among
/// pools picks one run for it.
#[derive(Debug, Default, Deserialize)]
struct RouterHints {
    ttft_target: Option<f64>,
    itl_target: Option<f64>,
}

/// Fields both endpoints share. Unknown fields are ignored, as OpenAI clients send many.
#[derive(Debug, Deserialize)]
struct Common {
    /// Optional where the server serves one model (vLLM and llama.cpp answer with it too).
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    nvext: Option<NvExt>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    /// vLLM's extension: keep the k most likely tokens; 0 or -1 keeps all.
    top_k: Option<i64>,
    seed: Option<u64>,
    stop: Option<StopIn>,
    /// vLLM's extension: token ids that end the output.
    stop_token_ids: Option<Vec<u32>>,
    /// vLLM's extension: `false` keeps special tokens in the text.
    skip_special_tokens: Option<bool>,
    /// vLLM's extension: scheduling priority, lower first.
    priority: Option<i32>,
    /// OpenAI's end-user id: the session, for session affinity, when no `x-session-id` says.
    user: Option<String>,
    /// vLLM's extension: requests share cached prefixes only with requests of the same salt.
    cache_salt: Option<Value>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    /// vLLM's extensions.
    repetition_penalty: Option<f32>,
    min_p: Option<f32>,
    /// Token id (as a string, OpenAI's form) → bias in [-100, 100].
    logit_bias: Option<BTreeMap<String, f32>>,
    /// vLLM's extension: the prompt's and the answer's token ids in the response.
    return_token_ids: Option<bool>,
    n: Option<u32>,
    /// Chat: `true` for the answer's log-probabilities; completions: how many alternatives.
    logprobs: Option<Value>,
    /// Chat: how many alternatives per token (with `logprobs: true`).
    top_logprobs: Option<Value>,
    ignore_eos: Option<bool>,
    min_tokens: Option<u32>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    /// Structured output: OpenAI's field, vLLM's, and vLLM's older `guided_*` fields.
    response_format: Option<Value>,
    structured_outputs: Option<Value>,
    guided_json: Option<Value>,
    guided_regex: Option<Value>,
    guided_choice: Option<Value>,
    guided_grammar: Option<Value>,
    /// Fields that change what a request means and that this server does not honour yet:
    /// refused by name, never dropped (an application that asks for a tool call or for JSON
    /// must not believe it got one).
    #[serde(flatten)]
    unsupported: BTreeMap<String, Value>,
}

/// The most choices one request may ask for (OpenAI allows 128; each is a sequence in the
/// engine).
const MAX_CHOICES: u32 = 16;
/// Prompts in one completions request, and choices over all of them, at most: each is a
/// request to the graph of its own.
const MAX_PROMPTS: usize = 64;

/// True for the values of a field that ask for nothing.
pub(crate) type AsksNothing = fn(&Value) -> bool;

/// The request fields [`refuse_unsupported`] looks at, each with the values that ask for
/// nothing (what clients send by default), so those still pass.
const UNSUPPORTED: &[(&str, AsksNothing)] = &[
    ("functions", empty),
    ("function_call", |v| {
        v.is_null() || v == "none" || v == "auto"
    }),
    // Completions: text after the insertion point, and choosing the best of several.
    ("suffix", |v| v.is_null() || v == ""),
    ("best_of", |v| v.is_null() || v.as_u64() == Some(1)),
    // What reasoning, audio and predicted-output models take (OpenAI refuses them for other
    // models too).
    ("reasoning_effort", Value::is_null),
    ("reasoning", Value::is_null),
    ("modalities", |v| {
        v.is_null() || *v == serde_json::json!(["text"])
    }),
    ("audio", Value::is_null),
    ("prediction", Value::is_null),
    ("web_search_options", Value::is_null),
    // vLLM's extensions that change the answer and are not built here.
    ("include_stop_str_in_output", |v| v.is_null() || *v == false),
    ("chat_template_kwargs", empty),
    ("add_generation_prompt", |v| v.is_null() || *v == true),
    ("continue_final_message", |v| v.is_null() || *v == false),
    ("prompt_logprobs", Value::is_null),
    ("truncate_prompt_tokens", Value::is_null),
    ("use_beam_search", |v| v.is_null() || *v == false),
    ("bad_words", empty),
    ("allowed_token_ids", empty),
    // Chat's echo (vLLM): only completions echo here.
    ("echo", |v| v.is_null() || *v == false),
];

/// Null, or an empty list or object.
pub(crate) fn empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}

/// A field from [`UNSUPPORTED`] that asks for something is a 400 naming it.
fn refuse_unsupported(fields: &BTreeMap<String, Value>) -> Result<(), ApiError> {
    refuse_fields(UNSUPPORTED, |name| fields.get(name))
}

/// A field of `list` that `get` finds asking for something is a 400 naming it (every
/// endpoint's fields that change an answer and are not built: refused, never dropped).
pub(crate) fn refuse_fields<'a>(
    list: &[(&str, AsksNothing)],
    get: impl Fn(&str) -> Option<&'a Value>,
) -> Result<(), ApiError> {
    for (name, asks_nothing) in list {
        if let Some(v) = get(name)
            && !asks_nothing(v)
        {
            return Err(ApiError::invalid(
                "unsupported_parameter",
                format!("`{name}` is not supported by this server yet"),
            )
            .with_param(*name));
        }
    }
    Ok(())
}

#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or a list of content parts")]
enum ContentIn {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Debug, Deserialize)]
struct MessageIn {
    role: String,
    content: Option<ContentIn>,
    /// An assistant turn's tool calls.
    #[serde(default)]
    tool_calls: Option<Value>,
    /// A tool result's call.
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
}

/// An assistant turn's `tool_calls` as chat templates read them: each call's `arguments`
/// parsed from OpenAI's JSON string into an object (as vLLM and transformers do).
fn template_calls(v: Value, i: usize) -> Result<Value, ApiError> {
    let Value::Array(calls) = v else {
        return Err(invalid(
            format!("messages[{i}].tool_calls"),
            "tool_calls must be a list",
        ));
    };
    let mut out = Vec::with_capacity(calls.len());
    for (j, mut call) in calls.into_iter().enumerate() {
        let f = &mut call["function"];
        if !f["name"].is_string() {
            return Err(invalid(
                format!("messages[{i}].tool_calls[{j}].function.name"),
                "a tool call needs its function's name",
            ));
        }
        if let Some(s) = f["arguments"].as_str() {
            f["arguments"] = serde_json::from_str(s).map_err(|e| {
                invalid(
                    format!("messages[{i}].tool_calls[{j}].function.arguments"),
                    format!("arguments must be a JSON text: {e}"),
                )
            })?;
        }
        out.push(call);
    }
    Ok(Value::Array(out))
}

#[derive(Debug, Deserialize)]
struct ChatBody {
    messages: Vec<MessageIn>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "a string, a list of strings, a list of token ids, or a list of lists of token ids"
)]
enum PromptIn {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    /// OpenAI's "array of token arrays" (lm-evaluation-harness sends its batches so).
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
struct CompletionBody {
    prompt: PromptIn,
    #[serde(default)]
    echo: bool,
    #[serde(flatten)]
    common: Common,
}

/// `nvext.router`'s targets, each a positive number of milliseconds.
fn targets(ext: Option<NvExt>) -> Result<SlaTargets, ApiError> {
    let hints = ext.and_then(|e| e.router).unwrap_or_default();
    let ms = |name: &str, v: Option<f64>| match v {
        Some(x) if !(x.is_finite() && x > 0.0) => Err(invalid(
            format!("nvext.router.{name}"),
            format!("{name} must be a positive number of milliseconds, got {x}"),
        )),
        _ => Ok(v),
    };
    Ok(SlaTargets {
        ttft_ms: ms("ttft_target", hints.ttft_target)?,
        itl_ms: ms("itl_target", hints.itl_target)?,
    })
}

/// The checks that need no model: the model name and parameters this server never supports.
fn request(
    app: &App,
    endpoint: Endpoint,
    prompt: Prompt,
    c: Common,
) -> Result<(LlmRequest, Options), ApiError> {
    let (at, lora) = app.catalog.resolve_or_only(c.model.as_deref())?;
    let model = &app.served[at];
    refuse_unsupported(&c.unsupported)?;
    super::check_metadata(c.unsupported.get("metadata"))?;
    let mut constraint = constraint(&c)?;
    // A harmony model answers in channels: the structured answer goes in its `final` channel,
    // after the reasoning the model may write first (a raw Lark grammar stays as written).
    let harmony = model.tool_format == ToolFormat::Harmony && endpoint == Endpoint::Chat;
    if harmony && let Some(expr) = constraint.as_ref().and_then(dyn_llm::grammar::lark_expr) {
        constraint = Some(Constraint::Lark(super::harmony::answer_grammar(&expr)));
    }
    let tools = ToolRequest::read(
        c.tools.as_ref(),
        c.tool_choice.as_ref(),
        c.parallel_tool_calls,
    )?;
    if tools.is_some() && endpoint == Endpoint::Completion {
        return Err(invalid("tools", "tools are for /v1/chat/completions"));
    }
    let forcing = tools.as_ref().is_some_and(ToolRequest::forcing);
    let parses = tools.as_ref().is_some_and(ToolRequest::parses);
    let forced = tools.as_ref().and_then(|t| t.forced(model.tool_format));
    if forcing && forced.is_none() {
        return Err(invalid(
            "tool_choice",
            format!(
                "this model writes tool calls in the {:?} format, which no grammar here can force; use tool_choice auto",
                model.tool_format
            ),
        ));
    }
    if let Some(forced) = forced {
        if constraint.is_some() {
            return Err(invalid(
                "tool_choice",
                "a forced tool call cannot be combined with response_format or structured_outputs",
            ));
        }
        constraint = Some(forced);
    }
    let n = c.n.unwrap_or(1);
    if !(1..=MAX_CHOICES).contains(&n) {
        return Err(invalid(
            "n",
            format!("n must be from 1 to {MAX_CHOICES}, got {n}"),
        ));
    }
    let logprobs = logprobs(endpoint, &c, app.server.max_logprobs)?;
    let constrained = constraint.is_some();
    let stop = match c.stop {
        None => Vec::new(),
        Some(StopIn::One(s)) => vec![s],
        Some(StopIn::Many(v)) => v,
    };
    let include_usage = c.stream_options.is_some_and(|o| o.include_usage);
    if include_usage && !c.stream {
        return Err(invalid(
            "stream_options",
            "stream_options is only allowed with stream: true",
        ));
    }
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => None,
        Some(k) => Some(u32::try_from(k).map_err(|_| {
            invalid(
                "top_k",
                format!("top_k must be -1, 0 or a positive count, got {k}"),
            )
        })?),
    };
    let in_range = |name: &str, v: Option<f32>, ok: std::ops::RangeInclusive<f32>| match v {
        Some(x) if !ok.contains(&x) => Err(invalid(
            name,
            format!(
                "{name} must be between {} and {}, got {x}",
                ok.start(),
                ok.end()
            ),
        )),
        _ => Ok(v),
    };
    let presence_penalty = in_range("presence_penalty", c.presence_penalty, -2.0..=2.0)?;
    let frequency_penalty = in_range("frequency_penalty", c.frequency_penalty, -2.0..=2.0)?;
    let min_p = in_range("min_p", c.min_p, 0.0..=1.0)?;
    let repetition_penalty = match c.repetition_penalty {
        Some(r) if !(r > 0.0 && r.is_finite()) => {
            return Err(invalid(
                "repetition_penalty",
                format!("repetition_penalty must be a positive number, got {r}"),
            ));
        }
        r => r,
    };
    let cache_salt = match c.cache_salt {
        None | Some(Value::Null) => None,
        Some(Value::String(salt)) => match dyn_protocol::types::cache_salt_problem(&salt) {
            Some(problem) => return Err(invalid("cache_salt", problem)),
            None => Some(salt),
        },
        Some(_) => return Err(invalid("cache_salt", "cache_salt must be a string")),
    };
    Ok((
        LlmRequest {
            endpoint,
            model: model.name.to_string(),
            prompt,
            sampling: Sampling {
                temperature: c.temperature,
                top_p: c.top_p,
                top_k,
                seed: c.seed,
                min_p,
                frequency_penalty,
                presence_penalty,
                repetition_penalty,
                logit_bias: logit_bias(c.logit_bias)?,
                logprobs,
                prompt_logprobs: None,
                constraint,
                priority: c.priority.unwrap_or(0),
                // The router's word, never the client's.
                yields: false,
                tenant: None,
                session: c
                    .user
                    .filter(|u| !u.is_empty() && u.len() <= super::SESSION_MAX),
                cache_salt,
                lora,
                targets: targets(c.nvext)?,
                embed: None,
            },
            limits: Limits {
                max_tokens: c.max_completion_tokens.or(c.max_tokens),
                min_tokens: c.min_tokens,
                ignore_eos: c.ignore_eos.unwrap_or(false),
                stop,
                stop_token_ids: c.stop_token_ids.unwrap_or_default(),
                return_token_ids: c.return_token_ids.unwrap_or(false),
                // Tool and harmony markup is often special tokens (`[TOOL_CALLS]`,
                // `<|python_tag|>`, `<|channel|>`): the parsers must see them, as vLLM's
                // parsers ask for too.
                keep_special: c.skip_special_tokens == Some(false) || harmony || parses,
            },
            tools: tools.as_ref().map(|t| t.tools.clone()).unwrap_or_default(),
        },
        Options {
            named: c
                .model
                .as_deref()
                .map_or_else(|| model.name.clone(), Arc::from),
            stream: c.stream,
            include_usage,
            // Harmony's channels always need parsing, calls or not.
            tools: (parses || harmony).then_some(model.tool_format),
            logprobs: logprobs.is_some(),
            echo: None,
            n: n as usize,
            more_prompts: Vec::new(),
            token_ids: c.return_token_ids.unwrap_or(false),
            // A grammar shapes the answer from its first token, so an answer cannot start
            // inside a block the template opened (R1): all of it is the answer.
            reasoning: model.reasoning.filter(|f| {
                endpoint == Endpoint::Chat && !(constrained && *f == ReasoningFormat::DeepseekR1)
            }),
        },
    ))
}

/// How many alternatives a request wants with each token's log-probability (`None`: no
/// log-probabilities): chat's `logprobs: true` with `top_logprobs`, or completions'
/// `logprobs`, each at most `max` (the ingress's `max_logprobs`, 20 as vLLM's by default;
/// OpenAI's own bounds are 20 and 5).
fn logprobs(endpoint: Endpoint, c: &Common, max: u32) -> Result<Option<u32>, ApiError> {
    let max = u64::from(max);
    fn set(v: &Option<Value>) -> Option<&Value> {
        v.as_ref().filter(|v| !v.is_null())
    }
    let count = |name: &str, v: &Value, max: u64| match v.as_u64() {
        Some(n) if n <= max => Ok(n as u32),
        _ => Err(invalid(
            name,
            format!("{name} must be an integer from 0 to {max}, got {v}"),
        )),
    };
    match endpoint {
        Endpoint::Chat => {
            let on = match set(&c.logprobs) {
                None => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => {
                    return Err(invalid(
                        "logprobs",
                        format!("logprobs must be a boolean, got {v}"),
                    ));
                }
            };
            let top = set(&c.top_logprobs)
                .map(|v| count("top_logprobs", v, max))
                .transpose()?;
            match (on, top) {
                (false, Some(n)) if n > 0 => {
                    Err(invalid("top_logprobs", "top_logprobs needs logprobs: true"))
                }
                (false, _) => Ok(None),
                (true, top) => Ok(Some(top.unwrap_or(0))),
            }
        }
        Endpoint::Completion => {
            if set(&c.top_logprobs).is_some() {
                return Err(invalid(
                    "top_logprobs",
                    "top_logprobs is a chat parameter; completions take logprobs: N",
                ));
            }
            // `logprobs: false` is what some clients send for "none".
            match set(&c.logprobs) {
                None | Some(Value::Bool(false)) => Ok(None),
                Some(v) => count("logprobs", v, max).map(Some),
            }
        }
    }
}

/// OpenAI's `logit_bias` (token ids as strings, biases in [-100, 100]), sorted by token id.
fn logit_bias(m: Option<BTreeMap<String, f32>>) -> Result<Vec<(u32, f32)>, ApiError> {
    let mut out = Vec::new();
    for (k, bias) in m.unwrap_or_default() {
        let id = k.trim().parse::<u32>().map_err(|_| {
            invalid(
                "logit_bias",
                format!("logit_bias keys must be token ids, got {k:?}"),
            )
        })?;
        if !(-100.0..=100.0).contains(&bias) {
            return Err(invalid(
                "logit_bias",
                format!("the bias of token {id} must be between -100 and 100, got {bias}"),
            ));
        }
        out.push((id, bias));
    }
    out.sort_by_key(|b| b.0);
    Ok(out)
}

/// The structured output a request asks for, from whichever field it used (at most one).
fn constraint(c: &Common) -> Result<Option<Constraint>, ApiError> {
    let mut found: Vec<(&str, Constraint)> = Vec::new();
    if let Some(v) = c.response_format.as_ref().filter(|v| !v.is_null())
        && let Some(k) = response_format(v)?
    {
        found.push(("response_format", k));
    }
    if let Some(v) = c.structured_outputs.as_ref().filter(|v| !v.is_null()) {
        let o = v
            .as_object()
            .ok_or_else(|| invalid("structured_outputs", "structured_outputs must be an object"))?;
        for (k, v) in o {
            let param = format!("structured_outputs.{k}");
            match k.as_str() {
                "json" | "regex" | "choice" | "grammar" => {
                    found.push(("structured_outputs", guided(k, v, &param)?))
                }
                "json_object" if v == &Value::Bool(true) => {
                    found.push(("structured_outputs", Constraint::JsonObject))
                }
                "json_object"
                | "disable_fallback"
                | "disable_any_whitespace"
                | "disable_additional_properties"
                | "whitespace_pattern" => {}
                _ => {
                    return Err(ApiError::invalid(
                        "unsupported_parameter",
                        format!("`{param}` is not supported by this server (json, regex, choice, grammar, json_object are)"),
                    )
                    .with_param(param));
                }
            }
        }
    }
    for (name, v) in [
        ("guided_json", &c.guided_json),
        ("guided_regex", &c.guided_regex),
        ("guided_choice", &c.guided_choice),
        ("guided_grammar", &c.guided_grammar),
    ] {
        if let Some(v) = v.as_ref().filter(|v| !v.is_null()) {
            found.push((name, guided(&name["guided_".len()..], v, name)?));
        }
    }
    match found.len() {
        0 | 1 => Ok(found.pop().map(|(_, c)| c)),
        _ => Err(invalid(
            found[1].0,
            "a request may ask for one structured output (one of response_format, structured_outputs, guided_*)",
        )),
    }
}

/// OpenAI's `response_format`: `text` (no constraint), `json_object` or `json_schema`.
fn response_format(v: &Value) -> Result<Option<Constraint>, ApiError> {
    match v["type"].as_str() {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonObject)),
        Some("json_schema") => {
            let schema = &v["json_schema"]["schema"];
            if schema.is_object() || schema.is_boolean() {
                Ok(Some(Constraint::JsonSchema(schema.clone())))
            } else {
                Err(invalid(
                    "response_format.json_schema.schema",
                    "response_format json_schema needs `json_schema.schema`, a JSON Schema object",
                ))
            }
        }
        other => Err(invalid(
            "response_format.type",
            format!(
                "response_format type must be text, json_object or json_schema, got {}",
                other.map_or_else(|| v["type"].to_string(), |t| format!("{t:?}"))
            ),
        )),
    }
}

/// vLLM's `json` (a schema, or a schema as a string), `regex`, `choice` or `grammar` (Lark).
fn guided(kind: &str, v: &Value, param: &str) -> Result<Constraint, ApiError> {
    let text = || {
        v.as_str()
            .map(str::to_owned)
            .ok_or_else(|| invalid(param, format!("`{param}` must be a string")))
    };
    Ok(match kind {
        "json" => match v {
            Value::String(s) => Constraint::JsonSchema(
                serde_json::from_str(s)
                    .map_err(|e| invalid(param, format!("`{param}` is not JSON: {e}")))?,
            ),
            _ => Constraint::JsonSchema(v.clone()),
        },
        "regex" => Constraint::Regex(text()?),
        "grammar" => Constraint::Lark(text()?),
        _ => {
            let options: Vec<String> = serde_json::from_value(v.clone())
                .map_err(|_| invalid(param, format!("`{param}` must be a list of strings")))?;
            if options.is_empty() {
                return Err(invalid(param, format!("`{param}` must not be empty")));
            }
            Constraint::Choice(options)
        }
    })
}

impl Options {
    /// Choices in all: `n` for each prompt.
    fn total(&self) -> usize {
        self.n * (1 + self.more_prompts.len())
    }

    /// The prompt choice `i` answers.
    fn prompt_of(&self, i: usize) -> usize {
        i / self.n.max(1)
    }

    /// What choice `i` echoes, if the request echoes.
    fn echo_of(&self, i: usize) -> Option<Option<String>> {
        let e = self.echo.as_ref()?;
        e.get(self.prompt_of(i)).cloned()
    }
}

pub(crate) struct Options {
    pub(crate) stream: bool,
    include_usage: bool,
    /// Tool calls are parsed out of the answer, in this format.
    pub(crate) tools: Option<ToolFormat>,
    /// The answer carries its tokens' log-probabilities.
    logprobs: bool,
    /// Completions' `echo`, per prompt: the answer starts with the prompt — its text when the
    /// client sent text, else (`None`) the text of its tokens as the engine reports them.
    echo: Option<Vec<Option<String>>>,
    /// Choices per prompt (OpenAI's `n`).
    n: usize,
    /// Completions' prompts after the first (the request's own): each has its `n` choices,
    /// numbered after the earlier prompts' (vLLM's order).
    more_prompts: Vec<Prompt>,
    /// Chat: reasoning is split out of the answer, in this format.
    pub(crate) reasoning: Option<ReasoningFormat>,
    /// vLLM's `return_token_ids`: choices carry `token_ids`, and the prompt's come back as
    /// `prompt_token_ids` (completions: per choice; chat: beside the choices).
    token_ids: bool,
    /// The model the client named (an adapter's name where it named one): the answer's.
    pub(crate) named: Arc<str>,
}

/// A chat completions body given as JSON — what the other dialects translate theirs into —
/// read as `/v1/chat/completions` reads its own.
pub(crate) fn chat_from_json(app: &App, body: Value) -> Result<(LlmRequest, Options), ApiError> {
    let b: ChatBody = serde_json::from_value(body)
        .map_err(|e| ApiError::invalid("invalid_json", format!("invalid request body: {e}")))?;
    let messages = chat_messages(b.messages)?;
    request(app, Endpoint::Chat, Prompt::Messages(messages), b.common)
}

/// How many tokens the prompt of a chat body given as JSON (its `model`, `messages` and
/// `tools`) is, the template applied with its generation prompt.
pub(crate) async fn count_prompt(app: &App, body: Value) -> Result<usize, ApiError> {
    #[derive(Deserialize)]
    struct Counted {
        model: String,
        messages: Vec<MessageIn>,
        #[serde(default)]
        tools: Option<Vec<Value>>,
    }
    let b: Counted = serde_json::from_value(body)
        .map_err(|e| ApiError::invalid("invalid_json", format!("invalid request body: {e}")))?;
    let served = app.tokenizer_of(Some(&b.model))?;
    let prompt = Prompt::Messages(chat_messages(b.messages)?);
    let tools = b.tools.unwrap_or_default();
    let ids = served
        .preprocess
        .tokenize(prompt, &tools, None, true)
        .await
        .map_err(ApiError::from)?;
    Ok(ids.len())
}

/// One input of an embeddings request, for `model` (an adapter's name runs its adapter): the
/// model's pooling, nothing sampled.
pub(crate) fn embedding_request(
    app: &App,
    model: &str,
    prompt: Prompt,
    user: Option<&str>,
) -> Result<(LlmRequest, Options), ApiError> {
    let (at, lora) = app.catalog.resolve(model)?;
    let served = &app.served[at];
    let pooling = served.preprocess.pooling().map_err(|why| {
        invalid(
            "model",
            format!("model `{model}` has no embeddings here: {why}"),
        )
    })?;
    Ok((
        LlmRequest {
            endpoint: Endpoint::Completion,
            model: served.name.to_string(),
            prompt,
            sampling: Sampling {
                embed: Some(pooling),
                lora,
                session: user
                    .filter(|u| !u.is_empty() && u.len() <= super::SESSION_MAX)
                    .map(str::to_owned),
                ..Sampling::default()
            },
            limits: Limits::default(),
            tools: Vec::new(),
        },
        Options {
            named: model.into(),
            stream: false,
            include_usage: false,
            tools: None,
            logprobs: false,
            echo: None,
            n: 1,
            more_prompts: Vec::new(),
            token_ids: false,
            reasoning: None,
        },
    ))
}

/// The width of `model`'s embeddings, where its config says.
pub(crate) fn embedding_width(app: &App, model: &str) -> Result<Option<u32>, ApiError> {
    let (at, _) = app.catalog.resolve(model)?;
    Ok(app.served[at].preprocess.hidden_size())
}

/// The context of a request that runs in parts ([`start_part`]).
pub(crate) fn request_ctx(app: &App, headers: &HeaderMap) -> Result<Ctx, ApiError> {
    app.server.request_ctx(&app.chain, headers)
}

fn chat_request(app: &App, body: &[u8]) -> Result<(LlmRequest, Options), ApiError> {
    let b: ChatBody = super::parse_json(body)?;
    let messages = chat_messages(b.messages)?;
    request(app, Endpoint::Chat, Prompt::Messages(messages), b.common)
}

/// A chat body's messages as the template takes them: text content (text parts joined),
/// assistant tool calls, tool results.
fn chat_messages(raw: Vec<MessageIn>) -> Result<Vec<ChatMessage>, ApiError> {
    let mut messages = Vec::with_capacity(raw.len());
    for (i, m) in raw.into_iter().enumerate() {
        if m.role == "function" {
            return Err(ApiError::invalid(
                "unsupported_parameter",
                "the legacy `function` role is not supported; use `tool` messages",
            )
            .with_param(format!("messages[{i}].role")));
        }
        let tool_calls = match m.tool_calls {
            Some(v) if !empty(&v) => Some(template_calls(v, i)?),
            _ => None,
        };
        let content = match m.content {
            None => String::new(),
            Some(ContentIn::Text(t)) => t,
            Some(ContentIn::Parts(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(t)) => text.push_str(&t),
                        (kind, _) => {
                            return Err(invalid(
                                format!("messages[{i}].content"),
                                format!(
                                    "content parts of type `{kind}` are not supported; only `text`"
                                ),
                            ));
                        }
                    }
                }
                text
            }
        };
        messages.push(ChatMessage {
            role: m.role,
            content,
            tool_calls,
            tool_call_id: m.tool_call_id,
            name: m.name,
        });
    }
    Ok(messages)
}

/// vLLM's `/tokenize` body: a completion's `prompt` or a chat's `messages`.
#[derive(Debug, Deserialize)]
struct TokenizeBody {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Vec<MessageIn>>,
    #[serde(default)]
    add_special_tokens: Option<bool>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    continue_final_message: bool,
    #[serde(default)]
    return_token_strs: Option<bool>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    chat_template: Option<Value>,
    #[serde(default)]
    chat_template_kwargs: Option<Value>,
    #[serde(default)]
    mm_processor_kwargs: Option<Value>,
    #[serde(default)]
    media_io_kwargs: Option<Value>,
}

/// vLLM's `/detokenize` body.
#[derive(Debug, Deserialize)]
struct DetokenizeBody {
    #[serde(default)]
    model: Option<String>,
    tokens: Vec<u64>,
}

impl App {
    /// The model a `/tokenize`-style body names (an adapter reads as its base), or the first.
    fn tokenizer_of(&self, model: Option<&str>) -> Result<&Served, ApiError> {
        match model {
            None => Ok(&self.served[0]),
            Some(m) => Ok(&self.served[self.catalog.resolve(m)?.0]),
        }
    }
}

#[derive(Debug, Deserialize)]
struct TokenizerInfoQuery {
    model: Option<String>,
}

/// `GET /tokenizer_info` (vLLM's): what a client needs to tokenize as the server does through
/// `/tokenize` and `/detokenize` — the special tokens' text and the chat template
/// (lm-evaluation-harness's remote tokenizer reads it, where it would otherwise need the
/// model's files from a hub). `?model=` picks a model where several are served.
async fn tokenizer_info(
    State(app): State<App>,
    query: Result<
        axum::extract::Query<TokenizerInfoQuery>,
        axum::extract::rejection::QueryRejection,
    >,
) -> Response {
    let model = match query {
        Ok(q) => q.0.model,
        Err(e) => return invalid("model", format!("invalid query: {e}")).into_response(),
    };
    let served = match app.tokenizer_of(model.as_deref()) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let dir = served.preprocess.model();
    Json(json!({
        "model": &*served.name,
        // A Hugging Face `tokenizer.json` (or a GGUF vocabulary read as one).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": dir.bos_token,
        "eos_token": dir.eos_token,
        "pad_token": null,
        "chat_template": dir.chat_template,
        "model_max_length": dir.context_length,
        "vocab_size": dir.vocab_size,
    }))
    .into_response()
}

/// `POST /tokenize` (vLLM's): the prompt's tokens as the model reads it, the chat template
/// applied to messages.
async fn tokenize(State(app): State<App>, body: Result<Bytes, BytesRejection>) -> Response {
    match tokenize_answer(&app, body).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn tokenize_answer(
    app: &App,
    body: Result<Bytes, BytesRejection>,
) -> Result<Value, ApiError> {
    let body = body.map_err(super::body_error)?;
    let b: TokenizeBody = super::parse_json(&body)?;
    let served = app.tokenizer_of(b.model.as_deref())?;
    if b.chat_template.is_some() {
        return Err(ApiError::invalid(
            "unsupported_parameter",
            "chat_template is not supported: the model's own template is applied",
        )
        .with_param("chat_template"));
    }
    // vLLM's other options: asked for, they are refused rather than ignored.
    for (name, v) in [
        ("chat_template_kwargs", &b.chat_template_kwargs),
        ("mm_processor_kwargs", &b.mm_processor_kwargs),
        ("media_io_kwargs", &b.media_io_kwargs),
    ] {
        if v.as_ref().is_some_and(|v| !empty(v)) {
            return Err(ApiError::invalid(
                "unsupported_parameter",
                format!("{name} is not supported"),
            )
            .with_param(name));
        }
    }
    if b.continue_final_message {
        return Err(ApiError::invalid(
            "unsupported_parameter",
            "continue_final_message is not supported",
        )
        .with_param("continue_final_message"));
    }
    let prompt = match (b.prompt, b.messages) {
        (Some(p), None) => Prompt::Text(p),
        (None, Some(m)) => Prompt::Messages(chat_messages(m)?),
        _ => {
            return Err(ApiError::invalid(
                "invalid_request",
                "give either `prompt` (a string) or `messages`",
            ));
        }
    };
    let p = &served.preprocess;
    let tools = b.tools.unwrap_or_default();
    let ids = p
        .tokenize(
            prompt,
            &tools,
            b.add_special_tokens,
            b.add_generation_prompt.unwrap_or(true),
        )
        .await
        .map_err(ApiError::from)?;
    let strs = b
        .return_token_strs
        .unwrap_or(false)
        .then(|| p.token_strs(&ids));
    Ok(json!({
        "count": ids.len(),
        "max_model_len": p.context_length(),
        "tokens": ids,
        "token_strs": strs,
    }))
}

/// `POST /detokenize` (vLLM's): the tokens' text, special tokens kept.
async fn detokenize(State(app): State<App>, body: Result<Bytes, BytesRejection>) -> Response {
    match detokenize_answer(&app, body) {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

fn detokenize_answer(app: &App, body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let body = body.map_err(super::body_error)?;
    let b: DetokenizeBody = super::parse_json(&body)?;
    let served = app.tokenizer_of(b.model.as_deref())?;
    let ids: Vec<u32> = b
        .tokens
        .iter()
        .map(|&t| u32::try_from(t))
        .collect::<Result<_, _>>()
        .map_err(|_| invalid("tokens", "token ids are below 2^32"))?;
    let text = served.preprocess.detokenize(&ids).map_err(ApiError::from)?;
    Ok(json!({"prompt": text}))
}

fn completion_request(app: &App, body: &[u8]) -> Result<(LlmRequest, Options), ApiError> {
    let b: CompletionBody = super::parse_json(body)?;
    // Several prompts are answered as several choices, each prompt's `n` after the
    // previous prompt's (as vLLM answers; lm-evaluation-harness sends its batches so).
    let prompts: Vec<Prompt> = match b.prompt {
        PromptIn::Text(t) => vec![Prompt::Text(t)],
        PromptIn::Texts(v) => v.into_iter().map(Prompt::Text).collect(),
        PromptIn::Tokens(t) => vec![Prompt::Tokens(t)],
        PromptIn::TokenLists(v) => v.into_iter().map(Prompt::Tokens).collect(),
    };
    if prompts.is_empty() || prompts.len() > MAX_PROMPTS {
        return Err(invalid(
            "prompt",
            format!(
                "a request takes 1 to {MAX_PROMPTS} prompts, got {}",
                prompts.len()
            ),
        ));
    }
    let echo: Option<Vec<Option<String>>> = b.echo.then(|| {
        prompts
            .iter()
            .map(|p| match p {
                Prompt::Text(t) => Some(t.clone()),
                _ => None,
            })
            .collect()
    });
    let mut prompts = prompts.into_iter();
    let first = prompts.next().unwrap_or(Prompt::Text(String::new()));
    let (mut req, mut opts) = request(app, Endpoint::Completion, first, b.common)?;
    opts.more_prompts = prompts.collect();
    if opts.total() > MAX_PROMPTS {
        return Err(invalid(
            "n",
            format!("prompts × n is at most {MAX_PROMPTS}, got {}", opts.total()),
        ));
    }
    if let Some(texts) = &echo {
        // The prompt's log-probabilities come with echo and logprobs (lm-evaluation-harness's
        // log-likelihoods); a prompt of token ids needs the engine's word for its text too.
        if opts.logprobs || texts.iter().any(Option::is_none) {
            req.sampling.prompt_logprobs = Some(req.sampling.logprobs.unwrap_or(0));
        }
        opts.echo = echo;
    }
    Ok((req, opts))
}

// ---- handlers ------------------------------------------------------------------------------

async fn chat(
    State(app): State<App>,
    key: Option<Extension<KeyTenant>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(app, Endpoint::Chat, key.map(|k| k.0), headers, body).await
}

async fn completions(
    State(app): State<App>,
    key: Option<Extension<KeyTenant>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(app, Endpoint::Completion, key.map(|k| k.0), headers, body).await
}

/// Counts one request in the frontend metrics from start to end; dropped without `finish`
/// (the client went away) it counts as cancelled.
pub(crate) struct Track {
    model: Arc<str>,
    /// The request's context until its first token: it names the pool serving the request,
    /// if a router chose among pools (let go then, so the request's end hooks are not held).
    ctx: Option<Ctx>,
    pool: Option<Arc<str>>,
    endpoint: &'static str,
    stream: bool,
    start: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// Tokens after the first one's delta, for the request's mean ITL.
    later_tokens: u32,
    usage: Option<(u32, u32)>,
    status: Option<&'static str>,
    stats: Arc<FrontendStats>,
}

impl Track {
    /// Counted under `model` (the base model the request runs on) and `endpoint` (the route's
    /// name: `chat_completions`, `messages`, …).
    fn new(app: &App, model: Arc<str>, endpoint: &'static str, stream: bool) -> Self {
        FRONTEND.inflight.with_label_values(&[&*model]).inc();
        app.stats.arrived();
        Self {
            stats: app.stats.clone(),
            ctx: None,
            pool: None,
            first_token: None,
            later_tokens: 0,
            usage: None,
            model,
            endpoint,
            stream,
            start: Instant::now(),
            last_token: None,
            status: None,
        }
    }

    pub(crate) fn delta(&mut self, d: &LlmDelta) {
        let m = [&*self.model];
        if let Some(u) = d.usage {
            // Several choices: the prompt once, their answers together.
            let before = self.usage.map_or(0, |(_, c)| c);
            self.usage = Some((u.prompt_tokens, before + u.completion_tokens));
            FRONTEND
                .input_tokens
                .with_label_values(&m)
                .inc_by(u64::from(u.prompt_tokens));
            FRONTEND
                .output_tokens
                .with_label_values(&m)
                .inc_by(u64::from(u.completion_tokens));
        }
        // A delta without tokens (an embedding's, the end of a stop string) times nothing.
        if d.tokens == 0 {
            return;
        }
        let now = Instant::now();
        match self.last_token {
            None => {
                FRONTEND
                    .ttft
                    .with_label_values(&m)
                    .observe((now - self.start).as_secs_f64());
                self.pool = self.ctx.take().and_then(|c| c.pool());
                self.stats
                    .first_token(now - self.start, self.pool.as_deref());
                self.first_token = Some(now);
            }
            Some(last) => {
                FRONTEND
                    .itl
                    .with_label_values(&m)
                    .observe((now - last).as_secs_f64() / f64::from(d.tokens));
                self.later_tokens += d.tokens;
            }
        }
        self.last_token = Some(now);
    }

    pub(crate) fn finish(&mut self, status: &'static str) {
        self.status.get_or_insert(status);
    }
}

impl Drop for Track {
    fn drop(&mut self) {
        let m = &*self.model;
        FRONTEND.inflight.with_label_values(&[m]).dec();
        let kind = if self.stream { "stream" } else { "unary" };
        let status = self.status.unwrap_or("cancelled");
        FRONTEND
            .requests
            .with_label_values(&[m, self.endpoint, kind, status])
            .inc();
        let itl = match (self.first_token, self.last_token) {
            (Some(first), Some(last)) if self.later_tokens > 0 => {
                Some((last - first) / self.later_tokens)
            }
            _ => None,
        };
        // A cancelled request is the client's doing, not a failure of the deployment.
        let pool = self.pool.take().or_else(|| self.ctx.take()?.pool());
        self.stats
            .finished(status != "error", self.usage, itl, pool.as_deref());
        if status == "success" {
            FRONTEND
                .duration
                .with_label_values(&[m])
                .observe(self.start.elapsed().as_secs_f64());
        }
    }
}

async fn serve(
    app: App,
    endpoint: Endpoint,
    key: Option<KeyTenant>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body.map_err(super::body_error) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let parsed = match endpoint {
        Endpoint::Chat => chat_request(&app, &body),
        Endpoint::Completion => completion_request(&app, &body),
    };
    let label = match endpoint {
        Endpoint::Chat => "chat_completions",
        Endpoint::Completion => "completions",
    };
    let (started, opts) = match start(&app, label, key.as_ref(), &headers, parsed).await {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let Started {
        first,
        out,
        guards,
        mut track,
        id,
    } = started;
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl-",
        Endpoint::Completion => "cmpl-",
    };
    let shape = Shape {
        id: format!("{prefix}{id}"),
        endpoint,
        model: opts.named.clone(),
        created: unix_now(),
    };
    if !opts.stream {
        let mut acc: Vec<Collected> = (0..opts.total())
            .map(|i| Collected {
                echo: opts.echo_of(i),
                ..Collected::default()
            })
            .collect();
        let mut next = first;
        let mut out = out;
        while let Some((i, item)) = next.take() {
            match item {
                Ok(d) => {
                    track.delta(&d);
                    acc[i].add(d);
                }
                Err(e) => {
                    track.finish("error");
                    return ApiError::from(e).into_response();
                }
            }
            next = out.next().await;
        }
        guards
            .into_iter()
            .for_each(dyn_core::ctx::KillOnDrop::disarm);
        track.finish("success");
        // Each prompt's first choice carries what its other choices share: the prompt's
        // log-probabilities and ids, and its tokens counted once in the usage.
        let mut usage = Usage::default();
        let firsts: Vec<(Vec<TextLogprob>, Option<Vec<u32>>)> = acc
            .iter()
            .step_by(opts.n.max(1))
            .map(|c| (c.prompt_logprobs.clone(), c.prompt_token_ids.clone()))
            .collect();
        let prompt_ids = firsts.first().and_then(|f| f.1.clone());
        let mut prompt_tokens = vec![0u32; firsts.len()];
        let choices: Vec<Value> = acc
            .into_iter()
            .enumerate()
            .map(|(i, mut c)| {
                let p = opts.prompt_of(i);
                if c.prompt_logprobs.is_empty() {
                    c.prompt_logprobs = firsts[p].0.clone();
                }
                if c.prompt_token_ids.is_none() {
                    c.prompt_token_ids = firsts[p].1.clone();
                }
                prompt_tokens[p] = prompt_tokens[p].max(c.usage.prompt_tokens);
                usage.completion_tokens += c.usage.completion_tokens;
                let mut v = shape.choice(&opts, c);
                v["index"] = json!(i);
                v
            })
            .collect();
        usage.prompt_tokens = prompt_tokens.iter().sum();
        let mut v = shape.envelope(false, Value::Array(choices));
        v["usage"] = usage_json(usage);
        if opts.token_ids && endpoint == Endpoint::Chat {
            v["prompt_token_ids"] = json!(prompt_ids);
        }
        return Json(v).into_response();
    }

    let events = sse(shape, opts, first, out, track, guards);
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        axum::body::Body::from_stream(events),
    )
        .into_response()
}

/// A request the graph has taken: its first delta (none when it was dropped), the rest of
/// every choice's deltas (ending in a deadline error if its deadline passes), the guards that
/// kill its choices when dropped, its tracking, and its id.
pub(crate) struct Started {
    pub first: Option<(usize, Result<LlmDelta, OpError>)>,
    pub out: Tagged,
    pub guards: Vec<dyn_core::ctx::KillOnDrop>,
    pub track: Track,
    pub id: dyn_core::RequestId,
}

/// Send a parsed request (`parsed`, counted under the endpoint `label`) down the graph with the
/// headers' tenant, priority and session, and wait for its first delta, so that an early
/// failure still gets its own status code. Every endpoint that generates starts here.
pub(crate) async fn start(
    app: &App,
    label: &'static str,
    key: Option<&KeyTenant>,
    headers: &HeaderMap,
    parsed: Result<(LlmRequest, Options), ApiError>,
) -> Result<(Started, Options), ApiError> {
    start_part(app, label, key, headers, parsed, None).await
}

/// [`start`] for one part of a request that runs several (the inputs of one embeddings
/// request): `part` is the request's context (made by [`ServerConfig::request_ctx`] once, so
/// its deadline counts from the request's start) and the part's index; parts after the first
/// run under the request's id with `-{index}` added.
pub(crate) async fn start_part(
    app: &App,
    label: &'static str,
    key: Option<&KeyTenant>,
    headers: &HeaderMap,
    parsed: Result<(LlmRequest, Options), ApiError>,
    part: Option<(&Ctx, usize)>,
) -> Result<(Started, Options), ApiError> {
    // The headers' tenant (the key's, or the tenant header) and priority (a gateway's word,
    // over the body's `priority`).
    let parsed = parsed.and_then(|(mut req, opts)| {
        let t = app.server.traffic(headers, key)?;
        req.sampling.tenant = t.tenant;
        if let Some(p) = t.priority {
            req.sampling.priority = p;
        }
        if t.session.is_some() {
            req.sampling.session = t.session;
        }
        // Behind API keys, a request without a salt of its own caches under its tenant's:
        // tenants share no prefix (nor learn of each other's prompts from its timing) unless
        // they send the same `cache_salt`.
        if key.is_some()
            && req.sampling.cache_salt.is_none()
            && let Some(tenant) = &req.sampling.tenant
        {
            req.sampling.cache_salt = Some(dyn_protocol::types::tenant_cache_salt(tenant));
        }
        Ok((req, opts))
    });
    let (req, opts) = match parsed {
        Ok(r) => r,
        Err(e) => {
            // A request refused before its model was known counts under the first model.
            let mut t = Track::new(app, app.served[0].name.clone(), label, false);
            t.finish("error");
            return Err(e);
        }
    };
    let mut track = Track::new(app, req.model.as_str().into(), label, opts.stream);
    if let Some(l) = &req.sampling.lora {
        FRONTEND
            .lora_requests
            .with_label_values(&[req.model.as_str(), &l.name])
            .inc();
    }
    let ctx = match part {
        Some((parent, 0)) => Ok(parent.clone()),
        Some((parent, i)) => {
            let c = app.chain.ctx(Some(format!("{}-{i}", parent.id()).into()));
            Ok(match parent.deadline() {
                Some(d) => c.with_deadline(d),
                None => c,
            })
        }
        None => app.server.request_ctx(&app.chain, headers),
    };
    let ctx = match ctx {
        Ok(c) => c,
        Err(e) => {
            track.finish("error");
            return Err(e);
        }
    };
    track.ctx = Some(ctx.clone());
    let deadline = ctx.deadline();
    let id = ctx.id().clone();
    let chosen = choices(app, ctx, req, opts.n, &opts.more_prompts);
    let chosen = match deadline {
        // A moment's grace: what stops the request at its deadline below (the admission
        // queue's 503, say) tells the client why; this is the backstop.
        Some(d) => tokio::time::timeout_at((d + DEADLINE_GRACE).into(), chosen)
            .await
            .unwrap_or_else(|_| Err(OpError::deadline_exceeded().into())),
        None => chosen.await,
    };
    let late = deadline.is_some_and(|d| Instant::now() >= d);
    let (first, out, guards) = match chosen {
        // Failed, or came back empty, as its deadline passed: the deadline's doing (a refusal
        // for want of room keeps its 503).
        Ok((None, ..)) if late => {
            track.finish("error");
            return Err(ApiError::from(OpError::deadline_exceeded()));
        }
        Ok(c) => c,
        Err(e) => {
            track.finish("error");
            return Err(super::at_deadline(e, late));
        }
    };
    let out = until_deadline(out, deadline, first.as_ref(), opts.total());
    Ok((
        Started {
            first,
            out,
            guards,
            track,
            id,
        },
        opts,
    ))
}

/// How long past a request's deadline the frontend waits for the graph to stop it.
const DEADLINE_GRACE: std::time::Duration = std::time::Duration::from_millis(100);

/// The deltas of a request's choices, each tagged with its index.
pub(crate) type Tagged =
    futures::stream::BoxStream<'static, (usize, Result<LlmDelta, dyn_core::OpError>)>;

/// `out` (the choices after `first`) ending in a [`OpError::deadline_exceeded`] error when the
/// deadline passes before every choice finished. The request's context carries the same
/// deadline, so everything under it stops too; whichever side notices first, a choice cut
/// short then reads as late, not as an ordinary error or a silent end.
fn until_deadline(
    out: Tagged,
    deadline: Option<Instant>,
    first: Option<&(usize, Result<LlmDelta, dyn_core::OpError>)>,
    n: usize,
) -> Tagged {
    let Some(deadline) = deadline else { return out };
    let mut finished = vec![false; n];
    if let Some((i, Ok(d))) = first
        && d.finish.is_some()
    {
        finished[*i] = true;
    }
    async_stream::stream! {
        let mut out = out;
        let timer = tokio::time::sleep_until((deadline + DEADLINE_GRACE).into());
        tokio::pin!(timer);
        loop {
            let next = tokio::select! {
                next = out.next() => Some(next),
                _ = &mut timer => None,
            };
            let unfinished = finished.iter().position(|f| !f);
            let late = Instant::now() >= deadline;
            match next {
                Some(Some((i, Ok(d)))) => {
                    if d.finish.is_some() {
                        finished[i] = true;
                    }
                    yield (i, Ok(d));
                }
                Some(Some((i, Err(_)))) if late => {
                    yield (i, Err(OpError::deadline_exceeded()));
                    return;
                }
                Some(Some(failed)) => yield failed,
                Some(None) | None => {
                    if let Some(i) = unfinished.filter(|_| late) {
                        yield (i, Err(OpError::deadline_exceeded()));
                    }
                    return;
                }
            }
        }
    }
    .boxed()
}

/// Send the request down the graph `n` times (choice `i` with `seed + i` when seeded) and
/// return the first choice's first delta, then every choice's deltas as they come, and the
/// guards that kill the choices when the response is dropped. The other choices start once
/// the first has its first delta, so its prompt's KV blocks are in the prefix cache by then
/// and the KV router sends them to the same worker: the prompt is computed once.
async fn choices(
    app: &App,
    ctx: dyn_core::Ctx,
    req: LlmRequest,
    n: usize,
    more_prompts: &[Prompt],
) -> Result<
    (
        Option<(usize, Result<LlmDelta, dyn_core::OpError>)>,
        Tagged,
        Vec<dyn_core::ctx::KillOnDrop>,
    ),
    ApiError,
> {
    // Unseeded choices still differ on engines that seed by the prompt (the mocker).
    let seed = req.sampling.seed.or_else(|| {
        use std::hash::{BuildHasher, Hasher};
        (n > 1).then(|| {
            std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish()
        })
    });
    // Choice `i` answers prompt `i / n` (the request's own first, then `more_prompts`).
    let child = |i: usize| {
        let mut r = req.clone();
        let (prompt, j) = (i / n.max(1), i % n.max(1));
        if let Some(p) = prompt.checked_sub(1).and_then(|k| more_prompts.get(k)) {
            r.prompt = p.clone();
        }
        r.sampling.seed = seed.map(|s| s.wrapping_add(j as u64));
        if j > 0 {
            // A prompt's log-probabilities (echo) come once, with its first choice.
            r.sampling.prompt_logprobs = None;
        }
        r
    };
    let n = n * (1 + more_prompts.len());
    let mut guards = vec![ctx.kill_on_drop()];
    let mut first_out = app.chain.call(ctx.clone(), child(0));
    let first = match first_out.next().await {
        Some(Err(e)) => return Err(ApiError::from(e)),
        // Nothing came back (the request was dropped): no other choice is started.
        None => return Ok((None, futures::stream::empty().boxed(), guards)),
        Some(d) => Some((0, d)),
    };
    let mut streams: Vec<Tagged> = vec![first_out.map(|d| (0, d)).boxed()];
    for i in 1..n {
        let mut c = app.chain.ctx(Some(format!("{}-{i}", ctx.id()).into()));
        if let Some(d) = ctx.deadline() {
            c = c.with_deadline(d);
        }
        guards.push(c.kill_on_drop());
        streams.push(app.chain.call(c, child(i)).map(move |d| (i, d)).boxed());
    }
    Ok((first, futures::stream::select_all(streams).boxed(), guards))
}

/// One choice of a unary answer, as its deltas arrive.
#[derive(Default)]
struct Collected {
    /// What the choice echoes ([`Options::echo_of`]).
    echo: Option<Option<String>>,
    text: String,
    finish: Option<FinishReason>,
    usage: Usage,
    logprobs: Vec<TextLogprob>,
    prompt_logprobs: Vec<TextLogprob>,
    token_ids: Vec<u32>,
    prompt_token_ids: Option<Vec<u32>>,
}

impl Collected {
    fn add(&mut self, mut d: LlmDelta) {
        self.token_ids
            .extend(d.token_ids.take().unwrap_or_default());
        if self.prompt_token_ids.is_none() {
            self.prompt_token_ids = d.prompt_token_ids.take();
        }
        self.text.push_str(&d.text);
        self.finish = d.finish.or(self.finish);
        self.usage = d.usage.unwrap_or(self.usage);
        self.logprobs.append(&mut d.logprobs);
        if self.prompt_logprobs.is_empty() {
            self.prompt_logprobs = d.prompt_logprobs;
        }
    }
}

/// What a streamed choice carries between its deltas.
struct StreamState {
    reasoning: Option<ReasoningParser>,
    tools: Option<(ToolParser, usize)>,
    echo: Option<Option<String>>,
    /// Completions' text offsets of the log-probabilities, counted across chunks.
    offset: usize,
    done: bool,
}

fn sse(
    shape: Shape,
    opts: Options,
    first: Option<(usize, Result<LlmDelta, dyn_core::OpError>)>,
    mut out: Tagged,
    mut track: Track,
    guards: Vec<dyn_core::ctx::KillOnDrop>,
) -> impl Stream<Item = Result<Bytes, Infallible>> {
    let include_usage = opts.include_usage;
    // One choice without log-probabilities takes the prerendered chunks; otherwise each
    // chunk is built whole (with its index and `logprobs`).
    let fast = opts.total() == 1 && !opts.logprobs && !opts.token_ids;
    let mut state: Vec<StreamState> = (0..opts.total())
        .map(|i| StreamState {
            reasoning: opts.reasoning.map(ReasoningParser::new),
            tools: opts.tools.map(|f| (ToolParser::new(f), 0usize)),
            echo: opts.echo_of(i),
            offset: 0,
            done: false,
        })
        .collect();
    async_stream::stream! {
        let chunks = Chunks::new(&shape, include_usage);
        let with = |i: usize, mut v: Value, lps: Option<Value>| {
            v["choices"][0]["index"] = json!(i);
            if let Some(l) = lps {
                v["choices"][0]["logprobs"] = l;
            }
            event(&v.to_string())
        };
        // A text chunk of choice `i`: prerendered on the fast path, else built whole.
        let text_chunk = |i: usize, text: &str, finish: Option<FinishReason>| {
            if fast {
                chunks.delta(text, finish)
            } else {
                with(i, shape.delta(text, finish, include_usage), None)
            }
        };
        // Reasoning of choice `i` (chat's `delta.reasoning_content`).
        let reasoning_chunk = |i: usize, text: &str| {
            with(i, shape.chunk(Some(json!({"reasoning_content": text})), None, include_usage), None)
        };
        // return_token_ids: a chunk's ids, and the prompt's on the choice's first chunk.
        let ids = |mut v: Value, d: &mut LlmDelta| {
            if opts.token_ids {
                v["choices"][0]["token_ids"] = json!(d.token_ids.take().unwrap_or_default());
                if let Some(p) = d.prompt_token_ids.take() {
                    match shape.endpoint {
                        Endpoint::Chat => v["prompt_token_ids"] = json!(p),
                        Endpoint::Completion => v["choices"][0]["prompt_token_ids"] = json!(p),
                    }
                }
            }
            v
        };
        if shape.endpoint == Endpoint::Chat {
            for i in 0..opts.total() {
                yield Ok(if fast {
                    chunks.role()
                } else {
                    with(i, shape.chunk(Some(json!({"role": "assistant", "content": ""})), None, include_usage), None)
                });
            }
        }
        let mut next = first;
        let mut usage: Option<Usage> = None;
        // Each prompt's tokens, counted once however many choices it has.
        let mut prompt_tokens = vec![0u32; 1 + opts.more_prompts.len()];
        // Each prompt's log-probabilities, from its first choice, for its other choices' echo.
        let mut prompt_lps: Vec<Vec<TextLogprob>> = vec![Vec::new(); 1 + opts.more_prompts.len()];
        let mut failed = false;
        while let Some((i, item)) = next.take() {
            let mut d = match item {
                Ok(d) => d,
                Err(e) => {
                    track.finish("error");
                    failed = true;
                    yield Ok(event(&ApiError::from(e).body().to_string()));
                    break;
                }
            };
            let p = opts.prompt_of(i);
            if prompt_lps[p].is_empty() && !d.prompt_logprobs.is_empty() {
                prompt_lps[p] = d.prompt_logprobs.clone();
            } else if d.prompt_logprobs.is_empty() && state[i].echo.is_some() {
                d.prompt_logprobs = prompt_lps[p].clone();
            }
            track.delta(&d);
            if let Some(u) = d.usage {
                let sum = usage.get_or_insert(Usage::default());
                prompt_tokens[p] = prompt_tokens[p].max(u.prompt_tokens);
                sum.prompt_tokens = prompt_tokens.iter().sum();
                sum.completion_tokens += u.completion_tokens;
            }
            let st = &mut state[i];
            if let Some(e) = st.echo.take() {
                // The prompt goes out with the first chunk (its log-probabilities too).
                d.text = echo_text(&e, &d.prompt_logprobs) + &d.text;
                let mut lps = std::mem::take(&mut d.prompt_logprobs);
                lps.append(&mut d.logprobs);
                d.logprobs = lps;
            }
            if let Some(p) = &mut st.reasoning {
                // Reasoning goes out as `reasoning_content`; the answer goes on as text.
                let split = p.feed(&d.text, d.finish.is_some());
                if !split.reasoning.is_empty() {
                    yield Ok(reasoning_chunk(i, &split.reasoning));
                }
                d.text = split.content;
            }
            let lps = (opts.logprobs && !d.logprobs.is_empty()).then(|| {
                let l = shape.logprobs(&[], &d.logprobs, st.offset);
                st.offset += d.logprobs.iter().map(|l| l.token.chars().count()).sum::<usize>();
                l
            });
            if let Some((parser, calls)) = &mut st.tools {
                // The delta's log-probabilities and token ids go ahead of the text and calls
                // the parser releases from it.
                let has_ids = opts.token_ids
                    && (d.token_ids.as_ref().is_some_and(|t| !t.is_empty()) || d.prompt_token_ids.is_some());
                if lps.is_some() || has_ids {
                    let v = ids(shape.delta("", None, include_usage), &mut d);
                    yield Ok(with(i, v, lps));
                }
                // Text passes as the parser releases it; each call is one chunk.
                let mut pieces = parser.push(&d.text);
                if d.finish.is_some() {
                    pieces.extend(parser.finish());
                }
                for piece in pieces {
                    match piece {
                        Piece::Text(t) => yield Ok(text_chunk(i, &t, None)),
                        Piece::Reasoning(r) => yield Ok(reasoning_chunk(i, &r)),
                        Piece::Call(c) => {
                            let v = shape.call_chunk(*calls, &c, include_usage);
                            *calls += 1;
                            yield Ok(with(i, v, None));
                        }
                    }
                }
                if let Some(f) = d.finish {
                    let f = if *calls > 0 { FinishReason::ToolCalls } else { f };
                    yield Ok(text_chunk(i, "", Some(f)));
                }
            } else if !d.text.is_empty()
                || d.finish.is_some()
                || lps.is_some()
                || d.token_ids.as_ref().is_some_and(|t| !t.is_empty())
            {
                yield Ok(if fast {
                    chunks.delta(&d.text, d.finish)
                } else {
                    let v = shape.delta(&d.text, d.finish, include_usage);
                    with(i, ids(v, &mut d), lps)
                });
            }
            if d.finish.is_some() {
                st.done = true;
                if state.iter().all(|s| s.done) {
                    break;
                }
            }
            next = out.next().await;
        }
        if include_usage && let Some(u) = usage {
            yield Ok(event(&shape.usage_chunk(u).to_string()));
        }
        if failed {
            // The other choices are killed with their guards.
            drop(guards);
        } else {
            guards.into_iter().for_each(dyn_core::ctx::KillOnDrop::disarm);
            track.finish("success");
        }
        yield Ok(Bytes::from_static(b"data: [DONE]\n\n"));
    }
}

/// What `echo` puts before the answer: the prompt as the client sent it, or the text of its
/// tokens as the engine reported them.
fn echo_text(echo: &Option<String>, prompt: &[TextLogprob]) -> String {
    match echo {
        Some(t) => t.clone(),
        None => {
            let bytes: Vec<u8> = prompt
                .iter()
                .flat_map(|l| l.bytes.iter().copied())
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
    }
}

/// One server-sent event carrying `data` (a JSON text: no newlines).
fn event(data: &str) -> Bytes {
    let mut b = Vec::with_capacity(data.len() + 8);
    b.extend_from_slice(b"data: ");
    b.extend_from_slice(data.as_bytes());
    b.extend_from_slice(b"\n\n");
    b.into()
}

/// A streamed response's token chunks, rendered from pieces fixed per request: the envelope
/// around the choice's content and its finish reason. Building every chunk as a
/// `serde_json::Value` (maps, key strings, a tree per token) cost about a sixth of the
/// frontend's CPU at 64 tokens a request; now a token costs its escaped text and a copy. The
/// pieces are cut from a chunk serde_json rendered, so key order and escaping are its own
/// (`streamed_chunks_are_the_json_values_they_replace` checks the bytes).
struct Chunks {
    /// `data: ` and the envelope up to the first slot; between the slots; after the second
    /// slot, with the closing `\n\n`.
    pieces: [Vec<u8>; 3],
    /// Whether the content slot comes before the finish reason slot.
    content_first: bool,
    chat: bool,
}

/// The first chat chunk's delta, as serde_json renders it (rendered once per process).
static ROLE_DELTA: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| json!({"role": "assistant", "content": ""}).to_string());

impl Chunks {
    fn new(shape: &Shape, include_usage: bool) -> Self {
        const CONTENT: &str = "\u{1}dyn-content\u{1}";
        const FINISH: &str = "\u{1}dyn-finish\u{1}";
        let mut v = shape.chunk(Some(json!(CONTENT)), None, include_usage);
        v["choices"][0]["finish_reason"] = json!(FINISH);
        let text = v.to_string();
        let mark = |m: &str| serde_json::to_string(m).unwrap_or_default();
        let (content, finish) = (mark(CONTENT), mark(FINISH));
        let (first, second) = match (text.find(&content), text.find(&finish)) {
            (Some(c), Some(f)) if c < f => (content.as_str(), finish.as_str()),
            _ => (finish.as_str(), content.as_str()),
        };
        let (p0, rest) = text.split_once(first).unwrap_or((&text, ""));
        let (p1, p2) = rest.split_once(second).unwrap_or((rest, ""));
        let mut head = b"data: ".to_vec();
        head.extend_from_slice(p0.as_bytes());
        let mut tail = p2.as_bytes().to_vec();
        tail.extend_from_slice(b"\n\n");
        Self {
            pieces: [head, p1.as_bytes().to_vec(), tail],
            content_first: first == content,
            chat: shape.endpoint == Endpoint::Chat,
        }
    }

    fn render(&self, content: impl FnOnce(&mut Vec<u8>), finish: Option<FinishReason>) -> Bytes {
        let [p0, p1, p2] = &self.pieces;
        let mut b = Vec::with_capacity(p0.len() + p1.len() + p2.len() + 64);
        let finish = |b: &mut Vec<u8>| match finish {
            Some(f) => {
                b.push(b'"');
                b.extend_from_slice(f.as_str().as_bytes());
                b.push(b'"');
            }
            None => b.extend_from_slice(b"null"),
        };
        b.extend_from_slice(p0);
        if self.content_first {
            content(&mut b);
            b.extend_from_slice(p1);
            finish(&mut b);
        } else {
            finish(&mut b);
            b.extend_from_slice(p1);
            content(&mut b);
        }
        b.extend_from_slice(p2);
        b.into()
    }

    /// The first chat chunk: the assistant's role and empty content.
    fn role(&self) -> Bytes {
        self.render(|b| b.extend_from_slice(ROLE_DELTA.as_bytes()), None)
    }

    fn delta(&self, text: &str, finish: Option<FinishReason>) -> Bytes {
        self.render(
            |b| {
                let quoted = |b: &mut Vec<u8>| {
                    // Writing a &str into a Vec cannot fail.
                    let _ = serde_json::to_writer(&mut *b, text);
                };
                match (self.chat, text.is_empty()) {
                    (true, true) => b.extend_from_slice(b"{}"),
                    (true, false) => {
                        b.extend_from_slice(br#"{"content":"#);
                        quoted(b);
                        b.push(b'}');
                    }
                    (false, _) => quoted(b),
                }
            },
            finish,
        )
    }
}

/// What every response object of one request shares.
struct Shape {
    id: String,
    endpoint: Endpoint,
    model: Arc<str>,
    created: u64,
}

fn usage_json(u: Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

impl Shape {
    fn object(&self, stream: bool) -> &'static str {
        match (self.endpoint, stream) {
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Completion, _) => "text_completion",
        }
    }

    fn envelope(&self, stream: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(stream),
            "created": self.created,
            "model": &*self.model,
            "choices": choices,
        })
    }

    /// A chat chunk with `delta`, or a completion chunk.
    fn chunk(
        &self,
        delta: Option<Value>,
        finish: Option<FinishReason>,
        include_usage: bool,
    ) -> Value {
        let finish = finish.map(FinishReason::as_str);
        let choice = match self.endpoint {
            Endpoint::Chat => {
                json!({"index": 0, "delta": delta.unwrap_or_else(|| json!({})), "logprobs": null, "finish_reason": finish})
            }
            Endpoint::Completion => {
                json!({"index": 0, "text": delta.unwrap_or_else(|| json!("")), "logprobs": null, "finish_reason": finish})
            }
        };
        let mut v = self.envelope(true, json!([choice]));
        if include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// A token chunk as a `Value`: what [`Chunks::delta`] renders (its test reference, and
    /// the chunks that carry log-probabilities).
    fn delta(&self, text: &str, finish: Option<FinishReason>, include_usage: bool) -> Value {
        let delta = match (self.endpoint, text.is_empty()) {
            (Endpoint::Chat, true) => json!({}),
            (Endpoint::Chat, false) => json!({"content": text}),
            (Endpoint::Completion, _) => json!(text),
        };
        self.chunk(Some(delta), finish, include_usage)
    }

    /// A choice's `logprobs`: chat's `{"content": [...]}` (each token's text, bytes,
    /// log-probability and `top_logprobs`), or completions' parallel lists (`tokens`,
    /// `token_logprobs`, `top_logprobs` as token → log-probability maps, `text_offset` from
    /// `offset`), where the echoed prompt's tokens come first, its first without a value.
    fn logprobs(&self, prompt: &[TextLogprob], answer: &[TextLogprob], offset: usize) -> Value {
        match self.endpoint {
            Endpoint::Chat => {
                let alt = |(t, b, lp): &(String, Vec<u8>, f32)| json!({"token": t, "logprob": lp, "bytes": b});
                let content: Vec<Value> = answer
                    .iter()
                    .map(|l| {
                        json!({"token": l.token, "logprob": l.logprob, "bytes": l.bytes,
                               "top_logprobs": l.top.iter().map(alt).collect::<Vec<_>>()})
                    })
                    .collect();
                json!({"content": content})
            }
            Endpoint::Completion => {
                let all = prompt.iter().chain(answer);
                let mut at = offset;
                let mut offsets = Vec::new();
                for l in all.clone() {
                    offsets.push(at);
                    at += l.token.chars().count();
                }
                let top = |l: &TextLogprob| match l.logprob {
                    None => Value::Null,
                    Some(_) => {
                        // Best first: a text two tokens share keeps the likelier one's value.
                        let mut m = serde_json::Map::new();
                        for (t, _, lp) in &l.top {
                            m.entry(t.clone()).or_insert_with(|| json!(lp));
                        }
                        // As OpenAI and vLLM: the sampled token is among them, top or not.
                        m.entry(l.token.clone()).or_insert_with(|| json!(l.logprob));
                        Value::Object(m)
                    }
                };
                json!({
                    "tokens": all.clone().map(|l| &l.token).collect::<Vec<_>>(),
                    "token_logprobs": all.clone().map(|l| l.logprob).collect::<Vec<_>>(),
                    "top_logprobs": all.map(top).collect::<Vec<_>>(),
                    "text_offset": offsets,
                })
            }
        }
    }

    fn usage_chunk(&self, u: Usage) -> Value {
        let mut v = self.envelope(true, json!([]));
        v["usage"] = usage_json(u);
        v
    }

    /// A call's id, unique per request and call.
    fn call_id(&self, index: usize) -> String {
        let id = self.id.strip_prefix("chatcmpl-").unwrap_or(&self.id);
        format!("call_{id}_{index}")
    }

    /// A streamed chunk carrying one whole tool call (OpenAI streams a call's name and
    /// arguments in pieces; clients accumulate either the same way).
    fn call_chunk(&self, index: usize, c: &ToolCall, include_usage: bool) -> Value {
        let call = json!({"index": index, "id": self.call_id(index), "type": "function",
            "function": {"name": c.name, "arguments": c.arguments}});
        self.chunk(Some(json!({"tool_calls": [call]})), None, include_usage)
    }

    /// A chat answer parsed for tool calls: `content` the text (null when only calls), and
    /// `finish_reason` `tool_calls` when there are any.
    fn full_with_calls(
        &self,
        pieces: &[Piece],
        finish: Option<FinishReason>,
        usage: Usage,
    ) -> Value {
        let mut text = String::new();
        let mut reasoning = String::new();
        let mut calls = Vec::new();
        for p in pieces {
            match p {
                Piece::Text(t) => text.push_str(t),
                Piece::Reasoning(r) => reasoning.push_str(r),
                Piece::Call(c) => calls
                    .push(json!({"id": self.call_id(calls.len()), "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments}})),
            }
        }
        let mut v = self.full(&text, finish, usage);
        if !reasoning.is_empty() {
            v["choices"][0]["message"]["reasoning_content"] = json!(reasoning);
        }
        if !calls.is_empty() {
            let choice = &mut v["choices"][0];
            if text.trim().is_empty() {
                choice["message"]["content"] = Value::Null;
            }
            choice["message"]["tool_calls"] = Value::Array(calls);
            choice["finish_reason"] = json!(FinishReason::ToolCalls.as_str());
        }
        v
    }

    /// A unary answer's choice: its text (after the echoed prompt), tool calls parsed out,
    /// and its log-probabilities.
    fn choice(&self, opts: &Options, mut c: Collected) -> Value {
        let reasoning = opts.reasoning.map(|f| {
            let split = ReasoningParser::new(f).feed(&c.text, true);
            c.text = split.content;
            split.reasoning
        });
        let mut v = if let Some(format) = opts.tools {
            let mut p = ToolParser::new(format);
            let mut pieces = p.push(&c.text);
            pieces.extend(p.finish());
            self.full_with_calls(&pieces, c.finish, c.usage)
        } else {
            let text = match &c.echo {
                Some(e) => echo_text(e, &c.prompt_logprobs) + &c.text,
                None => c.text,
            };
            self.full(&text, c.finish, c.usage)
        };
        let mut choice = v["choices"][0].take();
        if opts.token_ids {
            choice["token_ids"] = json!(c.token_ids);
            if self.endpoint == Endpoint::Completion {
                choice["prompt_token_ids"] = json!(c.prompt_token_ids);
            }
        }
        if let Some(r) = reasoning {
            choice["message"]["reasoning_content"] =
                if r.is_empty() { Value::Null } else { json!(r) };
        }
        if opts.logprobs {
            let prompt = if c.echo.is_some() {
                &c.prompt_logprobs[..]
            } else {
                &[]
            };
            choice["logprobs"] = self.logprobs(prompt, &c.logprobs, 0);
        }
        choice
    }

    fn full(&self, text: &str, finish: Option<FinishReason>, usage: Usage) -> Value {
        let finish = finish.map(FinishReason::as_str);
        let choice = match self.endpoint {
            Endpoint::Chat => {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish})
            }
            Endpoint::Completion => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
            }
        };
        let mut v = self.envelope(false, json!([choice]));
        v["usage"] = usage_json(usage);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_not_honoured_yet_are_refused_by_name_and_their_defaults_pass() {
        let refused = |extra: Value| {
            let mut body = json!({"model": "m", "messages": []});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            let b: ChatBody = serde_json::from_value(body).unwrap();
            refuse_unsupported(&b.common.unsupported)
                .err()
                .map(|e| e.param.unwrap_or_default())
        };
        // What clients send by default asks for nothing.
        let defaults = json!({"tools": [], "tool_choice": "none", "response_format": {"type": "text"},
            "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
            "min_p": 0, "stop_token_ids": [], "top_logprobs": null, "parallel_tool_calls": true,
            "suffix": "", "best_of": 1, "modalities": ["text"], "store": false, "service_tier": "auto",
            "user": "u", "metadata": {"a": "b"}, "include_stop_str_in_output": false,
            "skip_special_tokens": true, "chat_template_kwargs": {}, "add_generation_prompt": true,
            "continue_final_message": false, "prompt_logprobs": null, "use_beam_search": false,
            "bad_words": [], "allowed_token_ids": null, "echo": false});
        assert_eq!(refused(defaults), None);
        for (extra, param) in [
            (json!({"functions": [{"name": "f"}]}), "functions"),
            (json!({"suffix": "}"}), "suffix"),
            (json!({"best_of": 3}), "best_of"),
            (json!({"reasoning_effort": "high"}), "reasoning_effort"),
            (json!({"modalities": ["text", "audio"]}), "modalities"),
            (
                json!({"include_stop_str_in_output": true}),
                "include_stop_str_in_output",
            ),
            (
                json!({"chat_template_kwargs": {"enable_thinking": false}}),
                "chat_template_kwargs",
            ),
            (json!({"prompt_logprobs": 1}), "prompt_logprobs"),
            (json!({"allowed_token_ids": [1, 2]}), "allowed_token_ids"),
            (json!({"echo": true}), "echo"),
        ] {
            assert_eq!(refused(extra).as_deref(), Some(param));
        }
    }

    #[test]
    fn structured_outputs_are_read_from_each_dialect_and_bad_ones_named() {
        let read = |extra: Value| {
            let mut body = json!({"model": "m", "messages": []});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            let b: ChatBody = serde_json::from_value(body).unwrap();
            constraint(&b.common).map_err(|e| e.param.unwrap_or_default())
        };
        let schema = json!({"type": "object"});
        for (extra, want) in [
            (json!({"response_format": {"type": "text"}}), None),
            (
                json!({"response_format": {"type": "json_object"}}),
                Some(Constraint::JsonObject),
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
                Some(Constraint::JsonSchema(schema.clone())),
            ),
            (
                json!({"structured_outputs": {"regex": "a+"}}),
                Some(Constraint::Regex("a+".into())),
            ),
            (
                json!({"structured_outputs": {"choice": ["a", "b"]}}),
                Some(Constraint::Choice(vec!["a".into(), "b".into()])),
            ),
            (
                json!({"guided_json": "{\"type\": \"object\"}"}),
                Some(Constraint::JsonSchema(schema.clone())),
            ),
            (
                json!({"guided_grammar": "start: \"x\""}),
                Some(Constraint::Lark("start: \"x\"".into())),
            ),
        ] {
            assert_eq!(read(extra.clone()), Ok(want), "{extra}");
        }
        for (extra, param) in [
            (
                json!({"response_format": {"type": "xml"}}),
                "response_format.type",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"structured_outputs": {"choice": []}}),
                "structured_outputs.choice",
            ),
            (
                json!({"structured_outputs": {"structural_tag": "x"}}),
                "structured_outputs.structural_tag",
            ),
            (
                json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
                "guided_regex",
            ),
        ] {
            assert_eq!(read(extra.clone()), Err(param.to_string()), "{extra}");
        }
    }

    #[test]
    fn stop_accepts_a_string_or_a_list_and_names_what_it_expected() {
        let c: Common = serde_json::from_str(r#"{"model": "m", "stop": "x"}"#).expect("one");
        assert!(matches!(c.stop, Some(StopIn::One(_))));
        let c: Common =
            serde_json::from_str(r#"{"model": "m", "stop": ["x", "y"]}"#).expect("many");
        assert!(matches!(c.stop, Some(StopIn::Many(v)) if v.len() == 2));
        let e = serde_json::from_str::<Common>(r#"{"model": "m", "stop": 3}"#).expect_err("bad");
        assert!(
            e.to_string().contains("a string or a list of strings"),
            "{e}"
        );
    }

    #[test]
    fn chunks_have_openai_shapes() {
        let s = Shape {
            id: "chatcmpl-1".into(),
            endpoint: Endpoint::Chat,
            model: "tiny".into(),
            created: 5,
        };
        let c = s.delta("hi", None, true);
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["choices"][0]["delta"]["content"], "hi");
        assert!(c["usage"].is_null() && c.get("usage").is_some());
        let u = s.usage_chunk(Usage {
            prompt_tokens: 3,
            completion_tokens: 4,
        });
        assert_eq!(u["choices"], json!([]));
        assert_eq!(u["usage"]["total_tokens"], 7);
        let f = s.full("hey", Some(FinishReason::Length), Usage::default());
        assert_eq!(f["choices"][0]["message"]["content"], "hey");
        assert_eq!(f["choices"][0]["finish_reason"], "length");
    }

    #[test]
    fn streamed_chunks_are_the_json_values_they_replace() {
        for endpoint in [Endpoint::Chat, Endpoint::Completion] {
            let s = Shape {
                id: "chatcmpl-\"quoted\"-1".into(),
                endpoint,
                model: "tiny/\u{e9}\\model".into(),
                created: 1_795_448_917,
            };
            for include_usage in [false, true] {
                let chunks = Chunks::new(&s, include_usage);
                for text in ["", "hi", " \"quote\" \\ back\nline\t\u{1}", "日本語 🙂"] {
                    for finish in [None, Some(FinishReason::Stop), Some(FinishReason::Length)] {
                        let want = event(&s.delta(text, finish, include_usage).to_string());
                        assert_eq!(
                            chunks.delta(text, finish),
                            want,
                            "{endpoint:?} {text:?} {finish:?} usage {include_usage}"
                        );
                    }
                }
                if endpoint == Endpoint::Chat {
                    let role = s.chunk(
                        Some(json!({"role": "assistant", "content": ""})),
                        None,
                        include_usage,
                    );
                    assert_eq!(chunks.role(), event(&role.to_string()));
                }
            }
        }
    }
}
