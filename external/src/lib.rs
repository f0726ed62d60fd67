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
mod lora;
mod protocol;
mod scrape;
mod server;

use std::sync::Arc;
use std::time::Duration;

use dyn_core::{BuildCx, BuildError, OpError};
use dyn_llm::model::ModelDir;
use dyn_protocol::types::{
    FinishReason, Generated, Logprobs, PreprocessedRequest, StopConditions, TokenLogprob,
};
use eventsource_stream::{Event, Eventsource};
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use tokenizers::Tokenizer;
use tokio::sync::watch;
use tokio_util::task::AbortOnDropHandle;

pub use config::{ExternalConfig, ExternalKind};
use protocol::{Ask, Chunk, Prompt};
use server::{Endpoint, Server, ServerSpec};

/// Whether an adapter's path is a GGUF LoRA file (by its extension, as dyn reads it).
fn is_gguf(path: &str) -> bool {
    std::path::Path::new(path)
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// What dyn adds to a launched llama-server's command line for the graph's GGUF adapters:
/// `--lora FILE` each (absolute, as the ingress names them, so that the server's list matches),
/// not applied unless a request asks, and `--cache-ram 0`: its prompt cache across slots keys
/// KV by tokens alone, so a prompt computed under one adapter would be restored for a request
/// under another (a slot's own KV is cleared when its adapters change). PEFT directories are
/// left out (llama-server reads GGUF only; requests of them are refused by name).
async fn llamacpp_lora_args(cx: &BuildCx) -> String {
    let Some(model) = &cx.model else {
        return String::new();
    };
    let mut args = Vec::new();
    for path in model.loras.values().filter(|p| is_gguf(p)) {
        let path = cx.resolve(path);
        // A missing file is the ingress's error to report (it checks every adapter).
        let path = tokio::fs::canonicalize(&path).await.unwrap_or(path);
        args.push(format!(
            "--lora {}",
            shell_quoted(&path.display().to_string())
        ));
    }
    if args.is_empty() {
        return String::new();
    }
    format!("--cache-ram 0 --lora-init-without-apply {}", args.join(" "))
}

/// A launched server's extra arguments (made anew at each start) with `args` after them.
fn append_args(extra: &mut Option<Box<dyn Fn() -> String + Send + Sync>>, args: String) {
    *extra = Some(match extra.take() {
        Some(before) => Box::new(move || format!("{} {args}", before())),
        None => Box::new(move || args.clone()),
    });
}

/// `s` as one word for `sh`.
fn shell_quoted(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// One streamed event's output tokens, finish reason and (when asked) log-probabilities.
type Tokens = (Vec<u32>, Option<FinishReason>, Vec<TokenLogprob>);

/// A replica whose engine is an external server.
pub struct ExternalEngine {
    kind: ExternalKind,
    server: Server,
    client: reqwest::Client,
    tokenizer: Arc<Tokenizer>,
    /// How long the server may send nothing (`stall_timeout_s`).
    stall: Duration,
    /// vLLM with `lora`: the adapters loaded into its servers.
    loras: Option<lora::Loaded>,
    /// llama.cpp: the adapters its servers were started with.
    listed: Option<lora::Listed>,
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
        let mut config = config.clone();
        if let (Some(l), true) = (&config.lora, config.launch.is_some()) {
            append_args(&mut extra_args, l.launch_args());
            config
                .env
                .insert("VLLM_ALLOW_RUNTIME_LORA_UPDATING".into(), "True".into());
        }
        if let (ExternalKind::Llamacpp, Some(_)) = (kind, &config.launch) {
            let args = llamacpp_lora_args(cx).await;
            if !args.is_empty() {
                append_args(&mut extra_args, args);
            }
        }
        let loras = config.lora.as_ref().map(|l| lora::Loaded::new(l.keep));
        let listed = (kind == ExternalKind::Llamacpp).then(lora::Listed::default);
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
            // A server that stops answering mid-stream (wedged, not dead: its health check
            // catches that) fails the request after `stall` without a byte (`send`,
            // `next_data`), which migrates it.
            client: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(5))
                .build()
                .map_err(|e| BuildError::new(format!("HTTP client: {e}")))?,
            tokenizer: model.tokenizer.clone(),
            stall: Duration::from_secs_f64(config.stall_timeout_s),
            loras,
            listed,
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
            if req.sampling.embed.is_some() {
                match this.embed(&ep, &req).await {
                    Ok(v) => {
                        yield Ok(Generated::Start(req.output.clone()));
                        yield Ok(Generated::Tokens { ids: Vec::new(), finish: Some(FinishReason::Stop), logprobs: None, embedding: Some(v) });
                    }
                    Err(e) => yield Err(e),
                }
                return;
            }
            // The `model` the server is asked for: its own, or the adapter's name there; for
            // llama.cpp the adapters the request applies.
            let mut in_use = None;
            let mut applied = None;
            if let Some(listed) = &this.listed {
                let lora = req.routing.lora.as_ref();
                if let Some(l) = lora.filter(|l| !is_gguf(&l.path)) {
                    yield Err(OpError::invalid(format!(
                        "model `{}` is a LoRA adapter: llama.cpp reads GGUF LoRA files (its \
                         convert_lora_to_gguf.py writes them), not PEFT directories",
                        l.name
                    )).with_param("model"));
                    return;
                }
                match listed.field(&this.client, (&this.server, &ep), lora, this.stall).await {
                    Ok(f) => applied = f,
                    Err(e) => {
                        yield Err(e);
                        return;
                    }
                }
            }
            let model = match (&req.routing.lora, &this.loras) {
                (None, _) => ep.model.clone(),
                (Some(_), _) if this.listed.is_some() => ep.model.clone(),
                (Some(l), Some(loaded)) if !is_gguf(&l.path) => {
                    match loaded.ensure(&this.client, &ep, l, this.stall).await {
                        Ok((name, held)) => {
                            // Held for the request's life: not unloaded under it.
                            in_use = Some(held);
                            name
                        }
                        Err(e) => {
                            yield Err(e);
                            return;
                        }
                    }
                }
                (Some(l), _) => {
                    let why = match this.kind {
                        ExternalKind::Vllm if this.loras.is_some() => "vLLM reads PEFT directories, not GGUF LoRA files",
                        ExternalKind::Vllm => "this worker's vLLM servers serve no adapters (set `vllm.lora`)",
                        _ => "adapters run on native, vLLM and llama.cpp workers",
                    };
                    yield Err(OpError::invalid(format!("model `{}` is a LoRA adapter: {why}", l.name)).with_param("model"));
                    return;
                }
            };
            if req.stop.max_tokens == 0 {
                // Migrated after its last token, before the server said it was done.
                yield Ok(Generated::Start(req.output.clone()));
                yield Ok(Generated::Tokens { ids: Vec::new(), finish: Some(FinishReason::Length), logprobs: None, embedding: None });
                return;
            }
            for await item in this.run_phases(ep, model, applied, req) {
                yield item;
            }
            drop(in_use);
        }
        .boxed()
    }

    /// An embeddings request on the server's own `/v1/embeddings` (vLLM's pooling runner,
    /// llama-server with `--embeddings`): the prompt's tokens in (its text for an OpenAI
    /// server), the server's vector out, normalised as dyn's are. The server pools as it was
    /// started to.
    async fn embed(&self, ep: &Endpoint, req: &PreprocessedRequest) -> Result<Vec<f32>, OpError> {
        if let Some(l) = &req.routing.lora {
            return Err(OpError::invalid(format!(
                "model `{}` is a LoRA adapter: external workers embed with their base model only",
                l.name
            ))
            .with_param("model"));
        }
        // llama-server's embeddings take no per-request adapters: they would get the global
        // scales, the adapters applied (see `lora::Listed::field`).
        if let Some(listed) = &self.listed
            && listed
                .field(&self.client, (&self.server, ep), None, self.stall)
                .await?
                .is_some()
        {
            return Err(OpError::invalid(
                "this worker's llama.cpp server has LoRA adapters, which it would apply to every \
                 embedding: embeddings need a worker without adapters",
            ));
        }
        let input = match self.kind {
            ExternalKind::Openai => serde_json::json!(
                self.tokenizer
                    .decode(&req.token_ids, false)
                    .map_err(|e| OpError::internal(format!("cannot decode the prompt: {e}")))?
            ),
            _ => serde_json::json!(req.token_ids),
        };
        let url = format!("{}/v1/embeddings", ep.base);
        let body =
            serde_json::json!({"model": ep.model, "input": input, "encoding_format": "float"});
        let lost = |e: String| {
            self.server.suspect();
            OpError::instance_lost(format!("the engine server at {}: {e}", ep.base))
        };
        let resp = tokio::time::timeout(self.stall, self.client.post(&url).json(&body).send())
            .await
            .map_err(|_| lost(format!("no embedding in {:?}", self.stall)))?
            .map_err(|e| lost(e.to_string()))?;
        let status = resp.status();
        let text = tokio::time::timeout(self.stall, resp.text())
            .await
            .map_err(|_| lost(format!("no embedding in {:?}", self.stall)))?
            .map_err(|e| lost(e.to_string()))?;
        if !status.is_success() {
            return Err(refused(&self.server, status, &text));
        }
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| OpError::internal(format!("{url}: an answer that is not JSON: {e}")))?;
        let vector: Vec<f32> = serde_json::from_value(v["data"][0]["embedding"].clone())
            .map_err(|e| OpError::internal(format!("{url}: no embedding in its answer: {e}")))?;
        Ok(dyn_protocol::types::normalized(vector))
    }

    /// `req` on the server at `ep`, phase by phase (see [`Self::phases`]): [`Generated::Start`]
    /// once the server took the first, then the tokens of each.
    fn run_phases(
        self: Arc<Self>,
        ep: Endpoint,
        model: String,
        lora: Option<serde_json::Value>,
        req: PreprocessedRequest,
    ) -> impl Stream<Item = Result<Generated, OpError>> {
        async_stream::stream! {
            let stop = &req.stop;
            let max = stop.max_tokens;
            // The alternatives asked for with each token's log-probability.
            let top = req.sampling.logprobs.unwrap_or(0) as usize;
            let phases = self.phases(stop);
            let mut produced: Vec<u32> = Vec::new();
            let mut started = false;
            for (phase, &(upto, ignore_eos)) in phases.iter().enumerate() {
                let last_phase = phase + 1 == phases.len();
                let done = produced.len() as u32;
                if upto <= done {
                    continue;
                }
                let resp = match self.send(&ep, (&model, lora.as_ref()), &req, &produced, upto - done, ignore_eos).await {
                    Ok(resp) => resp,
                    Err(e) => {
                        yield Err(e);
                        return;
                    }
                };
                if !started {
                    started = true;
                    yield Ok(Generated::Start(req.output.clone()));
                }
                let mut events = resp.bytes_stream().eventsource();
                let mut health = self.server.watch();
                loop {
                    let (ids, f, lps) = match self.next_chunk(&mut events, &mut health, &ep, stop, produced.len(), top).await {
                        Ok(Some(chunk)) => chunk,
                        // Closed before a finish reason: the server failed mid-request.
                        Ok(None) => {
                            yield Err(closed_early(&self.server, &ep));
                            return;
                        }
                        Err(e) => {
                            yield Err(e);
                            return;
                        }
                    };
                    produced.extend_from_slice(&ids);
                    let report = reported(f, last_phase, produced.len(), max);
                    if !ids.is_empty() || report.is_some() {
                        let logprobs = (!lps.is_empty()).then(|| Box::new(Logprobs { tokens: lps, ..Logprobs::default() }));
                        yield Ok(Generated::Tokens { ids, finish: report, logprobs, embedding: None });
                    }
                    if report.is_some() {
                        return;
                    }
                    if f.is_some() {
                        // The eos-ignoring phase is over: the next one goes on from here.
                        break;
                    }
                }
            }
        }
    }

    /// The request's phases: `(output tokens by its end, whether eos is ignored)`.
    fn phases(&self, stop: &StopConditions) -> Vec<(u32, bool)> {
        let max = stop.max_tokens;
        // llama.cpp has no min_tokens: run that many with eos ignored first, then the rest.
        if self.kind == ExternalKind::Llamacpp && stop.min_tokens > 0 && !stop.ignore_eos {
            vec![(stop.min_tokens.min(max), true), (max, false)]
        } else {
            vec![(max, stop.ignore_eos)]
        }
    }

    /// Send one phase of `req`: its prompt followed by the tokens `produced` in earlier
    /// phases, for `max_tokens` more. The response is the server's accepted stream.
    async fn send(
        &self,
        ep: &Endpoint,
        (model, lora): (&str, Option<&serde_json::Value>),
        req: &PreprocessedRequest,
        produced: &[u32],
        max_tokens: u32,
        ignore_eos: bool,
    ) -> Result<reqwest::Response, OpError> {
        let tokens: Vec<u32>;
        let prompt = match self.kind {
            ExternalKind::Openai => match self.tokenizer.decode(&req.token_ids, false) {
                Ok(t) => Prompt::Text(t),
                Err(e) => {
                    return Err(OpError::internal(format!("cannot decode the prompt: {e}")));
                }
            },
            _ => {
                tokens = req.token_ids.iter().chain(produced).copied().collect();
                Prompt::Tokens(&tokens)
            }
        };
        let ask = Ask {
            model,
            lora,
            prompt,
            max_tokens,
            min_tokens: req.stop.min_tokens,
            ignore_eos,
        };
        let call = protocol::request(self.kind, req, &ask)
            .map_err(|(param, e)| OpError::invalid(e).with_param(param))?;
        let url = format!("{}{}", ep.base, call.path);
        let sent = tokio::time::timeout(self.stall, self.client.post(&url).json(&call.body).send());
        let resp = match sent.await {
            Ok(Ok(r)) => r,
            Err(_) => {
                self.server.suspect();
                return Err(OpError::instance_lost(format!(
                    "the engine server at {} sent no response for {:?}",
                    ep.base, self.stall
                )));
            }
            Ok(Err(e)) => {
                self.server.suspect();
                return Err(OpError::instance_lost(format!(
                    "the engine server at {} did not take the request: {e}",
                    ep.base
                )));
            }
        };
        let status = resp.status();
        if !status.is_success() {
            let body = tokio::time::timeout(self.stall, resp.text())
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or_default();
            // The server lost an adapter dyn loaded (restarted behind the same URL): load it
            // again when the request is resent.
            if let (reqwest::StatusCode::NOT_FOUND, Some(l), Some(loaded)) =
                (status, &req.routing.lora, &self.loras)
            {
                loaded.forget(ep, l);
                return Err(OpError::instance_lost(format!(
                    "the engine server at {} no longer holds adapter `{}`",
                    ep.base, l.name
                )));
            }
            return Err(refused(&self.server, status, &body));
        }
        Ok(resp)
    }

    /// The next event with tokens or a finish reason, or `None` at the end of the stream.
    async fn next_chunk<E: std::fmt::Display>(
        &self,
        events: &mut (impl Stream<Item = Result<Event, E>> + Unpin),
        health: &mut watch::Receiver<Option<Endpoint>>,
        ep: &Endpoint,
        stop: &StopConditions,
        before: usize,
        top: usize,
    ) -> Result<Option<Tokens>, OpError> {
        while let Some(data) = self.next_data(events, health, ep).await? {
            if let Some(chunk) = self.chunk(&data, stop, before, top)? {
                return Ok(Some(chunk));
            }
        }
        Ok(None)
    }

    /// The next event's data, or `None` at the end of the stream (`[DONE]` or closed).
    /// A server that stops answering its health checks while a stream is open (hung, not
    /// closed) ends the stream too: never a request that waits forever.
    async fn next_data<E: std::fmt::Display>(
        &self,
        events: &mut (impl Stream<Item = Result<Event, E>> + Unpin),
        health: &mut watch::Receiver<Option<Endpoint>>,
        ep: &Endpoint,
    ) -> Result<Option<String>, OpError> {
        loop {
            let ev = tokio::select! {
                ev = tokio::time::timeout(self.stall, events.next()) => match ev {
                    Ok(ev) => ev,
                    Err(_) => {
                        self.server.suspect();
                        return Err(OpError::instance_lost(format!(
                            "the engine server at {} sent nothing for {:?} mid-stream",
                            ep.base, self.stall
                        )));
                    }
                },
                changed = health.changed() => {
                    if changed.is_err() || health.borrow_and_update().as_ref() != Some(ep) {
                        return Err(OpError::instance_lost(format!(
                            "the engine server at {} went down",
                            ep.base
                        )));
                    }
                    continue;
                }
            };
            let Some(ev) = ev else { return Ok(None) };
            return match ev {
                Ok(ev) if ev.data == "[DONE]" => Ok(None),
                Ok(ev) => Ok(Some(ev.data)),
                Err(e) => {
                    self.server.suspect();
                    Err(OpError::instance_lost(format!(
                        "the engine server at {} broke off the stream: {e}",
                        ep.base
                    )))
                }
            };
        }
    }

    /// One event's tokens and finish reason, `None` for an event without either. `before`:
    /// the tokens produced before it, which count towards `min_tokens`.
    fn chunk(
        &self,
        data: &str,
        stop: &StopConditions,
        before: usize,
        top: usize,
    ) -> Result<Option<Tokens>, OpError> {
        let (mut ids, mut f, mut lps) = match protocol::parse(self.kind, data, top) {
            Ok(Chunk::Nothing) => return Ok(None),
            Ok(Chunk::Tokens(ids, f, lps)) => (ids, f, lps),
            Ok(Chunk::Text(text, f)) => match self.tokenizer.encode(text, false) {
                Ok(enc) => (enc.get_ids().to_vec(), f, Vec::new()),
                Err(e) => {
                    return Err(OpError::internal(format!(
                        "cannot tokenize the engine's text: {e}"
                    )));
                }
            },
            Err(msg) => return Err(OpError::internal(msg)),
        };
        // dyn's eos ids end the output too (a server may know fewer of them).
        if !stop.ignore_eos
            && let Some(j) = ids.iter().enumerate().position(|(j, t)| {
                before + j + 1 > stop.min_tokens as usize && stop.eos_token_ids.contains(t)
            })
        {
            ids.truncate(j + 1);
            lps.truncate(j + 1);
            f = Some(FinishReason::Stop);
        }
        Ok(Some((ids, f, lps)))
    }
}

/// A stream that ended without a finish reason: the server failed mid-request, and is
/// checked at once (the request migrates elsewhere).
fn closed_early(server: &Server, ep: &Endpoint) -> OpError {
    server.suspect();
    OpError::instance_lost(format!(
        "the engine server at {} closed the stream before the request finished",
        ep.base
    ))
}

/// The finish reason the client hears for a chunk: the end of the eos-ignoring phase is not
/// the end of the request.
fn reported(
    f: Option<FinishReason>,
    last_phase: bool,
    produced: usize,
    max: u32,
) -> Option<FinishReason> {
    match f {
        Some(FinishReason::Length) if !last_phase && (produced as u32) < max => None,
        other => other,
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
