//! Tenants' charges shared by the routers of a node over the event plane: each router
//! publishes what it charged since its last tick and credits what the others publish, so
//! every router holds the same served counts (sums, whatever order they arrive in) and a
//! tenant's share is its share of the node, whichever frontend its requests come through.

use serde::Deserialize;

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
}
