//! One replica's engine server: found at a URL, or started by dyn from the `launch` command.
//!
//! A supervisor task owns it. It waits for the server's health, checks that it serves the
//! graph's model (its tokenizer must split a probe text into the ids dyn's tokenizer does:
//! with token ids going in and out, a server with another vocabulary would answer garbage),
//! then reports the replica ready (see [`dyn_core::Readiness`]) and the endpoint to call.
//! From then on it probes the health every `health_interval_s` (and at once when a request
//! saw the server fail); when the server stops answering, or its process exits, the replica
//! is not ready until it is back. A launched server is restarted with a backoff (0.5 s
//! doubling to 10 s, reset after 30 s up) on a fresh port; one that serves the wrong model is
//! not (restarting cannot fix that). Dropping the [`Server`] stops the launched process group:
//! SIGTERM, and SIGKILL if it is still there after 10 s; a watchdog in the group stops it
//! when dyn dies without doing so.

use std::collections::VecDeque;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dyn_core::Readiness;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokenizers::Tokenizer;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::config::{ExternalConfig, ExternalKind, fill};

/// dyn's secrets, kept out of engine servers' environments.
const SECRETS: &[&str] = &[
    "DYN_CLUSTER_TOKEN",
    "DYN_CLUSTER_TOKEN_FILE",
    "DYN_CLUSTER_KEY",
    "DYN_SET",
    "DYN_API_KEYS",
    "DYN_METRICS_KEY",
    "DYN_ADMIN_KEY",
    "ETCD_AUTH_USERNAME",
    "ETCD_AUTH_PASSWORD",
    "ETCD_AUTH_CLIENT_KEY",
    "NATS_AUTH_USERNAME",
    "NATS_AUTH_PASSWORD",
    "NATS_AUTH_TOKEN",
    "NATS_AUTH_NKEY",
    "NATS_AUTH_CREDENTIALS_FILE",
    "NATS_TLS_CLIENT_KEY_PATH",
];

/// How a launched command runs: under `sh`, as the leader of its own process group, beside a
/// watchdog that reads dyn's end of a pipe and, when it closes — dyn exited, even by SIGKILL
/// — sends SIGTERM to the whole group, so no server outlives dyn. The command itself (`$1`)
/// gets no stdin and not the pipe; the group leader's exit status is the command's.
const WATCHDOG: &str =
    "exec 3<&0; (cat <&3 >/dev/null; kill -TERM 0) & sh -c \"$1\" </dev/null 3<&- & wait $!";

/// A text whose ids dyn and the server must agree on.
const PROBE: &str = "Hello, world! The quick brown fox jumps over 13 lazy dogs.";

/// How to call a ready server.
#[derive(Debug, Clone, PartialEq)]
pub struct Endpoint {
    /// `http://host:port`, no trailing slash.
    pub base: String,
    /// The `model` its requests name.
    pub model: String,
    /// Increases at every (re)start of a launched server: KV event followers start over.
    pub generation: u64,
}

/// What the supervisor needs besides the config.
pub struct ServerSpec {
    pub kind: ExternalKind,
    pub config: ExternalConfig,
    /// The replica's URL when not launched.
    pub url: Option<String>,
    pub replica: u32,
    pub model_path: String,
    pub model_name: String,
    pub tokenizer: Arc<Tokenizer>,
    /// Extra arguments for a launched server (vLLM's `--kv-events-config`), made per start.
    pub extra_args: Option<Box<dyn Fn() -> String + Send + Sync>>,
    /// For log lines.
    pub node: String,
}

