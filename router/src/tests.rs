//! The `route` operator end to end on embedded planes: routing by each policy, sessions,
//! the KV index fed by events, adapters, and the settings' checks.

use super::*;
use dyn_core::planes::{ENDPOINT, Planes, Transport};
use dyn_core::{BuildCx, OperatorConfig};
use dyn_protocol::kv::{KvEventData, RouterEvent, block_hashes};
use futures::stream;
use std::time::Duration;

fn cx(planes: &Planes) -> BuildCx {
    dyn_protocol::testing::cx("route", 1, &["decode"], planes)
}

async fn route_once(r: &Route) -> Result<PreprocessedRequest, OpError> {
    let mut out = r.call(
        Ctx::new(),
        stream::iter([dyn_protocol::testing::preprocessed(vec![1], 1)]).boxed(),
    );
    out.next().await.expect("one item")
}

/// A prompt with a memo of its own (a test's request hashes once too). The memo is leaked:
/// a test lives shorter than the leak matters.
fn fresh(tokens: &[u32], salt: Option<u64>) -> PromptRef<'_> {
    PromptRef::new(tokens, salt, Box::leak(Box::default()))
}

#[tokio::test]
async fn cycles_through_live_workers_and_is_unavailable_without_any() {
    let planes = Planes::embedded();
    let r = RouteConfig::default()
        .build(&cx(&planes))
        .await
        .expect("builds");
    let e = route_once(&r).await.expect_err("no workers");
    assert_eq!(e.kind, dyn_core::ErrorKind::Unavailable);

    register(&planes, &[10, 11]).await;
    // The watch applies registrations asynchronously.
    until("both workers live", || r.inner.workers.live().len() == 2).await;
    let mut picked = Vec::new();
    for _ in 0..4 {
        picked.push(
            route_once(&r)
                .await
                .expect("routed")
                .target
                .expect("target")
                .get(),
        );
    }
    picked.sort_unstable();
    assert_eq!(picked, [10, 10, 11, 11]);
}

async fn register(planes: &Planes, ids: &[u64]) {
    for &id in ids {
        let i = Instance {
            namespace: "ns".into(),
            component: "decode".into(),
            endpoint: ENDPOINT.into(),
            instance_id: id.into(),
            transport: Transport::InProcess,
            metadata: Default::default(),
        };
        planes.discovery.register(i).await.expect("register");
    }
}

// The route's watch and event task run asynchronously: poll until a condition holds.
use dyn_tests::until;

#[tokio::test]
async fn a_session_sticks_to_its_worker_until_that_one_is_over_its_bound_and_routers_share_it() {
    let planes = Planes::embedded();
    let config = RouteConfig {
        session_affinity: Some(sessions::AffinityConfig {
            ttl_s: 60.0,
            max_active: Some(1),
        }),
        ..RouteConfig::default()
    };
    let r = started(&planes, config.clone(), &[10, 11]).await;
    let go = |r: &Route, s: Option<&str>| {
        let ctx = Ctx::new();
        let w = r
            .inner
            .route(
                &ctx,
                fresh(&[1, 2, 3], None),
                None,
                s,
                Precedence::default(),
            )
            .expect("routed")
            .0;
        (w, ctx)
    };
    // Round robin alone alternates; a session stays.
    let first = go(&r, Some("conv")).0;
    for _ in 0..4 {
        assert_eq!(go(&r, Some("conv")).0, first);
    }
    let a = go(&r, None).0;
    assert_ne!(go(&r, None).0, a, "round robin without a session");
    // While a request of the session holds its worker at the bound, the policy decides
    // (round robin: the other worker within two requests), and the session moves there.
    let (held, _busy) = go(&r, Some("conv"));
    assert_eq!(held, first);
    go(&r, Some("conv"));
    let moved = go(&r, Some("conv")).0;
    assert_ne!(moved, first);
    for _ in 0..3 {
        assert_eq!(go(&r, Some("conv")).0, moved);
    }
    // A second router of the same node hears of the binding over the event plane.
    let other = started(&planes, config, &[10, 11]).await;
    go(&r, Some("shared"));
    let bound = r
        .inner
        .sessions
        .as_ref()
        .and_then(|s| s.table.get("shared", std::time::Instant::now()))
        .expect("bound");
    until("the other router has the binding", || {
        other
            .inner
            .sessions
            .as_ref()
            .and_then(|s| s.table.get("shared", std::time::Instant::now()))
            == Some(bound)
    })
    .await;
    for _ in 0..3 {
        assert_eq!(go(&other, Some("shared")).0, bound);
    }
}

