//! OpenAI's chat completions and completions bodies, read into an [`LlmRequest`] and the
//! answer's [`Options`]: the fields every generating dialect shares ([`Common`]), the prompt
//! forms, messages, sampling, log-probabilities, structured output and the fields refused as
//! unsupported. The other dialects build a typed chat body field by field ([`ChatBody`],
//! [`chat_from_body`]), never a JSON body parsed again.

use std::collections::BTreeMap;
use std::sync::Arc;

use dyn_protocol::types::{
    ChatMessage, Constraint, Endpoint, Limits, LlmRequest, Prompt, Routing, Sampling, SlaTargets,
};
use serde::Deserialize;
use serde_json::Value;

use crate::app::App;
use crate::pipeline::Options;
use crate::reasoning::ReasoningFormat;
use crate::tools::{ToolFormat, ToolRequest};
use crate::{ApiError, invalid};

#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or a list of strings")]
pub(crate) enum StopIn {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
pub(crate) struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Dynamo's request extensions (`nvext`): the ones read here.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct NvExt {
    #[serde(default)]
    router: Option<RouterHints>,
}

/// `nvext.router`: the latency the client asks for, milliseconds; a router choosing among
/// pools picks one run for it.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RouterHints {
    ttft_target: Option<f64>,
    itl_target: Option<f64>,
}

/// Fields both endpoints share. Unknown fields are ignored, as OpenAI clients send many.
/// What every generating body shares; the other dialects build one field by field (their
/// translation is typed, never a JSON body parsed again).
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Common {
    /// Optional where the server serves one model (vLLM and llama.cpp answer with it too).
    #[serde(default)]
    pub(crate) model: Option<String>,
    #[serde(default)]
    pub(crate) nvext: Option<NvExt>,
    #[serde(default)]
    pub(crate) stream: bool,
    pub(crate) stream_options: Option<StreamOptions>,
    pub(crate) max_tokens: Option<u32>,
    pub(crate) max_completion_tokens: Option<u32>,
    pub(crate) temperature: Option<f32>,
    pub(crate) top_p: Option<f32>,
    /// vLLM's extension: keep the k most likely tokens; 0 or -1 keeps all.
    pub(crate) top_k: Option<i64>,
    pub(crate) seed: Option<u64>,
    pub(crate) stop: Option<StopIn>,
    /// vLLM's extension: token ids that end the output.
    pub(crate) stop_token_ids: Option<Vec<u32>>,
    /// vLLM's extension: `false` keeps special tokens in the text.
    pub(crate) skip_special_tokens: Option<bool>,
    /// vLLM's extension: scheduling priority, lower first.
    pub(crate) priority: Option<i32>,
    /// OpenAI's end-user id: the session, for session affinity, when no `x-session-id` says.
    pub(crate) user: Option<String>,
    /// vLLM's extension: requests share cached prefixes only with requests of the same salt.
    pub(crate) cache_salt: Option<Value>,
    pub(crate) presence_penalty: Option<f32>,
    pub(crate) frequency_penalty: Option<f32>,
    /// vLLM's extensions.
    pub(crate) repetition_penalty: Option<f32>,
    pub(crate) min_p: Option<f32>,
    /// Token id (as a string, OpenAI's form) → bias in [-100, 100].
    pub(crate) logit_bias: Option<BTreeMap<String, f32>>,
    /// vLLM's extension: the prompt's and the answer's token ids in the response.
    pub(crate) return_token_ids: Option<bool>,
    pub(crate) n: Option<u32>,
    /// Chat: `true` for the answer's log-probabilities; completions: how many alternatives.
    pub(crate) logprobs: Option<Value>,
    /// Chat: how many alternatives per token (with `logprobs: true`).
    pub(crate) top_logprobs: Option<Value>,
    pub(crate) ignore_eos: Option<bool>,
    pub(crate) min_tokens: Option<u32>,
    pub(crate) tools: Option<Value>,
    pub(crate) tool_choice: Option<Value>,
    pub(crate) parallel_tool_calls: Option<bool>,
    /// Structured output: OpenAI's field, vLLM's, and vLLM's older `guided_*` fields.
    pub(crate) response_format: Option<Value>,
    pub(crate) structured_outputs: Option<Value>,
    pub(crate) guided_json: Option<Value>,
    pub(crate) guided_regex: Option<Value>,
    pub(crate) guided_choice: Option<Value>,
    pub(crate) guided_grammar: Option<Value>,
    /// Fields that change what a request means and that this server does not honour yet:
    /// refused by name, never dropped (an application that asks for a tool call or for JSON
    /// must not believe it got one).
    #[serde(flatten)]
    pub(crate) unsupported: BTreeMap<String, Value>,
}

