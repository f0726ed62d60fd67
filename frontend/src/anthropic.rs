//! Anthropic's Messages API on the `http` ingress: `POST /v1/messages` (unary, or streamed
//! as Anthropic's named server-sent events) and `POST /v1/messages/count_tokens`.
//!
//! A Messages body is translated into the chat completions body it means — `system` first,
//! text blocks joined, `tool_use` blocks as an assistant's tool calls, `tool_result` blocks as
//! tool messages, `tools` as functions, `tool_choice` `any` as `required` — and then runs
//! exactly as chat does: the same template, tool-call and reasoning parsing, routing, limits
//! and metrics (under the endpoint `messages`). Answers come back as Anthropic's content
//! blocks (`thinking`, `text`, `tool_use`), `stop_reason` (`end_turn`, `max_tokens`,
//! `stop_sequence` with the matched `stop_sequence`, `tool_use`) and usage; errors in its shape
//! (`{"type": "error", "error": {"type", "message"}}`). Clients authenticate with `x-api-key`
//! (or a bearer token) against the same keys as the OpenAI routes.

use std::convert::Infallible;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use dyn_protocol::types::FinishReason;
use futures::{Stream, StreamExt};
use serde::Deserialize;
use serde_json::{Value, json};

use super::answer::{self, Ending, Event, Whole};
use super::tools::ToolCall;
use super::{ApiError, KeyTenant, invalid};
use crate::app::App;
use crate::openai::request as openai;
use crate::pipeline;
use crate::{anthropic_error, anthropic_error_body};

#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or a list of content blocks")]
enum ContentIn {
    Text(String),
    Blocks(Vec<Value>),
}

#[derive(Debug, Deserialize)]
struct MessageIn {
    role: String,
    content: ContentIn,
}

#[derive(Debug, Deserialize)]
struct MessagesBody {
    model: String,
    /// Required by Anthropic; optional for `count_tokens`.
    max_tokens: Option<u32>,
    messages: Vec<MessageIn>,
    #[serde(default)]
    system: Option<ContentIn>,
    #[serde(default)]
    stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    stream: bool,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    metadata: Option<Value>,
    /// Anything else a client sends that changes the answer is refused by name.
    #[serde(flatten)]
    other: serde_json::Map<String, Value>,
}

/// Fields Anthropic defines that change an answer and are not built here, each with the values
/// that ask for nothing. Extended thinking with a budget is one: a model reasons (and answers
/// `thinking` blocks) as its template has it, not by a budget.
const REFUSED: &[(&str, openai::AsksNothing)] = &[
    ("container", Value::is_null),
    ("mcp_servers", openai::empty),
    ("context_management", Value::is_null),
    ("thinking", |v| v.is_null() || v["type"] == "disabled"),
];

/// The text of `system` or of a tool result's content: a string, or text blocks joined.
fn text_of(content: ContentIn, param: &str) -> Result<String, ApiError> {
    match content {
        ContentIn::Text(t) => Ok(t),
        ContentIn::Blocks(blocks) => {
            let mut text = String::new();
            for (j, b) in blocks.iter().enumerate() {
                match (b["type"].as_str(), b["text"].as_str()) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(invalid(
                            format!("{param}[{j}]"),
                            format!(
                                "content blocks of type {} are not supported here; only text",
                                kind.unwrap_or("(none)")
                            ),
                        ));
                    }
                }
            }
            Ok(text)
        }
    }
}

