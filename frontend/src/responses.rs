//! OpenAI's Responses API on the `http` ingress: `POST /v1/responses` (unary, or streamed as
//! the Responses events), `GET` and `DELETE /v1/responses/{id}`.
//!
//! A Responses body is translated into the chat completions body it means — `instructions`
//! as the system message, input items as messages (`function_call` items as an assistant's
//! tool calls, `function_call_output` items as tool messages, reasoning items left out as chat
//! templates leave earlier reasoning out), function tools as chat's, `text.format` as
//! `response_format` — and runs as chat does (endpoint label `responses`). The answer comes
//! back as output items: `reasoning`, `message` (`output_text`), `function_call`.
//!
//! With `store` (the default, as OpenAI's) the response and its conversation so far are kept
//! in the graph's key-value store ([`KeyValue`]): in memory in a one-process graph, in NATS
//! JetStream across processes, so `previous_response_id` continues a conversation through any
//! frontend. The store is bounded (`responses_store` in the ingress's config: entries, bytes,
//! each tenant's share, age), and so is what one response may put in it: `metadata` as
//! OpenAI bounds it, `user`, and the whole record (a request too large to store is refused
//! before it runs; an answer that makes it too large is answered with `store: false`). A
//! stored response is visible only to the tenant that made it.

use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use dyn_core::planes::{Bucket, KeyValue};
use dyn_protocol::types::{FinishReason, Usage};
use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::answer::{self, Ending, Event};
use super::tools::ToolCall;
use super::{ApiError, KeyTenant, MAX_STORED_RESPONSE_BYTES, invalid};
use crate::http::{App, unix_now};
use crate::openai::request as openai;
use crate::pipeline;

/// Where stored responses live.
#[derive(Clone)]
pub(crate) struct Store {
    pub kv: Arc<dyn KeyValue>,
    pub bucket: Bucket,
}

/// What is stored per response: the response object, its turn of the conversation (its
/// input and its answer as chat messages, without `instructions`, which are not carried
/// over), the response it continued (the turns before, each stored once), and the tenant it
/// belongs to.
#[derive(Serialize, Deserialize)]
struct Stored {
    response: Value,
    messages: Vec<Value>,
    #[serde(default)]
    previous: Option<String>,
    tenant: Option<String>,
}

/// Turns one conversation may have (each read back from the store to continue it).
const MAX_TURNS: usize = 1024;

/// The most a request may put in its stored record before its answer (its turn's input and
/// what the response repeats of the request: instructions, tools, metadata…, as JSON), so
/// that the answer still fits under [`MAX_STORED_RESPONSE_BYTES`].
const MAX_TURN_BYTES: usize = 768 << 10;

/// The longest `user` taken: it is stored and repeated with the response, and it is the
/// request's session (whose ids are bounded alike, [`super::SESSION_MAX`]).
const MAX_USER: usize = super::SESSION_MAX;

#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or a list of input items")]
enum InputIn {
    Text(String),
    Items(Vec<Value>),
}

#[derive(Debug, Deserialize)]
struct ResponsesBody {
    model: String,
    input: InputIn,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    text: Option<Value>,
    #[serde(default)]
    reasoning: Option<Value>,
    #[serde(default)]
    max_output_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    store: Option<bool>,
    #[serde(default)]
    previous_response_id: Option<String>,
    #[serde(default)]
    metadata: Option<Value>,
    #[serde(default)]
    user: Option<String>,
    /// Anything else a client sends: what changes the answer is refused by name.
    #[serde(flatten)]
    other: serde_json::Map<String, Value>,
}

/// Fields of the Responses API that change an answer and are not built here, each with the
/// values that ask for nothing.
const REFUSED: &[(&str, openai::AsksNothing)] = &[
    ("background", |v| v.is_null() || *v == false),
    // Extra output (encrypted reasoning, log-probabilities, sources): none of it is made here.
    ("include", openai::empty),
    ("conversation", Value::is_null),
    ("prompt", Value::is_null),
    ("top_logprobs", |v| v.is_null() || v.as_u64() == Some(0)),
    ("truncation", |v| v.is_null() || v == "disabled"),
    ("max_tool_calls", Value::is_null),
];