/// The replica's server, as the `decode` node sees it.
pub struct Server {
    ready: watch::Receiver<Option<Endpoint>>,
    suspect: Arc<Notify>,
    stop: CancellationToken,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Server {
    pub fn start(spec: ServerSpec, readiness: Readiness) -> Server {
        let (tx, ready) = watch::channel(None);
        let suspect = Arc::new(Notify::new());
        let stop = CancellationToken::new();
        readiness.set(false);
        let sup = Supervisor {
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .unwrap_or_default(),
            spec,
            ready: tx,
            readiness,
            suspect: suspect.clone(),
            stop: stop.clone(),
        };
        tokio::spawn(sup.run());
        Server {
            ready,
            suspect,
            stop,
        }
    }

    /// Where to send a request now; `None` while the server is down.
    pub fn endpoint(&self) -> Option<Endpoint> {
        self.ready.borrow().clone()
    }

    /// Follow the endpoint as the server comes and goes.
    pub fn watch(&self) -> watch::Receiver<Option<Endpoint>> {
        self.ready.clone()
    }

    /// A request saw the server fail: check its health now.
    pub fn suspect(&self) {
        self.suspect.notify_one();
    }
}

/// Why a server is not (or no longer) serving.
enum Down {
    /// It exited, or never became healthy, or stopped answering: worth another start.
    Retry(String),
    /// It serves something else: restarting does not help.
    Wrong(String),
    /// dyn is stopping.
    Stopped,
}

struct Supervisor {
    client: reqwest::Client,
    spec: ServerSpec,
    ready: watch::Sender<Option<Endpoint>>,
    readiness: Readiness,
    suspect: Arc<Notify>,
    stop: CancellationToken,
}

impl Supervisor {
    async fn run(self) {
        let mut backoff = Duration::from_millis(500);
        let mut generation = 0;
        let s = &self.spec;
        let who = format!("{} server of {}.{}", s.kind.name(), s.node, s.replica);
        loop {
            generation += 1;
            let started = Instant::now();
            let down = match &s.url {
                Some(url) => self.serve_url(url, generation).await,
                None => self.serve_launched(generation).await,
            };
            self.ready.send_replace(None);
            self.readiness.set(false);
            match down {
                Down::Stopped => return,
                Down::Wrong(why) => {
                    tracing::error!(node = %s.node, replica = s.replica, "The {who} is not usable: {why}");
                    if s.url.is_none() {
                        // A launched server is ours to fix: nothing more to try.
                        return;
                    }
                    // Someone else runs it and may restart it right: look again later.
                    backoff = Duration::from_secs(10);
                }
                Down::Retry(why) => {
                    if started.elapsed() >= Duration::from_secs(30) {
                        backoff = Duration::from_millis(500);
                    }
                    tracing::warn!(node = %s.node, replica = s.replica, retry_in = ?backoff, "The {who} is down: {why}");
                }
            }
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(10));
        }
    }

    /// A server someone else runs: wait until it answers, then watch it.
    async fn serve_url(&self, url: &str, generation: u64) -> Down {
        let base = url.trim_end_matches('/').to_owned();
        let interval = Duration::from_secs_f64(self.spec.config.health_interval_s);
        // Said at the first failure and every 30 s after: a wrong URL must not be silent.
        let mut said: Option<Instant> = None;
        loop {
            match self.probe(&base).await {
                Ok(()) => break,
                Err(e) if said.is_none_or(|t| t.elapsed() >= Duration::from_secs(30)) => {
                    said = Some(Instant::now());
                    tracing::warn!(node = %self.spec.node, replica = self.spec.replica, url = %base, error = %e, "Engine server not answering its health check; its replica waits");
                }
                Err(e) => {
                    tracing::debug!(node = %self.spec.node, url = %base, error = %e, "Engine server not healthy yet");
                }
            }
            tokio::select! {
                _ = self.stop.cancelled() => return Down::Stopped,
                _ = tokio::time::sleep(interval) => {}
            }
        }
        let endpoint = match self.verify(&base, generation).await {
            Ok(e) => e,
            Err(d) => return d,
        };
        self.watch_healthy(endpoint).await
    }

    /// Start the command, wait for its health, watch it; stop it whatever happens.
    async fn serve_launched(&self, generation: u64) -> Down {
        let Some(cmd) = &self.spec.config.launch else {
            return Down::Wrong("neither a URL nor a launch command".into());
        };
        let port = match free_port() {
            Ok(p) => p,
            Err(e) => return Down::Retry(format!("no free port: {e}")),
        };
        let line = self.launch_line(cmd, port);
        let mut launched = match self.launch(&line) {
            Ok(l) => l,
            Err(down) => return down,
        };
        let base = format!("http://127.0.0.1:{port}");
        let down = self.serve_process(&mut launched, &base, generation).await;
        launched.group.stop(&mut launched.child).await;
        down
    }

    /// The command with its placeholders filled, and the extra arguments of this start.
    fn launch_line(&self, cmd: &str, port: u16) -> String {
        let s = &self.spec;
        let port_s = port.to_string();
        let replica = s.replica.to_string();
        let mut line = fill(
            cmd,
            &[
                ("port", &port_s),
                ("host", "127.0.0.1"),
                ("model", &s.model_path),
                ("model_name", &s.model_name),
                ("replica", &replica),
            ],
        );
        if let Some(extra) = &s.extra_args {
            line.push(' ');
            line.push_str(&extra());
        }
        line
    }

