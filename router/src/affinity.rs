//! Session affinity as a router uses it: the table of sessions bound to workers
//! ([`Sessions`]), told to the node's other routers as they bind and heard from them, over
//! the event plane. Whether the bound worker may still take a session's next request is the
//! router's to say (it weighs load and health too).

use std::sync::Arc;
use std::time::{Duration, Instant};

use dyn_core::planes::{EventBus, PlaneError};
use futures::StreamExt;
use tokio_util::task::AbortOnDropHandle;

use crate::sessions::{AffinityConfig, Binding, Sessions, sessions_subject};

/// A router's sessions (`session_affinity`).
pub(crate) struct Affinity {
    /// Sessions bound to workers.
    pub table: Arc<Sessions>,
    /// Where the node's routers share their bindings.
    subject: String,
}

impl Affinity {
    /// The sessions of the router of node `target` in `namespace`.
    pub fn new(config: &AffinityConfig, namespace: &str, target: &str) -> Self {
        let ttl = Duration::from_secs_f64(config.ttl_s);
        Self {
            table: Arc::new(Sessions::new(ttl, rand::random())),
            subject: sessions_subject(namespace, target),
        }
    }

    /// Binds `session` to `worker` from `now`, and tells the other routers over `events`
    /// when they should hear of it (in the background: routing does not wait for it).
    pub fn bind(&self, session: &str, worker: u64, now: Instant, events: &Arc<dyn EventBus>) {
        if let Some(b) = self.table.bind(session, worker, now)
            && let Ok(payload) = serde_json::to_vec(&b)
        {
            let (events, subject) = (events.clone(), self.subject.clone());
            tokio::spawn(async move {
                if let Err(e) = events.publish(&subject, payload.into()).await {
                    tracing::warn!(error = %e, "Cannot share a session binding");
                }
            });
        }
    }

    /// Applies the bindings the node's other routers publish on `events`, for as long as the
    /// table lives (the router holds it) and the handle is kept.
    pub async fn hear_others(
        &self,
        events: &Arc<dyn EventBus>,
    ) -> Result<AbortOnDropHandle<()>, PlaneError> {
        let mut sub = events.subscribe(&self.subject).await?;
        let table = Arc::downgrade(&self.table);
        Ok(AbortOnDropHandle::new(tokio::spawn(async move {
            while let Some(ev) = sub.next().await {
                let Some(table) = table.upgrade() else { return };
                match serde_json::from_slice::<Binding>(&ev.payload) {
                    Ok(b) => table.apply(b, Instant::now()),
                    Err(e) => tracing::warn!(error = %e, "Bad session binding"),
                }
            }
        })))
    }
}
