//! The three planes every graph runs on, as traits with swappable implementations.
//!
//! - control ([`Discovery`]): which instances of which node exist and how to reach them;
//! - events ([`EventBus`]): fire-and-forget messages such as KV-cache events and load metrics;
//! - requests ([`RequestPlane`]): one request's input stream to an instance and its output
//!   stream back;
//! - work queues ([`WorkQueue`]): jobs one worker takes, on the event plane's server (JetStream);
//! - stores ([`KeyValue`]): bounded records any process reads back, on the same server.
//!
//! The embedded implementations here run everything inside one process with no set-up. The
//! etcd, NATS and TCP implementations (in `dyn-runtime`) implement the same traits, so
//! operators never know which they run on, and nothing here needs etcd, NATS or protoc.

pub mod discovery;
pub mod events;
pub mod queue;
pub mod request;
pub mod store;

use std::collections::HashMap;
use std::sync::{Arc, Weak};

pub use discovery::{
    Capabilities, Discovery, DiscoveryEvent, EmbeddedDiscovery, Instance, InstanceId, InstanceMeta,
    LiveInstances, Transport,
};
pub use events::{EmbeddedEventBus, Event, EventBus};
pub use queue::{EmbeddedWorkQueue, WorkQueue};
pub use request::{EmbeddedRequestPlane, EndpointTypes, InstanceHealth, RequestPlane, TcpOptions};
pub use store::{Bucket, EmbeddedStore, KeyValue};

/// The endpoint every node instance serves its requests on (`{ns}/{node}/generate/{id}`).
pub const ENDPOINT: &str = "generate";

/// Errors from any plane implementation.
#[derive(Debug, thiserror::Error)]
pub enum PlaneError {
    #[error("{plane} plane: {message}")]
    Backend {
        plane: &'static str,
        message: String,
    },
    #[error("invalid subject `{0}`")]
    InvalidSubject(String),
}

/// Which wire moves KV blocks between processes (the graph's `planes.transfer`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TransferWire {
    /// UCX when it starts in this process, else TCP.
    #[default]
    Auto,
    /// UCX, or the process does not start.
    Ucx,
    Tcp,
}

impl std::str::FromStr for TransferWire {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "ucx" => Ok(Self::Ucx),
            "tcp" => Ok(Self::Tcp),
            _ => Err(format!("transfer `{s}`: expected auto, ucx or tcp")),
        }
    }
}

/// The planes one graph runs on, cheap to clone into every node.
#[derive(Clone)]
pub struct Planes {
    pub discovery: Arc<dyn Discovery>,
    pub events: Arc<dyn EventBus>,
    pub requests: Arc<dyn RequestPlane>,
    pub queue: Arc<dyn WorkQueue>,
    pub store: Arc<dyn KeyValue>,
    /// How this process is reached from others (`None` when the graph runs in one process):
    /// services that open their own listeners (the KV transfer agent) bind where the request
    /// plane does.
    pub tcp: Option<TcpOptions>,
    /// How KV blocks move between processes (used with `tcp`).
    pub transfer: TransferWire,
    /// The wire this process's KV transfer agent moves blocks over (`inproc`, `tcp`, `ucx`),
    /// once an engine started it: workers publish it in their instance metadata.
    pub transfer_in_use: Arc<std::sync::OnceLock<&'static str>>,
    /// One discovery watch per prefix in this process, shared by everyone who follows it.
    watches: Arc<tokio::sync::Mutex<HashMap<String, Weak<LiveInstances>>>>,
}

impl Planes {
    /// All three planes in-process.
    pub fn embedded() -> Self {
        Self {
            discovery: Arc::new(EmbeddedDiscovery::default()),
            events: Arc::new(EmbeddedEventBus::default()),
            requests: Arc::new(EmbeddedRequestPlane::default()),
            queue: Arc::new(EmbeddedWorkQueue::default()),
            store: Arc::new(EmbeddedStore::default()),
            tcp: None,
            transfer: TransferWire::Auto,
            transfer_in_use: Arc::default(),
            watches: Arc::default(),
        }
    }

    /// True when the request plane just saw `instance_id` fail: route around it even though
    /// discovery still lists it (its lease has not run out yet).
    pub fn is_down(&self, instance_id: InstanceId) -> bool {
        self.requests
            .health()
            .is_some_and(|h| h.is_down(instance_id))
    }

    /// The live instances under `prefix`, from this process's one watch of it. A router and
    /// the edge client calling the replica it chose read the same list, so neither can know
    /// an instance the other does not.
    pub async fn live(&self, prefix: &str) -> Result<Arc<LiveInstances>, PlaneError> {
        let mut watches = self.watches.lock().await;
        if let Some(live) = watches.get(prefix).and_then(Weak::upgrade) {
            return Ok(live);
        }
        let live = Arc::new(LiveInstances::watch(self.discovery.as_ref(), prefix).await?);
        watches.retain(|_, w| w.strong_count() > 0);
        watches.insert(prefix.to_owned(), Arc::downgrade(&live));
        Ok(live)
    }
}