/// The text of a message's content: a string, or its text parts joined.
fn content_text(content: &Value, param: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p["type"].as_str(), p["text"].as_str()) {
                    (Some("input_text" | "output_text" | "text"), Some(t)) => text.push_str(t),
                    (Some("refusal"), _) => {
                        text.push_str(p["refusal"].as_str().unwrap_or_default())
                    }
                    (kind, _) => {
                        return Err(invalid(
                            format!("{param}[{j}]"),
                            format!(
                                "content of type {} is not supported; only text",
                                kind.unwrap_or("(none)")
                            ),
                        ));
                    }
                }
            }
            Ok(text)
        }
        Value::Null => Ok(String::new()),
        _ => Err(invalid(
            param,
            "content must be a string or a list of parts",
        )),
    }
}

/// Input items as chat messages, appended to `out` (a conversation so far, whose earlier turns
/// stay as they are).
fn input_messages(input: InputIn, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let floor = out.len();
    let items = match input {
        InputIn::Text(t) => {
            out.push(json!({"role": "user", "content": t}));
            return Ok(());
        }
        InputIn::Items(items) => items,
    };
    for (i, item) in items.into_iter().enumerate() {
        let at = format!("input[{i}]");
        match item["type"].as_str().unwrap_or("message") {
            "message" => {
                let role = match item["role"].as_str() {
                    Some("developer" | "system") => "system",
                    Some(r @ ("user" | "assistant")) => r,
                    other => {
                        return Err(invalid(
                            format!("{at}.role"),
                            format!(
                                "role must be user, assistant, system or developer, got {}",
                                other
                                    .map_or_else(|| item["role"].to_string(), |r| format!("{r:?}"))
                            ),
                        ));
                    }
                };
                let text = content_text(&item["content"], &format!("{at}.content"))?;
                out.push(json!({"role": role, "content": text}));
            }
            "function_call" => {
                let (Some(call_id), Some(name)) = (item["call_id"].as_str(), item["name"].as_str())
                else {
                    return Err(invalid(at, "a function_call item needs call_id and name"));
                };
                let arguments = item["arguments"].as_str().unwrap_or("{}");
                let call = json!({"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": arguments}});
                // Calls join the assistant turn they follow, as chat writes them.
                let at = out.len();
                match out.last_mut() {
                    Some(last) if last["role"] == "assistant" && at > floor => {
                        match last["tool_calls"].as_array_mut() {
                            Some(calls) => calls.push(call),
                            None => last["tool_calls"] = json!([call]),
                        }
                    }
                    _ => {
                        out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]}))
                    }
                }
            }
            "function_call_output" => {
                let Some(call_id) = item["call_id"].as_str() else {
                    return Err(invalid(at, "a function_call_output item needs its call_id"));
                };
                let output = content_text(&item["output"], &format!("{at}.output"))?;
                out.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            // Earlier reasoning is not shown to the model again.
            "reasoning" => {}
            other => {
                return Err(ApiError::invalid(
                    "unsupported_parameter",
                    format!("input items of type {other} are not supported"),
                )
                .with_param(format!("{at}.type")));
            }
        }
    }
    Ok(())
}

/// Function tools as chat's.
fn chat_tools(tools: &[Value]) -> Result<Value, ApiError> {
    let mut out = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        if t["type"] != "function" {
            return Err(ApiError::invalid(
                "unsupported_parameter",
                format!(
                    "tools of type {} are not supported; only function tools",
                    t["type"]
                ),
            )
            .with_param(format!("tools[{i}].type")));
        }
        let Some(name) = t["name"].as_str() else {
            return Err(invalid(
                format!("tools[{i}].name"),
                "a function tool needs a name",
            ));
        };
        let mut f = json!({"name": name, "parameters": t.get("parameters").cloned().unwrap_or(json!({"type": "object"}))});
        for key in ["description", "strict"] {
            if let Some(v) = t.get(key).filter(|v| !v.is_null()) {
                f[key] = v.clone();
            }
        }
        out.push(json!({"type": "function", "function": f}));
    }
    Ok(Value::Array(out))
}

