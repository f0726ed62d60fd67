//! Telemetry with owners: a worker's series leave `/metrics` with the worker. The real runtime
//! runs `graphs/agg.yaml` (mocker workers with offload tiers) in this process, and its embedded
//! scaling connector — the one the SLA planner drives — adds and removes replicas.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dyn_core::Connector;
use dyn_runtime::RunOptions;

/// The `/metrics` lines (series, not comments) naming the `decode` node.
fn decode_series() -> Vec<String> {
    dyn_protocol::metrics::render()
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains("node=\"decode\""))
        .map(str::to_owned)
        .collect()
}

use dyn_tests::until;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_scale_cycles_leave_metrics_the_same_size() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../graphs/agg.yaml");
    let sets: Vec<dyn_runtime::spec::Override> = [
        "http.listen=127.0.0.1:0",
        "decode.replicas=1",
        "decode.mocker.offload.host_blocks=8",
    ]
    .iter()
    .map(|s| s.parse().unwrap())
    .collect();
    let graph = dyn_runtime::load_and_compile(&path, &sets, &dyn_kinds::registry())
        .unwrap_or_else(|d| panic!("{d:?}"));
    let connector: Arc<Mutex<Option<Arc<dyn Connector>>>> = Arc::default();
    let slot = connector.clone();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        let opts = RunOptions {
            grace: Duration::from_secs(5),
            ..RunOptions::default()
        };
        dyn_runtime::run_attached(
            &graph,
            opts,
            async {
                let _ = stopped.await;
            },
            move |a| {
                *slot.lock().unwrap() = Some(a.replicas);
                None
            },
        )
        .await
    });
    until("the graph is up", || connector.lock().unwrap().is_some()).await;
    let replicas = connector.lock().unwrap().clone().unwrap();
    let before = decode_series();
    // One worker: its engine, tier and transfer series.
    assert!(
        before
            .iter()
            .any(|l| l.starts_with("dyn_worker_kv_total_blocks")),
        "{before:#?}"
    );
    assert!(
        before
            .iter()
            .any(|l| l.starts_with("dyn_worker_kv_tier_blocks")),
        "{before:#?}"
    );
    for cycle in 0..20 {
        replicas.set_replicas("decode", 3).await.unwrap();
        let up = decode_series().len();
        assert!(up > before.len(), "cycle {cycle}: three workers show");
        replicas.set_replicas("decode", 1).await.unwrap();
        // The removed replicas stop once their (no) calls are done; their engines' threads end
        // and take their series with them.
        until("the removed workers' series are gone", || {
            decode_series().len() == before.len()
        })
        .await;
    }
    let after = decode_series();
    assert_eq!(after.len(), before.len(), "{after:#?}");
    let _ = stop.send(());
    run.await.unwrap().unwrap();
}
