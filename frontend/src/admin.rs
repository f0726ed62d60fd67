//! The admin endpoint `dyn inspect` talks to, served by the `http` ingress under `/admin`,
//! apart from the OpenAI API and answered only to clients on the loopback interface (whatever
//! address the server listens on): it shows routing state and has no API-key check.
//!
//! - `GET /admin/nodes`: the inspectable nodes of this process;
//! - `POST /admin/nodes/{node}/{query}` with JSON args: a node's answer per replica
//!   (see [`dyn_core::Inspect`]; route nodes answer `workers`, `route`, `kv`);
//! - `POST /admin/route` with `{"node"?, "model"?, "prompt" | "messages"}`: the prompt goes
//!   through the same chat template and tokenizer as a real request of that model (default:
//!   the first the ingress serves), then the router explains where it would send it, without
//!   sending it;
//! - `GET /admin/events[?node=NODE]`: the workers' KV events as server-sent events;
//! - `GET /admin/planner`: the SLA planner's latest decision (404 while none was published).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Json;
use axum::extract::{ConnectInfo, Path, Query, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use dyn_core::Inspectables;
use dyn_core::planes::EventBus;
use dyn_llm::preprocess::Preprocess;
use dyn_planner::state::PlannerView;
use dyn_protocol::kv::RouterEvent;
use dyn_protocol::types::{ChatMessage, Endpoint, LlmRequest, Prompt};
use dyn_router::inspect::{Query as RouterQuery, Replicas, RouteAnswer, RouteArgs};
use dyn_router::remote_prefill::PrefillRouteAnswer;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::ApiError;

/// What the admin routes need from the process they run in.
#[derive(Clone)]
pub struct Admin {
    pub inspect: Arc<Inspectables>,
    pub events: Arc<dyn EventBus>,
    pub namespace: String,
    /// Each model the ingress serves, with what tokenizes prompts for `/admin/route` exactly
    /// as its `preprocess` would.
    pub models: Vec<(String, Arc<Preprocess>)>,
    /// The SLA planner's latest decision, wherever it runs.
    pub planner: Arc<PlannerView>,
    /// What a `model` names (a model or one of its adapters), in `models`' order.
    pub catalog: Arc<super::lora::Catalog>,
}

pub fn router(admin: Admin) -> axum::Router {
    axum::Router::new()
        .route("/admin/nodes", get(nodes))
        .route("/admin/nodes/{node}/{query}", post(query))
        .route("/admin/route", post(route))
        .route("/admin/events", get(events))
        .route("/admin/planner", get(planner))
        .route_layer(axum::middleware::from_fn(loopback_only))
        .with_state(admin)
}

async fn loopback_only(req: Request, next: Next) -> Response {
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip());
    // (An IPv4 client of a dual-stack listener shows as `::ffff:127.0.0.1`.)
    if peer.is_some_and(|ip| ip.to_canonical().is_loopback()) {
        return next.run(req).await;
    }
    ApiError::new(
        StatusCode::FORBIDDEN,
        "invalid_request_error",
        "forbidden",
        "the admin endpoint answers loopback clients only",
    )
    .into_response()
}

async fn planner(State(admin): State<Admin>) -> Response {
    match admin.planner.latest() {
        Some(s) => Json(s).into_response(),
        None => ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "no_planner",
            "no planner decision seen yet: the graph has no `planner:` section, or its first interval has not ended",
        )
        .into_response(),
    }
}

fn not_found(node: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "node_not_found",
        format!("no inspectable node '{node}' in this process"),
    )
}

async fn nodes(State(a): State<Admin>) -> Json<Value> {
    Json(json!({"namespace": a.namespace, "nodes": a.inspect.nodes()}))
}

/// Every replica's answer, or the first error as a 400.
fn ask(a: &Admin, node: &str, query: &str, args: &Value) -> Result<Value, ApiError> {
    let replicas = a.inspect.get(node);
    if replicas.is_empty() {
        return Err(not_found(node));
    }
    let answers = replicas
        .iter()
        .map(|r| r.inspect(query, args))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|m| ApiError::invalid("invalid_query", m))?;
    Ok(json!({"node": node, "replicas": answers}))
}

/// A router's (or remote prefill node's) answer to a typed query.
fn ask_router(a: &Admin, node: &str, q: &RouterQuery) -> Result<Value, ApiError> {
    ask(a, node, q.name(), &q.args())
}

async fn query(
    State(a): State<Admin>,
    Path((node, q)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    let args = if body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::invalid("invalid_json", format!("invalid JSON args: {e}")))?
    };
    ask(&a, &node, &q, &args).map(Json)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteBody {
    #[serde(default)]
    node: Option<String>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    /// The session the request would belong to (`session_affinity`).
    #[serde(default)]
    session: Option<String>,
}

