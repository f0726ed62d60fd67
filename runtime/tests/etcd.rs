//! The etcd control plane against a real etcd server: registration, watches, lease expiry
//! and re-registration after a lost lease.
//!
//! The test command (`scripts/test`) starts etcd on loopback and sets `DYN_TEST_ETCD`;
//! without it these tests say so and skip.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use std::time::Duration;

use dyn_runtime::planes::{Discovery, DiscoveryEvent, EtcdDiscovery, Instance, Transport};
use futures::StreamExt;
use futures::stream::BoxStream;

fn etcd() -> Option<String> {
    dyn_tests::servers::test_server("DYN_TEST_ETCD")
}

/// An instance in a namespace of its own, so tests sharing one etcd do not see each other.
fn instance(ns: &str, id: u64) -> Instance {
    Instance {
        namespace: ns.into(),
        component: "decode".into(),
        endpoint: "generate".into(),
        instance_id: id.into(),
        transport: Transport::Tcp {
            address: format!("127.0.0.1:{}", 9000 + id),
        },
        metadata: Default::default(),
    }
}

/// Register `i`, trying up to `tries` times 200 ms apart (etcd may be coming back); the last
/// error if it never went through.
async fn register_within(d: &EtcdDiscovery, i: &Instance, tries: usize) -> Result<(), String> {
    let mut last = String::new();
    for _ in 0..tries {
        match d.register(i.clone()).await {
            Ok(_) => return Ok(()),
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(last)
}

fn namespace() -> String {
    format!("t{}", uuid::Uuid::new_v4().simple())
}

async fn next(s: &mut BoxStream<'static, DiscoveryEvent>, within: Duration) -> DiscoveryEvent {
    tokio::time::timeout(within, s.next())
        .await
        .expect("an event in time")
        .expect("the watch is open")
}

const TTL: Duration = Duration::from_secs(2);

/// How long a watch event may take. These bounds only end a test that would otherwise hang:
/// etcd beside a test build on a loaded 2-core machine has taken seconds to answer.
const EVENT_WITHIN: Duration = Duration::from_secs(30);

/// Two processes' planes on `url` in a fresh namespace: `a` registers, `b` watches.
struct Pair {
    ns: String,
    a: EtcdDiscovery,
    b: EtcdDiscovery,
    prefix: String,
    snapshot: Vec<Instance>,
    changes: BoxStream<'static, DiscoveryEvent>,
}

async fn pair(url: &str) -> Pair {
    let ns = namespace();
    let a = EtcdDiscovery::connect(&[url], TTL).await.unwrap();
    let b = EtcdDiscovery::connect(&[url], TTL).await.unwrap();
    let prefix = Instance::prefix(&ns, "decode", "generate");
    let (snapshot, changes) = b.watch(&prefix).await.unwrap();
    Pair {
        ns,
        a,
        b,
        prefix,
        snapshot,
        changes,
    }
}

#[tokio::test]
async fn register_watch_list_and_deregister() {
    let Some(url) = etcd() else { return };
    let Pair {
        ns,
        a,
        b,
        prefix,
        snapshot,
        mut changes,
    } = pair(&url).await;
    assert!(snapshot.is_empty());

    let i = instance(&ns, 1);
    a.register(i.clone()).await.unwrap();
    assert_eq!(
        next(&mut changes, EVENT_WITHIN).await,
        DiscoveryEvent::Put(i.clone())
    );
    assert_eq!(b.list(&prefix).await.unwrap(), vec![i.clone()]);
    // A second watcher starts from a snapshot that already has it.
    let (snapshot, _) = b.watch(&prefix).await.unwrap();
    assert_eq!(snapshot, vec![i.clone()]);

    a.deregister(&i.key()).await.unwrap();
    assert_eq!(
        next(&mut changes, EVENT_WITHIN).await,
        DiscoveryEvent::Delete { key: i.key() }
    );
    assert!(b.list(&prefix).await.unwrap().is_empty());
}

#[tokio::test]
async fn a_dead_process_leaves_within_its_ttl() {
    let Some(url) = etcd() else { return };
    let Pair {
        ns, a, mut changes, ..
    } = pair(&url).await;
    let i = instance(&ns, 2);
    a.register(i.clone()).await.unwrap();
    assert_eq!(
        next(&mut changes, EVENT_WITHIN).await,
        DiscoveryEvent::Put(i.clone())
    );
    // Dropping the plane stops the keep-alive, as a killed process would: etcd expires the
    // lease and deletes the key, within the TTL (+ 1 s for etcd's expiry sweep) on an idle
    // machine. The bound is a hang's: what this checks is that the key goes at all, which a
    // key without a lease (or a keep-alive that outlived its plane) never would.
    drop(a);
    let dropped = std::time::Instant::now();
    assert_eq!(
        next(&mut changes, EVENT_WITHIN).await,
        DiscoveryEvent::Delete { key: i.key() }
    );
    eprintln!("the key left {:?} after its plane", dropped.elapsed());
}

#[tokio::test]
async fn a_lost_lease_is_replaced_and_the_instance_comes_back() {
    let Some(url) = etcd() else { return };
    let Pair {
        ns, a, mut changes, ..
    } = pair(&url).await;
    let i = instance(&ns, 3);
    a.register(i.clone()).await.unwrap();
    next(&mut changes, EVENT_WITHIN).await;
    // Someone revokes the lease (as etcd does after a long partition).
    let old = a.lease();
    let mut raw = etcd_client::Client::connect([url.as_str()], None)
        .await
        .unwrap();
    raw.lease_revoke(old).await.unwrap();
    assert_eq!(
        next(&mut changes, EVENT_WITHIN).await,
        DiscoveryEvent::Delete { key: i.key() }
    );
    // The keep-alive notices, takes a new lease and registers again.
    assert_eq!(
        next(&mut changes, EVENT_WITHIN).await,
        DiscoveryEvent::Put(i.clone())
    );
    assert_ne!(a.lease(), old);
}

/// Every endpoint of `--control etcd://a,b` is used: with the first one dead, the
/// registration goes through the second.
#[tokio::test]
async fn a_dead_endpoint_among_several_is_passed_over() {
    let Some(url) = etcd() else { return };
    let ns = namespace();
    let a = EtcdDiscovery::connect(&["http://127.0.0.1:1", &url], TTL)
        .await
        .unwrap();
    let i = instance(&ns, 1);
    a.register(i.clone()).await.unwrap();
    let listed = dyn_runtime::planes::etcd::list_instances(
        &["http://127.0.0.1:1", &url],
        &Default::default(),
        &i.key(),
    )
    .await
    .unwrap();
    assert_eq!(listed, vec![i]);
}

#[tokio::test]
async fn a_member_lost_after_connecting_is_replaced_by_the_next() {
    if etcd().is_none() {
        return;
    }
    // Two single-member clusters stand in for two members of one (what matters here is the
    // client moving; a real cluster also keeps the data, which the second lacks until the
    // keep-alive registers everything again under a lease of its own).
    let (Some(first), Some(second)) = (
        dyn_tests::servers::Server::etcd(),
        dyn_tests::servers::Server::etcd(),
    ) else {
        dyn_tests::skip("no etcd binary on PATH");
        return;
    };
    let ns = namespace();
    let a = EtcdDiscovery::connect(&[first.url(), second.url()], TTL)
        .await
        .unwrap();
    let one = instance(&ns, 1);
    a.register(one.clone()).await.unwrap();
    drop(first);
    // The second has no such lease: registering works once the keep-alive has moved there
    // and taken a new one.
    let two = instance(&ns, 2);
    register_within(&a, &two, 300)
        .await
        .unwrap_or_else(|e| panic!("registering never worked on the second member: {e}"));
    let prefix = format!("v1/instances/{ns}/");
    let second_url = [second.url()];
    let none = dyn_runtime::planes::EtcdCredentials::default();
    let on_second = || dyn_runtime::planes::etcd::list_instances(&second_url, &none, &prefix);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut listed = on_second().await.unwrap();
        listed.sort_by_key(|i| i.instance_id);
        if listed == [one.clone(), two.clone()] {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the second member never got both: {listed:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(a.list(&prefix).await.unwrap().len(), 2);
}

#[tokio::test]
async fn an_unreachable_etcd_is_a_clear_error() {
    let e = EtcdDiscovery::connect(&["http://127.0.0.1:1"], TTL)
        .await
        .err()
        .expect("no server");
    assert!(e.to_string().starts_with("control (etcd) plane: "), "{e}");
}

#[tokio::test]
async fn watches_and_registrations_survive_an_etcd_restart() {
    if etcd().is_none() {
        return;
    }
    let Some(mut server) = dyn_tests::servers::Server::etcd() else {
        dyn_tests::skip("no etcd binary on PATH");
        return;
    };
    let url = server.url();
    let Pair {
        ns,
        a,
        b,
        prefix,
        mut changes,
        ..
    } = pair(&url).await;
    let first = instance(&ns, 4);
    a.register(first.clone()).await.unwrap();
    next(&mut changes, EVENT_WITHIN).await;

    assert!(server.restart(), "etcd restarts");
    // After the restart a new registration reaches the old watch, and the first one is
    // still there (its lease survived, or was replaced and re-registered).
    let second = instance(&ns, 5);
    register_within(&a, &second, 300)
        .await
        .unwrap_or_else(|e| panic!("registering never worked again after the restart: {e}"));
    loop {
        match next(&mut changes, EVENT_WITHIN).await {
            DiscoveryEvent::Put(i) if i == second => break,
            _ => {}
        }
    }
    let mut listed = b.list(&prefix).await.unwrap();
    listed.sort_by_key(|i| i.instance_id);
    assert_eq!(listed, vec![first, second]);
    drop(server);
}

#[tokio::test]
async fn watches_started_during_registrations_miss_nothing() {
    let Some(url) = etcd() else { return };
    let ns = namespace();
    let a = EtcdDiscovery::connect(&[&url], TTL).await.unwrap();
    let b = std::sync::Arc::new(EtcdDiscovery::connect(&[&url], TTL).await.unwrap());
    let prefix = Instance::prefix(&ns, "decode", "generate");
    const N: u64 = 20;
    let watchers: Vec<_> = (0..N)
        .map(|i| {
            let (b, prefix) = (b.clone(), prefix.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(i * 3)).await;
                let live = dyn_runtime::planes::LiveInstances::watch(b.as_ref(), &prefix)
                    .await
                    .unwrap();
                let deadline = tokio::time::Instant::now() + EVENT_WITHIN;
                while live.read().len() < N as usize && tokio::time::Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                live.read().len()
            })
        })
        .collect();
    for i in 0..N {
        a.register(instance(&ns, i)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    for w in watchers {
        assert_eq!(w.await.unwrap(), N as usize);
    }
}

/// With authentication on, the credentials in `ETCD_AUTH_USERNAME`/`PASSWORD` get through and
/// their absence is a clear error that names the variables.
#[tokio::test]
async fn an_etcd_with_authentication_takes_a_user_and_says_what_is_missing() {
    if etcd().is_none() {
        return;
    }
    let Some(server) = dyn_tests::servers::Server::etcd_with_auth("root", "etcd-root-pw") else {
        dyn_tests::skip("etcd is not on PATH");
        return;
    };
    let url = server.url();
    let e = EtcdDiscovery::connect(&[&url], TTL).await.err().unwrap();
    assert!(e.to_string().contains("set ETCD_AUTH_USERNAME"), "{e}");
    let vars = |pw: &'static str| {
        move |k: &str| match k {
            "ETCD_AUTH_USERNAME" => Some("root".into()),
            "ETCD_AUTH_PASSWORD" => Some(pw.into()),
            _ => None,
        }
    };
    let wrong = dyn_runtime::planes::EtcdCredentials::from_vars(vars("nope")).unwrap();
    let e = EtcdDiscovery::connect_with(&[&url], TTL, wrong)
        .await
        .err()
        .unwrap();
    assert!(e.to_string().contains("refused"), "{e}");
    let creds = dyn_runtime::planes::EtcdCredentials::from_vars(vars("etcd-root-pw")).unwrap();
    let d = EtcdDiscovery::connect_with(&[&url], TTL, creds.clone())
        .await
        .unwrap();
    let ns = namespace();
    let i = instance(&ns, 1);
    d.register(i.clone()).await.unwrap();
    let listed = dyn_runtime::planes::etcd::list_instances(&[&url], &creds, &i.key())
        .await
        .unwrap();
    assert_eq!(listed, vec![i]);
}

/// etcd over TLS with client certificates: `ETCD_AUTH_CA` and the client certificate get
/// through (https), the CA alone or plain http do not.
#[tokio::test]
async fn an_etcd_over_tls_takes_the_ca_and_a_client_certificate() {
    if etcd().is_none() {
        return;
    }
    let dir = dyn_tests::scratch_dir("etcd-pki");
    let pki = dyn_tests::servers::pki(&dir).expect("test certificates");
    let Some(server) = dyn_tests::servers::Server::etcd_tls(&pki) else {
        dyn_tests::skip("etcd is not on PATH");
        return;
    };
    let path = |p: &std::path::Path| std::ffi::OsString::from(p.as_os_str());
    let full = dyn_runtime::planes::EtcdCredentials::from_vars(|k| match k {
        "ETCD_AUTH_CA" => Some(path(&pki.ca)),
        "ETCD_AUTH_CLIENT_CERT" => Some(path(&pki.client_cert)),
        "ETCD_AUTH_CLIENT_KEY" => Some(path(&pki.client_key)),
        _ => None,
    })
    .unwrap();
    let urls = full.urls(&[server.address()]);
    assert!(urls[0].starts_with("https://"), "{urls:?}");
    let d = EtcdDiscovery::connect_with(&urls, TTL, full.clone())
        .await
        .unwrap();
    let ns = namespace();
    let i = instance(&ns, 1);
    d.register(i.clone()).await.unwrap();
    let listed = dyn_runtime::planes::etcd::list_instances(&urls, &full, &i.key())
        .await
        .unwrap();
    assert_eq!(listed, vec![i]);
    // Without a client certificate, or without TLS: refused.
    let ca_only = dyn_runtime::planes::EtcdCredentials::from_vars(|k| {
        (k == "ETCD_AUTH_CA").then(|| path(&pki.ca))
    })
    .unwrap();
    assert!(
        EtcdDiscovery::connect_with(&urls, TTL, ca_only)
            .await
            .is_err()
    );
    assert!(
        EtcdDiscovery::connect(&[format!("http://{}", server.address())], TTL)
            .await
            .is_err()
    );
}

/// An etcd login token that expires (here after a second) is renewed: registrations and
/// lists go on long after it.
#[tokio::test]
async fn an_expired_etcd_login_is_renewed() {
    if etcd().is_none() {
        return;
    }
    let Some(server) = dyn_tests::servers::Server::etcd_with_auth_ttl("root", "etcd-root-pw", 1)
    else {
        dyn_tests::skip("etcd is not on PATH");
        return;
    };
    let url = server.url();
    let creds = dyn_runtime::planes::EtcdCredentials::from_vars(|k| match k {
        "ETCD_AUTH_USERNAME" => Some("root".into()),
        "ETCD_AUTH_PASSWORD" => Some("etcd-root-pw".into()),
        _ => None,
    })
    .unwrap();
    let d = EtcdDiscovery::connect_with(&[&url], TTL, creds.clone())
        .await
        .unwrap();
    let ns = namespace();
    let (_, mut watch) = d.watch(&format!("v1/instances/{ns}/")).await.unwrap();
    for id in 1..=2 {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let i = instance(&ns, id);
        d.register(i.clone()).await.unwrap();
        let listed = dyn_runtime::planes::etcd::list_instances(&[&url], &creds, &i.key())
            .await
            .unwrap();
        assert_eq!(listed, vec![i.clone()]);
        loop {
            if let DiscoveryEvent::Put(got) = next(&mut watch, EVENT_WITHIN).await
                && got == i
            {
                break;
            }
        }
    }
}
