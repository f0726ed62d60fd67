//! Drives the load: warm-up, then a closed loop (N workers, each sending its next request when
//! the previous one ends) or an open loop (requests sent on a schedule, whatever the server's
//! state), collecting one [`Record`] per request sent.
//!
//! The open-loop schedule runs on its own OS thread and sleeps with `std::thread::sleep`:
//! tokio's timer rounds every sleep up to the next millisecond, which alone would make a
//! 2,000 requests/s schedule up to a millisecond late. Each request is then a task on the
//! runtime; how late it really started (`sent − intended`) is recorded and reported as
//! `schedule_lag_ms`, and latencies count from the intended time.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value, json};
use tokenizers::Tokenizer;
use tokio::sync::mpsc;

use crate::Error;
use crate::arrival::{Arrival, Rate, Schedule};
use crate::client::{Client, Job, Live};
use crate::dataset::{Entry, Prompt};
use crate::metrics::{Record, Slo, Summary, summarize};

/// The API the requests go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/completions`
    Completions,
}

impl Endpoint {
    fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }
}

/// How requests are paced.
#[derive(Debug, Clone, PartialEq)]
pub enum Load {
    /// Closed loop: this many requests in flight at all times.
    Concurrency(usize),
    /// Open loop at `rate` requests per second.
    Rate {
        rate: Rate,
        arrival: Arrival,
        burstiness: f64,
    },
    /// Open loop on the dataset's own timestamps (trace replay).
    Trace,
}

/// When the measured phase ends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Stop {
    /// After this many requests have been sent (and have finished).
    Requests(usize),
    /// No new request after this long; in-flight ones finish.
    Duration(Duration),
}

/// A benchmark run.
#[derive(Debug, Clone)]
pub struct Config {
    /// Server base URL, e.g. `http://127.0.0.1:8000`.
    pub url: String,
    /// Model name; `None` asks the server's `/v1/models` and takes the first.
    pub model: Option<String>,
    pub endpoint: Endpoint,
    pub load: Load,
    pub stop: Stop,
    /// Requests sent (closed loop) and discarded before measuring.
    pub warmup: usize,
    /// Send `ignore_eos: true` so every answer is `max_tokens` long.
    pub ignore_eos: bool,
    /// Fields added to every request body (`--extra-inputs`), over the ones set here.
    pub extra: serde_json::Map<String, Value>,
    /// `(priority, weight)`: each request gets vLLM's `priority` field drawn by these weights
    /// (`--priority-mix`), and the summary has each priority's figures; empty: none sent.
    pub priority_mix: Vec<(i32, f64)>,
    /// `(tenant, weight)`: each request names a tenant drawn by these weights in
    /// `tenant_header` (`--tenants`), and the summary has each tenant's figures; empty: none.
    pub tenants: Vec<(String, f64)>,
    pub tenant_header: String,
    pub api_key: Option<String>,
    /// Per-request limit; a request over it counts as a `timeout` error.
    pub timeout: Duration,
    pub seed: u64,
    pub slo: Option<Slo>,
    /// Show a progress bar on stderr (hidden anyway when stderr is not a terminal).
    pub progress: bool,
    /// Sample the server's SLA planner during the run (see [`crate::planner`]).
    pub planner: bool,
}

/// A finished run.
pub struct Outcome {
    pub summary: Summary,
    /// One per request sent in the measured phase, in send order.
    pub records: Vec<Record>,
    /// With [`Config::planner`]: the planner's replicas over the run.
    pub planner: Vec<crate::planner::PlannerSample>,
}

