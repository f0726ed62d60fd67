//! The operator abstraction: one request is a typed stream in and a typed stream out.
//!
//! [`Operator`] is the one trait every processing kind implements (preprocess, route, decode,
//! postprocess, echo, ...). A unary step is simply a stream of one item. Kinds that bring
//! requests into the graph from the outside (HTTP) implement [`Ingress`] instead: they receive a
//! [`Chain`] that runs the rest of the graph for one request and hands back the response stream.
//!
//! Types stay generic inside operators; [`erase`] turns an operator into a [`DynOperator`] over
//! [`AnyPayload`] once the compiler has checked every edge.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::stream::{BoxStream, StreamExt};

use crate::ctx::{Ctx, RequestId};
use crate::payload::{AnyPayload, Payload, downcast};

/// The input side of one request.
pub type Input<T> = BoxStream<'static, T>;
/// The output side of one request; an `Err` item ends the response.
pub type Output<T> = BoxStream<'static, Result<T, OpError>>;

/// A streaming operator. See the module docs.
pub trait Operator: Send + Sync + 'static {
    type In: Payload;
    type Out: Payload;

    /// Serve one request. The returned stream is polled by the caller; dropping it abandons
    /// the request, and implementations should also watch `ctx` for stop and kill.
    fn call(&self, ctx: Ctx, input: Input<Self::In>) -> Output<Self::Out>;
}

/// An error produced while serving a request. `kind` decides what a client is told (an HTTP
/// ingress maps it to a status code); `message` is safe to show to the client, and detail for
/// operators goes to the log.
///
/// It is also what crosses the request plane when a remote node fails (serde), so a code or
/// kind this build does not know survives the trip: an unknown code is kept as sent, an
/// unknown kind reads as `internal`.
#[derive(Debug, Clone, thiserror::Error, serde::Serialize, serde::Deserialize)]
#[error("{message}")]
pub struct OpError {
    pub kind: ErrorKind,
    pub message: String,
    /// A stable machine-readable code (OpenAI's `code`, e.g. `context_length_exceeded`).
    pub code: Option<Cow<'static, str>>,
    /// The request field at fault (OpenAI's `param`).
    pub param: Option<String>,
    /// When to ask again, in seconds (HTTP's `Retry-After`), where the refusal knows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_s: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The request itself is wrong (4xx).
    InvalidRequest,
    /// No replica can take the request now (503): none is registered, or none is up.
    Unavailable,
    /// The replica is alive but refused the request because it is full (its queue, an
    /// external server's 429). Never migrated: sending it on at once only moves the overload
    /// (503 with a `Retry-After`).
    Overloaded,
    /// The replica serving the request was lost: it died, could not be reached, was leaving,
    /// or broke off the stream. The one kind request migration resends (503 once migration
    /// gives up).
    InstanceLost,
    /// The request was cancelled or passed its deadline.
    Cancelled,
    /// The client (its tenant) is over its rate limit (429 `rate_limit_exceeded`, with a
    /// `Retry-After`). Never resent.
    RateLimited,
    /// A bug or an unexpected failure (500).
    #[serde(other)]
    Internal,
}

impl OpError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            code: None,
            param: None,
            retry_after_s: None,
        }
    }
    /// Say when to ask again.
    pub fn with_retry_after(mut self, seconds: u64) -> Self {
        self.retry_after_s = Some(seconds);
        self
    }
    /// Attach a stable error code.
    pub fn with_code(mut self, code: impl Into<Cow<'static, str>>) -> Self {
        self.code = Some(code.into());
        self
    }
    /// Name the request field at fault.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidRequest, message)
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unavailable, message)
    }
    /// A replica refusing work it has no room for (code `worker_busy` unless another is set).
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Overloaded, message).with_code(WORKER_BUSY)
    }
    /// Over a rate limit (code `rate_limit_exceeded`); ask again in `retry_after_s`.
    pub fn rate_limited(message: impl Into<String>, retry_after_s: u64) -> Self {
        Self::new(ErrorKind::RateLimited, message)
            .with_code(RATE_LIMIT_EXCEEDED)
            .with_retry_after(retry_after_s)
    }
    /// The replica serving the request is gone (code `instance_lost`).
    pub fn instance_lost(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InstanceLost, message).with_code(INSTANCE_LOST)
    }
    pub fn cancelled() -> Self {
        Self::new(ErrorKind::Cancelled, "request cancelled")
    }
    /// The request's deadline ([`crate::Ctx::deadline`]) passed before its answer was
    /// complete (code `deadline_exceeded`).
    pub fn deadline_exceeded() -> Self {
        Self::new(
            ErrorKind::Cancelled,
            "the request's deadline passed before its answer was complete",
        )
        .with_code(DEADLINE_EXCEEDED)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }
}

