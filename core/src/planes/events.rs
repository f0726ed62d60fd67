//! The event plane: subject-addressed, fire-and-forget messages (KV events, load metrics).
//!
//! Subjects use NATS syntax (`kv.events.worker-1`, with `*` matching one token and `>` the
//! rest), so moving a graph from the embedded bus to NATS changes no operator. Like NATS core,
//! delivery is at most once: a subscriber that falls behind loses messages and is told so in
//! the log; consumers that need completeness (the KV indexer) detect gaps by event id.

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::{BoxStream, StreamExt};
use tokio::sync::broadcast;
use tokio_stream::wrappers::BroadcastStream;

use super::PlaneError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub subject: String,
    pub payload: Bytes,
}

#[async_trait]
pub trait EventBus: Send + Sync + 'static {
    async fn publish(&self, subject: &str, payload: Bytes) -> Result<(), PlaneError>;
    async fn subscribe(&self, pattern: &str) -> Result<BoxStream<'static, Event>, PlaneError>;

    /// False while events cannot flow (the server is unreachable); consumers that depend on
    /// them, like a KV router, degrade until it is true again.
    fn connected(&self) -> bool {
        true
    }
}

/// True when `subject` matches the NATS-style `pattern`.
pub fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut p = pattern.split('.');
    let mut s = subject.split('.');
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// A NATS subject: dot-separated non-empty tokens without spaces; `*` and `>` only in patterns.
pub fn valid_subject(subject: &str, allow_wildcards: bool) -> bool {
    !subject.is_empty()
        && subject.split('.').all(|t| {
            !t.is_empty()
                && !t.contains(char::is_whitespace)
                && (allow_wildcards || (t != "*" && t != ">"))
        })
}

/// In-process event bus: one broadcast channel, filtered per subscriber.
pub struct EmbeddedEventBus {
    tx: broadcast::Sender<Event>,
}

impl Default for EmbeddedEventBus {
    fn default() -> Self {
        Self::with_capacity(8192)
    }
}

impl EmbeddedEventBus {
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            tx: broadcast::channel(capacity).0,
        }
    }
}

#[async_trait]
impl EventBus for EmbeddedEventBus {
    async fn publish(&self, subject: &str, payload: Bytes) -> Result<(), PlaneError> {
        if !valid_subject(subject, false) {
            return Err(PlaneError::InvalidSubject(subject.to_owned()));
        }
        // No subscriber is not an error: events are best effort, as on NATS core.
        let _ = self.tx.send(Event {
            subject: subject.to_owned(),
            payload,
        });
        Ok(())
    }

    async fn subscribe(&self, pattern: &str) -> Result<BoxStream<'static, Event>, PlaneError> {
        if !valid_subject(pattern, true) {
            return Err(PlaneError::InvalidSubject(pattern.to_owned()));
        }
        let pattern = pattern.to_owned();
        let stream = BroadcastStream::new(self.tx.subscribe()).filter_map(move |ev| {
            let out = match ev {
                Ok(ev) if subject_matches(&pattern, &ev.subject) => Some(ev),
                Ok(_) => None,
                Err(e) => {
                    tracing::warn!(pattern = %pattern, error = %e, "event subscriber fell behind");
                    None
                }
            };
            futures::future::ready(out)
        });
        Ok(stream.boxed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nats_wildcards() {
        assert!(subject_matches("kv.events.*", "kv.events.w1"));
        assert!(!subject_matches("kv.events.*", "kv.events.w1.x"));
        assert!(subject_matches("kv.>", "kv.events.w1.x"));
        assert!(!subject_matches("kv.>", "kv"));
        assert!(subject_matches("a.b", "a.b"));
        assert!(!subject_matches("a.b", "a.c"));
    }

    #[tokio::test]
    async fn subscribers_get_matching_events_in_order() {
        let bus = EmbeddedEventBus::default();
        let mut sub = bus.subscribe("load.*").await.unwrap();
        bus.publish("kv.w1", Bytes::from_static(b"x"))
            .await
            .unwrap();
        bus.publish("load.w1", Bytes::from_static(b"1"))
            .await
            .unwrap();
        bus.publish("load.w2", Bytes::from_static(b"2"))
            .await
            .unwrap();
        assert_eq!(sub.next().await.unwrap().payload, Bytes::from_static(b"1"));
        assert_eq!(sub.next().await.unwrap().subject, "load.w2");
        assert!(bus.publish("bad subject", Bytes::new()).await.is_err());
        assert!(bus.publish("kv.*", Bytes::new()).await.is_err());
    }
}
