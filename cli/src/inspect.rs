//! `dyn inspect`: reads a running graph's routing state from the admin endpoint of its `http`
//! ingress (`/admin/…`, loopback only) and prints it as tables, or as JSON with `--json`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{Args, Subcommand};
use dyn_frontend::admin::EventLine;
use dyn_planner::state::PlannerState;
use dyn_protocol::kv::KvEventData;
use dyn_router::admission::QueueAnswer;
use dyn_router::inspect::{KvAnswer, KvArgs, Query, Replicas, RouteAnswer, WorkersAnswer};
use dyn_router::remote_prefill::PrefillRouteAnswer;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};

pub const EXAMPLES: &str = "\
Examples:
  dyn inspect workers                       instances, active requests, KV blocks, hit rate
  dyn inspect route --prompt 'Hello there'  where that prompt would go, and why (not sent)
  dyn inspect route --messages chat.json    the same for a chat message list
  dyn inspect kv --top 10                   the KV index: blocks per worker, shared prefixes
  dyn inspect queue                         admission: room, waiting by priority, tenants' shares
  dyn inspect events --follow               KV events as the workers publish them
  dyn inspect planner                       the SLA planner: load, prediction, replicas, why";

#[derive(Args)]
#[command(after_help = EXAMPLES)]
pub struct InspectArgs {
    /// The graph's HTTP ingress
    #[arg(long, global = true, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// Print the admin endpoint's JSON instead of tables
    #[arg(long, global = true)]
    json: bool,
    /// The node to ask [default: every inspectable node; for `route`, the request path]
    #[arg(long, global = true)]
    node: Option<String>,
    #[command(subcommand)]
    command: InspectCommand,
}

#[derive(Subcommand)]
enum InspectCommand {
    /// Workers: live, active requests, pending prefill, KV blocks used / total, prefix hit rate
    Workers,
    /// Where a prompt would be routed: matched blocks, cost terms per worker, the choice
    Route {
        /// A plain prompt (tokenized as a completion prompt)
        #[arg(
            long,
            conflicts_with = "messages",
            required_unless_present = "messages"
        )]
        prompt: Option<String>,
        /// A JSON file with a chat message list (or {"messages": [...]})
        #[arg(long)]
        messages: Option<PathBuf>,
        /// The session the request would belong to: its binding, and whether it decides
        #[arg(long)]
        session: Option<String>,
        /// The model whose tokenizer and template read the prompt (default: the first the
        /// graph serves; name its router with --node where it serves several), or a LoRA
        /// adapter: its model's, with the prompt's blocks hashed under the adapter and its
        /// read priced on the workers without it
        #[arg(long)]
        model: Option<String>,
    },
    /// The KV index: stored blocks per worker, tree size, memory, top shared prefixes
    Kv {
        /// Only this worker (hex id, as `workers` prints it)
        #[arg(long)]
        worker: Option<String>,
        #[arg(long, default_value_t = 5)]
        top: usize,
    },
    /// The SLA planner's latest decision: observed load, prediction, targets, replicas, why
    Planner,
    /// The router's admission queue: room, in flight, waiting by priority, tenants' shares
    Queue,
    /// KV events as they arrive
    Events {
        /// Keep printing until interrupted
        #[arg(long)]
        follow: bool,
        /// Without --follow: how many seconds to listen
        #[arg(long, default_value_t = 2.0)]
        wait: f64,
        /// Only this worker node's events (e.g. decode)
        #[arg(long)]
        worker_node: Option<String>,
    },
}

pub fn inspect(args: InspectArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(run(args))
}