/// The most choices one request may ask for (OpenAI allows 128; each is a sequence in the
/// engine).
pub(crate) const MAX_CHOICES: u32 = 16;
/// Prompts in one completions request, and choices over all of them, at most: each is a
/// request to the graph of its own.
pub(crate) const MAX_PROMPTS: usize = 64;

/// True for the values of a field that ask for nothing.
pub(crate) type AsksNothing = fn(&Value) -> bool;

/// The request fields [`refuse_unsupported`] looks at, each with the values that ask for
/// nothing (what clients send by default), so those still pass.
pub(crate) const UNSUPPORTED: &[(&str, AsksNothing)] = &[
    ("functions", empty),
    ("function_call", |v| {
        v.is_null() || v == "none" || v == "auto"
    }),
    // Completions: text after the insertion point, and choosing the best of several.
    ("suffix", |v| v.is_null() || v == ""),
    ("best_of", |v| v.is_null() || v.as_u64() == Some(1)),
    // What reasoning, audio and predicted-output models take (OpenAI refuses them for other
    // models too).
    ("reasoning_effort", Value::is_null),
    ("reasoning", Value::is_null),
    ("modalities", |v| {
        v.is_null() || *v == serde_json::json!(["text"])
    }),
    ("audio", Value::is_null),
    ("prediction", Value::is_null),
    ("web_search_options", Value::is_null),
    // vLLM's extensions that change the answer and are not built here.
    ("include_stop_str_in_output", |v| v.is_null() || *v == false),
    ("chat_template_kwargs", empty),
    ("add_generation_prompt", |v| v.is_null() || *v == true),
    ("continue_final_message", |v| v.is_null() || *v == false),
    ("prompt_logprobs", Value::is_null),
    ("truncate_prompt_tokens", Value::is_null),
    ("use_beam_search", |v| v.is_null() || *v == false),
    ("bad_words", empty),
    ("allowed_token_ids", empty),
    // Chat's echo (vLLM): only completions echo here.
    ("echo", |v| v.is_null() || *v == false),
];

/// Null, or an empty list or object.
pub(crate) fn empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}

/// A field from [`UNSUPPORTED`] that asks for something is a 400 naming it.
pub(crate) fn refuse_unsupported(fields: &BTreeMap<String, Value>) -> Result<(), ApiError> {
    refuse_fields(UNSUPPORTED, |name| fields.get(name))
}

/// A field of `list` that `get` finds asking for something is a 400 naming it (every
/// endpoint's fields that change an answer and are not built: refused, never dropped).
pub(crate) fn refuse_fields<'a>(
    list: &[(&str, AsksNothing)],
    get: impl Fn(&str) -> Option<&'a Value>,
) -> Result<(), ApiError> {
    for (name, asks_nothing) in list {
        if let Some(v) = get(name)
            && !asks_nothing(v)
        {
            return Err(ApiError::invalid(
                "unsupported_parameter",
                format!("`{name}` is not supported by this server yet"),
            )
            .with_param(*name));
        }
    }
    Ok(())
}

#[derive(Debug)]
pub(crate) enum ContentIn {
    Text(String),
    Parts(Vec<Part>),
}

