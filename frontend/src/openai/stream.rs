//! The OpenAI answer's shape: server-sent event chunks of a streamed choice, with tool calls
//! and reasoning parsed out as they come, and the JSON of a whole choice and its envelope
//! ([`Shape`]).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use dyn_protocol::types::{Endpoint, FinishReason, LlmDelta, TextLogprob, Usage};
use futures::{Stream, StreamExt};
use serde_json::{Value, json};

use super::Collected;
use crate::ApiError;
use crate::answer::Feed;
use crate::pipeline::{Options, Tagged, Track};
use crate::tools::{Piece, ToolCall};

/// What a streamed choice carries between its deltas.
pub(crate) struct StreamState {
    feed: Feed,
    echo: Option<Option<String>>,
    /// Completions' text offsets of the log-probabilities, counted across chunks.
    offset: usize,
    done: bool,
}

pub(crate) fn sse(
    shape: Shape,
    opts: Options,
    first: Option<(usize, Result<LlmDelta, dyn_core::OpError>)>,
    mut out: Tagged,
    mut track: Track,
    guards: Vec<dyn_core::ctx::KillOnDrop>,
) -> impl Stream<Item = Result<Bytes, Infallible>> {
    let include_usage = opts.include_usage;
    // One choice without log-probabilities takes the prerendered chunks; otherwise each
    // chunk is built whole (with its index and `logprobs`).
    let fast = opts.total() == 1 && !opts.logprobs && !opts.token_ids;
    let mut state: Vec<StreamState> = (0..opts.total())
        .map(|i| StreamState {
            feed: Feed::new(&opts),
            echo: opts.echo_of(i),
            offset: 0,
            done: false,
        })
        .collect();
    async_stream::stream! {
        let chunks = Chunks::new(&shape, include_usage);
        let with = |i: usize, mut v: Value, lps: Option<Value>| {
            v["choices"][0]["index"] = json!(i);
            if let Some(l) = lps {
                v["choices"][0]["logprobs"] = l;
            }
            event(&v.to_string())
        };
        // A text chunk of choice `i`: prerendered on the fast path, else built whole.
        let text_chunk = |i: usize, text: &str, finish: Option<FinishReason>| {
            if fast {
                chunks.delta(text, finish)
            } else {
                with(i, shape.delta(text, finish, include_usage), None)
            }
        };
        // Reasoning of choice `i` (chat's `delta.reasoning_content`).
        let reasoning_chunk = |i: usize, text: &str| {
            with(i, shape.chunk(Some(json!({"reasoning_content": text})), None, include_usage), None)
        };
        // return_token_ids: a chunk's ids, and the prompt's on the choice's first chunk.
        let ids = |mut v: Value, d: &mut LlmDelta| {
            if opts.token_ids {
                v["choices"][0]["token_ids"] = json!(d.token_ids.take().unwrap_or_default());
                if let Some(p) = d.prompt_token_ids.take() {
                    match shape.endpoint {
                        Endpoint::Chat => v["prompt_token_ids"] = json!(p),
                        Endpoint::Completion => v["choices"][0]["prompt_token_ids"] = json!(p),
                    }
                }
            }
            v
        };
        if shape.endpoint == Endpoint::Chat {
            for i in 0..opts.total() {
                yield Ok(if fast {
                    chunks.role()
                } else {
                    with(i, shape.chunk(Some(json!({"role": "assistant", "content": ""})), None, include_usage), None)
                });
            }
        }
        let mut next = first;
        let mut usage: Option<Usage> = None;
        // Each prompt's tokens, counted once however many choices it has.
        let mut prompt_tokens = vec![0u32; 1 + opts.more_prompts.len()];
        // Each prompt's log-probabilities, from its first choice, for its other choices' echo.
        let mut prompt_lps: Vec<Vec<TextLogprob>> = vec![Vec::new(); 1 + opts.more_prompts.len()];
        let mut failed = false;
        while let Some((i, item)) = next.take() {
            let mut d = match item {
                Ok(d) => d,
                Err(e) => {
                    track.finish("error");
                    failed = true;
                    yield Ok(event(&ApiError::from(e).body().to_string()));
                    break;
                }
            };
            let p = opts.prompt_of(i);
            if prompt_lps[p].is_empty() && !d.prompt_logprobs.is_empty() {
                prompt_lps[p] = d.prompt_logprobs.clone();
            } else if d.prompt_logprobs.is_empty() && state[i].echo.is_some() {
                d.prompt_logprobs = prompt_lps[p].clone();
            }
            track.delta(&d);
            if let Some(u) = d.usage {
                let sum = usage.get_or_insert(Usage::default());
                prompt_tokens[p] = prompt_tokens[p].max(u.prompt_tokens);
                sum.prompt_tokens = prompt_tokens.iter().sum();
                sum.completion_tokens += u.completion_tokens;
            }
            let st = &mut state[i];
            if let Some(e) = st.echo.take() {
                // The prompt goes out with the first chunk (its log-probabilities too).
                d.text = echo_text(&e, &d.prompt_logprobs) + &d.text;
                let mut lps = std::mem::take(&mut d.prompt_logprobs);
                lps.append(&mut d.logprobs);
                d.logprobs = lps;
            }
            let lps = (opts.logprobs && !d.logprobs.is_empty()).then(|| {
                let l = shape.logprobs(&[], &d.logprobs, st.offset);
                st.offset += d.logprobs.iter().map(|l| l.token.chars().count()).sum::<usize>();
                l
            });
            let calls_before = st.feed.calls();
            let pieces = st.feed.feed(std::mem::take(&mut d.text), d.finish.is_some());
            if st.feed.parses_tools() {
                // The reasoning the reasoning parser split off the delta goes first; then its
                // log-probabilities and token ids, ahead of the text, calls (and a harmony
                // answer's reasoning) the tool parser releases from it.
                let split_first = opts.reasoning.is_some();
                let mut pieces = pieces.into_iter().peekable();
                while let Some(Piece::Reasoning(r)) =
                    pieces.next_if(|p| split_first && matches!(p, Piece::Reasoning(_)))
                {
                    yield Ok(reasoning_chunk(i, &r));
                }
                let has_ids = opts.token_ids
                    && (d.token_ids.as_ref().is_some_and(|t| !t.is_empty()) || d.prompt_token_ids.is_some());
                if lps.is_some() || has_ids {
                    let v = ids(shape.delta("", None, include_usage), &mut d);
                    yield Ok(with(i, v, lps));
                }
                // Text passes as the parser releases it; each call is one chunk.
                let mut call = calls_before;
                for piece in pieces {
                    match piece {
                        Piece::Text(t) => yield Ok(text_chunk(i, &t, None)),
                        Piece::Reasoning(r) => yield Ok(reasoning_chunk(i, &r)),
                        Piece::Call(c) => {
                            yield Ok(with(i, shape.call_chunk(call, &c, include_usage), None));
                            call += 1;
                        }
                    }
                }
                if let Some(f) = d.finish {
                    yield Ok(text_chunk(i, "", Some(st.feed.finish(f))));
                }
            } else {
                // Reasoning goes out as `reasoning_content`; the answer's text, with the
                // delta's log-probabilities, ids and finish, as one chunk.
                for piece in pieces {
                    match piece {
                        Piece::Reasoning(r) => yield Ok(reasoning_chunk(i, &r)),
                        Piece::Text(t) => d.text = t,
                        Piece::Call(_) => {}
                    }
                }
                if !d.text.is_empty()
                    || d.finish.is_some()
                    || lps.is_some()
                    || d.token_ids.as_ref().is_some_and(|t| !t.is_empty())
                {
                    yield Ok(if fast {
                        chunks.delta(&d.text, d.finish)
                    } else {
                        let v = shape.delta(&d.text, d.finish, include_usage);
                        with(i, ids(v, &mut d), lps)
                    });
                }
            }
            if d.finish.is_some() {
                st.done = true;
                if state.iter().all(|s| s.done) {
                    break;
                }
            }
            next = out.next().await;
        }
        if include_usage && let Some(u) = usage {
            yield Ok(event(&shape.usage_chunk(u).to_string()));
        }
        if failed {
            // The other choices are killed with their guards.
            drop(guards);
        } else {
            guards.into_iter().for_each(dyn_core::ctx::KillOnDrop::disarm);
            track.finish("success");
        }
        yield Ok(Bytes::from_static(b"data: [DONE]\n\n"));
    }
}

