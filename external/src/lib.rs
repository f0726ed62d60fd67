//! dyn-external: external engine servers (vLLM, llama.cpp, OpenAI-compatible) supervised as
//! `decode` workers. It must not depend on the native engine (dyn-engine), the planner or the
//! frontend.
//!
//! External engine servers as `decode` workers: vLLM, llama.cpp's `llama-server`, or any
//! OpenAI-compatible server, one server per replica.
//!
//! Token ids go in and out (vLLM, llama.cpp): dyn's `preprocess` tokenizes, the server gets
//! the ids, and the ids it samples stream back for dyn's `postprocess` to detokenize and match
//! stop strings, so a response has the same shape whatever the engine, and the router's
//! block hashes name exactly what the server caches. An OpenAI server gets the prompt as text
//! and its text is tokenized again.
//!
//! Files: [`config`] (the YAML section), `server` (the replica's server: URL or launched and
//! supervised, health, readiness), `protocol` (requests and streamed chunks per engine),
//! `kv_events` (vLLM's ZeroMQ KV events into the router's index), `scrape` (the server's
//! Prometheus load into the router's view).
//!
//! A request streams over its own HTTP connection; a client that goes away drops the stream,
//! which closes the connection, and the server aborts the request. A server that fails
//! mid-stream (refused, reset, closed before the end) is a lost replica: the request fails
//! `InstanceLost`, which migrates it (`migration_limit`) with the tokens already sent appended
//! to its prompt, and the replica is checked at once and leaves discovery if it is down. A
//! server's 429 is `Overloaded`: the client hears it at once, nothing is resent.

pub mod config;
mod kv_events;
mod protocol;
mod scrape;
mod server;

use std::sync::Arc;
use std::time::Duration;

use dyn_core::{BuildCx, BuildError, OpError};
use dyn_llm::model::ModelDir;
use dyn_llm::types::{FinishReason, Generated, PreprocessedRequest};
use eventsource_stream::Eventsource;
use futures::StreamExt;
use futures::stream::BoxStream;
use tokenizers::Tokenizer;
use tokio_util::task::AbortOnDropHandle;

pub use config::{ExternalConfig, ExternalKind};
use protocol::{Ask, Chunk, Prompt};
use server::{Server, ServerSpec};

/// A replica whose engine is an external server.
pub struct ExternalEngine {
    kind: ExternalKind,
    server: Server,
    client: reqwest::Client,
    tokenizer: Arc<Tokenizer>,
    _tasks: Vec<AbortOnDropHandle<()>>,
}