/// By the JSON value's kind, not `#[serde(untagged)]`: an untagged enum buffers the value
/// first and copies a string twice, and a long conversation's contents are most of a body.
impl<'de> Deserialize<'de> for ContentIn {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Kind;
        impl<'de> serde::de::Visitor<'de> for Kind {
            type Value = ContentIn;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or a list of content parts")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ContentIn, E> {
                Ok(ContentIn::Text(v.to_owned()))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<ContentIn, E> {
                Ok(ContentIn::Text(v))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                seq: A,
            ) -> Result<ContentIn, A::Error> {
                Vec::deserialize(serde::de::value::SeqAccessDeserializer::new(seq))
                    .map(ContentIn::Parts)
            }
        }
        d.deserialize_any(Kind)
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct Part {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct MessageIn {
    pub(crate) role: String,
    pub(crate) content: Option<ContentIn>,
    /// An assistant turn's tool calls.
    #[serde(default)]
    pub(crate) tool_calls: Option<Value>,
    /// A tool result's call.
    #[serde(default)]
    pub(crate) tool_call_id: Option<String>,
    #[serde(default)]
    pub(crate) name: Option<String>,
}

impl MessageIn {
    /// A message of text alone.
    pub(crate) fn text(role: &str, text: String) -> Self {
        MessageIn {
            role: role.to_owned(),
            content: Some(ContentIn::Text(text)),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// An assistant turn's `tool_calls` as chat templates read them: each call's `arguments`
/// parsed from OpenAI's JSON string into an object (as vLLM and transformers do).
pub(crate) fn template_calls(v: Value, i: usize) -> Result<Value, ApiError> {
    let Value::Array(calls) = v else {
        return Err(invalid(
            format!("messages[{i}].tool_calls"),
            "tool_calls must be a list",
        ));
    };
    let mut out = Vec::with_capacity(calls.len());
    for (j, mut call) in calls.into_iter().enumerate() {
        let f = &mut call["function"];
        if !f["name"].is_string() {
            return Err(invalid(
                format!("messages[{i}].tool_calls[{j}].function.name"),
                "a tool call needs its function's name",
            ));
        }
        if let Some(s) = f["arguments"].as_str() {
            f["arguments"] = serde_json::from_str(s).map_err(|e| {
                invalid(
                    format!("messages[{i}].tool_calls[{j}].function.arguments"),
                    format!("arguments must be a JSON text: {e}"),
                )
            })?;
        }
        out.push(call);
    }
    Ok(Value::Array(out))
}

#[derive(Debug, Deserialize)]
pub(crate) struct ChatBody {
    pub(crate) messages: Vec<MessageIn>,
    #[serde(flatten)]
    pub(crate) common: Common,
}

#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "a string, a list of strings, a list of token ids, or a list of lists of token ids"
)]
pub(crate) enum PromptIn {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    /// OpenAI's "array of token arrays" (lm-evaluation-harness sends its batches so).
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
pub(crate) struct CompletionBody {
    prompt: PromptIn,
    #[serde(default)]
    echo: bool,
    #[serde(flatten)]
    common: Common,
}

/// `nvext.router`'s targets, each a positive number of milliseconds.
pub(crate) fn targets(ext: Option<NvExt>) -> Result<SlaTargets, ApiError> {
    let hints = ext.and_then(|e| e.router).unwrap_or_default();
    let ms = |name: &str, v: Option<f64>| match v {
        Some(x) if !(x.is_finite() && x > 0.0) => Err(invalid(
            format!("nvext.router.{name}"),
            format!("{name} must be a positive number of milliseconds, got {x}"),
        )),
        _ => Ok(v),
    };
    Ok(SlaTargets {
        ttft_ms: ms("ttft_target", hints.ttft_target)?,
        itl_ms: ms("itl_target", hints.itl_target)?,
    })
}

/// The checks that need no model: the model name and parameters this server never supports.
pub(crate) fn request(
    app: &App,
    endpoint: Endpoint,
    prompt: Prompt,
    c: Common,
) -> Result<(LlmRequest, Options), ApiError> {
    let (at, lora) = app.catalog.resolve_or_only(c.model.as_deref())?;
    let model = &app.served[at];
    refuse_unsupported(&c.unsupported)?;
    check_metadata(c.unsupported.get("metadata"))?;
    let mut constraint = constraint(&c)?;
    // A harmony model answers in channels: the structured answer goes in its `final` channel,
    // after the reasoning the model may write first (a raw Lark grammar stays as written).
    let harmony = model.tool_format == ToolFormat::Harmony && endpoint == Endpoint::Chat;
    if harmony && let Some(expr) = constraint.as_ref().and_then(dyn_llm::grammar::lark_expr) {
        constraint = Some(Constraint::Lark(crate::harmony::answer_grammar(&expr)));
    }
    let tools = ToolRequest::read(
        c.tools.as_ref(),
        c.tool_choice.as_ref(),
        c.parallel_tool_calls,
    )?;
    if tools.is_some() && endpoint == Endpoint::Completion {
        return Err(invalid("tools", "tools are for /v1/chat/completions"));
    }
    let forcing = tools.as_ref().is_some_and(ToolRequest::forcing);
    let parses = tools.as_ref().is_some_and(ToolRequest::parses);
    let forced = tools.as_ref().and_then(|t| t.forced(model.tool_format));
    if forcing && forced.is_none() {
        return Err(invalid(
            "tool_choice",
            format!(
                "this model writes tool calls in the {:?} format, which no grammar here can force; use tool_choice auto",
                model.tool_format
            ),
        ));
    }
    if let Some(forced) = forced {
        if constraint.is_some() {
            return Err(invalid(
                "tool_choice",
                "a forced tool call cannot be combined with response_format or structured_outputs",
            ));
        }
        constraint = Some(forced);
    }
    let n = c.n.unwrap_or(1);
    if !(1..=MAX_CHOICES).contains(&n) {
        return Err(invalid(
            "n",
            format!("n must be from 1 to {MAX_CHOICES}, got {n}"),
        ));
    }
    let logprobs = logprobs(endpoint, &c, app.server.max_logprobs)?;
    let constrained = constraint.is_some();
    let stop = match c.stop {
        None => Vec::new(),
        Some(StopIn::One(s)) => vec![s],
        Some(StopIn::Many(v)) => v,
    };
    let include_usage = c.stream_options.is_some_and(|o| o.include_usage);
    if include_usage && !c.stream {
        return Err(invalid(
            "stream_options",
            "stream_options is only allowed with stream: true",
        ));
    }
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => None,
        Some(k) => Some(u32::try_from(k).map_err(|_| {
            invalid(
                "top_k",
                format!("top_k must be -1, 0 or a positive count, got {k}"),
            )
        })?),
    };
    let in_range = |name: &str, v: Option<f32>, ok: std::ops::RangeInclusive<f32>| match v {
        Some(x) if !ok.contains(&x) => Err(invalid(
            name,
            format!(
                "{name} must be between {} and {}, got {x}",
                ok.start(),
                ok.end()
            ),
        )),
        _ => Ok(v),
    };
    let presence_penalty = in_range("presence_penalty", c.presence_penalty, -2.0..=2.0)?;
    let frequency_penalty = in_range("frequency_penalty", c.frequency_penalty, -2.0..=2.0)?;
    let min_p = in_range("min_p", c.min_p, 0.0..=1.0)?;
    let repetition_penalty = match c.repetition_penalty {
        Some(r) if !(r > 0.0 && r.is_finite()) => {
            return Err(invalid(
                "repetition_penalty",
                format!("repetition_penalty must be a positive number, got {r}"),
            ));
        }
        r => r,
    };
    let cache_salt = match c.cache_salt {
        None | Some(Value::Null) => None,
        Some(Value::String(salt)) => match dyn_protocol::types::cache_salt_problem(&salt) {
            Some(problem) => return Err(invalid("cache_salt", problem)),
            None => Some(salt),
        },
        Some(_) => return Err(invalid("cache_salt", "cache_salt must be a string")),
    };
    Ok((
        LlmRequest {
            endpoint,
            model: model.name.to_string(),
            prompt,
            sampling: Sampling {
                temperature: c.temperature,
                top_p: c.top_p,
                top_k,
                seed: c.seed,
                min_p,
                frequency_penalty,
                presence_penalty,
                repetition_penalty,
                logit_bias: logit_bias(c.logit_bias)?,
                logprobs,
                prompt_logprobs: None,
                constraint,
                embed: None,
            },
            routing: Routing {
                priority: c.priority.unwrap_or(0),
                // The router's word, never the client's.
                yields: false,
                tenant: None,
                session: c
                    .user
                    .filter(|u| !u.is_empty() && u.len() <= crate::SESSION_MAX),
                cache_salt,
                lora,
                targets: targets(c.nvext)?,
            },
            limits: Limits {
                max_tokens: c.max_completion_tokens.or(c.max_tokens),
                min_tokens: c.min_tokens,
                ignore_eos: c.ignore_eos.unwrap_or(false),
                stop,
                stop_token_ids: c.stop_token_ids.unwrap_or_default(),
                return_token_ids: c.return_token_ids.unwrap_or(false),
                // Tool and harmony markup is often special tokens (`[TOOL_CALLS]`,
                // `<|python_tag|>`, `<|channel|>`): the parsers must see them, as vLLM's
                // parsers ask for too.
                keep_special: c.skip_special_tokens == Some(false) || harmony || parses,
            },
            tools: tools.as_ref().map(|t| t.tools.clone()).unwrap_or_default(),
        },
        Options {
            named: c
                .model
                .as_deref()
                .map_or_else(|| model.name.clone(), Arc::from),
            stream: c.stream,
            include_usage,
            // Harmony's channels always need parsing, calls or not.
            tools: (parses || harmony).then_some(model.tool_format),
            logprobs: logprobs.is_some(),
            echo: None,
            n: n as usize,
            more_prompts: Vec::new(),
            token_ids: c.return_token_ids.unwrap_or(false),
            // A grammar shapes the answer from its first token, so an answer cannot start
            // inside a block the template opened (R1): all of it is the answer.
            reasoning: model.reasoning.filter(|f| {
                endpoint == Endpoint::Chat && !(constrained && *f == ReasoningFormat::DeepseekR1)
            }),
        },
    ))
}

/// How many alternatives a request wants with each token's log-probability (`None`: no
/// log-probabilities): chat's `logprobs: true` with `top_logprobs`, or completions'
/// `logprobs`, each at most `max` (the ingress's `max_logprobs`, 20 as vLLM's by default;
/// OpenAI's own bounds are 20 and 5).
pub(crate) fn logprobs(endpoint: Endpoint, c: &Common, max: u32) -> Result<Option<u32>, ApiError> {
    let max = u64::from(max);
    fn set(v: &Option<Value>) -> Option<&Value> {
        v.as_ref().filter(|v| !v.is_null())
    }
    let count = |name: &str, v: &Value, max: u64| match v.as_u64() {
        Some(n) if n <= max => Ok(n as u32),
        _ => Err(invalid(
            name,
            format!("{name} must be an integer from 0 to {max}, got {v}"),
        )),
    };
    match endpoint {
        Endpoint::Chat => {
            let on = match set(&c.logprobs) {
                None => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => {
                    return Err(invalid(
                        "logprobs",
                        format!("logprobs must be a boolean, got {v}"),
                    ));
                }
            };
            let top = set(&c.top_logprobs)
                .map(|v| count("top_logprobs", v, max))
                .transpose()?;
            match (on, top) {
                (false, Some(n)) if n > 0 => {
                    Err(invalid("top_logprobs", "top_logprobs needs logprobs: true"))
                }
                (false, _) => Ok(None),
                (true, top) => Ok(Some(top.unwrap_or(0))),
            }
        }
        Endpoint::Completion => {
            if set(&c.top_logprobs).is_some() {
                return Err(invalid(
                    "top_logprobs",
                    "top_logprobs is a chat parameter; completions take logprobs: N",
                ));
            }
            // `logprobs: false` is what some clients send for "none".
            match set(&c.logprobs) {
                None | Some(Value::Bool(false)) => Ok(None),
                Some(v) => count("logprobs", v, max).map(Some),
            }
        }
    }
}

/// OpenAI's `logit_bias` (token ids as strings, biases in [-100, 100]), sorted by token id.
pub(crate) fn logit_bias(m: Option<BTreeMap<String, f32>>) -> Result<Vec<(u32, f32)>, ApiError> {
    let mut out = Vec::new();
    for (k, bias) in m.unwrap_or_default() {
        let id = k.trim().parse::<u32>().map_err(|_| {
            invalid(
                "logit_bias",
                format!("logit_bias keys must be token ids, got {k:?}"),
            )
        })?;
        if !(-100.0..=100.0).contains(&bias) {
            return Err(invalid(
                "logit_bias",
                format!("the bias of token {id} must be between -100 and 100, got {bias}"),
            ));
        }
        out.push((id, bias));
    }
    out.sort_by_key(|b| b.0);
    Ok(out)
}

/// The structured output a request asks for, from whichever field it used (at most one).
pub(crate) fn constraint(c: &Common) -> Result<Option<Constraint>, ApiError> {
    let mut found: Vec<(&str, Constraint)> = Vec::new();
    if let Some(v) = c.response_format.as_ref().filter(|v| !v.is_null())
        && let Some(k) = response_format(v)?
    {
        found.push(("response_format", k));
    }
    if let Some(v) = c.structured_outputs.as_ref().filter(|v| !v.is_null()) {
        let o = v
            .as_object()
            .ok_or_else(|| invalid("structured_outputs", "structured_outputs must be an object"))?;
        for (k, v) in o {
            let param = format!("structured_outputs.{k}");
            match k.as_str() {
                "json" | "regex" | "choice" | "grammar" => {
                    found.push(("structured_outputs", guided(k, v, &param)?))
                }
                "json_object" if v == &Value::Bool(true) => {
                    found.push(("structured_outputs", Constraint::JsonObject))
                }
                "json_object"
                | "disable_fallback"
                | "disable_any_whitespace"
                | "disable_additional_properties"
                | "whitespace_pattern" => {}
                _ => {
                    return Err(ApiError::invalid(
                        "unsupported_parameter",
                        format!("`{param}` is not supported by this server (json, regex, choice, grammar, json_object are)"),
                    )
                    .with_param(param));
                }
            }
        }
    }
    for (name, v) in [
        ("guided_json", &c.guided_json),
        ("guided_regex", &c.guided_regex),
        ("guided_choice", &c.guided_choice),
        ("guided_grammar", &c.guided_grammar),
    ] {
        if let Some(v) = v.as_ref().filter(|v| !v.is_null()) {
            found.push((name, guided(&name["guided_".len()..], v, name)?));
        }
    }
    match found.len() {
        0 | 1 => Ok(found.pop().map(|(_, c)| c)),
        _ => Err(invalid(
            found[1].0,
            "a request may ask for one structured output (one of response_format, structured_outputs, guided_*)",
        )),
    }
}

/// OpenAI's `response_format`: `text` (no constraint), `json_object` or `json_schema`.
pub(crate) fn response_format(v: &Value) -> Result<Option<Constraint>, ApiError> {
    match v["type"].as_str() {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonObject)),
        Some("json_schema") => {
            let schema = &v["json_schema"]["schema"];
            if schema.is_object() || schema.is_boolean() {
                Ok(Some(Constraint::JsonSchema(schema.clone())))
            } else {
                Err(invalid(
                    "response_format.json_schema.schema",
                    "response_format json_schema needs `json_schema.schema`, a JSON Schema object",
                ))
            }
        }
        other => Err(invalid(
            "response_format.type",
            format!(
                "response_format type must be text, json_object or json_schema, got {}",
                other.map_or_else(|| v["type"].to_string(), |t| format!("{t:?}"))
            ),
        )),
    }
}

/// vLLM's `json` (a schema, or a schema as a string), `regex`, `choice` or `grammar` (Lark).
pub(crate) fn guided(kind: &str, v: &Value, param: &str) -> Result<Constraint, ApiError> {
    let text = || {
        v.as_str()
            .map(str::to_owned)
            .ok_or_else(|| invalid(param, format!("`{param}` must be a string")))
    };
    Ok(match kind {
        "json" => match v {
            Value::String(s) => Constraint::JsonSchema(
                serde_json::from_str(s)
                    .map_err(|e| invalid(param, format!("`{param}` is not JSON: {e}")))?,
            ),
            _ => Constraint::JsonSchema(v.clone()),
        },
        "regex" => Constraint::Regex(text()?),
        "grammar" => Constraint::Lark(text()?),
        _ => {
            let options: Vec<String> = serde_json::from_value(v.clone())
                .map_err(|_| invalid(param, format!("`{param}` must be a list of strings")))?;
            if options.is_empty() {
                return Err(invalid(param, format!("`{param}` must not be empty")));
            }
            Constraint::Choice(options)
        }
    })
}

/// A chat completions body given as JSON — what the other dialects translate theirs into —
/// read as `/v1/chat/completions` reads its own.
/// The request a chat body (parsed, or built by another dialect's translation) means.
pub(crate) fn chat_from_body(app: &App, b: ChatBody) -> Result<(LlmRequest, Options), ApiError> {
    let messages = chat_messages(b.messages)?;
    request(app, Endpoint::Chat, Prompt::Messages(messages), b.common)
}

/// How many tokens the prompt of a chat body (its `model`, `messages` and `tools`) is, the
/// template applied with its generation prompt.
pub(crate) async fn count_prompt(app: &App, b: ChatBody) -> Result<usize, ApiError> {
    let served = app.tokenizer_of(b.common.model.as_deref())?;
    let prompt = Prompt::Messages(chat_messages(b.messages)?);
    let tools = match b.common.tools {
        Some(Value::Array(tools)) => tools,
        _ => Vec::new(),
    };
    let ids = served
        .preprocess
        .tokenize(prompt, &tools, None, true)
        .await
        .map_err(ApiError::from)?;
    Ok(ids.len())
}

pub(crate) fn chat_request(app: &App, body: &[u8]) -> Result<(LlmRequest, Options), ApiError> {
    let b: ChatBody = crate::parse_json(body)?;
    let messages = chat_messages(b.messages)?;
    request(app, Endpoint::Chat, Prompt::Messages(messages), b.common)
}

/// A chat body's messages as the template takes them: text content (text parts joined),
/// assistant tool calls, tool results.
pub(crate) fn chat_messages(raw: Vec<MessageIn>) -> Result<Vec<ChatMessage>, ApiError> {
    let mut messages = Vec::with_capacity(raw.len());
    for (i, m) in raw.into_iter().enumerate() {
        if m.role == "function" {
            return Err(ApiError::invalid(
                "unsupported_parameter",
                "the legacy `function` role is not supported; use `tool` messages",
            )
            .with_param(format!("messages[{i}].role")));
        }
        let tool_calls = match m.tool_calls {
            Some(v) if !empty(&v) => Some(template_calls(v, i)?),
            _ => None,
        };
        let content = match m.content {
            None => String::new(),
            Some(ContentIn::Text(t)) => t,
            Some(ContentIn::Parts(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(t)) => text.push_str(&t),
                        (kind, _) => {
                            return Err(invalid(
                                format!("messages[{i}].content"),
                                format!(
                                    "content parts of type `{kind}` are not supported; only `text`"
                                ),
                            ));
                        }
                    }
                }
                text
            }
        };
        messages.push(ChatMessage {
            role: m.role,
            content,
            tool_calls,
            tool_call_id: m.tool_call_id,
            name: m.name,
        });
    }
    Ok(messages)
}

