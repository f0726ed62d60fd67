//! KV transfer: moving a request's KV-cache blocks from the worker that computed them (prefill)
//! to the worker that continues the request (decode).
//!
//! The prefill side *offers* blocks: they stay pinned in the agent until the decode side pulls
//! them or a time-to-live passes, and the offer is described by a [`TransferDescriptor`] (which
//! agent, which blocks, their size, layout and dtype) that travels with the request through the
//! control path. The decode side *pulls* with the descriptor. Two agents implement the trait:
//!
//! - [`InProcessAgent`]: both sides in one process; a pull hands over the same buffers.
//! - [`TcpAgent`]: one listener per process; a pull is one connection that sends the transfer
//!   id and reads a header and then every block's bytes back to back, so the transfer is one
//!   pipelined stream limited by the socket, not by round trips. Pulls of offers made by the
//!   same agent skip the socket. With a cluster identity the connection is TLS and a stranger
//!   is refused before it can name an offer. With UCX on both sides ([`TcpAgent::bind_with`])
//!   the same connection checks the pull and then hands the puller where to read the blocks
//!   with one-sided UCX reads (RDMA on a cluster, cross-memory attach on one machine); see
//!   [`tcp`].
//!
//! An offer is a capability: its id is 128 random bits, it can be pulled once, and, when the
//! router bound it to the decode worker it chose, only with that worker's [`PullKey`]. The
//! router draws the key per request and sends it to the decode worker alone (in the request,
//! over the request plane); the prefill worker and its offer hold only the key's SHA-256
//! ([`PullLock`]), which is what travels in the prefill job on the event plane. So a cluster
//! member that reads the job or the descriptor there cannot take the offer. A pull without the
//! key is refused and leaves the offer in place, so a guess or a mistaken worker cannot take
//! it or make it vanish.
//!
//! A CUDA agent (device↔host staging, peer copies) comes with the native engine's CUDA backend.

pub mod tcp;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;

pub use tcp::TcpAgent;

pub use dyn_protocol::transfer::{
    BlockDType, BlockFormat, BlockLayout, PullKey, PullLock, TransferDescriptor, TransferId,
};

impl From<crate::model::DType> for BlockDType {
    fn from(d: crate::model::DType) -> Self {
        match d {
            crate::model::DType::F32 => BlockDType::F32,
            crate::model::DType::F16 => BlockDType::F16,
            crate::model::DType::Bf16 => BlockDType::Bf16,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("block {index} has {got} bytes, the format says {want}")]
    BadBlock { index: usize, got: usize, want: u32 },
    #[error("{0} block ids for {1} blocks")]
    Mismatch(usize, usize),
    #[error(
        "transfer {0} is unknown: already pulled, expired, never offered here, or not for this worker"
    )]
    Unknown(TransferId),
    #[error("agent {0} is not reachable from this one")]
    Unreachable(String),
    #[error("transfer from {agent}: {message}")]
    Io { agent: String, message: String },
}

/// Kept with an offer and dropped when the offer ends (pulled, expired, or its agent gone): an
/// engine learns there when it may reuse the blocks it pinned for the transfer.
pub type Hold = Box<dyn std::any::Any + Send + Sync>;

/// Which wire brought a pull's blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    InProcess,
    Tcp,
    Ucx,
}

impl Via {
    pub fn as_str(self) -> &'static str {
        match self {
            Via::InProcess => "inproc",
            Via::Tcp => "tcp",
            Via::Ucx => "ucx",
        }
    }
}

impl std::fmt::Display for Via {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A pull's blocks, in order, and how they came.
#[derive(Debug)]
pub struct Pulled {
    pub blocks: Vec<Bytes>,
    pub via: Via,
    /// Why the faster wire both sides have was not the one used (a UCX read that failed and
    /// was streamed over TCP instead).
    pub fallback: Option<String>,
}

/// See the module docs.
#[async_trait::async_trait]
pub trait KvTransferAgent: Send + Sync + 'static {
    /// Pin `blocks` until they are pulled or `ttl` passes; anyone may pull them.
    fn offer(
        &self,
        block_ids: Vec<u32>,
        blocks: Vec<Bytes>,
        format: BlockFormat,
        ttl: Duration,
    ) -> Result<TransferDescriptor, TransferError> {
        self.offer_held(block_ids, blocks, format, ttl, None, None)
    }

