//! The TCP agent, and UCX beside it: a pull is one connection to the offering agent, which
//! checks the transfer id and key and then either streams the blocks back over the connection,
//! or — when both sides have UCX — registers them and sends where they can be read; the puller
//! reads them with one-sided UCX reads and says it is done, which ends the offer. A UCX read
//! that fails falls back to the stream on the same connection.
//!
//! So the capability checks, the TLS identity and the offer's lifetime stay on this
//! connection, whichever wire moves the bytes; a region's remote key is sent only to the
//! puller that passed them, and is unmapped when the offer ends.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use dyn_trust::{PlaneStream, Trust};
use futures::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::{FramedRead, FramedWrite, LengthDelimitedCodec};

use super::{
    BlockFormat, Hold, InProcessAgent, KvTransferAgent, Offer, Offers, PullKey, PullLock, Pulled,
    TransferDescriptor, TransferError, TransferId, Via,
};

/// A TCP pull: which offer, with which key (the connection is TLS with a cluster identity),
/// and whether the puller can read the blocks through UCX.
#[derive(Serialize, Deserialize)]
pub(super) struct PullRequest {
    pub(super) id: TransferId,
    pub(super) key: Option<PullKey>,
    #[serde(default)]
    pub(super) ucx: bool,
}

/// A pull whose bytes stop coming for this long fails (the prefill host went dark).
const PULL_STALL: Duration = Duration::from_secs(10);

/// The response header of a TCP pull. The blocks' bytes follow it, unless it says where to
/// read them through UCX (a [`dyn_ucx::Remote`]'s line); then the puller answers [`PullDone`].
#[derive(Serialize, Deserialize)]
pub(super) struct PullHeader {
    pub(super) error: Option<String>,
    pub(super) blocks: u32,
    pub(super) block_bytes: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) ucx: Option<String>,
}

/// The puller's answer to a UCX header: the blocks were read (the offer ends), or the read
/// failed and the blocks are to be streamed on this connection instead.
#[derive(Serialize, Deserialize)]
struct PullDone {
    ok: bool,
}

/// The most one pull may bring: far above any prompt's KV (a 128k-token prompt of a 70B model
/// in bf16 is 40 GiB), far below what a forged descriptor could ask a process to allocate.
const MAX_PULL_BYTES: u64 = 64 << 30;

fn stalled() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("no bytes for {PULL_STALL:?}"),
    )
}

/// Largest header or request accepted (they are small JSON objects).
const MAX_CONTROL: usize = 64 << 10;

/// Control messages (a pull's transfer id, its response header) are length-delimited JSON
/// frames; a response's blocks follow its header raw, back to back.
fn control_codec() -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .max_frame_length(MAX_CONTROL)
        .new_codec()
}

pub(super) async fn write_control(
    w: &mut (impl AsyncWrite + Unpin),
    v: &impl Serialize,
) -> std::io::Result<()> {
    let body = serde_json::to_vec(v).map_err(std::io::Error::other)?;
    let mut framed = FramedWrite::new(w, control_codec());
    framed.send(Bytes::from(body)).await
}

/// Read one control message; also returns what was read past it (the first block bytes of a
/// response), which the caller must use before reading on.
pub(super) async fn read_control<T: for<'de> Deserialize<'de>>(
    r: &mut (impl AsyncRead + Unpin),
) -> std::io::Result<(T, BytesMut)> {
    let mut framed = FramedRead::new(r, control_codec());
    let frame = framed
        .next()
        .await
        .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::UnexpectedEof))??;
    let v = serde_json::from_slice(&frame).map_err(std::io::Error::other)?;
    Ok((v, framed.into_parts().read_buf))
}

/// Blocks over TCP, or through UCX where both sides have it. See the module docs.
pub struct TcpAgent {
    /// Its offers, and pulls of them from this process, which skip the socket.
    local: InProcessAgent,
    trust: Trust,
    ucx: Option<Arc<dyn_ucx::Agent>>,
    _listener: tokio::task::JoinHandle<()>,
}

impl Drop for TcpAgent {
    fn drop(&mut self) {
        self._listener.abort();
    }
}

impl TcpAgent {
    /// Listen on `bind` (port 0: any); `advertise` is the host peers use (default: the bound
    /// IP); `trust` says who may pull, and how this agent connects to others.
    pub async fn bind(bind: &str, advertise: Option<&str>, trust: Trust) -> std::io::Result<Self> {
        Self::bind_with(bind, advertise, trust, None).await
    }

