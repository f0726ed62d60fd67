//! Multi-process `dyn graph up`, and `dyn graph ps` / `dyn graph down`.
//!
//! With etcd and NATS planes, `dyn graph up` becomes a supervisor: it starts one `dyn` process
//! per process-group replica (the same binary with `--group NAME:REPLICA`), prefixes their log
//! lines with `[NAME.REPLICA]`, restarts a process that exits with a backoff (0.5 s doubling to
//! 10 s, reset once it has run for 30 s), and on SIGINT/SIGTERM passes SIGTERM on so every
//! process drains, then waits for them. It records itself and its processes in a state file
//! (one per supervisor, so machines joining with `--only` on one host do not collide); `ps`
//! reads those and asks etcd which instances are registered, `down` sends SIGTERM to the
//! supervisors and waits for them to finish.
//!
//! A supervised process checks every second that its supervisor is still its parent, and
//! drains and exits when it is not: a supervisor killed with SIGKILL leaves nothing behind.
//!
//! The supervisor is also the SLA planner's multi-process connector ([`Supervisor`]): scaling
//! a node up starts the next replica of its process group, scaling down sends SIGTERM to the
//! newest one, which drains like any stopping process; the state file follows.
//!
//! The state directory may sit in a shared temporary directory, where another user could make
//! it first: it is created 0700 and refused unless it is a real directory (not a symlink)
//! owned by this user and writable by no one else, and state files are written under a new
//! name (`O_CREAT|O_EXCL|O_NOFOLLOW`) then renamed over, so nothing planted is written
//! through. A state file names a pid, which `down` signals: only a process of this user whose
//! executable is `dyn` and whose start time (`/proc/PID/stat`) is the one recorded is taken
//! for the run, so a reused pid or a pid someone wrote there is never signalled.

use std::fs::OpenOptions;
use std::io::{Read as _, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use nix::fcntl::OFlag;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::watch;

/// What one supervisor (or one embedded `dyn graph up`) runs, as written to its state file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct State {
    pub graph: String,
    pub namespace: String,
    pub pid: u32,
    /// `embedded` or `distributed`.
    pub mode: String,
    pub control: String,
    pub events: String,
    pub started_unix: u64,
    /// `pid`'s start time in clock ticks since boot (`/proc/PID/stat`'s 22nd field): a pid
    /// reused by another process does not match it.
    #[serde(default)]
    pub start_ticks: Option<u64>,
    pub processes: Vec<ProcState>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProcState {
    pub process: String,
    pub replica: u32,
    pub pid: Option<u32>,
    pub restarts: u32,
    pub status: String,
}

/// The most bytes a state file is read for: one lists a run's processes (a few KiB).
const STATE_MAX: u64 = 1 << 20;

/// Where state files live: `$DYN_RUN_DIR`, else `$XDG_RUNTIME_DIR/dyn`, else a per-user
/// directory under the temp dir; created if missing, and checked ([`private_dir`]).
pub fn run_dir() -> anyhow::Result<PathBuf> {
    let dir = if let Some(d) = std::env::var_os("DYN_RUN_DIR") {
        PathBuf::from(d)
    } else if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR") {
        PathBuf::from(d).join("dyn")
    } else {
        std::env::temp_dir().join(format!("dyn-{}", nix::unistd::getuid()))
    };
    private_dir(&dir)?;
    Ok(dir)
}