pub(crate) fn completion_request(
    app: &App,
    body: &[u8],
) -> Result<(LlmRequest, Options), ApiError> {
    let b: CompletionBody = crate::parse_json(body)?;
    // Several prompts are answered as several choices, each prompt's `n` after the
    // previous prompt's (as vLLM answers; lm-evaluation-harness sends its batches so).
    let prompts: Vec<Prompt> = match b.prompt {
        PromptIn::Text(t) => vec![Prompt::Text(t)],
        PromptIn::Texts(v) => v.into_iter().map(Prompt::Text).collect(),
        PromptIn::Tokens(t) => vec![Prompt::Tokens(t)],
        PromptIn::TokenLists(v) => v.into_iter().map(Prompt::Tokens).collect(),
    };
    if prompts.is_empty() || prompts.len() > MAX_PROMPTS {
        return Err(invalid(
            "prompt",
            format!(
                "a request takes 1 to {MAX_PROMPTS} prompts, got {}",
                prompts.len()
            ),
        ));
    }
    let echo: Option<Vec<Option<String>>> = b.echo.then(|| {
        prompts
            .iter()
            .map(|p| match p {
                Prompt::Text(t) => Some(t.clone()),
                _ => None,
            })
            .collect()
    });
    let mut prompts = prompts.into_iter();
    let first = prompts.next().unwrap_or(Prompt::Text(String::new()));
    let (mut req, mut opts) = request(app, Endpoint::Completion, first, b.common)?;
    opts.more_prompts = prompts.collect();
    if opts.total() > MAX_PROMPTS {
        return Err(invalid(
            "n",
            format!("prompts × n is at most {MAX_PROMPTS}, got {}", opts.total()),
        ));
    }
    if let Some(texts) = &echo {
        // The prompt's log-probabilities come with echo and logprobs (lm-evaluation-harness's
        // log-likelihoods); a prompt of token ids needs the engine's word for its text too.
        if opts.logprobs || texts.iter().any(Option::is_none) {
            req.sampling.prompt_logprobs = Some(req.sampling.logprobs.unwrap_or(0));
        }
        opts.echo = echo;
    }
    Ok((req, opts))
}

