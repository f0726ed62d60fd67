//! The KV transfer agent as a process-wide service: prefill workers offer their blocks to it,
//! decode workers pull through it. One per graph run, started by the first engine built.

use std::sync::Arc;

use dyn_compute::transfer::{InProcessAgent, KvTransferAgent, TcpAgent};
use dyn_core::{BuildCx, BuildError, Service};

/// This process's agent: over TCP (on the request plane's host, any port, with its cluster
/// identity) when other processes may pull from it, in-process otherwise.
pub struct TransferAgent(pub Arc<dyn KvTransferAgent>);

impl Service for TransferAgent {
    async fn start(cx: &BuildCx) -> Result<Self, BuildError> {
        let Some(tcp) = &cx.planes.tcp else {
            return Ok(Self(Arc::new(InProcessAgent::default())));
        };
        let host = tcp.bind.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h);
        let agent = TcpAgent::bind(
            &format!("{host}:0"),
            tcp.advertise_host.as_deref(),
            tcp.trust.clone(),
        )
        .await
        .map_err(|e| BuildError::new(format!("cannot listen for KV transfers on {host}: {e}")))?;
        tracing::info!(agent = agent.name(), "KV transfer agent listening");
        Ok(Self(Arc::new(agent)))
    }
}