    /// [`Self::bind`], moving blocks through `ucx` with pullers that have UCX too.
    pub async fn bind_with(
        bind: &str,
        advertise: Option<&str>,
        trust: Trust,
        ucx: Option<Arc<dyn_ucx::Agent>>,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(bind).await?;
        let local = listener.local_addr()?;
        let host = advertise.map_or_else(|| local.ip().to_string(), str::to_owned);
        // `[v6]:PORT`, as the request plane writes it (and as a connect parses it).
        let host = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]")
        } else {
            host
        };
        let agent = InProcessAgent::named(format!("tcp://{host}:{}", local.port()));
        let serving = agent.offers.clone();
        let accepting = trust.clone();
        let registrar = ucx.clone();
        let task = tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((s, _)) => {
                        dyn_trust::tune(&s);
                        let (offers, trust) = (serving.clone(), accepting.clone());
                        let ucx = registrar.clone();
                        tokio::spawn(async move {
                            match trust.accept(s).await {
                                Ok(s) => serve_pull(s, offers, ucx).await,
                                Err(e) => {
                                    tracing::warn!(error = %e, "KV transfer: connection refused")
                                }
                            }
                        });
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "KV transfer accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
        Ok(Self {
            local: agent,
            trust,
            ucx,
            _listener: task,
        })
    }

    /// `tcp://HOST:PORT`.
    pub fn name(&self) -> &str {
        &self.local.name
    }

    /// How this agent moves blocks between processes: `ucx` or `tcp`.
    pub fn wire(&self) -> Via {
        if self.ucx.is_some() {
            Via::Ucx
        } else {
            Via::Tcp
        }
    }
}

async fn serve_pull(stream: PlaneStream, offers: Arc<Offers>, ucx: Option<Arc<dyn_ucx::Agent>>) {
    let (mut r, w) = tokio::io::split(stream);
    // Coalesce small blocks into large writes; large blocks go through in one call each.
    let mut w = BufWriter::with_capacity(256 << 10, w);
    let result = async {
        let (pull, _): (PullRequest, _) = read_control(&mut r).await?;
        let offer = match offers.take(pull.id, pull.key) {
            Ok(offer) => offer,
            Err(e) => {
                let header = PullHeader {
                    error: Some(e.to_string()),
                    blocks: 0,
                    block_bytes: 0,
                    ucx: None,
                };
                write_control(&mut w, &header).await?;
                return w.flush().await;
            }
        };
        let mut header = PullHeader {
            error: None,
            blocks: offer.blocks.len() as u32,
            block_bytes: offer.block_bytes,
            ucx: None,
        };
        if let (true, Some(ucx), false) = (pull.ucx, &ucx, offer.blocks.is_empty()) {
            match ucx.register_blocks(offer.blocks.clone()).await {
                Ok(region) => {
                    header.ucx = Some(region.remote().to_string());
                    write_control(&mut w, &header).await?;
                    w.flush().await?;
                    // The region stays readable until the puller says it is done or goes away,
                    // or the offer's time is up (but not before the puller's own read limit);
                    // then it is unmapped and the offer (its hold) ends.
                    let left = offer.expires.saturating_duration_since(Instant::now());
                    let total = offer.blocks.len() * offer.block_bytes as usize;
                    let wait = left.max(ucx_limit(total) + PULL_STALL);
                    let done = tokio::time::timeout(wait, read_control(&mut r)).await;
                    if let Ok(Ok((PullDone { ok: true }, _))) = done {
                        return Ok(());
                    }
                    // A puller that gave up on its read, or went away, may have left it in
                    // flight: the region's memory stays mapped a while longer, so no read is
                    // ever served from memory freed under it.
                    tokio::spawn(async move {
                        tokio::time::sleep(LINGER).await;
                        drop(region);
                    });
                    return match done {
                        Ok(Ok(_)) => {
                            tracing::debug!("KV transfer: the UCX read failed; streaming instead");
                            stream_blocks(&mut w, &offer).await
                        }
                        Ok(Err(e)) => Err(e),
                        Err(_) => Err(stalled()),
                    };
                }
                Err(e) => {
                    tracing::warn!(error = %e, "KV transfer: blocks not registered with UCX; streaming them")
                }
            }
        }
        write_control(&mut w, &header).await?;
        stream_blocks(&mut w, &offer).await
    };
    if let Err(e) = result.await {
        tracing::debug!(error = %e, "KV transfer pull failed");
    }
}

async fn stream_blocks(w: &mut (impl AsyncWrite + Unpin), offer: &Offer) -> std::io::Result<()> {
    for b in &offer.blocks {
        w.write_all(b).await?;
    }
    w.flush().await
}

/// How long a region outlives a UCX pull that did not end in the puller's "done": longer than a
/// cancelled read takes to end (`dyn_ucx` gives one a second).
const LINGER: Duration = Duration::from_secs(5);

/// How long a UCX read of `bytes` may take: the stall bound, plus the bytes at 100 MB/s (far
/// below any wire UCX picks), so only a peer that went away reaches it.
fn ucx_limit(bytes: usize) -> Duration {
    PULL_STALL + Duration::from_secs_f64(bytes as f64 / 1e8)
}

#[async_trait::async_trait]
impl KvTransferAgent for TcpAgent {
    fn offer_held(
        &self,
        block_ids: Vec<u32>,
        blocks: Vec<Bytes>,
        format: BlockFormat,
        ttl: Duration,
        hold: Option<Hold>,
        to: Option<PullLock>,
    ) -> Result<TransferDescriptor, TransferError> {
        self.local
            .offer_held(block_ids, blocks, format, ttl, hold, to)
    }