/// The code of an [`ErrorKind::InstanceLost`] error.
pub const INSTANCE_LOST: &str = "instance_lost";
/// The code of the request plane's own [`ErrorKind::InstanceLost`]: the process answered but
/// serves no such instance (it left). Only this marks an instance down for callers; a lost
/// request (an engine's broken stream) says nothing about the next one.
pub const NOT_SERVED: &str = "instance_not_served";
/// The code of [`OpError::deadline_exceeded`].
pub const DEADLINE_EXCEEDED: &str = "deadline_exceeded";
/// The code of an [`ErrorKind::RateLimited`] error (OpenAI's).
pub const RATE_LIMIT_EXCEEDED: &str = "rate_limit_exceeded";
/// The default code of an [`ErrorKind::Overloaded`] error.
pub const WORKER_BUSY: &str = "worker_busy";

/// The type-erased operator the runtime holds.
pub trait DynOperator: Send + Sync + 'static {
    fn call(&self, ctx: Ctx, input: Input<AnyPayload>) -> Output<AnyPayload>;
}

struct Erased<O>(O);

/// Erase an operator's types; only done after the compiler checked the edges.
pub fn erase<O: Operator>(op: O) -> Arc<dyn DynOperator> {
    Arc::new(Erased(op))
}

impl<O: Operator> DynOperator for Erased<O> {
    fn call(&self, ctx: Ctx, input: Input<AnyPayload>) -> Output<AnyPayload> {
        let input = input
            .filter_map(|item| async move {
                match downcast::<O::In>(item) {
                    Ok(v) => Some(v),
                    Err(other) => {
                        // The compiler rules this out; if it ever happens it is our bug, so
                        // log it loudly instead of taking the process down.
                        tracing::error!(
                            expected = O::In::NAME,
                            found = other.type_name(),
                            "payload type mismatch dropped an item"
                        );
                        None
                    }
                }
            })
            .boxed();
        // The operator runs inside the request's span (its set-up here, then every poll of
        // its output), so every line it logs carries `request_id`.
        let span = ctx.span().clone();
        let out = span.in_scope(|| self.0.call(ctx, input));
        InSpan {
            inner: out.map(|r| r.map(|v| Box::new(v) as AnyPayload)).boxed(),
            span,
        }
        .boxed()
    }
}

/// A stream polled inside `span`.
struct InSpan<S> {
    inner: S,
    span: tracing::Span,
}

impl<S: futures::Stream + Unpin> futures::Stream for InSpan<S> {
    type Item = S::Item;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<S::Item>> {
        let this = &mut *self;
        let _entered = this.span.enter();
        this.inner.poll_next_unpin(cx)
    }
}

/// Runs the rest of the graph for requests an [`Ingress`] accepted.
#[derive(Clone)]
pub struct Chain<Req, Resp> {
    inner: Arc<dyn DynChain>,
    _types: std::marker::PhantomData<fn(Req) -> Resp>,
}

/// Object-safe chain the runtime provides.
pub trait DynChain: Send + Sync + 'static {
    /// A context for a new request, linked to the runtime so shutdown can reach it.
    fn new_ctx(&self, id: RequestId) -> Ctx;
    fn call(&self, ctx: Ctx, request: AnyPayload) -> Output<AnyPayload>;
    /// Requests whose response stream is still open.
    fn in_flight(&self) -> usize {
        0
    }
    /// Resolves once no request is in flight (an ingress drains on it).
    fn drained(&self) -> BoxFuture<'static, ()> {
        Box::pin(std::future::ready(()))
    }
}

