//! The runtime's own tests: paths, migration, readiness, supervision.

use super::*;
use dyn_core::operator::{Operator, erase};
use dyn_core::payload::{Payload, downcast};
use std::sync::atomic::Ordering;

struct N(u32);
impl Payload for N {
    const NAME: &'static str = "N";
}

/// Emits each input, then fails if `fail` is set.
struct Step {
    fail: bool,
}
impl Operator for Step {
    type In = N;
    type Out = N;
    fn call(&self, _ctx: Ctx, input: Input<N>) -> Output<N> {
        let fail = self.fail;
        input
            .map(Ok)
            .chain(stream::iter(
                fail.then(|| Err(OpError::invalid("step failed"))),
            ))
            .boxed()
    }
}

fn n_types() -> EndpointTypes {
    EndpointTypes {
        input: dyn_core::PayloadType::of::<N>(),
        output: dyn_core::PayloadType::of::<N>(),
    }
}

async fn serve(planes: &Planes, node: &str, op: Step) -> Arc<EdgeClient> {
    let types = n_types();
    let instance = Instance {
        namespace: "t".into(),
        component: node.into(),
        endpoint: ENDPOINT.into(),
        instance_id: random_instance_id(),
        transport: Transport::InProcess,
        metadata: Default::default(),
    };
    planes
        .requests
        .serve(&instance, types, erase(op))
        .await
        .unwrap();
    planes.discovery.register(instance).await.unwrap();
    Arc::new(
        EdgeClient::start(planes, "t", node, Role::Stage, types, Arc::default())
            .await
            .unwrap(),
    )
}

