//! The per-request context every operator receives.
//!
//! A [`Ctx`] names the request, carries its tracing span and optional deadline, and tells the
//! operators working on it when to give up: [`Ctx::kill`] aborts (nobody is listening any
//! more: the client went away, shutdown ran out of grace), and so does the deadline passing;
//! work and memory are released at once. (A "finish cleanly" signal, as Dynamo's
//! `AsyncEngineContext::stop_generating`, has no sender in dyn, so it has no receiver either.)
//!
//! Operators that keep per-request bookkeeping elsewhere (a router counting active requests
//! per worker) register hooks: [`Ctx::on_first_output`] runs when the request path yields its
//! first item, [`Ctx::on_done`] when the request is over in any way (finished, failed,
//! cancelled), that is when its last context is dropped.
//!
//! Contexts form a tree: a child created with [`Ctx::child`] observes its parent's kill,
//! so cancelling an HTTP request reaches every sub-request it fanned out to. The tree is built on
//! `tokio_util`'s `CancellationToken`, which already unlinks dropped children.
//!
//! The ids a request is known by live here too: its own ([`RequestId`]) and the replica's that
//! serves it ([`InstanceId`]), which payloads name as their target without knowing the planes.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

/// A request identifier, unique per request and carried into every log line as `request_id`.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct RequestId(Arc<str>);

impl RequestId {
    /// A fresh random identifier.
    pub fn random() -> Self {
        Self(uuid::Uuid::new_v4().simple().to_string().into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<&str> for RequestId {
    fn from(s: &str) -> Self {
        Self(s.into())
    }
}

impl From<String> for RequestId {
    fn from(s: String) -> Self {
        Self(s.into())
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// Cheap-to-clone request context. See the module docs.
#[derive(Clone)]
pub struct Ctx {
    inner: Arc<Inner>,
}

struct Inner {
    id: RequestId,
    /// Cancelled by `kill()`: "abort now".
    kill: CancellationToken,
    deadline: Option<Instant>,
    span: tracing::Span,
    /// Shared by the contexts of one request (`with_deadline` keeps them), not by children.
    hooks: Arc<Hooks>,
}

type Hook = Box<dyn FnOnce() + Send>;
type FailureHook = Box<dyn FnOnce(&crate::OpError) + Send>;

#[derive(Default)]
struct Hooks {
    state: parking_lot::Mutex<HookState>,
}

#[derive(Default)]
struct HookState {
    first_output_seen: bool,
    first_output: Vec<Hook>,
    done: Vec<Hook>,
    failure: Vec<FailureHook>,
    /// The pool serving the request (see [`Ctx::set_pool`]).
    pool: Option<Arc<str>>,
}

impl Drop for Hooks {
    fn drop(&mut self) {
        for f in std::mem::take(&mut self.state.get_mut().done) {
            f();
        }
    }
}

impl fmt::Debug for Ctx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ctx")
            .field("id", &self.inner.id)
            .field("killed", &self.is_killed())
            .field("deadline", &self.inner.deadline)
            .finish()
    }
}

impl Ctx {
    /// A root context with a fresh random id.
    pub fn new() -> Self {
        Self::with_id(RequestId::random())
    }

    /// A root context with the given id (for example a client-supplied `x-request-id`).
    pub fn with_id(id: impl Into<RequestId>) -> Self {
        let id = id.into();
        let span = tracing::info_span!("request", request_id = %id);
        Self::from_parts(id, CancellationToken::new(), None, span, Arc::default())
    }

    fn from_parts(
        id: RequestId,
        kill: CancellationToken,
        deadline: Option<Instant>,
        span: tracing::Span,
        hooks: Arc<Hooks>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                id,
                kill,
                deadline,
                span,
                hooks,
            }),
        }
    }

