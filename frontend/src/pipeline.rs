//! The request pipeline every generating dialect shares: a parsed request goes down the
//! graph with the headers' tenant, priority and session ([`start`]), its choices and prompts
//! run as sibling requests ([`choices`]), its deadline bounds the stream
//! ([`until_deadline`]), and [`Track`] counts it in the frontend's metrics from start to end.
//! What the answer looks like ([`Options`]) travels beside it, set by the dialect that parsed
//! it.

use std::sync::Arc;
use std::time::Instant;

use axum::http::HeaderMap;
use dyn_core::{Ctx, OpError};
use dyn_planner::stats::FrontendStats;
use dyn_protocol::types::{LlmDelta, LlmRequest, Prompt};
use futures::StreamExt;

use super::reasoning::ReasoningFormat;
use super::tools::ToolFormat;
use super::{ApiError, KeyTenant};
use crate::app::App;
use crate::metrics::FRONTEND;

impl Options {
    /// Choices in all: `n` for each prompt.
    pub(crate) fn total(&self) -> usize {
        self.n * (1 + self.more_prompts.len())
    }

    /// The prompt choice `i` answers.
    pub(crate) fn prompt_of(&self, i: usize) -> usize {
        i / self.n.max(1)
    }

    /// What choice `i` echoes, if the request echoes.
    pub(crate) fn echo_of(&self, i: usize) -> Option<Option<String>> {
        let e = self.echo.as_ref()?;
        e.get(self.prompt_of(i)).cloned()
    }
}

pub(crate) struct Options {
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    /// Tool calls are parsed out of the answer, in this format.
    pub(crate) tools: Option<ToolFormat>,
    /// The answer carries its tokens' log-probabilities.
    pub(crate) logprobs: bool,
    /// Completions' `echo`, per prompt: the answer starts with the prompt — its text when the
    /// client sent text, else (`None`) the text of its tokens as the engine reports them.
    pub(crate) echo: Option<Vec<Option<String>>>,
    /// Choices per prompt (OpenAI's `n`).
    pub(crate) n: usize,
    /// Completions' prompts after the first (the request's own): each has its `n` choices,
    /// numbered after the earlier prompts' (vLLM's order).
    pub(crate) more_prompts: Vec<Prompt>,
    /// Chat: reasoning is split out of the answer, in this format.
    pub(crate) reasoning: Option<ReasoningFormat>,
    /// vLLM's `return_token_ids`: choices carry `token_ids`, and the prompt's come back as
    /// `prompt_token_ids` (completions: per choice; chat: beside the choices).
    pub(crate) token_ids: bool,
    /// The model the client named (an adapter's name where it named one): the answer's.
    pub(crate) named: Arc<str>,
}

/// The context of a request that runs in parts ([`start_part`]).
pub(crate) fn request_ctx(app: &App, headers: &HeaderMap) -> Result<Ctx, ApiError> {
    app.server.request_ctx(&app.chain, headers)
}

/// Counts one request in the frontend metrics from start to end; dropped without `finish`
/// (the client went away) it counts as cancelled.
pub(crate) struct Track {
    model: Arc<str>,
    /// The request's context until its first token: it names the pool serving the request,
    /// if a router chose among pools (let go then, so the request's end hooks are not held).
    ctx: Option<Ctx>,
    pool: Option<Arc<str>>,
    endpoint: &'static str,
    stream: bool,
    start: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// Tokens after the first one's delta, for the request's mean ITL.
    later_tokens: u32,
    usage: Option<(u32, u32)>,
    status: Option<&'static str>,
    stats: Arc<FrontendStats>,
}

impl Track {
    /// Counted under `model` (the base model the request runs on) and `endpoint` (the route's
    /// name: `chat_completions`, `messages`, …).
    fn new(app: &App, model: Arc<str>, endpoint: &'static str, stream: bool) -> Self {
        FRONTEND.inflight.with_label_values(&[&*model]).inc();
        app.stats.arrived();
        Self {
            stats: app.stats.clone(),
            ctx: None,
            pool: None,
            first_token: None,
            later_tokens: 0,
            usage: None,
            model,
            endpoint,
            stream,
            start: Instant::now(),
            last_token: None,
            status: None,
        }
    }