/// Run the benchmark over `entries` (cycled when more requests are asked for than there are
/// entries). `tokenizer` counts output tokens when the server reports no usage. Setting
/// `interrupted` (see [`interrupt_on_ctrl_c`]) stops new requests; those in flight finish and
/// the run is summarized.
pub async fn run(
    cfg: &Config,
    entries: &[Entry],
    tokenizer: Option<Arc<Tokenizer>>,
    interrupted: &Arc<AtomicBool>,
) -> Result<Outcome, Error> {
    if entries.is_empty() {
        return Err(Error::Invalid("the dataset is empty".into()));
    }
    let base = cfg.url.trim_end_matches('/').to_owned();
    let model = match &cfg.model {
        Some(m) => m.clone(),
        None => first_model(&base, cfg.api_key.as_deref()).await?,
    };
    let priorities = draw(&cfg.priority_mix, cfg.seed ^ 0x7072_696f, entries.len());
    let tenants: Vec<Option<Arc<str>>> = draw(&cfg.tenants, cfg.seed ^ 0x7465_6e61, entries.len())
        .into_iter()
        .map(|t| t.map(Arc::from))
        .collect();
    // Several models (a model and its LoRA adapters) take turns, request by request.
    let models: Vec<&str> = model.split(',').map(str::trim).collect();
    let bodies = entries
        .iter()
        .zip(&priorities)
        .enumerate()
        .map(|(i, (e, p))| body(cfg, models[i % models.len()], e, *p))
        .collect::<Result<Vec<_>, _>>()?;
    let client = Client::new(
        format!("{base}{}", cfg.endpoint.path()),
        cfg.api_key.clone(),
        cfg.tenant_header.clone(),
        tokenizer,
        cfg.timeout,
    )
    .map_err(|e| Error::Invalid(format!("cannot build the HTTP client: {e}")))?;
    let dataset = Arc::new(Dataset::new(cfg, bodies, entries, priorities, tenants));
    let pace = pace(cfg, &dataset)?;
    if cfg.warmup > 0 {
        warm_up(cfg, &client, &dataset, interrupted).await;
    }

    let stop = match (&cfg.load, cfg.stop) {
        // A trace replays once unless fewer requests are asked for.
        (Load::Trace, Stop::Requests(n)) => Stop::Requests(n.min(entries.len())),
        (_, s) => s,
    };
    let measured = measure(cfg, &base, &client, dataset, pace, stop, interrupted).await;
    let summary = summarize_run(cfg, &model, entries.len(), &measured, interrupted);
    Ok(Outcome {
        summary,
        records: measured.records,
        planner: measured.planner,
    })
}

/// How the measured phase paces its requests.
fn pace(cfg: &Config, dataset: &Dataset) -> Result<Pace, Error> {
    Ok(match &cfg.load {
        Load::Concurrency(0) => {
            return Err(Error::Invalid("--concurrency must be at least 1".into()));
        }
        Load::Concurrency(n) => Pace::Closed(*n),
        Load::Rate {
            rate,
            arrival,
            burstiness,
        } => Pace::Open(Box::new(
            Schedule::with_rate(rate.clone(), *arrival, *burstiness, cfg.seed)
                .map_err(Error::Invalid)?,
        )),
        Load::Trace => {
            let times: Vec<Duration> = dataset.at.iter().map(|t| t.unwrap_or_default()).collect();
            Pace::Open(Box::new(times.into_iter()))
        }
    })
}

/// `cfg.warmup` requests, closed loop from the dataset's first entry; only their failures
/// are told.
async fn warm_up(cfg: &Config, client: &Client, dataset: &Dataset, interrupted: &Arc<AtomicBool>) {
    let width = match cfg.load {
        Load::Concurrency(n) => n,
        _ => 8,
    };
    let warm = Arc::new(Dataset {
        offset: 0,
        ..dataset.clone()
    });
    let records = phase(
        client,
        warm,
        Pace::Closed(width.clamp(1, cfg.warmup)),
        Stop::Requests(cfg.warmup),
        ProgressBar::hidden(),
        interrupted,
    )
    .await;
    let failed = records.iter().filter(|r| r.error.is_some()).count();
    if failed > 0 {
        tracing::warn!(failed, warmup = cfg.warmup, "Warm-up requests failed");
    }
}

/// What the measured phase gives besides its summary.
struct Measured {
    records: Vec<Record>,
    /// CPU seconds the client used during the phase.
    cpu: f64,
    planner: Vec<crate::planner::PlannerSample>,
}

/// The measured phase, with the client's CPU time over it and, with `cfg.planner`, the
/// planner sampled alongside.
async fn measure(
    cfg: &Config,
    base: &str,
    client: &Client,
    dataset: Arc<Dataset>,
    pace: Pace,
    stop: Stop,
    interrupted: &Arc<AtomicBool>,
) -> Measured {
    let bar = progress_bar(cfg.progress, stop);
    let cpu0 = cpu_seconds();
    let sampled = Arc::new(AtomicBool::new(false));
    let sampler = cfg.planner.then(|| {
        tokio::spawn(crate::planner::sample(
            base.to_owned(),
            std::time::Instant::now(),
            sampled.clone(),
        ))
    });
    let records = phase(client, dataset, pace, stop, bar, interrupted).await;
    let cpu = cpu_seconds().zip(cpu0).map_or(0.0, |(b, a)| b - a);
    sampled.store(true, Ordering::Relaxed);
    let planner = match sampler {
        Some(task) => task.await.unwrap_or_default(),
        None => Vec::new(),
    };
    Measured {
        records,
        cpu,
        planner,
    }
}

