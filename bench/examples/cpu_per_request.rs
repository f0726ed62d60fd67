//! CPU cost per request of a running `dyn graph up` process, split into the frontend path and
//! the mocker workers (threads named `mocker-N`), under a closed-loop streaming chat load.
//!
//! A stopgap measurement tool until `dyn bench` lands; it reads per-thread CPU time from
//! `/proc/PID/task/*/stat` before and after the load.
//!
//! ```text
//! cargo run --release -p dyn-bench --example cpu_per_request -- \
//!     --url http://127.0.0.1:8000 --pid PID [--concurrency 64] [--requests 2000] [--isl 512] [--osl 64]
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)] // a measurement script: fail loudly

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use serde_json::json;

struct Args {
    url: String,
    pid: u32,
    concurrency: usize,
    requests: usize,
    isl: usize,
    osl: u32,
}

fn args() -> Result<Args> {
    let mut a = Args {
        url: "http://127.0.0.1:8000".into(),
        pid: 0,
        concurrency: 64,
        requests: 2000,
        isl: 512,
        osl: 64,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().with_context(|| format!("{k} needs a value"))?;
        match k.as_str() {
            "--url" => a.url = v,
            "--pid" => a.pid = v.parse()?,
            "--concurrency" => a.concurrency = v.parse()?,
            "--requests" => a.requests = v.parse()?,
            "--isl" => a.isl = v.parse()?,
            "--osl" => a.osl = v.parse()?,
            _ => bail!("unknown argument {k}"),
        }
    }
    if a.pid == 0 {
        bail!("--pid PID of the dyn process is required");
    }
    Ok(a)
}

/// CPU seconds per thread name group: `mocker` or `frontend` (everything else).
fn cpu(pid: u32) -> Result<HashMap<&'static str, f64>> {
    let tick = 100.0; // USER_HZ on Linux
    let mut out = HashMap::from([("mocker", 0.0), ("frontend", 0.0)]);
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let stat = std::fs::read_to_string(task?.path().join("stat"))?;
        let (name, rest) = stat
            .split_once(" (")
            .and_then(|(_, r)| r.rsplit_once(") "))
            .context("stat")?;
        let f: Vec<&str> = rest.split(' ').collect();
        let secs = (f[11].parse::<f64>()? + f[12].parse::<f64>()?) / tick;
        *out.get_mut(if name.starts_with("mocker") {
            "mocker"
        } else {
            "frontend"
        })
        .unwrap() += secs;
    }
    Ok(out)
}

/// A user message that is `isl` tokens once the chat template is applied (the template adds a
/// fixed number of tokens; `salt` makes each prompt distinct so the prefix cache stays cold).
fn prompt(tok: &tokenizers::Tokenizer, isl: usize, salt: usize) -> String {
    let base = std::fs::read_to_string("models/tiny/corpus.txt").unwrap();
    let ids = tok
        .encode(format!("{salt} {}", base.repeat(4)), false)
        .unwrap()
        .get_ids()
        .to_vec();
    let overhead = 16; // what the tiny chat template adds around the message
    tok.decode(&ids[..isl.saturating_sub(overhead)], false)
        .unwrap()
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = args()?;
    let tok = tokenizers::Tokenizer::from_file("models/tiny/tokenizer.json")
        .map_err(anyhow::Error::msg)?;
    let prompts: Arc<Vec<String>> =
        Arc::new((0..a.requests).map(|i| prompt(&tok, a.isl, i)).collect());
    let client = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", a.url);
    let next = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(AtomicUsize::new(0));
    let prompt_tokens = Arc::new(AtomicUsize::new(0));

    let before = cpu(a.pid)?;
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..a.concurrency {
        let (client, url, next, prompts, tokens, prompt_tokens) = (
            client.clone(),
            url.clone(),
            next.clone(),
            prompts.clone(),
            tokens.clone(),
            prompt_tokens.clone(),
        );
        let osl = a.osl;
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(p) = prompts.get(i) else { return Ok::<_, anyhow::Error>(()) };
                let body = json!({"model": "tiny", "messages": [{"role": "user", "content": p}], "max_tokens": osl, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}});
                let resp = client.post(&url).json(&body).send().await?;
                if !resp.status().is_success() {
                    bail!("{}: {}", resp.status(), resp.text().await?);
                }
                let mut body = resp.bytes_stream();
                let mut buf = Vec::new();
                while let Some(chunk) = body.next().await {
                    buf.extend_from_slice(&chunk?);
                }
                let text = String::from_utf8_lossy(&buf);
                let usage = text.lines().filter_map(|l| l.strip_prefix("data: ")).filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok()).find(|v| v["usage"].is_object()).context("no usage")?;
                tokens.fetch_add(usage["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize, Ordering::Relaxed);
                prompt_tokens.fetch_add(usage["usage"]["prompt_tokens"].as_u64().unwrap_or(0) as usize, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    let wall = start.elapsed().as_secs_f64();
    let after = cpu(a.pid)?;
    let n = a.requests as f64;
    let ms = |k: &str| (after[k] - before[k]) * 1000.0 / n;
    println!("requests            {}", a.requests);
    println!("concurrency         {}", a.concurrency);
    println!(
        "mean prompt tokens  {:.0}",
        prompt_tokens.load(Ordering::Relaxed) as f64 / n
    );
    println!(
        "mean output tokens  {:.0}",
        tokens.load(Ordering::Relaxed) as f64 / n
    );
    println!("wall                {wall:.2} s");
    println!("requests/s          {:.1}", n / wall);
    println!(
        "output tokens/s     {:.0}",
        tokens.load(Ordering::Relaxed) as f64 / wall
    );
    println!(
        "CPU ms/request      frontend {:.3}  workers {:.3}  total {:.3}",
        ms("frontend"),
        ms("mocker"),
        ms("frontend") + ms("mocker")
    );
    Ok(())
}
