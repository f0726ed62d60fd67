//! What every HTTP ingress runs on: request ids, the key checks, health routes, the
//! operators' routes kept to loopback, and serving with graceful shutdown ([`serve`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Json;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use dyn_core::{Chain, OpError, Payload, ShutdownSignal};
use serde_json::json;
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;
use tower_http::request_id::{MakeRequestId, PropagateRequestIdLayer, SetRequestIdLayer};

use crate::config::ServerConfig;
use crate::error::{ApiError, anthropic_error};
use crate::keys::{ApiKey, KeyTenant};
use crate::traffic::{REQUEST_ID, request_id_ok};
use crate::{conn, metrics};

/// Middleware: drop an `x-request-id` that [`request_id_ok`] refuses, so the id layer makes
/// a new one (the response then carries that, and the logs never show the client's).
async fn replace_unsafe_request_id(mut req: Request, next: Next) -> Response {
    let unsafe_id = req
        .headers()
        .get_all(REQUEST_ID)
        .iter()
        .any(|v| !v.to_str().is_ok_and(request_id_ok));
    // Several ids are one too many as well: which one is meant is not the server's guess.
    if unsafe_id || req.headers().get_all(REQUEST_ID).iter().count() > 1 {
        req.headers_mut().remove(REQUEST_ID);
    }
    next.run(req).await
}

/// The id of a request that comes without `x-request-id`: dyn's usual form (32 hex digits).
#[derive(Clone, Copy)]
struct NewRequestId;

impl MakeRequestId for NewRequestId {
    fn make_request_id<B>(
        &mut self,
        _request: &axum::http::Request<B>,
    ) -> Option<tower_http::request_id::RequestId> {
        axum::http::HeaderValue::from_str(dyn_core::RequestId::random().as_str())
            .ok()
            .map(tower_http::request_id::RequestId::new)
    }
}

/// Middleware: require `Authorization: Bearer KEY` when keys are configured.
pub async fn require_api_key(
    State(keys): State<std::sync::Arc<Vec<ApiKey>>>,
    mut req: Request,
    next: Next,
) -> Response {
    if keys.is_empty() {
        return next.run(req).await;
    }
    let given = bearer(req.headers()).unwrap_or_default();
    // Every key is compared, each in constant time, and the match is picked without a
    // branch: how long the check takes says nothing about how much of a key was right.
    let (hit, place) =
        keys.iter()
            .enumerate()
            .fold((subtle::Choice::from(0), 0u64), |(hit, place), (i, key)| {
                let eq = key.key().as_bytes().ct_eq(given.as_bytes());
                (
                    hit | eq,
                    subtle::ConditionallySelectable::conditional_select(&place, &(i as u64), eq),
                )
            });
    if bool::from(hit) && !given.is_empty() {
        let place = usize::try_from(place).unwrap_or_default();
        if let Some(k) = keys.get(place) {
            let named = matches!(k, ApiKey::Named(_));
            req.extensions_mut()
                .insert(KeyTenant(k.tenant(place), named));
        }
        return next.run(req).await;
    }
    let e = ApiError::new(
        StatusCode::UNAUTHORIZED,
        "invalid_request_error",
        "invalid_api_key",
        "missing or invalid API key",
    );
    // Anthropic's clients read their own error shape.
    if req.uri().path().starts_with("/v1/messages") {
        return anthropic_error(e);
    }
    e.into_response()
}

pub async fn health() -> Json<serde_json::Value> {
    Json(json!({"status": "healthy"}))
}

pub async fn live() -> Json<serde_json::Value> {
    Json(json!({"status": "live"}))
}

pub async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "not_found",
        "no such route",
    )
}

/// An ingress's routes and the limits of the connections that reach them.
pub struct HttpApp {
    router: axum::Router,
    max_connections: usize,
    header_read_timeout: Duration,
    write_timeout: Duration,
}

/// The whole app of an HTTP ingress: its `api` routes behind the API-key check, its `open`
/// routes (metrics and the like, each behind its own key when set) and the probes without
/// it, a JSON 404 and the body limit. Every request has an `x-request-id` (the client's when
/// [`request_id_ok`], else a new one), echoed on the response. A server on loopback answers only requests addressed to
/// a loopback name (`Host`), so a web page cannot reach it through DNS rebinding.
pub fn app(config: &ServerConfig, api: axum::Router, open: axum::Router) -> HttpApp {
    let keys = std::sync::Arc::new(config.api_keys.clone());
    let ops = Arc::new(OpsKeys {
        metrics: config.metrics_key.clone(),
        admin: config.admin_key.clone(),
    });
    let mut router = axum::Router::new()
        .merge(api.route_layer(axum::middleware::from_fn_with_state(keys, require_api_key)))
        // `layer`, not `route_layer`: an ingress may have no open routes at all.
        .merge(open.layer(axum::middleware::from_fn_with_state(ops, require_ops_key)))
        .route("/health", axum::routing::get(health))
        .route("/live", axum::routing::get(live))
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(config.max_body_bytes));
    if config
        .listen
        .parse::<SocketAddr>()
        .is_ok_and(|a| a.ip().is_loopback())
        && !config.allowed_hosts.iter().any(|h| h == "*")
    {
        let allowed: Arc<Vec<String>> = Arc::new(
            config
                .allowed_hosts
                .iter()
                .map(|h| h.to_ascii_lowercase())
                .collect(),
        );
        router = router.layer(axum::middleware::from_fn_with_state(
            allowed,
            loopback_host_only,
        ));
    }
    HttpApp {
        router: router
            .layer(PropagateRequestIdLayer::x_request_id())
            .layer(SetRequestIdLayer::x_request_id(NewRequestId))
            // Outermost: an unsafe id is gone before the id layer looks for one.
            .layer(axum::middleware::from_fn(replace_unsafe_request_id)),
        max_connections: config.max_connections,
        header_read_timeout: Duration::from_secs_f64(config.header_read_timeout_s),
        write_timeout: Duration::from_secs_f64(config.write_timeout_s),
    }
}