/// Make `dir` (0700) unless it exists, then require that it is a directory itself (not a
/// symlink to one), owned by this user, that no one else may write: in a shared temp dir
/// another user may have made it, to plant state files (`down` would signal their pids) or
/// symlinks (`up` would write through them).
fn private_dir(dir: &Path) -> anyhow::Result<()> {
    let shown = dir.display().to_string().escape_debug().to_string();
    let fix = "remove it, or set DYN_RUN_DIR to a directory of your own";
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("cannot create the state directory {shown}"))?;
    // lstat: the name itself, not what a symlink there points at.
    let m = std::fs::symlink_metadata(dir)
        .with_context(|| format!("cannot read the state directory {shown}"))?;
    let uid = nix::unistd::getuid().as_raw();
    let problem = if m.file_type().is_symlink() {
        Some("is a symbolic link, not a directory".to_owned())
    } else if !m.is_dir() {
        Some("is not a directory".to_owned())
    } else if m.uid() != uid {
        Some(format!(
            "is owned by uid {}, not by this user (uid {uid})",
            m.uid()
        ))
    } else if m.mode() & 0o022 != 0 {
        Some(format!(
            "may be written by other users (mode {:o})",
            m.mode() & 0o7777
        ))
    } else {
        None
    };
    match problem {
        Some(p) => anyhow::bail!("the state directory {shown} {p}: {fix}"),
        None => Ok(()),
    }
}

fn state_path(namespace: &str, graph: &str, pid: u32) -> anyhow::Result<PathBuf> {
    Ok(run_dir()?.join(format!("{namespace}.{graph}.{pid}.json")))
}

/// `pid`'s start time in clock ticks since boot (`/proc/PID/stat`'s 22nd field).
pub fn start_ticks(pid: u32) -> Option<u64> {
    let stat = read_small(&PathBuf::from(format!("/proc/{pid}/stat")), false).ok()?;
    let stat = String::from_utf8_lossy(&stat);
    // `pid (comm) state ppid …`: the fields after the last `)` start at the 3rd (comm may
    // contain spaces and parentheses).
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(22 - 3)?.parse().ok()
}

/// Whether `pid` is a process of this user running `dyn` (its executable's name is `dyn`, or
/// this process's own), started at `ticks` where the state file recorded that: what `down`
/// may signal. A process whose `/proc` entry cannot be read is not taken for one.
fn ours_and_dyn(pid: u32, ticks: Option<u64>) -> bool {
    let Ok(status) = read_small(&PathBuf::from(format!("/proc/{pid}/status")), false) else {
        return false;
    };
    let uid = nix::unistd::getuid().as_raw();
    // `Uid:\treal\teffective\tsaved\tfs`.
    let owner = String::from_utf8_lossy(&status)
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next()?.parse::<u32>().ok());
    if owner != Some(uid) {
        return false;
    }
    let Ok(exe) = std::fs::read_link(format!("/proc/{pid}/exe")) else {
        return false;
    };
    is_dyn(&exe) && ticks.is_none_or(|t| start_ticks(pid) == Some(t))
}

/// Whether `exe` is a dyn binary: named `dyn`, or as this one is.
fn is_dyn(exe: &Path) -> bool {
    let name = |p: &Path| {
        p.file_name().map(|n| {
            let n = n.to_string_lossy();
            // A binary replaced on disk while it runs (a rebuild) reads `dyn (deleted)`.
            n.strip_suffix(" (deleted)").unwrap_or(&n).to_owned()
        })
    };
    let own = std::env::current_exe().ok().and_then(|e| name(&e));
    name(exe).is_some_and(|n| n == "dyn" || Some(&n) == own.as_ref())
}

/// Whether `pid` is verifiably a process of this user that is not the run that wrote a state
/// file: another program, or a later process under a reused pid (its start time differs).
/// `false` where that cannot be told (`/proc` unreadable).
fn ours_and_other(pid: u32, ticks: Option<u64>) -> bool {
    let Ok(meta) = std::fs::metadata(format!("/proc/{pid}")) else {
        return false;
    };
    if std::os::unix::fs::MetadataExt::uid(&meta) != nix::unistd::getuid().as_raw() {
        return false;
    }
    let reused = ticks.is_some_and(|t| start_ticks(pid).is_some_and(|now| now != t));
    let other_exe = std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|e| !is_dyn(&e));
    reused || other_exe
}