    pub(crate) fn delta(&mut self, d: &LlmDelta) {
        let m = [&*self.model];
        if let Some(u) = d.usage {
            // Several choices: the prompt once, their answers together.
            let before = self.usage.map_or(0, |(_, c)| c);
            self.usage = Some((u.prompt_tokens, before + u.completion_tokens));
            FRONTEND
                .input_tokens
                .with_label_values(&m)
                .inc_by(u64::from(u.prompt_tokens));
            FRONTEND
                .output_tokens
                .with_label_values(&m)
                .inc_by(u64::from(u.completion_tokens));
        }
        // A delta without tokens (an embedding's, the end of a stop string) times nothing.
        if d.tokens == 0 {
            return;
        }
        let now = Instant::now();
        match self.last_token {
            None => {
                FRONTEND
                    .ttft
                    .with_label_values(&m)
                    .observe((now - self.start).as_secs_f64());
                self.pool = self.ctx.take().and_then(|c| c.pool());
                self.stats
                    .first_token(now - self.start, self.pool.as_deref());
                self.first_token = Some(now);
            }
            Some(last) => {
                FRONTEND
                    .itl
                    .with_label_values(&m)
                    .observe((now - last).as_secs_f64() / f64::from(d.tokens));
                self.later_tokens += d.tokens;
            }
        }
        self.last_token = Some(now);
    }

    pub(crate) fn finish(&mut self, status: &'static str) {
        self.status.get_or_insert(status);
    }
}

impl Drop for Track {
    fn drop(&mut self) {
        let m = &*self.model;
        FRONTEND.inflight.with_label_values(&[m]).dec();
        let kind = if self.stream { "stream" } else { "unary" };
        let status = self.status.unwrap_or("cancelled");
        FRONTEND
            .requests
            .with_label_values(&[m, self.endpoint, kind, status])
            .inc();
        let itl = match (self.first_token, self.last_token) {
            (Some(first), Some(last)) if self.later_tokens > 0 => {
                Some((last - first) / self.later_tokens)
            }
            _ => None,
        };
        // A cancelled request is the client's doing, not a failure of the deployment.
        let pool = self.pool.take().or_else(|| self.ctx.take()?.pool());
        self.stats
            .finished(status != "error", self.usage, itl, pool.as_deref());
        if status == "success" {
            FRONTEND
                .duration
                .with_label_values(&[m])
                .observe(self.start.elapsed().as_secs_f64());
        }
    }
}

/// A request the graph has taken: its first delta (none when it was dropped), the rest of
/// every choice's deltas (ending in a deadline error if its deadline passes), the guards that
/// kill its choices when dropped, its tracking, and its id.
pub(crate) struct Started {
    pub first: Option<(usize, Result<LlmDelta, OpError>)>,
    pub out: Tagged,
    pub guards: Vec<dyn_core::ctx::KillOnDrop>,
    pub track: Track,
    pub id: dyn_core::RequestId,
}

/// Send a parsed request (`parsed`, counted under the endpoint `label`) down the graph with the
/// headers' tenant, priority and session, and wait for its first delta, so that an early
/// failure still gets its own status code. Every endpoint that generates starts here.
pub(crate) async fn start(
    app: &App,
    label: &'static str,
    key: Option<&KeyTenant>,
    headers: &HeaderMap,
    parsed: Result<(LlmRequest, Options), ApiError>,
) -> Result<(Started, Options), ApiError> {
    start_part(app, label, key, headers, parsed, None).await
}

