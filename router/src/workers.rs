//! The worker node as one router sees it: its instances as discovery lists them, less those
//! the request plane just saw fail, and the places admission gives each. Every other part of
//! the router asks here which workers are live.

use std::sync::Arc;

use dyn_core::OpError;
use dyn_core::planes::{Instance, InstanceId, LiveInstances, Planes};

use crate::admission::AdmissionConfig;

/// The instances of the node a router feeds.
pub(crate) struct Workers {
    /// The node's name.
    pub target: String,
    /// Its instances, as discovery lists them (live or not).
    pub instances: Arc<LiveInstances>,
    /// For the request plane's view of unreachable workers and the event plane's health.
    pub planes: Planes,
}

impl Workers {
    pub fn unavailable(&self) -> OpError {
        OpError::unavailable(format!("no worker of '{}' is available", self.target))
    }

    /// Workers in discovery, less those the request plane just saw fail (their lease has
    /// not run out yet, but a request sent there would be lost).
    pub fn live(&self) -> Vec<u64> {
        self.instances
            .read()
            .iter()
            .map(|i| i.instance_id)
            .filter(|id| !self.planes.is_down(*id))
            .map(InstanceId::get)
            .collect()
    }

    /// Whether any worker is live (without collecting them, on every request).
    pub fn any_live(&self) -> bool {
        self.instances
            .read()
            .iter()
            .any(|i| !self.planes.is_down(i.instance_id))
    }

    /// Every worker in discovery, including those only marked down.
    pub fn registered(&self) -> Vec<u64> {
        self.instances
            .read()
            .iter()
            .map(|i| i.instance_id.get())
            .collect()
    }

    /// Worker `id`'s discovery record, while it is registered.
    pub fn instance(&self, id: u64) -> Option<Instance> {
        self.instances
            .read()
            .iter()
            .find(|i| i.instance_id.get() == id)
            .cloned()
    }

    /// With admission, the requests each worker takes from this router before others wait
    /// (`per_worker`, or the batch size it advertises), for the live ones or all: one pass.
    pub fn places_of(
        &self,
        admission: Option<&AdmissionConfig>,
        live_only: bool,
    ) -> Vec<(u64, u32)> {
        let Some(a) = admission else {
            return Vec::new();
        };
        self.instances
            .read()
            .iter()
            .filter(|i| !live_only || !self.planes.is_down(i.instance_id))
            .map(|i| (i.instance_id.get(), a.places(i.metadata.max_num_seqs)))
            .collect()
    }
}