    /// Run `line` under the watchdog, its output forwarded to the log.
    fn launch(&self, line: &str) -> Result<Launched, Down> {
        let s = &self.spec;
        let mut command = tokio::process::Command::new("sh");
        // A third party's server gets none of dyn's secrets (its config's `env` may still
        // hand one on on purpose).
        for var in SECRETS {
            command.env_remove(var);
        }
        command
            .arg("-c")
            .arg(WATCHDOG)
            .arg("dyn-engine-server")
            .arg(line)
            .envs(&s.config.env)
            // The watchdog's pipe: it closes when dyn exits, however it exits.
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group, so stopping it stops what it started (vLLM's engine
            // core, a shell's children).
            .process_group(0)
            .kill_on_drop(true);
        let mut child = match command.spawn() {
            Ok(c) => c,
            Err(e) => return Err(Down::Wrong(format!("cannot run `sh -c {line}`: {e}"))),
        };
        let lifeline = child.stdin.take();
        let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) else {
            return Err(Down::Retry("the launched server exited at once".into()));
        };
        let group = Group(Pid::from_raw(pid));
        tracing::info!(node = %s.node, replica = s.replica, pid, command = %line, "Started an engine server");
        let (tail, readers) = self.forward_output(&mut child);
        Ok(Launched {
            readers,
            tail,
            group,
            _lifeline: lifeline,
            child,
        })
    }

    /// Tasks that log the server's stdout and stderr and keep their last lines.
    fn forward_output(&self, child: &mut tokio::process::Child) -> (Tail, Vec<JoinHandle<()>>) {
        let s = &self.spec;
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let read = |out, stream| {
            tokio::spawn(keep_tail(
                out,
                tail.clone(),
                s.node.clone(),
                s.replica,
                stream,
            ))
        };
        let mut readers = Vec::new();
        if let Some(out) = child.stdout.take() {
            readers.push(read(
                Box::new(out) as Box<dyn AsyncRead + Send + Unpin>,
                "stdout",
            ));
        }
        if let Some(err) = child.stderr.take() {
            readers.push(read(Box::new(err), "stderr"));
        }
        (tail, readers)
    }

    /// Wait for the launched server's health, verify it, watch it: until it exits, fails,
    /// or dyn stops.
    async fn serve_process(&self, launched: &mut Launched, base: &str, generation: u64) -> Down {
        let s = &self.spec;
        let exited = exit_message(
            &mut launched.child,
            std::mem::take(&mut launched.readers),
            &launched.tail,
        );
        tokio::pin!(exited);
        let timeout = Duration::from_secs_f64(s.config.startup_timeout_s);
        tokio::select! {
            _ = self.stop.cancelled() => Down::Stopped,
            why = &mut exited => Down::Retry(why),
            up = self.wait_healthy(base, timeout) => if up {
                match self.verify(base, generation).await {
                    Ok(endpoint) => tokio::select! {
                        why = &mut exited => Down::Retry(why),
                        down = self.watch_healthy(endpoint) => down,
                    },
                    Err(d) => d,
                }
            } else {
                Down::Retry(format!("not healthy {}s after its start", s.config.startup_timeout_s))
            },
        }
    }