async fn run(args: InspectArgs) -> anyhow::Result<()> {
    let base = format!("{}/admin", args.url.trim_end_matches('/'));
    let http = reqwest::Client::new();
    if let InspectCommand::Events {
        follow,
        wait,
        worker_node,
    } = &args.command
    {
        return events(
            &http,
            &base,
            *follow,
            *wait,
            worker_node.as_deref(),
            args.json,
        )
        .await;
    }
    if let InspectCommand::Planner = &args.command {
        let url = format!("{base}/planner");
        let v = send(http.get(&url), &url).await?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&v)?);
        } else {
            print_planner(&typed(v)?);
        }
        return Ok(());
    }
    if let InspectCommand::Route {
        prompt,
        messages,
        session,
        model,
    } = &args.command
    {
        // Without --node every node on the path explains its part (router, remote prefill).
        let mut body = json!({"node": args.node, "session": session});
        if let Some(m) = model {
            body["model"] = json!(m);
        }
        if let Some(p) = prompt {
            body["prompt"] = json!(p);
        }
        if let Some(path) = messages {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            let v: Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: not JSON", path.display()))?;
            body["messages"] = match v {
                Value::Object(mut o) => o.remove("messages").unwrap_or(Value::Null),
                other => other,
            };
        }
        let answer = post(&http, &format!("{base}/route"), &body).await?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&answer)?);
            return Ok(());
        }
        // A router's answer (with the remote prefill decision after it), or, when --node
        // names a remote_prefill node, that node's decision alone.
        if let Ok(r) = serde_json::from_value::<RouteReply>(answer.clone()) {
            print_replicas(&r.router.replicas, print_route);
            if let Some(p) = r.prefill {
                print_replicas(&p.replicas, print_prefill_decision);
            }
        } else {
            let p: Replicas<PrefillRouteAnswer> = typed(answer)?;
            print_replicas(&p.replicas, print_prefill_decision);
        }
        return Ok(());
    }
    let nodes = match &args.node {
        Some(n) => vec![n.clone()],
        None => all_nodes(&http, &base).await?,
    };
    let (mut answered, mut passed_over) = (0, Vec::new());
    for (i, node) in nodes.iter().enumerate() {
        let query = match &args.command {
            InspectCommand::Workers => Query::Workers,
            InspectCommand::Kv { worker, top } => Query::Kv(KvArgs {
                worker: worker.clone(),
                top: *top,
            }),
            InspectCommand::Queue => Query::Queue,
            InspectCommand::Route { .. }
            | InspectCommand::Events { .. }
            | InspectCommand::Planner => {
                unreachable!("handled above")
            }
        };
        let answer = match post(&http, &format!("{base}{}", query.path(node)), &query.args()).await
        {
            Ok(a) => a,
            // Only route nodes with admission have a queue: the others are passed over (any
            // other failure is one).
            Err(e)
                if matches!(query, Query::Queue)
                    && args.node.is_none()
                    && format!("{e:#}").contains(dyn_router::inspect::NO_QUEUE) =>
            {
                passed_over.push(format!("{node}: {e:#}"));
                continue;
            }
            Err(e) => return Err(e),
        };
        answered += 1;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&answer)?);
            continue;
        }
        if nodes.len() > 1 {
            if i > 0 {
                println!();
            }
            println!("[{node}]");
        }
        match &args.command {
            InspectCommand::Workers => {
                let r: Replicas<WorkersAnswer> = typed(answer)?;
                print_replicas(&r.replicas, print_workers);
            }
            InspectCommand::Queue => {
                let r: Replicas<QueueAnswer> = typed(answer)?;
                print_replicas(&r.replicas, print_queue);
            }
            _ => {
                let r: Replicas<KvAnswer> = typed(answer)?;
                print_replicas(&r.replicas, print_kv);
            }
        }
    }
    if answered == 0 && !passed_over.is_empty() {
        bail!(
            "no node has an admission queue:\n  {}",
            passed_over.join("\n  ")
        );
    }
    Ok(())
}

/// The admin endpoint's answer to `/admin/route` from a router, with the remote prefill
/// node's decision when the path has one.
#[derive(Deserialize)]
struct RouteReply {
    #[serde(flatten)]
    router: Replicas<RouteAnswer>,
    prefill: Option<Replicas<PrefillRouteAnswer>>,
}

/// Read an answer as the node kind's typed answer.
fn typed<T: serde::de::DeserializeOwned>(answer: Value) -> anyhow::Result<T> {
    serde_json::from_value(answer)
        .context("the admin endpoint's answer is not what this dyn expects (a different version?)")
}

/// Print each replica's answer, a blank line apart.
fn print_replicas<T>(replicas: &[T], printer: fn(&T)) {
    for (i, replica) in replicas.iter().enumerate() {
        if i > 0 {
            println!();
        }
        printer(replica);
    }
}