fn chat_tool_choice(choice: &Value) -> Result<Value, ApiError> {
    match choice {
        Value::String(s) if matches!(s.as_str(), "auto" | "none" | "required") => {
            Ok(choice.clone())
        }
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            match o.get("name").and_then(Value::as_str) {
                Some(n) => Ok(json!({"type": "function", "function": {"name": n}})),
                None => Err(invalid(
                    "tool_choice.name",
                    "tool_choice function needs a name",
                )),
            }
        }
        _ => Err(invalid(
            "tool_choice",
            "tool_choice must be auto, none, required or {type: function, name}",
        )),
    }
}

/// `text.format` as chat's `response_format`.
fn response_format(text: &Value) -> Result<Option<Value>, ApiError> {
    let f = &text["format"];
    match f["type"].as_str() {
        None if f.is_null() => Ok(None),
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => Ok(Some(json!({"type": "json_schema", "json_schema": {
            "name": f["name"], "schema": f["schema"], "strict": f["strict"]}}))),
        _ => Err(invalid(
            "text.format.type",
            "text.format type must be text, json_object or json_schema",
        )),
    }
}

/// What a response object repeats of its request.
struct Meta {
    id: String,
    created_at: u64,
    model: String,
    /// The request's own fields, as the response object echoes them.
    echo: Value,
    store: bool,
}

/// A Responses body: the chat body it means, the conversation to store with the answer
/// (earlier turns and this input), and what the response repeats.
struct Translated {
    chat: Value,
    messages: Vec<Value>,
    meta: Meta,
    /// Where this turn's messages start in `messages` (after the earlier turns').
    new_from: usize,
}

fn translate(b: ResponsesBody, earlier: Vec<Value>) -> Result<Translated, ApiError> {
    openai::refuse_fields(REFUSED, |name| b.other.get(name))?;
    super::check_metadata(b.metadata.as_ref())?;
    if b.user
        .as_ref()
        .is_some_and(|u| u.chars().count() > MAX_USER)
    {
        return Err(invalid(
            "user",
            format!("user may be at most {MAX_USER} characters"),
        ));
    }
    // A model reasons as its template has it: how much is not the client's to say here.
    for part in ["effort", "summary"] {
        if b.reasoning.as_ref().is_some_and(|r| !r[part].is_null()) {
            return Err(ApiError::invalid(
                "unsupported_parameter",
                format!("`reasoning.{part}` is not supported by this server yet"),
            )
            .with_param(format!("reasoning.{part}")));
        }
    }
    let new_from = earlier.len();
    let mut messages = earlier;
    input_messages(b.input, &mut messages)?;
    let mut prompt = Vec::with_capacity(messages.len() + 1);
    if let Some(i) = b.instructions.as_ref().filter(|i| !i.is_empty()) {
        prompt.push(json!({"role": "system", "content": i}));
    }
    prompt.extend(messages.iter().cloned());
    let mut chat = json!({
        "model": b.model,
        "messages": prompt,
        "stream": b.stream,
        "max_tokens": b.max_output_tokens,
        "temperature": b.temperature,
        "top_p": b.top_p,
        "user": b.user,
        "parallel_tool_calls": b.parallel_tool_calls,
    });
    let tools = b.tools.unwrap_or_default();
    if !tools.is_empty() {
        chat["tools"] = chat_tools(&tools)?;
    }
    if let Some(c) = b.tool_choice.as_ref().filter(|c| !c.is_null()) {
        chat["tool_choice"] = chat_tool_choice(c)?;
    }
    if let Some(f) = b.text.as_ref().map(response_format).transpose()?.flatten() {
        chat["response_format"] = f;
    }
    let hex = dyn_core::RequestId::random();
    let meta = Meta {
        id: format!("resp_{hex}"),
        created_at: unix_now(),
        model: b.model,
        store: b.store.unwrap_or(true),
        echo: json!({
            "instructions": b.instructions,
            "tools": tools,
            "tool_choice": b.tool_choice.unwrap_or(json!("auto")),
            "parallel_tool_calls": b.parallel_tool_calls.unwrap_or(true),
            "text": b.text.unwrap_or(json!({"format": {"type": "text"}})),
            // What a reasoning object may ask for is refused above: nothing else of it is kept.
            "reasoning": b.reasoning.as_ref().map(|_| json!({"effort": null, "summary": null})),
            "max_output_tokens": b.max_output_tokens,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "metadata": b.metadata.unwrap_or(json!({})),
            "previous_response_id": b.previous_response_id,
            "user": b.user,
            "truncation": "disabled",
        }),
    };
    Ok(Translated {
        chat,
        messages,
        meta,
        new_from,
    })
}