/// The chat completions messages a Messages body's `system` and `messages` mean. A last
/// assistant message (Anthropic's prefill: the answer goes on from it) is refused: the
/// template would close that turn and start a new one.
fn chat_messages(
    system: Option<ContentIn>,
    messages: Vec<MessageIn>,
) -> Result<Vec<openai::MessageIn>, ApiError> {
    if let Some(last) = messages.len().checked_sub(1)
        && messages[last].role == "assistant"
    {
        return Err(ApiError::invalid(
            "unsupported_parameter",
            "a final assistant message (prefilling the answer) is not supported; end with a user message",
        )
        .with_param(format!("messages[{last}]")));
    }
    let mut out = Vec::with_capacity(messages.len() + 1);
    if let Some(s) = system {
        out.push(openai::MessageIn::text("system", text_of(s, "system")?));
    }
    for (i, m) in messages.into_iter().enumerate() {
        let role = m.role.as_str();
        if role != "user" && role != "assistant" {
            return Err(invalid(
                format!("messages[{i}].role"),
                format!("role must be user or assistant, got {role:?}"),
            ));
        }
        let blocks = match m.content {
            ContentIn::Text(t) => {
                out.push(openai::MessageIn::text(role, t));
                continue;
            }
            ContentIn::Blocks(b) => b,
        };
        let mut text = String::new();
        let mut calls = Vec::new();
        for (j, b) in blocks.into_iter().enumerate() {
            let at = format!("messages[{i}].content[{j}]");
            match b["type"].as_str() {
                Some("text") => text.push_str(b["text"].as_str().unwrap_or_default()),
                // Earlier thinking is not shown to the model again (as chat templates drop
                // earlier reasoning).
                Some("thinking" | "redacted_thinking") if role == "assistant" => {}
                Some("tool_use") if role == "assistant" => {
                    let (Some(id), Some(name)) = (b["id"].as_str(), b["name"].as_str()) else {
                        return Err(invalid(at, "a tool_use block needs its id and name"));
                    };
                    calls.push(json!({"id": id, "type": "function",
                        "function": {"name": name, "arguments": b["input"].to_string()}}));
                }
                Some("tool_result") if role == "user" => {
                    let Some(id) = b["tool_use_id"].as_str() else {
                        return Err(invalid(at, "a tool_result block needs its tool_use_id"));
                    };
                    let content = match b.get("content") {
                        None | Some(Value::Null) => String::new(),
                        Some(c) => text_of(
                            serde_json::from_value(c.clone())
                                .map_err(|e| invalid(&at, e.to_string()))?,
                            &format!("{at}.content"),
                        )?,
                    };
                    let content = if b["is_error"] == true {
                        format!("Error: {content}")
                    } else {
                        content
                    };
                    // Results answer the calls before them: they go ahead of the turn's text.
                    out.push(openai::MessageIn {
                        tool_call_id: Some(id.to_owned()),
                        ..openai::MessageIn::text("tool", content)
                    });
                }
                other => {
                    return Err(invalid(
                        at,
                        format!(
                            "content blocks of type {} are not supported in {role} messages",
                            other.unwrap_or("(none)")
                        ),
                    ));
                }
            }
        }
        if !calls.is_empty() {
            out.push(openai::MessageIn {
                tool_calls: Some(Value::Array(calls)),
                ..openai::MessageIn::text(role, text)
            });
        } else if !text.is_empty() || role == "assistant" {
            out.push(openai::MessageIn::text(role, text));
        }
    }
    Ok(out)
}

/// Anthropic's tools (`name`, `description`, `input_schema`) as OpenAI's functions.
fn chat_tools(tools: Vec<Value>) -> Result<Value, ApiError> {
    let mut out = Vec::with_capacity(tools.len());
    for (i, t) in tools.into_iter().enumerate() {
        if let Some(kind) = t["type"].as_str().filter(|k| *k != "custom") {
            return Err(ApiError::invalid(
                "unsupported_parameter",
                format!("server tools ({kind}) are not supported; give client tools with name and input_schema"),
            )
            .with_param(format!("tools[{i}].type")));
        }
        let Some(name) = t["name"].as_str() else {
            return Err(invalid(format!("tools[{i}].name"), "a tool needs a name"));
        };
        let mut f = json!({"name": name, "parameters": t["input_schema"]});
        if let Some(d) = t["description"].as_str() {
            f["description"] = json!(d);
        }
        out.push(json!({"type": "function", "function": f}));
    }
    Ok(Value::Array(out))
}

/// `tool_choice` (`auto`, `any`, `tool` with its name, `none`) as OpenAI's, and whether
/// parallel calls are off.
fn chat_tool_choice(choice: &Value) -> Result<(Value, Option<bool>), ApiError> {
    let parallel = choice["disable_parallel_tool_use"].as_bool().map(|d| !d);
    let c = match choice["type"].as_str() {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => match choice["name"].as_str() {
            Some(n) => json!({"type": "function", "function": {"name": n}}),
            None => return Err(invalid("tool_choice.name", "tool_choice tool needs a name")),
        },
        other => {
            return Err(invalid(
                "tool_choice.type",
                format!(
                    "tool_choice type must be auto, any, tool or none, got {}",
                    other.map_or_else(|| choice["type"].to_string(), |t| format!("{t:?}"))
                ),
            ));
        }
    };
    Ok((c, parallel))
}

