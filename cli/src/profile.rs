//! `dyn graph profile`: measure one replica of a worker node for the SLA planner.
//!
//! The graph runs in this process (embedded planes) with the node at one replica and the
//! ingress on a free loopback port; `dyn bench` (the library) then sweeps it twice, as
//! Dynamo's pre-deployment profiling does: prefill — lone requests of growing prompt length,
//! one output token, their median TTFT; decode — closed loops at growing concurrency, ITL
//! percentiles and output tokens per second. The result is the JSON file the planner's
//! `profile:` names ([`dyn_planner::profile::Profile`]).

use std::path::PathBuf;

use std::time::Duration;

use anyhow::{Context as _, bail};
use dyn_bench::dataset::{Source, Synthetic, Words};
use dyn_bench::{Config, Endpoint, Load, Stop};
use dyn_planner::profile::{DecodePoint, PrefillPoint, Profile};
use dyn_runtime::spec::Override;

#[derive(clap::Args)]
pub struct ProfileArgs {
    file: PathBuf,
    /// The worker node to profile
    #[arg(long, default_value = "decode")]
    node: String,
    /// Where to write the profile (JSON)
    #[arg(long, short)]
    output: PathBuf,
    /// Prompt lengths of the prefill sweep
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024,2048")]
    prefill_isl: Vec<usize>,
    /// Concurrencies of the decode sweep
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16,24,32,48")]
    concurrency: Vec<usize>,
    /// Prompt and output lengths of the decode sweep
    #[arg(long, default_value_t = 256)]
    isl: usize,
    #[arg(long, default_value_t = 64)]
    osl: u32,
    /// Requests per prefill length; a decode level sends 4 × its concurrency (at least this)
    #[arg(long, default_value_t = 16)]
    requests: usize,
    /// Override a value: NODE.KEY=VALUE (KEY may be dotted; VALUE is YAML)
    #[arg(long = "set", value_name = "NODE.KEY=VALUE")]
    set: Vec<Override>,
}

pub fn profile(args: ProfileArgs, registry: &dyn_core::Registry) -> anyhow::Result<()> {
    if args.prefill_isl.is_empty()
        || args.concurrency.is_empty()
        || args.prefill_isl.contains(&0)
        || args.concurrency.contains(&0)
    {
        bail!("--prefill-isl and --concurrency take positive numbers");
    }
    let g = super::compile(&args.file, &args.set, registry)?;
    let node = g
        .node(&args.node)
        .with_context(|| format!("graph '{}' has no node '{}'", g.name, args.node))?;
    if node.kind.role != dyn_core::Role::Worker {
        bail!(
            "'{}' is a {} node; profile a worker",
            args.node,
            node.kind.role
        );
    }
    let kind = node.kind.name.to_owned();
    let ingress = g
        .nodes
        .iter()
        .find(|n| n.kind.is_ingress())
        .context("the graph has no ingress to send requests to")?
        .id
        .clone();
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut set = args.set.clone();
    for (n, k, v) in [
        (args.node.as_str(), "replicas", "1".to_owned()),
        (ingress.as_str(), "listen", format!("127.0.0.1:{port}")),
    ] {
        set.push(format!("{n}.{k}={v}").parse().map_err(anyhow::Error::msg)?);
    }
    let mut graph = super::compile(&args.file, &set, registry)?;
    graph.control = dyn_runtime::compile::PlaneAddr::Embedded;
    graph.events = dyn_runtime::compile::PlaneAddr::Embedded;
    let url = format!("http://127.0.0.1:{port}");
    let rt = super::runtime()?;
    rt.block_on(async {
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let g2 = graph.clone();
        let server = tokio::spawn(async move {
            dyn_runtime::run(&g2, dyn_runtime::RunOptions::default(), async {
                let _ = stop_rx.await;
            })
            .await
        });
        let result = sweep(&args, &url).await;
        let _ = stop_tx.send(());
        server.await.context("the graph's task failed")??;
        let (prefill, decode) = result?;
        let p = Profile {
            node: args.node.clone(),
            kind,
            graph: args.file.display().to_string(),
            prefill,
            decode,
        };
        std::fs::write(&args.output, serde_json::to_string_pretty(&p)?)
            .with_context(|| format!("cannot write {}", args.output.display()))?;
        println!(
            "\nprefill: {:>8} {:>10} {:>14}",
            "ISL", "TTFT ms", "tokens/s"
        );
        for x in &p.prefill {
            println!(
                "         {:>8} {:>10.1} {:>14.0}",
                x.isl,
                x.ttft_ms,
                p.prefill_tps(x.isl)
            );
        }
        println!(
            "\ndecode:  {:>8} {:>10} {:>10} {:>10} {:>14}",
            "conc", "ITL p50", "ITL p90", "TTFT p90", "output tok/s"
        );
        for x in &p.decode {
            println!(
                "         {:>8} {:>10.2} {:>10.2} {:>10.1} {:>14.0}",
                x.concurrency, x.itl_p50_ms, x.itl_p90_ms, x.ttft_p90_ms, x.output_tps
            );
        }
        println!("\nwrote {}", args.output.display());
        Ok(())
    })
}

