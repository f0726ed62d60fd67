//! Helpers for integration tests that drive the real `dyn` binary, in the manner of
//! ripgrep's `TestCommand`: find the binary, run it, and for `dyn graph up` wait until the
//! graph is serving and learn the address it bound.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers: a failure is a test failure

pub mod servers;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The repository root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The `dyn` binary under test: `$DYN_BIN`, or this checkout's, built by the first call in
/// each test process (`cargo build -p dyn-cli --bin dyn` in this test executable's profile:
/// a no-op when fresh), so a bare `cargo test` never drives a stale binary.
pub fn dyn_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("DYN_BIN") {
        return p.into();
    }
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            // target/<profile>/deps/<test> → target/<profile>/dyn
            let exe = std::env::current_exe().unwrap();
            let dir = exe.parent().unwrap().parent().unwrap();
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let mut build = Command::new(cargo);
            build.current_dir(root());
            build.args(["build", "--quiet", "-p", "dyn-cli", "--bin", "dyn"]);
            if dir.file_name().is_some_and(|p| p == "release") {
                build.arg("--release");
            }
            let status = build.status().unwrap();
            assert!(status.success(), "building the dyn binary failed");
            let bin = dir.join("dyn");
            assert!(
                bin.exists(),
                "{} not found after building it",
                bin.display()
            );
            bin
        })
        .clone()
}

/// A test that cannot run here. Under the test command (`scripts/test` provides etcd,
/// NATS, the model and the Python venv, and sets `DYN_TEST_REQUIRE`) that is a failure;
/// under a bare `cargo test` it says `SKIPPED` and the test passes.
pub fn skip(reason: &str) {
    assert!(
        std::env::var_os("DYN_TEST_REQUIRE").is_none(),
        "{reason}, but the test command provides it (DYN_TEST_REQUIRE is set)"
    );
    eprintln!("SKIPPED: {reason}");
}

/// A `dyn` command run from the repository root.
pub fn dyn_cmd() -> Command {
    let mut c = Command::new(dyn_bin());
    c.current_dir(root());
    c
}

/// Run `dyn ARGS…` to completion.
pub fn run(args: &[&str]) -> Output {
    dyn_cmd().args(args).output().unwrap()
}

