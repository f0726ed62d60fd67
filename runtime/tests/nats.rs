//! The NATS event plane against real nats-server processes: subjects and wildcards across two
//! connections, and subscriptions that come back after the server restarts.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use std::time::Duration;

use bytes::Bytes;
use dyn_runtime::planes::{EventBus, NatsEventBus};
use dyn_tests::servers::{Server, test_server};
use futures::StreamExt;

/// How long an event or a reconnection may take. These bounds only end a test that would
/// otherwise hang: nats-server beside a test build on a loaded 2-core machine is slow.
const WITHIN: Duration = Duration::from_secs(30);

fn endpoint(url: &str) -> Vec<String> {
    vec![url.trim_start_matches("nats://").to_owned()]
}

#[tokio::test]
async fn events_cross_connections_by_subject() {
    let Some(url) = test_server("DYN_TEST_NATS") else {
        return;
    };
    let ns = uuid::Uuid::new_v4().simple().to_string();
    let a = NatsEventBus::connect(&endpoint(&url)).await.unwrap();
    let b = NatsEventBus::connect(&endpoint(&url)).await.unwrap();
    assert!(a.connected() && b.connected());
    let mut sub = b.subscribe(&format!("dyn.{ns}.*.kv_events")).await.unwrap();
    // NATS core is at most once, and `b`'s subscription reaches the server in its own time
    // (on a loaded machine, later than any fixed pause): publish until it hears.
    let ev = tokio::time::timeout(WITHIN, async {
        loop {
            a.publish(&format!("dyn.{ns}.decode.load"), Bytes::from_static(b"x"))
                .await
                .unwrap();
            a.publish(
                &format!("dyn.{ns}.decode.kv_events"),
                Bytes::from_static(b"1"),
            )
            .await
            .unwrap();
            if let Ok(ev) = tokio::time::timeout(Duration::from_millis(200), sub.next()).await {
                return ev.expect("the subscription is open");
            }
        }
    })
    .await
    .expect("an event from the other connection");
    assert_eq!(ev.subject, format!("dyn.{ns}.decode.kv_events"));
    assert_eq!(ev.payload, Bytes::from_static(b"1"));
    assert!(a.publish("bad subject", Bytes::new()).await.is_err());
    assert!(a.subscribe("a..b").await.is_err());
}

#[tokio::test]
async fn an_unreachable_server_is_a_clear_error() {
    let port = dyn_tests::servers::free_port();
    let err = NatsEventBus::connect(&[format!("127.0.0.1:{port}")])
        .await
        .err()
        .expect("nothing listens there");
    assert!(err.to_string().contains("NATS"), "{err}");
}

#[tokio::test]
async fn subscriptions_come_back_after_a_server_restart() {
    if test_server("DYN_TEST_NATS").is_none() {
        return;
    }
    let Some(mut server) = Server::nats() else {
        dyn_tests::skip("no nats-server binary on PATH");
        return;
    };
    let a = NatsEventBus::connect(&endpoint(&server.url()))
        .await
        .unwrap();
    let b = NatsEventBus::connect(&endpoint(&server.url()))
        .await
        .unwrap();
    let mut sub = b.subscribe("load.>").await.unwrap();
    server.kill();
    let deadline = tokio::time::Instant::now() + WITHIN;
    while a.connected() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!a.connected(), "the outage is noticed");
    // Publishing during the outage drops the message instead of blocking the publisher.
    tokio::time::timeout(WITHIN, a.publish("load.w1", Bytes::from_static(b"lost")))
        .await
        .expect("publish does not block")
        .unwrap();
    assert!(server.start(), "nats-server starts again");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !(a.connected() && b.connected()) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(a.connected() && b.connected(), "both reconnect");
    // The old subscription receives again (async-nats re-subscribes on reconnect).
    let got = async {
        loop {
            a.publish("load.w1", Bytes::from_static(b"back"))
                .await
                .unwrap();
            if let Ok(Some(ev)) = tokio::time::timeout(Duration::from_millis(200), sub.next()).await
            {
                return ev;
            }
        }
    };
    let ev = tokio::time::timeout(WITHIN, got)
        .await
        .expect("events flow again");
    assert_eq!(ev.payload, Bytes::from_static(b"back"));
}