    /// [`offer`](Self::offer), with `hold` dropped when the offer ends, for the holder of the
    /// key `to` locks only, when there is a lock.
    fn offer_held(
        &self,
        block_ids: Vec<u32>,
        blocks: Vec<Bytes>,
        format: BlockFormat,
        ttl: Duration,
        hold: Option<Hold>,
        to: Option<PullLock>,
    ) -> Result<TransferDescriptor, TransferError>;

    /// Fetch the blocks `desc` names, in order, with `key` (for an offer bound to a puller);
    /// the offer is released.
    async fn pull(
        &self,
        desc: &TransferDescriptor,
        key: Option<PullKey>,
    ) -> Result<Pulled, TransferError>;

    /// End an offer of this agent's that nobody will pull (its request was cancelled, or
    /// prefilled elsewhere), so its blocks are free now rather than at the TTL. True when
    /// there was such an offer.
    fn discard(&self, desc: &TransferDescriptor) -> bool;
}

struct Offer {
    blocks: Vec<Bytes>,
    block_bytes: u32,
    expires: Instant,
    /// The only puller that may take it, when bound to one.
    to: Option<PullLock>,
    _hold: Option<Hold>,
}

/// How long an offer stays, what it holds meanwhile, and whom it is for.
struct Terms {
    ttl: Duration,
    hold: Option<Hold>,
    to: Option<PullLock>,
}

/// Offers pinned by one agent.
#[derive(Default)]
struct Offers {
    map: Mutex<HashMap<TransferId, Offer>>,
}

impl Offers {
    fn add(
        &self,
        block_ids: &[u32],
        blocks: Vec<Bytes>,
        format: &BlockFormat,
        Terms { ttl, hold, to }: Terms,
    ) -> Result<TransferId, TransferError> {
        if block_ids.len() != blocks.len() {
            return Err(TransferError::Mismatch(block_ids.len(), blocks.len()));
        }
        if let Some((index, b)) = blocks
            .iter()
            .enumerate()
            .find(|(_, b)| b.len() != format.block_bytes as usize)
        {
            return Err(TransferError::BadBlock {
                index,
                got: b.len(),
                want: format.block_bytes,
            });
        }
        let id = TransferId::random();
        let now = Instant::now();
        let mut map = self.map.lock();
        // Offers nobody pulled in time are dropped here, so the map cannot grow without bound.
        map.retain(|_, o| o.expires > now);
        map.insert(
            id,
            Offer {
                blocks,
                block_bytes: format.block_bytes,
                expires: now + ttl,
                to,
                _hold: hold,
            },
        );
        Ok(id)
    }

    /// Pin the blocks and describe them as held by `agent`.
    fn offer(
        &self,
        agent: &str,
        block_ids: Vec<u32>,
        blocks: Vec<Bytes>,
        f: BlockFormat,
        terms: Terms,
    ) -> Result<TransferDescriptor, TransferError> {
        let transfer_id = self.add(&block_ids, blocks, &f, terms)?;
        Ok(TransferDescriptor {
            agent: agent.to_owned(),
            transfer_id,
            block_ids,
            block_bytes: f.block_bytes,
            layout: f.layout,
            dtype: f.dtype,
        })
    }

    /// The offer, for the holder of `key`: one bound to another key stays where it is.
    fn take(&self, id: TransferId, key: Option<PullKey>) -> Result<Offer, TransferError> {
        let mut map = self.map.lock();
        match map.get(&id) {
            Some(o) if o.to.is_some_and(|lock| !lock.opens(key)) => Err(TransferError::Unknown(id)),
            Some(o) if o.expires > Instant::now() => {
                Ok(map.remove(&id).ok_or(TransferError::Unknown(id))?)
            }
            Some(_) => {
                map.remove(&id);
                Err(TransferError::Unknown(id))
            }
            None => Err(TransferError::Unknown(id)),
        }
    }
}

/// Both sides in one process. Also the local half of a [`TcpAgent`], under its TCP name.
pub struct InProcessAgent {
    name: String,
    offers: Arc<Offers>,
}

impl Default for InProcessAgent {
    fn default() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self::named(format!("inproc://{}", NEXT.fetch_add(1, Ordering::Relaxed)))
    }
}

impl InProcessAgent {
    fn named(name: String) -> Self {
        Self {
            name,
            offers: Arc::default(),
        }
    }
}