    /// A linked child: it observes this context's kill and deadline, and can be killed on its
    /// own without touching the parent.
    pub fn child(&self, id: impl Into<RequestId>) -> Self {
        let id = id.into();
        let span = tracing::info_span!(parent: &self.inner.span, "request", request_id = %id);
        Self::from_parts(
            id,
            self.inner.kill.child_token(),
            self.inner.deadline,
            span,
            Arc::default(),
        )
    }

    /// The same request with a deadline; an earlier deadline already in force is kept.
    pub fn with_deadline(&self, deadline: Instant) -> Self {
        let deadline = Some(self.inner.deadline.map_or(deadline, |d| d.min(deadline)));
        Self::from_parts(
            self.inner.id.clone(),
            self.inner.kill.child_token(),
            deadline,
            self.inner.span.clone(),
            self.inner.hooks.clone(),
        )
    }

    /// The same request with a deadline `timeout` from now.
    pub fn with_timeout(&self, timeout: Duration) -> Self {
        self.with_deadline(Instant::now() + timeout)
    }

    pub fn id(&self) -> &RequestId {
        &self.inner.id
    }

    pub fn span(&self) -> &tracing::Span {
        &self.inner.span
    }

    pub fn deadline(&self) -> Option<Instant> {
        self.inner.deadline
    }

    /// Abort this request and its children.
    pub fn kill(&self) {
        self.inner.kill.cancel();
    }

    /// True once `kill()` reached this context, or its deadline passed.
    pub fn is_killed(&self) -> bool {
        self.inner.kill.is_cancelled() || self.deadline_passed()
    }

    fn deadline_passed(&self) -> bool {
        self.inner.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// Resolves when the request is aborted: killed, or past its deadline.
    pub async fn killed(&self) {
        match self.inner.deadline {
            Some(deadline) => {
                tokio::select! {
                    _ = self.inner.kill.cancelled() => {}
                    _ = tokio::time::sleep_until(deadline.into()) => {}
                }
            }
            None => self.inner.kill.cancelled().await,
        }
    }

    /// Run `f` when the request path yields its first item (at once if it already has).
    pub fn on_first_output(&self, f: impl FnOnce() + Send + 'static) {
        let mut st = self.inner.hooks.state.lock();
        if st.first_output_seen {
            drop(st);
            f();
        } else {
            st.first_output.push(Box::new(f));
        }
    }

    /// Whether the request path has yielded an item (a resent request's client already has
    /// part of its answer).
    pub fn output_started(&self) -> bool {
        self.inner.hooks.state.lock().first_output_seen
    }

    /// Where a router chose among several worker nodes (pools), the one serving this request;
    /// the runtime sets it, and the frontend counts latencies per pool for the planner.
    pub fn set_pool(&self, node: &str) {
        self.inner.hooks.state.lock().pool = Some(node.into());
    }

    /// The pool serving this request, once chosen (see [`Ctx::set_pool`]).
    pub fn pool(&self) -> Option<Arc<str>> {
        self.inner.hooks.state.lock().pool.clone()
    }

    /// Run `f` once the request is over: when the last context of this request is dropped.
    pub fn on_done(&self, f: impl FnOnce() + Send + 'static) {
        self.inner.hooks.state.lock().done.push(Box::new(f));
    }

    /// Run `f` if the request fails (see [`Ctx::failed`]); hooks are run once, and the ones
    /// registered after a failure wait for the next.
    pub fn on_failure(&self, f: impl FnOnce(&crate::OpError) + Send + 'static) {
        self.inner.hooks.state.lock().failure.push(Box::new(f));
    }

    /// The request path failed with `e` (the runtime calls this, before it resends the
    /// request or gives up): runs the failure hooks registered so far.
    pub fn failed(&self, e: &crate::OpError) {
        let hooks = std::mem::take(&mut self.inner.hooks.state.lock().failure);
        for f in hooks {
            f(e);
        }
    }

    /// The request path yielded its first item; the runtime calls this.
    pub fn first_output(&self) {
        let hooks = {
            let mut st = self.inner.hooks.state.lock();
            if st.first_output_seen {
                return;
            }
            st.first_output_seen = true;
            std::mem::take(&mut st.first_output)
        };
        for f in hooks {
            f();
        }
    }

    /// A guard that kills this context when dropped, unless disarmed. Ingresses hold one per
    /// response so that a client hanging up reaches the engine.
    pub fn kill_on_drop(&self) -> KillOnDrop {
        KillOnDrop(Some(self.clone()))
    }
}

impl Default for Ctx {
    fn default() -> Self {
        Self::new()
    }
}

/// See [`Ctx::kill_on_drop`].
#[must_use]
pub struct KillOnDrop(Option<Ctx>);

impl KillOnDrop {
    /// The request finished normally: dropping the guard no longer kills it.
    pub fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(ctx) = self.0.take() {
            tracing::debug!(request_id = %ctx.id(), "Request killed: its consumer went away");
            ctx.kill();
        }
    }
}

