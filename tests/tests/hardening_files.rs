//! Files a request or another user can point `dyn` at must not take it down (issue 51), behind
//! the real binary:
//!
//! - LoRA loads (`/v1/load_lora_adapter`, `graphs/lora.yaml` on models/tiny's native engine)
//!   of a config that is `/dev/zero`, a FIFO, or a 1 GiB sparse file, of weights that are
//!   `/dev/zero`, and of paths that are missing or a file where a directory should be, are
//!   each answered with the same 400 (the log says why), promptly enough that a bounded
//!   client never gives up; the server then still answers a chat request, with its memory
//!   (VmRSS) far below what reading any of those files would take. Files swapped for
//!   `/dev/zero` after a load was checked are refused when the worker reads them, and an
//!   adapter in the graph that is a FIFO fails `dyn graph up` instead of hanging it.
//! - The state directory: with no `DYN_RUN_DIR` or `XDG_RUNTIME_DIR`, a `dyn-UID` directory
//!   under `$TMPDIR` that others may write, or that is a symlink, makes `dyn graph up`, `ps`
//!   and `down` refuse, naming it; a state file naming a process that is not `dyn` (a `sleep`)
//!   is not signalled by `dyn graph down`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use dyn_tests::{Graph, dyn_cmd, root, scratch_dir};
use serde_json::{Value, json};

/// A client bound that only ends a hang (a FIFO read by the server would never answer): far
/// above any answer's time on a loaded machine, and no assertion on time.
const HANG: Duration = Duration::from_secs(120);

/// The most memory the server may hold after the refused loads: the tiny model's process
/// takes tens of MiB; reading the sparse config alone would take 1 GiB.
const RSS_MAX: u64 = 512 << 20;

fn mkfifo(path: &Path) {
    nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
}

/// A copy of models/tiny-lora/`name` in `dir`: a good adapter whose files a test may swap.
fn copy_adapter(name: &str, dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(
            root().join("models/tiny-lora").join(name).join(f),
            dir.join(f),
        )
        .unwrap();
    }
}