/// What `echo` puts before the answer: the prompt as the client sent it, or the text of its
/// tokens as the engine reported them.
pub(crate) fn echo_text(echo: &Option<String>, prompt: &[TextLogprob]) -> String {
    match echo {
        Some(t) => t.clone(),
        None => {
            let bytes: Vec<u8> = prompt
                .iter()
                .flat_map(|l| l.bytes.iter().copied())
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
    }
}

/// One server-sent event carrying `data` (a JSON text: no newlines).
pub(crate) fn event(data: &str) -> Bytes {
    let mut b = Vec::with_capacity(data.len() + 8);
    b.extend_from_slice(b"data: ");
    b.extend_from_slice(data.as_bytes());
    b.extend_from_slice(b"\n\n");
    b.into()
}

/// A streamed response's token chunks, rendered from pieces fixed per request: the envelope
/// around the choice's content and its finish reason. Building every chunk as a
/// `serde_json::Value` (maps, key strings, a tree per token) cost about a sixth of the
/// frontend's CPU at 64 tokens a request; now a token costs its escaped text and a copy. The
/// pieces are cut from a chunk serde_json rendered, so key order and escaping are its own
/// (`streamed_chunks_are_the_json_values_they_replace` checks the bytes).
pub(crate) struct Chunks {
    /// `data: ` and the envelope up to the first slot; between the slots; after the second
    /// slot, with the closing `\n\n`.
    pieces: [Vec<u8>; 3],
    /// Whether the content slot comes before the finish reason slot.
    content_first: bool,
    chat: bool,
}

/// The first chat chunk's delta, as serde_json renders it (rendered once per process).
pub(crate) static ROLE_DELTA: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| json!({"role": "assistant", "content": ""}).to_string());

