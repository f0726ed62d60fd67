//! `dyn bench`: argument parsing and output for the load generator in `dyn-bench`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{Args, Subcommand, ValueEnum};
use dyn_bench::arrival::Arrival;
use dyn_bench::dataset::{Entry, Source, Synthetic, Words};
use dyn_bench::report::{self, SweepPoint};
use dyn_bench::run::Outcome;
use dyn_bench::{Config, Endpoint, Load, Slo, Stop};

pub const EXAMPLES: &str = "\
Examples:
  dyn bench --url http://127.0.0.1:8000 --concurrency 8 --requests 200 --isl 512 --osl 128
  dyn bench --request-rate 50 --arrival gamma --burstiness 0.5 --duration 60 --output out/
  dyn bench --tokenizer models/tiny --prefix-groups 4 --prefix-len 256 --isl 1024
  dyn bench --trace mooncake.jsonl --trace-speed 2 --output out/
  dyn bench --sweep-concurrency 1,8,32,128 --requests 200 --output sweep/
  dyn bench compare before/summary.json after/summary.json";

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true, after_help = EXAMPLES)]
pub struct BenchArgs {
    #[command(subcommand)]
    command: Option<BenchCommand>,

    /// Server base URL (an OpenAI-compatible API)
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// Model name; several, comma-separated, take turns request by request (a model's LoRA
    /// adapters) [default: the first one the server lists]
    #[arg(long)]
    model: Option<String>,
    #[arg(long, value_enum, default_value_t = EndpointArg::Chat)]
    endpoint: EndpointArg,
    /// Bearer token for servers that check one
    #[arg(long, env = "DYN_API_KEY", hide_env_values = true)]
    api_key: Option<String>,

    /// Closed loop: keep this many requests in flight [default: 1]
    #[arg(long, group = "load")]
    concurrency: Option<usize>,
    /// Open loop: send this many requests per second, whatever the server's state; or a rate
    /// changing over the run, SECONDS:RATE points joined by lines (0:2,60:40,90:40,100:2)
    #[arg(long, group = "load")]
    request_rate: Option<dyn_bench::arrival::Rate>,
    /// Gaps between open-loop requests
    #[arg(long, value_enum, default_value_t = ArrivalArg::Poisson, requires = "request_rate")]
    arrival: ArrivalArg,
    /// Gamma shape of the gaps: < 1 burstier, > 1 steadier (needs --arrival gamma unless 1)
    #[arg(long, default_value_t = 1.0, requires = "request_rate")]
    burstiness: f64,
    /// Run a closed loop at each of these concurrencies (e.g. 1,8,32,128) and plot
    /// tokens/s/user against tokens/s
    #[arg(long, value_delimiter = ',', group = "load")]
    sweep_concurrency: Option<Vec<usize>>,

    /// Measured requests [default: 100; a trace replays all its lines]
    #[arg(long, conflicts_with = "duration")]
    requests: Option<usize>,
    /// Measure for this many seconds instead of a request count
    #[arg(long)]
    duration: Option<f64>,
    /// Requests sent and discarded before measuring
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// Per-request timeout in seconds (a timed-out request counts as an error)
    #[arg(long, default_value_t = 600.0)]
    timeout: f64,