/// POST `body` to `url` with the hang bound: the status and the JSON answer.
async fn post(client: &reqwest::Client, url: &str, body: &Value) -> (u16, Value) {
    let r = client
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url} {body}: no answer: {e}"));
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// A chat request the server must still answer.
async fn chat_answers(client: &reqwest::Client, g: &Graph, after: &str) {
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hello"}],
                      "max_tokens": 4});
    let (status, v) = post(client, &g.url("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "after {after}: {v}");
    assert!(v["choices"][0]["message"].is_object(), "after {after}: {v}");
    let rss = dyn_tests::rss_bytes(g.pid());
    assert!(rss < RSS_MAX, "after {after}: VmRSS {} MiB", rss >> 20);
}

#[tokio::test(flavor = "multi_thread")]
async fn lora_loads_of_what_is_no_adapter_are_refused_alike_and_the_server_keeps_serving() {
    let d = scratch_dir("hardening-lora");
    // adapter_config.json → /dev/zero (endless).
    let zero = d.join("zero");
    std::fs::create_dir(&zero).unwrap();
    std::os::unix::fs::symlink("/dev/zero", zero.join("adapter_config.json")).unwrap();
    // adapter_config.json a FIFO no one writes (a blocking open waits for ever).
    let fifo = d.join("fifo");
    std::fs::create_dir(&fifo).unwrap();
    mkfifo(&fifo.join("adapter_config.json"));
    // A 1 GiB sparse config (nothing on disk, 1 GiB to read).
    let sparse = d.join("sparse");
    std::fs::create_dir(&sparse).unwrap();
    std::fs::File::create(sparse.join("adapter_config.json"))
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    // A good config, weights that are /dev/zero.
    let weights = d.join("weights");
    copy_adapter("qv", &weights);
    std::fs::remove_file(weights.join("adapter_model.safetensors")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", weights.join("adapter_model.safetensors")).unwrap();
    // GGUF adapters (by extension): a FIFO and /dev/zero.
    let fifo_gguf = d.join("fifo.gguf");
    mkfifo(&fifo_gguf);
    let zero_gguf = d.join("zero.gguf");
    std::os::unix::fs::symlink("/dev/zero", &zero_gguf).unwrap();
    // Nothing there, and a file where a directory should be: answered alike.
    let missing = d.join("missing");
    let plain = d.join("plain");
    std::fs::write(&plain, b"not a directory").unwrap();
    // A directory whose name holds a newline: its log line cannot be forged.
    let forged = d.join("x\nforged log line");
    std::fs::create_dir(&forged).unwrap();

    let g = Graph::up_with_ingress("graphs/lora.yaml", "http", &[]);
    let client = reqwest::Client::builder().timeout(HANG).build().unwrap();
    let load = g.url("/v1/load_lora_adapter");
    let cases: [(&str, &PathBuf); 9] = [
        ("config /dev/zero", &zero),
        ("config FIFO", &fifo),
        ("sparse 1 GiB config", &sparse),
        ("weights /dev/zero", &weights),
        ("GGUF FIFO", &fifo_gguf),
        ("GGUF /dev/zero", &zero_gguf),
        ("missing path", &missing),
        ("file, not a directory", &plain),
        ("name with a newline", &forged),
    ];
    let mut first: Option<Value> = None;
    for (i, (what, path)) in cases.iter().enumerate() {
        let body = json!({"lora_name": format!("bad{i}"), "lora_path": path.display().to_string()});
        let (status, v) = post(&client, &load, &body).await;
        assert_eq!(status, 400, "{what}: {v}");
        assert_eq!(v["error"]["param"], "lora_path", "{what}: {v}");
        // One answer for every path: it says nothing of the server's disk.
        match &first {
            None => first = Some(v["error"].clone()),
            Some(f) => assert_eq!(&v["error"], f, "{what}"),
        }
        chat_answers(&client, &g, what).await;
    }
    let msg = first.unwrap()["message"].as_str().unwrap().to_owned();
    assert!(
        msg.starts_with("lora_path is not a LoRA adapter this server can read"),
        "{msg}"
    );
    assert!(
        !msg.contains("No such file") && !msg.contains("directory:"),
        "{msg}"
    );
    // The log has each reason, the path escaped.
    let refusals: Vec<Value> = g
        .logs()
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(dyn_tests::unprefixed(l)).ok())
        .filter(|v| v["message"] == "Not loading a LoRA adapter")
        .collect();
    let said = |needle: &str| {
        refusals
            .iter()
            .any(|v| v["error"].as_str().unwrap_or_default().contains(needle))
    };
    for reason in [
        "a character device, not a regular file",
        "a FIFO, not a regular file",
        "1073741824 bytes, more than",
        "Not a directory",
        "No such file",
    ] {
        assert!(said(reason), "no refusal logged {reason:?}: {refusals:?}");
    }
    let forged_line = refusals
        .iter()
        .find(|v| v["path"].as_str().unwrap_or_default().contains("forged"))
        .unwrap_or_else(|| panic!("the newline path's refusal: {refusals:?}"));
    let shown = forged_line["path"].as_str().unwrap();
    assert!(
        shown.contains("x\\nforged") && !shown.contains('\n'),
        "{shown:?}"
    );

    // Checked when loaded, then swapped for /dev/zero: the worker of this one-process graph
    // runs the copy the ingress read to check it (handed over, so the files are read once),
    // which is the version the request names, and the swapped files are never read. (A
    // worker that must read them, elsewhere or once the hand-over lapsed, refuses them as
    // unreadable: `dyn_engine::lora`'s tests.) The server goes on either way.
    let swapped = d.join("swapped");
    copy_adapter("qv", &swapped);
    let body = json!({"lora_name": "swapped", "lora_path": swapped.display().to_string()});
    let (status, v) = post(&client, &load, &body).await;
    assert_eq!(status, 200, "{v}");
    std::fs::remove_file(swapped.join("adapter_model.safetensors")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", swapped.join("adapter_model.safetensors")).unwrap();
    let (status, v) = post(
        &client,
        &g.url("/v1/completions"),
        &json!({"model": "swapped", "prompt": "Hello", "max_tokens": 4}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    chat_answers(&client, &g, "an adapter swapped for /dev/zero").await;
    let _ = std::fs::remove_dir_all(&d);
}

/// Wait (with a bound that only ends a hang) for a `dyn` started with `cmd` to exit: its
/// output.
fn finishes(mut cmd: Command) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > HANG {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("dyn did not exit: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn an_adapter_in_the_graph_that_is_a_fifo_fails_start_up_instead_of_hanging_it() {
    let d = scratch_dir("hardening-graph-fifo");
    mkfifo(&d.join("adapter_config.json"));
    let mut cmd = dyn_cmd();
    cmd.args(["graph", "up", "graphs/lora.yaml"])
        .args(["--set", "http.listen=127.0.0.1:0"])
        .args(["--set", &format!("model.loras.bad={}", d.display())]);
    let out = finishes(cmd);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("a FIFO, not a regular file"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

/// `dyn ARGS…` with no run directory set and `TMPDIR` at `tmp`.
fn dyn_in_tmp(tmp: &Path, args: &[&str]) -> Command {
    let mut c = dyn_cmd();
    c.args(args)
        .env_remove("DYN_RUN_DIR")
        .env_remove("XDG_RUNTIME_DIR")
        .env("TMPDIR", tmp);
    c
}

#[test]
fn a_state_directory_others_may_write_or_a_symlink_is_refused() {
    let tmp = scratch_dir("hardening-state-dir");
    let dir = tmp.join(format!("dyn-{}", nix::unistd::getuid()));
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let up = [
        "graph",
        "up",
        "graphs/agg.yaml",
        "--set",
        "http.listen=127.0.0.1:0",
    ];
    let commands: [&[&str]; 3] = [
        &up,
        &["graph", "ps", "graphs/agg.yaml"],
        &["graph", "down", "graphs/agg.yaml"],
    ];
    for args in commands {
        let out = finishes(dyn_in_tmp(&tmp, args));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {err}");
        assert!(
            err.contains(&dir.display().to_string())
                && err.contains("may be written by other users (mode 777)"),
            "{args:?}: {err}"
        );
    }
    // A symlink to a directory of this user's is refused too: it may have been planted.
    std::fs::remove_dir(&dir).unwrap();
    let elsewhere = tmp.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &dir).unwrap();
    for args in commands {
        let out = finishes(dyn_in_tmp(&tmp, args));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {err}");
        assert!(err.contains("is a symbolic link"), "{args:?}: {err}");
    }
    assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
    // Once it is gone, dyn makes its own, private.
    std::fs::remove_file(&dir).unwrap();
    let out = finishes(dyn_in_tmp(&tmp, &["graph", "ps", "graphs/agg.yaml"]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mode = std::fs::symlink_metadata(&dir)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "{mode:o}");
    let _ = std::fs::remove_dir_all(&tmp);
}

/// A `/proc/PID/stat` start time, as dyn records it.
fn start_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let (_, rest) = stat.rsplit_once(')').unwrap();
    rest.split_whitespace().nth(19).unwrap().parse().unwrap()
}

#[test]
fn a_state_file_naming_a_process_that_is_not_dyn_is_not_signalled() {
    let run = scratch_dir("hardening-state-file");
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700)).unwrap();
    let mut sleep = Command::new("sleep").arg("600").spawn().unwrap();
    let pid = sleep.id();
    // What a `dyn graph up` of graphs/agg.yaml writes, naming the sleep, with its very start
    // time: only its executable gives it away.
    let state = json!({
        "graph": "agg", "namespace": "dyn", "pid": pid, "mode": "embedded",
        "control": "embedded", "events": "embedded", "started_unix": 0,
        "start_ticks": start_ticks(pid), "processes": [],
    });
    std::fs::write(run.join(format!("dyn.agg.{pid}.json")), state.to_string()).unwrap();
    let dyn_run = |args: &[&str]| {
        let mut c = dyn_cmd();
        c.args(args).env("DYN_RUN_DIR", &run);
        finishes(c)
    };
    let out = dyn_run(&["graph", "ps", "graphs/agg.yaml"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("no `dyn graph up` running"), "{text}");
    // The pid is verifiably another program's: the file is no run's and goes.
    let file = run.join(format!("dyn.agg.{pid}.json"));
    assert!(!file.exists(), "the stale state file stays");
    std::fs::write(&file, state.to_string()).unwrap();
    let out = dyn_run(&["graph", "down", "graphs/agg.yaml", "--timeout", "1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("is not running on this machine"), "{text}");
    assert!(
        sleep.try_wait().unwrap().is_none(),
        "dyn graph down signalled a process that is not dyn"
    );
    let _ = sleep.kill();
    let _ = sleep.wait();

    // A real run in the same directory is still found and stopped.
    let g = Graph::start(
        "graphs/agg.yaml",
        "http",
        &[],
        &[("DYN_RUN_DIR", run.to_str().unwrap())],
    );
    let out = dyn_run(&["graph", "down", "graphs/agg.yaml"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains(&format!("stopped pid {}", g.pid())), "{text}");
    assert_eq!(g.wait(HANG), Some(0));
    let _ = std::fs::remove_dir_all(&run);
}
