//! OpenAI's `POST /v1/chat/completions` and `POST /v1/completions`: streaming as server-sent
//! events ending in `data: [DONE]` ([`stream`]), or one JSON answer collected here. Bodies
//! are read in [`request`]; range checks on sampling parameters happen in `preprocess`, which
//! knows the model. A streaming response is committed only once the first delta (or an
//! error) is back, so a request the graph rejects still gets its 4xx status. A client that
//! disconnects drops the response stream, which kills the request's context, which reaches
//! the engine.

pub(crate) mod request;
mod stream;
#[cfg(test)]
mod tests;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use dyn_protocol::types::{Endpoint, FinishReason, LlmDelta, TextLogprob, Usage};
use futures::StreamExt;
use serde_json::{Value, json};

use crate::app::{App, unix_now};
use crate::pipeline::{Started, start};
use crate::{ApiError, KeyTenant};
use request::{chat_request, completion_request};
use stream::{Shape, sse, usage_json};

pub(crate) async fn chat(
    State(app): State<App>,
    key: Option<Extension<KeyTenant>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(app, Endpoint::Chat, key.map(|k| k.0), headers, body).await
}

pub(crate) async fn completions(
    State(app): State<App>,
    key: Option<Extension<KeyTenant>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(app, Endpoint::Completion, key.map(|k| k.0), headers, body).await
}

async fn serve(
    app: App,
    endpoint: Endpoint,
    key: Option<KeyTenant>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body.map_err(crate::body_error) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let parsed = match endpoint {
        Endpoint::Chat => chat_request(&app, &body),
        Endpoint::Completion => completion_request(&app, &body),
    };
    let label = match endpoint {
        Endpoint::Chat => "chat_completions",
        Endpoint::Completion => "completions",
    };
    let (started, opts) = match start(&app, label, key.as_ref(), &headers, parsed).await {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let Started {
        first,
        out,
        guards,
        mut track,
        id,
    } = started;
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl-",
        Endpoint::Completion => "cmpl-",
    };
    let shape = Shape {
        id: format!("{prefix}{id}"),
        endpoint,
        model: opts.named.clone(),
        created: unix_now(),
    };
    if !opts.stream {
        let mut acc: Vec<Collected> = (0..opts.total())
            .map(|i| Collected {
                echo: opts.echo_of(i),
                ..Collected::default()
            })
            .collect();
        let mut next = first;
        let mut out = out;
        while let Some((i, item)) = next.take() {
            match item {
                Ok(d) => {
                    track.delta(&d);
                    acc[i].add(d);
                }
                Err(e) => {
                    track.finish("error");
                    return ApiError::from(e).into_response();
                }
            }
            next = out.next().await;
        }
        guards
            .into_iter()
            .for_each(dyn_core::ctx::KillOnDrop::disarm);
        track.finish("success");
        // Each prompt's first choice carries what its other choices share: the prompt's
        // log-probabilities and ids, and its tokens counted once in the usage.
        let mut usage = Usage::default();
        let firsts: Vec<(Vec<TextLogprob>, Option<Vec<u32>>)> = acc
            .iter()
            .step_by(opts.n.max(1))
            .map(|c| (c.prompt_logprobs.clone(), c.prompt_token_ids.clone()))
            .collect();
        let prompt_ids = firsts.first().and_then(|f| f.1.clone());
        let mut prompt_tokens = vec![0u32; firsts.len()];
        let choices: Vec<Value> = acc
            .into_iter()
            .enumerate()
            .map(|(i, mut c)| {
                let p = opts.prompt_of(i);
                if c.prompt_logprobs.is_empty() {
                    c.prompt_logprobs = firsts[p].0.clone();
                }
                if c.prompt_token_ids.is_none() {
                    c.prompt_token_ids = firsts[p].1.clone();
                }
                prompt_tokens[p] = prompt_tokens[p].max(c.usage.prompt_tokens);
                usage.completion_tokens += c.usage.completion_tokens;
                let mut v = shape.choice(&opts, c);
                v["index"] = json!(i);
                v
            })
            .collect();
        usage.prompt_tokens = prompt_tokens.iter().sum();
        let mut v = shape.envelope(false, Value::Array(choices));
        v["usage"] = usage_json(usage);
        if opts.token_ids && endpoint == Endpoint::Chat {
            v["prompt_token_ids"] = json!(prompt_ids);
        }
        return Json(v).into_response();
    }

    let events = sse(shape, opts, first, out, track, guards);
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        axum::body::Body::from_stream(events),
    )
        .into_response()
}

/// One choice of a unary answer, as its deltas arrive.
#[derive(Default)]
struct Collected {
    /// What the choice echoes ([`Options::echo_of`]).
    echo: Option<Option<String>>,
    text: String,
    finish: Option<FinishReason>,
    usage: Usage,
    logprobs: Vec<TextLogprob>,
    prompt_logprobs: Vec<TextLogprob>,
    token_ids: Vec<u32>,
    prompt_token_ids: Option<Vec<u32>>,
}

impl Collected {
    fn add(&mut self, mut d: LlmDelta) {
        self.token_ids
            .extend(d.token_ids.take().unwrap_or_default());
        if self.prompt_token_ids.is_none() {
            self.prompt_token_ids = d.prompt_token_ids.take();
        }
        self.text.push_str(&d.text);
        self.finish = d.finish.or(self.finish);
        self.usage = d.usage.unwrap_or(self.usage);
        self.logprobs.append(&mut d.logprobs);
        if self.prompt_logprobs.is_empty() {
            self.prompt_logprobs = d.prompt_logprobs;
        }
    }
}
