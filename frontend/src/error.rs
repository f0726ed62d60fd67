//! The errors clients see: OpenAI error objects (`{"error": {"message", "type", "param",
//! "code"}}`) with a stable `type` and `code` ([`ApiError`]), made from the graph's errors and
//! from bodies that cannot be read.

use std::borrow::Cow;

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use dyn_core::{ErrorKind, OpError};
use serde::Deserialize;
use serde_json::{Value, json};

/// An error response in OpenAI's shape.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: Cow<'static, str>,
    pub message: String,
    pub param: Option<String>,
    /// Seconds for `Retry-After` (a 503 says 1 unless told).
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: impl Into<Cow<'static, str>>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            kind,
            code: code.into(),
            message: message.into(),
            param: None,
            retry_after_s: None,
        }
    }

    pub fn invalid(code: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message,
        )
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

/// What a failure is for the client when it came as the request's deadline passed (`late`):
/// the deadline's (504), unless it is a refusal for want of room or workers, which keeps its
/// 503 and `Retry-After`. Both ingresses answer so.
pub(crate) fn at_deadline(e: ApiError, late: bool) -> ApiError {
    if late && e.status != StatusCode::SERVICE_UNAVAILABLE {
        OpError::deadline_exceeded().into()
    } else {
        e
    }
}

impl From<OpError> for ApiError {
    fn from(e: OpError) -> Self {
        let param = e.param;
        let retry_after_s = e.retry_after_s;
        let mut api = match e.kind {
            ErrorKind::InvalidRequest => ApiError::invalid(
                e.code.unwrap_or(Cow::Borrowed("invalid_request")),
                e.message,
            ),
            ErrorKind::Unavailable => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                e.code.unwrap_or(Cow::Borrowed("no_worker_available")),
                e.message,
            ),
            ErrorKind::Overloaded => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                e.code.unwrap_or(Cow::Borrowed(dyn_core::WORKER_BUSY)),
                e.message,
            ),
            ErrorKind::RateLimited => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                e.code
                    .unwrap_or(Cow::Borrowed(dyn_core::RATE_LIMIT_EXCEEDED)),
                e.message,
            ),
            ErrorKind::InstanceLost => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                e.code.unwrap_or(Cow::Borrowed(dyn_core::INSTANCE_LOST)),
                e.message,
            ),
            ErrorKind::Cancelled if e.code.as_deref() == Some(dyn_core::DEADLINE_EXCEEDED) => {
                ApiError::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "timeout_error",
                    dyn_core::DEADLINE_EXCEEDED,
                    e.message,
                )
            }
            ErrorKind::Cancelled => ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "request_cancelled",
                "cancelled",
                e.message,
            ),
            ErrorKind::Internal => {
                tracing::error!(error = %e.message, "Internal error answered as 500");
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal_error",
                    "internal_error",
                    "internal error",
                )
            }
        };
        api.param = param;
        api.retry_after_s = retry_after_s;
        api
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        // A refusal for want of room (or over a rate limit) may be asked again; say when
        // (RFC 9110 §10.2.3).
        let retry = match self.status {
            StatusCode::SERVICE_UNAVAILABLE => Some(self.retry_after_s.unwrap_or(1)),
            StatusCode::TOO_MANY_REQUESTS => self.retry_after_s,
            _ => None,
        };
        if let Some(s) = retry {
            return (
                self.status,
                [(axum::http::header::RETRY_AFTER, s.max(1).to_string())],
                Json(self.body()),
            )
                .into_response();
        }
        (self.status, Json(self.body())).into_response()
    }
}

/// Turn an axum body rejection (too large, unreadable) into an OpenAI error.
pub fn body_error(rejection: axum::extract::rejection::BytesRejection) -> ApiError {
    let status = rejection.status();
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::new(
            status,
            "invalid_request_error",
            "request_too_large",
            "request body is too large",
        )
    } else {
        ApiError::new(
            status,
            "invalid_request_error",
            "invalid_body",
            rejection.body_text(),
        )
    }
}

/// A 400 for a field whose value is wrong (`invalid_value`), naming the field.
pub(crate) fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
    ApiError::invalid("invalid_value", message).with_param(param)
}

/// Parse a JSON body with serde's message (line, column, field) as the client's error: code
/// `invalid_json` where the body is not JSON, `invalid_value` where it is JSON of the wrong
/// shape (a field missing, of another type, a value out of its set).
pub fn parse_json<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let code = match e.classify() {
            serde_json::error::Category::Data => "invalid_value",
            _ => "invalid_json",
        };
        ApiError::invalid(code, format!("invalid request body: {e}"))
    })
}

/// Anthropic's error types by status.
fn anthropic_error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        504 => "timeout_error",
        _ => "api_error",
    }
}

/// An error's body in Anthropic's shape.
pub(crate) fn anthropic_error_body(e: &ApiError) -> Value {
    let mut message = e.message.clone();
    if let Some(p) = &e.param {
        message = format!("{p}: {message}");
    }
    json!({"type": "error", "error": {"type": anthropic_error_type(e.status), "message": message}})
}

/// An error as Anthropic's clients read it (status, `Retry-After` as OpenAI's routes send it).
pub(crate) fn anthropic_error(e: ApiError) -> Response {
    let body = anthropic_error_body(&e);
    let mut r = e.into_response();
    *r.body_mut() = axum::body::Body::from(body.to_string());
    r
}
