//! The TCP request plane over real sockets on loopback.

use super::*;
use dyn_core::operator::{NOT_SERVED, Operator, erase};
use dyn_core::payload::PayloadType;
use dyn_core::payload::{Payload, downcast};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicUsize, Ordering};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Num(u64);
impl Payload for Num {
    const NAME: &'static str = "Num";
    fn codec() -> Option<Codec> {
        Some(Codec::json::<Self>())
    }
}

/// For each input n, streams n, n+1, …, n+count-1, one per `delay`; counts drops.
struct Counter {
    count: u64,
    delay: Duration,
    killed: Arc<AtomicUsize>,
}
impl Operator for Counter {
    type In = Num;
    type Out = Num;
    fn call(&self, ctx: Ctx, input: Input<Num>) -> Output<Num> {
        let (count, delay, killed) = (self.count, self.delay, self.killed.clone());
        async_stream::stream! {
            let mut input = input;
            while let Some(Num(n)) = input.next().await {
                for i in 0..count {
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = ctx.killed() => {
                            killed.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                    }
                    yield Ok(Num(n + i));
                }
            }
            if n_fail(&ctx) {
                yield Err(OpError::invalid("asked to fail").with_code("a_code_only_the_callee_knows"));
            }
            if ctx.id().as_str() == "lost" {
                // What an engine that died under this request says.
                yield Err(OpError::instance_lost("the engine stopped"));
            }
        }
        .boxed()
    }
}

fn n_fail(ctx: &Ctx) -> bool {
    ctx.id().as_str() == "fail"
}

/// Waits up to 5 s for `cond` (what another task or process does meanwhile).
async fn eventually(mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cond() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn types() -> EndpointTypes {
    EndpointTypes {
        input: PayloadType::of::<Num>(),
        output: PayloadType::of::<Num>(),
    }
}

async fn served(
    count: u64,
    delay: Duration,
    opts: TcpOptions,
) -> (TcpRequestPlane, Instance, Arc<AtomicUsize>) {
    let plane = TcpRequestPlane::new(opts, Arc::default());
    let killed = Arc::new(AtomicUsize::new(0));
    let mut inst = Instance {
        namespace: "t".into(),
        component: "counter".into(),
        endpoint: "generate".into(),
        instance_id: InstanceId(7),
        transport: Transport::InProcess,
        metadata: Default::default(),
    };
    inst.transport = plane
        .serve(
            &inst,
            types(),
            erase(Counter {
                count,
                delay,
                killed: killed.clone(),
            }),
        )
        .await
        .unwrap();
    (plane, inst, killed)
}

fn nums(v: &[u64]) -> Input<AnyPayload> {
    stream::iter(
        v.iter()
            .map(|&n| Box::new(Num(n)) as AnyPayload)
            .collect::<Vec<_>>(),
    )
    .boxed()
}

fn collect_nums(out: Vec<Result<AnyPayload, OpError>>) -> (Vec<u64>, Option<OpError>) {
    let mut ok = Vec::new();
    let mut err = None;
    for item in out {
        match item {
            Ok(v) => ok.push(downcast::<Num>(v).map(|n| n.0).unwrap_or(u64::MAX)),
            Err(e) => err = Some(e),
        }
    }
    (ok, err)
}

#[tokio::test]
async fn a_cleanly_ended_call_leaves_its_connection_for_the_next_and_a_closed_one_is_not_used() {
    let (server, inst, _) = served(3, Duration::ZERO, TcpOptions::default()).await;
    let client = TcpRequestPlane::new(TcpOptions::default(), Arc::default());
    let Transport::Tcp { address } = inst.transport.clone() else {
        panic!("served over TCP")
    };
    let idle = |c: &TcpRequestPlane| c.pool.idle.lock().get(&address).map_or(0, Vec::len);
    for round in 0..3 {
        let out: Vec<_> = client
            .call(&inst, types(), Ctx::new(), nums(&[10 * round]))
            .collect()
            .await;
        let base = 10 * round;
        assert_eq!(collect_nums(out).0, vec![base, base + 1, base + 2]);
        assert_eq!(idle(&client), 1, "one connection, reused");
    }
    // An error ends the call before its done mark is read: the dropped call reads up to the
    // mark on a task of its own, then the connection is back.
    let out: Vec<_> = client
        .call(&inst, types(), Ctx::with_id("fail"), nums(&[1]))
        .collect()
        .await;
    assert!(collect_nums(out).1.is_some());
    eventually(|| idle(&client) == 1).await;
    assert_eq!(idle(&client), 1);
    drop(server);
}

#[tokio::test]
async fn a_pooled_connection_the_other_side_closed_is_dropped_not_used() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let pool = ConnPool::default();
    let conn = |s: TcpStream| {
        let (r, w) = tokio::io::split(dyn_trust::PlaneStream::Plain(s));
        (
            FramedRead::new(r, length_codec(1024)),
            FramedWrite::new(w, length_codec(1024)),
        )
    };
    // One connection whose peer stays, one whose peer closed (a restarted worker).
    let open = TcpStream::connect(&address).await.unwrap();
    let (_kept, _) = listener.accept().await.unwrap();
    let closed = TcpStream::connect(&address).await.unwrap();
    drop(listener.accept().await.unwrap());
    pool.put(&address, conn(open));
    pool.put(&address, conn(closed));
    // Let the FIN arrive.
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Last in, first out: the closed one is found closed and dropped, the open one returned.
    assert!(pool.take(&address).is_some());
    assert!(pool.take(&address).is_none(), "nothing else was kept");
    assert!(pool.idle.lock()[&address].is_empty());
}

