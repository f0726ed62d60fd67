//! vLLM's KV-cache events, followed over ZeroMQ and republished as dyn's own.
//!
//! vLLM's publisher (`vllm/distributed/kv_events.py`) sends multipart messages `(topic, seq,
//! payload)`: `seq` an 8-byte big-endian batch number from 0, `payload` a msgpack
//! `KVEventBatch` — an array `[ts, events, dp_rank?]` whose events are maps tagged by `type`:
//! `BlockStored {block_hashes, parent_block_hash, token_ids, block_size, medium, …}`,
//! `BlockRemoved {block_hashes, medium, …}`, `AllBlocksCleared`. A ROUTER socket replays
//! buffered batches: send `(b"", start_seq)`, receive `(b"", topic, seq, payload)` per batch
//! and then `(b"", b"", -1, b"")`.
//!
//! vLLM's block hashes are opaque (SHA-256 over its own key), so the follower keeps a
//! mirror of the server's cache: per vLLM hash, dyn's hashes of the same block, computed from
//! the token ids `BlockStored` carries. Routers get dyn events on the event plane with
//! consecutive ids, exactly as from dyn's engines, and a router that lost some asks for a
//! dump, answered from the mirror. A gap in vLLM's batch numbers is filled from the replay
//! socket; a batch number going back means the server restarted with an empty cache.
//!
//! Where the sockets are: a server dyn launches is told to connect its publisher to a SUB
//! socket dyn binds on loopback (vLLM binds only `*`/`::` endpoints, and servers here bind to
//! loopback only), and to bind its replay socket on a loopback port dyn chose. A server given
//! by URL publishes where `kv_publishers` says, and dyn connects.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dyn_core::BuildCx;
use dyn_core::planes::EventBus;
use dyn_protocol::kv::{
    BlockHash, KvCacheEvent, KvEventData, Medium, ResyncRequest, RouterEvent, chain_hash,
    kv_events_subject, kv_resync_subject, local_hash,
};
use futures::StreamExt;
use parking_lot::Mutex;
use serde::Deserialize;
use tokio::sync::{mpsc, watch};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::server::Endpoint;

/// A vLLM block hash: an integer, or bytes in some hash modes. (Read by hand: serde's
/// untagged enums buffer values and lose msgpack's 64-bit unsigned integers.)
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum VllmHash {
    Int(i128),
    Bytes(Vec<u8>),
}

