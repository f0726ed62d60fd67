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

use super::auth::NatsCredentials;
use super::{Event, EventBus, PlaneError};
use dyn_core::planes::events::valid_subject;

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
        Self::connect_with(endpoints, &NatsCredentials::default()).await
    }

    /// [`connect`](Self::connect) with credentials or TLS.
    pub async fn connect_with(
        endpoints: &[String],
        creds: &NatsCredentials,
    ) -> Result<Self, PlaneError> {
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
        let opts = creds.apply(opts).await?;
        let client = tokio::time::timeout(Duration::from_secs(5), opts.connect(urls.clone()))
            .await
            .map_err(|_| err(format!("no NATS server answered at {shown} within 5 s")))?
            .map_err(|e| {
                use async_nats::ConnectErrorKind as K;
                match e.kind() {
                    K::AuthorizationViolation | K::Authentication => err(format!(
                        "cannot connect to NATS at {shown}: {e} ({})",
                        creds.explain()
                    )),
                    _ => err(format!("cannot connect to NATS at {shown}: {e}")),
                }
            })?;
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

impl NatsEventBus {
    /// Work queues on the same connection, in JetStream.
    pub fn work_queue(&self) -> NatsWorkQueue {
        NatsWorkQueue {
            js: async_nats::jetstream::new(self.client.clone()),
            client: self.client.clone(),
            ready: parking_lot::Mutex::new(std::collections::HashSet::new()),
        }
    }
}

/// [`WorkQueue`](super::WorkQueue) on NATS JetStream: one work-queue stream per queue
/// (`DYN_Q_{queue}`, subjects `dyn.queue.{queue}.{partition}`, in memory), one durable pull
/// consumer per partition filtered on its subject. A job is acknowledged as it is taken, which
/// removes it from the stream, so the stream's message count is the queue's depth. Only
/// features nats-server 2.9 has are used (no `filter_subjects`, no key-value buckets).
///
/// A server restart loses a stream in memory and its consumers: a push or a depth that finds
/// its stream gone makes it again, and a taker whose consumer fails makes both again and goes
/// on (before, one restart ended remote prefill for good). While the server is unreachable
/// push and depth fail at once rather than wait for it.
pub struct NatsWorkQueue {
    js: async_nats::jetstream::Context,
    client: async_nats::Client,
    /// Streams known to exist.
    ready: parking_lot::Mutex<std::collections::HashSet<String>>,
}

fn qerr(message: String) -> PlaneError {
    PlaneError::Backend {
        plane: "queue",
        message,
    }
}

/// Jobs older than this are dropped unread: whoever pushed them has given up long since.
const JOB_MAX_AGE: Duration = Duration::from_secs(120);

impl NatsWorkQueue {
    fn stream_name(queue: &str) -> String {
        format!("DYN_Q_{queue}")
    }

    fn subject(queue: &str, partition: &str) -> String {
        format!("dyn.queue.{queue}.{partition}")
    }

    /// Fails at once while the server is unreachable: a caller deciding whether to queue work
    /// must not wait for it.
    fn connected(&self) -> Result<(), PlaneError> {
        if self.client.connection_state() == async_nats::connection::State::Connected {
            Ok(())
        } else {
            Err(qerr("the NATS server is unreachable".into()))
        }
    }

    /// Forget that `queue`'s stream exists (a server restart lost it): the next use makes it.
    fn lost(&self, queue: &str) {
        self.ready.lock().remove(&Self::stream_name(queue));
    }

    async fn stream(
        &self,
        queue: &str,
    ) -> Result<async_nats::jetstream::stream::Stream<()>, PlaneError> {
        use async_nats::jetstream::stream;
        let config = stream::Config {
            name: Self::stream_name(queue),
            subjects: vec![format!("dyn.queue.{queue}.*")],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::Memory,
            max_age: JOB_MAX_AGE,
            max_messages: 100_000,
            ..Default::default()
        };
        ensure_stream(&self.js, &self.ready, config, qerr).await
    }
}

/// The stream `config` names, made the first time this process asks for it (`ready` holds
/// the names known to exist). One that exists keeps its settings, except that a stream an
/// earlier version made without a byte bound is given this one's.
async fn ensure_stream(
    js: &async_nats::jetstream::Context,
    ready: &parking_lot::Mutex<std::collections::HashSet<String>>,
    config: async_nats::jetstream::stream::Config,
    err: fn(String) -> PlaneError,
) -> Result<async_nats::jetstream::stream::Stream<()>, PlaneError> {
    let name = config.name.clone();
    if ready.lock().contains(&name) {
        return js
            .get_stream_no_info(&name)
            .await
            .map_err(|e| err(format!("stream {name}: {e}")));
    }
    let mut stream = js
        .get_or_create_stream(config.clone())
        .await
        .map_err(|e| err(format!("cannot create stream {name}: {e}")))?;
    // An existing stream keeps the settings it was made with (the processes of a graph may
    // be given different bounds; the first one's stand), unless it has no byte bound where
    // this version sets one: a stream an earlier version made, brought to the bound now.
    let unbounded = stream
        .info()
        .await
        .is_ok_and(|i| i.config.max_bytes <= 0 && config.max_bytes > 0);
    if unbounded && let Err(e) = js.update_stream(&config).await {
        tracing::warn!(stream = %name, error = %e, "A NATS stream keeps its own settings");
    }
    ready.lock().insert(name.clone());
    js.get_stream_no_info(&name)
        .await
        .map_err(|e| err(format!("stream {name}: {e}")))
}

#[async_trait]
impl super::WorkQueue for NatsWorkQueue {
    async fn push(&self, queue: &str, partition: &str, job: Bytes) -> Result<(), PlaneError> {
        dyn_core::planes::queue::check(queue, Some(partition))?;
        self.connected()?;
        let subject = Self::subject(queue, partition);
        // Twice at most: the second time after making a stream a restart lost (a publish
        // that no stream takes is answered "no responders"). One message id for both, so a
        // first try that was stored but whose acknowledgement was lost is not stored twice
        // (JetStream drops a duplicate id within its window).
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            "Nats-Msg-Id",
            uuid::Uuid::new_v4().simple().to_string().as_str(),
        );
        let mut tries = 0;
        loop {
            tries += 1;
            self.stream(queue).await?;
            // Wait for the server's acknowledgement: a job is only pushed once it is stored.
            let published = self
                .js
                .publish_with_headers(subject.clone(), headers.clone(), job.clone())
                .await;
            let stored = match published {
                Ok(ack) => ack.await.map(drop).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match stored {
                Ok(()) => return Ok(()),
                Err(e) if tries == 2 => return Err(qerr(format!("push to {subject}: {e}"))),
                Err(e) => {
                    tracing::info!(error = %e, queue, "Work queue push failed; making its stream again");
                    self.lost(queue);
                }
            }
        }
    }

    async fn depth(&self, queue: &str) -> Result<u64, PlaneError> {
        dyn_core::planes::queue::check(queue, None)?;
        self.connected()?;
        let info = match self.stream(queue).await?.get_info().await {
            Ok(info) => info,
            Err(e) => {
                // Gone with a restart: made again (empty) on the next use.
                self.lost(queue);
                return Err(qerr(format!("depth of {queue}: {e}")));
            }
        };
        Ok(info.state.messages)
    }

    async fn take(
        &self,
        queue: &str,
        partition: &str,
    ) -> Result<BoxStream<'static, Bytes>, PlaneError> {
        dyn_core::planes::queue::check(queue, Some(partition))?;
        // The first consumer is made here, so that a bad start is an error to the caller;
        // later ones (after a restart lost it) inside the stream.
        let first = self.consumer(queue, partition).await?;
        let this = NatsWorkQueue {
            js: self.js.clone(),
            client: self.client.clone(),
            ready: parking_lot::Mutex::new(self.ready.lock().clone()),
        };
        let (queue, partition) = (queue.to_owned(), partition.to_owned());
        Ok(async_stream::stream! {
            let mut messages = Some(first);
            let mut backoff = Duration::from_millis(100);
            loop {
                let Some(current) = messages.as_mut() else {
                    // The stream or its consumer is gone (a server restart): made again once
                    // the server answers, backing off meanwhile.
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    this.lost(&queue);
                    match this.consumer(&queue, &partition).await {
                        Ok(m) => {
                            tracing::info!(queue, partition, "Work queue consumer made again");
                            messages = Some(m);
                        }
                        Err(e) => tracing::debug!(error = %e, "Work queue consumer not made yet"),
                    }
                    continue;
                };
                match current.next().await {
                    Some(Ok(m)) => {
                        backoff = Duration::from_millis(100);
                        // Taken: acknowledged now, so the job leaves the stream and the depth.
                        if let Err(e) = m.ack().await {
                            tracing::warn!(error = %e, "Cannot acknowledge a queued job; it may be delivered again");
                        }
                        yield m.payload.clone();
                    }
                    Some(Err(e)) => {
                        use async_nats::jetstream::consumer::pull::MessagesErrorKind as K;
                        // Missed heartbeats while disconnected are the reconnect's to mend; a
                        // consumer or stream that is gone is this loop's.
                        if matches!(e.kind(), K::MissingHeartbeat) && !matches!(this.connected(), Ok(())) {
                            tracing::debug!(error = %e, "Work queue consumer waiting for the server");
                        } else {
                            tracing::warn!(error = %e, queue, partition, "Work queue consumer failed; making it again");
                            messages = None;
                        }
                    }
                    None => messages = None,
                }
            }
        }
        .boxed())
    }
}