/// The remote prefill decision for the routed prompt.
fn print_prefill_decision(r: &PrefillRouteAnswer) {
    println!(
        "prefill: {} ({}) — {} of {} tokens not cached on the decode worker (remote above {}), {} prefill worker(s), queue limit {}{}",
        r.decision,
        r.reason,
        r.uncached_tokens,
        r.prompt_tokens,
        r.min_remote_tokens,
        r.prefill_workers,
        r.max_queue,
        match &r.prefill_worker {
            Some(w) => format!(" → prefill worker {w}"),
            None => String::new(),
        }
    );
    println!("decisions so far: {}", json!(r.decisions));
}

/// The admin endpoint's answer, or its error message.
async fn send(req: reqwest::RequestBuilder, url: &str) -> anyhow::Result<Value> {
    let resp = req.send().await.with_context(|| {
        format!("cannot reach {url} (is the graph up, and is this its http ingress?)")
    })?;
    let status = resp.status();
    let v: Value = resp
        .json()
        .await
        .with_context(|| format!("{url} did not answer JSON"))?;
    if !status.is_success() {
        bail!(
            "{url}: {status}: {}",
            v["error"]["message"].as_str().unwrap_or("error")
        );
    }
    Ok(v)
}

async fn post(http: &reqwest::Client, url: &str, body: &Value) -> anyhow::Result<Value> {
    let req = http.post(url).header("content-type", "application/json");
    let req = if body.is_null() {
        req
    } else {
        req.body(body.to_string())
    };
    send(req, url).await
}

async fn all_nodes(http: &reqwest::Client, base: &str) -> anyhow::Result<Vec<String>> {
    let url = format!("{base}/nodes");
    let v = send(http.get(&url), &url).await?;
    let nodes: Vec<String> = serde_json::from_value(v["nodes"].clone()).unwrap_or_default();
    if nodes.is_empty() {
        bail!("the graph has no inspectable node (a route or remote_prefill node)");
    }
    Ok(nodes)
}

/// A unit enum's name as it is written in the JSON (`holt`, `prefill`).
fn name(v: impl serde::Serialize) -> String {
    serde_json::to_value(v)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn print_planner(s: &PlannerState) {
    let o = &s.observed;
    let ms = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.1} ms"));
    let tokens = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.0}"));
    println!(
        "planner: {} ({} predictor), scaling {}; every {} s, cool-down {} s",
        s.mode,
        name(s.predictor),
        s.connector,
        s.interval_s,
        s.cooldown_s
    );
    println!(
        "targets:   TTFT p{0} ≤ {1} ms, ITL p{0} ≤ {2} ms",
        s.percentile, s.ttft_ms, s.itl_ms
    );
    println!(
        "observed:  {:.2} req/s over {:.1} s ({} finished, {} failed, {} in flight), ISL {}, OSL {}, TTFT p{} {}, ITL {}",
        o.request_rate,
        o.interval_s,
        o.finished,
        o.errors,
        o.inflight,
        tokens(o.isl),
        tokens(o.osl),
        s.percentile,
        ms(o.ttft_ms),
        ms(o.itl_ms)
    );
    println!(
        "predicted: {:.2} req/s, ISL {:.0}, OSL {:.0}",
        s.predicted.request_rate, s.predicted.isl, s.predicted.osl
    );
    println!(
        "\n  {:<14} {:<8} {:>5} {:>7} {:>7} {:>6} {:>7} {:>7} {:>8}  REASON",
        "NODE", "PHASE", "MIN", "MAX", "WORKERS", "QUEUED", "CURRENT", "DESIRED", "ACTUAL"
    );
    for n in &s.nodes {
        let d = &n.decision;
        let load = o.nodes.get(&d.node).cloned().unwrap_or_default();
        let phase = name(d.phase);
        let needed = d
            .needed
            .map_or(String::new(), |n| format!(" [needs {n:.2}]"));
        let error = n
            .error
            .as_ref()
            .map_or(String::new(), |e| format!(" [error: {e}]"));
        println!(
            "  {:<14} {:<8} {:>5} {:>7} {:>7} {:>6} {:>7} {:>7} {:>8}  {}{needed}{error}",
            d.node,
            phase,
            d.min,
            d.max,
            load.workers,
            load.waiting,
            d.current,
            d.desired,
            n.actual,
            d.reason
        );
    }
}

/// An optional figure, `-` when absent.
fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

