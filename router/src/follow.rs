//! Feeding the router: the workers' load metrics, and (`kv`) their KV events applied to the
//! index. A gap in a worker's event ids drops its blocks and asks it for a full dump (again
//! each second until it comes); departed workers leave the index on a one-second tick; while
//! the event plane is down the router falls back to its own decisions and, once it is back,
//! resyncs every worker.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dyn_core::planes::EventBus;
use futures::StreamExt;

use super::Inner;
use super::indexer::Applied;
use dyn_protocol::kv::{
    KvEventData, LoadMetrics, ResyncRequest, RouterEvent, kv_events_subject, kv_resync_subject,
    load_metrics_subject,
};

/// Keep the workers' load metrics and (`kv`) apply their KV events to the index; once a
/// second drop departed workers, expire approximate records, and ask again for dumps still
/// missing.
pub(super) async fn follow_workers(
    inner: Arc<Inner>,
    events: Arc<dyn EventBus>,
    namespace: String,
    kv_events: bool,
) -> Result<impl std::future::Future<Output = ()>, dyn_core::planes::PlaneError> {
    let node = inner.workers.target.clone();
    let mut kv_sub = if kv_events {
        Some(
            events
                .subscribe(&kv_events_subject(&namespace, &node))
                .await?,
        )
    } else {
        None
    };
    let mut load_sub = events
        .subscribe(&load_metrics_subject(&namespace, &node))
        .await?;
    let resync_subject = kv_resync_subject(&namespace, &node);
    Ok(async move {
        let kv = inner.placement.kv.as_deref();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let mut awaiting: HashMap<u64, Instant> = HashMap::new();
        let mut events_up = true;
        let ask = |worker_id: u64| {
            let events = events.clone();
            let subject = resync_subject.clone();
            async move {
                let Ok(payload) = serde_json::to_vec(&ResyncRequest { worker_id }) else {
                    return;
                };
                if let Err(e) = events.publish(&subject, payload.into()).await {
                    tracing::warn!(error = %e, "Cannot ask for a KV dump");
                }
            }
        };
        loop {
            tokio::select! {
                Some(ev) = async { match kv_sub.as_mut() { Some(s) => s.next().await, None => std::future::pending().await } } => {
                    let Ok(ev) = serde_json::from_slice::<RouterEvent>(&ev.payload) else {
                        tracing::warn!("Ignoring a malformed KV event");
                        continue;
                    };
                    let Some(kv) = kv else { continue };
                    let applied = kv.index.write().apply(ev.worker_id, &ev.event);
                    match applied {
                        Applied::Gap { expected, got } => {
                            tracing::warn!(worker_id = format_args!("{:x}", ev.worker_id), expected, got, "KV events lost; asking the worker for a dump");
                            awaiting.insert(ev.worker_id, Instant::now());
                            ask(ev.worker_id).await;
                        }
                        Applied::Ok if ev.event.data == KvEventData::Cleared => {
                            awaiting.remove(&ev.worker_id);
                        }
                        Applied::Full => tracing::warn!(worker_id = format_args!("{:x}", ev.worker_id), "Too many workers for the KV index; ignoring this one"),
                        _ => {}
                    }
                }
                Some(ev) = load_sub.next() => {
                    let Ok(m) = serde_json::from_slice::<LoadMetrics>(&ev.payload) else {
                        tracing::warn!("Ignoring malformed load metrics");
                        continue;
                    };
                    if let Some(kv) = kv && m.block_size > 0 && inner.config.block_size.is_none() {
                        kv.set_block_size(m.block_size);
                    }
                    inner.loads.report(m);
                }
                _ = tick.tick() => {
                    let live = inner.workers.live();
                    inner.loads.retain(&live);
                    // Series of workers that left discovery (not those only marked down).
                    let registered = inner.workers.registered();
                    inner.placement.quality.retain(&registered);
                    let Some(kv) = kv else { continue };
                    let gone: Vec<u64> = kv.index.read().worker_ids().filter(|w| !live.contains(w)).collect();
                    if !gone.is_empty() {
                        let mut index = kv.index.write();
                        for w in &gone {
                            index.remove_worker(*w);
                            awaiting.remove(w);
                        }
                    }
                    let up = events.connected();
                    if kv_events && up != events_up {
                        if up {
                            // Events were lost meanwhile: rebuild every worker's blocks from a
                            // dump, which replaces the decisions recorded during the outage.
                            tracing::info!("Event plane is back; resyncing the KV index from every worker");
                            kv.forget_own_decisions();
                            let stale = Instant::now().checked_sub(Duration::from_secs(1)).unwrap_or_else(Instant::now);
                            for w in &live {
                                awaiting.insert(*w, stale);
                            }
                        } else {
                            tracing::warn!("Event plane is down; routing on this router's own decisions until it is back");
                        }
                        events_up = up;
                    }
                    if !kv_events || !up {
                        kv.expire(Duration::from_secs_f64(inner.config.approx_ttl_s));
                    }
                    for (w, since) in awaiting.iter_mut() {
                        if since.elapsed() >= Duration::from_secs(1) {
                            *since = Instant::now();
                            ask(*w).await;
                        }
                    }
                }
            }
        }
    })
}