// ---- handlers ------------------------------------------------------------------------------

/// OpenAI's bounds on `metadata` (Responses, chat completions): at most 16 pairs, keys of at
/// most 64 characters, values strings of at most 512. A stored response keeps it, so
/// without them one request could store megabytes.
pub(crate) fn check_metadata(metadata: Option<&serde_json::Value>) -> Result<(), ApiError> {
    const PAIRS: usize = 16;
    const KEY: usize = 64;
    const VALUE: usize = 512;
    let bad = |param: String, why: String| invalid(param, why);
    let m = match metadata {
        None | Some(serde_json::Value::Null) => return Ok(()),
        Some(serde_json::Value::Object(m)) => m,
        Some(_) => {
            return Err(bad(
                "metadata".into(),
                "metadata must be an object of strings".into(),
            ));
        }
    };
    if m.len() > PAIRS {
        return Err(bad(
            "metadata".into(),
            format!("metadata may have at most {PAIRS} pairs, got {}", m.len()),
        ));
    }
    for (k, v) in m {
        // The key is not repeated back: it may be the long one.
        if k.chars().count() > KEY {
            return Err(bad(
                "metadata".into(),
                format!("metadata keys may be at most {KEY} characters"),
            ));
        }
        match v {
            serde_json::Value::String(v) if v.chars().count() <= VALUE => {}
            serde_json::Value::String(_) => {
                return Err(bad(
                    format!("metadata.{k}"),
                    format!("metadata values may be at most {VALUE} characters"),
                ));
            }
            _ => {
                return Err(bad(
                    format!("metadata.{k}"),
                    "metadata values must be strings".into(),
                ));
            }
        }
    }
    Ok(())
}