/// A route with `policy` (and `config`'s other settings) over live workers `ids`.
async fn started(planes: &Planes, config: RouteConfig, ids: &[u64]) -> Route {
    let r = config.build(&cx(planes)).await.expect("builds");
    register(planes, ids).await;
    until("the workers live", || {
        r.inner.workers.live().len() == ids.len()
    })
    .await;
    r
}

/// Publish worker `worker`'s first KV event: it stored the full blocks of `tokens`.
/// A `kv` router over workers `ids`.
async fn kv_router(planes: &Planes, ids: &[u64]) -> Route {
    let config = RouteConfig {
        policy: Policy::Kv,
        ..RouteConfig::default()
    };
    started(planes, config, ids).await
}

async fn publish_stored(planes: &Planes, worker: u64, tokens: &[u32]) {
    publish_blocks(planes, worker, 0, block_hashes(tokens, 16)).await
}

/// Publish worker `worker`'s KV event `event_id`: it stored `blocks`, a chain from the
/// root.
async fn publish_blocks(
    planes: &Planes,
    worker: u64,
    event_id: u64,
    blocks: Vec<dyn_protocol::kv::BlockHash>,
) {
    let ev = RouterEvent {
        worker_id: worker,
        event: dyn_protocol::kv::KvCacheEvent {
            event_id,
            dp_rank: 0,
            medium: Default::default(),
            data: KvEventData::Stored {
                parent_hash: None,
                blocks,
            },
        },
    };
    let payload = serde_json::to_vec(&ev).expect("json");
    planes
        .events
        .publish("dyn.ns.decode.kv_events", payload.into())
        .await
        .expect("publish");
}

async fn route_with(r: &Route, ctx: Ctx, tokens: Vec<u32>) -> u64 {
    let mut out = r.call(
        ctx,
        stream::iter([dyn_protocol::testing::preprocessed(tokens, 1)]).boxed(),
    );
    out.next()
        .await
        .expect("item")
        .expect("routed")
        .target
        .expect("target")
        .get()
}

#[tokio::test]
async fn kv_policy_follows_the_cached_prefix() {
    let planes = Planes::embedded();
    let r = kv_router(&planes, &[10, 11]).await;
    let prompt: Vec<u32> = (0..64).collect();
    publish_stored(&planes, 11, &prompt).await;
    let kv = r.inner.placement.kv.as_ref().expect("kv state");
    until("the stored blocks indexed", || {
        kv.index.read().worker_blocks(11) == 4
    })
    .await;
    let d = r.inner.decide(&prompt).expect("decides");
    assert_eq!(d.worker, 11);
    let c11 = d.candidates.iter().find(|c| c.worker == 11).expect("11");
    assert_eq!(
        (c11.matched_blocks, c11.prefill_blocks, c11.prefill_tokens),
        (4, 0, 0)
    );
    // While the request is active its blocks count against worker 11; once it is over
    // they are released.
    let ctx = Ctx::new();
    assert_eq!(route_with(&r, ctx.clone(), prompt.clone()).await, 11);
    assert_eq!(r.inner.loads.active.load(11).decode_blocks, 4);
    assert_eq!(
        r.inner.loads.active.load(11).prefill_tokens,
        0,
        "fully cached"
    );
    drop(ctx);
    until("the load released", || {
        r.inner.loads.active.load(11) == sequences::Load::default()
    })
    .await;
}