#[tokio::test]
async fn streams_across_a_socket_and_carries_errors() {
    let (server, inst, _) = served(3, Duration::ZERO, TcpOptions::default()).await;
    // A second plane is "another process": it has no local handler for the instance.
    let client = TcpRequestPlane::new(TcpOptions::default(), Arc::default());
    let out: Vec<_> = client
        .call(&inst, types(), Ctx::new(), nums(&[10, 20]))
        .collect()
        .await;
    let (ok, err) = collect_nums(out);
    assert_eq!(ok, vec![10, 11, 12, 20, 21, 22]);
    assert!(err.is_none());
    let out: Vec<_> = client
        .call(&inst, types(), Ctx::with_id("fail"), nums(&[1]))
        .collect()
        .await;
    let (ok, err) = collect_nums(out);
    assert_eq!(ok, vec![1, 2, 3]);
    let err = err.expect("an error");
    assert_eq!(
        (err.kind, err.code.as_deref(), err.message.as_str()),
        (
            ErrorKind::InvalidRequest,
            Some("a_code_only_the_callee_knows"),
            "asked to fail"
        )
    );
    // Same process: the call skips the socket.
    let out: Vec<_> = server
        .call(&inst, types(), Ctx::new(), nums(&[5]))
        .collect()
        .await;
    assert_eq!(collect_nums(out).0, vec![5, 6, 7]);
}

#[tokio::test]
async fn a_call_dropped_before_its_first_item_still_kills_the_remote_request() {
    let (server, inst, killed) =
        served(1000, Duration::from_millis(20), TcpOptions::default()).await;
    let client = TcpRequestPlane::new(TcpOptions::default(), Arc::default());
    let mut out = client.call(&inst, types(), Ctx::new(), nums(&[0]));
    // Polled once: the header and input are out, no item has come back yet.
    assert!(
        tokio::time::timeout(Duration::from_millis(2), out.next())
            .await
            .is_err()
    );
    drop(out);
    eventually(|| killed.load(Ordering::SeqCst) > 0).await;
    assert_eq!(killed.load(Ordering::SeqCst), 1);
    drop(server);
}

#[tokio::test]
async fn a_dropped_call_kills_the_remote_request() {
    let (server, inst, killed) =
        served(1000, Duration::from_millis(5), TcpOptions::default()).await;
    let client = TcpRequestPlane::new(TcpOptions::default(), Arc::default());
    let mut out = client.call(&inst, types(), Ctx::new(), nums(&[0]));
    assert!(out.next().await.is_some_and(|r| r.is_ok()));
    assert_eq!(server.in_flight(), 1);
    drop(out);
    eventually(|| killed.load(Ordering::SeqCst) > 0).await;
    assert_eq!(killed.load(Ordering::SeqCst), 1);
    eventually(|| server.in_flight() == 0).await;
    assert_eq!(server.in_flight(), 0);
    // The cancel travelled in band: the connection survives for the next call.
    let Transport::Tcp { address } = inst.transport.clone() else {
        panic!("served over TCP")
    };
    eventually(|| {
        client
            .pool
            .idle
            .lock()
            .get(&address)
            .is_some_and(|v| !v.is_empty())
    })
    .await;
    let mut out = client.call(&inst, types(), Ctx::new(), nums(&[0]));
    assert!(out.next().await.is_some_and(|r| r.is_ok()));
    assert_eq!(
        client.pool.idle.lock()[&address].len(),
        0,
        "the pooled one is in use"
    );
}