async fn sweep(
    args: &ProfileArgs,
    url: &str,
) -> anyhow::Result<(Vec<PrefillPoint>, Vec<DecodePoint>)> {
    // Wait for the ingress.
    let http = reqwest::Client::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while http.get(format!("{url}/v1/models")).send().await.is_err() {
        if std::time::Instant::now() > deadline {
            bail!("the graph did not start serving at {url}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let words = Words::approximate();
    let interrupted = dyn_bench::run::interrupt_on_ctrl_c();
    let run = |load: Load, requests: usize, warmup: usize, isl: usize, osl: u32, seed: u64| {
        let cfg = Config {
            url: url.to_owned(),
            model: None,
            endpoint: Endpoint::Chat,
            load,
            stop: Stop::Requests(requests),
            warmup,
            ignore_eos: true,
            extra: Default::default(),
            priority_mix: Vec::new(),
            tenants: Vec::new(),
            tenant_header: "x-tenant-id".into(),
            api_key: None,
            timeout: Duration::from_secs(600),
            seed,
            slo: None,
            progress: true,
            planner: false,
        };
        let source = Source::Synthetic(Synthetic {
            isl,
            isl_stddev: 0.0,
            osl,
            osl_stddev: 0.0,
            prefix_groups: 0,
            prefix_len: 0,
            prefix_seed: None,
        });
        let entries = source.load(&words, requests + warmup, seed);
        let interrupted = interrupted.clone();
        async move {
            let entries = entries?;
            let out = dyn_bench::run::run(&cfg, &entries, None, &interrupted).await?;
            if out.summary.requests.ok == 0 {
                bail!("every request failed");
            }
            anyhow::Ok(out.summary)
        }
    };
    let mut prefill = Vec::new();
    for (i, &isl) in args.prefill_isl.iter().enumerate() {
        eprintln!("prefill: ISL {isl}, one request at a time");
        let s = run(
            Load::Concurrency(1),
            args.requests,
            2,
            isl,
            1,
            100 + i as u64,
        )
        .await?;
        let (Some(ttft), Some(inp)) = (s.ttft_ms, s.input_tokens) else {
            bail!("no TTFT measured at ISL {isl}");
        };
        // The prompt as the engine saw it (the chat template adds tokens).
        prefill.push(PrefillPoint {
            isl: inp.avg,
            ttft_ms: ttft.p50,
        });
    }
    let mut decode = Vec::new();
    for (i, &c) in args.concurrency.iter().enumerate() {
        eprintln!("decode: concurrency {c}");
        let requests = (4 * c).max(args.requests);
        let s = run(
            Load::Concurrency(c),
            requests,
            c,
            args.isl,
            args.osl,
            200 + i as u64,
        )
        .await?;
        let (Some(itl), Some(ttft)) = (s.itl_ms, s.ttft_ms) else {
            bail!("no ITL measured at concurrency {c}");
        };
        decode.push(DecodePoint {
            concurrency: c as f64,
            isl: s.input_tokens.map_or(args.isl as f64, |x| x.avg),
            osl: f64::from(args.osl),
            itl_p50_ms: itl.p50,
            itl_p90_ms: itl.p90,
            itl_p99_ms: itl.p99,
            ttft_p90_ms: ttft.p90,
            output_tps: s.output_token_throughput,
        });
    }
    Ok((prefill, decode))
}