/// A salted prompt matches the blocks a worker stored under the same salt only: not the
/// unsalted prompt's, not another salt's (and an unsalted prompt not the salted ones).
#[tokio::test]
async fn a_salted_prompt_matches_only_blocks_of_its_own_salt() {
    use dyn_protocol::kv::{block_hashes_salted, salt_hash};
    let planes = Planes::embedded();
    let r = kv_router(&planes, &[10, 11]).await;
    let prompt: Vec<u32> = (0..64).collect();
    let a = Some(salt_hash("a"));
    // Worker 11 caches the prompt under salt "a", worker 10 unsalted.
    publish_blocks(&planes, 11, 0, block_hashes_salted(&prompt, 16, a)).await;
    publish_stored(&planes, 10, &prompt).await;
    let kv = r.inner.placement.kv.as_ref().expect("kv state");
    until("the stored blocks indexed", || {
        let ix = kv.index.read();
        ix.worker_blocks(11) == 4 && ix.worker_blocks(10) == 4
    })
    .await;
    let matched = |salt: Option<u64>| -> Vec<(u64, usize)> {
        let d = r
            .inner
            .decide_without(fresh(&prompt, salt), None, &|_| false)
            .expect("decides");
        let mut m: Vec<(u64, usize)> = d
            .candidates
            .iter()
            .map(|c| (c.worker, c.matched_blocks))
            .collect();
        m.sort();
        m
    };
    assert_eq!(matched(a), vec![(10, 0), (11, 4)]);
    assert_eq!(matched(None), vec![(10, 4), (11, 0)]);
    assert_eq!(matched(Some(salt_hash("b"))), vec![(10, 0), (11, 0)]);
    // Through the operator: the request's `cache_salt` decides.
    let mut req = dyn_protocol::testing::preprocessed(prompt.clone(), 1);
    req.routing.cache_salt = Some("a".into());
    let mut out = r.call(Ctx::new(), stream::iter([req]).boxed());
    let routed = out.next().await.expect("item").expect("routed");
    assert_eq!(
        (routed.target.map(|t| t.get()), routed.cached_tokens),
        (Some(11), 64)
    );
    // The routed request carries the hashes the router made, for the engine's admission.
    assert_eq!(routed.hashes.kept(), 1);
    let salted = dyn_protocol::kv::request_salt(&routed.routing);
    let carried = routed.hashes.share().get(&prompt, 16, salted);
    assert_eq!(routed.hashes.kept(), 1, "found, not hashed again");
    assert_eq!(&carried[..], &block_hashes_salted(&prompt, 16, a)[..]);
    // Pricing and routing one request hash it once.
    let memo = dyn_protocol::kv::PromptHashes::default();
    let d = |r: &Route| {
        r.inner
            .decide_without(PromptRef::new(&prompt, a, &memo), None, &|_| false)
            .expect("decides")
            .blocks
    };
    assert!(std::sync::Arc::ptr_eq(&d(&r), &d(&r)));
}

#[tokio::test]
async fn a_departed_worker_leaves_the_index() {
    let planes = Planes::embedded();
    let r = kv_router(&planes, &[10, 11]).await;
    publish_stored(&planes, 11, &(0..32).collect::<Vec<_>>()).await;
    let kv = r.inner.placement.kv.as_ref().expect("kv state");
    until("the blocks indexed", || {
        kv.index.read().worker_blocks(11) == 2
    })
    .await;
    let key = Instance {
        namespace: "ns".into(),
        component: "decode".into(),
        endpoint: ENDPOINT.into(),
        instance_id: 11.into(),
        transport: Transport::InProcess,
        metadata: Default::default(),
    }
    .key();
    planes.discovery.deregister(&key).await.expect("deregister");
    // Reconciled on the router's once-a-second tick.
    until("the index emptied", || kv.index.read().stats().nodes == 0).await;
    assert_eq!(
        kv.index.read().worker_ids().collect::<Vec<_>>(),
        Vec::<u64>::new()
    );
}

#[tokio::test]
async fn least_loaded_counts_active_requests_until_they_finish() {
    let planes = Planes::embedded();
    let config = RouteConfig {
        policy: Policy::LeastLoaded,
        ..RouteConfig::default()
    };
    let r = started(&planes, config, &[1, 2]).await;
    let a = Ctx::new();
    let first = route_with(&r, a.clone(), vec![1, 2, 3]).await;
    let b = Ctx::new();
    let second = route_with(&r, b.clone(), vec![1, 2, 3]).await;
    assert_ne!(first, second, "the busy worker is avoided");
    a.first_output();
    assert_eq!(r.inner.loads.active.load(first).prefill_tokens, 0);
    assert_eq!(r.inner.loads.active.load(first).requests, 1);
    drop(a);
    assert_eq!(r.inner.loads.active.load(first).requests, 0);
    assert_eq!(route_with(&r, Ctx::new(), vec![1]).await, first);
    drop(b);
    assert!(r.inner.loads.active.snapshot().is_empty());
}

#[tokio::test]
async fn approximate_kv_remembers_its_own_decisions_until_the_ttl() {
    let planes = Planes::embedded();
    let config = RouteConfig {
        policy: Policy::Kv,
        kv_events: false,
        ..RouteConfig::default()
    };
    let r = started(&planes, config, &[1, 2, 3]).await;
    let prompt: Vec<u32> = (100..164).collect();
    let w = route_with(&r, Ctx::new(), prompt.clone()).await;
    let kv = r.inner.placement.kv.as_ref().expect("kv");
    assert_eq!(r.inner.decide(&prompt).expect("decides").worker, w);
    // Not yet expired with a long TTL; gone with a zero one.
    kv.expire(Duration::from_secs(3600));
    assert_eq!(kv.index.read().worker_blocks(w), 4);
    kv.expire(Duration::ZERO);
    assert_eq!(kv.index.read().worker_blocks(w), 0);
    assert_eq!(kv.own_decisions(), 0);
}