/// The JetStream work queue: jobs wait in their partition (also for a taker that starts
/// late), each is taken once, and the depth counts what is not taken yet, across connections.
#[tokio::test]
async fn jetstream_work_queue_hands_each_job_to_its_partition_once() {
    use dyn_runtime::planes::WorkQueue;
    let Some(url) = test_server("DYN_TEST_NATS") else {
        return;
    };
    let queue = format!("q{}", uuid::Uuid::new_v4().simple());
    let sender = NatsEventBus::connect(&endpoint(&url))
        .await
        .unwrap()
        .work_queue();
    let worker = NatsEventBus::connect(&endpoint(&url))
        .await
        .unwrap()
        .work_queue();
    for (p, job) in [("a", "1"), ("b", "2"), ("a", "3")] {
        sender
            .push(&queue, p, Bytes::from(job.to_owned()))
            .await
            .unwrap();
    }
    assert_eq!(sender.depth(&queue).await.unwrap(), 3);
    let mut a = worker.take(&queue, "a").await.unwrap();
    assert_eq!(next(&mut a).await, Bytes::from_static(b"1"));
    assert_eq!(next(&mut a).await, Bytes::from_static(b"3"));
    // Acknowledged on take: only b's job is left.
    let mut depth = 0;
    let deadline = tokio::time::Instant::now() + WITHIN;
    while tokio::time::Instant::now() < deadline {
        depth = sender.depth(&queue).await.unwrap();
        if depth == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(depth, 1);
    sender
        .push(&queue, "a", Bytes::from_static(b"4"))
        .await
        .unwrap();
    assert_eq!(next(&mut a).await, Bytes::from_static(b"4"));
    let mut b = worker.take(&queue, "b").await.unwrap();
    assert_eq!(next(&mut b).await, Bytes::from_static(b"2"));
    assert!(sender.push("bad.name", "a", Bytes::new()).await.is_err());
}

/// A server restart loses the work queue's stream (memory storage) and its consumers: pushes,
/// depths and the taker make them again and go on; while the server is down, push and depth
/// fail rather than wait for it. (Before, one restart ended remote prefill for good: the
/// stream was never made again and the taker's consumer errors were only logged.)
#[tokio::test]
async fn jetstream_work_queue_comes_back_after_a_server_restart() {
    use dyn_runtime::planes::WorkQueue;
    if test_server("DYN_TEST_NATS").is_none() {
        return;
    }
    let Some(mut server) = Server::nats() else {
        dyn_tests::skip("no nats-server binary on PATH");
        return;
    };
    let queue = "prefill";
    let sender_bus = NatsEventBus::connect(&endpoint(&server.url()))
        .await
        .unwrap();
    let sender = sender_bus.work_queue();
    let worker = NatsEventBus::connect(&endpoint(&server.url()))
        .await
        .unwrap()
        .work_queue();
    let mut taken = worker.take(queue, "w1").await.unwrap();
    sender
        .push(queue, "w1", Bytes::from_static(b"before"))
        .await
        .unwrap();
    assert_eq!(next(&mut taken).await, Bytes::from_static(b"before"));

    server.kill();
    let deadline = tokio::time::Instant::now() + WITHIN;
    while sender_bus.connected() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!sender_bus.connected(), "the outage is noticed");
    // Down: refused, not waited out.
    assert!(sender.depth(queue).await.is_err());
    assert!(
        sender
            .push(queue, "w1", Bytes::from_static(b"x"))
            .await
            .is_err()
    );

    assert!(server.start(), "nats-server starts again");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !sender_bus.connected() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(sender_bus.connected(), "reconnects");
    // The stream is made again by the push; the taker's consumer by the taker.
    sender
        .push(queue, "w1", Bytes::from_static(b"after"))
        .await
        .unwrap();
    assert_eq!(next(&mut taken).await, Bytes::from_static(b"after"));
    let deadline = tokio::time::Instant::now() + WITHIN;
    let mut depth = sender.depth(queue).await;
    while depth.as_ref().map_or(true, |d| *d != 0) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        depth = sender.depth(queue).await;
    }
    assert_eq!(depth.unwrap(), 0);
}