/// The measured phase's summary, with what the records alone do not say.
fn summarize_run(
    cfg: &Config,
    model: &str,
    entries: usize,
    measured: &Measured,
    interrupted: &AtomicBool,
) -> Summary {
    let records = &measured.records;
    let mut summary = summarize(records, cfg.slo.as_ref());
    summary.client_cpu_s = measured.cpu;
    summary.interrupted = interrupted.load(Ordering::Relaxed);
    summary.config = describe(cfg, model, entries);
    if cfg.planner {
        let end = records
            .iter()
            .map(|r| r.end.as_secs_f64())
            .fold(0.0, f64::max);
        summary.replica_seconds = Some(crate::planner::replica_seconds(&measured.planner, end));
    }
    summary
}

/// Request bodies and what the dataset knows, shared by the sending tasks.
#[derive(Clone)]
struct Dataset {
    bodies: Vec<Bytes>,
    priorities: Vec<Option<i32>>,
    tenants: Vec<Option<Arc<str>>>,
    sessions: Vec<Option<Arc<str>>>,
    input_tokens: Vec<Option<usize>>,
    at: Vec<Option<Duration>>,
    offset: usize,
}

impl Dataset {
    fn new(
        cfg: &Config,
        bodies: Vec<Bytes>,
        entries: &[Entry],
        priorities: Vec<Option<i32>>,
        tenants: Vec<Option<Arc<str>>>,
    ) -> Dataset {
        Dataset {
            bodies,
            priorities,
            tenants,
            sessions: entries
                .iter()
                .map(|e| e.session.as_deref().map(Arc::from))
                .collect(),
            input_tokens: entries.iter().map(|e| e.input_tokens).collect(),
            at: entries.iter().map(|e| e.at).collect(),
            // Measured requests start after the warm-up's entries, except in a trace replay,
            // which must start at its first line.
            offset: if cfg.load == Load::Trace {
                0
            } else {
                cfg.warmup
            },
        }
    }

    fn job(&self, index: usize, intended: Option<Duration>) -> Job {
        let i = (self.offset + index) % self.bodies.len();
        Job {
            index,
            body: self.bodies[i].clone(),
            input_tokens: self.input_tokens[i],
            intended,
            priority: self.priorities[i],
            tenant: self.tenants[i].clone(),
            session: self.sessions[i].clone(),
        }
    }
}

enum Pace {
    Closed(usize),
    /// Intended send offsets, in order.
    Open(Box<dyn Iterator<Item = Duration> + Send>),
}

/// Run one phase to its stop condition and return its records sorted by index.
async fn phase(
    client: &Client,
    dataset: Arc<Dataset>,
    pace: Pace,
    stop: Stop,
    bar: ProgressBar,
    interrupted: &Arc<AtomicBool>,
) -> Vec<Record> {
    let live = Arc::new(Live::default());
    // Bounded: the collector below drains it as fast as records arrive.
    let (tx, mut rx) = mpsc::channel::<Record>(1024);
    let t0 = Instant::now();
    let (limit, deadline) = match stop {
        Stop::Requests(n) => (n, None),
        Stop::Duration(d) => (usize::MAX, Some(d)),
    };
    let senders = Senders {
        client: client.clone(),
        dataset,
        live: live.clone(),
        tx,
        t0,
        limit,
        deadline,
        stopped: interrupted.clone(),
    };
    // Each takes `senders` (its `tx` among them): the channel closes when the last request
    // is done.
    match pace {
        Pace::Closed(n) => senders.spawn_workers(n),
        Pace::Open(times) => senders.spawn_schedule(times),
    }

    let ticker = spawn_ticker(bar.clone(), live, t0, deadline);
    let mut records = Vec::new();
    while let Some(r) = rx.recv().await {
        records.push(r);
    }
    ticker.abort();
    bar.finish_and_clear();
    records.sort_by_key(|r| r.index);
    records
}

/// What a phase's senders share: the client, the requests, where their records go, and
/// when to stop sending (`limit` requests, the `deadline` after `t0`, or `stopped`).
struct Senders {
    client: Client,
    dataset: Arc<Dataset>,
    live: Arc<Live>,
    tx: mpsc::Sender<Record>,
    t0: Instant,
    limit: usize,
    deadline: Option<Duration>,
    stopped: Arc<AtomicBool>,
}