impl NatsWorkQueue {
    /// The durable pull consumer of one partition, its stream made first where needed.
    async fn consumer(
        &self,
        queue: &str,
        partition: &str,
    ) -> Result<async_nats::jetstream::consumer::pull::Stream, PlaneError> {
        use async_nats::jetstream::consumer::{AckPolicy, pull};
        let s = self.stream(queue).await?;
        let durable = format!("take_{partition}");
        let consumer = s
            .get_or_create_consumer(
                &durable,
                pull::Config {
                    durable_name: Some(durable.clone()),
                    filter_subject: Self::subject(queue, partition),
                    ack_policy: AckPolicy::Explicit,
                    // A partition whose worker is gone is cleaned up by the server.
                    inactive_threshold: Duration::from_secs(300),
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| qerr(format!("cannot consume {queue}/{partition}: {e}")))?;
        // Heartbeats every second (async-nats's default is 15 s): a consumer a server restart
        // lost is noticed, and made again, within seconds rather than after remote prefills
        // have timed out.
        consumer
            .stream()
            .expires(Duration::from_secs(5))
            .heartbeat(Duration::from_secs(1))
            .messages()
            .await
            .map_err(|e| qerr(format!("cannot consume {queue}/{partition}: {e}")))
    }
}

impl NatsEventBus {
    /// Key-value buckets on the same connection, in JetStream.
    pub fn store(&self) -> NatsStore {
        NatsStore {
            js: async_nats::jetstream::new(self.client.clone()),
            ready: parking_lot::Mutex::new(std::collections::HashSet::new()),
        }
    }
}

/// [`KeyValue`](super::KeyValue) on NATS JetStream, built as NATS's own key-value buckets are
/// (which nats-server 2.9 cannot create through async-nats): one stream per bucket
/// (`DYN_KV_{bucket}`, subjects `dyn.kv.{bucket}.{key}`, on the server's disk), keeping one
/// message per subject, at most `max_entries` messages and `max_bytes` (the oldest discarded)
/// for at most `max_age`. A stream has no per-owner bounds: `put_for` stores as `put` does,
/// and a full bucket discards its oldest whoever they belong to. A get reads the subject's
/// last message; a delete purges the subject.
pub struct NatsStore {
    js: async_nats::jetstream::Context,
    /// Streams known to exist.
    ready: parking_lot::Mutex<std::collections::HashSet<String>>,
}

fn serr(message: String) -> PlaneError {
    PlaneError::Backend {
        plane: "store",
        message,
    }
}

impl NatsStore {
    fn subject(bucket: &super::Bucket, key: &str) -> String {
        format!("dyn.kv.{}.{key}", bucket.name)
    }