#[tokio::test]
async fn a_replica_is_in_discovery_exactly_while_it_is_ready() {
    let planes = Planes::embedded();
    let instance = Instance {
        namespace: "t".into(),
        component: "w".into(),
        endpoint: ENDPOINT.into(),
        instance_id: InstanceId(7),
        transport: Transport::InProcess,
        metadata: Default::default(),
    };
    let readiness = Readiness::default();
    readiness.set(false);
    let mut ready = readiness.subscribe();
    ready.borrow_and_update();
    let (failed, mut failures) = mpsc::channel(1);
    let follower = tokio::spawn(follow_readiness(planes.clone(), instance, ready, failed));
    let registered = || async { planes.discovery.list("").await.unwrap().len() };
    let until = |want: usize| async move {
        for _ in 0..200 {
            if registered().await == want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("never {want} registered");
    };
    assert_eq!(registered().await, 0);
    readiness.set(true);
    until(1).await;
    readiness.set(false);
    until(0).await;
    readiness.set(true);
    until(1).await;
    // A failure is for good: out of discovery, reported, and nothing after it counts.
    readiness.fail("engine thread panicked");
    assert_eq!(failures.recv().await, Some(InstanceId(7)));
    until(0).await;
    readiness.set(true);
    assert!(!readiness.is_ready());
    assert!(follower.await.is_ok(), "the follower ends after a failure");
    assert_eq!(registered().await, 0);
}

#[tokio::test]
async fn error_in_the_middle_of_a_path_reaches_the_ingress_last() {
    let planes = Planes::embedded();
    let runner = ChainRunner {
        paths: vec![PathStages {
            model: None,
            stages: vec![
                Stage::Node(Hop::One(serve(&planes, "a", Step { fail: true }).await)),
                Stage::Node(Hop::One(serve(&planes, "b", Step { fail: false }).await)),
            ],
            worker: None,
        }],
        root: Ctx::new(),
        in_flight: TaskTracker::new(),
    };
    let ctx = runner.new_ctx("r".into());
    let out: Vec<_> = runner.call(ctx, Box::new(N(7))).collect().await;
    assert_eq!(out.len(), 2);
    let mut out = out.into_iter();
    let first = out.next().unwrap().unwrap();
    assert_eq!(downcast::<N>(first).ok().map(|n| n.0), Some(7));
    let err = out.next().unwrap().err().unwrap();
    assert_eq!(err.message, "step failed");
}

#[tokio::test]
async fn runtime_root_kill_reaches_request_contexts() {
    let planes = Planes::embedded();
    let runner = ChainRunner {
        paths: vec![PathStages {
            model: None,
            stages: vec![Stage::Node(Hop::One(
                serve(&planes, "a", Step { fail: false }).await,
            ))],
            worker: None,
        }],
        root: Ctx::new(),
        in_flight: TaskTracker::new(),
    };
    let ctx = runner.new_ctx("r".into());
    runner.root.kill();
    assert!(ctx.is_killed());
}

#[tokio::test]
async fn no_live_instance_is_unavailable() {
    let planes = Planes::embedded();
    let types = n_types();
    let edge = Arc::new(
        EdgeClient::start(&planes, "t", "ghost", Role::Worker, types, Arc::default())
            .await
            .unwrap(),
    );
    let out: Vec<_> = edge
        .call(
            Ctx::new(),
            stream::iter([Box::new(N(1)) as AnyPayload]).boxed(),
        )
        .collect()
        .await;
    assert!(matches!(&out[..], [Err(e)] if e.kind == dyn_core::ErrorKind::Unavailable));
}
#[derive(Clone)]
struct Req {
    pos: u32,
    left: u32,
}
impl Payload for Req {
    const NAME: &'static str = "Req";
    fn resume() -> Option<Resume> {
        Some(Resume::of::<Self>())
    }
}
const HEADER: u32 = u32::MAX;
impl dyn_core::payload::Resumable for Req {
    type Output = N;
    fn absorb(&mut self, out: &N) {
        if out.0 != HEADER {
            self.pos += 1;
            self.left -= 1;
        }
    }
    fn is_repeat(out: &N) -> bool {
        out.0 == HEADER
    }
    fn clear_target(&mut self) {}
}

/// Streams a header, then positions `pos..pos+left`; the first call to get 3 tokens out
/// dies with `InstanceLost`, as a lost replica does.
struct Flaky {
    died: Arc<std::sync::atomic::AtomicBool>,
}
impl Operator for Flaky {
    type In = Req;
    type Out = N;
    fn call(&self, _ctx: Ctx, input: Input<Req>) -> Output<N> {
        let died = self.died.clone();
        async_stream::stream! {
            let mut input = input;
            let Some(req) = input.next().await else { return };
            yield Ok(N(HEADER));
            for (i, p) in (req.pos..req.pos + req.left).enumerate() {
                if i == 3 && !died.swap(true, Ordering::SeqCst) {
                    yield Err(OpError::instance_lost("replica lost"));
                    return;
                }
                yield Ok(N(p));
            }
        }
        .boxed()
    }
}

/// Workers of node `decode` (instances 1, 2, …), one per operator, and a worker edge to them.
async fn workers<O: Operator<In = Req, Out = N>>(ops: Vec<O>) -> Arc<EdgeClient> {
    let planes = Planes::embedded();
    let types = EndpointTypes {
        input: dyn_core::PayloadType::of::<Req>(),
        output: dyn_core::PayloadType::of::<N>(),
    };
    for (id, op) in (1..).zip(ops) {
        let instance = Instance {
            namespace: "t".into(),
            component: "decode".into(),
            endpoint: ENDPOINT.into(),
            instance_id: InstanceId(id),
            transport: Transport::InProcess,
            metadata: Default::default(),
        };
        planes
            .requests
            .serve(&instance, types, erase(op))
            .await
            .unwrap();
        planes.discovery.register(instance).await.unwrap();
    }
    Arc::new(
        EdgeClient::start(&planes, "t", "decode", Role::Worker, types, Arc::default())
            .await
            .unwrap(),
    )
}

/// A path of one migrating segment over `edge`'s workers, resending up to `limit` times.
fn migrating(edge: Arc<EdgeClient>, limit: u32) -> ChainRunner {
    ChainRunner {
        paths: vec![PathStages {
            model: None,
            stages: vec![Stage::Migrating(Arc::new(Migrating {
                steps: vec![Hop::One(edge)],
                resume: Resume::of::<Req>(),
                limit,
            }))],
            worker: None,
        }],
        root: Ctx::new(),
        in_flight: TaskTracker::new(),
    }
}

#[tokio::test]
async fn a_lost_replica_is_migrated_without_gaps_or_repeats() {
    let died = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let edge = workers((0..2).map(|_| Flaky { died: died.clone() }).collect()).await;
    let migrating = |limit| migrating(edge.clone(), limit);
    let runner = migrating(3);
    let out: Vec<u32> = runner
        .call(Ctx::new(), Box::new(Req { pos: 0, left: 10 }))
        .map(|r| downcast::<N>(r.unwrap()).ok().unwrap().0)
        .collect()
        .await;
    assert!(died.load(Ordering::SeqCst), "a replica was lost");
    let mut want = vec![HEADER];
    want.extend(0..10);
    assert_eq!(out, want);
    assert_eq!(runner.in_flight(), 0);

    // Without migration the loss reaches the caller.
    died.store(false, Ordering::SeqCst);
    let out: Vec<_> = migrating(0)
        .call(Ctx::new(), Box::new(Req { pos: 0, left: 10 }))
        .collect()
        .await;
    assert!(matches!(out.last(), Some(Err(e)) if e.kind == ErrorKind::InstanceLost));
}

/// Answers every call with `error` and counts the calls.
struct Refusing {
    error: OpError,
    calls: Arc<std::sync::atomic::AtomicUsize>,
}
impl Operator for Refusing {
    type In = Req;
    type Out = N;
    fn call(&self, _ctx: Ctx, _input: Input<Req>) -> Output<N> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        stream::iter([Err(self.error.clone())]).boxed()
    }
}