impl Senders {
    /// Closed loop: `n` tasks, each sending its next request when the previous one ends.
    fn spawn_workers(self, n: usize) {
        let Senders {
            client,
            dataset,
            live,
            tx,
            t0,
            limit,
            deadline,
            stopped,
        } = self;
        let next = Arc::new(AtomicUsize::new(0));
        for _ in 0..n {
            let (client, dataset, live, tx, next, stopped) = (
                client.clone(),
                dataset.clone(),
                live.clone(),
                tx.clone(),
                next.clone(),
                stopped.clone(),
            );
            tokio::spawn(async move {
                loop {
                    if deadline.is_some_and(|d| t0.elapsed() >= d)
                        || stopped.load(Ordering::Relaxed)
                    {
                        break;
                    }
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= limit {
                        break;
                    }
                    let rec = client.send(dataset.job(i, None), t0, &live).await;
                    if tx.send(rec).await.is_err() {
                        break;
                    }
                }
            });
        }
    }

    /// Open loop: a thread that sends each request at its time in `times`, as a task on the
    /// runtime.
    fn spawn_schedule(self, times: Box<dyn Iterator<Item = Duration> + Send>) {
        let Senders {
            client,
            dataset,
            live,
            tx,
            t0,
            limit,
            deadline,
            stopped,
        } = self;
        let rt = tokio::runtime::Handle::current();
        let spawned = std::thread::Builder::new()
            .name("bench-schedule".into())
            .spawn(move || {
                for (i, at) in times.enumerate().take(limit) {
                    if deadline.is_some_and(|d| at >= d) {
                        break;
                    }
                    // Sleep in slices so an interrupt is seen during a long gap in a trace;
                    // the last slice ends exactly on time.
                    let target = t0 + at;
                    loop {
                        let now = Instant::now();
                        if stopped.load(Ordering::Relaxed) || now >= target {
                            break;
                        }
                        std::thread::sleep((target - now).min(Duration::from_millis(50)));
                    }
                    if stopped.load(Ordering::Relaxed) {
                        break;
                    }
                    let (client, live, tx) = (client.clone(), live.clone(), tx.clone());
                    let job = dataset.job(i, Some(at));
                    rt.spawn(async move {
                        let rec = client.send(job, t0, &live).await;
                        let _ = tx.send(rec).await;
                    });
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "Cannot start the schedule thread");
        }
    }
}

/// Update the progress bar every 250 ms: requests done (or seconds, with a `deadline`),
/// errors, and the recent token rate.
fn spawn_ticker(
    bar: ProgressBar,
    live: Arc<Live>,
    t0: Instant,
    deadline: Option<Duration>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        let mut window = std::collections::VecDeque::from([(Instant::now(), 0u64)]);
        loop {
            tick.tick().await;
            let now = Instant::now();
            let tokens = live.tokens.load(Ordering::Relaxed);
            window.push_back((now, tokens));
            // Tokens per second over the last two seconds.
            while window.len() > 2 && now - window[0].0 > Duration::from_secs(2) {
                window.pop_front();
            }
            let (t, n) = window[0];
            let rate = (tokens - n) as f64 / (now - t).as_secs_f64().max(1e-3);
            let done = live.done.load(Ordering::Relaxed);
            let errors = live.errors.load(Ordering::Relaxed);
            match deadline {
                Some(_) => {
                    bar.set_position(t0.elapsed().as_secs());
                    bar.set_message(format!("{done} done, {errors} errors, {rate:.0} tokens/s"));
                }
                None => {
                    bar.set_position(done);
                    bar.set_message(format!("{errors} errors, {rate:.0} tokens/s"));
                }
            }
        }
    })
}

/// A flag the first Ctrl-C sets (stop sending, summarize what was sent); a second Ctrl-C
/// exits at once. Call inside a tokio runtime, once per process.
pub fn interrupt_on_ctrl_c() -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let set = flag.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_err() {
            return;
        }
        set.store(true, Ordering::Relaxed);
        eprintln!("interrupted: waiting for requests in flight (Ctrl-C again to quit)");
        if tokio::signal::ctrl_c().await.is_ok() {
            std::process::exit(130);
        }
    });
    flag
}

fn progress_bar(show: bool, stop: Stop) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let (len, template) = match stop {
        Stop::Requests(n) => (
            n as u64,
            "{elapsed_precise} [{bar:25}] {pos}/{len} done, {msg}",
        ),
        Stop::Duration(d) => (
            d.as_secs().max(1),
            "{elapsed_precise} [{bar:25}] {pos}/{len} s, {msg}",
        ),
    };
    let bar = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Each of `n` entries' class (a priority, a tenant), drawn by `mix`'s weights with `seed`