#[async_trait::async_trait]
impl KvTransferAgent for InProcessAgent {
    fn offer_held(
        &self,
        block_ids: Vec<u32>,
        blocks: Vec<Bytes>,
        format: BlockFormat,
        ttl: Duration,
        hold: Option<Hold>,
        to: Option<PullLock>,
    ) -> Result<TransferDescriptor, TransferError> {
        self.offers.offer(
            &self.name,
            block_ids,
            blocks,
            format,
            Terms { ttl, hold, to },
        )
    }

    async fn pull(
        &self,
        desc: &TransferDescriptor,
        key: Option<PullKey>,
    ) -> Result<Pulled, TransferError> {
        if desc.agent != self.name {
            return Err(TransferError::Unreachable(desc.agent.clone()));
        }
        Ok(Pulled {
            blocks: self.offers.take(desc.transfer_id, key)?.blocks,
            via: Via::InProcess,
            fallback: None,
        })
    }

    fn discard(&self, desc: &TransferDescriptor) -> bool {
        // The hold goes with the offer: the engine releases the blocks.
        desc.agent == self.name && self.offers.map.lock().remove(&desc.transfer_id).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::tcp::{PullHeader, PullRequest, read_control, write_control};
    use super::*;
    use dyn_trust::Trust;
    use proptest::prelude::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn format(block_bytes: u32) -> BlockFormat {
        BlockFormat {
            block_bytes,
            layout: BlockLayout::LayerKvHeadSlotDim,
            dtype: BlockDType::Bf16,
        }
    }

    fn blocks(n: usize, size: usize, seed: u8) -> Vec<Bytes> {
        (0..n)
            .map(|i| {
                Bytes::from(
                    (0..size)
                        .map(|j| (i * 31 + j * 7) as u8 ^ seed)
                        .collect::<Vec<_>>(),
                )
            })
            .collect()
    }

    /// A hold that raises its flag when the offer ends.
    struct Flag(Arc<std::sync::atomic::AtomicBool>);

    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    /// A prefill side's agent and a decode side's, on loopback, without an identity.
    async fn plain_pair() -> (TcpAgent, TcpAgent) {
        let bind = || TcpAgent::bind("127.0.0.1:0", None, Trust::plain());
        (bind().await.unwrap(), bind().await.unwrap())
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        #[test]
        fn random_block_sets_arrive_byte_identical(n in 0usize..48, size in 1usize..9000, seed: u8) {
            let rt = rt();
            rt.block_on(async {
                let (prefill, decode) = plain_pair().await;
                let sent = blocks(n, size, seed);
                let ids: Vec<u32> = (0..n as u32).map(|i| i * 3 + 1).collect();
                let desc = prefill.offer(ids.clone(), sent.clone(), format(size as u32), Duration::from_secs(10)).unwrap();
                assert_eq!(desc.block_ids, ids);
                let got = decode.pull(&desc, None).await.unwrap().blocks;
                assert_eq!(got, sent);
                // In-process: the same buffers come back.
                let local = InProcessAgent::default();
                let desc = local.offer(ids, sent.clone(), format(size as u32), Duration::from_secs(10)).unwrap();
                assert_eq!(local.pull(&desc, None).await.unwrap().blocks, sent);
            });
        }
    }

    #[test]
    fn block_dtypes_travel_and_are_recorded_by_name() {
        // The wire (descriptors) and the offload files' headers spell them as before.
        for (d, name) in [
            (BlockDType::F32, "f32"),
            (BlockDType::F16, "f16"),
            (BlockDType::Bf16, "bf16"),
            (BlockDType::U32le, "u32le"),
        ] {
            assert_eq!(serde_json::to_value(d).unwrap(), serde_json::json!(name));
            assert_eq!(d.to_string(), name);
            assert_eq!(
                serde_json::from_value::<BlockDType>(name.into()).unwrap(),
                d
            );
        }
        assert_eq!(
            BlockDType::from(crate::model::DType::Bf16),
            BlockDType::Bf16
        );
        assert!(serde_json::from_value::<BlockDType>("int4".into()).is_err());
    }

    #[tokio::test]
    async fn an_offer_is_pulled_once_and_expires() {
        let (prefill, decode) = plain_pair().await;
        let desc = prefill
            .offer(
                vec![1, 2],
                blocks(2, 64, 1),
                format(64),
                Duration::from_secs(10),
            )
            .unwrap();
        decode.pull(&desc, None).await.unwrap();
        let again = decode.pull(&desc, None).await.unwrap_err();
        assert!(again.to_string().contains("unknown"), "{again}");
        let short = prefill
            .offer(
                vec![1],
                blocks(1, 64, 2),
                format(64),
                Duration::from_millis(20),
            )
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(decode.pull(&short, None).await.is_err());
        // Pulling from the agent that made the offer skips the socket.
        let own = prefill
            .offer(vec![9], blocks(1, 8, 3), format(8), Duration::from_secs(10))
            .unwrap();
        assert_eq!(
            prefill.pull(&own, None).await.unwrap().blocks,
            blocks(1, 8, 3)
        );
    }

    /// The engine learns through the hold when its pinned blocks are free again.
    #[tokio::test]
    async fn the_hold_is_dropped_when_the_offer_ends() {
        let (prefill, decode) = plain_pair().await;
        let held = |f: &Arc<std::sync::atomic::AtomicBool>| Some(Box::new(Flag(f.clone())) as Hold);
        let pulled = Arc::default();
        let desc = prefill
            .offer_held(
                vec![1],
                blocks(1, 8, 1),
                format(8),
                Duration::from_secs(10),
                held(&pulled),
                None,
            )
            .unwrap();
        assert!(!pulled.load(Ordering::SeqCst));
        decode.pull(&desc, None).await.unwrap();
        for _ in 0..100 {
            if pulled.load(Ordering::SeqCst) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(pulled.load(Ordering::SeqCst), "released after the pull");
        let expired = Arc::default();
        prefill
            .offer_held(
                vec![1],
                blocks(1, 8, 1),
                format(8),
                Duration::ZERO,
                held(&expired),
                None,
            )
            .unwrap();
        // Expired offers are swept when the next one is made.
        prefill
            .offer(vec![1], blocks(1, 8, 1), format(8), Duration::from_secs(1))
            .unwrap();
        assert!(expired.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn bad_offers_and_unreachable_agents_are_errors() {
        let a = InProcessAgent::default();
        assert!(matches!(
            a.offer(
                vec![1],
                blocks(1, 10, 0),
                format(16),
                Duration::from_secs(1)
            ),
            Err(TransferError::BadBlock { .. })
        ));
        assert!(matches!(
            a.offer(
                vec![1, 2],
                blocks(1, 16, 0),
                format(16),
                Duration::from_secs(1)
            ),
            Err(TransferError::Mismatch(2, 1))
        ));
        let b = InProcessAgent::default();
        let desc = a
            .offer(
                vec![1],
                blocks(1, 16, 0),
                format(16),
                Duration::from_secs(1),
            )
            .unwrap();
        assert!(matches!(
            b.pull(&desc, None).await,
            Err(TransferError::Unreachable(_))
        ));
        let tcp = TcpAgent::bind("127.0.0.1:0", None, Trust::plain())
            .await
            .unwrap();
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let gone = TransferDescriptor {
            agent: format!("tcp://127.0.0.1:{port}"),
            ..desc
        };
        assert!(tcp.pull(&gone, None).await.is_err());
    }

    fn token(t: &str) -> Trust {
        Trust::from_secrets(dyn_trust::Secrets {
            token: Some(t.as_bytes().to_vec()),
            ca: None,
        })
        .unwrap()
    }

    /// Offers are capabilities: unguessable, for the worker named only, and a refused pull
    /// leaves them for that worker; a stranger to the cluster is refused before it can ask.
    #[tokio::test]
    async fn only_the_intended_worker_of_the_cluster_takes_an_offer() {
        const TOKEN: &str = "transfer-token-of-the-cluster";
        let prefill = TcpAgent::bind("127.0.0.1:0", None, token(TOKEN))
            .await
            .unwrap();
        let decode = TcpAgent::bind("127.0.0.1:0", None, token(TOKEN))
            .await
            .unwrap();
        let sent = blocks(2, 64, 7);
        let key = PullKey::random();
        // The offer holds the lock only; the lock (which the prefill job carries on the event
        // plane) does not open it.
        let lock = key.lock();
        let desc = prefill
            .offer_held(
                vec![1, 2],
                sent.clone(),
                format(64),
                Duration::from_secs(10),
                None,
                Some(lock),
            )
            .unwrap();
        // Strangers: no identity, another token.
        for trust in [Trust::plain(), token("not-the-cluster-token")] {
            let stranger = TcpAgent::bind("127.0.0.1:0", None, trust).await.unwrap();
            let e = stranger.pull(&desc, Some(key)).await.unwrap_err();
            assert!(matches!(e, TransferError::Io { .. }), "{e}");
        }
        // A member without the key: none, another, or the lock read off the job as a key.
        let read_off: PullKey =
            serde_json::from_value(serde_json::to_value(lock).unwrap()).unwrap();
        for other in [None, Some(PullKey::random()), Some(read_off)] {
            let e = decode.pull(&desc, other).await.unwrap_err();
            assert!(e.to_string().contains("unknown"), "{e}");
        }
        // Guessed ids find nothing.
        for _ in 0..64 {
            let guess = TransferDescriptor {
                transfer_id: TransferId::random(),
                ..desc.clone()
            };
            assert!(decode.pull(&guess, Some(key)).await.is_err());
        }
        // The intended worker still gets every byte, once.
        assert_eq!(decode.pull(&desc, Some(key)).await.unwrap().blocks, sent);
        assert!(decode.pull(&desc, Some(key)).await.is_err());
        // Keys travel as 32 hex digits, and are not shown in logs.
        let json = serde_json::to_value(key).unwrap();
        assert_eq!(serde_json::from_value::<PullKey>(json).unwrap(), key);
        assert_eq!(format!("{key:?}"), "PullKey(..)");
        assert_eq!(desc.transfer_id.to_string().len(), 32);
        let json = serde_json::to_value(&desc).unwrap();
        assert_eq!(
            serde_json::from_value::<TransferDescriptor>(json).unwrap(),
            desc
        );
    }

    /// A forged descriptor asking for more than a pull may bring is refused before anything
    /// is connected to or allocated.
    #[tokio::test]
    async fn a_forged_descriptor_is_refused_before_connecting() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let forged = TransferDescriptor {
            agent: format!("tcp://{}", listener.local_addr().unwrap()),
            transfer_id: TransferId(1),
            block_ids: vec![0; 1 << 20],
            block_bytes: u32::MAX,
            layout: BlockLayout::TokenIds,
            dtype: BlockDType::U32le,
        };
        let decode = TcpAgent::bind("127.0.0.1:0", None, Trust::plain())
            .await
            .unwrap();
        let e = decode.pull(&forged, None).await.unwrap_err();
        assert!(e.to_string().contains("more than one pull"), "{e}");
        let accepted = tokio::time::timeout(Duration::from_millis(100), listener.accept()).await;
        assert!(accepted.is_err(), "nothing connected");
    }

    /// A prefill host that goes silent mid-pull (its header sent, its blocks never) fails the
    /// pull after the stall bound instead of holding the decode worker for ever. Virtual time:
    /// the runtime jumps to the bound as soon as everything waits.
    #[tokio::test(start_paused = true)]
    async fn a_pull_from_a_host_gone_silent_fails_at_the_stall_bound() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let agent = format!("tcp://{}", listener.local_addr().unwrap());
        let _silent = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let _: (PullRequest, _) = read_control(&mut s).await.unwrap();
            let header = PullHeader {
                error: None,
                blocks: 2,
                block_bytes: 64,
                ucx: None,
            };
            write_control(&mut s, &header).await.unwrap();
            std::future::pending::<()>().await;
        });
        let desc = TransferDescriptor {
            agent,
            transfer_id: TransferId(7),
            block_ids: vec![0, 1],
            block_bytes: 64,
            layout: BlockLayout::TokenIds,
            dtype: BlockDType::U32le,
        };
        let decode = TcpAgent::bind("127.0.0.1:0", None, Trust::plain())
            .await
            .unwrap();
        let e = decode.pull(&desc, None).await.unwrap_err();
        assert!(e.to_string().contains("no bytes for 10s"), "{e}");
    }

