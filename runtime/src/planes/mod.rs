//! The planes that leave the process: etcd discovery, NATS events and work queues, and the TCP
//! request plane. They implement `dyn-core`'s plane traits (re-exported here, with the embedded
//! implementations), so operators never know which they run on; [`connect`] picks them from a
//! graph's plane addresses.

pub mod etcd;
pub mod nats;
pub mod tcp;

use std::sync::Arc;

pub use dyn_core::planes::*;
pub use etcd::EtcdDiscovery;
pub use nats::{NatsEventBus, NatsWorkQueue};
pub use tcp::TcpRequestPlane;

use crate::compile::PlaneAddr;

/// The planes a graph's addresses name: etcd discovery, NATS events, and the TCP request
/// plane as soon as either leaves the process (another process may then call in).
pub async fn connect(
    control: &PlaneAddr,
    events: &PlaneAddr,
    tcp: TcpOptions,
    lease_ttl: std::time::Duration,
) -> Result<Planes, PlaneError> {
    let mut planes = Planes::embedded();
    let mut distributed = false;
    if let PlaneAddr::Etcd(endpoints) = control {
        if endpoints.is_empty() {
            return Err(PlaneError::Backend {
                plane: "control",
                message: "no etcd endpoint".into(),
            });
        }
        let urls: Vec<String> = endpoints.iter().map(|e| format!("http://{e}")).collect();
        planes.discovery = Arc::new(EtcdDiscovery::connect(&urls, lease_ttl).await?);
        distributed = true;
    }
    if let PlaneAddr::Nats(endpoints) = events {
        let bus = NatsEventBus::connect(endpoints).await?;
        planes.queue = Arc::new(bus.work_queue());
        planes.events = Arc::new(bus);
        distributed = true;
    }
    if distributed {
        planes.requests = Arc::new(TcpRequestPlane::new(tcp.clone(), Arc::default()));
        planes.tcp = Some(tcp);
    }
    Ok(planes)
}