#[tokio::test]
async fn unreachable_and_unserved_instances_are_lost_and_marked_down() {
    let (server, inst, _) = served(1, Duration::ZERO, TcpOptions::default()).await;
    let health = Arc::new(InstanceHealth::default());
    let client = TcpRequestPlane::new(TcpOptions::default(), health.clone());
    // A request lost in the engine is lost, but the instance still serves: not marked down.
    let out: Vec<_> = client
        .call(&inst, types(), Ctx::with_id("lost"), nums(&[1]))
        .collect()
        .await;
    let err = collect_nums(out).1.expect("error");
    assert_eq!(err.kind, ErrorKind::InstanceLost);
    assert!(!health.is_down(inst.instance_id));
    server.unserve(inst.instance_id).await.unwrap();
    let out: Vec<_> = client
        .call(&inst, types(), Ctx::new(), nums(&[1]))
        .collect()
        .await;
    let err = collect_nums(out).1.expect("error");
    assert_eq!(
        (err.kind, err.code.as_deref()),
        (ErrorKind::InstanceLost, Some(NOT_SERVED))
    );
    assert!(health.is_down(inst.instance_id));
    drop(server);
    // Nothing listens there any more.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let out: Vec<_> = client
        .call(&inst, types(), Ctx::new(), nums(&[1]))
        .collect()
        .await;
    let err = collect_nums(out).1.expect("error");
    // (A pooled connection may still reach the old server's connection task: not served.)
    assert_eq!(err.kind, ErrorKind::InstanceLost, "{}", err.message);
    assert!(health.is_down(inst.instance_id));
}

#[tokio::test]
async fn oversized_items_fail_cleanly_and_the_deadline_travels() {
    let small = TcpOptions {
        max_message_bytes: 8,
        ..TcpOptions::default()
    };
    let (_server, inst, killed) =
        served(1000, Duration::from_millis(5), TcpOptions::default()).await;
    let client = TcpRequestPlane::new(small, Arc::default());
    let out: Vec<_> = client
        .call(&inst, types(), Ctx::new(), nums(&[u64::MAX / 2]))
        .collect()
        .await;
    let err = collect_nums(out).1.expect("too large");
    assert_eq!(err.kind, ErrorKind::InvalidRequest, "{}", err.message);
    assert!(err.message.contains("message limit"), "{}", err.message);
    // The server kills the request at the deadline it was sent.
    let client = TcpRequestPlane::new(TcpOptions::default(), Arc::default());
    let ctx = Ctx::new().with_timeout(Duration::from_millis(50));
    let out: Vec<_> = client.call(&inst, types(), ctx, nums(&[0])).collect().await;
    let (ok, err) = collect_nums(out);
    assert!(ok.len() < 1000);
    assert_eq!(err.map(|e| e.kind), Some(ErrorKind::Cancelled));
    eventually(|| killed.load(Ordering::SeqCst) > 0).await;
    assert!(killed.load(Ordering::SeqCst) >= 1);
}

fn with_token(token: &str) -> TcpOptions {
    TcpOptions {
        trust: dyn_trust::Trust::from_secrets(dyn_trust::Secrets {
            token: Some(token.as_bytes().to_vec()),
            ca: None,
        })
        .unwrap(),
        ..TcpOptions::default()
    }
}