    /// Input tokens per synthetic prompt (exact with --tokenizer)
    #[arg(long, default_value_t = 512)]
    isl: usize,
    #[arg(long, default_value_t = 0.0)]
    isl_stddev: f64,
    /// Output tokens per request (`max_tokens`)
    #[arg(long, default_value_t = 128)]
    osl: u32,
    #[arg(long, default_value_t = 0.0)]
    osl_stddev: f64,
    /// Model directory (or tokenizer.json) for exact prompt lengths and for counting output
    /// tokens when the server sends no usage
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Draw each prompt from one of this many groups sharing a prefix
    #[arg(long, default_value_t = 0, requires = "prefix_len")]
    prefix_groups: usize,
    /// Tokens of the shared prefix (part of --isl)
    #[arg(long, default_value_t = 0)]
    prefix_len: usize,
    /// Seed of the shared prefixes' text [default: --seed]: clients with different seeds
    /// sharing the same prefixes
    #[arg(long, requires = "prefix_groups")]
    prefix_seed: Option<u64>,
    /// Replay a Mooncake trace (JSONL: timestamp ms, input_length, output_length, hash_ids)
    #[arg(long, group = "load", conflicts_with = "prompts")]
    trace: Option<PathBuf>,
    /// Replay the trace this many times faster
    #[arg(long, default_value_t = 1.0, requires = "trace")]
    trace_speed: f64,
    /// Tokens per trace hash id
    #[arg(long, default_value_t = 512, requires = "trace")]
    trace_block_size: usize,
    /// JSONL prompts: {"messages": [...], "max_tokens": N} or a message list per line
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Distinct synthetic prompts to cycle through in a --duration run
    #[arg(long, default_value_t = 1000)]
    dataset_size: usize,
    /// Let the model stop at end-of-sequence instead of always generating --osl tokens
    #[arg(long)]
    no_ignore_eos: bool,
    /// Add a field to every request, as AIPerf's option does: NAME:VALUE (the value read as
    /// JSON when it parses, else as a string) or a JSON object of fields; repeatable. E.g.
    /// --extra-inputs '{"response_format": {"type": "json_object"}}' --no-ignore-eos
    #[arg(long, value_parser = parse_extra)]
    extra_inputs: Vec<serde_json::Map<String, serde_json::Value>>,
    /// Send vLLM's `priority` field drawn by weight, PRIORITY:WEIGHT,... (e.g. 0:0.2,1:0.8 —
    /// 20 % interactive, 80 % batch), and report each priority's figures
    #[arg(long, value_delimiter = ',', value_parser = parse_priority)]
    priority_mix: Vec<(i32, f64)>,
    /// Send each request for a tenant drawn by weight, TENANT:WEIGHT,... (e.g. heavy:10,light:1
    /// — ten times the demand), named in --tenant-header, and report each tenant's figures
    #[arg(long, value_delimiter = ',', value_parser = parse_tenant)]
    tenants: Vec<(String, f64)>,
    /// The header --tenants names the tenant in (the ingress's `tenant_header`)
    #[arg(long, default_value = "x-tenant-id", value_parser = parse_header)]
    tenant_header: String,
    #[arg(long, default_value_t = 0)]
    seed: u64,

    /// Also compute the hit rate a cache-perfect router would reach on this workload over
    /// WORKERSxBLOCKS caches (e.g. 4x1024), to compare with the servers' own
    #[arg(long, value_parser = parse_oracle)]
    oracle: Option<(usize, usize)>,
    /// Tokens per KV block for --oracle
    #[arg(long, default_value_t = 16, requires = "oracle")]
    oracle_block_size: usize,

    /// Service-level objectives for goodput, e.g. ttft_ms=200,itl_ms=20
    #[arg(long)]
    slo: Option<Slo>,
    /// Write summary.json, requests.csv and PNG/SVG plots here
    #[arg(long)]
    output: Option<PathBuf>,
    /// No progress bar
    #[arg(long)]
    no_progress: bool,
    /// Follow the graph's SLA planner during the run (its /admin/planner, once a second):
    /// replica-seconds in the summary; with --output, planner.csv and a timeline plot of
    /// TTFT and replicas
    #[arg(long)]
    planner: bool,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Print two summaries side by side with the ratio B/A
    Compare { a: PathBuf, b: PathBuf },
    /// Plot TTFT ratios across a grid of workloads (scripts/route-grid): a JSONL file of
    /// {"cell": LABEL, "p50": RATIO, "p99": RATIO} → OUT.png and OUT.svg
    PlotRatios {
        input: PathBuf,
        /// Output path without extension
        output: PathBuf,
        #[arg(long, default_value = "TTFT, round robin ÷ kv")]
        title: String,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum EndpointArg {
    Chat,
    Completions,
}

#[derive(Clone, Copy, ValueEnum)]
enum ArrivalArg {
    Poisson,
    Gamma,
    Constant,
}

fn plot_ratios(input: &Path, output: &Path, title: &str) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(input)
        .with_context(|| format!("cannot read {}", input.display()))?;
    let cells = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str::<dyn_bench::plot::RatioCell>(l)
                .with_context(|| format!("{}:{}", input.display(), i + 1))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    if cells.is_empty() {
        bail!("{}: no cells", input.display());
    }
    let dir = output
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = output
        .file_name()
        .and_then(|n| n.to_str())
        .context("the output needs a file name")?;
    dyn_bench::plot::ratios(dir, name, title, &cells)?;
    println!(
        "wrote {}.png and {}.svg",
        output.display(),
        output.display()
    );
    Ok(())
}

/// `NAME:VALUE` or a JSON object: the fields `--extra-inputs` adds to every request.
fn parse_extra(s: &str) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    if s.trim_start().starts_with('{') {
        return serde_json::from_str(s).map_err(|e| format!("not a JSON object: {e}"));
    }
    let (name, value) = s
        .split_once(':')
        .ok_or_else(|| format!("expected NAME:VALUE or a JSON object, got {s:?}"))?;
    let value = serde_json::from_str(value).unwrap_or_else(|_| value.into());
    Ok(serde_json::Map::from_iter([(name.to_owned(), value)]))
}