    /// Agents with UCX (each its own UCX context and worker, as in two processes).
    async fn ucx_agent() -> TcpAgent {
        let ucx = dyn_ucx::Agent::new("test-ucx").expect("UCX starts");
        TcpAgent::bind_with("127.0.0.1:0", None, Trust::plain(), Some(Arc::new(ucx)))
            .await
            .unwrap()
    }

    /// Both sides with UCX: the blocks come through it byte for byte, the offer ends with
    /// the pull (its hold dropped), and a second pull is refused. Either side without UCX:
    /// the stream, with no fallback to report.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn blocks_move_through_ucx_when_both_sides_have_it_and_over_tcp_otherwise() {
        let (prefill, decode) = (ucx_agent().await, ucx_agent().await);
        assert_eq!(prefill.wire(), Via::Ucx);
        let sent = blocks(5, 4096, 9);
        let ended = Arc::<std::sync::atomic::AtomicBool>::default();
        let desc = prefill
            .offer_held(
                vec![4, 5, 6, 7, 8],
                sent.clone(),
                format(4096),
                Duration::from_secs(10),
                Some(Box::new(Flag(ended.clone()))),
                None,
            )
            .unwrap();
        let got = decode.pull(&desc, None).await.unwrap();
        assert_eq!((got.via, got.fallback), (Via::Ucx, None));
        assert_eq!(got.blocks, sent);
        for _ in 0..200 {
            if ended.load(Ordering::SeqCst) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(
            ended.load(Ordering::SeqCst),
            "the offer ends when the puller is done"
        );
        assert!(decode.pull(&desc, None).await.is_err(), "pulled once");

        let plain = TcpAgent::bind("127.0.0.1:0", None, Trust::plain())
            .await
            .unwrap();
        for (from, to) in [(&plain, &decode), (&prefill, &plain)] {
            let desc = from
                .offer(
                    vec![1, 2],
                    sent[..2].to_vec(),
                    format(4096),
                    Duration::from_secs(10),
                )
                .unwrap();
            let got = to.pull(&desc, None).await.unwrap();
            assert_eq!((got.via, got.fallback), (Via::Tcp, None));
            assert_eq!(got.blocks, sent[..2]);
        }
    }