/// With a cluster identity the plane is TLS: members stream as before (over a reused
/// connection); a process with another token or none, or an intruder writing frames by hand,
/// is refused before the handler sees anything.
#[tokio::test]
async fn only_members_of_the_cluster_are_served() {
    const TOKEN: &str = "a-cluster-token-of-some-length";
    let (_server, inst, _) = served(3, Duration::ZERO, with_token(TOKEN)).await;
    let member = TcpRequestPlane::new(with_token(TOKEN), Arc::default());
    for round in 0..2 {
        let out: Vec<_> = member
            .call(&inst, types(), Ctx::new(), nums(&[round]))
            .collect()
            .await;
        let (ok, err) = collect_nums(out);
        assert!(err.is_none(), "{err:?}");
        assert_eq!(ok, vec![round, round + 1, round + 2]);
    }
    for stranger in [with_token("another-token-entirely!"), TcpOptions::default()] {
        let health = Arc::new(InstanceHealth::default());
        let client = TcpRequestPlane::new(stranger, health.clone());
        let out: Vec<_> = client
            .call(&inst, types(), Ctx::new(), nums(&[1]))
            .collect()
            .await;
        let (ok, err) = collect_nums(out);
        assert!(ok.is_empty());
        let err = err.expect("refused");
        assert_eq!(err.kind, ErrorKind::InstanceLost, "{}", err.message);
        assert!(health.is_down(inst.instance_id));
    }
    // By hand: a header naming the instance, an item and the end of input, as a caller writes
    // them. The connection is closed; nothing is served.
    let Transport::Tcp { address } = &inst.transport else {
        panic!("served over TCP")
    };
    let s = TcpStream::connect(address).await.unwrap();
    let (r, w) = s.into_split();
    let mut w = FramedWrite::new(w, length_codec(1 << 20));
    let header = serde_json::json!({"instance_id": inst.instance_id, "request_id": "x"});
    let _ = w.feed(frame(HEADER, header.to_string().as_bytes())).await;
    let _ = w.feed(frame(ITEM, b"5")).await;
    let _ = w.send(frame(END_INPUT, b"")).await;
    let mut r = FramedRead::new(r, length_codec(1 << 20));
    let answer = tokio::time::timeout(Duration::from_secs(6), r.next()).await;
    assert!(
        matches!(answer, Ok(None | Some(Err(_)))),
        "closed without an answer"
    );
}

/// A silent handler is kept alive by heartbeats; a server that says nothing at all (a frozen
/// process keeps its sockets open) loses the call as an instance lost, and is marked down.
#[tokio::test]
async fn heartbeats_tell_a_slow_answer_from_a_frozen_process() {
    let quick = TcpOptions {
        heartbeat: Duration::from_millis(20),
        silence: Duration::from_millis(150),
        ..TcpOptions::default()
    };
    let (_server, inst, _) = served(2, Duration::from_millis(400), quick.clone()).await;
    let client = TcpRequestPlane::new(quick.clone(), Arc::default());
    let out: Vec<_> = client
        .call(&inst, types(), Ctx::new(), nums(&[0]))
        .collect()
        .await;
    let (ok, err) = collect_nums(out);
    assert!(err.is_none(), "{err:?}");
    assert_eq!(ok, vec![0, 1]);

    // A listener that accepts and never answers.
    let frozen = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = frozen.local_addr().unwrap().to_string();
    let _hold = tokio::spawn(async move {
        let mut kept = Vec::new();
        while let Ok((s, _)) = frozen.accept().await {
            kept.push(s);
        }
    });
    let gone = Instance {
        transport: Transport::Tcp { address },
        instance_id: InstanceId(99),
        ..inst.clone()
    };
    let health = Arc::new(InstanceHealth::default());
    let client = TcpRequestPlane::new(quick, health.clone());
    let started = Instant::now();
    let out: Vec<_> = client
        .call(&gone, types(), Ctx::new(), nums(&[0]))
        .collect()
        .await;
    let err = collect_nums(out).1.expect("lost");
    assert_eq!(err.kind, ErrorKind::InstanceLost, "{}", err.message);
    assert!(err.message.contains("nothing heard"), "{}", err.message);
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(health.is_down(InstanceId(99)));
}

#[tokio::test]
async fn a_caller_writing_another_codec_is_refused_by_name_and_the_worker_stays_up() {
    let (_server, inst, _) = served(2, Duration::ZERO, TcpOptions::default()).await;
    let health = Arc::new(InstanceHealth::default());
    let client = TcpRequestPlane::new(TcpOptions::default(), health.clone());
    // As a caller of another dyn version would: its input in a format this worker does not
    // read (the bytes happen to be JSON; the header says what they are).
    let mut other = types();
    other.input.codec = Some(Codec {
        format: "msgpack",
        ..Codec::json::<Num>()
    });
    let out: Vec<_> = client
        .call(&inst, other, Ctx::new(), nums(&[1]))
        .collect()
        .await;
    let err = collect_nums(out).1.expect("refused");
    assert_eq!(err.kind, ErrorKind::Internal, "{}", err.message);
    assert!(
        err.message.contains("`Num` as msgpack") && err.message.contains("one dyn version"),
        "{}",
        err.message
    );
    assert!(!health.is_down(inst.instance_id));
    // The same worker serves a caller of its own version.
    let out: Vec<_> = client
        .call(&inst, types(), Ctx::new(), nums(&[1]))
        .collect()
        .await;
    let (ok, err) = collect_nums(out);
    assert!(err.is_none() && !ok.is_empty(), "{ok:?} {err:?}");
}