impl ExternalEngine {
    /// Start following (or launching) this replica's server. The build does not wait for it:
    /// the replica joins discovery once the server is healthy (see `server`).
    pub async fn start(
        kind: ExternalKind,
        config: &ExternalConfig,
        cx: &BuildCx,
    ) -> Result<Arc<Self>, BuildError> {
        let model = ModelDir::shared(cx).await?;
        let urls = config.urls();
        let url = match &config.launch {
            Some(_) => None,
            None => Some(urls.get(cx.replica as usize).cloned().ok_or_else(|| {
                BuildError::new(format!(
                    "replica {} has no server: {} given",
                    cx.replica,
                    urls.len()
                ))
            })?),
        };
        let mut tasks = Vec::new();
        let mut follower = None;
        let mut extra_args: Option<Box<dyn Fn() -> String + Send + Sync>> = None;
        if config.follows_kv_events(kind) {
            let (f, sub) = match (
                &config.launch,
                config.kv_publishers.get(cx.replica as usize),
            ) {
                (Some(_), _) => kv_events::Follower::open("tcp://127.0.0.1:0", true, None).await,
                (None, Some(p)) => match (&p.listen, &p.events) {
                    (Some(at), _) => kv_events::Follower::open(at, true, p.replay.clone()).await,
                    (None, Some(at)) => {
                        kv_events::Follower::open(at, false, p.replay.clone()).await
                    }
                    (None, None) => Err("a kv_publishers entry names no endpoint".to_owned()),
                },
                (None, None) => Err("no kv_publishers entry for this replica".to_owned()),
            }
            .map_err(BuildError::new)?;
            if config.launch.is_some() {
                extra_args = Some(Box::new(f.launch_args()));
            }
            follower = Some((f, sub));
        }
        let server = Server::start(
            ServerSpec {
                kind,
                config: config.clone(),
                url,
                replica: cx.replica,
                model_path: model.path.display().to_string(),
                model_name: model.name.clone(),
                tokenizer: model.tokenizer.clone(),
                extra_args,
                node: cx.node.clone(),
            },
            cx.readiness.clone(),
        );
        if let Some((f, sub)) = follower {
            let cx = cx.clone();
            let endpoint = server.watch();
            tasks.push(AbortOnDropHandle::new(tokio::spawn(async move {
                if let Err(e) = f.run(sub, &cx, endpoint).await {
                    tracing::error!(node = %cx.node, error = %e, "Not following the engine's KV events");
                }
            })));
        }
        if config.metrics_interval_s > 0.0 && kind != ExternalKind::Openai {
            let cx = cx.clone();
            let endpoint = server.watch();
            let interval = Duration::from_secs_f64(config.metrics_interval_s);
            // 0: not announced; routers keep their own (see `route/kv_aware.rs`).
            let block_size = config.block_size.unwrap_or(0);
            tasks.push(AbortOnDropHandle::new(tokio::spawn(async move {
                scrape::run(kind, &cx, interval, block_size, endpoint).await;
            })));
        }
        Ok(Arc::new(ExternalEngine {
            kind,
            server,
            client: reqwest::Client::new(),
            tokenizer: model.tokenizer.clone(),
            _tasks: tasks,
        }))
    }

