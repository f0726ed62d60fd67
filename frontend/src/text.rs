//! `http_text`: a plain-text HTTP ingress for debugging graphs before any LLM kind is involved.
//!
//! `POST /v1/text` with `{"text": "...", "stream": false}` answers `{"id", "text"}`; with
//! `"stream": true` it answers server-sent events `data: {"text": "..."}` ending in
//! `data: [DONE]`. `GET /health` and `GET /live` report readiness and liveness.

use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use dyn_core::{
    BuildCx, BuildError, Chain, Ingress, IngressConfig, Invalid, OpError, ShutdownSignal,
};
use dyn_protocol::text::Text;
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use serde::Deserialize;
use serde_json::json;
use tokio::net::TcpListener;

use super::{ApiError, ServerConfig};

/// Only the shared server settings (`listen`, `max_body_bytes`, `api_keys`).
#[derive(Debug, Clone, Deserialize)]
#[serde(transparent)]
pub struct HttpTextConfig {
    pub server: ServerConfig,
}

impl IngressConfig for HttpTextConfig {
    const KIND: &'static str = "http_text";
    const SUMMARY: &'static str =
        "HTTP ingress for plain text (POST /v1/text), for debugging graphs";
    type Ingress = HttpText;

    fn validate(&self) -> Vec<Invalid> {
        let mut out = self.server.validate();
        // Tenants and priorities steer an LLM router's admission; plain text has neither.
        if self.server.tenant_header.is_some() {
            out.push(Invalid::field(
                "tenant_header",
                "only the http ingress reads it",
            ));
        }
        if !self.server.priority_classes.is_empty() {
            out.push(Invalid::field(
                "priority_classes",
                "only the http ingress reads it",
            ));
        }
        out
    }

    async fn build(&self, cx: &BuildCx) -> Result<HttpText, BuildError> {
        Ok(HttpText {
            listener: self.server.bind(&cx.node).await?,
            config: self.server.resolved()?,
        })
    }
}

pub struct HttpText {
    listener: TcpListener,
    config: ServerConfig,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TextRequest {
    text: String,
    #[serde(default)]
    stream: bool,
}

type AppChain = Chain<Text, Text>;

impl Ingress for HttpText {
    type Request = Text;
    type Response = Text;

    fn serve(
        self: Box<Self>,
        chain: AppChain,
        shutdown: ShutdownSignal,
    ) -> BoxFuture<'static, Result<(), OpError>> {
        let api = axum::Router::new()
            .route("/v1/text", post(text))
            .with_state((chain.clone(), Arc::new(self.config.clone())));
        let app = super::app(&self.config, api, axum::Router::new());
        super::serve(self.listener, app, shutdown, chain).boxed()
    }
}

async fn text(
    State((chain, config)): State<(AppChain, Arc<ServerConfig>)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match handle(chain, &config, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn handle(
    chain: AppChain,
    config: &ServerConfig,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(super::body_error)?;
    let req: TextRequest = super::parse_json(&body)?;
    let ctx = config.request_ctx(&chain, &headers)?;
    let id = ctx.id().to_string();
    // Text has no end marker: past the deadline, an end is the deadline's, and so is an
    // error (a refusal for want of room aside).
    let deadline = ctx.deadline();
    let late = move || deadline.is_some_and(|d| std::time::Instant::now() >= d);
    let why = move |e: OpError| super::at_deadline(e.into(), late());
    // Dropped with this future or with the SSE stream: a client that hangs up kills the request.
    let guard = ctx.kill_on_drop();
    let mut out = chain.call(ctx, Text(req.text));
    if !req.stream {
        let mut text = String::new();
        while let Some(item) = out.next().await {
            text.push_str(&item.map_err(why)?.0);
        }
        if late() {
            return Err(OpError::deadline_exceeded().into());
        }
        guard.disarm();
        return Ok(Json(json!({"id": id, "text": text})).into_response());
    }
    // Wait for the first item so an early failure still gets a proper status code.
    let first = match out.next().await {
        Some(item) => Some(item.map_err(why)?),
        None if late() => return Err(OpError::deadline_exceeded().into()),
        None => None,
    };
    let events = async_stream::stream! {
        let mut failed = false;
        if let Some(Text(t)) = first {
            yield Ok::<_, Infallible>(Event::default().data(json!({"id": id, "text": t}).to_string()));
        }
        while let Some(item) = out.next().await {
            match item {
                Ok(Text(t)) => yield Ok(Event::default().data(json!({"id": id, "text": t}).to_string())),
                Err(e) => {
                    yield Ok(Event::default().data(why(e).body().to_string()));
                    failed = true;
                    break;
                }
            }
        }
        if late() && !failed {
            yield Ok(Event::default().data(ApiError::from(OpError::deadline_exceeded()).body().to_string()));
        }
        guard.disarm();
        yield Ok(Event::default().data("[DONE]"));
    };
    Ok(Sse::new(events).into_response())
}