impl Meta {
    /// The response object at `status`.
    fn object(&self, status: &str, output: &[Value], end: Option<&Ending>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "error": null,
            "incomplete_details": null,
            "store": self.store,
            "usage": null,
        });
        if let (Some(o), Some(e)) = (v.as_object_mut(), self.echo.as_object()) {
            o.extend(e.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        if let Some(end) = end {
            v["usage"] = usage(end.usage);
            if end.finish == FinishReason::Length {
                v["incomplete_details"] = json!({"reason": "max_output_tokens"});
            }
        }
        v
    }

    /// The id of the answer's `kind` item (`msg`, `rs`, `fc`), or of its call.
    fn item_id(&self, kind: &str, index: usize) -> String {
        let hex = self.id.strip_prefix("resp_").unwrap_or(&self.id);
        format!("{kind}_{hex}_{index}")
    }
}

fn usage(u: Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// A response's status from how its answer ended.
fn status(end: &Ending) -> &'static str {
    if end.finish == FinishReason::Length {
        "incomplete"
    } else {
        "completed"
    }
}

/// The output item open in a stream.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    Reasoning,
    Message,
}

/// Builds a response's output items from its answer's events, and (streaming) the Responses
/// events that tell a client so, numbered.
struct Output<'a> {
    meta: &'a Meta,
    streaming: bool,
    /// Finished items.
    items: Vec<Value>,
    /// The open item and its text so far.
    open: Option<(Open, String)>,
    text: String,
    calls: Vec<ToolCall>,
    sequence: u64,
    /// Events not yet sent.
    pending: Vec<Bytes>,
}

impl<'a> Output<'a> {
    fn new(meta: &'a Meta, streaming: bool) -> Self {
        Self {
            meta,
            streaming,
            items: Vec::new(),
            open: None,
            text: String::new(),
            calls: Vec::new(),
            sequence: 0,
            pending: Vec::new(),
        }
    }

    fn emit(&mut self, kind: &str, mut data: Value) {
        if !self.streaming {
            return;
        }
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        self.pending
            .push(Bytes::from(format!("event: {kind}\ndata: {data}\n\n")));
    }

    /// The id of the item of `kind` at the next output index.
    fn open_id(&self, kind: Open) -> String {
        let prefix = match kind {
            Open::Reasoning => "rs",
            Open::Message => "msg",
        };
        self.meta.item_id(prefix, self.items.len())
    }