impl Chunks {
    pub(crate) fn new(shape: &Shape, include_usage: bool) -> Self {
        const CONTENT: &str = "\u{1}dyn-content\u{1}";
        const FINISH: &str = "\u{1}dyn-finish\u{1}";
        let mut v = shape.chunk(Some(json!(CONTENT)), None, include_usage);
        v["choices"][0]["finish_reason"] = json!(FINISH);
        let text = v.to_string();
        let mark = |m: &str| serde_json::to_string(m).unwrap_or_default();
        let (content, finish) = (mark(CONTENT), mark(FINISH));
        let (first, second) = match (text.find(&content), text.find(&finish)) {
            (Some(c), Some(f)) if c < f => (content.as_str(), finish.as_str()),
            _ => (finish.as_str(), content.as_str()),
        };
        let (p0, rest) = text.split_once(first).unwrap_or((&text, ""));
        let (p1, p2) = rest.split_once(second).unwrap_or((rest, ""));
        let mut head = b"data: ".to_vec();
        head.extend_from_slice(p0.as_bytes());
        let mut tail = p2.as_bytes().to_vec();
        tail.extend_from_slice(b"\n\n");
        Self {
            pieces: [head, p1.as_bytes().to_vec(), tail],
            content_first: first == content,
            chat: shape.endpoint == Endpoint::Chat,
        }
    }

    fn render(&self, content: impl FnOnce(&mut Vec<u8>), finish: Option<FinishReason>) -> Bytes {
        let [p0, p1, p2] = &self.pieces;
        let mut b = Vec::with_capacity(p0.len() + p1.len() + p2.len() + 64);
        let finish = |b: &mut Vec<u8>| match finish {
            Some(f) => {
                b.push(b'"');
                b.extend_from_slice(f.as_str().as_bytes());
                b.push(b'"');
            }
            None => b.extend_from_slice(b"null"),
        };
        b.extend_from_slice(p0);
        if self.content_first {
            content(&mut b);
            b.extend_from_slice(p1);
            finish(&mut b);
        } else {
            finish(&mut b);
            b.extend_from_slice(p1);
            content(&mut b);
        }
        b.extend_from_slice(p2);
        b.into()
    }

    /// The first chat chunk: the assistant's role and empty content.
    pub(crate) fn role(&self) -> Bytes {
        self.render(|b| b.extend_from_slice(ROLE_DELTA.as_bytes()), None)
    }

