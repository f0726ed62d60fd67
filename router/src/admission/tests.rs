//! Admission on tokio's paused clock: the queue's order and refusals, tenants' shares,
//! preemption, rate limits, the reserve and the charges routers share.

use super::forecast::WAIT_MARGIN;
use super::*;
use std::collections::BTreeMap;

#[test]
fn the_queue_orders_by_priority_then_deadline_then_arrival() {
    let t0 = Instant::now();
    let s = Duration::from_secs;
    let mut q = Queue::new(8);
    q.push(1, t0 + s(5), "", 1.0, "batch late");
    q.push(1, t0 + s(2), "", 1.0, "batch early");
    q.push(0, t0 + s(9), "", 1.0, "interactive");
    q.push(1, t0 + s(2), "", 1.0, "batch early, second");
    let order: Vec<&str> = std::iter::from_fn(|| q.pop().map(|(_, v)| v)).collect();
    assert_eq!(
        order,
        [
            "interactive",
            "batch early",
            "batch early, second",
            "batch late"
        ]
    );
}

#[test]
fn a_full_queue_refuses_lower_classes_first() {
    let t0 = Instant::now();
    let s = Duration::from_secs;
    let mut q = Queue::new(2);
    assert!(matches!(
        q.push(1, t0 + s(1), "", 1.0, "b1"),
        Pushed::Waiting
    ));
    assert!(matches!(
        q.push(1, t0 + s(2), "", 1.0, "b2"),
        Pushed::Waiting
    ));
    // A batch request ranks last: refused.
    assert_eq!(q.push(1, t0 + s(3), "", 1.0, "b3"), Pushed::Refused("b3"));
    // An interactive one takes the worst place.
    assert!(matches!(
        q.push(0, t0 + s(3), "", 1.0, "i1"),
        Pushed::Displaced("b2")
    ));
    assert_eq!(q.pop().map(|(_, v)| v), Some("i1"));
    assert_eq!(q.pop().map(|(_, v)| v), Some("b1"));
}

fn config(per_worker: u32, queue: usize, max_wait_s: f64) -> AdmissionConfig {
    AdmissionConfig {
        per_worker: Some(per_worker),
        queue,
        max_wait_s,
        tenants: BTreeMap::new(),
        tenant_default: TenantConfig::default(),
        reserve: 0,
        preempt: true,
    }
}

/// Admission over one worker.
fn admitting(config: AdmissionConfig) -> Arc<Admission> {
    let places = config.places(None);
    Admission::new(config, "route", move || vec![places])
}

fn admission(per_worker: u32, queue: usize, max_wait_s: f64) -> Arc<Admission> {
    admitting(config(per_worker, queue, max_wait_s))
}

#[tokio::test(start_paused = true)]
async fn requests_wait_for_room_and_go_best_first() {
    // Without preemption, priority orders the queue only.
    let a = admitting(AdmissionConfig {
        preempt: false,
        ..config(1, 4, 10.0)
    });
    let ctx = Ctx::new();
    let running = a.admit(&ctx, Ask::priority(5)).await.expect("room");
    // Two wait; the interactive one (0) goes first when the running one ends.
    let (a1, a2) = (a.clone(), a.clone());
    let batch = tokio::spawn(async move {
        a1.admit(&Ctx::new(), Ask::priority(1))
            .await
            .map(|_| "batch")
    });
    tokio::task::yield_now().await;
    let inter = tokio::spawn(async move {
        let p = a2.admit(&Ctx::new(), Ask::priority(0)).await;
        p.map(|p| {
            drop(p);
            "interactive"
        })
    });
    tokio::task::yield_now().await;
    assert_eq!(a.counts(), (1, 2));
    drop(running);
    assert_eq!(inter.await.unwrap().unwrap(), "interactive");
    assert_eq!(batch.await.unwrap().unwrap(), "batch");
}