    /// A UCX read that fails falls back to the stream on the same connection, and says why:
    /// the puller's side against a server whose region does not hold the blocks (a real
    /// region, one byte short: refused before anything is read), the server's side against a
    /// puller that reports its read failed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_ucx_read_falls_back_to_the_stream() {
        let sent = blocks(3, 1000, 4);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let agent = format!("tcp://{}", listener.local_addr().unwrap());
        let owner = dyn_ucx::Agent::new("test-ucx-owner").expect("UCX starts");
        let served = sent.clone();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let (pull, _): (PullRequest, _) = read_control(&mut s).await.unwrap();
            assert!(pull.ucx, "the puller asks for UCX");
            let region = owner.register(Bytes::from(vec![7u8; 2999])).await.unwrap();
            let bad = region.remote().clone();
            let header = PullHeader {
                error: None,
                blocks: 3,
                block_bytes: 1000,
                ucx: Some(bad.to_string()),
            };
            write_control(&mut s, &header).await.unwrap();
            let (done, _): (serde_json::Value, _) = read_control(&mut s).await.unwrap();
            assert_eq!(done, serde_json::json!({"ok": false}));
            for b in &served {
                s.write_all(b).await.unwrap();
            }
        });
        let desc = TransferDescriptor {
            agent,
            transfer_id: TransferId(7),
            block_ids: vec![0, 1, 2],
            block_bytes: 1000,
            layout: BlockLayout::LayerKvHeadSlotDim,
            dtype: BlockDType::Bf16,
        };
        let decode = ucx_agent().await;
        let got = decode.pull(&desc, None).await.unwrap();
        server.await.unwrap();
        assert_eq!(got.via, Via::Tcp);
        assert!(got.fallback.is_some(), "the reason is kept");
        assert_eq!(got.blocks, sent);

        // The serving side: told the read failed, it streams the blocks.
        let prefill = ucx_agent().await;
        let desc = prefill
            .offer(
                vec![1, 2, 3],
                sent.clone(),
                format(1000),
                Duration::from_secs(10),
            )
            .unwrap();
        let addr = desc.agent.strip_prefix("tcp://").unwrap();
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let pull = PullRequest {
            id: desc.transfer_id,
            key: None,
            ucx: true,
        };
        write_control(&mut s, &pull).await.unwrap();
        let (header, ahead): (PullHeader, _) = read_control(&mut s).await.unwrap();
        assert!(header.ucx.is_some() && ahead.is_empty());
        write_control(&mut s, &serde_json::json!({"ok": false}))
            .await
            .unwrap();
        let mut all = vec![0u8; 3000];
        s.read_exact(&mut all).await.unwrap();
        assert_eq!(all, sent.concat());
    }
}
