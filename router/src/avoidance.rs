//! Which workers a request should not go to: those whose circuit breaker is open
//! ([`Health`]), and for a request resent after a failure, the worker it failed on. Both are
//! fed by each request's outcome, which the router watches through the request's hooks.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use dyn_core::{Ctx, ErrorKind};
use parking_lot::Mutex;

use crate::health::Health;
use crate::metrics;

/// The workers a router steers away from, shared with its requests' hooks.
#[derive(Default)]
pub(crate) struct Avoidance {
    /// Each worker's circuit breaker.
    pub health: Arc<Health>,
    /// The worker each failed request last went to (by request id), left out of its resend.
    failed_on: Arc<Mutex<HashMap<String, u64>>>,
}

impl Avoidance {
    /// The worker request `id` last failed on, while it is being resent.
    pub fn failed_here(&self, id: &str) -> Option<u64> {
        self.failed_on.lock().get(id).copied()
    }

    /// Feeds the request's outcome on `worker` to its breaker: its first token closes it,
    /// a failure of the worker counts toward opening it (and leaves the worker out of the
    /// request's resend). `node`: the route node, for the metrics and the log.
    pub fn watch(&self, ctx: &Ctx, worker: u64, now: Instant, node: &str) {
        use std::sync::atomic::{AtomicU8, Ordering};
        const PENDING: u8 = 0;
        const ANSWERED: u8 = 1;
        const FAILED: u8 = 2;
        self.health.taken(worker, now);
        let outcome = Arc::new(AtomicU8::new(PENDING));
        let id = ctx.id().to_string();
        let (health, avoid, node) = (self.health.clone(), self.failed_on.clone(), node.to_owned());
        let (failed_id, o) = (id.clone(), outcome.clone());
        ctx.on_failure(move |e| {
            // A refusal for want of room, or the client's doing, says nothing of its health.
            if !matches!(e.kind, ErrorKind::Internal | ErrorKind::InstanceLost) {
                return;
            }
            o.store(FAILED, Ordering::Relaxed);
            avoid.lock().insert(failed_id, worker);
            if health.failed(worker, Instant::now()) {
                metrics::ROUTER.breaker_trips.with_label_values(&[&node]).inc();
                tracing::warn!(worker_id = format_args!("{worker:x}"), node = %node, error = %e.message, "Worker left out of routing for a while: its requests keep failing");
            }
        });
        // A request resent after its client got tokens has had its first output: the hook
        // would run at once, before this worker answered anything, which proves nothing.
        if !ctx.output_started() {
            let (health, o) = (self.health.clone(), outcome.clone());
            ctx.on_first_output(move || {
                if o.compare_exchange(PENDING, ANSWERED, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
                {
                    health.ok(worker);
                }
            });
        }
        let (health, avoid) = (self.health.clone(), self.failed_on.clone());
        ctx.on_done(move || {
            avoid.lock().remove(&id);
            if outcome.load(Ordering::Relaxed) == PENDING {
                health.abandoned(worker);
            }
        });
    }
}
