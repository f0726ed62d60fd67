//! The planes that leave the process: etcd discovery, NATS events and work queues, and the TCP
//! request plane. They implement `dyn-core`'s plane traits (re-exported here, with the embedded
//! implementations), so operators never know which they run on; [`connect`] picks them from a
//! graph's plane addresses.

pub mod auth;
pub mod etcd;
pub mod nats;
pub mod tcp;

use std::sync::Arc;

pub use auth::{EtcdCredentials, NatsCredentials};
pub use dyn_core::planes::*;
pub use etcd::EtcdDiscovery;
pub use nats::{NatsEventBus, NatsStore, NatsWorkQueue};
pub use tcp::TcpRequestPlane;

use crate::compile::PlaneAddr;

/// Reach etcd and NATS once with the environment's credentials, as a supervisor does before
/// it starts processes that would each fail the same way (and be restarted for ever).
pub async fn check(control: &PlaneAddr, events: &PlaneAddr) -> Result<(), PlaneError> {
    if let PlaneAddr::Etcd(endpoints) = control {
        let creds = EtcdCredentials::from_env()?;
        etcd::list_instances(&creds.urls(endpoints), &creds, "v1/instances/").await?;
    }
    if let PlaneAddr::Nats(endpoints) = events {
        NatsEventBus::connect_with(endpoints, &NatsCredentials::from_env()?).await?;
    }
    Ok(())
}

/// The planes a graph's addresses name: etcd discovery, NATS events, and the TCP request
/// plane as soon as either leaves the process (another process may then call in). etcd's
/// and NATS's credentials come from the environment ([`auth`]).
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
        let creds = EtcdCredentials::from_env()?;
        let urls = creds.urls(endpoints);
        planes.discovery = Arc::new(EtcdDiscovery::connect_with(&urls, lease_ttl, creds).await?);
        distributed = true;
    }
    if let PlaneAddr::Nats(endpoints) = events {
        let bus = NatsEventBus::connect_with(endpoints, &NatsCredentials::from_env()?).await?;
        planes.queue = Arc::new(bus.work_queue());
        planes.store = Arc::new(bus.store());
        planes.events = Arc::new(bus);
        distributed = true;
    }
    if distributed {
        planes.requests = Arc::new(TcpRequestPlane::new(tcp.clone(), Arc::default()));
        planes.tcp = Some(tcp);
    }
    Ok(planes)
}
