//! Where a worker's KV events leave. Two threads produce them — the engine's (its pool, G1)
//! and its offload thread (host memory and disk, G2/G3) — and routers need one stream with
//! consecutive event ids, so ids are taken and events queued under one lock.

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::mpsc;

use dyn_protocol::kv::{KvCacheEvent, KvEventData, Medium, RouterEvent};

/// A worker's KV event stream onto the event plane's bounded queue.
pub struct KvPublisher {
    worker_id: u64,
    subject: String,
    /// The next event id; the queue is written under the same lock so ids leave in order.
    next: Mutex<u64>,
    tx: mpsc::Sender<(String, Bytes)>,
}

impl KvPublisher {
    pub fn new(worker_id: u64, subject: String, tx: mpsc::Sender<(String, Bytes)>) -> Self {
        Self {
            worker_id,
            subject,
            next: Mutex::new(0),
            tx,
        }
    }

    /// Publish events about blocks in `medium`. A full queue drops them: routers see the gap
    /// in ids and ask for a dump.
    pub fn publish(&self, medium: Medium, events: Vec<KvEventData>) {
        self.publish_mixed(events.into_iter().map(|e| (medium, e)).collect());
    }

    /// Publish events each about its own tier (a dump).
    pub fn publish_mixed(&self, events: Vec<(Medium, KvEventData)>) {
        if events.is_empty() {
            return;
        }
        let mut next = self.next.lock();
        for (medium, data) in events {
            let ev = RouterEvent {
                worker_id: self.worker_id,
                event: KvCacheEvent {
                    event_id: *next,
                    dp_rank: 0,
                    medium,
                    data,
                },
            };
            *next += 1;
            match serde_json::to_vec(&ev) {
                Ok(bytes) => {
                    if self
                        .tx
                        .try_send((self.subject.clone(), Bytes::from(bytes)))
                        .is_err()
                    {
                        tracing::warn!("Engine event queue is full; dropping a KV event");
                    }
                }
                Err(e) => tracing::error!(error = %e, "Cannot encode a KV event"),
            }
        }
    }
}