fn print_queue(q: &QueueAnswer) {
    println!(
        "in flight {}/{} (one tenant at most {}); waiting {}/{} (at most {:.1} s); a finish every {} ms",
        q.in_flight,
        q.room,
        q.tenant_room,
        q.waiting,
        q.queue,
        q.max_wait_s,
        opt(q.finish_gap_ms.map(|g| format!("{g:.1}")))
    );
    if !q.waiting_by_priority.is_empty() {
        let by: Vec<String> = q
            .waiting_by_priority
            .iter()
            .map(|(p, n)| format!("priority {p}: {n}"))
            .collect();
        println!("waiting by priority: {}", by.join(", "));
    }
    if q.tenants.is_empty() {
        return;
    }
    println!(
        "{:<24} {:>7} {:>10} {:>8} {:>14} {:>10}",
        "tenant", "weight", "in flight", "waiting", "counter", "lift"
    );
    for t in &q.tenants {
        let name = if t.tenant.is_empty() {
            "(none)"
        } else {
            &t.tenant
        };
        println!(
            "{:<24} {:>7} {:>10} {:>8} {:>14.0} {:>10.0}",
            name, t.weight, t.in_flight, t.waiting, t.counter, t.lift
        );
    }
}

fn print_workers(r: &WorkersAnswer) {
    println!("policy {} over '{}'", r.policy, r.target);
    if let Some(d) = &r.decisions {
        println!("prefill decisions: {}", json!(d));
    }
    if let Some(q) = &r.quality {
        let (achieved, reachable) = q.hit_rates();
        println!(
            "routing: {} decisions; best-matching worker chosen {} of {} times; hit rate \
             expected {achieved:.3} of {reachable:.3} reachable; {} avoidable prefill tokens",
            q.decisions, q.best_match_decisions, q.match_decisions, q.avoidable_prefill_tokens
        );
    }
    println!(
        "{:<18} {:>5} {:>7} {:>11} {:>14} {:>8} {:>15} {:>9} {:>8} {:>8} {:>10} {:>8}",
        "worker",
        "live",
        "active",
        "prefill tok",
        "routed blocks",
        "indexed",
        "kv used/total",
        "hit rate",
        "running",
        "waiting",
        "breaker",
        "transfer"
    );
    for w in &r.workers {
        println!(
            "{:<18} {:>5} {:>7} {:>11} {:>14} {:>8} {:>15} {:>9} {:>8} {:>8} {:>10} {:>8}",
            w.worker_id,
            w.live,
            w.active_requests,
            w.pending_prefill_tokens,
            w.active_blocks_routed,
            opt(w.indexed_blocks),
            format!("{}/{}", opt(w.kv_active_blocks), opt(w.kv_total_blocks)),
            opt(w.prefix_cache_hit_rate.map(|h| format!("{h:.3}"))),
            opt(w.requests_running),
            opt(w.requests_waiting),
            w.breaker,
            opt(w.transfer.as_deref()),
        );
    }
}

fn print_route(r: &RouteAnswer) {
    println!(
        "prompt: {} tokens, {} blocks of {}; policy {} → worker {}",
        r.prompt_tokens, r.prompt_blocks, r.block_size, r.policy, r.worker_id,
    );
    if let Some(s) = &r.session {
        let per: Vec<String> = s
            .bound_per_worker
            .iter()
            .map(|(w, n)| format!("{w}: {n}"))
            .collect();
        match (&s.bound_worker, s.expires_in_s) {
            (Some(w), Some(left)) => println!(
                "session {:?}: bound to {w} for {left:.0} s more; {} (sessions per worker: {})",
                s.session,
                if s.kept {
                    "it decides"
                } else {
                    "that worker is gone or over its bound: the session moves"
                },
                per.join(", ")
            ),
            _ => println!(
                "session {:?}: not bound; this request binds it (sessions per worker: {})",
                s.session,
                per.join(", ")
            ),
        }
    }
    let Some(p) = &r.pricing else {
        return;
    };
    println!(
        "cost {}: miss_weight {}, overlap_weight {}, overlap_credit {}, load_bound {} (slack {}), temperature {}",
        format!("{:?}", p.model).to_lowercase(),
        p.miss_weight,
        p.overlap_weight,
        p.overlap_credit,
        p.load_bound,
        p.load_slack,
        p.temperature
    );
    println!("why: {}", r.reason);
    println!(
        "  {:<18} {:>7} {:>7} {:>7} {:>8} {:>6} {:>8} {:>9} {:>10} {:>9} {:>9}  left out",
        "worker",
        "cached",
        "indexed",
        "pending",
        "prefill",
        "reqs",
        "queued",
        "queue ms",
        "prefill ms",
        "ttft ms",
        "cost"
    );
    for c in &r.candidates {
        let id = format!("{:x}", c.worker);
        println!(
            "{} {:<18} {:>7} {:>7} {:>7} {:>8} {:>6} {:>8} {:>9.2} {:>10.2} {:>9.2} {:>9.3}  {}",
            if id == r.worker_id { "*" } else { " " },
            id,
            c.matched_blocks,
            c.indexed_blocks,
            c.pending_blocks,
            c.prefill_tokens,
            c.requests,
            c.queued_tokens,
            c.queue_ms,
            c.prefill_ms,
            c.ttft_ms(),
            c.cost,
            c.excluded.as_deref().unwrap_or("-"),
        );
    }
    // A LoRA adapter's request (`--model ADAPTER`): where it would be read first.
    let missing: Vec<String> = r
        .candidates
        .iter()
        .filter(|c| c.lora_ms > 0.0)
        .map(|c| format!("{:x} ({:.0} ms)", c.worker, c.lora_ms))
        .collect();
    if !missing.is_empty() {
        println!(
            "adapter not held by: {} — its read is in their prefill ms",
            missing.join(", ")
        );
    }
}