    pub(crate) fn delta(&self, text: &str, finish: Option<FinishReason>) -> Bytes {
        self.render(
            |b| {
                let quoted = |b: &mut Vec<u8>| {
                    // Writing a &str into a Vec cannot fail.
                    let _ = serde_json::to_writer(&mut *b, text);
                };
                match (self.chat, text.is_empty()) {
                    (true, true) => b.extend_from_slice(b"{}"),
                    (true, false) => {
                        b.extend_from_slice(br#"{"content":"#);
                        quoted(b);
                        b.push(b'}');
                    }
                    (false, _) => quoted(b),
                }
            },
            finish,
        )
    }
}

/// What every response object of one request shares.
pub(crate) struct Shape {
    pub(crate) id: String,
    pub(crate) endpoint: Endpoint,
    pub(crate) model: Arc<str>,
    pub(crate) created: u64,
}

pub(crate) fn usage_json(u: Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

impl Shape {
    fn object(&self, stream: bool) -> &'static str {
        match (self.endpoint, stream) {
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Completion, _) => "text_completion",
        }
    }

    pub(crate) fn envelope(&self, stream: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(stream),
            "created": self.created,
            "model": &*self.model,
            "choices": choices,
        })
    }

    /// A chat chunk with `delta`, or a completion chunk.
    pub(crate) fn chunk(
        &self,
        delta: Option<Value>,
        finish: Option<FinishReason>,
        include_usage: bool,
    ) -> Value {
        let finish = finish.map(FinishReason::as_str);
        let choice = match self.endpoint {
            Endpoint::Chat => {
                json!({"index": 0, "delta": delta.unwrap_or_else(|| json!({})), "logprobs": null, "finish_reason": finish})
            }
            Endpoint::Completion => {
                json!({"index": 0, "text": delta.unwrap_or_else(|| json!("")), "logprobs": null, "finish_reason": finish})
            }
        };
        let mut v = self.envelope(true, json!([choice]));
        if include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// A token chunk as a `Value`: what [`Chunks::delta`] renders (its test reference, and
    /// the chunks that carry log-probabilities).
    pub(crate) fn delta(
        &self,
        text: &str,
        finish: Option<FinishReason>,
        include_usage: bool,
    ) -> Value {
        let delta = match (self.endpoint, text.is_empty()) {
            (Endpoint::Chat, true) => json!({}),
            (Endpoint::Chat, false) => json!({"content": text}),
            (Endpoint::Completion, _) => json!(text),
        };
        self.chunk(Some(delta), finish, include_usage)
    }

    /// A choice's `logprobs`: chat's `{"content": [...]}` (each token's text, bytes,
    /// log-probability and `top_logprobs`), or completions' parallel lists (`tokens`,
    /// `token_logprobs`, `top_logprobs` as token → log-probability maps, `text_offset` from
    /// `offset`), where the echoed prompt's tokens come first, its first without a value.
    fn logprobs(&self, prompt: &[TextLogprob], answer: &[TextLogprob], offset: usize) -> Value {
        match self.endpoint {
            Endpoint::Chat => {
                let alt = |(t, b, lp): &(String, Vec<u8>, f32)| json!({"token": t, "logprob": lp, "bytes": b});
                let content: Vec<Value> = answer
                    .iter()
                    .map(|l| {
                        json!({"token": l.token, "logprob": l.logprob, "bytes": l.bytes,
                               "top_logprobs": l.top.iter().map(alt).collect::<Vec<_>>()})
                    })
                    .collect();
                json!({"content": content})
            }
            Endpoint::Completion => {
                let all = prompt.iter().chain(answer);
                let mut at = offset;
                let mut offsets = Vec::new();
                for l in all.clone() {
                    offsets.push(at);
                    at += l.token.chars().count();
                }
                let top = |l: &TextLogprob| match l.logprob {
                    None => Value::Null,
                    Some(_) => {
                        // Best first: a text two tokens share keeps the likelier one's value.
                        let mut m = serde_json::Map::new();
                        for (t, _, lp) in &l.top {
                            m.entry(t.clone()).or_insert_with(|| json!(lp));
                        }
                        // As OpenAI and vLLM: the sampled token is among them, top or not.
                        m.entry(l.token.clone()).or_insert_with(|| json!(l.logprob));
                        Value::Object(m)
                    }
                };
                json!({
                    "tokens": all.clone().map(|l| &l.token).collect::<Vec<_>>(),
                    "token_logprobs": all.clone().map(|l| l.logprob).collect::<Vec<_>>(),
                    "top_logprobs": all.map(top).collect::<Vec<_>>(),
                    "text_offset": offsets,
                })
            }
        }
    }

    pub(crate) fn usage_chunk(&self, u: Usage) -> Value {
        let mut v = self.envelope(true, json!([]));
        v["usage"] = usage_json(u);
        v
    }

    /// A call's id, unique per request and call.
    fn call_id(&self, index: usize) -> String {
        let id = self.id.strip_prefix("chatcmpl-").unwrap_or(&self.id);
        format!("call_{id}_{index}")
    }

    /// A streamed chunk carrying one whole tool call (OpenAI streams a call's name and
    /// arguments in pieces; clients accumulate either the same way).
    fn call_chunk(&self, index: usize, c: &ToolCall, include_usage: bool) -> Value {
        let call = json!({"index": index, "id": self.call_id(index), "type": "function",
            "function": {"name": c.name, "arguments": c.arguments}});
        self.chunk(Some(json!({"tool_calls": [call]})), None, include_usage)
    }

    /// A chat answer parsed for tool calls: `content` the text (null when only calls), and
    /// `finish_reason` `tool_calls` when there are any.
    fn full_with_calls(
        &self,
        pieces: &[Piece],
        finish: Option<FinishReason>,
        usage: Usage,
    ) -> Value {
        let mut text = String::new();
        let mut reasoning = String::new();
        let mut calls = Vec::new();
        for p in pieces {
            match p {
                Piece::Text(t) => text.push_str(t),
                Piece::Reasoning(r) => reasoning.push_str(r),
                Piece::Call(c) => calls
                    .push(json!({"id": self.call_id(calls.len()), "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments}})),
            }
        }
        let mut v = self.full(&text, finish, usage);
        if !reasoning.is_empty() {
            v["choices"][0]["message"]["reasoning_content"] = json!(reasoning);
        }
        if !calls.is_empty() {
            let choice = &mut v["choices"][0];
            if text.trim().is_empty() {
                choice["message"]["content"] = Value::Null;
            }
            choice["message"]["tool_calls"] = Value::Array(calls);
            choice["finish_reason"] = json!(FinishReason::ToolCalls.as_str());
        }
        v
    }

    /// A unary answer's choice: its text (after the echoed prompt), tool calls parsed out,
    /// and its log-probabilities.
    pub(crate) fn choice(&self, opts: &Options, mut c: Collected) -> Value {
        let mut feed = Feed::new(opts);
        let pieces = feed.feed(std::mem::take(&mut c.text), true);
        // Chat's `reasoning_content` (null when the model wrote none) where reasoning is parsed.
        let reasoning = opts.reasoning.map(|_| {
            let mut r = String::new();
            for p in &pieces {
                if let Piece::Reasoning(t) = p {
                    r.push_str(t);
                }
            }
            r
        });
        let mut v = if feed.parses_tools() {
            self.full_with_calls(&pieces, c.finish, c.usage)
        } else {
            let mut text = String::new();
            for p in &pieces {
                if let Piece::Text(t) = p {
                    text.push_str(t);
                }
            }
            if let Some(e) = &c.echo {
                text = echo_text(e, &c.prompt_logprobs) + &text;
            }
            self.full(&text, c.finish, c.usage)
        };
        let mut choice = v["choices"][0].take();
        if opts.token_ids {
            choice["token_ids"] = json!(c.token_ids);
            if self.endpoint == Endpoint::Completion {
                choice["prompt_token_ids"] = json!(c.prompt_token_ids);
            }
        }
        if let Some(r) = reasoning {
            choice["message"]["reasoning_content"] =
                if r.is_empty() { Value::Null } else { json!(r) };
        }
        if opts.logprobs {
            let prompt = if c.echo.is_some() {
                &c.prompt_logprobs[..]
            } else {
                &[]
            };
            choice["logprobs"] = self.logprobs(prompt, &c.logprobs, 0);
        }
        choice
    }

    pub(crate) fn full(&self, text: &str, finish: Option<FinishReason>, usage: Usage) -> Value {
        let finish = finish.map(FinishReason::as_str);
        let choice = match self.endpoint {
            Endpoint::Chat => {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish})
            }
            Endpoint::Completion => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
            }
        };
        let mut v = self.envelope(false, json!([choice]));
        v["usage"] = usage_json(usage);
        v
    }
}