    fn item(&self, kind: Open, text: &str, status: &str) -> Value {
        let id = self.open_id(kind);
        match kind {
            Open::Reasoning => json!({"type": "reasoning", "id": id,
                "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": status}),
            Open::Message => json!({"type": "message", "id": id,
                "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}),
        }
    }

    fn open(&mut self, kind: Open) {
        if self.open.as_ref().is_some_and(|(k, _)| *k == kind) {
            return;
        }
        self.close();
        let index = self.items.len();
        let mut item = self.item(kind, "", "in_progress");
        let part = item["content"][0].take();
        item["content"] = json!([]);
        let id = item["id"].clone();
        self.emit(
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        );
        self.emit(
            "response.content_part.added",
            json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
        );
        self.open = Some((kind, String::new()));
    }

    fn delta(&mut self, kind: Open, delta: String) {
        self.open(kind);
        if let Some((_, text)) = &mut self.open {
            text.push_str(&delta);
        }
        if kind == Open::Message {
            self.text.push_str(&delta);
        }
        if !self.streaming {
            return;
        }
        // Per token: only the id, not the item it names.
        let index = self.items.len();
        let id = self.open_id(kind);
        match kind {
            Open::Reasoning => self.emit("response.reasoning_text.delta", json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta})),
            Open::Message => self.emit("response.output_text.delta", json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta, "logprobs": []})),
        }
    }

    fn close(&mut self) {
        let Some((kind, text)) = self.open.take() else {
            return;
        };
        let index = self.items.len();
        let item = self.item(kind, &text, "completed");
        let id = item["id"].clone();
        let part = item["content"][0].clone();
        match kind {
            Open::Reasoning => self.emit("response.reasoning_text.done", json!({"item_id": id, "output_index": index, "content_index": 0, "text": text})),
            Open::Message => self.emit("response.output_text.done", json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []})),
        }
        self.emit(
            "response.content_part.done",
            json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
        );
        self.emit(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
        self.items.push(item);
    }

    fn call(&mut self, c: ToolCall) {
        self.close();
        let index = self.items.len();
        let n = self.calls.len();
        let item = json!({"type": "function_call", "id": self.meta.item_id("fc", n),
            "call_id": self.meta.item_id("call", n), "name": c.name, "arguments": c.arguments, "status": "completed"});
        let mut added = item.clone();
        added["arguments"] = json!("");
        added["status"] = json!("in_progress");
        self.emit(
            "response.output_item.added",
            json!({"output_index": index, "item": added}),
        );
        self.emit(
            "response.function_call_arguments.delta",
            json!({"item_id": item["id"], "output_index": index, "delta": c.arguments}),
        );
        self.emit("response.function_call_arguments.done", json!({"item_id": item["id"], "output_index": index, "name": c.name, "arguments": c.arguments}));
        self.emit(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
        self.items.push(item);
        self.calls.push(c);
    }

    fn feed(&mut self, e: Event) {
        match e {
            Event::Text(t) => self.delta(Open::Message, t),
            Event::Reasoning(r) => self.delta(Open::Reasoning, r),
            Event::Call(c) => self.call(c),
            Event::End(_) | Event::Failed(_) => {}
        }
    }

    /// The answer is over: close what is open (an answer with nothing in it still gets its
    /// empty message).
    fn end(&mut self) {
        if self.items.is_empty() && self.open.is_none() {
            self.open(Open::Message);
        }
        self.close();
    }

    /// The answer as the assistant turn of the conversation stored with it. A call whose
    /// arguments are not JSON (a model writing calls without a grammar) is kept with none, so
    /// the next turn's template can still read it.
    fn turn(&self) -> Value {
        let mut m = json!({"role": "assistant", "content": self.text});
        if !self.calls.is_empty() {
            m["tool_calls"] = self
                .calls
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let arguments = match serde_json::from_str::<Value>(&c.arguments) {
                        Ok(_) => c.arguments.as_str(),
                        Err(_) => "{}",
                    };
                    json!({"id": self.meta.item_id("call", i), "type": "function",
                        "function": {"name": c.name, "arguments": arguments}})
                })
                .collect();
        }
        m
    }
}

/// The bytes of an error as a Responses client reads it in a stream: `response.failed`.
fn failed(out: &mut Output<'_>, e: &ApiError) {
    let mut r = out.meta.object("failed", &out.items, None);
    r["error"] = json!({"code": e.code, "message": e.message});
    out.emit("response.failed", json!({"response": r}));
}

impl Store {
    async fn load(&self, id: &str, tenant: Option<&str>) -> Result<Stored, ApiError> {
        let not_found = || {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "not_found",
                format!("Response with id '{id}' not found."),
            )
        };
        if !dyn_core::planes::queue::valid_name(id) {
            return Err(not_found());
        }
        let bytes = self
            .kv
            .get(&self.bucket, id)
            .await
            .map_err(|e| store_error(&e))?
            .ok_or_else(not_found)?;
        let stored: Stored = serde_json::from_slice(&bytes).map_err(|e| {
            ApiError::from(dyn_core::OpError::internal(format!(
                "stored response {id}: {e}"
            )))
        })?;
        // Another tenant's response does not exist for this one.
        if stored.tenant.as_deref() != tenant {
            return Err(not_found());
        }
        Ok(stored)
    }

    /// The conversation up to and including response `id`: its turns' messages, oldest first.
    async fn conversation(&self, id: &str, tenant: Option<&str>) -> Result<Vec<Value>, ApiError> {
        let mut turns = Vec::new();
        let mut at = Some(id.to_owned());
        while let Some(id) = at.take() {
            if turns.len() == MAX_TURNS {
                return Err(invalid(
                    "previous_response_id",
                    format!("a conversation may have at most {MAX_TURNS} stored turns"),
                ));
            }
            let first = turns.is_empty();
            let stored = self.load(&id, tenant).await.map_err(|e| match first {
                true => e,
                // The response asked for is there, an earlier one of its conversation is not.
                false => ApiError::new(
                    StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    "not_found",
                    format!("Response with id '{id}', earlier in this conversation, is no longer stored."),
                ),
            })?;
            at = stored.previous;
            turns.push(stored.messages);
        }
        Ok(turns.into_iter().rev().flatten().collect())
    }

    /// Store `stored` as response `id`, in its tenant's share; false when the record is
    /// larger than one may be (then nothing is stored).
    async fn save(&self, id: &str, stored: &Stored) -> Result<bool, ApiError> {
        let bytes = serde_json::to_vec(stored)
            .map_err(|e| ApiError::from(dyn_core::OpError::internal(e.to_string())))?;
        if bytes.len() as u64 > MAX_STORED_RESPONSE_BYTES {
            tracing::warn!(
                id,
                bytes = bytes.len(),
                max = MAX_STORED_RESPONSE_BYTES,
                "Response too large to store; answered with store: false"
            );
            return Ok(false);
        }
        // Tenant names are never empty: "" is the requests that have none.
        let owner = stored.tenant.as_deref().unwrap_or_default();
        self.kv
            .put_for(&self.bucket, owner, id, bytes.into())
            .await
            .map_err(|e| store_error(&e))?;
        Ok(true)
    }
}

