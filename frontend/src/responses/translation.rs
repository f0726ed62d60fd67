//! A Responses body read and translated into the chat completions body it means: input
//! items as messages, function tools and `tool_choice` as chat's, `text.format` as
//! `response_format`, and what the answer must carry back ([`Meta`]).

use dyn_protocol::types::{FinishReason, Usage};
use serde::Deserialize;
use serde_json::{Value, json};

use super::MAX_USER;
use crate::answer::Ending;
use crate::app::unix_now;
use crate::openai::request as openai;
use crate::{ApiError, invalid};

#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or a list of input items")]
pub(super) enum InputIn {
    Text(String),
    Items(Vec<Value>),
}

#[derive(Debug, Deserialize)]
pub(super) struct ResponsesBody {
    pub(super) model: String,
    pub(super) input: InputIn,
    #[serde(default)]
    pub(super) instructions: Option<String>,
    #[serde(default)]
    pub(super) tools: Option<Vec<Value>>,
    #[serde(default)]
    pub(super) tool_choice: Option<Value>,
    #[serde(default)]
    pub(super) parallel_tool_calls: Option<bool>,
    #[serde(default)]
    pub(super) text: Option<Value>,
    #[serde(default)]
    pub(super) reasoning: Option<Value>,
    #[serde(default)]
    pub(super) max_output_tokens: Option<u32>,
    pub(super) temperature: Option<f32>,
    pub(super) top_p: Option<f32>,
    #[serde(default)]
    pub(super) stream: bool,
    #[serde(default)]
    pub(super) store: Option<bool>,
    #[serde(default)]
    pub(super) previous_response_id: Option<String>,
    #[serde(default)]
    pub(super) metadata: Option<Value>,
    #[serde(default)]
    pub(super) user: Option<String>,
    /// Anything else a client sends: what changes the answer is refused by name.
    #[serde(flatten)]
    pub(super) other: serde_json::Map<String, Value>,
}

/// Fields of the Responses API that change an answer and are not built here, each with the
/// values that ask for nothing.
pub(super) const REFUSED: &[(&str, openai::AsksNothing)] = &[
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
pub(super) fn content_text(content: &Value, param: &str) -> Result<String, ApiError> {
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
pub(super) fn input_messages(input: InputIn, out: &mut Vec<Value>) -> Result<(), ApiError> {
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
pub(super) fn chat_tools(tools: &[Value]) -> Result<Value, ApiError> {
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

pub(super) fn chat_tool_choice(choice: &Value) -> Result<Value, ApiError> {
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
pub(super) fn response_format(text: &Value) -> Result<Option<Value>, ApiError> {
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
pub(super) struct Meta {
    pub(super) id: String,
    pub(super) created_at: u64,
    pub(super) model: String,
    /// The request's own fields, as the response object echoes them.
    pub(super) echo: Value,
    pub(super) store: bool,
}

/// A Responses body: the chat body it means, the conversation to store with the answer
/// (earlier turns and this input), and what the response repeats.
pub(super) struct Translated {
    pub(super) chat: openai::ChatBody,
    pub(super) messages: Vec<Value>,
    pub(super) meta: Meta,
    /// Where this turn's messages start in `messages` (after the earlier turns').
    pub(super) new_from: usize,
}

pub(super) fn translate(b: ResponsesBody, earlier: Vec<Value>) -> Result<Translated, ApiError> {
    openai::refuse_fields(REFUSED, |name| b.other.get(name))?;
    openai::check_metadata(b.metadata.as_ref())?;
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
        prompt.push(openai::MessageIn::text("system", i.clone()));
    }
    // The conversation is kept as the store keeps it (chat messages as JSON, earlier turns
    // read back from it): each message is read into its typed form here, once.
    for (i, m) in messages.iter().enumerate() {
        prompt.push(
            openai::MessageIn::deserialize(m)
                .map_err(|e| invalid("input", format!("conversation item {i}: {e}")))?,
        );
    }
    let tools = b.tools.unwrap_or_default();
    let chat = openai::ChatBody {
        messages: prompt,
        common: openai::Common {
            model: Some(b.model.clone()),
            stream: b.stream,
            max_tokens: b.max_output_tokens,
            temperature: b.temperature,
            top_p: b.top_p,
            user: b.user.clone(),
            parallel_tool_calls: b.parallel_tool_calls,
            tools: (!tools.is_empty())
                .then(|| chat_tools(&tools))
                .transpose()?,
            tool_choice: b
                .tool_choice
                .as_ref()
                .filter(|c| !c.is_null())
                .map(chat_tool_choice)
                .transpose()?,
            response_format: b.text.as_ref().map(response_format).transpose()?.flatten(),
            ..openai::Common::default()
        },
    };
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
    pub(super) fn object(&self, status: &str, output: &[Value], end: Option<&Ending>) -> Value {
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
    pub(super) fn item_id(&self, kind: &str, index: usize) -> String {
        let hex = self.id.strip_prefix("resp_").unwrap_or(&self.id);
        format!("{kind}_{hex}_{index}")
    }
}

/// The Responses `usage` object.
pub(super) fn usage(u: Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}