async fn route(State(a): State<Admin>, body: axum::body::Bytes) -> Result<Json<Value>, ApiError> {
    let b: RouteBody = serde_json::from_slice(&body)
        .map_err(|e| ApiError::invalid("invalid_json", format!("invalid body: {e}")))?;
    let (endpoint, prompt) = match (b.prompt, b.messages) {
        (Some(p), None) => (Endpoint::Completion, Prompt::Text(p)),
        (None, Some(m)) if !m.is_empty() => (Endpoint::Chat, Prompt::Messages(m)),
        _ => {
            return Err(ApiError::invalid(
                "invalid_request",
                "give either \"prompt\" or a non-empty \"messages\" list",
            ));
        }
    };
    // A model, or an adapter: its model's tokenizer, and its blocks hashed under it (a 404
    // naming what is served otherwise, as for a request).
    let (i, lora) = match &b.model {
        None => (0, None),
        Some(m) => a.catalog.resolve(m)?,
    };
    let Some((model, preprocess)) = a.models.get(i) else {
        return Err(ApiError::from(dyn_core::OpError::internal(
            "the ingress serves no model",
        )));
    };
    let req = LlmRequest {
        endpoint,
        model: model.clone(),
        prompt,
        sampling: Default::default(),
        routing: Default::default(),
        limits: Default::default(),
        tools: Vec::new(),
    };
    let pre = preprocess.preprocess(req).await.map_err(ApiError::from)?;
    let mut args = RouteArgs {
        tokens: pre.token_ids,
        cached_tokens: 0,
        session: b.session,
        lora: lora.as_ref().map(dyn_protocol::types::LoraRef::key),
    };
    let route = RouterQuery::Route(args.clone());
    if let Some(node) = b.node {
        return ask_router(&a, &node, &route).map(Json);
    }
    // Every inspectable node on the path explains its part: the router its choice of worker,
    // then a remote prefill node its decision, given what that worker caches.
    // (`nodes()` lists only nodes with a live replica.)
    let mut routers = Vec::new();
    let mut prefills = Vec::new();
    for node in a.inspect.nodes() {
        let answer = ask_router(&a, &node, &route)?;
        if serde_json::from_value::<Replicas<PrefillRouteAnswer>>(answer.clone()).is_ok() {
            prefills.push(node);
        } else {
            routers.push(answer);
        }
    }
    let mut answer = match routers.len() {
        1 => routers.remove(0),
        0 if prefills.is_empty() => return Err(not_found("(any)")),
        _ => {
            return Err(ApiError::invalid(
                "invalid_request",
                format!(
                    "several inspectable nodes ({}); name one with \"node\"",
                    a.inspect.nodes().join(", ")
                ),
            ));
        }
    };
    if let Some(node) = prefills.first() {
        let router: Replicas<RouteAnswer> =
            serde_json::from_value(answer.clone()).map_err(|e| {
                ApiError::invalid("invalid_query", format!("not a router's answer: {e}"))
            })?;
        args.cached_tokens = router
            .replicas
            .first()
            .map_or(0, RouteAnswer::cached_tokens);
        answer["prefill"] = ask_router(&a, node, &RouterQuery::Route(args))?;
    }
    Ok(Json(answer))
}

/// One KV event as `/admin/events` streams it (an SSE `data:` line).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EventLine {
    pub subject: String,
    pub event: RouterEvent,
}

#[derive(Deserialize)]
struct EventsQuery {
    node: Option<String>,
}

async fn events(
    State(a): State<Admin>,
    Query(q): Query<EventsQuery>,
) -> Result<Response, ApiError> {
    let node = q.node.as_deref().unwrap_or("*");
    let subject = format!("dyn.{}.{node}.kv_events", a.namespace);
    let sub = a.events.subscribe(&subject).await.map_err(|e| {
        ApiError::invalid("invalid_request", format!("cannot follow {subject}: {e}"))
    })?;
    let stream = sub.filter_map(|ev| {
        let line = match serde_json::from_slice::<RouterEvent>(&ev.payload) {
            Ok(event) => serde_json::to_string(&EventLine {
                subject: ev.subject,
                event,
            })
            .ok(),
            Err(e) => {
                tracing::warn!(subject = %ev.subject, error = %e, "Not showing a malformed KV event");
                None
            }
        };
        std::future::ready(line.map(|l| Ok::<_, Infallible>(Event::default().data(l))))
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}