fn store_error(e: &dyn_core::planes::PlaneError) -> ApiError {
    tracing::warn!(error = %e, "Response store");
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "service_unavailable",
        "store_unavailable",
        "the response store is unavailable",
    )
}

/// What a request puts in its stored record before its answer: its turn's input and what the
/// response repeats of the request, as JSON.
fn turn_bytes(t: &Translated) -> usize {
    let len = |v: &Value| serde_json::to_vec(v).map_or(usize::MAX, |b| b.len());
    t.messages[t.new_from..]
        .iter()
        .fold(len(&t.meta.echo), |n, m| n.saturating_add(len(m)))
}

/// The tenant a request's key names (its stored responses are its own).
fn tenant_of(
    app: &App,
    headers: &HeaderMap,
    key: Option<&KeyTenant>,
) -> Result<Option<String>, ApiError> {
    Ok(app.server.traffic(headers, key)?.tenant)
}

/// `POST /v1/responses`.
pub(crate) async fn create(
    State(app): State<App>,
    key: Option<Extension<KeyTenant>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let key = key.map(|k| k.0);
    let prepared = async {
        let body = body.map_err(super::body_error)?;
        let b: ResponsesBody = super::parse_json(&body)?;
        let tenant = tenant_of(&app, &headers, key.as_ref())?;
        let earlier = match b.previous_response_id.as_deref() {
            Some(id) => app
                .responses
                .conversation(id, tenant.as_deref())
                .await
                .map_err(|e| e.with_param("previous_response_id"))?,
            None => Vec::new(),
        };
        let t = translate(b, earlier)?;
        // A turn too large to store is refused before it runs, not after.
        if t.meta.store && turn_bytes(&t) > MAX_TURN_BYTES {
            return Err(invalid(
                "input",
                format!(
                    "this request is too large to store (its input, instructions, tools and \
                     the rest of what is stored with the response are over {} KiB): send \
                     store: false",
                    MAX_TURN_BYTES >> 10
                ),
            ));
        }
        Ok::<_, ApiError>((t, tenant))
    };
    let (t, tenant) = match prepared.await {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let Translated {
        chat,
        mut messages,
        mut meta,
        new_from,
    } = t;
    // Stored with the answer: this turn's messages only (the earlier turns are stored).
    let messages = messages.split_off(new_from);
    let parsed = openai::chat_from_json(&app, chat);
    let (started, opts) =
        match pipeline::start(&app, "responses", key.as_ref(), &headers, parsed).await {
            Ok(s) => s,
            Err(e) => return e.into_response(),
        };
    // The name the client used (an adapter's, say).
    meta.model = opts.named.to_string();
    let events = answer::events(started, &opts);
    let saved = Saved {
        store: app.responses.clone(),
        messages,
        previous: meta.echo["previous_response_id"]
            .as_str()
            .map(str::to_owned),
        tenant,
    };
    if !opts.stream {
        let mut out = Output::new(&meta, false);
        let mut events = std::pin::pin!(events);
        while let Some(e) = events.next().await {
            match e {
                Event::End(end) => {
                    out.end();
                    let mut response = meta.object(status(&end), &out.items, Some(&end));
                    if let Err(e) = saved.save(&meta, &out, &mut response).await {
                        return e.into_response();
                    }
                    return Json(response).into_response();
                }
                Event::Failed(e) => return e.into_response(),
                e => out.feed(e),
            }
        }
        return ApiError::from(dyn_core::OpError::internal("the answer ended early"))
            .into_response();
    }
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        axum::body::Body::from_stream(sse(meta, events, saved)),
    )
        .into_response()
}