fn print_kv(r: &KvAnswer) {
    println!(
        "index: {} prefixes, {} stored blocks (block size {}), {} bytes ({:.3} bytes/block)",
        r.tree_nodes, r.stored_blocks, r.block_size, r.bytes, r.bytes_per_block,
    );
    println!(
        "{:<18} {:>8} {:>8} {:>8} {:>8}",
        "worker", "blocks", "GPU", "CPU", "DISK"
    );
    for w in &r.workers {
        println!(
            "{:<18} {:>8} {:>8} {:>8} {:>8}",
            w.worker_id, w.blocks, w.gpu, w.cpu, w.disk
        );
    }
    if !r.top_shared_prefixes.is_empty() {
        println!("top shared prefixes:");
        for p in &r.top_shared_prefixes {
            println!(
                "  {} blocks ({} tokens) {} on {}",
                p.blocks,
                p.tokens,
                p.hash,
                p.workers.join(", ")
            );
        }
    }
}

/// One KV event as a line.
fn describe_event(line: &EventLine) -> String {
    let e = &line.event;
    let what = match &e.event.data {
        KvEventData::Stored {
            parent_hash,
            blocks,
        } => format!(
            "stored {} blocks after {}",
            blocks.len(),
            parent_hash.map_or_else(|| "root".to_owned(), |p| format!("{p:x}"))
        ),
        KvEventData::Removed { block_hashes } => format!("removed {} blocks", block_hashes.len()),
        KvEventData::Cleared => "cleared".to_owned(),
    };
    format!(
        "worker {:x} #{} {} {what}",
        e.worker_id,
        e.event.event_id,
        e.event.medium.name()
    )
}

async fn events(
    http: &reqwest::Client,
    base: &str,
    follow: bool,
    wait: f64,
    node: Option<&str>,
    as_json: bool,
) -> anyhow::Result<()> {
    let mut url = format!("{base}/events");
    if let Some(n) = node {
        url.push_str(&format!("?node={n}"));
    }
    let resp = http
        .get(&url)
        .send()
        .await
        .with_context(|| format!("cannot reach {url}"))?;
    if !resp.status().is_success() {
        bail!("{url}: {}", resp.status());
    }
    let mut body = resp.bytes_stream();
    let mut parser = dyn_bench::sse::SseParser::new();
    let mut out = Vec::new();
    let deadline = (!follow).then(|| {
        tokio::time::Instant::now() + Duration::try_from_secs_f64(wait).unwrap_or_default()
    });
    loop {
        let next = match deadline {
            Some(d) => match tokio::time::timeout_at(d, body.next()).await {
                Ok(n) => n,
                Err(_) => return Ok(()),
            },
            None => body.next().await,
        };
        let Some(chunk) = next else { return Ok(()) };
        parser.push(&chunk.context("the event stream broke")?, &mut out);
        for ev in out.drain(..) {
            if as_json {
                println!("{}", ev.data);
            } else if let Ok(line) = serde_json::from_str::<EventLine>(&ev.data) {
                println!("{}", describe_event(&line));
            }
        }
    }
}