/// A migrating segment over `replicas` workers that all answer with `error`.
async fn refused_by(
    replicas: u64,
    error: OpError,
) -> (ChainRunner, Arc<std::sync::atomic::AtomicUsize>) {
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let edge = workers(
        (0..replicas)
            .map(|_| Refusing {
                error: error.clone(),
                calls: calls.clone(),
            })
            .collect(),
    )
    .await;
    let runner = migrating(edge, 3);
    (runner, calls)
}

// Paused clocks: a back-off slept shows as virtual time passed, with nothing timed for real.
#[tokio::test(start_paused = true)]
async fn busy_workers_refuse_once_and_are_not_retried() {
    let (runner, calls) = refused_by(3, OpError::overloaded("the worker is busy")).await;
    let started = tokio::time::Instant::now();
    let out: Vec<_> = runner
        .call(Ctx::new(), Box::new(Req { pos: 0, left: 10 }))
        .collect()
        .await;
    assert!(
        matches!(&out[..], [Err(e)] if e.kind == ErrorKind::Overloaded && e.code.as_deref() == Some(dyn_core::WORKER_BUSY)),
        "{out:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1, "one call, no resends");
    // No back-off was slept (the old path slept 50 + 100 + 200 ms).
    assert_eq!(started.elapsed(), Duration::ZERO);

    // An empty pool is not retried either.
    let (runner, calls) = refused_by(2, OpError::unavailable("no worker")).await;
    let out: Vec<_> = runner
        .call(Ctx::new(), Box::new(Req { pos: 0, left: 10 }))
        .collect()
        .await;
    assert!(matches!(&out[..], [Err(e)] if e.kind == ErrorKind::Unavailable));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_client_that_leaves_during_the_back_off_ends_the_migration_at_once() {
    let (runner, calls) = refused_by(2, OpError::instance_lost("gone")).await;
    let ctx = Ctx::new();
    let killer = ctx.clone();
    let mut out = runner.call(ctx, Box::new(Req { pos: 0, left: 10 }));
    // The first loss starts a 50 ms back-off; the client leaves inside it.
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(10)).await;
        killer.kill();
    });
    let started = tokio::time::Instant::now();
    let last = out.next().await;
    assert!(
        matches!(&last, Some(Err(e)) if e.kind == ErrorKind::Cancelled),
        "{last:?}"
    );
    assert!(out.next().await.is_none());
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "nothing resent after the kill"
    );
    assert_eq!(
        started.elapsed(),
        Duration::from_millis(10),
        "not the 50 ms back-off"
    );

    // Left alone, a lost request is resent up to the limit (1 + 3 calls).
    let (runner, calls) = refused_by(2, OpError::instance_lost("gone")).await;
    let out: Vec<_> = runner
        .call(Ctx::new(), Box::new(Req { pos: 0, left: 10 }))
        .collect()
        .await;
    assert!(matches!(&out[..], [Err(e)] if e.kind == ErrorKind::InstanceLost));
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}

/// The first call loses the request after two positions, the second is refused as busy, the
/// rest serve.
struct LostThenBusy {
    calls: Arc<std::sync::atomic::AtomicUsize>,
}
impl Operator for LostThenBusy {
    type In = Req;
    type Out = N;
    fn call(&self, _ctx: Ctx, input: Input<Req>) -> Output<N> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        async_stream::stream! {
            let mut input = input;
            let Some(req) = input.next().await else { return };
            if call == 1 {
                yield Err(OpError::overloaded("busy"));
                return;
            }
            yield Ok(N(HEADER));
            for (i, p) in (req.pos..req.pos + req.left).enumerate() {
                if call == 0 && i == 2 {
                    yield Err(OpError::instance_lost("replica lost"));
                    return;
                }
                yield Ok(N(p));
            }
        }
        .boxed()
    }
}

#[tokio::test(start_paused = true)]
async fn a_request_being_resent_waits_out_a_busy_survivor() {
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let edge = workers(
        (0..2)
            .map(|_| LostThenBusy {
                calls: calls.clone(),
            })
            .collect(),
    )
    .await;
    let runner = migrating(edge, 3);
    let out: Vec<u32> = runner
        .call(Ctx::new(), Box::new(Req { pos: 0, left: 6 }))
        .map(|r| downcast::<N>(r.unwrap()).ok().unwrap().0)
        .collect()
        .await;
    let mut want = vec![HEADER];
    want.extend(0..6);
    assert_eq!(out, want);
    assert_eq!(calls.load(Ordering::SeqCst), 3, "lost, busy, served");
}