/// Where an answer is stored once it is whole.
struct Saved {
    store: Store,
    /// This turn's input, as chat messages.
    messages: Vec<Value>,
    previous: Option<String>,
    tenant: Option<String>,
}

impl Saved {
    /// Store the response (when asked to) with its conversation and this answer; one whose
    /// answer made it too large to store says `store: false`.
    async fn save(
        self,
        meta: &Meta,
        out: &Output<'_>,
        response: &mut Value,
    ) -> Result<(), ApiError> {
        if !meta.store {
            return Ok(());
        }
        let mut messages = self.messages;
        messages.push(out.turn());
        let stored = Stored {
            response: response.clone(),
            messages,
            previous: self.previous,
            tenant: self.tenant,
        };
        if !self.store.save(&meta.id, &stored).await? {
            response["store"] = json!(false);
        }
        Ok(())
    }
}

fn sse(
    meta: Meta,
    events: impl Stream<Item = Event> + Send + 'static,
    saved: Saved,
) -> impl Stream<Item = Result<Bytes, Infallible>> + Send {
    async_stream::stream! {
        let mut out = Output::new(&meta, true);
        let created = meta.object("in_progress", &[], None);
        out.emit("response.created", json!({"response": created}));
        out.emit("response.in_progress", json!({"response": created}));
        let mut events = std::pin::pin!(events);
        let mut saved = Some(saved);
        while let Some(e) = events.next().await {
            match e {
                Event::End(end) => {
                    out.end();
                    let status = status(&end);
                    let mut response = meta.object(status, &out.items, Some(&end));
                    if let Some(s) = saved.take()
                        && let Err(e) = s.save(&meta, &out, &mut response).await
                    {
                        failed(&mut out, &e);
                    } else {
                        let kind = if status == "completed" { "response.completed" } else { "response.incomplete" };
                        out.emit(kind, json!({"response": response}));
                    }
                }
                Event::Failed(e) => failed(&mut out, &e),
                e => out.feed(e),
            }
            for b in out.pending.drain(..) {
                yield Ok(b);
            }
        }
    }
}

/// The stored response `id` as the request's tenant sees it.
async fn stored(
    app: &App,
    key: Option<Extension<KeyTenant>>,
    headers: &HeaderMap,
    id: &str,
) -> Result<Stored, ApiError> {
    let key = key.map(|k| k.0);
    let tenant = tenant_of(app, headers, key.as_ref())?;
    app.responses.load(id, tenant.as_deref()).await
}