/// One `PRIORITY:WEIGHT` of `--priority-mix`, e.g. `0:0.2`.
fn parse_priority(s: &str) -> Result<(i32, f64), String> {
    let bad = || format!("expected PRIORITY:WEIGHT, e.g. 0:0.2, got {s:?}");
    let (p, w) = s.split_once(':').ok_or_else(bad)?;
    match (p.trim().parse::<i32>(), w.trim().parse::<f64>()) {
        (Ok(p), Ok(w)) if w.is_finite() && w > 0.0 => Ok((p, w)),
        _ => Err(bad()),
    }
}

/// An HTTP header name.
fn parse_header(s: &str) -> Result<String, String> {
    reqwest::header::HeaderName::from_bytes(s.as_bytes())
        .map(|_| s.to_owned())
        .map_err(|_| format!("{s:?} is not a header name"))
}

/// `TENANT:WEIGHT`, e.g. `heavy:10`.
fn parse_tenant(s: &str) -> Result<(String, f64), String> {
    let bad = || format!("expected TENANT:WEIGHT, e.g. heavy:10, got {s:?}");
    let (t, w) = s.rsplit_once(':').ok_or_else(bad)?;
    let t = t.trim();
    // What the http ingress takes as a tenant.
    let name_ok = dyn_frontend::tenant_name_ok(t);
    match w.trim().parse::<f64>() {
        Ok(w) if w.is_finite() && w > 0.0 && name_ok => Ok((t.to_owned(), w)),
        _ => Err(bad()),
    }
}

/// `WORKERSxBLOCKS`, e.g. `4x1024`.
fn parse_oracle(s: &str) -> Result<(usize, usize), String> {
    let bad = || format!("expected WORKERSxBLOCKS, e.g. 4x1024, got {s:?}");
    let (w, b) = s.split_once('x').ok_or_else(bad)?;
    match (w.trim().parse(), b.trim().parse()) {
        (Ok(w), Ok(b)) if w > 0 && b > 0 => Ok((w, b)),
        _ => Err(bad()),
    }
}

pub fn bench(args: BenchArgs) -> anyhow::Result<()> {
    if let Some(command) = &args.command {
        return subcommand(command);
    }
    let words = match &args.tokenizer {
        Some(dir) => Words::from_tokenizer(dir)?,
        None => Words::approximate(),
    };
    let tokenizer = words.tokenizer().cloned().map(Arc::new);
    let source = args.source();
    let stop = args.stop()?;
    let count = args.entries_needed(&stop);
    let cfg = args.config(stop)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let interrupted = {
        let _rt = rt.enter();
        dyn_bench::run::interrupt_on_ctrl_c()
    };
    // A sweep runs once per level: the runtime, tokenizer and Ctrl-C flag are shared by all.
    let run = |cfg: &Config, entries: &[Entry]| {
        rt.block_on(dyn_bench::run::run(
            cfg,
            entries,
            tokenizer.clone(),
            &interrupted,
        ))
    };
    match &args.sweep_concurrency {
        None => run_once(&args, &cfg, &source.load(&words, count, args.seed)?, run),
        Some(levels) => sweep(
            &args,
            levels,
            cfg,
            |seed| source.load(&words, count, seed),
            run,
        ),
    }
}

