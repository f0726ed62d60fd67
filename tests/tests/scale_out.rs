//! Multi-process `dyn graph up` on real etcd and NATS servers: serving, lease expiry of a
//! killed worker, request migration when a worker dies mid-stream, event and control plane
//! restarts under load, and graceful drain on SIGTERM.
//!
//! Every test starts its own etcd and nats-server (free loopback ports, temporary data) so it
//! can kill and restart them, and gives its graph a run directory of its own for `ps`/`down`.
//! They run when the test command has set the servers up (`DYN_TEST_ETCD`), and skip visibly
//! otherwise.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use std::path::PathBuf;
use std::process::Output;
use std::time::{Duration, Instant};

use dyn_tests::servers::{Server, test_server};
use dyn_tests::{Graph, dyn_cmd, long_prompt, metric, scratch_dir};
use serde_json::{Value, json};

const AGG: &str = "graphs/agg.yaml";
/// Every multi-process test runs its planes with a cluster identity: TLS between processes.
const CLUSTER_TOKEN: &str = "scale-out-tests-cluster-token";
/// Every request carries this key; a test that configures it checks it stays off command lines.
const API_KEY: &str = "scale-out-tests-api-key";
const AGG_KV: &str = "graphs/agg_kv.yaml";

struct Cluster {
    g: Graph,
    etcd: Server,
    nats: Server,
    run_dir: PathBuf,
    file: &'static str,
}

impl Cluster {
    /// `dyn graph up FILE` across processes on private etcd and NATS servers, once every
    /// decode replica has registered.
    fn up(file: &'static str, decode: usize, extra: &[&str]) -> Option<Cluster> {
        Self::up_with_token(file, decode, extra, Some(CLUSTER_TOKEN))
    }

    /// [`Cluster::up`] with `token` as the cluster's identity (none: the run makes its own).
    fn up_with_token(
        file: &'static str,
        decode: usize,
        extra: &[&str],
        token: Option<&str>,
    ) -> Option<Cluster> {
        test_server("DYN_TEST_ETCD")?;
        let (Some(etcd), Some(nats)) = (Server::etcd(), Server::nats()) else {
            dyn_tests::skip("etcd or nats-server is not on PATH");
            return None;
        };
        let run_dir = scratch_dir(&format!("run-{}", etcd.address().replace(':', "-")));
        let control = format!("etcd://{}", etcd.address());
        let events = format!("nats://{}", nats.address());
        let mut args = vec![
            "--control",
            &control,
            "--events",
            &events,
            "--lease-ttl",
            "2",
            "--grace-period",
            "20",
        ];
        args.extend_from_slice(extra);
        let dir = run_dir.display().to_string();
        let mut env = vec![("DYN_RUN_DIR", dir.as_str())];
        env.extend(token.map(|t| ("DYN_CLUSTER_TOKEN", t)));
        let g = Graph::start(file, "http", &args, &env);
        let c = Cluster {
            g,
            etcd,
            nats,
            run_dir,
            file,
        };
        c.wait_for(
            |c| c.instances("decode").len() == decode,
            "decode replicas register",
        );
        // The frontend's own watch may be a moment behind etcd on a busy machine: ready once a
        // request goes through.
        let url = format!("http://{}", c.g.addr);
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::thread::scope(|s| {
            s.spawn(|| {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap()
                    .block_on(stream_chat(&url, "ready?", 1))
            })
            .join()
            .unwrap()
        })
        .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "the graph never served a request"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Some(c)
    }

    fn dyn_graph(&self, args: &[&str]) -> Output {
        dyn_cmd()
            .args(["graph"])
            .args(args)
            .env("DYN_RUN_DIR", &self.run_dir)
            .output()
            .unwrap()
    }

