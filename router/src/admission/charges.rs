//! Tenants' charges shared by the routers of a node over the event plane: each router
//! publishes what it charged since its last tick and credits what the others publish, so
//! every router holds the same served counts (sums, whatever order they arrive in) and a
//! tenant's share is its share of the node, whichever frontend its requests come through.
//! The same timer lets waiting requests go when workers join.

use std::sync::Arc;
use std::time::Duration;

use dyn_core::planes::{EventBus, PlaneError};
use futures::StreamExt;
use serde::Deserialize;
use tokio_util::task::AbortOnDropHandle;

use super::Admission;

/// What a router tells the others of the node: its tenants' charges, in order.
#[derive(Debug, Clone, PartialEq, serde::Serialize, Deserialize)]
pub struct Charges {
    pub origin: u64,
    pub charges: Vec<(String, f64)>,
}

/// The event-plane subject on which the routers of node `target` share tenants' charges.
pub fn charges_subject(namespace: &str, target: &str) -> String {
    format!("dyn.{namespace}.{target}.tenant_charges")
}

impl Admission {
    /// This router's tenant charges since last asked, to publish (none: nothing to say).
    pub fn take_charges(&self) -> Option<Charges> {
        let charges = self.state.lock().queue.take_charged();
        (!charges.is_empty()).then_some(Charges {
            origin: self.origin,
            charges,
        })
    }

    /// Another router's charges (this router's own are skipped).
    pub fn apply_charges(&self, c: Charges) {
        if c.origin == self.origin {
            return;
        }
        let mut s = self.state.lock();
        for (tenant, cost) in &c.charges {
            s.queue.credit(tenant, *cost);
        }
    }

    /// Every 100 ms, until the handle is dropped: lets waiting requests go if workers joined
    /// ([`Admission::tick`]), and publishes this router's charges on `subject`.
    pub(crate) fn keep_ticking(
        self: &Arc<Self>,
        events: Arc<dyn EventBus>,
        subject: String,
    ) -> AbortOnDropHandle<()> {
        let a = self.clone();
        AbortOnDropHandle::new(tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_millis(100));
            loop {
                every.tick().await;
                a.tick();
                let Some(c) = a.take_charges() else { continue };
                let Ok(payload) = serde_json::to_vec(&c) else {
                    continue;
                };
                if let Err(e) = events.publish(&subject, payload.into()).await {
                    tracing::warn!(error = %e, "Cannot share tenants' charges");
                }
            }
        }))
    }

    /// Credits the charges the node's other routers publish on `subject`, while this
    /// admission lives and the handle is kept.
    pub(crate) async fn hear_charges(
        self: &Arc<Self>,
        events: &Arc<dyn EventBus>,
        subject: &str,
    ) -> Result<AbortOnDropHandle<()>, PlaneError> {
        let mut sub = events.subscribe(subject).await?;
        let a = Arc::downgrade(self);
        Ok(AbortOnDropHandle::new(tokio::spawn(async move {
            while let Some(ev) = sub.next().await {
                let Some(a) = a.upgrade() else { return };
                match serde_json::from_slice::<Charges>(&ev.payload) {
                    Ok(c) => a.apply_charges(c),
                    Err(e) => tracing::warn!(error = %e, "Bad tenant charges"),
                }
            }
        })))
    }
}