/// The chat completions body a Messages body means, built field by field.
fn chat_body(b: MessagesBody, count_only: bool) -> Result<openai::ChatBody, ApiError> {
    openai::refuse_fields(REFUSED, |name| b.other.get(name))?;
    if b.max_tokens.is_none() && !count_only {
        return Err(invalid("max_tokens", "max_tokens is required"));
    }
    let mut common = openai::Common {
        model: Some(b.model),
        stream: b.stream,
        max_tokens: b.max_tokens,
        temperature: b.temperature,
        top_p: b.top_p,
        top_k: b.top_k,
        stop: b.stop_sequences.map(openai::StopIn::Many),
        user: metadata_user(b.metadata.as_ref())?.map(str::to_owned),
        ..openai::Common::default()
    };
    if let Some(tools) = b.tools.filter(|t| !t.is_empty()) {
        common.tools = Some(chat_tools(tools)?);
    }
    if let Some(choice) = b.tool_choice.filter(|c| !c.is_null()) {
        let (c, parallel) = chat_tool_choice(&choice)?;
        common.tool_choice = Some(c);
        common.parallel_tool_calls = parallel;
    }
    Ok(openai::ChatBody {
        messages: chat_messages(b.system, b.messages)?,
        common,
    })
}

/// The longest `metadata.user_id` taken (Anthropic's bound).
const MAX_USER_ID: usize = 256;

/// Anthropic's `metadata`: `{user_id}` (a string of at most 256 characters, or null) and
/// nothing else, as Anthropic checks it.
fn metadata_user(metadata: Option<&Value>) -> Result<Option<&str>, ApiError> {
    let m = match metadata {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(invalid("metadata", "metadata must be an object")),
    };
    if m.keys().any(|k| k != "user_id") {
        return Err(invalid(
            "metadata",
            "metadata may hold user_id only; other fields are not permitted",
        ));
    }
    match m.get("user_id") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(u)) if u.chars().count() <= MAX_USER_ID => Ok(Some(u)),
        Some(Value::String(_)) => Err(invalid(
            "metadata.user_id",
            format!("user_id may be at most {MAX_USER_ID} characters"),
        )),
        Some(_) => Err(invalid("metadata.user_id", "user_id must be a string")),
    }
}

fn parse(
    body: Result<Bytes, BytesRejection>,
    count_only: bool,
) -> Result<openai::ChatBody, ApiError> {
    let body = body.map_err(super::body_error)?;
    let b: MessagesBody = super::parse_json(&body)?;
    chat_body(b, count_only)
}

/// `POST /v1/messages`.
pub(crate) async fn messages(
    State(app): State<App>,
    key: Option<Extension<KeyTenant>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let parsed = parse(body, false).and_then(|chat| openai::chat_from_body(&app, chat));
    let key = key.map(|k| k.0);
    let (started, opts) =
        match pipeline::start(&app, "messages", key.as_ref(), &headers, parsed).await {
            Ok(s) => s,
            Err(e) => return anthropic_error(e),
        };
    let id = format!("msg_{}", started.id);
    let model = opts.named.to_string();
    let stream = opts.stream;
    let events = answer::events(started, &opts);
    if !stream {
        return match answer::collect(events).await {
            Ok((whole, end)) => Json(message(&id, &model, whole, &end)).into_response(),
            Err(e) => anthropic_error(e),
        };
    }
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        axum::body::Body::from_stream(sse(id, model, events)),
    )
        .into_response()
}

/// A tool call's id (`toolu_…`), unique per message and call.
fn call_id(id: &str, index: usize) -> String {
    format!("toolu_{}_{index}", id.strip_prefix("msg_").unwrap_or(id))
}

/// A call's arguments as the object Anthropic's `input` is (`{}` when they are not JSON,
/// which a grammar-free parse can leave).
fn input(c: &ToolCall) -> Value {
    serde_json::from_str(&c.arguments)
        .ok()
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}))
}

fn stop_reason(end: &Ending) -> (&'static str, Option<&str>) {
    match end.finish {
        FinishReason::ToolCalls => ("tool_use", None),
        FinishReason::Length => ("max_tokens", None),
        FinishReason::Stop => match &end.stop_string {
            Some(s) => ("stop_sequence", Some(s.as_str())),
            None => ("end_turn", None),
        },
    }
}