/// The bytes of a small regular file, at most [`STATE_MAX`]: opened without blocking (a FIFO
/// planted there must not park `ps`), never through a symlink where `nofollow`, and read from
/// the descriptor that was checked.
fn read_small(path: &Path, nofollow: bool) -> std::io::Result<Vec<u8>> {
    let mut flags = OFlag::O_NONBLOCK;
    if nofollow {
        flags |= OFlag::O_NOFOLLOW;
    }
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(flags.bits())
        .open(path)?;
    let m = f.metadata()?;
    // (Files under /proc say size 0: the bound is what is read, not what fstat says.)
    if !m.is_file() || m.len() > STATE_MAX {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a regular file of at most 1 MiB",
        ));
    }
    let mut bytes = Vec::new();
    f.take(STATE_MAX + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > STATE_MAX {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "more than 1 MiB",
        ));
    }
    Ok(bytes)
}

/// The state file of a running `dyn graph up`, removed when dropped.
pub struct StateFile {
    path: PathBuf,
    state: Mutex<State>,
}

impl StateFile {
    pub fn create(state: State) -> anyhow::Result<Arc<Self>> {
        let path = state_path(&state.namespace, &state.graph, state.pid)?;
        let f = Arc::new(Self {
            path,
            state: Mutex::new(state),
        });
        f.write();
        Ok(f)
    }

    fn update(&self, f: impl FnOnce(&mut State)) {
        let mut state = self.state.lock();
        f(&mut state);
        self.write_locked(&state);
    }

    fn write(&self) {
        self.write_locked(&self.state.lock());
    }

    /// Called with the state locked, so concurrent updates do not share the temporary file.
    fn write_locked(&self, state: &State) {
        let text = serde_json::to_string_pretty(state).unwrap_or_default();
        // Write then rename, so `ps` never reads half a file.
        let tmp = self.path.with_extension("tmp");
        if let Err(e) =
            write_new(&tmp, text.as_bytes()).and_then(|()| std::fs::rename(&tmp, &self.path))
        {
            tracing::warn!(path = ?self.path, error = %e, "Cannot write the state file");
        }
    }
}

/// Write `bytes` to a file made at `path` (`O_CREAT|O_EXCL|O_NOFOLLOW`, 0600): never through
/// a symlink or into a file that was there. One left by a run that crashed (the same pid
/// later) is removed first: unlinking a name never follows it.
fn write_new(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let open = || {
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(OFlag::O_NOFOLLOW.bits())
            .open(path)
    };
    let mut f = match open() {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            std::fs::remove_file(path)?;
            open()?
        }
        other => other?,
    };
    f.write_all(bytes)
}

impl Drop for StateFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// True while `pid` runs; an exited process its parent has not reaped yet (a zombie) counts
/// as gone.
fn alive(pid: u32) -> bool {
    let exists = i32::try_from(pid).is_ok_and(|p| kill(Pid::from_raw(p), None).is_ok());
    let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // `pid (comm) S …`: the state follows the last `)` (comm may contain spaces).
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
    });
    exists && !zombie
}

fn signal(pid: u32, sig: Signal) {
    if let Ok(p) = i32::try_from(pid) {
        let _ = kill(Pid::from_raw(p), sig);
    }
}

/// One process to supervise: its group, replica, and its `dyn` command.
pub struct Group {
    pub process: String,
    pub replica: u32,
    pub command: ChildCommand,
}

/// A supervised `dyn` process's arguments, and what its environment adds to this process's.
pub struct ChildCommand {
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
}

/// The command of the `dyn` process running replica `replica` of process group `process`.
pub type ArgsFor = Box<dyn Fn(&str, u32) -> ChildCommand + Send + Sync>;

/// A running replica and the switch that stops it.
type Replica = (u32, watch::Sender<bool>);