    /// Whether the server answers its health check within `timeout`.
    async fn wait_healthy(&self, base: &str, timeout: Duration) -> bool {
        let start = Instant::now();
        loop {
            if self.probe(base).await.is_ok() {
                return true;
            }
            if start.elapsed() >= timeout {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Report the server ready and probe it until it fails.
    async fn watch_healthy(&self, endpoint: Endpoint) -> Down {
        let s = &self.spec;
        tracing::info!(node = %s.node, replica = s.replica, url = %endpoint.base, model = %endpoint.model, "Engine server ready");
        let base = endpoint.base.clone();
        self.ready.send_replace(Some(endpoint));
        self.readiness.set(true);
        let interval = Duration::from_secs_f64(s.config.health_interval_s);
        loop {
            tokio::select! {
                _ = self.stop.cancelled() => return Down::Stopped,
                _ = tokio::time::sleep(interval) => {}
                _ = self.suspect.notified() => {}
            }
            // Two failures in a row: one slow answer from a busy server is not a death.
            if let Err(first) = self.probe(&base).await {
                tokio::time::sleep(Duration::from_millis(200)).await;
                if self.probe(&base).await.is_err() {
                    return Down::Retry(format!("stopped answering its health check: {first}"));
                }
            }
        }
    }

    async fn probe(&self, base: &str) -> Result<(), String> {
        let path = match self.spec.kind {
            ExternalKind::Vllm | ExternalKind::Llamacpp => "/health",
            ExternalKind::Openai => "/v1/models",
        };
        let r = self
            .client
            .get(format!("{base}{path}"))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if r.status().is_success() {
            Ok(())
        } else {
            Err(format!("{path} answered {}", r.status()))
        }
    }

    /// The model it serves, and that its tokenizer is the graph's.
    async fn verify(&self, base: &str, generation: u64) -> Result<Endpoint, Down> {
        let s = &self.spec;
        let retry = |e: String| Down::Retry(e);
        let model = match s.kind {
            ExternalKind::Llamacpp => s.config.served_model.clone().unwrap_or_default(),
            ExternalKind::Vllm | ExternalKind::Openai => {
                let v: Value = self
                    .get_json(&format!("{base}/v1/models"))
                    .await
                    .map_err(retry)?;
                let ids: Vec<String> = v
                    .get("data")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(|m| m.get("id").and_then(Value::as_str).map(str::to_owned))
                    .collect();
                match (&s.config.served_model, ids.first()) {
                    (Some(want), _) if ids.contains(want) => want.clone(),
                    (Some(want), _) => {
                        return Err(Down::Wrong(format!(
                            "it serves {ids:?}, not `{want}` (served_model)"
                        )));
                    }
                    (None, Some(first)) => first.clone(),
                    (None, None) => return Err(Down::Retry("/v1/models lists no model".into())),
                }
            }
        };
        let expected = s
            .tokenizer
            .encode(PROBE, false)
            .map_err(|e| Down::Wrong(format!("dyn's tokenizer failed the probe text: {e}")))?
            .get_ids()
            .to_vec();
        let got = match s.kind {
            ExternalKind::Vllm => Some(
                self.post_json(
                    &format!("{base}/tokenize"),
                    &json!({"model": model, "prompt": PROBE, "add_special_tokens": false}),
                )
                .await
                .map_err(retry)?,
            ),
            ExternalKind::Llamacpp => Some(
                self.post_json(
                    &format!("{base}/tokenize"),
                    &json!({"content": PROBE, "add_special": false}),
                )
                .await
                .map_err(retry)?,
            ),
            // Text goes in and out: the server's vocabulary does not matter.
            ExternalKind::Openai => None,
        };
        if let Some(v) = got {
            let ids: Vec<u32> = v
                .get("tokens")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect();
            if ids != expected {
                return Err(Down::Wrong(format!(
                    "it serves another model: its tokenizer splits {PROBE:?} into {ids:?}, the graph's model ({}) into {expected:?}",
                    s.model_path
                )));
            }
        }
        Ok(Endpoint {
            base: base.to_owned(),
            model,
            generation,
        })
    }

    async fn get_json(&self, url: &str) -> Result<Value, String> {
        let r = self
            .client
            .get(url)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        read_json(url, r).await
    }

    async fn post_json(&self, url: &str, body: &Value) -> Result<Value, String> {
        let r = self
            .client
            .post(url)
            .json(body)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        read_json(url, r).await
    }
}

async fn read_json(url: &str, r: reqwest::Response) -> Result<Value, String> {
    let status = r.status();
    if !status.is_success() {
        return Err(format!("{url} answered {status}"));
    }
    r.json().await.map_err(|e| format!("{url}: {e}"))
}

/// A free loopback port for a server to listen on.
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Forward a launched server's output to the log (debug) and keep its last lines for the
/// message when it exits.
async fn keep_tail(
    out: Box<dyn AsyncRead + Send + Unpin>,
    tail: Tail,
    node: String,
    replica: u32,
    stream: &'static str,
) {
    let mut lines = BufReader::new(out).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        tracing::debug!(target: "dyn::engine_server", node = %node, replica, stream, "{line}");
        let mut t = tail.lock();
        if t.len() == 20 {
            t.pop_front();
        }
        t.push_back(line);
    }
}

/// A launched server's last lines of output.
type Tail = Arc<Mutex<VecDeque<String>>>;

/// A launched server: its process, its group, and what collects its output.
struct Launched {
    readers: Vec<JoinHandle<()>>,
    tail: Tail,
    group: Group,
    /// Held (not written) while the server runs; see WATCHDOG.
    _lifeline: Option<tokio::process::ChildStdin>,
    child: tokio::process::Child,
}

/// When the launched server exits: why, with its last lines.
async fn exit_message(
    child: &mut tokio::process::Child,
    readers: Vec<JoinHandle<()>>,
    tail: &Tail,
) -> String {
    let status = child.wait().await;
    // Its last lines may still be in the pipes.
    let _ = tokio::time::timeout(Duration::from_secs(1), futures::future::join_all(readers)).await;
    let last: Vec<String> = tail.lock().iter().cloned().collect();
    let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
    format!(
        "the launched server exited ({status}); its last lines:\n  {}",
        last.join("\n  ")
    )
}

/// A launched server's process group.
struct Group(Pid);

impl Group {
    /// SIGTERM to the group; SIGKILL after 10 s if the leader is still there.
    async fn stop(&self, child: &mut tokio::process::Child) {
        let _ = killpg(self.0, Signal::SIGTERM);
        if tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .is_err()
        {
            let _ = killpg(self.0, Signal::SIGKILL);
            let _ = child.wait().await;
        }
        // Whatever else of the group outlived its leader.
        let _ = killpg(self.0, Signal::SIGKILL);
    }
}

impl Drop for Group {
    /// Also when the runtime goes away with the task (the process is exiting): the server
    /// must not outlive dyn.
    fn drop(&mut self) {
        let _ = killpg(self.0, Signal::SIGTERM);
    }
}