fn subcommand(command: &BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Compare { a, b } => {
            let (a, b) = (report::load(a)?, report::load(b)?);
            print!("{}", report::compare(&a, &b));
            Ok(())
        }
        BenchCommand::PlotRatios {
            input,
            output,
            title,
        } => plot_ratios(input, output, title),
    }
}

impl BenchArgs {
    /// What to send: a trace, a prompts file or synthetic prompts.
    fn source(&self) -> Source {
        if let Some(path) = &self.trace {
            Source::Trace {
                path: path.clone(),
                speed: self.trace_speed,
                block_size: self.trace_block_size,
            }
        } else if let Some(path) = &self.prompts {
            Source::Prompts {
                path: path.clone(),
                osl: self.osl,
            }
        } else {
            Source::Synthetic(Synthetic {
                isl: self.isl,
                isl_stddev: self.isl_stddev,
                osl: self.osl,
                osl_stddev: self.osl_stddev,
                prefix_groups: self.prefix_groups,
                prefix_len: self.prefix_len,
                prefix_seed: self.prefix_seed,
            })
        }
    }

    /// When measuring stops: after --duration, else after --requests (a trace: all its lines).
    fn stop(&self) -> anyhow::Result<Stop> {
        Ok(match (self.requests, self.duration) {
            (_, Some(s)) => Stop::Duration(
                Duration::try_from_secs_f64(s)
                    .ok()
                    .filter(|d| !d.is_zero())
                    .context("--duration must be a positive number of seconds")?,
            ),
            (Some(0), None) => bail!("--requests must be at least 1"),
            (Some(n), None) => Stop::Requests(n),
            (None, None) if self.trace.is_some() => Stop::Requests(usize::MAX),
            (None, None) => Stop::Requests(100),
        })
    }

    /// Entries to load: one per request sent when the count is known (warm-up included),
    /// else a pool to cycle through; a trace loads all its lines whatever the count.
    fn entries_needed(&self, stop: &Stop) -> usize {
        match stop {
            Stop::Requests(n) if self.trace.is_none() => n + self.warmup,
            _ => self.dataset_size.max(1),
        }
    }

    /// How requests are paced: by a trace's timestamps, an open-loop rate or a closed loop.
    fn load(&self) -> Load {
        if self.trace.is_some() {
            Load::Trace
        } else if let Some(rate) = self.request_rate.clone() {
            Load::Rate {
                rate,
                arrival: match self.arrival {
                    ArrivalArg::Poisson => Arrival::Poisson,
                    ArrivalArg::Gamma => Arrival::Gamma,
                    ArrivalArg::Constant => Arrival::Constant,
                },
                burstiness: self.burstiness,
            }
        } else {
            Load::Concurrency(self.concurrency.unwrap_or(1))
        }
    }

    fn config(&self, stop: Stop) -> anyhow::Result<Config> {
        Ok(Config {
            url: self.url.clone(),
            model: self.model.clone(),
            endpoint: match self.endpoint {
                EndpointArg::Chat => Endpoint::Chat,
                EndpointArg::Completions => Endpoint::Completions,
            },
            load: self.load(),
            stop,
            warmup: self.warmup,
            ignore_eos: !self.no_ignore_eos,
            extra: self
                .extra_inputs
                .iter()
                .flatten()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            priority_mix: self.priority_mix.clone(),
            tenants: self.tenants.clone(),
            tenant_header: self.tenant_header.clone(),
            api_key: self.api_key.clone(),
            timeout: Duration::try_from_secs_f64(self.timeout)
                .context("--timeout must be a non-negative number of seconds")?,
            seed: self.seed,
            slo: self.slo.clone(),
            progress: !self.no_progress,
            planner: self.planner,
        })
    }
}