/// The keys of the operators' routes.
struct OpsKeys {
    metrics: Option<String>,
    admin: Option<String>,
}

async fn require_ops_key(State(keys): State<Arc<OpsKeys>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let want = if path == "/metrics" {
        keys.metrics.as_deref()
    } else if path.starts_with("/admin") || path.ends_with("_lora_adapter") {
        keys.admin.as_deref()
    } else {
        None
    };
    let Some(want) = want else {
        return next.run(req).await;
    };
    let given = bearer(req.headers()).unwrap_or_default();
    if bool::from(given.as_bytes().ct_eq(want.as_bytes())) {
        return next.run(req).await;
    }
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "invalid_request_error",
        "invalid_api_key",
        "missing or invalid key for this endpoint",
    )
    .into_response()
}

/// The token of an `Authorization: Bearer` header, else of an `x-api-key` header (what
/// Anthropic's clients send).
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let bearer = || {
        headers
            .get(header::AUTHORIZATION)?
            .to_str()
            .ok()?
            .strip_prefix("Bearer ")
    };
    bearer().or_else(|| headers.get("x-api-key")?.to_str().ok())
}

/// Whether `host` (a `Host` header or an address: name or IP, maybe a port) names this
/// machine's loopback interface.
pub fn loopback_host(host: &str) -> bool {
    let name = dyn_trust::host_of(host);
    name.eq_ignore_ascii_case("localhost")
        || name.to_ascii_lowercase().ends_with(".localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

async fn loopback_host_only(
    State(allowed): State<Arc<Vec<String>>>,
    req: Request,
    next: Next,
) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .map(|h| h.to_str().unwrap_or("?"));
    let named = |h: &str| {
        let h = h.to_ascii_lowercase();
        let name = dyn_trust::host_of(&h);
        allowed.iter().any(|a| *a == h || *a == name)
    };
    if host.is_none_or(|h| loopback_host(h) || named(h)) {
        return next.run(req).await;
    }
    ApiError::new(
        StatusCode::MISDIRECTED_REQUEST,
        "invalid_request_error",
        "misdirected_request",
        "this server listens on loopback and answers requests for localhost only (Host header)",
    )
    .into_response()
}

/// Serve `app` until shutdown, then drain: while requests sent down `chain` are still
/// streaming, the listener stays open so load balancers can see `/health`
/// answer 503 and new API requests get a 503 `draining` error; once nothing is in flight the
/// server closes (the runtime bounds how long all this may take).
pub async fn serve<Req: Payload, Resp: Payload>(
    listener: TcpListener,
    app: HttpApp,
    shutdown: ShutdownSignal,
    chain: Chain<Req, Resp>,
) -> Result<(), OpError> {
    let draining = Arc::new(AtomicBool::new(false));
    let router = app.router.layer(axum::middleware::from_fn_with_state(
        draining.clone(),
        refuse_while_draining,
    ));
    let closed = async move {
        shutdown.await;
        draining.store(true, Ordering::Release);
        tracing::info!(
            in_flight = chain.in_flight(),
            "Draining: /health answers 503, new requests are refused"
        );
        chain.drained().await;
    };
    // hyper's own connection loop rather than `axum::serve`, which installs no timer: without
    // one hyper cannot time out a client that never finishes its headers.
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(app.header_read_timeout);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(app.max_connections));
    tokio::pin!(closed);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "HTTP accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut closed => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!(peer = %peer, "Connection limit reached; closing a new connection");
            continue;
        };
        // Streamed tokens are small writes: with Nagle's algorithm on, each one after the
        // first waits for the client's (delayed) ACK, ~40 ms on Linux, which paced every
        // stream.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
        // Peer addresses reach the handlers: the admin routes answer loopback clients only.
        let router = router.clone();
        let service =
            hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                req.extensions_mut()
                    .insert(axum::extract::ConnectInfo(peer));
                tower::ServiceExt::oneshot(router.clone(), req)
            });
        // hyper times out reading headers but not writing: a client that stops reading
        // would hold its place and its request for ever (`conn`).
        let io = conn::WriteDeadline::new(tcp, app.write_timeout, peer);
        let conn = graceful.watch(http.serve_connection(hyper_util::rt::TokioIo::new(io), service));
        let open = metrics::FRONTEND.connections.clone();
        open.inc();
        tokio::spawn(async move {
            // Ending here drops the connection's response body, and with it the request's
            // stream: cancellation reaches the engine.
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "HTTP connection ended with an error");
            }
            open.dec();
            drop(slot);
        });
    }
    // The requests sent down the chain are answered by now (the drain waited for them);
    // others (metrics, admin, the end of a stream being written) get a few seconds more, then
    // their connections are dropped with the process.
    let _ = tokio::time::timeout(Duration::from_secs(5), graceful.shutdown()).await;
    Ok(())
}

async fn refuse_while_draining(
    State(draining): State<Arc<AtomicBool>>,
    req: Request,
    next: Next,
) -> Response {
    if !draining.load(Ordering::Acquire) {
        return next.run(req).await;
    }
    match req.uri().path() {
        // Liveness and metrics still answer: the process is alive and finishing its work.
        "/live" | "/metrics" => next.run(req).await,
        "/health" => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "draining"})),
        )
            .into_response(),
        _ => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "draining",
            "the server is shutting down; retry on another replica",
        )
        .into_response(),
    }
}