/// [`start`] for one part of a request that runs several (the inputs of one embeddings
/// request): `part` is the request's context (made by [`ServerConfig::request_ctx`] once, so
/// its deadline counts from the request's start) and the part's index; parts after the first
/// run under the request's id with `-{index}` added.
pub(crate) async fn start_part(
    app: &App,
    label: &'static str,
    key: Option<&KeyTenant>,
    headers: &HeaderMap,
    parsed: Result<(LlmRequest, Options), ApiError>,
    part: Option<(&Ctx, usize)>,
) -> Result<(Started, Options), ApiError> {
    // The headers' tenant (the key's, or the tenant header) and priority (a gateway's word,
    // over the body's `priority`).
    let parsed = parsed.and_then(|(mut req, opts)| {
        let t = app.server.traffic(headers, key)?;
        req.routing.tenant = t.tenant;
        if let Some(p) = t.priority {
            req.routing.priority = p;
        }
        if t.session.is_some() {
            req.routing.session = t.session;
        }
        // Behind API keys, a request without a salt of its own caches under its tenant's:
        // tenants share no prefix (nor learn of each other's prompts from its timing) unless
        // they send the same `cache_salt`.
        if key.is_some()
            && req.routing.cache_salt.is_none()
            && let Some(tenant) = &req.routing.tenant
        {
            req.routing.cache_salt = Some(dyn_protocol::types::tenant_cache_salt(tenant));
        }
        Ok((req, opts))
    });
    let (req, opts) = match parsed {
        Ok(r) => r,
        Err(e) => {
            // A request refused before its model was known counts under the first model.
            let mut t = Track::new(app, app.served[0].name.clone(), label, false);
            t.finish("error");
            return Err(e);
        }
    };
    let mut track = Track::new(app, req.model.as_str().into(), label, opts.stream);
    if let Some(l) = &req.routing.lora {
        FRONTEND
            .lora_requests
            .with_label_values(&[req.model.as_str(), &l.name])
            .inc();
    }
    let ctx = match part {
        Some((parent, 0)) => Ok(parent.clone()),
        Some((parent, i)) => {
            let c = app.chain.ctx(Some(format!("{}-{i}", parent.id()).into()));
            Ok(match parent.deadline() {
                Some(d) => c.with_deadline(d),
                None => c,
            })
        }
        None => app.server.request_ctx(&app.chain, headers),
    };
    let ctx = match ctx {
        Ok(c) => c,
        Err(e) => {
            track.finish("error");
            return Err(e);
        }
    };
    track.ctx = Some(ctx.clone());
    let deadline = ctx.deadline();
    let id = ctx.id().clone();
    let chosen = choices(app, ctx, req, opts.n, &opts.more_prompts);
    let chosen = match deadline {
        // A moment's grace: what stops the request at its deadline below (the admission
        // queue's 503, say) tells the client why; this is the backstop.
        Some(d) => tokio::time::timeout_at((d + DEADLINE_GRACE).into(), chosen)
            .await
            .unwrap_or_else(|_| Err(OpError::deadline_exceeded().into())),
        None => chosen.await,
    };
    let late = deadline.is_some_and(|d| Instant::now() >= d);
    let (first, out, guards) = match chosen {
        // Failed, or came back empty, as its deadline passed: the deadline's doing (a refusal
        // for want of room keeps its 503).
        Ok((None, ..)) if late => {
            track.finish("error");
            return Err(ApiError::from(OpError::deadline_exceeded()));
        }
        Ok(c) => c,
        Err(e) => {
            track.finish("error");
            return Err(super::at_deadline(e, late));
        }
    };
    let out = until_deadline(out, deadline, first.as_ref(), opts.total());
    Ok((
        Started {
            first,
            out,
            guards,
            track,
            id,
        },
        opts,
    ))
}

/// How long past a request's deadline the frontend waits for the graph to stop it.
const DEADLINE_GRACE: std::time::Duration = std::time::Duration::from_millis(100);

/// The deltas of a request's choices, each tagged with its index.
pub(crate) type Tagged =
    futures::stream::BoxStream<'static, (usize, Result<LlmDelta, dyn_core::OpError>)>;

/// `out` (the choices after `first`) ending in a [`OpError::deadline_exceeded`] error when the
/// deadline passes before every choice finished. The request's context carries the same
/// deadline, so everything under it stops too; whichever side notices first, a choice cut
/// short then reads as late, not as an ordinary error or a silent end.
fn until_deadline(
    out: Tagged,
    deadline: Option<Instant>,
    first: Option<&(usize, Result<LlmDelta, dyn_core::OpError>)>,
    n: usize,
) -> Tagged {
    let Some(deadline) = deadline else { return out };
    let mut finished = vec![false; n];
    if let Some((i, Ok(d))) = first
        && d.finish.is_some()
    {
        finished[*i] = true;
    }
    async_stream::stream! {
        let mut out = out;
        let timer = tokio::time::sleep_until((deadline + DEADLINE_GRACE).into());
        tokio::pin!(timer);
        loop {
            let next = tokio::select! {
                next = out.next() => Some(next),
                _ = &mut timer => None,
            };
            let unfinished = finished.iter().position(|f| !f);
            let late = Instant::now() >= deadline;
            match next {
                Some(Some((i, Ok(d)))) => {
                    if d.finish.is_some() {
                        finished[i] = true;
                    }
                    yield (i, Ok(d));
                }
                Some(Some((i, Err(_)))) if late => {
                    yield (i, Err(OpError::deadline_exceeded()));
                    return;
                }
                Some(Some(failed)) => yield failed,
                Some(None) | None => {
                    if let Some(i) = unfinished.filter(|_| late) {
                        yield (i, Err(OpError::deadline_exceeded()));
                    }
                    return;
                }
            }
        }
    }
    .boxed()
}