/// One run at the configured load: the table, the files with --output, and an error when
/// every request failed (so scripts notice a server that was never up).
fn run_once(
    args: &BenchArgs,
    cfg: &Config,
    entries: &[Entry],
    run: impl Fn(&Config, &[Entry]) -> Result<Outcome, dyn_bench::Error>,
) -> anyhow::Result<()> {
    let mut out = run(cfg, entries)?;
    if let Some((workers, blocks)) = args.oracle {
        // The entries the run sent, in order (a closed loop cycles through them).
        let sent = out.summary.requests.sent as usize + args.warmup;
        out.summary.oracle_hit_rate = Some(dyn_bench::oracle::hit_rate(
            entries.iter().cycle().take(sent),
            workers,
            blocks,
            args.oracle_block_size.max(1),
        ));
    }
    print!("{}", report::table(&out.summary));
    if let Some(rs) = out.summary.replica_seconds {
        println!("replica-seconds (planner): {rs:.1}");
    }
    if let Some(dir) = &args.output {
        report::write(dir, &out.summary, &out.records)?;
        if args.planner {
            report::write_planner(dir, &out.summary, &out.records, &out.planner)?;
        }
        println!("wrote {}", dir.display());
    }
    if out.summary.requests.ok == 0 {
        bail!("every request failed");
    }
    Ok(())
}

/// A closed loop at each of `levels`, one after another, each level's run written under
/// `c{level}/`; an interrupted level ends the sweep there.
fn sweep(
    args: &BenchArgs,
    levels: &[usize],
    mut cfg: Config,
    load: impl Fn(u64) -> Result<Vec<Entry>, dyn_bench::Error>,
    run: impl Fn(&Config, &[Entry]) -> Result<Outcome, dyn_bench::Error>,
) -> anyhow::Result<()> {
    if levels.is_empty() || levels.contains(&0) {
        bail!("--sweep-concurrency takes positive concurrencies, e.g. 1,8,32");
    }
    let mut points = Vec::new();
    for (i, &c) in levels.iter().enumerate() {
        cfg.load = Load::Concurrency(c);
        // A fresh seed per level: repeated prompts would hit the prefix cache.
        cfg.seed = args.seed.wrapping_add(i as u64 * 1_000_003);
        let entries = load(cfg.seed)?;
        eprintln!("concurrency {c}");
        let out = run(&cfg, &entries)?;
        if let Some(dir) = &args.output {
            report::write(&dir.join(format!("c{c}")), &out.summary, &out.records)?;
        }
        points.push(SweepPoint::new(c, &out.summary));
        if out.summary.interrupted {
            break;
        }
    }
    print!("{}", report::sweep_table(&points));
    if let Some(dir) = &args.output {
        report::write_sweep(dir, &points)?;
        println!("wrote {}", dir.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Args {
        #[command(flatten)]
        bench: BenchArgs,
    }

    #[test]
    fn a_priority_mix_reaches_the_run_configuration() {
        let a = Args::try_parse_from([
            "bench",
            "--url",
            "http://x",
            "--priority-mix",
            "0:0.2,1:0.8",
        ])
        .expect("parses");
        let cfg = a.bench.config(Stop::Requests(1)).expect("a config");
        assert_eq!(cfg.priority_mix, [(0, 0.2), (1, 0.8)]);
        let a = Args::try_parse_from([
            "bench",
            "--url",
            "http://x",
            "--tenants",
            "heavy:10,light:1",
        ])
        .expect("parses");
        let cfg = a.bench.config(Stop::Requests(1)).expect("a config");
        assert_eq!(
            cfg.tenants,
            [("heavy".to_string(), 10.0), ("light".to_string(), 1.0)]
        );
        assert_eq!(cfg.tenant_header, "x-tenant-id");
        assert!(Args::try_parse_from(["bench", "--url", "x", "--tenants", "heavy"]).is_err());
        assert!(Args::try_parse_from(["bench", "--url", "x", "--priority-mix", "0"]).is_err());
        assert!(Args::try_parse_from(["bench", "--url", "x", "--priority-mix", "0:-1"]).is_err());
    }
}