impl<Req: Payload, Resp: Payload> Chain<Req, Resp> {
    pub fn new(inner: Arc<dyn DynChain>) -> Self {
        Self {
            inner,
            _types: std::marker::PhantomData,
        }
    }

    /// A context for a new request (`id` from the client, or random).
    pub fn ctx(&self, id: Option<RequestId>) -> Ctx {
        self.inner.new_ctx(id.unwrap_or_else(RequestId::random))
    }

    /// Requests sent down the graph whose responses are still open.
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }

    /// Resolves once no request sent down the graph has an open response.
    pub fn drained(&self) -> BoxFuture<'static, ()> {
        self.inner.drained()
    }

    /// Send one request down the graph; the stream yields the last node's outputs.
    pub fn call(&self, ctx: Ctx, request: Req) -> Output<Resp> {
        self.inner
            .call(ctx, Box::new(request))
            .map(|item| {
                item.and_then(|v| {
                    downcast::<Resp>(v).map_err(|other| {
                        OpError::internal(format!(
                            "graph returned `{}` where `{}` was expected",
                            other.type_name(),
                            Resp::NAME
                        ))
                    })
                })
            })
            .boxed()
    }
}

impl<Req, Resp> fmt::Debug for Chain<Req, Resp> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Chain")
    }
}

/// Resolves when the runtime asks ingresses to stop accepting new work.
pub type ShutdownSignal = futures::future::Shared<BoxFuture<'static, ()>>;

/// A kind that brings requests into the graph (HTTP and friends).
pub trait Ingress: Send + Sync + 'static {
    /// What it sends down the graph.
    type Request: Payload;
    /// What it expects back from the last node.
    type Response: Payload;

    /// Accept requests until `shutdown` resolves, then finish in-flight ones and return.
    fn serve(
        self: Box<Self>,
        chain: Chain<Self::Request, Self::Response>,
        shutdown: ShutdownSignal,
    ) -> BoxFuture<'static, Result<(), OpError>>;
}

/// The type-erased ingress the runtime holds.
pub trait DynIngress: Send + 'static {
    fn serve(
        self: Box<Self>,
        chain: Arc<dyn DynChain>,
        shutdown: ShutdownSignal,
    ) -> BoxFuture<'static, Result<(), OpError>>;
}

struct ErasedIngress<I>(Box<I>);

pub fn erase_ingress<I: Ingress>(ingress: I) -> Box<dyn DynIngress> {
    Box::new(ErasedIngress(Box::new(ingress)))
}

impl<I: Ingress> DynIngress for ErasedIngress<I> {
    fn serve(
        self: Box<Self>,
        chain: Arc<dyn DynChain>,
        shutdown: ShutdownSignal,
    ) -> BoxFuture<'static, Result<(), OpError>> {
        self.0.serve(Chain::new(chain), shutdown)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::Mutex;

    use super::*;

    struct Word;
    impl Payload for Word {
        const NAME: &'static str = "Word";
    }

    /// Logs once when called and once per output.
    struct Logs;
    impl Operator for Logs {
        type In = Word;
        type Out = Word;
        fn call(&self, _ctx: Ctx, input: Input<Word>) -> Output<Word> {
            tracing::info!("called");
            input
                .map(|w| {
                    tracing::info!("item");
                    Ok(w)
                })
                .boxed()
        }
    }

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// An operator's log lines, at its call and while its output is polled, carry the
    /// request's id.
    #[test]
    fn operators_log_inside_the_request_span() {
        let buf = Buf::default();
        let writer = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let id = tracing::subscriber::with_default(subscriber, || {
            let ctx = Ctx::new();
            let id = ctx.id().to_string();
            let op = erase(Logs);
            let input = futures::stream::iter([Box::new(Word) as AnyPayload]).boxed();
            let out: Vec<_> = futures::executor::block_on(op.call(ctx, input).collect());
            assert_eq!(out.len(), 1);
            id
        });
        let log = String::from_utf8(buf.0.lock().unwrap_or_else(|e| e.into_inner()).clone());
        let log = log.unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        assert_eq!(lines.len(), 2, "{log}");
        for line in lines {
            assert!(line.contains(&format!("request_id={id}")), "{line}");
        }
    }
}