/// (so reruns send the same classes); all `None` without a mix.
fn draw<T: Clone>(mix: &[(T, f64)], seed: u64, n: usize) -> Vec<Option<T>> {
    use rand::{Rng, SeedableRng};
    let total: f64 = mix.iter().map(|(_, w)| w).sum();
    if mix.is_empty() || total <= 0.0 {
        return vec![None; n];
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let mut u = rng.random::<f64>() * total;
            for (p, w) in mix {
                if u < *w {
                    return Some(p.clone());
                }
                u -= w;
            }
            mix.last().map(|(p, _)| p.clone())
        })
        .collect()
}

/// The JSON body of one request, serialized once before the run.
fn body(cfg: &Config, model: &str, e: &Entry, priority: Option<i32>) -> Result<Bytes, Error> {
    let mut b = json!({
        "model": model,
        "max_tokens": e.output_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    match (cfg.endpoint, &e.prompt) {
        (Endpoint::Chat, Prompt::Text(t)) => {
            b["messages"] = json!([{"role": "user", "content": t}]);
        }
        (Endpoint::Chat, Prompt::Messages(m)) => b["messages"] = Value::from(m.clone()),
        (Endpoint::Completions, Prompt::Text(t)) => b["prompt"] = Value::from(t.as_str()),
        (Endpoint::Completions, Prompt::Messages(_)) => {
            return Err(Error::Invalid(
                "chat messages need --endpoint chat (the completions API takes text)".into(),
            ));
        }
    }
    if cfg.ignore_eos {
        b["ignore_eos"] = Value::Bool(true);
    }
    if let Some(p) = priority {
        b["priority"] = json!(p);
    }
    for (k, v) in &cfg.extra {
        b[k] = v.clone();
    }
    serde_json::to_vec(&b)
        .map(Bytes::from)
        .map_err(|e| Error::Invalid(e.to_string()))
}

/// The first model the server lists.
async fn first_model(base: &str, api_key: Option<&str>) -> Result<String, Error> {
    let url = format!("{base}/v1/models");
    let err = |message: String| Error::Server {
        url: url.clone(),
        message,
    };
    let mut req = reqwest::Client::new().get(&url);
    if let Some(key) = api_key {
        req = req.bearer_auth(key);
    }
    let resp = req.send().await.map_err(|e| err(chain(&e)))?;
    if !resp.status().is_success() {
        return Err(err(format!("answered {}", resp.status())));
    }
    let v: Value = resp.json().await.map_err(|e| err(chain(&e)))?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| err("lists no model; pass --model".into()))
}

/// An error with its causes, as reqwest's own message leaves them out.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

fn describe(cfg: &Config, model: &str, entries: usize) -> Value {
    let load = match &cfg.load {
        Load::Concurrency(n) => json!({"mode": "concurrency", "concurrency": n}),
        Load::Rate {
            rate,
            arrival,
            burstiness,
        } => json!({
            "mode": "request_rate",
            // A number when constant, `SECONDS:RATE,…` when it changes.
            "request_rate": match rate.points() {
                [(_, r)] => json!(r),
                _ => json!(rate.to_string()),
            },
            "arrival": format!("{arrival:?}").to_lowercase(),
            "burstiness": burstiness,
        }),
        Load::Trace => json!({"mode": "trace"}),
    };
    let stop = match cfg.stop {
        Stop::Requests(n) => json!({"requests": n}),
        Stop::Duration(d) => json!({"duration_s": d.as_secs_f64()}),
    };
    json!({
        "url": cfg.url,
        "model": model,
        "endpoint": match cfg.endpoint { Endpoint::Chat => "chat", Endpoint::Completions => "completions" },
        "load": load,
        "stop": stop,
        "warmup": cfg.warmup,
        "ignore_eos": cfg.ignore_eos,
        "extra_inputs": cfg.extra,
        "priority_mix": cfg.priority_mix,
        "tenants": cfg.tenants,
        "dataset_entries": entries,
        "seed": cfg.seed,
    })
}

/// CPU seconds (user + system) this process has used; Linux only.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesized command name; utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(") ")?.1;
    let f: Vec<&str> = rest.split(' ').collect();
    let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    // USER_HZ is 100 on every Linux architecture this runs on.
    Some(ticks / 100.0)
}