/// `dyn inspect --url URL --json ARGS…`, which must succeed; its JSON answer.
pub fn inspect_json(url: &str, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["inspect", "--url", url, "--json"];
    all.extend_from_slice(args);
    let out = run(&all);
    assert!(
        out.status.success(),
        "dyn {all:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("dyn {all:?} printed no JSON: {e}"))
}

/// How long `dyn graph up` may take to listen.
const START_WITHIN: Duration = Duration::from_secs(180);

/// A running `dyn graph up`, killed on drop.
pub struct Graph {
    child: Option<Child>,
    /// The address the HTTP ingress bound (from its "listening" log line).
    pub addr: String,
    logs: Arc<Mutex<Vec<String>>>,
}

impl Graph {
    /// Start `dyn graph up GRAPH --set ingress.listen=127.0.0.1:0 EXTRA…` with JSON logs and
    /// wait until the ingress listens.
    pub fn up(graph: &str, extra: &[&str]) -> Graph {
        Self::up_with_ingress(graph, "ingress", extra)
    }

    /// [`Graph::up`] for a graph whose ingress node is called `ingress`.
    pub fn up_with_ingress(graph: &str, ingress: &str, extra: &[&str]) -> Graph {
        Self::start(graph, ingress, extra, &[])
    }

    /// [`Graph::up_with_ingress`] with extra environment variables.
    pub fn start(graph: &str, ingress: &str, extra: &[&str], env: &[(&str, &str)]) -> Graph {
        let mut child = dyn_cmd()
            .args(["--log-format", "json", "graph", "up", graph])
            .args(["--set", &format!("{ingress}.listen=127.0.0.1:0")])
            .args(extra)
            .env("RUST_LOG", "info,dyn_kinds=debug,dyn_llm=debug,dyn_router=debug,dyn_planner=debug,dyn_engine=debug,dyn_external=debug,dyn_frontend=debug,dyn_core=debug,dyn_runtime=debug")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let sink = logs.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(unprefixed(&line))
                    && v["message"] == "HTTP ingress listening"
                {
                    let _ = tx.send(v["addr"].as_str().unwrap_or_default().to_owned());
                }
                sink.lock().unwrap().push(line);
            }
        });
        // A bound that only ends a hang: a graph that loads a real model in a debug build on
        // a loaded 2-core machine has taken most of a minute. A graph that exits ends the wait
        // at once (its stderr closes).
        let addr = match rx.recv_timeout(START_WITHIN) {
            Ok(addr) => addr,
            Err(e) => {
                let why = match e {
                    mpsc::RecvTimeoutError::Timeout => {
                        format!("was not listening after {START_WITHIN:?}")
                    }
                    mpsc::RecvTimeoutError::Disconnected => match child.try_wait() {
                        Ok(Some(status)) => format!("exited ({status})"),
                        _ => "closed its log".to_owned(),
                    },
                };
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "dyn graph up {graph} {why}; logs:\n{}",
                    logs.lock().unwrap().join("\n")
                )
            }
        };
        Graph {
            child: Some(child),
            addr,
            logs,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// `GET path` over a plain HTTP/1.0 connection, for synchronous tests; the response body.
    pub fn get(&self, path: &str) -> String {
        use std::io::{Read, Write};
        let mut conn = std::net::TcpStream::connect(&self.addr).unwrap();
        write!(conn, "GET {path} HTTP/1.0\r\nHost: {}\r\n\r\n", self.addr).unwrap();
        let mut resp = String::new();
        conn.read_to_string(&mut resp).unwrap();
        resp.split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default()
    }

    /// Log lines so far (JSON, one per line).
    pub fn logs(&self) -> Vec<String> {
        self.logs.lock().unwrap().clone()
    }

    /// The log lines as they keep coming, also after [`Graph::wait`] took the graph.
    pub fn log_sink(&self) -> Arc<Mutex<Vec<String>>> {
        self.logs.clone()
    }

    /// The `dyn graph up` process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Send SIGTERM.
    pub fn terminate(&self) {
        let pid = self.child.as_ref().unwrap().id().to_string();
        let ok = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(ok.success());
    }

    /// Wait for exit (up to `timeout`) and return the exit code.
    pub fn wait(mut self, timeout: Duration) -> Option<i32> {
        let mut child = self.child.take().unwrap();
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status.code();
            }
            if start.elapsed() > timeout {
                let _ = child.kill();
                panic!(
                    "dyn did not exit in {timeout:?}; logs:\n{}",
                    self.logs().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A log line without the `[PROCESS.REPLICA] ` prefix a supervisor adds to its processes'.
pub fn unprefixed(line: &str) -> &str {
    match line.strip_prefix('[').and_then(|l| l.split_once("] ")) {
        Some((_, rest)) => rest,
        None => line,
    }
}

/// The log lines of one supervised process (`frontend.0`), prefix removed, parsed.
pub fn process_logs(logs: &[String], process: &str) -> Vec<serde_json::Value> {
    let prefix = format!("[{process}] ");
    logs.iter()
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// A fresh empty directory under the system temp dir, unique to this test process and `name`.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dyn-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A prompt of about a thousand tokens with the tiny tokenizer (above `graphs/disagg.yaml`'s
/// `min_remote_tokens` of 512), distinct per `i`.
pub fn long_prompt(i: usize) -> String {
    (0..200)
        .map(|w| format!("w{i}x{w}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Sum of the samples in Prometheus `text` of series `name` (a metric name, or a full series
/// with its labels) whose line also contains every one of `labels`.
pub fn metric_sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| labels.iter().all(|p| l.contains(p)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// [`metric_sum`] for counters and gauges counted in whole numbers; `parts` is the metric name
/// and then label matches.
pub fn metric(text: &str, parts: &[&str]) -> u64 {
    match parts {
        [name, labels @ ..] => metric_sum(text, name, labels) as u64,
        [] => 0,
    }
}

/// POST an OpenAI completion request; the status and the JSON body.
pub async fn completion(url: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    post_json(&format!("{url}/v1/completions"), body).await
}

/// POST a streaming request to `url`: the JSON of each server-sent event (`[DONE]` left out),
/// and the whole text (for failure messages).
pub async fn sse_events(url: &str, body: &serde_json::Value) -> (Vec<serde_json::Value>, String) {
    let text = reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"))
        .text()
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    let events = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    (events, text)
}

/// POST a JSON body to `url`; the status and the JSON answer.
pub async fn post_json(url: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let r = reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    let status = r.status().as_u16();
    let v = r
        .json()
        .await
        .unwrap_or_else(|e| panic!("{url}: an answer that is not JSON: {e}"));
    (status, v)
}

/// Poll `ok` every 10 ms until it holds, for state that background tasks update (watches,
/// event followers, engine threads); panic after 60 s naming `what`. Nothing is timed: the
/// limit only ends a test that would otherwise hang, sized for a loaded 2-core machine.
pub async fn until(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never {what} (waited 60 s)");
}

/// `GET url`'s body as JSON.
pub async fn get_json(url: &str) -> serde_json::Value {
    reqwest::get(url).await.unwrap().json().await.unwrap()
}

/// The test venv's Python (`DYN_TEST_PYTHON`) and `graphs/chat.yaml` up on SmolLM2
/// (`DYN_SMOLLM2_GGUF`) with its `http` ingress, for the official clients' checks; `None`, said
/// visibly, without them.
pub fn smollm2_for_python() -> Option<(std::ffi::OsString, Graph)> {
    let (Some(python), Some(gguf)) = (
        std::env::var_os("DYN_TEST_PYTHON"),
        std::env::var("DYN_SMOLLM2_GGUF").ok(),
    ) else {
        skip("DYN_TEST_PYTHON or DYN_SMOLLM2_GGUF is not set (scripts/test sets both)");
        return None;
    };
    let g = Graph::up_with_ingress(
        "graphs/chat.yaml",
        "http",
        &["--set", &format!("model.path={gguf}")],
    );
    Some((python, g))
}

/// Run a script of tests/py with `python` and `args`; it must succeed; its stdout's lines, as
/// JSON.
pub fn python_lines(
    python: &std::ffi::OsStr,
    script: &str,
    args: &[&str],
) -> Vec<serde_json::Value> {
    let out = Command::new(python)
        .arg(root().join(script))
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Resident memory of process `pid` in bytes (`VmRSS`); a process that is gone is a failure
/// that says so.
pub fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("process {pid} is gone: {e}"));
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no VmRSS for process {pid}"));
    kb * 1024
}