    /// `dyn graph ps FILE --json`.
    fn ps(&self) -> Value {
        let control = format!("etcd://{}", self.etcd.address());
        let out = self.dyn_graph(&["ps", self.file, "--control", &control, "--json"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// Registered instance ids (hex) of `node`.
    fn instances(&self, node: &str) -> Vec<String> {
        self.ps()["instances"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|i| i["component"] == node)
                    .map(|i| format!("{:x}", i["instance_id"].as_u64().unwrap()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The pid of one supervised process, e.g. `("decode", 1)`.
    fn pid(&self, process: &str, replica: u64) -> u32 {
        let ps = self.ps();
        let procs = ps["runs"][0]["processes"].as_array().unwrap().clone();
        procs
            .iter()
            .find(|p| p["process"] == process && p["replica"] == replica)
            .and_then(|p| p["pid"].as_u64())
            .unwrap_or_else(|| panic!("no pid for {process}.{replica} in {ps}")) as u32
    }

    fn wait_for(&self, ok: impl Fn(&Cluster) -> bool, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !ok(self) {
            assert!(
                Instant::now() < deadline,
                "timed out waiting until {what}; logs:\n{}",
                self.g.logs().join("\n")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Log lines of the frontend process.
    fn frontend_logs(&self) -> Vec<Value> {
        dyn_tests::process_logs(&self.g.logs(), "frontend.0")
    }
}

fn signal(pid: u32, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
}

/// A streamed chat completion: its text and completion tokens, or why it failed.
async fn stream_chat(url: &str, content: &str, max_tokens: u32) -> Result<(String, u64), String> {
    let body = json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let r = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth(API_KEY)
        .json(&body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = r.status();
    let text = r.text().await.map_err(|e| e.to_string())?;
    if status != 200 {
        return Err(format!("{status}: {text}"));
    }
    let mut out = String::new();
    let mut tokens = None;
    let mut done = false;
    for event in text.split("\n\n").filter(|e| !e.is_empty()) {
        let data = event
            .strip_prefix("data: ")
            .ok_or(format!("bad event {event:?}"))?;
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).map_err(|e| e.to_string())?;
        if v.get("error").is_some() {
            return Err(v.to_string());
        }
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            out.push_str(c);
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            tokens = Some(n);
        }
    }
    match (done, tokens) {
        (true, Some(n)) => Ok((out, n)),
        _ => Err(format!("incomplete stream: {text}")),
    }
}

/// Send `prompts` concurrently; results in order.
async fn stream_all(
    url: &str,
    prompts: &[String],
    max_tokens: u32,
) -> Vec<Result<(String, u64), String>> {
    let tasks: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (url, p) = (url.to_owned(), p.clone());
            tokio::spawn(async move { stream_chat(&url, &p, max_tokens).await })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

fn prompts(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("Tell me story number {i}, please."))
        .collect()
}

/// Requests sent back to back by `workers` tasks until `stop`; (ok, failures).
async fn load(
    url: String,
    workers: usize,
    stop: tokio::sync::watch::Receiver<bool>,
) -> (usize, Vec<String>) {
    let tasks: Vec<_> = (0..workers)
        .map(|w| {
            let (url, stop) = (url.clone(), stop.clone());
            tokio::spawn(async move {
                let (mut ok, mut failed) = (0, Vec::new());
                let mut i = 0;
                while !*stop.borrow() {
                    match stream_chat(
                        &url,
                        &format!("load {w} {i} {}", "word ".repeat(i % 40)),
                        16,
                    )
                    .await
                    {
                        Ok(_) => ok += 1,
                        Err(e) => failed.push(e),
                    }
                    i += 1;
                }
                (ok, failed)
            })
        })
        .collect();
    let (mut ok, mut failed) = (0, Vec::new());
    for t in tasks {
        let (o, f) = t.await.unwrap();
        ok += o;
        failed.extend(f);
    }
    (ok, failed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_process_graph_serves_and_a_killed_worker_leaves_within_its_ttl() {
    let Some(c) = Cluster::up(AGG, 2, &["--set", "decode.mocker.speedup=20"]) else {
        return;
    };
    let url = format!("http://{}", c.g.addr);
    let (text, n) = stream_chat(&url, "Hello!", 8).await.unwrap();
    assert_eq!(n, 8);
    assert!(!text.is_empty());

    // `ps`: three supervised processes, and every node's instances in etcd.
    let ps = c.ps();
    let procs = ps["runs"][0]["processes"].as_array().unwrap();
    assert_eq!(procs.len(), 3, "{ps}");
    assert!(procs.iter().all(|p| p["status"] == "running"), "{ps}");
    for node in ["preprocess", "route", "decode", "postprocess"] {
        assert!(!c.instances(node).is_empty(), "{node} registered: {ps}");
    }
    // What late joiners need is in the records: the model, and the engine's block size.
    let decode = ps["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["component"] == "decode")
        .unwrap();
    assert_eq!(decode["metadata"]["model"], "tiny", "{decode}");
    assert_eq!(decode["metadata"]["block_size"], 16, "{decode}");
    assert_eq!(decode["metadata"]["kind"], "decode", "{decode}");

    // SIGKILL one worker: its key leaves etcd when its lease expires (TTL 2 s, + 1 s for
    // etcd's sweep on an idle machine). The bound only ends a hang: a key that outlived its
    // process would stay for good.
    let before = c.instances("decode");
    signal(c.pid("decode", 1), "-KILL");
    let killed_at = Instant::now();
    let dead = loop {
        let now = c.instances("decode");
        if let Some(gone) = before.iter().find(|id| !now.contains(id)) {
            break gone.clone();
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(60),
            "the SIGKILLed worker is still registered 60 s later: {now:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!("the dead worker left after {:?}", killed_at.elapsed());

    // Nothing is routed to it afterwards, and every request succeeds.
    let mark = c.g.logs().len();
    for r in stream_all(&url, &prompts(20), 4).await {
        r.unwrap();
    }
    let routed_to_dead = dyn_tests::process_logs(&c.g.logs()[mark..], "frontend.0")
        .iter()
        .filter(|l| l["message"] == "Routed" && l["worker_id"] == dead.as_str())
        .count();
    assert_eq!(routed_to_dead, 0);
    // The supervisor restarted the process: two workers again.
    c.wait_for(
        |c| c.instances("decode").len() == 2,
        "the killed worker is restarted",
    );

    // Another "machine" joins with `--only decode`: two more workers, then it leaves.
    let mut joined = dyn_cmd()
        .args(["graph", "up", AGG, "--only", "decode", "--lease-ttl", "2"])
        .args(["--control", &format!("etcd://{}", c.etcd.address())])
        .args(["--events", &format!("nats://{}", c.nats.address())])
        .args(["--set", "decode.mocker.speedup=20"])
        .env("DYN_RUN_DIR", &c.run_dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    c.wait_for(
        |c| c.instances("decode").len() == 4,
        "the joining workers register",
    );
    for r in stream_all(&url, &prompts(8), 4).await {
        r.unwrap();
    }
    assert_eq!(
        c.ps()["runs"].as_array().unwrap().len(),
        2,
        "two runs on this machine"
    );
    signal(joined.id(), "-TERM");
    assert!(joined.wait().unwrap().success());
    c.wait_for(
        |c| c.instances("decode").len() == 2,
        "the joined workers leave",
    );
}

/// `n` streams of 48 tokens on two slow workers, with `hit` done to worker process decode.1
/// once they are under way; each must equal its run without the hit. The frontend's
/// migration log lines after.
async fn streams_through(c: &Cluster, n: usize, hit: impl FnOnce(u32)) -> Vec<Value> {
    let url = format!("http://{}", c.g.addr);
    let prompts = prompts(n);
    // The mocker's output is a function of the prompt: the expected streams.
    let t0 = Instant::now();
    let expected: Vec<_> = stream_all(&url, &prompts, 48)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(expected.iter().all(|(_, n)| *n == 48));
    eprintln!("{n} streams took {:?}", t0.elapsed());
    let first_tokens = |c: &Cluster| {
        dyn_tests::metric(
            &c.g.get("/metrics"),
            &["dyn_frontend_time_to_first_token_seconds_count"],
        )
    };
    let before = first_tokens(c);
    let run = tokio::spawn({
        let (url, prompts) = (url.clone(), prompts.clone());
        async move { stream_all(&url, &prompts, 48).await }
    });
    // Under way: every stream has had its first token (a fixed pause is not enough on a
    // loaded machine, where some would not have reached a worker yet).
    let deadline = Instant::now() + Duration::from_secs(60);
    while first_tokens(c) < before + n as u64 {
        assert!(
            Instant::now() < deadline,
            "the {n} streams were not all under way after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    hit(c.pid("decode", 1));
    let hit_at = Instant::now();
    let got = run.await.unwrap();
    eprintln!("streams done {:?} after the hit", hit_at.elapsed());
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(g.as_ref().unwrap(), e, "stream {i}");
    }
    c.frontend_logs()
        .into_iter()
        .filter(|l| l["message"] == "Replica lost; migrating the request")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_survive_a_worker_killed_mid_stream() {
    let Some(c) = Cluster::up(AGG, 2, &["--set", "decode.mocker.speedup=0.25"]) else {
        return;
    };
    let migrated = streams_through(&c, 64, |pid| signal(pid, "-KILL")).await;
    assert!(!migrated.is_empty(), "some streams were cut and migrated");
    eprintln!("{} requests migrated", migrated.len());
}

/// A worker frozen mid-stream (SIGSTOP: what a host that lost power looks like from the other
/// end, connections established and silent) is given up after the request plane's silence
/// bound, and its streams migrate and finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_migrate_off_a_frozen_worker_within_the_heartbeat_bound() {
    let Some(c) = Cluster::up(AGG, 2, &["--set", "decode.mocker.speedup=0.25"]) else {
        return;
    };
    let frozen = c.pid("decode", 1);
    let migrated = streams_through(&c, 32, |pid| signal(pid, "-STOP")).await;
    signal(frozen, "-CONT");
    let lost = migrated
        .iter()
        .filter(|l| l.to_string().contains("nothing heard"))
        .count();
    assert!(
        lost > 0,
        "streams on the frozen worker were given up and migrated"
    );
    eprintln!("{lost} requests migrated off the frozen worker");
}

/// etcd with authentication and NATS with a user: `dyn graph up` says which credentials are
/// missing and exits; with them in the environment the graph serves, and no process's
/// command line holds a password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_and_nats_credentials_come_from_the_environment() {
    if test_server("DYN_TEST_ETCD").is_none() {
        return;
    }
    let (Some(etcd), Some(nats)) = (
        Server::etcd_with_auth("root", "etcd-secret-pw"),
        Server::nats_with_user("dyn", "nats-secret-pw"),
    ) else {
        dyn_tests::skip("etcd or nats-server is not on PATH");
        return;
    };
    let control = format!("etcd://{}", etcd.address());
    let events = format!("nats://{}", nats.address());
    let dir = scratch_dir(&format!("run-auth-{}", etcd.address().replace(':', "-")));
    let etcd_creds = [
        ("ETCD_AUTH_USERNAME", "root"),
        ("ETCD_AUTH_PASSWORD", "etcd-secret-pw"),
    ];
    let nats_creds = [
        ("NATS_AUTH_USERNAME", "dyn"),
        ("NATS_AUTH_PASSWORD", "nats-secret-pw"),
    ];
    let refused = |env: &[(&str, &str)]| {
        let out = std::process::Command::new("timeout")
            .arg("60")
            .arg(dyn_tests::dyn_bin())
            .args([
                "graph",
                "up",
                AGG,
                "--control",
                &control,
                "--events",
                &events,
            ])
            .current_dir(dyn_tests::root())
            .env("DYN_RUN_DIR", &dir)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = refused(&[]);
    assert!(
        e.contains("set ETCD_AUTH_USERNAME and ETCD_AUTH_PASSWORD"),
        "{e}"
    );
    let e = refused(&etcd_creds);
    assert!(e.contains("NATS wants credentials"), "{e}");
    let mut env: Vec<(&str, &str)> = vec![
        ("DYN_RUN_DIR", dir.to_str().unwrap()),
        ("DYN_CLUSTER_TOKEN", CLUSTER_TOKEN),
    ];
    env.extend(etcd_creds);
    env.extend(nats_creds);
    let g = Graph::start(
        AGG,
        "http",
        &[
            "--control",
            &control,
            "--events",
            &events,
            "--lease-ttl",
            "2",
        ],
        &env,
    );
    let url = format!("http://{}", g.addr);
    let mut served = Err(String::new());
    for _ in 0..300 {
        served = stream_chat(&url, "hello", 4).await;
        if served.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(served.unwrap().1, 4);
    let mut seen = 0;
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline);
        // dyn's processes (the test's nats-server has its password on its own).
        if !cmdline.contains("graph\0up") || !cmdline.contains(&control) {
            continue;
        }
        seen += 1;
        for secret in ["etcd-secret-pw", "nats-secret-pw", CLUSTER_TOKEN] {
            assert!(!cmdline.contains(secret), "{:?}: {cmdline}", entry.path());
        }
    }
    assert!(seen >= 3, "the supervisor and its processes: {seen}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serving_goes_on_through_nats_and_etcd_restarts() {
    let Some(mut c) = Cluster::up(AGG_KV, 4, &["--set", "decode.mocker.speedup=20"]) else {
        return;
    };
    let url = format!("http://{}", c.g.addr);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(load(url.clone(), 4, stop_rx));
    tokio::time::sleep(Duration::from_millis(500)).await;

    // NATS down for 2 s: the router routes on its own decisions, then resyncs the index.
    c.nats.kill();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(c.nats.start());
    c.wait_for(
        |c| {
            c.frontend_logs().iter().any(|l| {
                l["message"] == "Event plane is back; resyncing the KV index from every worker"
            })
        },
        "the router resyncs after NATS returns",
    );
    // etcd down and back: the frontend keeps its worker list meanwhile, and registrations
    // come back.
    c.etcd.kill();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(c.etcd.start());
    c.wait_for(
        |c| c.instances("decode").len() == 4,
        "registrations come back",
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop_tx.send(true).unwrap();
    let (ok, failed) = running.await.unwrap();
    assert!(
        failed.is_empty(),
        "{} of {} failed: {:?}",
        failed.len(),
        ok + failed.len(),
        &failed[..failed.len().min(3)]
    );
    assert!(ok > 20, "{ok} requests");

    // The index holds blocks again, from the workers' dumps and events.
    let kv = dyn_tests::inspect_json(&url, &["kv"]);
    assert!(
        kv["replicas"][0]["stored_blocks"].as_u64().unwrap_or(0) > 0,
        "{kv}"
    );
    eprintln!("{ok} requests through both restarts");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_without_losing_a_request() {
    let Some(c) = Cluster::up(AGG, 2, &["--set", "decode.mocker.speedup=0.25"]) else {
        return;
    };
    let url = format!("http://{}", c.g.addr);
    let prompts = prompts(16);

    // A worker told to stop finishes what it has; new requests go to the other one.
    let run = tokio::spawn({
        let (url, prompts) = (url.clone(), prompts.clone());
        async move { stream_all(&url, &prompts, 48).await }
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    signal(c.pid("decode", 0), "-TERM");
    for r in run.await.unwrap() {
        assert_eq!(r.unwrap().1, 48);
    }

    // The whole graph: `dyn graph down` while streams run; /health says 503 meanwhile.
    c.wait_for(
        |c| c.instances("decode").len() == 2,
        "the stopped worker is restarted",
    );
    let run = tokio::spawn({
        let (url, prompts) = (url.clone(), prompts.clone());
        async move { stream_all(&url, &prompts, 48).await }
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    let file = c.file;
    let run_dir = c.run_dir.clone();
    let down = std::thread::spawn(move || {
        dyn_cmd()
            .args(["graph", "down", file])
            .env("DYN_RUN_DIR", run_dir)
            .output()
            .unwrap()
    });
    let health = format!("{url}/health");
    let mut saw_503 = false;
    for _ in 0..100 {
        match reqwest::get(&health).await {
            Ok(r) if r.status() == 503 => {
                saw_503 = true;
                break;
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            Err(_) => break,
        }
    }
    for r in run.await.unwrap() {
        assert_eq!(r.unwrap().1, 48);
    }
    assert!(saw_503, "/health answered 503 while draining");
    let down = down.join().unwrap();
    assert!(
        down.status.success(),
        "{}{}\nlogs:\n{}",
        String::from_utf8_lossy(&down.stdout),
        String::from_utf8_lossy(&down.stderr),
        c.g.logs().join("\n")
    );
    assert_eq!(c.g.wait(Duration::from_secs(30)), Some(0));
}

const DISAGG: &str = "graphs/disagg.yaml";

/// Log lines of every replica of process group `process` whose message contains `text`.
fn logged(c: &Cluster, process: &str, replicas: u64, text: &str) -> usize {
    (0..replicas)
        .flat_map(|r| dyn_tests::process_logs(&c.g.logs(), &format!("{process}.{r}")))
        .filter(|v| v["message"].as_str().is_some_and(|m| m.contains(text)))
        .count()
}

impl Cluster {
    /// Up, and the frontend sees the prefill worker (a long prompt is prefilled remotely).
    fn disagg(extra: &[&str]) -> Option<Cluster> {
        Self::disagg_graph(DISAGG, 2, extra)
    }

    fn disagg_graph(file: &'static str, decode: usize, extra: &[&str]) -> Option<Cluster> {
        let c = Cluster::up(file, decode, extra)?;
        let url = format!("http://{}", c.g.addr);
        c.wait_for(
            |_| {
                let out = dyn_tests::run(&[
                    "inspect",
                    "--url",
                    &url,
                    "--node",
                    "remote_prefill",
                    "--json",
                    "workers",
                ]);
                serde_json::from_slice::<Value>(&out.stdout).is_ok_and(|v| {
                    v["replicas"][0]["workers"]
                        .as_array()
                        .is_some_and(|w| w.len() == 1)
                })
            },
            "the frontend sees the prefill worker",
        );
        Some(c)
    }

    fn remote_decisions(&self) -> u64 {
        metric(
            &self.g.get("/metrics"),
            &["dyn_remote_prefill_decisions_total", "decision=\"remote\""],
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_across_processes_long_prompts_go_remote_short_stay_local() {
    // A queue limit no burst reaches: every long prompt must go remote.
    let Some(c) = Cluster::disagg(&[
        "--set",
        "decode.config.mocker.speedup=10",
        "--set",
        "prefill.config.mocker.speedup=10",
        "--set",
        "remote_prefill.max_queue=1000",
    ]) else {
        return;
    };
    let url = format!("http://{}", c.g.addr);
    let mut prompts: Vec<String> = (0..8).map(long_prompt).collect();
    prompts.extend((0..8).map(|i| format!("short question {i}")));
    let results = stream_all(&url, &prompts, 16).await;
    for (p, r) in prompts.iter().zip(&results) {
        let (_, n) = r.as_ref().unwrap_or_else(|e| panic!("{p:.40}: {e}"));
        assert_eq!(*n, 16);
    }
    let m = c.g.get("/metrics");
    assert_eq!(c.remote_decisions(), 8, "{m}");
    assert!(
        metric(
            &m,
            &[
                "dyn_remote_prefill_decisions_total",
                "reason=\"below_threshold\""
            ]
        ) >= 8,
        "{m}"
    );
    // The KV crossed processes: each decode worker pulled from the prefill process's agent.
    assert_eq!(logged(&c, "decode", 2, "KV transfer failed"), 0);
    assert_eq!(logged(&c, "frontend", 1, "Prefilled remotely"), 8);
    // The same prompts again, one at a time (so load does not outweigh the cache): each goes
    // to the decode worker caching it and is prefilled there, with the same answer.
    for (p, r) in prompts.iter().zip(&results) {
        assert_eq!(&stream_chat(&url, p, 16).await, r);
    }
    assert_eq!(c.remote_decisions(), 8);
}

/// Frames as a caller writes them by hand: a header naming `instance`, one item, the end.
fn hand_written_call(instance: u64) -> Vec<u8> {
    let mut out = Vec::new();
    let header = json!({"instance_id": instance, "request_id": "intruder-1"}).to_string();
    let item = json!({"model": "x", "token_ids": [1, 2, 3]}).to_string();
    for (tag, body) in [
        (b'H', header.as_bytes()),
        (b'I', item.as_bytes()),
        (b'E', &[][..]),
    ] {
        out.extend_from_slice(&(body.len() as u32 + 1).to_be_bytes());
        out.push(tag);
        out.extend_from_slice(body);
    }
    out
}

/// The request-plane address and instance id of the first decode worker `dyn graph ps` lists.
fn first_decode(ps: &Value) -> (String, u64) {
    let decode = ps["instances"]
        .as_array()
        .and_then(|a| a.iter().find(|i| i["component"] == "decode"))
        .unwrap_or_else(|| panic!("no decode instance in {ps}"));
    (
        decode["transport"]["address"].as_str().unwrap().to_owned(),
        decode["instance_id"].as_u64().unwrap(),
    )
}

/// Writes `bytes` to `address` and reads until the other side closes: what came back.
/// A TLS listener answers garbage with at most an alert record (content type 21), never a frame.
async fn knock(address: &str, bytes: &[u8]) -> Vec<u8> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(address).await.unwrap();
    let _ = s.write_all(bytes).await;
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got)).await;
    assert!(read.is_ok(), "{address} kept the connection open");
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_without_the_cluster_identity_gets_no_work_done_and_no_kv() {
    let keys = format!("http.api_keys=[{API_KEY}]");
    let Some(c) = Cluster::disagg(&["--set", "remote_prefill.max_queue=1000", "--set", &keys])
    else {
        return;
    };
    // Secrets stay off every command line: the cluster token is in the environment, and the
    // supervisor hands `--set` (an API key here) to its processes the same way.
    let ps = c.ps();
    let mut pids: Vec<u32> = ps["runs"][0]["processes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["pid"].as_u64().map(|p| p as u32))
        .collect();
    pids.push(c.g.pid());
    assert!(pids.len() >= 4, "{ps}");
    for pid in pids {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        assert!(cmdline.contains("graph up"), "{cmdline}");
        if pid != c.g.pid() {
            assert!(!cmdline.contains(API_KEY), "{pid}: {cmdline}");
        }
        assert!(!cmdline.contains(CLUSTER_TOKEN), "{pid}: {cmdline}");
    }
    let url = format!("http://{}", c.g.addr);
    // A long prompt goes remote: an offer exists on the prefill worker's agent meanwhile.
    let (_, n) = stream_chat(&url, &long_prompt(7), 8).await.unwrap();
    assert_eq!(n, 8);
    let (address, id) = first_decode(&c.ps());
    // Plain TCP, frames by hand: closed, nothing back.
    let got = knock(&address, &hand_written_call(id)).await;
    assert!(got.is_empty() || got[0] == 21, "{got:?}");
    // TLS with another token: refused in the handshake's proof.
    let stranger = dyn_trust::Trust::from_secrets(dyn_trust::Secrets {
        token: Some(b"a-token-of-another-cluster".to_vec()),
        ca: None,
    })
    .unwrap();
    let tcp = tokio::net::TcpStream::connect(&address).await.unwrap();
    let e = stranger.connect(tcp, "127.0.0.1").await.err().unwrap();
    assert!(e.to_string().contains("not of this cluster"), "{e}");
    // The KV transfer agent: a pull of a guessed offer, by hand, is closed unanswered.
    let agents: Vec<String> = dyn_tests::process_logs(&c.g.logs(), "prefill.0")
        .iter()
        .filter(|v| v["message"] == "KV transfer agent listening")
        .filter_map(|v| v["agent"].as_str().map(str::to_owned))
        .collect();
    let agent = agents[0].strip_prefix("tcp://").unwrap().to_owned();
    let pull = json!({"id": format!("{:032x}", 1), "puller": id}).to_string();
    let mut frame = (pull.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(pull.as_bytes());
    let got = knock(&agent, &frame).await;
    assert!(got.is_empty() || got[0] == 21, "{got:?}");
    // Nothing was served: no process saw the intruder's request; each refusal was logged.
    assert!(!c.g.logs().iter().any(|l| l.contains("intruder-1")));
    dyn_tests::until("both refusals at the decode worker are logged", || {
        logged(&c, "decode", 2, "Request plane: connection refused") >= 2
    })
    .await;
    dyn_tests::until("the refusal at the agent is logged", || {
        logged(&c, "prefill", 1, "KV transfer: connection refused") >= 1
    })
    .await;
    // Members go on as before, over TLS: remote prefills pull their KV.
    let before = logged(&c, "frontend", 1, "Prefilled remotely");
    let (_, n) = stream_chat(&url, &long_prompt(8), 8).await.unwrap();
    assert_eq!(n, 8);
    assert_eq!(logged(&c, "decode", 2, "KV transfer failed"), 0);
    assert_eq!(logged(&c, "frontend", 1, "Prefilled remotely"), before + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_killed_mid_transfer_leaves_requests_to_local_prefill() {
    // A slow link (~2.5 s per prompt's KV) leaves time to kill the prefill worker while the
    // decode workers wait for their transfers.
    let Some(c) = Cluster::disagg(&[
        "--set",
        "decode.config.mocker.transfer_gbps=0.05",
        "--set",
        "remote_prefill.max_queue=1000",
    ]) else {
        return;
    };
    let url = format!("http://{}", c.g.addr);
    let prompts: Vec<String> = (0..4).map(|i| long_prompt(100 + i)).collect();
    let sent = {
        let (url, prompts) = (url.clone(), prompts.clone());
        tokio::spawn(async move { stream_all(&url, &prompts, 8).await })
    };
    c.wait_for(
        |c| logged(c, "frontend", 1, "Prefilled remotely") == 4,
        "all four prompts are prefilled and their transfers start",
    );
    signal(c.pid("prefill", 0), "-KILL");
    let results = sent.await.unwrap();
    for r in &results {
        assert_eq!(r.as_ref().unwrap().1, 8, "{r:?}");
    }
    assert_eq!(
        logged(&c, "decode", 2, "KV transfer failed; prefilling locally"),
        4
    );
    // Recomputed locally, the answers are the ones a fresh run gives.
    let again = stream_all(&url, &prompts, 8).await;
    assert_eq!(results, again);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_kv_crosses_processes_and_greedy_output_equals_one_process() {
    let Some(c) = Cluster::disagg_graph("graphs/disagg_native.yaml", 1, &[]) else {
        return;
    };
    let agg = Graph::up_with_ingress("graphs/agg_native.yaml", "http", &[]);
    let url = format!("http://{}", c.g.addr);
    for i in 0..4 {
        let p = long_prompt(200 + i);
        let got = greedy_text(&url, &p).await;
        assert_eq!(got, greedy_text(&agg.url(""), &p).await, "prompt {i}");
    }
    assert_eq!(c.remote_decisions(), 4);
    // Real KV blocks (f32, the CPU backend's layout) went through UCX (`planes.transfer:
    // auto`, and UCX starts here): one-sided reads, cross-memory attach on one machine.
    assert_eq!(logged(&c, "decode", 1, "KV transfer failed"), 0);
    assert_eq!(logged(&c, "decode", 1, "first blocks pulled over ucx"), 1);
    assert_eq!(logged(&c, "decode", 1, "first blocks pulled over tcp"), 0);
    assert_eq!(logged(&c, "decode", 1, "the UCX read failed"), 0);
    assert_eq!(logged(&c, "frontend", 1, "Prefilled remotely"), 4);
    // `dyn inspect` shows each worker's wire, as it registered.
    assert_eq!(transfer_wires(&url), ["ucx", "ucx"]);

    // The prefill process killed under load: every stream finishes, with the answer one
    // process gives (its prompt prefilled locally where the transfer failed).
    let prompts: Vec<String> = (0..6).map(|i| long_prompt(300 + i)).collect();
    let agg_url = agg.url("");
    let want = futures::future::join_all(prompts.iter().map(|p| greedy_text(&agg_url, p))).await;
    let got = tokio::spawn({
        let (url, prompts) = (url.clone(), prompts.clone());
        async move { futures::future::join_all(prompts.iter().map(|p| greedy_text(&url, p))).await }
    });
    c.wait_for(
        |c| logged(c, "frontend", 1, "Prefilled remotely") > 4,
        "a prompt of the load is prefilled remotely",
    );
    signal(c.pid("prefill", 0), "-KILL");
    assert_eq!(got.await.unwrap(), want);
}

/// `planes.transfer: tcp`: the same answers, the blocks streamed over the TCP agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_kv_goes_over_tcp_when_the_graph_says_so() {
    let Some(c) = Cluster::disagg_graph(
        "graphs/disagg_native.yaml",
        1,
        &["--set", "planes.transfer=tcp"],
    ) else {
        return;
    };
    let agg = Graph::up_with_ingress("graphs/agg_native.yaml", "http", &[]);
    let url = format!("http://{}", c.g.addr);
    for i in 0..2 {
        let p = long_prompt(200 + i);
        assert_eq!(
            greedy_text(&url, &p).await,
            greedy_text(&agg.url(""), &p).await
        );
    }
    assert_eq!(c.remote_decisions(), 2);
    assert_eq!(logged(&c, "decode", 1, "first blocks pulled over tcp"), 1);
    assert_eq!(logged(&c, "decode", 1, "first blocks pulled over ucx"), 0);
    assert_eq!(transfer_wires(&url), ["tcp", "tcp"]);
}

/// A prefill process whose UCX does not start (`UCX_TLS` names no transport UCX has): with
/// `planes.transfer: auto` it says so and serves its offers over TCP, and the decode worker,
/// which has UCX, gets them streamed — the same answers, no failed transfer, no fallback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_process_without_ucx_serves_its_kv_over_tcp() {
    let Some((c, prefill, log)) = disagg_with_prefill_apart(&[("UCX_TLS", "no-such-transport")])
    else {
        return;
    };
    answers_equal_one_process(&c, 400, 2).await;
    let url = format!("http://{}", c.g.addr);
    assert_eq!(c.remote_decisions(), 2);
    assert_eq!(transfer_wires(&url), ["ucx", "tcp"]);
    assert_eq!(logged(&c, "decode", 1, "first blocks pulled over tcp"), 1);
    assert_eq!(logged(&c, "decode", 1, "KV transfer failed"), 0);
    assert_eq!(logged(&c, "decode", 1, "the UCX read failed"), 0);
    prefill.stop();
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(
        said.contains("UCX did not start; KV transfers go over TCP"),
        "{said}"
    );
}

/// A prefill process whose UCX the decode worker's cannot reach (`UCX_TLS=self,cma` there:
/// no transport to set an endpoint up over): each pull's UCX read fails, the blocks come over
/// TCP on the same connection, and the fallback is counted and said once — the same answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_ucx_read_falls_back_to_tcp_across_processes() {
    let Some((c, prefill, log)) = disagg_with_prefill_apart(&[("UCX_TLS", "self,cma")]) else {
        return;
    };
    answers_equal_one_process(&c, 500, 2).await;
    assert_eq!(c.remote_decisions(), 2);
    prefill.stop();
    // The prefill side's UCX started (it is the reads that fail, not its agent).
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(said.contains("\"wire\":\"ucx\""), "{said}");
    for l in dyn_tests::process_logs(&c.g.logs(), "decode.0") {
        if l["message"]
            .as_str()
            .is_some_and(|m| m.contains("said once"))
        {
            eprintln!("the fallback's reason: {}", l["reason"]);
        }
    }
    assert_eq!(
        logged(&c, "decode", 1, "the blocks came over TCP (said once)"),
        1
    );
    assert_eq!(logged(&c, "decode", 1, "first blocks pulled over tcp"), 1);
    assert_eq!(logged(&c, "decode", 1, "KV transfer failed"), 0);
}

/// `graphs/disagg_native.yaml` across processes, its prefill worker in a process of its own
/// started apart with `env` (its log in the returned file), once the frontend sees it.
fn disagg_with_prefill_apart(env: &[(&str, &str)]) -> Option<(Cluster, Apart, PathBuf)> {
    let only = "http,preprocess,route,remote_prefill,decode,postprocess";
    let c = Cluster::up("graphs/disagg_native.yaml", 1, &["--only", only])?;
    let dir = scratch_dir(&format!("run-p-{}", c.etcd.address().replace(':', "-")));
    let log = dir.join("prefill.log");
    let prefill = dyn_cmd()
        .args([
            "--log-format",
            "json",
            "graph",
            "up",
            "graphs/disagg_native.yaml",
        ])
        .args(["--only", "prefill", "--lease-ttl", "2"])
        .args(["--control", &format!("etcd://{}", c.etcd.address())])
        .args(["--events", &format!("nats://{}", c.nats.address())])
        .env("DYN_RUN_DIR", &dir)
        .env("DYN_CLUSTER_TOKEN", CLUSTER_TOKEN)
        .env("RUST_LOG", "info")
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let url = format!("http://{}", c.g.addr);
    c.wait_for(
        |_| {
            let v = dyn_tests::inspect_json(&url, &["--node", "remote_prefill", "workers"]);
            v["replicas"][0]["workers"]
                .as_array()
                .is_some_and(|w| w.len() == 1)
        },
        "the frontend sees the prefill worker",
    );
    Some((c, Apart(Some(prefill)), log))
}

/// A `dyn graph up` started apart from the cluster's: killed if the test fails before it
/// stops it.
struct Apart(Option<std::process::Child>);

impl Apart {
    /// SIGTERM, and a clean exit (its drain) within 60 s.
    fn stop(mut self) {
        let mut child = self.0.take().unwrap();
        signal(child.id(), "-TERM");
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("the process started apart did not exit within 60 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(
            status.success(),
            "the process started apart exited {status}"
        );
    }
}

impl Drop for Apart {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Greedy answers to `n` long prompts (from `seed` on) through the cluster equal those of
/// `graphs/agg_native.yaml` in one process.
async fn answers_equal_one_process(c: &Cluster, seed: usize, n: usize) {
    let url = format!("http://{}", c.g.addr);
    let agg = Graph::up_with_ingress("graphs/agg_native.yaml", "http", &[]);
    for i in 0..n {
        let p = long_prompt(seed + i);
        let got = greedy_text(&url, &p).await;
        assert_eq!(got, greedy_text(&agg.url(""), &p).await, "prompt {i}");
    }
}

/// A completion's text at temperature 0 (10 tokens, eos ignored).
async fn greedy_text(url: &str, prompt: &str) -> String {
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 10,
                      "temperature": 0, "ignore_eos": true});
    let (status, v) = dyn_tests::completion(url, &body).await;
    assert_eq!(status, 200, "{v}");
    v["choices"][0]["text"].to_string()
}

/// The transfer wire of the decode worker (behind `route`) and of the prefill worker (behind
/// `remote_prefill`), as `dyn inspect workers` shows them.
fn transfer_wires(url: &str) -> Vec<String> {
    ["route", "remote_prefill"]
        .iter()
        .map(|node| {
            let v = dyn_tests::inspect_json(url, &["--node", node, "workers"]);
            v["replicas"][0]["workers"][0]["transfer"]
                .as_str()
                .unwrap_or_else(|| panic!("{node}: {v}"))
                .to_owned()
        })
        .collect()
}

/// The workers the router behind `url` sees live.
fn live_workers(url: &str) -> usize {
    dyn_tests::inspect_json(url, &["workers"])["replicas"][0]["workers"]
        .as_array()
        .map_or(0, |w| w.iter().filter(|w| w["live"] == true).count())
}

/// A second frontend process (http, preprocess, route, postprocess) on the cluster's planes,
/// with `extra` settings.
fn second_frontend(c: &Cluster, extra: &[&str]) -> Graph {
    let control = format!("etcd://{}", c.etcd.address());
    let events = format!("nats://{}", c.nats.address());
    let dir = scratch_dir(&format!("run-b-{}", c.etcd.address().replace(':', "-")));
    let mut args = vec![
        "--control",
        &control,
        "--events",
        &events,
        "--only",
        "http,preprocess,route,postprocess",
        "--lease-ttl",
        "2",
    ];
    args.extend_from_slice(extra);
    Graph::start(
        c.file,
        "http",
        &args,
        &[
            ("DYN_RUN_DIR", &dir.display().to_string()),
            ("DYN_CLUSTER_TOKEN", CLUSTER_TOKEN),
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_frontends_route_on_one_view_of_the_workers() {
    let Some(c) = Cluster::up(AGG_KV, 4, &["--set", "decode.mocker.speedup=20"]) else {
        return;
    };
    let b = second_frontend(&c, &[]);
    let (url_a, url_b) = (format!("http://{}", c.g.addr), format!("http://{}", b.addr));
    c.wait_for(
        |_| live_workers(&url_b) == 4,
        "the second router sees the 4 workers",
    );

    // Prompts served through frontend A are cached on their workers; router B, which never
    // saw them, routes them to the same workers from the shared KV events, and both routers
    // explain the same choice.
    for i in 0..4 {
        let prompt = long_prompt(100 + i);
        let (status, _) = dyn_tests::completion(
            &url_a,
            &json!({"model": "tiny", "prompt": prompt, "max_tokens": 2}),
        )
        .await;
        assert_eq!(status, 200);
        let route = |url: &str| dyn_tests::inspect_json(url, &["route", "--prompt", &prompt]);
        let cached = |r: &Value| {
            let worker = r["replicas"][0]["worker_id"].clone();
            let c = r["replicas"][0]["candidates"]
                .as_array()
                .and_then(|c| c.iter().find(|c| c["worker_id"] == worker).cloned())
                .unwrap_or_default();
            (worker, c["indexed_blocks"].as_u64().unwrap_or(0))
        };
        c.wait_for(
            |_| cached(&route(&url_b)).1 > 0,
            "router B's index holds the prompt served through A",
        );
        let (a, b) = (cached(&route(&url_a)), cached(&route(&url_b)));
        assert_eq!(a, b, "both routers choose the worker caching prompt {i}");
    }

    // Both frontends under load at once: nothing fails, and each router's load view counts
    // the other's requests (the workers' reported running + waiting).
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let la = tokio::spawn(load(url_a.clone(), 4, stop_rx.clone()));
    let lb = tokio::spawn(load(url_b.clone(), 4, stop_rx));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let reported = |url: &str| -> u64 {
        dyn_tests::inspect_json(url, &["workers"])["replicas"][0]["workers"]
            .as_array()
            .map_or(0, |w| {
                w.iter()
                    .map(|w| {
                        w["requests_running"].as_u64().unwrap_or(0)
                            + w["requests_waiting"].as_u64().unwrap_or(0)
                    })
                    .sum()
            })
    };
    let own = |url: &str| -> u64 {
        dyn_tests::inspect_json(url, &["workers"])["replicas"][0]["workers"]
            .as_array()
            .map_or(0, |w| {
                w.iter().filter_map(|w| w["active_requests"].as_u64()).sum()
            })
    };
    c.wait_for(
        |_| reported(&url_b) > own(&url_b),
        "router B sees more requests on the workers than its own",
    );
    stop_tx.send(true).unwrap();
    for l in [la, lb] {
        let (ok, failed) = l.await.unwrap();
        assert!(failed.is_empty(), "{failed:?}");
        assert!(ok > 0);
    }
}

/// The SLA planner over processes: an open-loop ramp (4 → 40 req/s over 40 s, held, then
/// down to 3 req/s) makes the decode processes grow and TTFT p90 come back under its target
/// while the load is held; the drop makes them shrink, and no request fails throughout
/// (a scaled-down process deregisters, drains, stops).
#[tokio::test(flavor = "multi_thread")]
async fn the_planner_grows_decode_with_a_ramp_and_shrinks_it_after_without_a_failure() {
    let Some(c) = Cluster::up(
        "graphs/planner.yaml",
        1,
        &[
            "--set",
            "planner.interval_s=3",
            "--set",
            "planner.cooldown_s=9",
        ],
    ) else {
        return;
    };
    let dir = scratch_dir("planner-ramp");
    let url = format!("http://{}", c.g.addr);
    let out = tokio::task::spawn_blocking({
        let dir = dir.clone();
        move || {
            dyn_cmd()
                .args(["bench", "--url", &url, "--no-progress", "--planner"])
                .args(["--request-rate", "0:4,40:40,70:40,72:3"])
                .args(["--duration", "110", "--isl", "256", "--osl", "64"])
                .args(["--slo", "ttft_ms=300", "--output", dir.to_str().unwrap()])
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["requests"]["failed"], 0, "{stdout}");
    // Replicas over the run, from the planner's decisions as the frontend served them.
    let planner = std::fs::read_to_string(dir.join("planner.csv")).unwrap();
    let actual: Vec<(f64, u64)> = planner
        .lines()
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            (f[0].parse().unwrap(), f[3].parse().unwrap())
        })
        .collect();
    let peak = actual.iter().map(|a| a.1).max().unwrap();
    let peak_at = actual.iter().find(|a| a.1 == peak).unwrap().0;
    let last = actual.last().unwrap().1;
    assert!(peak >= 3, "decode grew with the ramp: {actual:?}");
    assert!(last < peak, "and shrank after the drop: {actual:?}");
    assert!(dir.join("timeline.png").exists() && dir.join("timeline.svg").exists());
    // TTFT p90 of the requests sent while the load was held (50–70 s) is under the target.
    let text = std::fs::read_to_string(dir.join("requests.csv")).unwrap();
    let mut held: Vec<f64> = text
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            let at: f64 = f[1].parse().ok()?;
            ((50_000.0..70_000.0).contains(&at)).then(|| f[5].parse().ok())?
        })
        .collect();
    held.sort_by(f64::total_cmp);
    let p90 = held[(held.len() * 9 / 10).min(held.len() - 1)];
    assert!(
        p90 < 300.0,
        "TTFT p90 {p90} ms while held (peak {peak} replicas at {peak_at:.0} s): {actual:?}"
    );
    // What was stopped left discovery: the registered decode instances are what the planner
    // says runs now.
    let mut registered = 0;
    for _ in 0..50 {
        registered = c.instances("decode").len() as u64;
        let now = inspect_planner(&c);
        if registered == now {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(registered, inspect_planner(&c));
}

/// `dyn inspect planner --json`: the decode node's actual replicas.
fn inspect_planner(c: &Cluster) -> u64 {
    let v = dyn_tests::inspect_json(&format!("http://{}", c.g.addr), &["planner"]);
    assert_eq!(v["connector"], "processes", "{v}");
    assert!(v["observed"]["request_rate"].is_number(), "{v}");
    v["nodes"][0]["actual"].as_u64().unwrap()
}

/// Two frontends, each with its router, on real etcd and NATS: a session bound through one is
/// kept through the other, and both routers' tenant counters follow one history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_frontends_share_session_bindings_and_tenant_shares() {
    let extra = [
        "--set",
        "decode.mocker.speedup=20",
        "--set",
        "route.session_affinity.ttl_s=120",
        "--set",
        "route.admission.per_worker=8",
        "--set",
        "http.tenant_header=x-tenant-id",
    ];
    let Some(c) = Cluster::up(AGG_KV, 4, &extra) else {
        return;
    };
    let b = second_frontend(&c, &extra);
    let (url_a, url_b) = (format!("http://{}", c.g.addr), format!("http://{}", b.addr));
    c.wait_for(
        |_| live_workers(&url_b) == 4,
        "the second router sees the 4 workers",
    );
    let send = |url: String, session: &'static str, tenant: &'static str, prompt: String| async move {
        let r = reqwest::Client::new()
            .post(format!("{url}/v1/completions"))
            .header("x-session-id", session)
            .header("x-tenant-id", tenant)
            .json(&json!({"model": "tiny", "prompt": prompt, "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    };
    // A session's first turn through A binds it.
    send(url_a.clone(), "conv-1", "acme", long_prompt(7)).await;
    let bound = |url: &str| {
        let r = dyn_tests::inspect_json(
            url,
            &["route", "--prompt", &long_prompt(99), "--session", "conv-1"],
        );
        let s = r["replicas"][0]["session"].clone();
        (
            s["bound_worker"].as_str().map(str::to_owned),
            r["replicas"][0]["worker_id"].clone(),
            s["kept"].clone(),
        )
    };
    let (worker, _, _) = bound(&url_a);
    let worker = worker.expect("bound through A");
    // B hears of it: a prompt its KV index would send elsewhere goes to the session's worker.
    c.wait_for(
        |_| bound(&url_b).0.as_deref() == Some(worker.as_str()),
        "router B holds the session bound through A",
    );
    let (_, chosen, kept) = bound(&url_b);
    assert_eq!(
        (chosen.as_str(), kept),
        (Some(worker.as_str()), json!(true))
    );
    send(url_b.clone(), "conv-1", "acme", long_prompt(8)).await;
    assert_eq!(bound(&url_a).0.as_deref(), Some(worker.as_str()));

    // Tenants' requests through A only: B's counters follow A's.
    for i in 0..6 {
        send(
            url_a.clone(),
            "t",
            if i % 3 == 0 { "light" } else { "heavy" },
            long_prompt(20 + i),
        )
        .await;
    }
    let counters = |url: &str| -> Vec<(String, u64)> {
        let q = dyn_tests::inspect_json(url, &["queue"]);
        let mut out: Vec<(String, u64)> = q["replicas"][0]["tenants"]
            .as_array()
            .map(|t| {
                t.iter()
                    .filter(|t| t["tenant"] != "")
                    .map(|t| {
                        (
                            t["tenant"].as_str().unwrap_or_default().to_owned(),
                            t["counter"].as_f64().unwrap_or(0.0) as u64,
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.sort();
        out
    };
    c.wait_for(
        |_| counters(&url_b) == counters(&url_a),
        "router B's tenant counters follow router A's",
    );
    let shares = counters(&url_a);
    assert_eq!(shares.len(), 3, "{shares:?}");
}

/// The Responses API's store on the cluster's NATS: a response stored through one frontend is
/// read, continued and deleted through another, as a load balancer in front of several
/// frontends sends a conversation's turns wherever it likes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_response_goes_on_through_another_frontend() {
    let Some(c) = Cluster::up(AGG, 2, &["--set", "decode.mocker.speedup=20"]) else {
        return;
    };
    let b = second_frontend(&c, &[]);
    let (url_a, url_b) = (format!("http://{}", c.g.addr), format!("http://{}", b.addr));
    c.wait_for(
        |_| live_workers(&url_b) == 2,
        "the second frontend sees the workers",
    );
    let (status, first) = dyn_tests::post_json(
        &format!("{url_a}/v1/responses"),
        &json!({"model": "tiny", "input": "Hello there", "max_output_tokens": 3}),
    )
    .await;
    assert_eq!(status, 200, "{first}");
    let id = first["id"].as_str().unwrap();
    // Read back through B as A stored it.
    let got = dyn_tests::get_json(&format!("{url_b}/v1/responses/{id}")).await;
    assert_eq!(got, first);
    // Continued through B: the earlier turn is in the prompt.
    let (status, next) = dyn_tests::post_json(
        &format!("{url_b}/v1/responses"),
        &json!({"model": "tiny", "input": "And then?", "previous_response_id": id, "max_output_tokens": 3}),
    )
    .await;
    assert_eq!(status, 200, "{next}");
    let tokens = |v: &Value, k: &str| v["usage"][k].as_u64().unwrap();
    assert!(
        tokens(&next, "input_tokens")
            > tokens(&first, "input_tokens") + tokens(&first, "output_tokens"),
        "{first}\n{next}"
    );
    // Deleted through B, gone for A.
    let deleted = reqwest::Client::new()
        .delete(format!("{url_b}/v1/responses/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 200);
    let gone = reqwest::get(format!("{url_a}/v1/responses/{id}"))
        .await
        .unwrap();
    assert_eq!(gone.status(), 404);
}

/// NATS restarted under `graphs/disagg.yaml`: while it is down, long prompts prefill locally at
/// once (`plane_down`), not after waiting for it; once it is back, the prefill queue's stream
/// and the prefill worker's consumer are made again and long prompts go remote again. (Before,
/// the stream lived in the server's memory, was never made again, and every request after
/// one restart prefilled locally for good.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_prefill_comes_back_after_a_nats_restart() {
    let Some(mut c) = Cluster::disagg(&[
        "--set",
        "decode.config.mocker.speedup=10",
        "--set",
        "prefill.config.mocker.speedup=10",
        "--set",
        "remote_prefill.max_queue=1000",
    ]) else {
        return;
    };
    let url = format!("http://{}", c.g.addr);
    for r in stream_all(
        &url,
        &(0..2).map(|i| long_prompt(200 + i)).collect::<Vec<_>>(),
        8,
    )
    .await
    {
        assert_eq!(r.unwrap().1, 8);
    }
    assert_eq!(c.remote_decisions(), 2);

    c.nats.kill();
    c.wait_for(
        |c| {
            c.frontend_logs()
                .iter()
                .any(|l| l["message"] == "Event plane disconnected; reconnecting")
        },
        "the frontend notices the outage",
    );
    for r in stream_all(
        &url,
        &(0..2).map(|i| long_prompt(210 + i)).collect::<Vec<_>>(),
        8,
    )
    .await
    {
        assert_eq!(r.unwrap().1, 8, "answered during the outage");
    }
    let m = c.g.get("/metrics");
    assert!(
        metric(
            &m,
            &[
                "dyn_remote_prefill_decisions_total",
                "reason=\"plane_down\""
            ]
        ) >= 2,
        "{m}"
    );

    assert!(c.nats.start(), "nats-server starts again");
    // Remote again once the stream and the consumer are made again (bounded: a hang fails).
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut i = 0;
    while c.remote_decisions() < 3 {
        assert!(
            Instant::now() < deadline,
            "no remote prefill after NATS came back; logs:\n{}",
            c.g.logs().join("\n")
        );
        let r = stream_chat(&url, &long_prompt(300 + i), 8).await;
        assert_eq!(r.unwrap().1, 8);
        i += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // And the remote prefills succeed (prefilled there, not timed out into local ones).
    let before = logged(&c, "frontend", 1, "Prefilled remotely");
    for r in stream_all(
        &url,
        &(0..2).map(|i| long_prompt(400 + i)).collect::<Vec<_>>(),
        8,
    )
    .await
    {
        assert_eq!(r.unwrap().1, 8);
    }
    assert_eq!(logged(&c, "frontend", 1, "Prefilled remotely"), before + 2);
}

/// A cluster member that reads the event plane sees each prefill job and its reply, with the
/// offer's descriptor, but not the key that pulls it: the job carries the key's lock, the key
/// goes to the chosen decode worker alone, over the request plane. Here such a member (the
/// cluster's token, a NATS subscription to everything) races the decode worker — whose pull
/// waits out a slow modelled link first — with what it read: refused, and the decode worker
/// still gets the KV. (Before, the offer was bound to the decode worker's id, which any member
/// could name.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_reading_the_event_plane_cannot_take_an_offer() {
    use futures::StreamExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some(c) = Cluster::disagg(&[
        "--set",
        "decode.config.mocker.transfer_gbps=0.05",
        "--set",
        "remote_prefill.max_queue=1000",
    ]) else {
        return;
    };
    let url = format!("http://{}", c.g.addr);
    let nats = async_nats::connect(c.nats.address()).await.unwrap();
    let mut all = nats.subscribe(">").await.unwrap();
    nats.flush().await.unwrap();
    let sent = {
        let url = url.clone();
        tokio::spawn(async move { stream_chat(&url, &long_prompt(500), 8).await })
    };
    // The job (with the lock) and then the reply (with the descriptor), as any member reads them.
    let (mut lock, mut reply) = (None, None);
    let deadline = Instant::now() + Duration::from_secs(60);
    while reply.is_none() {
        assert!(Instant::now() < deadline, "no prefill reply seen on NATS");
        let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(1), all.next()).await else {
            continue;
        };
        let Ok(v) = serde_json::from_slice::<Value>(&m.payload) else {
            continue;
        };
        assert!(
            v.pointer("/result/Ok/key").is_none() && v.get("key").is_none(),
            "a key on the event plane: {v}"
        );
        if let Some(l) = v["lock"].as_str() {
            lock = Some(l.to_owned());
        }
        if v.pointer("/result/Ok/transfer").is_some() {
            reply = Some(v);
        }
    }
    let lock = lock.expect("the job carries the offer's lock");
    let transfer = &reply.unwrap()["result"]["Ok"]["transfer"];
    let agent = transfer["agent"]
        .as_str()
        .unwrap()
        .strip_prefix("tcp://")
        .unwrap()
        .to_owned();
    // A member of the cluster: its token gets through TLS; the lock is not the key.
    let member = dyn_trust::Trust::from_secrets(dyn_trust::Secrets {
        token: Some(CLUSTER_TOKEN.as_bytes().to_vec()),
        ca: None,
    })
    .unwrap();
    // The lock as a key, no key, and the old claim: naming a decode worker (either).
    let decode_ids: Vec<u64> = c.ps()["instances"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["component"] == "decode")
        .filter_map(|i| i["instance_id"].as_u64())
        .collect();
    assert_eq!(decode_ids.len(), 2);
    let mut pulls = vec![
        json!({"id": transfer["transfer_id"], "key": lock}),
        json!({"id": transfer["transfer_id"], "key": null}),
    ];
    pulls.extend(
        decode_ids
            .iter()
            .map(|d| json!({"id": transfer["transfer_id"], "puller": d})),
    );
    for pull in pulls {
        let tcp = tokio::net::TcpStream::connect(&agent).await.unwrap();
        let mut s = member.connect(tcp, "127.0.0.1").await.unwrap();
        let pull = pull.to_string();
        s.write_all(&(pull.len() as u32).to_be_bytes())
            .await
            .unwrap();
        s.write_all(pull.as_bytes()).await.unwrap();
        let mut len = [0u8; 4];
        s.read_exact(&mut len).await.unwrap();
        let mut header = vec![0u8; u32::from_be_bytes(len) as usize];
        s.read_exact(&mut header).await.unwrap();
        let header: Value = serde_json::from_slice(&header).unwrap();
        assert!(
            header["error"]
                .as_str()
                .is_some_and(|e| e.contains("unknown")),
            "a member took the offer: {header}"
        );
    }
    // The decode worker, with the key, still pulls it.
    let (_, n) = sent.await.unwrap().unwrap();
    assert_eq!(n, 8);
    assert_eq!(logged(&c, "decode", 2, "KV transfer failed"), 0);
    assert_eq!(logged(&c, "frontend", 1, "Prefilled remotely"), 1);
}

/// A whole graph on one machine without a cluster identity: the run makes a token of its own
/// for its processes (in their environment, which only this user reads), so another local
/// user reaching the request plane's loopback ports gets no work done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_without_an_identity_makes_its_own_token() {
    let Some(c) = Cluster::up_with_token(AGG, 2, &["--set", "decode.mocker.speedup=100"], None)
    else {
        return;
    };
    let url = format!("http://{}", c.g.addr);
    let (_, n) = stream_chat(&url, "hello", 4).await.unwrap();
    assert_eq!(n, 4);
    let ps = c.ps();
    let pids: Vec<u32> = ps["runs"][0]["processes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["pid"].as_u64().map(|p| p as u32))
        .collect();
    let tokens: std::collections::HashSet<String> = pids
        .iter()
        .map(|pid| {
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
            String::from_utf8_lossy(&env)
                .split('\0')
                .find_map(|kv| kv.strip_prefix("DYN_CLUSTER_TOKEN=").map(str::to_owned))
                .unwrap_or_else(|| panic!("process {pid} has no cluster token"))
        })
        .collect();
    assert_eq!(tokens.len(), 1, "one token for the run: {tokens:?}");
    assert!(tokens.iter().all(|t| t.len() == 64));
    // Not on any command line.
    for pid in &pids {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        let t = tokens.iter().next().unwrap();
        assert!(!String::from_utf8_lossy(&cmdline).contains(t.as_str()));
    }
    // A local process without it: frames by hand to a decode worker are closed unanswered.
    let (address, id) = first_decode(&ps);
    let got = knock(&address, &hand_written_call(id)).await;
    assert!(got.is_empty() || got[0] == 21, "{got:?}");
    assert!(!c.g.logs().iter().any(|l| l.contains("intruder-1")));
}