/// Send the request down the graph `n` times (choice `i` with `seed + i` when seeded) and
/// return the first choice's first delta, then every choice's deltas as they come, and the
/// guards that kill the choices when the response is dropped. The other choices start once
/// the first has its first delta, so its prompt's KV blocks are in the prefix cache by then
/// and the KV router sends them to the same worker: the prompt is computed once.
async fn choices(
    app: &App,
    ctx: dyn_core::Ctx,
    req: LlmRequest,
    n: usize,
    more_prompts: &[Prompt],
) -> Result<
    (
        Option<(usize, Result<LlmDelta, dyn_core::OpError>)>,
        Tagged,
        Vec<dyn_core::ctx::KillOnDrop>,
    ),
    ApiError,
> {
    // Unseeded choices still differ on engines that seed by the prompt (the mocker).
    let seed = req.sampling.seed.or_else(|| {
        use std::hash::{BuildHasher, Hasher};
        (n > 1).then(|| {
            std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish()
        })
    });
    // Choice `i` answers prompt `i / n` (the request's own first, then `more_prompts`).
    let child = |i: usize, req: &LlmRequest| {
        let mut r = req.clone();
        let (prompt, j) = (i / n.max(1), i % n.max(1));
        if let Some(p) = prompt.checked_sub(1).and_then(|k| more_prompts.get(k)) {
            r.prompt = p.clone();
        }
        r.sampling.seed = seed.map(|s| s.wrapping_add(j as u64));
        if j > 0 {
            // A prompt's log-probabilities (echo) come once, with its first choice.
            r.sampling.prompt_logprobs = None;
        }
        r
    };
    // Several prompts (OpenAI's list forms): each of the others is read as its choices will
    // be (checked and tokenized by the ingress's own preprocess) before the first starts, so
    // a bad one is a 400 for the whole request, as vLLM answers, not an error after other
    // prompts' choices have begun to stream. (The first is checked by its own start below.)
    if !more_prompts.is_empty() {
        let served = app.tokenizer_of(Some(&req.model))?;
        for k in 1..=more_prompts.len() {
            if let Err(mut e) = served.preprocess.preprocess(child(k * n, &req)).await {
                if e.param.as_deref() == Some("prompt") {
                    e.param = Some(format!("prompt[{k}]"));
                }
                return Err(ApiError::from(e));
            }
        }
    }
    let n = n * (1 + more_prompts.len());
    let mut guards = vec![ctx.kill_on_drop()];
    // One choice (the usual request) goes down as it came: its messages are not copied.
    let (first_req, req) = if n == 1 {
        let mut r = req;
        r.sampling.seed = seed;
        (r, None)
    } else {
        (child(0, &req), Some(req))
    };
    let mut first_out = app.chain.call(ctx.clone(), first_req);
    let first = match first_out.next().await {
        Some(Err(e)) => return Err(ApiError::from(e)),
        // Nothing came back (the request was dropped): no other choice is started.
        None => return Ok((None, futures::stream::empty().boxed(), guards)),
        Some(d) => Some((0, d)),
    };
    let mut streams: Vec<Tagged> = vec![first_out.map(|d| (0, d)).boxed()];
    // The other choices: copies of the request (there are none when `n` is 1).
    for (i, req) in req.iter().flat_map(|r| (1..n).map(move |i| (i, r))) {
        let mut c = app.chain.ctx(Some(format!("{}-{i}", ctx.id()).into()));
        if let Some(d) = ctx.deadline() {
            c = c.with_deadline(d);
        }
        guards.push(c.kill_on_drop());
        streams.push(
            app.chain
                .call(c, child(i, req))
                .map(move |d| (i, d))
                .boxed(),
        );
    }
    Ok((first, futures::stream::select_all(streams).boxed(), guards))
}