#[tokio::test]
async fn jetstream_store_keeps_the_last_value_per_key_within_its_bounds() {
    use dyn_runtime::planes::{Bucket, KeyValue};
    let Some(url) = test_server("DYN_TEST_NATS") else {
        return;
    };
    let bucket = Bucket::new(
        format!("b{}", uuid::Uuid::new_v4().simple()),
        2,
        Duration::from_secs(60),
    );
    // Written through one connection, read through another (another frontend).
    let a = NatsEventBus::connect(&endpoint(&url))
        .await
        .unwrap()
        .store();
    let b = NatsEventBus::connect(&endpoint(&url))
        .await
        .unwrap()
        .store();
    a.put(&bucket, "k1", Bytes::from_static(b"one"))
        .await
        .unwrap();
    a.put(&bucket, "k1", Bytes::from_static(b"two"))
        .await
        .unwrap();
    assert_eq!(
        b.get(&bucket, "k1").await.unwrap().as_deref(),
        Some(&b"two"[..])
    );
    assert_eq!(b.get(&bucket, "nothing").await.unwrap(), None);
    // Past max_entries the oldest goes.
    a.put(&bucket, "k2", Bytes::from_static(b"2"))
        .await
        .unwrap();
    a.put(&bucket, "k3", Bytes::from_static(b"3"))
        .await
        .unwrap();
    assert_eq!(b.get(&bucket, "k1").await.unwrap(), None);
    assert_eq!(
        b.get(&bucket, "k3").await.unwrap().as_deref(),
        Some(&b"3"[..])
    );
    assert!(b.delete(&bucket, "k3").await.unwrap());
    assert!(!b.delete(&bucket, "k3").await.unwrap());
    assert_eq!(a.get(&bucket, "k3").await.unwrap(), None);
    assert!(a.put(&bucket, "bad.key", Bytes::new()).await.is_err());
}

#[tokio::test]
async fn jetstream_store_keeps_its_byte_bound() {
    use dyn_runtime::planes::{Bucket, KeyValue};
    let Some(url) = test_server("DYN_TEST_NATS") else {
        return;
    };
    let bucket = Bucket {
        max_bytes: 4096,
        ..Bucket::new(
            format!("b{}", uuid::Uuid::new_v4().simple()),
            100,
            Duration::from_secs(60),
        )
    };
    let s = NatsEventBus::connect(&endpoint(&url))
        .await
        .unwrap()
        .store();
    let value = Bytes::from(vec![b'x'; 1000]);
    for i in 0..10 {
        s.put(&bucket, &format!("k{i}"), value.clone())
            .await
            .unwrap();
    }
    // The server discards the oldest past the bound (its own count of a message is a little
    // more than its value); the newest stays.
    assert_eq!(s.get(&bucket, "k0").await.unwrap(), None);
    assert_eq!(s.get(&bucket, "k9").await.unwrap(), Some(value));
    // A value larger than the bucket is refused, not stored past it.
    assert!(
        s.put(&bucket, "huge", Bytes::from(vec![b'x'; 5000]))
            .await
            .is_err()
    );
}

#[tokio::test]
async fn a_store_stream_an_earlier_version_made_takes_this_ones_bounds() {
    use async_nats::jetstream::stream;
    use dyn_runtime::planes::{Bucket, KeyValue};
    let Some(url) = test_server("DYN_TEST_NATS") else {
        return;
    };
    let name = format!("b{}", uuid::Uuid::new_v4().simple());
    // As a version without byte bounds made it: the same stream, unbounded.
    let js = async_nats::jetstream::new(async_nats::connect(&url).await.unwrap());
    js.create_stream(stream::Config {
        name: format!("DYN_KV_{name}"),
        subjects: vec![format!("dyn.kv.{name}.*")],
        storage: stream::StorageType::File,
        max_messages_per_subject: 1,
        ..Default::default()
    })
    .await
    .unwrap();
    let bucket = Bucket {
        max_bytes: 4096,
        ..Bucket::new(name.clone(), 100, Duration::from_secs(60))
    };
    let s = NatsEventBus::connect(&endpoint(&url))
        .await
        .unwrap()
        .store();
    s.put(&bucket, "k", Bytes::from_static(b"v")).await.unwrap();
    let mut made = js.get_stream(format!("DYN_KV_{name}")).await.unwrap();
    let config = made.info().await.unwrap().config.clone();
    assert_eq!((config.max_bytes, config.max_messages), (4096, 100));
    js.delete_stream(format!("DYN_KV_{name}")).await.unwrap();
}