    fn discard(&self, desc: &TransferDescriptor) -> bool {
        self.local.discard(desc)
    }

    async fn pull(
        &self,
        desc: &TransferDescriptor,
        key: Option<PullKey>,
    ) -> Result<Pulled, TransferError> {
        if desc.agent == self.local.name {
            return self.local.pull(desc, key).await;
        }
        let addr = desc
            .agent
            .strip_prefix("tcp://")
            .ok_or_else(|| TransferError::Unreachable(desc.agent.clone()))?;
        let io = |e: std::io::Error| TransferError::Io {
            agent: desc.agent.clone(),
            message: e.to_string(),
        };
        let refused = |message: String| TransferError::Io {
            agent: desc.agent.clone(),
            message,
        };
        // Nothing is connected to, nor allocated for, a descriptor that could not be served.
        let total = (desc.block_ids.len() as u64)
            .checked_mul(u64::from(desc.block_bytes))
            .filter(|&t| t <= MAX_PULL_BYTES)
            .ok_or_else(|| {
                refused(format!(
                    "{} blocks of {} bytes is more than one pull may bring",
                    desc.block_ids.len(),
                    desc.block_bytes
                ))
            })? as usize;
        let tcp = tokio::time::timeout(Duration::from_secs(3), TcpStream::connect(addr))
            .await
            .map_err(|_| TransferError::Unreachable(desc.agent.clone()))?
            .map_err(io)?;
        dyn_trust::tune(&tcp);
        let mut s = self
            .trust
            .connect(tcp, addr)
            .await
            .map_err(|e| refused(e.to_string()))?;
        let pull = PullRequest {
            id: desc.transfer_id,
            key,
            ucx: self.ucx.is_some(),
        };
        write_control(&mut s, &pull).await.map_err(io)?;
        // Asking for UCX, the header waits for the offer's registration too.
        let header_wait = if pull.ucx {
            ucx_limit(total)
        } else {
            PULL_STALL
        };
        let (header, read_ahead): (PullHeader, _) =
            tokio::time::timeout(header_wait, read_control(&mut s))
                .await
                .map_err(|_| io(stalled()))?
                .map_err(io)?;
        if let Some(e) = header.error {
            return Err(refused(e));
        }
        if header.blocks as usize != desc.block_ids.len() || header.block_bytes != desc.block_bytes
        {
            return Err(refused(format!(
                "sent {} blocks of {} bytes for a descriptor of {} blocks of {}",
                header.blocks,
                header.block_bytes,
                desc.block_ids.len(),
                desc.block_bytes
            )));
        }
        let split = |mut all: Bytes| -> Vec<Bytes> {
            (0..header.blocks)
                .map(|_| all.split_to(header.block_bytes as usize))
                .collect()
        };
        let mut fallback = None;
        if let (Some(line), Some(ucx)) = (&header.ucx, &self.ucx) {
            match ucx_read(ucx, line, total).await {
                Ok(all) => {
                    // The offer ends on this; nothing is waited for.
                    let _ = write_control(&mut s, &PullDone { ok: true }).await;
                    return Ok(Pulled {
                        blocks: split(Bytes::from(all)),
                        via: Via::Ucx,
                        fallback: None,
                    });
                }
                Err(e) => {
                    write_control(&mut s, &PullDone { ok: false })
                        .await
                        .map_err(io)?;
                    fallback = Some(e);
                }
            }
        } else if header.ucx.is_some() {
            return Err(refused(
                "offered UCX, which this puller did not ask for".into(),
            ));
        }
        // One buffer for everything, read straight from the socket (after what the header's
        // read took ahead), then split per block without copying. `total` is the descriptor's
        // size, which the header matched.
        if read_ahead.len() > total {
            return Err(io(std::io::Error::other("bytes past the last block")));
        }
        let mut buf = BytesMut::zeroed(total);
        buf[..read_ahead.len()].copy_from_slice(&read_ahead);
        let mut at = read_ahead.len();
        while at < total {
            let n = tokio::time::timeout(PULL_STALL, s.read(&mut buf[at..]))
                .await
                .map_err(|_| io(stalled()))?
                .map_err(io)?;
            if n == 0 {
                return Err(io(std::io::ErrorKind::UnexpectedEof.into()));
            }
            at += n;
        }
        Ok(Pulled {
            blocks: split(buf.freeze()),
            via: Via::Tcp,
            fallback,
        })
    }
}

/// Read the `total` bytes the region `line` names (as the offering agent wrote it: checked
/// here, not trusted).
async fn ucx_read(ucx: &dyn_ucx::Agent, line: &str, total: usize) -> Result<Vec<u8>, String> {
    let remote: dyn_ucx::Remote = line.parse()?;
    if remote.len != total as u64 {
        return Err(format!(
            "the region has {} bytes, the blocks {total}",
            remote.len
        ));
    }
    ucx.get_into(
        &remote,
        0,
        Vec::with_capacity(total),
        total,
        ucx_limit(total),
    )
    .await
    .map_err(|e| e.to_string())
}
