//! The KV transfer agent as a process-wide service: prefill workers offer their blocks to it,
//! decode workers pull through it. One per graph run, started by the first engine built.

use std::sync::Arc;

use dyn_compute::transfer::{InProcessAgent, KvTransferAgent, TcpAgent, Via};
use dyn_core::planes::TransferWire;
use dyn_core::{BuildCx, BuildError, Service};

/// This process's agent: over TCP (on the request plane's host, any port, with its cluster
/// identity) when other processes may pull from it, with UCX beside it as the graph's
/// `planes.transfer` says; in-process otherwise.
pub struct TransferAgent(pub Arc<dyn KvTransferAgent>);

impl Service for TransferAgent {
    async fn start(cx: &BuildCx) -> Result<Self, BuildError> {
        let Some(tcp) = &cx.planes.tcp else {
            let _ = cx.planes.transfer_in_use.set(Via::InProcess.as_str());
            return Ok(Self(Arc::new(InProcessAgent::default())));
        };
        let ucx = match cx.planes.transfer {
            TransferWire::Tcp => None,
            wire => match tokio::task::spawn_blocking(|| dyn_ucx::Agent::new("dyn-ucx")).await {
                Ok(Ok(agent)) => Some(Arc::new(agent)),
                Ok(Err(e)) if wire == TransferWire::Auto => {
                    tracing::warn!(error = %e, "UCX did not start; KV transfers go over TCP");
                    None
                }
                Ok(Err(e)) => {
                    return Err(BuildError::new(format!(
                        "planes.transfer is ucx, and UCX did not start: {e}"
                    )));
                }
                Err(e) => return Err(BuildError::new(format!("starting UCX: {e}"))),
            },
        };
        let host = tcp.bind.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h);
        let agent = TcpAgent::bind_with(
            &format!("{host}:0"),
            tcp.advertise_host.as_deref(),
            tcp.trust.clone(),
            ucx,
        )
        .await
        .map_err(|e| BuildError::new(format!("cannot listen for KV transfers on {host}: {e}")))?;
        tracing::info!(agent = agent.name(), wire = %agent.wire(), "KV transfer agent listening");
        let _ = cx.planes.transfer_in_use.set(agent.wire().as_str());
        Ok(Self(Arc::new(agent)))
    }
}