/// Admits `ask` in the background; the permit comes back through the handle.
fn admit_later(a: &Arc<Admission>, priority: i32, tenant: &'static str) -> Later {
    let a = a.clone();
    tokio::spawn(async move {
        let ask = Ask {
            priority,
            tenant,
            tokens: 1,
        };
        a.admit(&Ctx::new(), ask).await
    })
}

type Later = tokio::task::JoinHandle<Result<Permit, OpError>>;

#[tokio::test(start_paused = true)]
async fn a_request_that_comes_first_goes_beyond_the_room_for_a_running_one_to_give_way() {
    let a = admission(2, 8, 10.0);
    let batch = [
        a.admit(&Ctx::new(), Ask::priority(1)).await.expect("room"),
        a.admit(&Ctx::new(), Ask::priority(1)).await.expect("room"),
    ];
    let waiting_batch = admit_later(&a, 1, "");
    tokio::task::yield_now().await;
    assert_eq!(a.counts(), (2, 1));
    // Interactive requests go at once, past the waiting batch one, while fewer than the
    // places come before them: the engine preempts a batch request for each.
    let i1 = a
        .admit(&Ctx::new(), Ask::priority(0))
        .await
        .expect("at once");
    let i2 = a
        .admit(&Ctx::new(), Ask::priority(0))
        .await
        .expect("at once");
    assert_eq!(i1.precedence(), Precedence::default());
    assert_eq!(a.counts(), (4, 1));
    let waiting_interactive = admit_later(&a, 0, "");
    tokio::task::yield_now().await;
    assert_eq!(a.counts(), (4, 2), "two interactive ones fill the places");
    // A batch request ending frees no place that anyone waiting could start in...
    drop(batch);
    tokio::task::yield_now().await;
    assert_eq!(a.counts(), (2, 2));
    // ...an interactive one ending does, and the interactive waiter goes first.
    drop(i1);
    let next = waiting_interactive.await.unwrap().expect("its turn");
    assert_eq!(next.precedence().priority, 0);
    assert_eq!(a.counts(), (2, 1));
    drop((i2, next));
    assert!(waiting_batch.await.unwrap().is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_tenant_under_its_share_takes_a_place_from_one_over_it() {
    let a = admission(4, 8, 10.0);
    let ask = |tenant, tokens| Ask {
        priority: 0,
        tenant,
        tokens,
    };
    // Alone, a tenant's share is half the places (a newcomer's is the other half): its
    // requests beyond it give way.
    let mut heavy = Vec::new();
    for _ in 0..4 {
        heavy.push(a.admit(&Ctx::new(), ask("heavy", 100)).await.expect("room"));
    }
    let yields: Vec<bool> = heavy.iter().map(|p| p.precedence().yields).collect();
    assert_eq!(yields, [false, false, true, true]);
    let a1 = a.clone();
    let heavy_waits = tokio::spawn(async move { a1.admit(&Ctx::new(), ask("heavy", 100)).await });
    tokio::task::yield_now().await;
    assert_eq!(a.counts(), (4, 1));
    // A light tenant goes ahead of the heavy one's queue and past the room, taking the
    // places of the two that give way.
    let a1 = a.clone();
    let l1 = tokio::spawn(async move { a1.admit(&Ctx::new(), ask("light", 1)).await });
    tokio::task::yield_now().await;
    let l1 = l1.await.unwrap().expect("at once");
    assert!(!l1.precedence().yields);
    let l2 = a
        .admit(&Ctx::new(), ask("light", 1))
        .await
        .expect("at once");
    assert!(!l2.precedence().yields);
    assert_eq!(a.counts(), (6, 1));
    // No more give way: its third waits, and goes when a heavy request ends. It holds its
    // share by then, yet does not give way: it is the tenant served least lately.
    let a1 = a.clone();
    let l3 = tokio::spawn(async move { a1.admit(&Ctx::new(), ask("light", 1)).await });
    tokio::task::yield_now().await;
    assert_eq!(a.counts(), (6, 2));
    drop(heavy.remove(0));
    let l3 = l3.await.unwrap().expect("its turn");
    assert!(!l3.precedence().yields);
    drop((l1, l2, l3, heavy));
    assert!(heavy_waits.await.unwrap().is_ok());
}

#[tokio::test(start_paused = true)]
async fn no_room_within_the_deadline_is_refused_and_a_full_queue_at_once() {
    let a = admission(1, 1, 0.5);
    let _running = a.admit(&Ctx::new(), Ask::priority(0)).await.expect("room");
    let a1 = a.clone();
    let waiting = tokio::spawn(async move { a1.admit(&Ctx::new(), Ask::priority(0)).await.err() });
    tokio::task::yield_now().await;
    // The queue (one place) is taken by an equal: refused now.
    let e = a
        .admit(&Ctx::new(), Ask::priority(0))
        .await
        .err()
        .expect("refused");
    assert_eq!(e.code.as_deref(), Some(QUEUE_FULL));
    // The waiter gives up at its deadline.
    let e = waiting.await.unwrap().expect("timed out");
    assert_eq!(e.code.as_deref(), Some(QUEUE_TIMEOUT));
    assert_eq!(a.counts(), (1, 1));
    a.tick();
    assert_eq!(a.counts(), (1, 0), "the closed waiter leaves the queue");
}

#[tokio::test(start_paused = true)]
async fn requests_that_would_wait_past_their_deadline_are_refused_at_once() {
    let a = admission(1, 16, 1.0);
    // Requests finish every 100 ms.
    for _ in 0..3 {
        let p = a.admit(&Ctx::new(), Ask::priority(0)).await.expect("room");
        tokio::time::advance(Duration::from_millis(100)).await;
        drop(p);
    }
    let _running = a.admit(&Ctx::new(), Ask::priority(0)).await.expect("room");
    let t0 = Instant::now();
    let mut waiting = Vec::new();
    for _ in 0..5 {
        let a = a.clone();
        waiting.push(tokio::spawn(async move {
            a.admit(&Ctx::new(), Ask::priority(0))
                .await
                .err()
                .map(|e| (e.code, Instant::now()))
        }));
        tokio::task::yield_now().await;
    }
    // Place i should start in (i + 1) x 100 ms x the margin: those past 1 s are refused now.
    let kept = ((1000.0 / (100.0 * WAIT_MARGIN)) as usize).min(5);
    assert!(kept < 5);
    assert_eq!(a.counts(), (1, kept));
    for w in waiting.into_iter().skip(kept) {
        let (code, at) = w.await.unwrap().expect("refused");
        assert_eq!(code.as_deref(), Some(QUEUE_TIMEOUT));
        assert_eq!(at, t0, "refused at once, not at the deadline");
    }
}

#[tokio::test(start_paused = true)]
async fn a_waiter_whose_client_left_does_not_take_the_room() {
    let a = admission(1, 4, 10.0);
    let running = a.admit(&Ctx::new(), Ask::priority(0)).await.expect("room");
    let a1 = a.clone();
    let gone = tokio::spawn(async move { a1.admit(&Ctx::new(), Ask::priority(0)).await.map(drop) });
    tokio::task::yield_now().await;
    gone.abort();
    let _ = gone.await;
    let a2 = a.clone();
    let next = tokio::spawn(async move { a2.admit(&Ctx::new(), Ask::priority(1)).await.map(drop) });
    tokio::task::yield_now().await;
    drop(running);
    assert!(next.await.unwrap().is_ok());
    assert_eq!(a.counts(), (0, 0));
}

/// Pops `n` from a queue kept full of both tenants' requests (each pushes one back for
/// every one popped, as a backlog does): how many each got.
fn shares(weights: [(&str, f64); 2], demand: [usize; 2], n: usize) -> [usize; 2] {
    let t0 = Instant::now();
    let mut q = Queue::new(1000);
    let cost = |w: f64| 100.0 / w;
    for (i, (t, w)) in weights.iter().enumerate() {
        for _ in 0..demand[i] {
            q.push(0, t0, t, cost(*w), i);
        }
    }
    let mut got = [0, 0];
    for _ in 0..n {
        let (_, i) = q.pop().expect("backlogged");
        got[i] += 1;
        q.push(0, t0, weights[i].0, cost(weights[i].1), i);
    }
    got
}

#[test]
fn backlogged_tenants_share_by_weight() {
    for (w, want) in [(1.0, 0.5), (3.0, 0.75)] {
        let got = shares([("a", 1.0), ("b", w)], [50, 50], 400);
        let share = got[1] as f64 / 400.0;
        assert!(
            (share / want - 1.0).abs() <= 0.1,
            "weight {w}: {got:?}, share {share}, wanted {want}"
        );
    }
    // Ten times the demand buys no more than an equal share.
    let got = shares([("heavy", 1.0), ("light", 1.0)], [100, 10], 400);
    assert!((got[1] as f64 / 200.0 - 1.0).abs() <= 0.1, "{got:?}");
}

#[test]
fn a_light_tenant_goes_ahead_of_a_heavy_tenants_backlog_and_idle_time_banks_nothing() {
    let t0 = Instant::now();
    let mut q = Queue::new(100);
    for i in 0..10 {
        q.push(0, t0, "heavy", 1.0, format!("h{i}"));
    }
    // The heavy tenant was served a while: its counter runs ahead.
    for _ in 0..5 {
        let (_, h) = q.pop().expect("one");
        q.push(0, t0, "heavy", 1.0, h);
    }
    // The light tenant starts just under the heavy one: it goes ahead of the heavy
    // tenant's backlog, and once charged stands level with it.
    q.push(0, t0, "light", 1.0, "l0".to_string());
    assert_eq!(q.pop().map(|(_, v)| v), Some("l0".to_string()));
    assert_eq!(q.counter("light"), q.counter("heavy"));
    // A tenant that comes back after being away starts level with the waiting ones: it
    // gets its turn, not a run of turns.
    let mut q = Queue::new(100);
    for i in 0..20 {
        q.charge("heavy", 1.0);
        q.push(0, t0, "heavy", 1.0, format!("h{i}"));
    }
    for i in 0..3 {
        q.push(0, t0, "new", 1.0, format!("n{i}"));
    }
    let first: Vec<String> = (0..6).filter_map(|_| q.pop().map(|(_, v)| v)).collect();
    let new = first.iter().filter(|v| v.starts_with('n')).count();
    assert!((2..=3).contains(&new), "{first:?}");
    assert!(first.iter().any(|v| v.starts_with('h')), "{first:?}");
}

#[test]
fn a_full_queue_refuses_the_most_served_tenants_request() {
    let t0 = Instant::now();
    let mut q = Queue::new(2);
    assert_eq!(q.push(0, t0, "light", 1.0, "l1"), Pushed::Waiting);
    // The heavy tenant is served while the light one waits (here, or by another router).
    q.charge("heavy", 50.0);
    assert_eq!(q.push(0, t0, "heavy", 1.0, "h1"), Pushed::Waiting);
    assert_eq!(q.push(0, t0, "light", 1.0, "l2"), Pushed::Displaced("h1"));
    // Still, priority comes first.
    assert_eq!(q.push(1, t0, "light", 1.0, "l3"), Pushed::Refused("l3"));
    // Level counters: the entry that would go last is the heavy tenant's last, behind
    // its own backlog, not the light tenant's one request that arrived after it.
    let mut q = Queue::new(4);
    for h in ["h0", "h1", "h2", "h3"] {
        assert_eq!(q.push(0, t0, "heavy", 1.0, h), Pushed::Waiting);
    }
    assert_eq!(q.push(0, t0, "light", 1.0, "l0"), Pushed::Displaced("h3"));
}

#[tokio::test(start_paused = true)]
async fn a_tenant_over_its_rate_limit_is_refused_with_when_to_come_back() {
    let limited = TenantConfig {
        weight: 1.0,
        requests_per_minute: Some(2),
        tokens_per_minute: Some(1000),
    };
    let a = admitting(AdmissionConfig {
        tenants: BTreeMap::from([("acme".to_string(), limited)]),
        ..config(100, 4, 1.0)
    });
    let ask = |tokens| Ask {
        priority: 0,
        tenant: "acme",
        tokens,
    };
    let _p1 = a.admit(&Ctx::new(), ask(100)).await.expect("first");
    let _p2 = a.admit(&Ctx::new(), ask(100)).await.expect("second");
    let e = a.admit(&Ctx::new(), ask(100)).await.err().expect("third");
    assert_eq!(e.kind, dyn_core::ErrorKind::RateLimited);
    assert_eq!(e.code.as_deref(), Some(dyn_core::RATE_LIMIT_EXCEEDED));
    // One request comes back every 30 s.
    assert_eq!(e.retry_after_s, Some(30));
    // Other tenants are not limited.
    let _other = a.admit(&Ctx::new(), Ask::priority(0)).await.expect("other");
    tokio::time::advance(Duration::from_secs(30)).await;
    // A request comes back; tokens: 800 left of 1000 plus 500 refilled, capped at 1000.
    let _p3 = a.admit(&Ctx::new(), ask(900)).await.expect("after 30 s");
    let e = a
        .admit(&Ctx::new(), ask(5000))
        .await
        .err()
        .expect("never fits");
    assert_eq!(e.retry_after_s, Some(3600));
}

#[tokio::test(start_paused = true)]
async fn a_reserve_keeps_places_free_of_any_one_tenant() {
    let a = admitting(AdmissionConfig {
        reserve: 1,
        ..config(3, 8, 10.0)
    });
    let ask = |tenant| Ask {
        priority: 0,
        tenant,
        tokens: 1,
    };
    let h1 = a.admit(&Ctx::new(), ask("heavy")).await.expect("room");
    let _h2 = a.admit(&Ctx::new(), ask("heavy")).await.expect("room");
    // The heavy tenant holds all it may: its next waits though a place is free...
    let a1 = a.clone();
    let h3 = tokio::spawn(async move { a1.admit(&Ctx::new(), ask("heavy")).await.map(drop) });
    tokio::task::yield_now().await;
    assert_eq!(a.counts(), (2, 1));
    // ...which a light tenant's request takes at once.
    let _l1 = a
        .admit(&Ctx::new(), ask("light"))
        .await
        .expect("the reserve");
    assert_eq!(a.counts(), (3, 1));
    drop(h1);
    assert!(h3.await.unwrap().is_ok());
}

#[tokio::test(start_paused = true)]
async fn routers_replaying_each_others_charges_hold_the_same_counters() {
    let a = admission(100, 8, 1.0);
    let b = admission(100, 8, 1.0);
    let ask = |tenant, tokens| Ask {
        priority: 0,
        tenant,
        tokens,
    };
    for (t, n) in [
        ("heavy", 50),
        ("light", 10),
        ("heavy", 50),
        ("", 7),
        ("light", 10),
    ] {
        drop(a.admit(&Ctx::new(), ask(t, n)).await.expect("room"));
    }
    let charges = a.take_charges().expect("charged");
    assert_eq!(charges.charges.len(), 5);
    b.apply_charges(charges.clone());
    let counters = |x: &Admission| x.state.lock().queue.counters();
    assert_eq!(counters(&a), counters(&b));
    // Its own, coming back, change nothing.
    a.apply_charges(charges);
    assert_eq!(counters(&a), counters(&b));
    assert!(a.take_charges().is_none());
}