/// The supervised processes, by group: started at `dyn graph up`, and added or removed by
/// the planner through [`Connector`](dyn_core::Connector).
pub struct Supervisor {
    exe: PathBuf,
    state: Arc<StateFile>,
    args_for: ArgsFor,
    /// Scaled node → its process group.
    groups_of: std::collections::BTreeMap<String, String>,
    /// Running replicas per group, each with the switch that stops it.
    running: Mutex<std::collections::BTreeMap<String, Vec<Replica>>>,
    tasks: Mutex<tokio::task::JoinSet<()>>,
    stopping: std::sync::atomic::AtomicBool,
}

impl Supervisor {
    pub fn new(
        state: Arc<StateFile>,
        args_for: ArgsFor,
        groups_of: std::collections::BTreeMap<String, String>,
    ) -> anyhow::Result<Arc<Self>> {
        Ok(Arc::new(Self {
            exe: std::env::current_exe().context("cannot find the dyn binary")?,
            state,
            args_for,
            groups_of,
            running: Mutex::default(),
            tasks: Mutex::new(tokio::task::JoinSet::new()),
            stopping: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    /// Start replica `replica` of `process` and keep it running until told to stop.
    pub fn start(&self, process: &str, replica: u32) {
        let (tx, rx) = watch::channel(false);
        self.running
            .lock()
            .entry(process.to_owned())
            .or_default()
            .push((replica, tx));
        self.state.update(|s| {
            s.processes.push(ProcState {
                process: process.to_owned(),
                replica,
                pid: None,
                restarts: 0,
                status: "starting".into(),
            })
        });
        let g = Group {
            process: process.to_owned(),
            replica,
            command: (self.args_for)(process, replica),
        };
        self.tasks
            .lock()
            .spawn(keep_running(self.exe.clone(), g, self.state.clone(), rx));
    }

    /// Stop the newest replica of `process` (SIGTERM: it deregisters, drains, exits).
    fn stop_newest(&self, process: &str) -> bool {
        let mut running = self.running.lock();
        let Some(list) = running.get_mut(process) else {
            return false;
        };
        let Some(i) = list
            .iter()
            .enumerate()
            .max_by_key(|(_, (r, _))| *r)
            .map(|(i, _)| i)
        else {
            return false;
        };
        let (replica, stop) = list.remove(i);
        tracing::info!(
            process,
            replica,
            "Scaling down: the process drains and stops"
        );
        let _ = stop.send(true);
        true
    }

    fn count(&self, process: &str) -> u32 {
        let n = self.running.lock().get(process).map_or(0, Vec::len);
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    fn group(&self, node: &str) -> Result<&str, dyn_core::ScaleError> {
        self.groups_of
            .get(node)
            .map(String::as_str)
            .ok_or_else(|| dyn_core::ScaleError::UnknownNode(node.to_owned()))
    }

    /// Run until `shutdown`, then stop every process (each drains) and wait for them.
    pub async fn run(
        &self,
        grace: Duration,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> anyhow::Result<()> {
        shutdown.await;
        tracing::info!("Stopping: every process drains its requests (SIGTERM)");
        self.stopping
            .store(true, std::sync::atomic::Ordering::SeqCst);
        for list in self.running.lock().values() {
            for (_, stop) in list {
                let _ = stop.send(true);
            }
        }
        let mut tasks = std::mem::take(&mut *self.tasks.lock());
        // Each task sends SIGTERM and waits for its process; past the grace, SIGKILL.
        let all = async { while tasks.join_next().await.is_some() {} };
        if tokio::time::timeout(grace + Duration::from_secs(10), all)
            .await
            .is_err()
        {
            tracing::warn!("Processes still running after the grace period; killing them");
            let pids: Vec<u32> = self
                .state
                .state
                .lock()
                .processes
                .iter()
                .filter_map(|p| p.pid)
                .collect();
            for pid in pids {
                signal(pid, Signal::SIGKILL);
            }
            tasks.abort_all();
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl dyn_core::Connector for Supervisor {
    fn name(&self) -> &'static str {
        "processes"
    }

    async fn replicas(&self, node: &str) -> Result<u32, dyn_core::ScaleError> {
        Ok(self.count(self.group(node)?))
    }

    async fn set_replicas(&self, node: &str, n: u32) -> Result<(), dyn_core::ScaleError> {
        let process = self.group(node)?.to_owned();
        if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(());
        }
        while self.count(&process) < n {
            let next = self
                .running
                .lock()
                .get(&process)
                .and_then(|l| l.iter().map(|(r, _)| r + 1).max())
                .unwrap_or(0);
            self.start(&process, next);
        }
        while self.count(&process) > n {
            if !self.stop_newest(&process) {
                break;
            }
        }
        Ok(())
    }
}

async fn keep_running(
    exe: PathBuf,
    g: Group,
    state: Arc<StateFile>,
    mut stop: watch::Receiver<bool>,
) {
    let name = format!("{}.{}", g.process, g.replica);
    let (process, replica) = (g.process.clone(), g.replica);
    let update = |f: &dyn Fn(&mut ProcState)| {
        state.update(|s| {
            if let Some(p) = s
                .processes
                .iter_mut()
                .find(|p| p.process == process && p.replica == replica)
            {
                f(p);
            }
        })
    };
    let mut backoff = Duration::from_millis(500);
    loop {
        if *stop.borrow() {
            break;
        }
        let started = Instant::now();
        let child = tokio::process::Command::new(&exe)
            .args(&g.command.args)
            .envs(g.command.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn();
        let mut child = match child {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(process = %name, error = %e, "Cannot start the process");
                return;
            }
        };
        let pid = child.id();
        update(&|p| {
            p.pid = pid;
            p.status = "running".into();
        });
        tracing::info!(process = %name, pid, "Process started");
        if let Some(out) = child.stdout.take() {
            tokio::spawn(prefix_lines(out, name.clone(), false));
        }
        if let Some(err) = child.stderr.take() {
            tokio::spawn(prefix_lines(err, name.clone(), true));
        }
        let status = tokio::select! {
            s = child.wait() => s,
            _ = stopped(&mut stop) => {
                if let Some(pid) = pid {
                    signal(pid, Signal::SIGTERM);
                }
                update(&|p| p.status = "draining".into());
                let s = child.wait().await;
                tracing::info!(process = %name, status = ?s.as_ref().ok(), "Process stopped");
                break;
            }
        };
        if *stop.borrow() {
            break;
        }
        if started.elapsed() > Duration::from_secs(30) {
            backoff = Duration::from_millis(500);
        }
        let shown = status
            .as_ref()
            .map(|s| s.to_string())
            .unwrap_or_else(|e| e.to_string());
        tracing::warn!(process = %name, status = %shown, restart_in = ?backoff, "Process exited; restarting");
        update(&|p| {
            p.pid = None;
            p.restarts += 1;
            p.status = format!("restarting ({shown})");
        });
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stopped(&mut stop) => break,
        }
        backoff = (backoff * 2).min(Duration::from_secs(10));
    }
    // Stopped (scaled down or shut down): it leaves the state file.
    state.update(|s| {
        s.processes
            .retain(|p| !(p.process == process && p.replica == replica))
    });
}

/// Resolves when this process's parent (the supervisor) has gone: the process was re-parented.
pub async fn parent_gone() {
    let parent = nix::unistd::getppid();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        if nix::unistd::getppid() != parent {
            tracing::warn!("The supervisor is gone; stopping");
            return;
        }
    }
}

/// Resolves once the supervisor is stopping.
async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

async fn prefix_lines(r: impl tokio::io::AsyncRead + Unpin, name: String, stderr: bool) {
    let mut lines = BufReader::new(r).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if stderr {
            eprintln!("[{name}] {line}");
        } else {
            println!("[{name}] {line}");
        }
    }
}

/// Whether the run `s` describes is still going: its pid alive, and the `dyn` process of
/// this user that wrote the file ([`ours_and_dyn`]).
fn is_running(s: &State) -> bool {
    alive(s.pid) && ours_and_dyn(s.pid, s.start_ticks)
}

/// The state files of `graph` whose supervisor is alive; stale ones (and ones naming a
/// process that is not that run's) are removed.
pub fn running(namespace: &str, graph: &str) -> anyhow::Result<Vec<State>> {
    let prefix = format!("{namespace}.{graph}.");
    let Ok(dir) = std::fs::read_dir(run_dir()?) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with(&prefix) || !name.ends_with(".json") {
            continue;
        }
        let Ok(bytes) = read_small(&entry.path(), true) else {
            continue;
        };
        match serde_json::from_slice::<State>(&bytes) {
            Ok(s) if is_running(&s) => out.push(s),
            // A pid that is gone (or another user's: our runs are ours), or that another
            // program took over, is no run of ours any more; one of ours we could not look
            // into (its /proc entries unreadable) may still be one, so its file stays (and it
            // is not listed, or signalled).
            Ok(s) if !alive(s.pid) || ours_and_other(s.pid, s.start_ticks) => {
                tracing::debug!(path = ?entry.path(), pid = s.pid, "A state file of no running dyn; removed");
                let _ = std::fs::remove_file(entry.path());
            }
            Ok(s) => {
                tracing::debug!(path = ?entry.path(), pid = s.pid, "A state file whose process cannot be checked; kept");
            }
            Err(_) => {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    out.sort_by_key(|s| s.pid);
    Ok(out)
}

/// `dyn graph ps`: processes from the state files, instances from etcd.
pub async fn ps(
    namespace: &str,
    graph: &str,
    control: &dyn_runtime::compile::PlaneAddr,
    json: bool,
) -> anyhow::Result<()> {
    let states = running(namespace, graph)?;
    let instances = match control {
        dyn_runtime::compile::PlaneAddr::Etcd(eps) => {
            let prefix = format!("v1/instances/{namespace}/");
            let creds = dyn_runtime::planes::EtcdCredentials::from_env()?;
            let urls = creds.urls(eps);
            Some(
                dyn_runtime::planes::etcd::list_instances(&urls, &creds, &prefix)
                    .await
                    .with_context(|| {
                        format!("cannot list instances in etcd at {}", eps.join(","))
                    })?,
            )
        }
        _ => None,
    };
    if json {
        let v = serde_json::json!({"runs": states, "instances": instances});
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    if states.is_empty() {
        println!(
            "graph {graph} (namespace {namespace}): no `dyn graph up` running on this machine"
        );
    }
    for s in &states {
        println!(
            "graph {} (namespace {}): {} run, pid {}, control {}, events {}, up {} s",
            s.graph,
            s.namespace,
            s.mode,
            s.pid,
            s.control,
            s.events,
            now_unix().saturating_sub(s.started_unix)
        );
        println!(
            "  {:<16} {:>7} {:>8} {:>8}  STATUS",
            "PROCESS", "REPLICA", "PID", "RESTARTS"
        );
        for p in &s.processes {
            let pid = p.pid.map_or("-".into(), |p| p.to_string());
            println!(
                "  {:<16} {:>7} {:>8} {:>8}  {}",
                p.process, p.replica, pid, p.restarts, p.status
            );
        }
    }
    if let Some(list) = instances {
        println!("\nregistered instances ({control}):");
        println!("  {:<16} {:<18} ADDRESS", "NODE", "INSTANCE");
        for i in list {
            let addr = match &i.transport {
                dyn_runtime::planes::Transport::Tcp { address } => address.clone(),
                dyn_runtime::planes::Transport::InProcess => "in-process".into(),
            };
            println!("  {:<16} {:<18x} {addr}", i.component, i.instance_id);
        }
    }
    Ok(())
}

/// `dyn graph down`: SIGTERM every supervisor of the graph on this machine and wait.
pub fn down(namespace: &str, graph: &str, timeout: Duration) -> anyhow::Result<()> {
    let states = running(namespace, graph)?;
    if states.is_empty() {
        println!("graph {graph} (namespace {namespace}) is not running on this machine");
        return Ok(());
    }
    for s in &states {
        // Checked again just before: the process may have gone, and its pid been reused,
        // since the file was read.
        if is_running(s) {
            signal(s.pid, Signal::SIGTERM);
        }
    }
    let deadline = Instant::now() + timeout;
    let mut left: Vec<&State> = states.iter().collect();
    while !left.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        left.retain(|s| is_running(s));
    }
    for s in &states {
        if is_running(s) {
            println!(
                "graph {graph}: pid {} is still draining after {timeout:?}",
                s.pid
            );
        } else {
            println!("graph {graph}: stopped pid {} ({} run)", s.pid, s.mode);
        }
    }
    if left.is_empty() {
        Ok(())
    } else {
        anyhow::bail!("{} run(s) of '{graph}' did not stop in time", left.len())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is a failure report

    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("dyn-procs-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn the_state_directory_is_made_private_and_refused_when_others_may_write_it() {
        let d = scratch("dir");
        let fresh = d.join("dyn-1000");
        private_dir(&fresh).unwrap();
        let mode = std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode & 0o077, 0, "{mode:o}");
        // An existing directory of ours without group or world write is kept.
        std::fs::set_permissions(&fresh, std::fs::Permissions::from_mode(0o755)).unwrap();
        private_dir(&fresh).unwrap();

        let open = d.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = private_dir(&open).unwrap_err().to_string();
        assert!(
            e.contains("may be written by other users (mode 777)"),
            "{e}"
        );
        assert!(e.contains(&open.display().to_string()), "{e}");

        let link = d.join("link");
        std::os::unix::fs::symlink(&fresh, &link).unwrap();
        let e = private_dir(&link).unwrap_err().to_string();
        assert!(e.contains("is a symbolic link"), "{e}");

        let file = d.join("file");
        std::fs::write(&file, b"").unwrap();
        assert!(private_dir(&file).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn state_files_are_written_anew_never_through_a_symlink() {
        let d = scratch("write");
        let target = d.join("target");
        std::fs::write(&target, b"keep").unwrap();
        let tmp = d.join("a.tmp");
        std::os::unix::fs::symlink(&target, &tmp).unwrap();
        write_new(&tmp, b"state").unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        assert_eq!(std::fs::read(&tmp).unwrap(), b"state");
        assert!(
            !std::fs::symlink_metadata(&tmp)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        // A FIFO planted as a state file is refused at once, not waited on.
        let fifo = d.join("g.n.1.json");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert!(read_small(&fifo, true).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn only_this_user_s_dyn_processes_started_when_recorded_are_taken_for_runs() {
        let me = std::process::id();
        let ticks = start_ticks(me).unwrap();
        // This test binary stands for `dyn` here (its own executable's name counts).
        assert!(ours_and_dyn(me, Some(ticks)));
        assert!(ours_and_dyn(me, None));
        // The same pid with another start time: a reused pid.
        assert!(!ours_and_dyn(me, Some(ticks + 1)));
        // A process of this user that is not dyn.
        let mut sleep = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        assert!(!ours_and_dyn(sleep.id(), None));
        assert!(!ours_and_dyn(sleep.id(), start_ticks(sleep.id())));
        let _ = sleep.kill();
        let _ = sleep.wait();
        // A process of another user (init, pid 1, is root's), unless the tests run as root.
        if !nix::unistd::getuid().is_root() {
            assert!(!ours_and_dyn(1, None));
        }
    }
}