/// A unary answer: Anthropic's message object.
fn message(id: &str, model: &str, w: Whole, end: &Ending) -> Value {
    let mut content = Vec::new();
    if !w.reasoning.is_empty() {
        content.push(json!({"type": "thinking", "thinking": w.reasoning, "signature": ""}));
    }
    if !w.text.is_empty() || w.calls.is_empty() {
        content.push(json!({"type": "text", "text": w.text}));
    }
    for (i, c) in w.calls.iter().enumerate() {
        content.push(
            json!({"type": "tool_use", "id": call_id(id, i), "name": c.name, "input": input(c)}),
        );
    }
    let (reason, sequence) = stop_reason(end);
    json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {"input_tokens": end.usage.prompt_tokens, "output_tokens": end.usage.completion_tokens},
    })
}

/// One named server-sent event.
fn event(name: &str, data: &Value) -> Result<Bytes, Infallible> {
    Ok(Bytes::from(format!("event: {name}\ndata: {data}\n\n")))
}

/// The kind of content block open in a stream.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Block {
    Text,
    Thinking,
}

/// A streamed answer: `message_start`, a `ping`, each content block as
/// `content_block_start`, its deltas and `content_block_stop`, then `message_delta` (stop
/// reason and usage) and `message_stop`; a failure part way is an `error` event.
fn sse(
    id: String,
    model: String,
    events: impl Stream<Item = Event> + Send + 'static,
) -> impl Stream<Item = Result<Bytes, Infallible>> + Send {
    async_stream::stream! {
        yield event("message_start", &json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 0, "output_tokens": 0}}}));
        yield event("ping", &json!({"type": "ping"}));
        // The open block and its index; the next block's index.
        let mut open: Option<Block> = None;
        let mut index = 0usize;
        let mut calls = 0usize;
        let mut events = std::pin::pin!(events);
        while let Some(e) = events.next().await {
            let (kind, delta) = match e {
                Event::Text(t) => (Block::Text, json!({"type": "text_delta", "text": t})),
                Event::Reasoning(r) => (Block::Thinking, json!({"type": "thinking_delta", "thinking": r})),
                Event::Call(c) => {
                    if open.take().is_some() {
                        yield event("content_block_stop", &json!({"type": "content_block_stop", "index": index - 1}));
                    }
                    let block = json!({"type": "tool_use", "id": call_id(&id, calls), "name": c.name, "input": {}});
                    calls += 1;
                    yield event("content_block_start", &json!({"type": "content_block_start", "index": index, "content_block": block}));
                    yield event("content_block_delta", &json!({"type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": input(&c).to_string()}}));
                    yield event("content_block_stop", &json!({"type": "content_block_stop", "index": index}));
                    index += 1;
                    continue;
                }
                Event::End(end) => {
                    if open.take().is_some() {
                        yield event("content_block_stop", &json!({"type": "content_block_stop", "index": index - 1}));
                    }
                    if index == 0 {
                        // Nothing was said: one empty text block, as the unary answer has.
                        yield event("content_block_start", &json!({"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}));
                        yield event("content_block_stop", &json!({"type": "content_block_stop", "index": 0}));
                    }
                    let (reason, sequence) = stop_reason(&end);
                    yield event("message_delta", &json!({"type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": {"input_tokens": end.usage.prompt_tokens, "output_tokens": end.usage.completion_tokens}}));
                    yield event("message_stop", &json!({"type": "message_stop"}));
                    return;
                }
                Event::Failed(e) => {
                    yield event("error", &anthropic_error_body(&e));
                    return;
                }
            };
            if open != Some(kind) {
                if open.is_some() {
                    yield event("content_block_stop", &json!({"type": "content_block_stop", "index": index - 1}));
                }
                let block = match kind {
                    Block::Text => json!({"type": "text", "text": ""}),
                    Block::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
                };
                yield event("content_block_start", &json!({"type": "content_block_start", "index": index, "content_block": block}));
                open = Some(kind);
                index += 1;
            }
            yield event("content_block_delta", &json!({"type": "content_block_delta", "index": index - 1, "delta": delta}));
        }
    }
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as the model reads it.
pub(crate) async fn count_tokens(
    State(app): State<App>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let counted = async {
        let chat = parse(body, true)?;
        openai::count_prompt(&app, chat).await
    };
    match counted.await {
        Ok(n) => Json(json!({"input_tokens": n})).into_response(),
        Err(e) => anthropic_error(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> MessagesBody {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_conversation_with_tools_becomes_the_chat_it_means() {
        let b = body(json!({
            "model": "m", "max_tokens": 64,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "look it up", "signature": "x"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "And so?"}]}
            ],
            "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "stop_sequences": ["END"],
            "metadata": {"user_id": "u1"}
        }));
        let chat = chat_body(b, false).unwrap();
        // The messages the typed translation makes are those the chat dialect reads from the
        // chat body that means the same.
        let same: Vec<openai::MessageIn> = serde_json::from_value(json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "toolu_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
                {"role": "user", "content": "And so?"}
        ]))
        .unwrap();
        assert_eq!(
            openai::chat_messages(chat.messages).unwrap(),
            openai::chat_messages(same).unwrap()
        );
        let c = chat.common;
        assert_eq!(
            c.tools,
            Some(
                json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}}])
            )
        );
        assert_eq!(c.tool_choice, Some(json!("required")));
        assert_eq!(c.parallel_tool_calls, Some(false));
        assert!(matches!(c.stop, Some(openai::StopIn::Many(s)) if s == ["END"]));
        assert_eq!(c.user.as_deref(), Some("u1"));
    }

    #[test]
    fn what_cannot_be_served_is_refused_by_name() {
        let refused = |v: Value, count_only: bool| chat_body(body(v), count_only).unwrap_err();
        let e = refused(json!({"model": "m", "messages": []}), false);
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(chat_body(body(json!({"model": "m", "messages": []})), true).is_ok());
        let e = refused(
            json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {}}]}]}),
            false,
        );
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0]"));
        let e = refused(
            json!({"model": "m", "max_tokens": 1, "messages": [],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
            false,
        );
        assert_eq!(e.param.as_deref(), Some("tools[0].type"));
        let e = refused(
            json!({"model": "m", "max_tokens": 1, "messages": [], "mcp_servers": [{}]}),
            false,
        );
        assert_eq!(e.param.as_deref(), Some("mcp_servers"));
        let e = refused(
            json!({"model": "m", "max_tokens": 1, "messages": [],
                "thinking": {"type": "enabled", "budget_tokens": 1024}}),
            false,
        );
        assert_eq!(e.param.as_deref(), Some("thinking"));
        let e = refused(
            json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"},
                {"role": "assistant", "content": "The answer is"}]}),
            false,
        );
        assert_eq!(e.param.as_deref(), Some("messages[1]"));
        let e = refused(
            json!({"model": "m", "max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}),
            false,
        );
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        // Errors read as Anthropic's.
        let b = anthropic_error_body(&e);
        assert_eq!(b["type"], "error");
        assert_eq!(b["error"]["type"], "invalid_request_error");
    }

    #[test]
    fn answers_read_as_anthropic_messages() {
        let end = |finish, stop: Option<&str>| Ending {
            finish,
            usage: dyn_protocol::types::Usage {
                prompt_tokens: 5,
                completion_tokens: 3,
            },
            stop_string: stop.map(str::to_owned),
        };
        let w = Whole {
            reasoning: "hmm".into(),
            text: String::new(),
            calls: vec![ToolCall {
                name: "f".into(),
                arguments: r#"{"a":1}"#.into(),
            }],
        };
        let m = message("msg_abc", "m", w, &end(FinishReason::ToolCalls, None));
        assert_eq!(
            m["content"],
            json!([{"type": "thinking", "thinking": "hmm", "signature": ""},
                   {"type": "tool_use", "id": "toolu_abc_0", "name": "f", "input": {"a": 1}}])
        );
        assert_eq!(m["stop_reason"], "tool_use");
        assert_eq!(m["usage"], json!({"input_tokens": 5, "output_tokens": 3}));
        let m = message(
            "msg_x",
            "m",
            Whole::default(),
            &end(FinishReason::Stop, Some("END")),
        );
        assert_eq!(m["content"], json!([{"type": "text", "text": ""}]));
        assert_eq!(
            (m["stop_reason"].as_str(), m["stop_sequence"].as_str()),
            (Some("stop_sequence"), Some("END"))
        );
        let m = message(
            "msg_x",
            "m",
            Whole::default(),
            &end(FinishReason::Length, None),
        );
        assert_eq!(m["stop_reason"], "max_tokens");
    }
}
