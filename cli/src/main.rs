//! The `dyn` command. Only argument parsing, output and exit codes live here; the work is done
//! by `dyn-pipeline` (compile, plan, run), `dyn-operators` (the kinds) and `dyn-bench` (the load
//! generator).

mod bench;
mod inspect;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use dyn_pipeline::spec::Override;
use dyn_pipeline::{CompiledGraph, Diagnostics, EXIT_CONFIG, Plan, RunOptions, load_and_compile};

const EXAMPLES: &str = "\
Examples:
  dyn graph validate graphs/*.yaml          check graphs; exit 78 on configuration errors
  dyn graph plan graphs/agg.yaml --format mermaid
  dyn graph up graphs/agg.yaml --set http.listen=127.0.0.1:9000 --set decode.replicas=4
  dyn graph kinds                           list the operator kinds this build knows
  dyn bench --concurrency 8 --requests 200 --output out/
  dyn inspect route --prompt 'Hello'        where a prompt would be routed, and why";

#[derive(Parser)]
#[command(name = "dyn", version, about = "Serve LLMs as dataflow graphs", after_help = EXAMPLES)]
struct Cli {
    /// Log line format (stderr). Filter with RUST_LOG, e.g. RUST_LOG=dyn_pipeline=debug.
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
    /// Run a graph until SIGINT or SIGTERM, then drain in-flight requests and exit 0
    Up {
        file: PathBuf,
        /// Override a value: NODE.KEY=VALUE (KEY may be dotted; VALUE is YAML)
        #[arg(long = "set", value_name = "NODE.KEY=VALUE")]
        set: Vec<Override>,
        /// Seconds in-flight requests get to finish after a shutdown signal
        #[arg(long, default_value_t = 30.0)]
        grace_period: f64,
    },
    /// List the operator kinds this build knows, with their payload types
    Kinds,
}

#[derive(Clone, Copy, ValueEnum)]
enum PlanFormat {
    Text,
    Json,
    Dot,
    Mermaid,
}

impl From<PlanFormat> for dyn_pipeline::Format {
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
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
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
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
    let registry = dyn_operators::registry();
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
        GraphCommand::Up {
            file,
            set,
            grace_period,
        } => {
            let g = compile(&file, &set, &registry)?;
            let grace = Duration::try_from_secs_f64(grace_period)
                .context("--grace-period must be a non-negative number of seconds")?;
            up(g, RunOptions { grace })
        }
        GraphCommand::Kinds => {
            for k in registry.kinds() {
                let types = match k.role {
                    dyn_pipeline::registry::Role::Operator { input, output } => {
                        format!("{} → {}", input.name, output.name)
                    }
                    dyn_pipeline::registry::Role::Ingress { request, response } => {
                        format!(
                            "ingress: sends {}, answers with {}",
                            request.name, response.name
                        )
                    }
                };
                println!("{:<12} {:<40} {}", k.name, types, k.summary);
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
    registry: &dyn_pipeline::Registry,
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

fn up(graph: CompiledGraph, opts: RunOptions) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(dyn_pipeline::run(&graph, opts, shutdown_signal()))
        .map_err(Into::into)
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