    /// Run `req` on the server: [`Generated::Start`] once the server took it, then its
    /// tokens. Dropping the stream closes the connection, which aborts the request there.
    pub fn generate(
        self: &Arc<Self>,
        req: PreprocessedRequest,
    ) -> BoxStream<'static, Result<Generated, OpError>> {
        let this = self.clone();
        async_stream::stream! {
            let Some(ep) = this.server.endpoint() else {
                yield Err(OpError::instance_lost("the engine server is down"));
                return;
            };
            let stop = &req.stop;
            let max = stop.max_tokens;
            if max == 0 {
                // Migrated after its last token, before the server said it was done.
                yield Ok(Generated::Start(req.output.clone()));
                yield Ok(Generated::Tokens { ids: Vec::new(), finish: Some(FinishReason::Length) });
                return;
            }
            // llama.cpp has no min_tokens: run that many with eos ignored first, then the rest.
            let phases: Vec<(u32, bool)> = if this.kind == ExternalKind::Llamacpp && stop.min_tokens > 0 && !stop.ignore_eos {
                vec![(stop.min_tokens.min(max), true), (max, false)]
            } else {
                vec![(max, stop.ignore_eos)]
            };
            let mut produced: Vec<u32> = Vec::new();
            let mut started = false;
            for (phase, &(upto, ignore_eos)) in phases.iter().enumerate() {
                let last_phase = phase + 1 == phases.len();
                let done = produced.len() as u32;
                if upto <= done {
                    continue;
                }
                let tokens: Vec<u32>;
                let prompt = match this.kind {
                    ExternalKind::Openai => match this.tokenizer.decode(&req.token_ids, false) {
                        Ok(t) => Prompt::Text(t),
                        Err(e) => {
                            yield Err(OpError::internal(format!("cannot decode the prompt: {e}")));
                            return;
                        }
                    },
                    _ => {
                        tokens = req.token_ids.iter().chain(&produced).copied().collect();
                        Prompt::Tokens(&tokens)
                    }
                };
                let ask = Ask {
                    model: &ep.model,
                    prompt,
                    max_tokens: upto - done,
                    min_tokens: stop.min_tokens,
                    ignore_eos,
                };
                let call = protocol::request(this.kind, &req, &ask);
                let url = format!("{}{}", ep.base, call.path);
                let resp = match this.client.post(&url).json(&call.body).send().await {
                    Ok(r) => r,
                    Err(e) => {
                        this.server.suspect();
                        yield Err(OpError::instance_lost(format!("the engine server at {} did not take the request: {e}", ep.base)));
                        return;
                    }
                };
                let status = resp.status();
                if !status.is_success() {
                    let body = resp.text().await.unwrap_or_default();
                    yield Err(refused(&this.server, status, &body));
                    return;
                }
                if !started {
                    started = true;
                    yield Ok(Generated::Start(req.output.clone()));
                }
                let mut events = resp.bytes_stream().eventsource();
                let mut finish = None;
                // A server that stops answering its health checks while a stream is open (hung,
                // not closed) ends the stream too: never a request that waits forever.
                let mut health = this.server.watch();
                loop {
                    let ev = tokio::select! {
                        ev = events.next() => ev,
                        changed = health.changed() => {
                            if changed.is_err() || health.borrow_and_update().as_ref() != Some(&ep) {
                                yield Err(OpError::instance_lost(format!("the engine server at {} went down", ep.base)));
                                return;
                            }
                            continue;
                        }
                    };
                    let Some(ev) = ev else { break };
                    let data = match ev {
                        Ok(ev) => ev.data,
                        Err(e) => {
                            this.server.suspect();
                            yield Err(OpError::instance_lost(format!("the engine server at {} broke off the stream: {e}", ep.base)));
                            return;
                        }
                    };
                    if data == "[DONE]" {
                        break;
                    }
                    let (mut ids, mut f) = match protocol::parse(this.kind, &data) {
                        Ok(Chunk::Nothing) => continue,
                        Ok(Chunk::Tokens(ids, f)) => (ids, f),
                        Ok(Chunk::Text(text, f)) => match this.tokenizer.encode(text, false) {
                            Ok(enc) => (enc.get_ids().to_vec(), f),
                            Err(e) => {
                                yield Err(OpError::internal(format!("cannot tokenize the engine's text: {e}")));
                                return;
                            }
                        },
                        Err(msg) => {
                            yield Err(OpError::internal(msg));
                            return;
                        }
                    };
                    // dyn's eos ids end the output too (a server may know fewer of them).
                    if !stop.ignore_eos {
                        let before = produced.len();
                        if let Some(j) = ids.iter().enumerate().position(|(j, t)| {
                            before + j + 1 > stop.min_tokens as usize && stop.eos_token_ids.contains(t)
                        }) {
                            ids.truncate(j + 1);
                            f = Some(FinishReason::Stop);
                        }
                    }
                    produced.extend_from_slice(&ids);
                    // The end of the eos-ignoring phase is not the end of the request.
                    let report = match f {
                        Some(FinishReason::Length) if !last_phase && (produced.len() as u32) < max => None,
                        other => other,
                    };
                    if !ids.is_empty() || report.is_some() {
                        yield Ok(Generated::Tokens { ids, finish: report });
                    }
                    if f.is_some() {
                        finish = Some(report);
                        break;
                    }
                }
                match finish {
                    None => {
                        this.server.suspect();
                        yield Err(OpError::instance_lost(format!("the engine server at {} closed the stream before the request finished", ep.base)));
                        return;
                    }
                    Some(Some(_)) => return,
                    Some(None) => {}
                }
            }
        }
        .boxed()
    }
}

/// A server's refusal as the client should see it.
fn refused(server: &Server, status: reqwest::StatusCode, body: &str) -> OpError {
    let detail = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            let e = v.get("error")?;
            e.get("message")
                .and_then(|m| m.as_str())
                .or(e.as_str())
                .map(str::to_owned)
        })
        .unwrap_or_else(|| body.chars().take(300).collect());
    let msg = format!("the engine server refused the request ({status}): {detail}");
    if status == reqwest::StatusCode::TOO_MANY_REQUESTS {
        // Full, not broken: the client hears it now rather than after resends elsewhere.
        OpError::overloaded(msg)
    } else if status.is_server_error() {
        server.suspect();
        OpError::instance_lost(msg)
    } else {
        OpError::invalid(msg)
    }
}
