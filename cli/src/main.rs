//! The `dyn` command. Only argument parsing, output and exit codes live here; the work is done
//! by `dyn-runtime` (compile, plan, run), `dyn-kinds` (the kinds) and `dyn-bench` (the load
//! generator).

mod bench;
mod inspect;
mod procs;
mod profile;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use dyn_runtime::compile::PlaneAddr;
use dyn_runtime::spec::Override;
use dyn_runtime::{
    CompiledGraph, Diagnostics, EXIT_CONFIG, Placement, Plan, RunOptions, load_and_compile,
};
use futures::FutureExt as _;

const EXAMPLES: &str = "\
Examples:
  dyn graph validate graphs/*.yaml          check graphs; exit 78 on configuration errors
  dyn graph plan graphs/agg.yaml --format mermaid
  dyn graph up graphs/agg.yaml --set http.listen=127.0.0.1:9000 --set decode.replicas=4
  dyn graph up graphs/agg.yaml --control etcd://127.0.0.1:2379 --events nats://127.0.0.1:4222
  dyn graph ps graphs/agg.yaml              processes and registered instances
  dyn graph down graphs/agg.yaml            drain and stop
  dyn graph kinds                           list the operator kinds this build knows
  dyn graph profile graphs/planner.yaml --node decode -o decode.profile.json
  dyn bench --concurrency 8 --requests 200 --output out/
  dyn inspect route --prompt 'Hello'        where a prompt would be routed, and why";

#[derive(Parser)]
#[command(name = "dyn", version, about = "Serve LLMs as dataflow graphs", after_help = EXAMPLES)]
struct Cli {
    /// Log line format (stderr). Filter with RUST_LOG, e.g. RUST_LOG=dyn_runtime=debug.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Check, plan and run graphs
    #[command(subcommand, after_help = EXAMPLES)]
    Graph(GraphCommand),
    /// Load-test an OpenAI-compatible server and report TTFT, ITL, throughput and goodput
    Bench(Box<bench::BenchArgs>),
    /// Show a running graph's routing state: workers, routing decisions, KV index, KV events
    Inspect(inspect::InspectArgs),
}

#[derive(Subcommand)]
enum GraphCommand {
    /// Type-check graph files and print every error as FILE:LINE:COL (exit 78 on errors)
    Validate {
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Show which nodes share a process, replicas, and which edges cross processes
    Plan {
        file: PathBuf,
        #[arg(long, value_enum, default_value_t = PlanFormat::Text)]
        format: PlanFormat,
        /// Override a value: NODE.KEY=VALUE (KEY may be dotted; VALUE is YAML)
        #[arg(long = "set", value_name = "NODE.KEY=VALUE")]
        set: Vec<Override>,
    },
    /// Run a graph until SIGINT or SIGTERM, then drain in-flight requests and exit 0.
    /// With embedded planes everything runs in this process; with etcd and NATS, one process
    /// per process-group replica, supervised from this one.
    Up(Box<UpArgs>),
    /// List the processes of running graphs on this machine and the instances in etcd
    Ps {
        file: PathBuf,
        #[command(flatten)]
        planes: PlaneArgs,
        /// Print JSON
        #[arg(long)]
        json: bool,
    },
    /// Drain and stop a graph's processes on this machine (SIGTERM, then wait)
    Down {
        file: PathBuf,
        /// Seconds to wait for the processes to finish draining
        #[arg(long, default_value_t = 60.0)]
        timeout: f64,
    },
    /// List the operator kinds this build knows, with their payload types
    Kinds,
    /// Measure one replica of a worker node (prefill and decode sweeps with `dyn bench`) and
    /// write the performance profile the SLA planner reads
    Profile(Box<profile::ProfileArgs>),
}

#[derive(clap::Args)]
struct UpArgs {
    file: PathBuf,
    /// Override a value: NODE.KEY=VALUE (KEY may be dotted; VALUE is YAML)
    #[arg(long = "set", value_name = "NODE.KEY=VALUE")]
    set: Vec<Override>,
    /// Seconds in-flight requests get to finish after a shutdown signal
    #[arg(long, default_value_t = 30.0)]
    grace_period: f64,
    #[command(flatten)]
    planes: PlaneArgs,
    /// Run only these nodes (comma-separated), e.g. more workers on another machine
    #[arg(long, value_delimiter = ',', value_name = "NODE[,NODE]")]
    only: Option<Vec<String>>,
    /// Seconds a dead process stays registered at most (the etcd lease)
    #[arg(long, default_value_t = 10)]
    lease_ttl: u64,
    /// Address other processes reach this machine's request plane at
    #[arg(long, env = "DYN_REQUEST_HOST", default_value = "127.0.0.1")]
    request_host: String,
    /// Serve the request plane and KV transfers beyond loopback without a cluster identity
    /// (DYN_CLUSTER_TOKEN, or DYN_CLUSTER_CA/CERT/KEY): anyone who reaches the port is served
    #[arg(long, env = "DYN_INSECURE_PLANES")]
    insecure_planes: bool,
    /// Seconds a call waits without a word (an item or a heartbeat) from the process serving
    /// it before giving it up as lost (its host froze or lost power); the request migrates
    #[arg(long, env = "DYN_PLANE_SILENCE", default_value_t = 5.0)]
    plane_silence: f64,
    /// Run one process-group replica (what the supervisor starts): NAME:REPLICA
    #[arg(long, hide = true, value_name = "NAME:REPLICA")]
    group: Option<String>,
}

#[derive(clap::Args)]
struct PlaneArgs {
    /// Control plane, overriding the graph's `planes.control`: embedded or etcd://HOST:PORT
    #[arg(long, env = "DYN_CONTROL", value_parser = |s: &str| PlaneAddr::parse(s, "etcd"))]
    control: Option<PlaneAddr>,
    /// Event plane, overriding the graph's `planes.events`: embedded or nats://HOST:PORT
    #[arg(long, env = "DYN_EVENTS", value_parser = |s: &str| PlaneAddr::parse(s, "nats"))]
    events: Option<PlaneAddr>,
}

impl PlaneArgs {
    fn apply(&self, g: &mut CompiledGraph) {
        if let Some(c) = &self.control {
            g.control = c.clone();
        }
        if let Some(e) = &self.events {
            g.events = e.clone();
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum PlanFormat {
    Text,
    Json,
    Dot,
    Mermaid,
}

impl From<PlanFormat> for dyn_runtime::Format {
    fn from(f: PlanFormat) -> Self {
        match f {
            PlanFormat::Text => Self::Text,
            PlanFormat::Json => Self::Json,
            PlanFormat::Dot => Self::Dot,
            PlanFormat::Mermaid => Self::Mermaid,
        }
    }
}

/// A configuration error, already printed; maps to exit code 78.
#[derive(Debug)]
struct ConfigError;

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("invalid configuration")
    }
}

impl std::error::Error for ConfigError {}

/// mimalloc rather than glibc's malloc: the serving path allocates and frees small buffers per
/// token on several threads, where glibc's arenas spent about a fifth of the frontend's CPU
/// (BENCHMARKS.md, "Frontend cost").
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    raise_open_files_limit();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is::<ConfigError>() => ExitCode::from(EXIT_CONFIG as u8),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only on a terminal: a supervisor or a log collector reads these lines.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let cmd = match cli.command {
        Command::Graph(cmd) => cmd,
        Command::Bench(args) => return bench::bench(*args),
        Command::Inspect(args) => return inspect::inspect(args),
    };
    let registry = dyn_kinds::registry();
    match cmd {
        GraphCommand::Validate { files } => {
            let mut failed = false;
            for file in files {
                match load_and_compile(&file, &[], &registry) {
                    Ok(g) => {
                        print_warnings(&g.warnings);
                        let plan = Plan::new(&g);
                        println!(
                            "{}: valid (graph '{}', {} nodes, {} processes)",
                            file.display(),
                            g.name,
                            g.nodes.len(),
                            plan.processes.len()
                        );
                    }
                    Err(d) => {
                        eprint!("{d}");
                        failed = true;
                    }
                }
            }
            if failed {
                return Err(ConfigError.into());
            }
            Ok(())
        }
        GraphCommand::Plan { file, format, set } => {
            let g = compile(&file, &set, &registry)?;
            print!("{}", Plan::new(&g).render(format.into()));
            Ok(())
        }
        GraphCommand::Up(args) => up(*args, &registry, cli.log_format),
        GraphCommand::Profile(args) => profile::profile(*args, &registry),
        GraphCommand::Ps { file, planes, json } => {
            let mut g = compile(&file, &[], &registry)?;
            planes.apply(&mut g);
            runtime()?.block_on(procs::ps(&g.namespace, &g.name, &g.control, json))
        }
        GraphCommand::Down { file, timeout } => {
            let g = compile(&file, &[], &registry)?;
            let timeout = Duration::try_from_secs_f64(timeout)
                .context("--timeout must be a non-negative number of seconds")?;
            procs::down(&g.namespace, &g.name, timeout)
        }
        GraphCommand::Kinds => {
            for k in registry.kinds() {
                let types = match k.ports {
                    dyn_core::registry::Ports::Operator { input, output } => {
                        format!("{} → {}", input.name, output.name)
                    }
                    dyn_core::registry::Ports::Ingress { request, response } => {
                        format!(
                            "ingress: sends {}, answers with {}",
                            request.name, response.name
                        )
                    }
                };
                println!(
                    "{:<16} {:<12} {:<44} {}",
                    k.name,
                    k.role.to_string(),
                    types,
                    k.summary
                );
            }
            Ok(())
        }
    }
}

fn print_warnings(d: &Diagnostics) {
    for w in d.warnings() {
        eprintln!("{}", d.render(w));
    }
}

fn compile(
    file: &std::path::Path,
    set: &[Override],
    registry: &dyn_core::Registry,
) -> anyhow::Result<CompiledGraph> {
    match load_and_compile(file, set, registry) {
        Ok(g) => {
            print_warnings(&g.warnings);
            Ok(g)
        }
        Err(d) => {
            eprint!("{d}");
            Err(ConfigError.into())
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

fn up(mut args: UpArgs, registry: &dyn_core::Registry, log: LogFormat) -> anyhow::Result<()> {
    // A supervised process gets the run's `--set` overrides in its environment, not its
    // command line: they may hold secrets, and any local user can read a command line.
    if args.group.is_some()
        && let Some(sets) = std::env::var_os(SET_ENV)
    {
        let sets: Vec<String> = serde_json::from_str(&sets.to_string_lossy())
            .with_context(|| format!("{SET_ENV} is not a JSON list of overrides"))?;
        for s in sets {
            args.set.push(
                s.parse()
                    .map_err(|e: String| anyhow::anyhow!("{SET_ENV}: {e}"))?,
            );
        }
    }
    let mut graph = compile(&args.file, &args.set, registry)?;
    args.planes.apply(&mut graph);
    let grace = Duration::try_from_secs_f64(args.grace_period)
        .context("--grace-period must be a non-negative number of seconds")?;
    let embedded = graph.control == PlaneAddr::Embedded && graph.events == PlaneAddr::Embedded;
    let opts = run_options(&args, grace)?;
    let rt = runtime()?;
    // Embedded planes reach no other process, so the whole graph runs in this one.
    if args.group.is_some() || embedded {
        return up_in_process(&args, &graph, opts, &rt);
    }
    up_supervised(args, &graph, grace, log, &rt)
}

/// How this process runs its share of the graph: which part (`--group`, `--only`), how long
/// it drains, and how others reach it.
fn run_options(args: &UpArgs, grace: Duration) -> anyhow::Result<RunOptions> {
    let placement = match &args.group {
        Some(g) => {
            let (process, replica) = g
                .rsplit_once(':')
                .and_then(|(p, r)| Some((p.to_owned(), r.parse().ok()?)))
                .context("--group takes NAME:REPLICA")?;
            Placement::Group { process, replica }
        }
        None => Placement::All,
    };
    anyhow::ensure!(
        args.plane_silence.is_finite() && (0.5..=3600.0).contains(&args.plane_silence),
        "--plane-silence must be between 0.5 and 3600 seconds"
    );
    let silence = Duration::from_secs_f64(args.plane_silence);
    let trust = dyn_trust::Trust::from_env()?;
    if !trust.is_secure()
        && !args.insecure_planes
        && !dyn_frontend::loopback_host(&args.request_host)
    {
        anyhow::bail!(
            "--request-host {} is reachable from other machines, and without a cluster identity \
             anyone who reaches it could send work and read prompts' KV: set {} (the same \
             secret on every machine; or {}, {} and {}), or pass --insecure-planes on a \
             network you trust",
            args.request_host,
            dyn_trust::TOKEN_ENV,
            dyn_trust::CA_ENV,
            dyn_trust::CERT_ENV,
            dyn_trust::KEY_ENV
        );
    }
    if trust.is_secure() {
        tracing::debug!(identity = trust.describe(), "Cluster identity");
    }
    Ok(RunOptions {
        grace,
        placement,
        only: args.only.clone(),
        tcp: dyn_runtime::planes::TcpOptions {
            bind: format!("{}:0", args.request_host),
            trust,
            // Heartbeats five times within the bound, so a late one or two do not matter.
            heartbeat: silence / 5,
            silence,
            ..Default::default()
        },
        lease_ttl: Duration::from_secs(args.lease_ttl.max(1)),
    })
}

/// What `dyn graph ps` and `down` read about this run, as of now.
fn run_state(graph: &CompiledGraph, mode: &str, processes: Vec<procs::ProcState>) -> procs::State {
    procs::State {
        graph: graph.name.clone(),
        namespace: graph.namespace.clone(),
        pid: std::process::id(),
        mode: mode.into(),
        control: graph.control.to_string(),
        events: graph.events.to_string(),
        started_unix: procs::now_unix(),
        start_ticks: procs::start_ticks(std::process::id()),
        processes,
    }
}

/// One process: the whole graph (embedded), or one replica the supervisor started.
fn up_in_process(
    args: &UpArgs,
    graph: &CompiledGraph,
    opts: RunOptions,
    rt: &tokio::runtime::Runtime,
) -> anyhow::Result<()> {
    let supervised = args.group.is_some();
    // A supervised replica is listed in its supervisor's state file, not in one of its own.
    let _state = if !supervised {
        Some(procs::StateFile::create(run_state(
            graph,
            "embedded",
            vec![procs::ProcState {
                process: "(all)".into(),
                replica: 0,
                pid: Some(std::process::id()),
                restarts: 0,
                status: "running".into(),
            }],
        ))?)
    } else {
        None
    };
    let stop = async move {
        if supervised {
            tokio::select! {
                _ = shutdown_signal() => {}
                _ = procs::parent_gone() => {}
            }
        } else {
            shutdown_signal().await;
        }
    };
    // The planner runs beside an embedded graph, or in the supervisor of a distributed
    // one (`up_supervised`), never in its processes.
    let planner = if supervised {
        None
    } else {
        planner_plan(graph)?
    };
    let attach = move |a: dyn_runtime::Attach| {
        planner.map(|p| dyn_planner::run(p, a.planes.events, a.replicas).boxed())
    };
    rt.block_on(dyn_runtime::run_attached(graph, opts, stop, attach))
        .map_err(Into::into)
}

/// Distributed: supervise one process per process-group replica (of the selected nodes).
fn up_supervised(
    args: UpArgs,
    graph: &CompiledGraph,
    grace: Duration,
    log: LogFormat,
    rt: &tokio::runtime::Runtime,
) -> anyhow::Result<()> {
    let groups = process_groups(&args, graph)?;
    // One planner per graph: the supervisor of the whole graph runs it; one started with
    // `--only` (more workers on another machine) leaves it to that one.
    let planner = if args.only.is_some() {
        None
    } else {
        planner_plan(graph)?
    };
    let file = procs::StateFile::create(run_state(graph, "distributed", Vec::new()))?;
    let groups_of = graph
        .nodes
        .iter()
        .map(|n| (n.id.clone(), n.process.clone()))
        .collect();
    let token = run_token(&args)?;
    let args_for: procs::ArgsFor = {
        let graph = graph.clone();
        Box::new(move |process, replica| {
            let mut c = child_command(&args, &graph, log, &format!("{process}:{replica}"));
            if let Some(t) = &token {
                c.env.push((dyn_trust::TOKEN_ENV.to_owned(), t.clone()));
            }
            c
        })
    };
    tracing::info!(graph = %graph.name, processes = groups.len(), control = %graph.control, events = %graph.events, "Starting the graph's processes");
    rt.block_on(async {
        dyn_runtime::planes::check(&graph.control, &graph.events)
            .await
            .context("the graph's planes are not reachable")?;
        let sup = procs::Supervisor::new(file, args_for, groups_of)?;
        for (process, replica) in &groups {
            sup.start(process, *replica);
        }
        let _planner = match planner {
            Some(p) => Some(start_planner(p, &graph.events, &sup).await?),
            None => None,
        };
        sup.run(grace, shutdown_signal()).await
    })
}

/// A token of this run's own for its processes, when the whole graph runs on this machine
/// and no cluster identity is given: without one, every local user could reach the request
/// plane's loopback ports, send work and read prompts' KV. It travels in the processes'
/// environment, which only this user can read. A run with `--only` (other machines, or
/// processes added later, must share a secret) is left to the operator's identity, and
/// `--insecure-planes` says the operator wants none.
fn run_token(args: &UpArgs) -> anyhow::Result<Option<String>> {
    if args.insecure_planes || args.only.is_some() || dyn_trust::Trust::from_env()?.is_secure() {
        return Ok(None);
    }
    Ok(Some(format!(
        "{:032x}{:032x}",
        rand::random::<u128>(),
        rand::random::<u128>()
    )))
}

/// The process-group replicas to supervise: every replica of each process that holds a
/// node `--only` selects (all of them without it).
fn process_groups(args: &UpArgs, graph: &CompiledGraph) -> anyhow::Result<Vec<(String, u32)>> {
    let plan = Plan::new(graph);
    let mut groups = Vec::new();
    for p in &plan.processes {
        if let Some(only) = &args.only
            && !p.nodes.iter().any(|n| only.contains(n))
        {
            continue;
        }
        for replica in 0..p.replicas {
            groups.push((p.name.clone(), replica));
        }
    }
    if groups.is_empty() {
        anyhow::bail!("--only selects no node of graph '{}'", graph.name);
    }
    Ok(groups)
}

/// The planner of a supervised graph, scaling through the supervisor; it runs until the
/// returned handle is dropped.
async fn start_planner(
    p: dyn_planner::run::Plan,
    events: &PlaneAddr,
    sup: &std::sync::Arc<procs::Supervisor>,
) -> anyhow::Result<tokio_util::task::AbortOnDropHandle<()>> {
    let events = match events {
        PlaneAddr::Nats(eps) => dyn_runtime::planes::NatsEventBus::connect(eps)
            .await
            .context("the planner cannot reach NATS")?,
        _ => anyhow::bail!(
            "the planner of a multi-process graph observes it over NATS: give --events nats://HOST:PORT"
        ),
    };
    let connector: std::sync::Arc<dyn dyn_core::Connector> = sup.clone();
    Ok(tokio_util::task::AbortOnDropHandle::new(tokio::spawn(
        dyn_planner::run(p, std::sync::Arc::new(events), connector),
    )))
}

/// The graph's planner, with its profile loaded (a bad profile stops `dyn graph up` here).
fn planner_plan(graph: &CompiledGraph) -> anyhow::Result<Option<dyn_planner::run::Plan>> {
    let Some(cfg) = graph.section::<dyn_planner::PlannerConfig>() else {
        return Ok(None);
    };
    let facts = dyn_planner::run::GraphFacts {
        namespace: &graph.namespace,
        base_dir: &graph.base_dir,
        kinds: graph
            .nodes
            .iter()
            .map(|n| (n.id.as_str(), n.kind.name))
            .collect(),
    };
    Ok(Some(dyn_planner::run::Plan::of(cfg, &facts)?))
}

/// Where a supervised process finds the run's `--set` overrides (a JSON list).
const SET_ENV: &str = "DYN_SET";

/// The command of the `dyn` process that runs one process-group replica (`NAME:REPLICA`)
/// of a supervised graph: this run's settings, with the planes resolved. The overrides go in
/// its environment (`SET_ENV`), which only its user can read.
fn child_command(
    args: &UpArgs,
    graph: &CompiledGraph,
    log: LogFormat,
    group: &str,
) -> procs::ChildCommand {
    let sets: Vec<String> = args
        .set
        .iter()
        .map(|o| format!("{}.{}={}", o.node, o.path.join("."), o.value))
        .collect();
    let env = if sets.is_empty() {
        Vec::new()
    } else {
        vec![(
            SET_ENV.to_owned(),
            serde_json::to_string(&sets).unwrap_or_default(),
        )]
    };
    procs::ChildCommand {
        args: child_args(args, graph, log, group),
        env,
    }
}

fn child_args(args: &UpArgs, graph: &CompiledGraph, log: LogFormat, group: &str) -> Vec<String> {
    let log = log
        .to_possible_value()
        .map_or_else(|| "text".to_owned(), |v| v.get_name().to_owned());
    let mut a = vec![
        "--log-format".to_owned(),
        log,
        "graph".into(),
        "up".into(),
        args.file.display().to_string(),
    ];
    a.extend([
        "--grace-period".into(),
        args.grace_period.to_string(),
        "--control".into(),
        graph.control.to_string(),
        "--events".into(),
        graph.events.to_string(),
        "--lease-ttl".into(),
        args.lease_ttl.to_string(),
        "--request-host".into(),
        args.request_host.clone(),
        "--group".into(),
        group.to_owned(),
    ]);
    if let Some(only) = &args.only {
        a.push("--only".into());
        a.push(only.join(","));
    }
    if args.insecure_planes {
        a.push("--insecure-planes".into());
    }
    a.push("--plane-silence".into());
    a.push(args.plane_silence.to_string());
    a
}

/// Open files up to the hard limit: a server's connections are file descriptors, and the soft
/// limit (1024 on most systems) is below `max_connections`.
fn raise_open_files_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
        && let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
    {
        tracing::debug!(error = %e, "Cannot raise the open-files limit");
    }
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!(error = %e, "Cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "Cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => tracing::info!(signal = "SIGINT", "Signal received"),
        _ = term => tracing::info!(signal = "SIGTERM", "Signal received"),
    }
}