/// One replica's id across the planes: its discovery key ends in it (in hex, as logs show
/// it), the request plane serves it, and a worker's KV events and load metrics carry it as
/// `worker_id`. On the wire it is a plain integer.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct InstanceId(pub u64);

impl InstanceId {
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl From<u64> for InstanceId {
    fn from(id: u64) -> Self {
        Self(id)
    }
}

impl From<InstanceId> for u64 {
    fn from(id: InstanceId) -> Self {
        id.0
    }
}

impl std::fmt::Display for InstanceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

impl std::fmt::LowerHex for InstanceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::LowerHex::fmt(&self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kill_parent_reaches_children_and_grandchildren() {
        let root = Ctx::with_id("root");
        let child = root.child("child");
        let grandchild = child.child("grandchild");
        assert!(!grandchild.is_killed());
        root.kill();
        assert!(child.is_killed());
        assert!(grandchild.is_killed());
    }

    #[test]
    fn cancelling_a_child_leaves_the_parent_alone() {
        let root = Ctx::new();
        let child = root.child("c");
        let sibling = root.child("s");
        child.kill();
        assert!(!root.is_killed());
        assert!(!sibling.is_killed());
    }

    #[test]
    fn child_created_after_kill_is_killed() {
        let root = Ctx::new();
        root.kill();
        assert!(root.child("late").is_killed());
    }

    #[tokio::test]
    async fn killed_future_resolves_for_linked_child() {
        let root = Ctx::new();
        let child = root.child("c");
        let waiter = tokio::spawn(async move { child.killed().await });
        root.kill();
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("child observed the kill")
            .unwrap();
    }

    #[tokio::test]
    async fn deadline_counts_as_kill() {
        let ctx = Ctx::new().with_timeout(Duration::from_millis(10));
        let child = ctx.child("c");
        tokio::time::timeout(Duration::from_secs(5), child.killed())
            .await
            .expect("deadline reached");
        assert!(child.is_killed());
    }

    #[test]
    fn kill_on_drop_guard() {
        let ctx = Ctx::new();
        drop(ctx.kill_on_drop());
        assert!(ctx.is_killed());
        let ctx = Ctx::new();
        ctx.kill_on_drop().disarm();
        assert!(!ctx.is_killed());
    }

    #[test]
    fn hooks_run_on_first_output_and_when_the_request_is_over() {
        let log = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let push = |s: &'static str| {
            let log = log.clone();
            move || log.lock().push(s)
        };
        let ctx = Ctx::new();
        let timed = ctx.with_timeout(Duration::from_secs(60));
        timed.on_first_output(push("first"));
        ctx.on_done(push("done"));
        ctx.first_output();
        ctx.first_output();
        ctx.on_first_output(push("late first"));
        // A child is another request: dropping it runs nothing of the parent's.
        drop(ctx.child("sub"));
        assert_eq!(*log.lock(), ["first", "late first"]);
        drop(ctx);
        assert_eq!(
            log.lock().len(),
            2,
            "a context of the request is still alive"
        );
        drop(timed);
        assert_eq!(*log.lock(), ["first", "late first", "done"]);
    }
}