/// `GET /v1/responses/{id}`: a stored response.
pub(crate) async fn get(
    State(app): State<App>,
    key: Option<Extension<KeyTenant>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    match stored(&app, key, &headers, &id).await {
        Ok(s) => Json(s.response).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `DELETE /v1/responses/{id}`: only its own tenant's (another's is not found).
pub(crate) async fn delete(
    State(app): State<App>,
    key: Option<Extension<KeyTenant>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let deleted = async {
        stored(&app, key, &headers, &id).await?;
        app.responses
            .kv
            .delete(&app.responses.bucket, &id)
            .await
            .map_err(|e| store_error(&e))
    };
    match deleted.await {
        Ok(_) => Json(json!({"id": id, "object": "response", "deleted": true})).into_response(),
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> ResponsesBody {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn items_become_the_chat_they_mean() {
        let b = body(json!({
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
            ],
            "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"}, "strict": true}],
            "tool_choice": {"type": "function", "name": "weather"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
            "max_output_tokens": 20
        }));
        let earlier = vec![
            json!({"role": "user", "content": "Hi"}),
            json!({"role": "assistant", "content": "Hello"}),
        ];
        let t = translate(b, earlier).unwrap();
        assert_eq!(
            t.chat["messages"],
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "system", "content": "Use tools."},
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "weather", "arguments": "{\"city\":\"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
            ])
        );
        // The stored conversation has no instructions (they are not carried over).
        assert_eq!(t.messages.len(), 6);
        assert_eq!(
            t.chat["tools"],
            json!([{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}, "strict": true}}])
        );
        assert_eq!(
            t.chat["tool_choice"],
            json!({"type": "function", "function": {"name": "weather"}})
        );
        assert_eq!(
            t.chat["response_format"]["json_schema"]["schema"],
            json!({"type": "object"})
        );
        assert_eq!(t.chat["max_tokens"], 20);
        assert!(t.meta.id.starts_with("resp_") && t.meta.store);
    }

    #[test]
    fn what_cannot_be_served_is_refused_by_name() {
        let refused = |v: Value| translate(body(v), Vec::new()).err().and_then(|e| e.param);
        assert_eq!(
            refused(json!({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}))
                .as_deref(),
            Some("tools[0].type")
        );
        assert_eq!(
            refused(json!({"model": "m", "input": "x", "background": true})).as_deref(),
            Some("background")
        );
        assert_eq!(
            refused(json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]})).as_deref(),
            Some("input[0].content[0]")
        );
        assert_eq!(
            refused(json!({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}))
                .as_deref(),
            Some("input[0].type")
        );
        assert!(
            translate(
                body(json!({"model": "m", "input": "x", "background": false})),
                Vec::new()
            )
            .is_ok()
        );
    }

    #[test]
    fn what_a_response_stores_of_its_request_is_bounded() {
        let refused = |v: Value| translate(body(v), Vec::new()).err().and_then(|e| e.param);
        let big: serde_json::Map<String, Value> =
            (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
        assert_eq!(
            refused(json!({"model": "m", "input": "x", "metadata": big})).as_deref(),
            Some("metadata")
        );
        assert_eq!(
            refused(json!({"model": "m", "input": "x", "metadata": {"k": "v".repeat(513)}}))
                .as_deref(),
            Some("metadata.k")
        );
        assert_eq!(
            refused(json!({"model": "m", "input": "x", "user": "u".repeat(MAX_USER + 1)}))
                .as_deref(),
            Some("user")
        );
        // A reasoning object's other fields are not kept.
        let t = translate(
            body(json!({"model": "m", "input": "x", "reasoning": {"junk": "y".repeat(1000)}})),
            Vec::new(),
        )
        .unwrap();
        assert_eq!(
            t.meta.echo["reasoning"],
            json!({"effort": null, "summary": null})
        );
        // What is stored before the answer counts the instructions too (not in the turn).
        let small = translate(body(json!({"model": "m", "input": "x"})), Vec::new()).unwrap();
        let long = translate(
            body(json!({"model": "m", "input": "x", "instructions": "i".repeat(10_000)})),
            Vec::new(),
        )
        .unwrap();
        assert!(turn_bytes(&long) > turn_bytes(&small) + 9_000);
    }

    #[test]
    fn a_streamed_answer_opens_and_closes_its_items_in_order() {
        let t = translate(body(json!({"model": "m", "input": "x"})), Vec::new()).unwrap();
        let mut out = Output::new(&t.meta, true);
        out.feed(Event::Reasoning("think".into()));
        out.feed(Event::Text("Hel".into()));
        out.feed(Event::Text("lo".into()));
        out.feed(Event::Call(ToolCall {
            name: "f".into(),
            arguments: "{}".into(),
        }));
        out.end();
        let kinds: Vec<String> = out
            .pending
            .iter()
            .map(|b| {
                let s = std::str::from_utf8(b).unwrap();
                s.lines()
                    .next()
                    .unwrap()
                    .trim_start_matches("event: ")
                    .to_owned()
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
            ]
        );
        assert_eq!(out.items.len(), 3);
        assert_eq!(out.items[1]["content"][0]["text"], "Hello");
        assert_eq!(out.items[2]["call_id"], out.turn()["tool_calls"][0]["id"]);
        assert_eq!(out.turn()["content"], "Hello");
        // Numbered from 0 without gaps.
        let last = std::str::from_utf8(out.pending.last().unwrap()).unwrap();
        assert!(last.contains("\"sequence_number\":16"), "{last}");
    }
}