async fn next(s: &mut futures::stream::BoxStream<'static, Bytes>) -> Bytes {
    tokio::time::timeout(WITHIN, s.next())
        .await
        .expect("a job in time")
        .expect("the queue is open")
}

/// A NATS server with a user: the credentials get through, their absence is a clear error.
#[tokio::test]
async fn a_nats_server_with_a_user_takes_credentials_and_says_what_is_missing() {
    if test_server("DYN_TEST_NATS").is_none() {
        return;
    }
    let Some(server) = Server::nats_with_user("dyn", "nats-pw") else {
        dyn_tests::skip("nats-server is not on PATH");
        return;
    };
    let at = endpoint(&server.url());
    let e = NatsEventBus::connect(&at).await.err().unwrap();
    assert!(e.to_string().contains("set NATS_AUTH_USERNAME"), "{e}");
    let creds = |pw: &'static str| {
        dyn_runtime::planes::NatsCredentials::from_vars(move |k| match k {
            "NATS_AUTH_USERNAME" => Some("dyn".into()),
            "NATS_AUTH_PASSWORD" => Some(pw.into()),
            _ => None,
        })
        .unwrap()
    };
    let e = NatsEventBus::connect_with(&at, &creds("nope"))
        .await
        .err()
        .unwrap();
    assert!(e.to_string().contains("refused"), "{e}");
    let a = NatsEventBus::connect_with(&at, &creds("nats-pw"))
        .await
        .unwrap();
    let mut sub = a.subscribe("t.auth").await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    a.publish("t.auth", Bytes::from_static(b"x")).await.unwrap();
    let got = tokio::time::timeout(WITHIN, futures::StreamExt::next(&mut sub))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&got.payload[..], b"x");
}

/// NATS over TLS with client certificates: `NATS_TLS_CA_CERT_PATH` and the client certificate
/// get through, the CA alone or no TLS do not.
#[tokio::test]
async fn a_nats_server_over_tls_takes_the_ca_and_a_client_certificate() {
    if test_server("DYN_TEST_NATS").is_none() {
        return;
    }
    let dir = dyn_tests::scratch_dir("nats-pki");
    let pki = dyn_tests::servers::pki(&dir).expect("test certificates");
    let Some(server) = Server::nats_tls(&pki) else {
        dyn_tests::skip("nats-server is not on PATH");
        return;
    };
    let at = endpoint(&server.url());
    let path = |p: &std::path::Path| std::ffi::OsString::from(p.as_os_str());
    let full = dyn_runtime::planes::NatsCredentials::from_vars(|k| match k {
        "NATS_TLS_CA_CERT_PATH" => Some(path(&pki.ca)),
        "NATS_TLS_CLIENT_CERT_PATH" => Some(path(&pki.client_cert)),
        "NATS_TLS_CLIENT_KEY_PATH" => Some(path(&pki.client_key)),
        _ => None,
    })
    .unwrap();
    let a = NatsEventBus::connect_with(&at, &full).await.unwrap();
    let mut sub = a.subscribe("t.tls").await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    a.publish("t.tls", Bytes::from_static(b"y")).await.unwrap();
    let got = tokio::time::timeout(WITHIN, futures::StreamExt::next(&mut sub))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&got.payload[..], b"y");
    let ca_only = dyn_runtime::planes::NatsCredentials::from_vars(|k| {
        (k == "NATS_TLS_CA_CERT_PATH").then(|| path(&pki.ca))
    })
    .unwrap();
    assert!(NatsEventBus::connect_with(&at, &ca_only).await.is_err());
    assert!(NatsEventBus::connect(&at).await.is_err());
}