#[test]
fn bad_settings_are_reported() {
    let c = RouteConfig {
        overlap_weight: Some(-1.0),
        miss_weight: -1.0,
        overlap_credit: 1.5,
        load_bound: 0.5,
        busy_threshold: Some(2.0),
        temperature: f64::NAN,
        approx_ttl_s: 0.0,
        block_size: Some(0),
        ..RouteConfig::default()
    };
    let fields = c.validate();
    // overlap_weight twice: negative, and given with `cost: time`.
    assert_eq!(fields.len(), 9, "{fields:#?}");
    assert!(RouteConfig::default().validate().is_empty());
    let blocks = RouteConfig {
        cost: CostModel::Blocks,
        overlap_weight: Some(2.0),
        ..RouteConfig::default()
    };
    assert!(blocks.validate().is_empty());
}

#[test]
fn dynamo_router_settings_carry_over_under_their_names() {
    let c: RouteConfig = serde_json::from_value(serde_json::json!({
        "policy": "kv",
        "router_temperature": 0.5,
        "kv_overlap_score_credit": 0.25,
        "busy_threshold": 0.9,
        "router_ttl_secs": 60.0,
        "kv_cache_block_size": 32,
        "use_kv_events": false,
    }))
    .expect("Dynamo's names parse");
    assert_eq!(
        (c.temperature, c.overlap_credit, c.busy_threshold),
        (0.5, 0.25, Some(0.9))
    );
    assert_eq!(
        (c.approx_ttl_s, c.block_size, c.kv_events),
        (60.0, Some(32), false)
    );
    assert!(c.validate().is_empty());
    // Dynamo's overlap weight is the blocks cost's.
    let c: RouteConfig = serde_json::from_value(serde_json::json!({
        "policy": "kv", "cost": "blocks", "overlap_score_weight": 2.0,
    }))
    .expect("parses");
    assert_eq!(c.pricing().overlap_weight, 2.0);
    assert!(c.validate().is_empty());
    // A Dynamo knob with no counterpart is an unknown field, as any other.
    let e = serde_json::from_value::<RouteConfig>(serde_json::json!({
        "policy": "kv", "router_replica_sync": true,
    }))
    .expect_err("unknown");
    assert!(e.to_string().contains("router_replica_sync"), "{e}");
}

#[tokio::test]
async fn needs_exactly_one_consumer() {
    let planes = Planes::embedded();
    let mut c = cx(&planes);
    c.consumers.clear();
    assert!(RouteConfig::default().build(&c).await.is_err());
}

/// An adapter's requests stay with the worker that got its first one (it holds the
/// adapter) while the load allows; another adapter's may go elsewhere; a worker that has
/// not seen an adapter for `lora_slots` others no longer counts as holding it.
#[tokio::test]
async fn an_adapter_s_requests_go_where_it_is_held_until_the_load_says_otherwise() {
    let planes = Planes::embedded();
    let config = RouteConfig {
        policy: Policy::Kv,
        lora_slots: 2,
        // Ten queued 40-token prompts at the default 0.02 ms a token.
        lora_load_ms: 8.0,
        ..RouteConfig::default()
    };
    let r = started(&planes, config, &[10, 11]).await;
    let mut prompt = 0u32;
    let mut go = |lora: Option<&str>| {
        let ctx = Ctx::new();
        prompt += 100;
        let tokens: Vec<u32> = (prompt..prompt + 40).collect();
        let w = r
            .inner
            .route(
                &ctx,
                fresh(&tokens, None),
                lora,
                None,
                Precedence::default(),
            )
            .expect("routed")
            .0;
        (w, ctx)
    };
    // One at a time (each done before the next): the holder every time.
    let home = go(Some("a")).0;
    for _ in 0..8 {
        assert_eq!(go(Some("a")).0, home);
    }
    // Held open, they pile up on the holder until its queue outweighs a read elsewhere:
    // a hot adapter spreads.
    let busy: Vec<(u64, Ctx)> = (0..40).map(|_| go(Some("a"))).collect();
    let away = busy.iter().filter(|(w, _)| *w != home).count();
    assert!(
        away > 0 && away < 40,
        "{away} of 40 went away from the holder"
    );
    drop(busy);
    // Both hold `a` now; the other worker forgets it after two other adapters.
    let other = if home == 10 { 11 } else { 10 };
    r.inner.adapters.hold(other, "b", &r.inner.workers);
    r.inner.adapters.hold(other, "c", &r.inner.workers);
    let d = r
        .inner
        .decide_without(fresh(&[1, 2, 3], None), Some("a"), &|_| false)
        .expect("decides");
    let lora_ms: Vec<(u64, f64)> = d.candidates.iter().map(|c| (c.worker, c.lora_ms)).collect();
    assert!(
        lora_ms.contains(&(home, 0.0)) && lora_ms.contains(&(other, 8.0)),
        "{lora_ms:?}"
    );
}
