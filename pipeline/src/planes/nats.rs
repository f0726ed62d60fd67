//! The event plane on NATS core (async-nats): KV events, load metrics and resync requests
//! between processes.
//!
//! Subjects are the embedded bus's subjects unchanged, so no operator knows which bus it is on.
//! Delivery is at most once, as on the embedded bus. While the server is unreachable async-nats
//! reconnects with backoff and re-subscribes on its own; publishing meanwhile drops the message
//! instead of queueing it, because an engine must never wait on the event plane and the KV
//! index detects the gap by event id and asks for a resync. [`EventBus::connected`] lets a
//! router fall back to approximate routing for as long as events are not flowing.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::{BoxStream, StreamExt};

use super::events::valid_subject;
use super::{Event, EventBus, PlaneError};

/// An event bus on a NATS server.
pub struct NatsEventBus {
    client: async_nats::Client,
}

fn err(message: String) -> PlaneError {
    PlaneError::Backend {
        plane: "event",
        message,
    }
}

impl NatsEventBus {
    /// Connect to `endpoints` (`host:port`, several for a cluster); fails when none answers
    /// within a few seconds, so a wrong address is reported at start-up.
    pub async fn connect(endpoints: &[String]) -> Result<Self, PlaneError> {
        let urls: Vec<String> = endpoints.iter().map(|e| format!("nats://{e}")).collect();
        let shown = urls.join(",");
        let opts = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(3))
            // Retry fast at first, then every 2 s: an event outage costs routing quality.
            .reconnect_delay_callback(|attempts| {
                Duration::from_millis((50u64 << attempts.min(6)).min(2000))
            })
            .max_reconnects(None)
            .event_callback(|ev| async move {
                match ev {
                    async_nats::Event::Connected => tracing::info!("Event plane connected"),
                    async_nats::Event::Disconnected => {
                        tracing::warn!("Event plane disconnected; reconnecting")
                    }
                    async_nats::Event::SlowConsumer(sid) => {
                        tracing::warn!(sid, "Event subscriber fell behind; messages dropped")
                    }
                    other => tracing::debug!(event = %other, "Event plane"),
                }
            });
        let client = tokio::time::timeout(Duration::from_secs(5), opts.connect(urls.clone()))
            .await
            .map_err(|_| err(format!("no NATS server answered at {shown} within 5 s")))?
            .map_err(|e| err(format!("cannot connect to NATS at {shown}: {e}")))?;
        Ok(Self { client })
    }
}

#[async_trait]
impl EventBus for NatsEventBus {
    async fn publish(&self, subject: &str, payload: Bytes) -> Result<(), PlaneError> {
        if !valid_subject(subject, false) {
            return Err(PlaneError::InvalidSubject(subject.to_owned()));
        }
        if !self.connected() {
            // Dropped, not queued: see the module docs.
            return Ok(());
        }
        self.client
            .publish(subject.to_owned(), payload)
            .await
            .map_err(|e| err(format!("publish on {subject}: {e}")))
    }

    async fn subscribe(&self, pattern: &str) -> Result<BoxStream<'static, Event>, PlaneError> {
        if !valid_subject(pattern, true) {
            return Err(PlaneError::InvalidSubject(pattern.to_owned()));
        }
        let sub = self
            .client
            .subscribe(pattern.to_owned())
            .await
            .map_err(|e| err(format!("subscribe to {pattern}: {e}")))?;
        Ok(sub
            .map(|m| Event {
                subject: m.subject.to_string(),
                payload: m.payload,
            })
            .boxed())
    }

    fn connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }
}