impl<'de> Deserialize<'de> for VllmHash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{Error, SeqAccess, Visitor};
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = VllmHash;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a block hash (integer or bytes)")
            }
            fn visit_u64<E: Error>(self, v: u64) -> Result<VllmHash, E> {
                Ok(VllmHash::Int(i128::from(v)))
            }
            fn visit_i64<E: Error>(self, v: i64) -> Result<VllmHash, E> {
                Ok(VllmHash::Int(i128::from(v)))
            }
            fn visit_bytes<E: Error>(self, v: &[u8]) -> Result<VllmHash, E> {
                Ok(VllmHash::Bytes(v.to_vec()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<VllmHash, A::Error> {
                let mut out = Vec::new();
                while let Some(b) = s.next_element()? {
                    out.push(b);
                }
                Ok(VllmHash::Bytes(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// One event of a batch; fields dyn does not use are skipped.
#[derive(Debug, Deserialize, PartialEq)]
#[serde(tag = "type")]
pub enum VllmEvent {
    BlockStored {
        block_hashes: Vec<VllmHash>,
        parent_block_hash: Option<VllmHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        #[serde(default)]
        medium: Option<String>,
        /// The adapter the blocks were computed under: dyn's name for it there
        /// (`crate::lora::served_name`), or none.
        #[serde(default)]
        lora_name: Option<String>,
    },
    BlockRemoved {
        block_hashes: Vec<VllmHash>,
        #[serde(default)]
        medium: Option<String>,
    },
    AllBlocksCleared,
    /// An event type of a later vLLM.
    #[serde(other)]
    Other,
}

/// `KVEventBatch`: an array `[ts, events, dp_rank?]` (a struct reads from an array by
/// position).
#[derive(Debug, Deserialize)]
pub struct VllmBatch {
    _ts: serde::de::IgnoredAny,
    pub events: Vec<VllmEvent>,
    #[serde(default)]
    _dp_rank: Option<serde::de::IgnoredAny>,
}

pub fn decode_batch(payload: &[u8]) -> Result<VllmBatch, rmp_serde::decode::Error> {
    rmp_serde::from_slice(payload)
}

/// The tier an event is about; `None` for a medium dyn does not know (skipped).
fn tier(medium: &Option<String>) -> Option<Medium> {
    medium
        .as_deref()
        .map_or(Some(Medium::Gpu), Medium::from_vllm)
}

/// The server's cache as dyn names it.
#[derive(Default)]
pub struct Mirror {
    /// vLLM hash → (dyn hashes, parent's vLLM hash, tiers holding it as [`Medium::bit`]s).
    blocks: HashMap<VllmHash, (BlockHash, Option<VllmHash>, u8)>,
    /// The block size the server announced in its events (0 until then).
    pub block_size: u32,
}

impl Mirror {
    /// dyn events (each with its tier) for a vLLM batch's events, the mirror updated. An
    /// offload tier's copy of a block the mirror knows needs no token ids: vLLM names a block
    /// by the same hash in every tier.
    pub fn apply(&mut self, events: Vec<VllmEvent>) -> Vec<(Medium, KvEventData)> {
        let mut out = Vec::new();
        for ev in events {
            match ev {
                VllmEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    medium,
                    lora_name,
                } => {
                    let Some(medium) = tier(&medium) else {
                        continue;
                    };
                    // An adapter's blocks hash apart, as dyn's requests of it do.
                    let salt = lora_name
                        .as_deref()
                        .and_then(crate::lora::key_of)
                        .map(|k| dyn_protocol::kv::salt_of(None, Some(&k)).unwrap_or_default());
                    if block_size > 0 {
                        self.block_size = block_size;
                    }
                    let parent = match &parent_block_hash {
                        None => None,
                        Some(p) => match self.blocks.get(p) {
                            Some((h, _, _)) => Some(h.block_hash),
                            None => {
                                // Stored before dyn followed and not replayable: the
                                // chain cannot be named; the blocks are left out.
                                tracing::debug!(
                                    "KV event for a block whose parent is unknown; skipped"
                                );
                                continue;
                            }
                        },
                    };
                    let mut chain = parent;
                    let mut parent_v = parent_block_hash;
                    let mut blocks = Vec::with_capacity(block_hashes.len());
                    let mut tokens = token_ids.chunks_exact(block_size.max(1) as usize);
                    for v in block_hashes {
                        let h = match (self.blocks.get_mut(&v), tokens.next()) {
                            (Some(known), _) => {
                                known.2 |= medium.bit();
                                known.0
                            }
                            (None, Some(tokens)) if block_size > 0 => {
                                let local = local_hash(tokens);
                                let local = match chain {
                                    None => dyn_protocol::kv::salted_local(salt, local),
                                    Some(_) => local,
                                };
                                let h = BlockHash {
                                    block_hash: chain_hash(chain, local),
                                    tokens_hash: local,
                                };
                                self.blocks
                                    .insert(v.clone(), (h, parent_v.take(), medium.bit()));
                                h
                            }
                            // Neither known nor given: the rest of the chain cannot be named.
                            _ => break,
                        };
                        parent_v = Some(v);
                        chain = Some(h.block_hash);
                        blocks.push(h);
                    }
                    if !blocks.is_empty() {
                        out.push((
                            medium,
                            KvEventData::Stored {
                                parent_hash: parent,
                                blocks,
                            },
                        ));
                    }
                }
                VllmEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } => {
                    let Some(medium) = tier(&medium) else {
                        continue;
                    };
                    let mut gone = Vec::new();
                    for v in &block_hashes {
                        let Some(entry) = self.blocks.get_mut(v) else {
                            continue;
                        };
                        if entry.2 & medium.bit() == 0 {
                            continue;
                        }
                        entry.2 &= !medium.bit();
                        gone.push(entry.0.block_hash);
                        if entry.2 == 0 {
                            self.blocks.remove(v);
                        }
                    }
                    if !gone.is_empty() {
                        out.push((medium, KvEventData::Removed { block_hashes: gone }));
                    }
                }
                VllmEvent::AllBlocksCleared => {
                    self.blocks.clear();
                    out.push((Medium::Gpu, KvEventData::Cleared));
                }
                VllmEvent::Other => {}
            }
        }
        out
    }

    /// The whole cache: `Cleared`, then one `Stored` per block and tier, parents first.
    pub fn dump(&self) -> Vec<(Medium, KvEventData)> {
        let held = self.blocks.values().flat_map(|(h, parent_v, mask)| {
            let parent = parent_v
                .as_ref()
                .and_then(|p| self.blocks.get(p))
                .map(|(p, _, _)| p.block_hash);
            Medium::ALL
                .into_iter()
                .filter(move |m| mask & m.bit() != 0)
                .map(move |m| (m, h.block_hash, parent, h.tokens_hash))
        });
        dyn_protocol::kv::dump_events(held)
    }
}

/// The end-of-replay marker's batch number (-1).
const END_SEQ: u64 = u64::MAX;

/// Follows one replica's server's events for as long as it lives.
pub struct Follower {
    /// The SUB endpoint: bound by dyn (a launched server connects to it) or the server's.
    events: String,
    /// Replay endpoint of the launched server's current start.
    replay: Arc<Mutex<Option<String>>>,
    pub mirror: Arc<Mutex<Mirror>>,
}

impl Follower {
    /// A SUB socket on `at`: bound there (a server's publisher connects to it; a launched
    /// one is told a free port through [`Follower::launch_args`]) or connected to a
    /// publisher that binds.
    pub async fn open(
        at: &str,
        bind: bool,
        replay: Option<String>,
    ) -> Result<(Follower, SubSocket), String> {
        let mut sub = SubSocket::new();
        let events = if bind {
            sub.bind(at)
                .await
                .map_err(|e| format!("cannot bind a ZeroMQ socket for KV events at {at}: {e}"))?
                .to_string()
        } else {
            sub.connect(at)
                .await
                .map_err(|e| format!("cannot connect to vLLM's KV events at {at}: {e}"))?;
            at.to_owned()
        };
        sub.subscribe("")
            .await
            .map_err(|e| format!("cannot subscribe: {e}"))?;
        Ok((
            Follower {
                events,
                replay: Arc::new(Mutex::new(replay)),
                mirror: Arc::default(),
            },
            sub,
        ))
    }

    /// `--kv-events-config` for a launched server: publish to dyn's socket, replay on a fresh
    /// loopback port.
    pub fn launch_args(&self) -> impl Fn() -> String + Send + Sync + 'static {
        let events = self.events.clone();
        let replay = self.replay.clone();
        move || {
            let r = super::server::free_port()
                .map(|p| format!("tcp://127.0.0.1:{p}"))
                .ok();
            *replay.lock() = r.clone();
            let config = serde_json::json!({
                "enable_kv_cache_events": true,
                "publisher": "zmq",
                "endpoint": events,
                "replay_endpoint": r,
            });
            format!("--kv-events-config '{config}'")
        }
    }

    /// Follow `sub` until the process ends: apply batches to the mirror and publish dyn's
    /// events; answer routers' dump requests. `endpoint` tells of server restarts.
    pub async fn run(
        self,
        mut sub: SubSocket,
        cx: &BuildCx,
        mut endpoint: watch::Receiver<Option<Endpoint>>,
    ) -> Result<(), String> {
        let worker_id = cx.instance_id.get();
        let (tx, rx) = mpsc::channel::<Vec<(Medium, KvEventData)>>(1024);
        tokio::spawn(publish(
            rx,
            cx.planes.events.clone(),
            kv_events_subject(&cx.namespace, &cx.node),
            worker_id,
        ));
        let mut resync = cx
            .planes
            .events
            .subscribe(&kv_resync_subject(&cx.namespace, &cx.node))
            .await
            .map_err(|e| format!("cannot subscribe to KV resync requests: {e}"))?;
        let mirror = self.mirror.clone();
        let dumps = tx.clone();
        tokio::spawn(async move {
            while let Some(ev) = resync.next().await {
                let Ok(req) = serde_json::from_slice::<ResyncRequest>(&ev.payload) else {
                    continue;
                };
                if req.worker_id == worker_id {
                    let dump = mirror.lock().dump();
                    if dumps.send(dump).await.is_err() {
                        break;
                    }
                }
            }
        });
        let mut next_seq: Option<u64> = None;
        let mut generation = endpoint.borrow().as_ref().map(|e| e.generation);
        loop {
            let msg = tokio::select! {
                m = sub.recv() => m,
                changed = endpoint.changed() => {
                    if changed.is_err() {
                        return Ok(());
                    }
                    let now = endpoint.borrow_and_update().as_ref().map(|e| e.generation);
                    if let Some(g) = now && Some(g) != generation {
                        // A new start: its cache is empty and its batches count from 0.
                        if generation.is_some() {
                            self.restart(&tx).await;
                        }
                        generation = Some(g);
                        next_seq = None;
                        if let Some(fill) = self.replay_from(0).await {
                            self.apply_all(fill, &tx, &mut next_seq).await;
                        }
                    }
                    continue;
                }
            };
            let msg = match msg {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(error = %e, "KV event socket failed");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
            let Some((seq, payload)) = frames(msg) else {
                tracing::warn!("Ignoring a malformed KV event message");
                continue;
            };
            match next_seq {
                Some(n) if seq < n => {
                    // Counting from 0 again: the server restarted (one dyn did not start).
                    self.restart(&tx).await;
                }
                Some(n) if seq > n => {
                    tracing::warn!(
                        expected = n,
                        got = seq,
                        "vLLM KV event batches lost; replaying"
                    );
                    match self.replay_from(n).await {
                        Some(fill) => {
                            let fill = fill.into_iter().filter(|(s, _)| *s < seq).collect();
                            self.apply_all(fill, &tx, &mut next_seq).await;
                        }
                        None => {
                            // Nothing to replay from: what was lost is unknown, so forget the
                            // mirror (routers are told) rather than keep it wrong.
                            self.restart(&tx).await;
                        }
                    }
                }
                _ => {}
            }
            self.apply_all(vec![(seq, payload)], &tx, &mut next_seq)
                .await;
        }
    }

    async fn restart(&self, tx: &mpsc::Sender<Vec<(Medium, KvEventData)>>) {
        self.mirror.lock().blocks.clear();
        let _ = tx.send(vec![(Medium::Gpu, KvEventData::Cleared)]).await;
    }

    async fn apply_all(
        &self,
        batches: Vec<(u64, Bytes)>,
        tx: &mpsc::Sender<Vec<(Medium, KvEventData)>>,
        next_seq: &mut Option<u64>,
    ) {
        for (seq, payload) in batches {
            if next_seq.is_some_and(|n| seq < n) {
                continue;
            }
            *next_seq = Some(seq + 1);
            let batch = match decode_batch(&payload) {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!(error = %e, seq, "Ignoring an unreadable vLLM KV event batch");
                    continue;
                }
            };
            let events = self.mirror.lock().apply(batch.events);
            if !events.is_empty() && tx.send(events).await.is_err() {
                return;
            }
        }
    }

    /// Batches from `start` on, from the server's replay socket (none without one).
    async fn replay_from(&self, start: u64) -> Option<Vec<(u64, Bytes)>> {
        let at = self.replay.lock().clone()?;
        let ask = async {
            let mut dealer = DealerSocket::new();
            dealer.connect(&at).await.map_err(|e| e.to_string())?;
            let mut m = ZmqMessage::from(Bytes::new());
            m.push_back(Bytes::copy_from_slice(&start.to_be_bytes()));
            dealer.send(m).await.map_err(|e| e.to_string())?;
            let mut out = Vec::new();
            loop {
                let reply = dealer.recv().await.map_err(|e| e.to_string())?;
                // (b"", topic, seq, payload)
                let mut f = reply.into_vecdeque();
                f.pop_front();
                let Some((seq, payload)) = ZmqMessage::try_from(f).ok().and_then(frames) else {
                    return Err("malformed replay".to_owned());
                };
                if seq == END_SEQ {
                    return Ok::<_, String>(out);
                }
                out.push((seq, payload));
            }
        };
        match tokio::time::timeout(Duration::from_secs(5), ask).await {
            Ok(Ok(batches)) => Some(batches),
            Ok(Err(e)) => {
                tracing::warn!(replay = %at, error = %e, "vLLM KV event replay failed");
                None
            }
            Err(_) => {
                tracing::warn!(replay = %at, "vLLM KV event replay timed out");
                None
            }
        }
    }
}

/// `(topic, seq, payload)` → `(seq, payload)`.
fn frames(msg: ZmqMessage) -> Option<(u64, Bytes)> {
    let v = msg.into_vec();
    let [_, seq, payload] = <[Bytes; 3]>::try_from(v).ok()?;
    let seq = u64::from_be_bytes(seq.as_ref().try_into().ok()?);
    Some((seq, payload))
}

/// Publish dyn events in order with consecutive ids.
async fn publish(
    mut rx: mpsc::Receiver<Vec<(Medium, KvEventData)>>,
    events: Arc<dyn EventBus>,
    subject: String,
    worker_id: u64,
) {
    let mut event_id = 0u64;
    while let Some(batch) = rx.recv().await {
        for (medium, data) in batch {
            let ev = RouterEvent {
                worker_id,
                event: KvCacheEvent {
                    event_id,
                    dp_rank: 0,
                    medium,
                    data,
                },
            };
            event_id += 1;
            let Ok(payload) = serde_json::to_vec(&ev) else {
                continue;
            };
            if let Err(e) = events.publish(&subject, payload.into()).await {
                tracing::warn!(error = %e, subject, "Cannot publish a KV event");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dyn_protocol::kv::block_hashes;

    /// A batch as vLLM's msgspec encoder writes it (maps tagged by `type`, batch as array).
    fn batch(events: serde_json::Value) -> Vec<u8> {
        let v = serde_json::json!([1795412261.75, events, 0]);
        rmp_serde::to_vec(&v).expect("msgpack")
    }

    #[test]
    fn an_adapters_blocks_hash_as_dyns_requests_of_it_do() {
        let tokens: Vec<u32> = (100..132).collect();
        let lora = dyn_protocol::types::LoraRef {
            name: "qv".into(),
            path: "/a".into(),
            id: 0x1f,
        };
        let b = batch(serde_json::json!([
            {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": null,
             "token_ids": &tokens, "block_size": 16, "lora_id": 1, "medium": "GPU",
             "lora_name": crate::lora::served_name(&lora)},
        ]));
        let mut m = Mirror::default();
        let out = m.apply(decode_batch(&b).expect("batch").events);
        let salt = dyn_protocol::kv::salt_of(None, Some(&lora.key()));
        let want = dyn_protocol::kv::block_hashes_salted(&tokens, 16, salt);
        assert_eq!(
            out,
            vec![(
                Medium::Gpu,
                KvEventData::Stored {
                    parent_hash: None,
                    blocks: want
                }
            )]
        );
    }

    #[test]
    fn stored_blocks_get_dyns_hashes_and_removals_and_dumps_follow() {
        let tokens: Vec<u32> = (100..164).collect();
        let b = batch(serde_json::json!([
            {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": null,
             "token_ids": &tokens[..32], "block_size": 16, "lora_id": null, "medium": "GPU", "lora_name": null},
            {"type": "BlockStored", "block_hashes": [13, 14], "parent_block_hash": 12,
             "token_ids": &tokens[32..], "block_size": 16, "lora_id": null, "medium": "GPU", "lora_name": null},
            {"type": "SomethingNew", "x": 1},
        ]));
        let decoded = decode_batch(&b).expect("batch");
        let mut m = Mirror::default();
        let out = m.apply(decoded.events);
        let want = block_hashes(&tokens, 16);
        let gpu = |e| (Medium::Gpu, e);
        assert_eq!(
            out,
            vec![
                gpu(KvEventData::Stored {
                    parent_hash: None,
                    blocks: want[..2].to_vec()
                }),
                gpu(KvEventData::Stored {
                    parent_hash: Some(want[1].block_hash),
                    blocks: want[2..].to_vec()
                }),
            ]
        );
        assert_eq!(m.block_size, 16);
        let dump = m.dump();
        assert_eq!(dump[0], gpu(KvEventData::Cleared));
        assert_eq!(dump.len(), 5);
        assert_eq!(
            dump[4],
            gpu(KvEventData::Stored {
                parent_hash: Some(want[2].block_hash),
                blocks: vec![want[3]]
            })
        );
        // The offload tier's copy of a known block: named without token ids.
        let offloaded = batch(serde_json::json!([
            {"type": "BlockStored", "block_hashes": [13], "parent_block_hash": 12,
             "token_ids": [], "block_size": 16, "lora_id": null, "medium": "CPU", "lora_name": null},
        ]));
        assert_eq!(
            m.apply(decode_batch(&offloaded).expect("batch").events),
            vec![(
                Medium::Cpu,
                KvEventData::Stored {
                    parent_hash: Some(want[1].block_hash),
                    blocks: vec![want[2]]
                }
            )]
        );
        assert_eq!(m.dump().len(), 6, "block 13 in two tiers");
        let removed = batch(serde_json::json!([
            {"type": "BlockRemoved", "block_hashes": [14, 99], "medium": "GPU"},
            {"type": "BlockRemoved", "block_hashes": [13], "medium": "CPU"},
            {"type": "BlockRemoved", "block_hashes": [12], "medium": "TAPE"},
        ]));
        assert_eq!(
            m.apply(decode_batch(&removed).expect("batch").events),
            vec![
                gpu(KvEventData::Removed {
                    block_hashes: vec![want[3].block_hash]
                }),
                (
                    Medium::Cpu,
                    KvEventData::Removed {
                        block_hashes: vec![want[2].block_hash]
                    }
                ),
            ]
        );
        assert_eq!(m.dump().len(), 4, "13 is still on the GPU");
        let cleared = batch(serde_json::json!([{"type": "AllBlocksCleared"}]));
        assert_eq!(
            m.apply(decode_batch(&cleared).expect("batch").events),
            vec![gpu(KvEventData::Cleared)]
        );
        assert_eq!(m.dump(), vec![gpu(KvEventData::Cleared)]);
    }

    #[test]
    fn a_batch_without_a_rank_and_an_unknown_parent_are_read() {
        let v = serde_json::json!([1.0, [
            {"type": "BlockStored", "block_hashes": [2], "parent_block_hash": 1,
             "token_ids": [1, 2], "block_size": 2, "lora_id": null, "medium": null, "lora_name": null}
        ]]);
        let b = decode_batch(&rmp_serde::to_vec(&v).expect("msgpack")).expect("batch");
        assert!(Mirror::default().apply(b.events).is_empty());
        assert!(decode_batch(b"\x01\x02").is_err());
    }
}