    async fn stream(
        &self,
        bucket: &super::Bucket,
    ) -> Result<async_nats::jetstream::stream::Stream<()>, PlaneError> {
        use async_nats::jetstream::stream;
        let config = stream::Config {
            name: format!("DYN_KV_{}", bucket.name),
            subjects: vec![format!("dyn.kv.{}.*", bucket.name)],
            storage: stream::StorageType::File,
            max_messages_per_subject: 1,
            max_messages: i64::try_from(bucket.max_entries).unwrap_or(i64::MAX),
            // -1: no bound of the server's own beyond the entries (a bucket without one).
            max_bytes: i64::try_from(bucket.max_bytes).unwrap_or(-1),
            max_age: bucket.max_age,
            discard: stream::DiscardPolicy::Old,
            ..Default::default()
        };
        ensure_stream(&self.js, &self.ready, config, serr).await
    }
}

#[async_trait]
impl super::KeyValue for NatsStore {
    async fn put(&self, bucket: &super::Bucket, key: &str, value: Bytes) -> Result<(), PlaneError> {
        dyn_core::planes::store::check(bucket, key)?;
        dyn_core::planes::store::check_size(bucket, key, &value)?;
        self.stream(bucket).await?;
        let subject = Self::subject(bucket, key);
        // Stored once the server acknowledges it: a reader elsewhere then finds it.
        self.js
            .publish(subject.clone(), value)
            .await
            .map_err(|e| serr(format!("put {subject}: {e}")))?
            .await
            .map_err(|e| serr(format!("put {subject}: {e}")))?;
        Ok(())
    }

    async fn get(&self, bucket: &super::Bucket, key: &str) -> Result<Option<Bytes>, PlaneError> {
        use async_nats::jetstream::stream::LastRawMessageErrorKind;
        dyn_core::planes::store::check(bucket, key)?;
        let subject = Self::subject(bucket, key);
        match self
            .stream(bucket)
            .await?
            .get_last_raw_message_by_subject(&subject)
            .await
        {
            Ok(m) => Ok(Some(m.payload)),
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
            Err(e) => Err(serr(format!("get {subject}: {e}"))),
        }
    }

    async fn delete(&self, bucket: &super::Bucket, key: &str) -> Result<bool, PlaneError> {
        dyn_core::planes::store::check(bucket, key)?;
        let subject = Self::subject(bucket, key);
        let purged = self
            .stream(bucket)
            .await?
            .purge()
            .filter(subject.clone())
            .await
            .map_err(|e| serr(format!("delete {subject}: {e}")))?;
        Ok(purged.purged > 0)
    }
}
