//! vLLM's tokenizer routes: `POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`,
//! served with each model's own tokenizer and chat template (so lm-evaluation-harness and
//! other clients need no local copy of the model's files).

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use dyn_protocol::types::Prompt;
use serde::Deserialize;
use serde_json::{Value, json};

use super::{ApiError, invalid};
use crate::app::{App, Served};
use crate::openai::request::{MessageIn, chat_messages, empty};

/// vLLM's `/tokenize` body: a completion's `prompt` or a chat's `messages`.
#[derive(Debug, Deserialize)]
struct TokenizeBody {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Vec<MessageIn>>,
    #[serde(default)]
    add_special_tokens: Option<bool>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    continue_final_message: bool,
    #[serde(default)]
    return_token_strs: Option<bool>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    chat_template: Option<Value>,
    #[serde(default)]
    chat_template_kwargs: Option<Value>,
    #[serde(default)]
    mm_processor_kwargs: Option<Value>,
    #[serde(default)]
    media_io_kwargs: Option<Value>,
}

/// vLLM's `/detokenize` body.
#[derive(Debug, Deserialize)]
struct DetokenizeBody {
    #[serde(default)]
    model: Option<String>,
    tokens: Vec<u64>,
}

impl App {
    /// The model a `/tokenize`-style body names (an adapter reads as its base), or the first.
    pub(crate) fn tokenizer_of(&self, model: Option<&str>) -> Result<&Served, ApiError> {
        match model {
            None => Ok(&self.served[0]),
            Some(m) => Ok(&self.served[self.catalog.resolve(m)?.0]),
        }
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct TokenizerInfoQuery {
    model: Option<String>,
}

/// `GET /tokenizer_info` (vLLM's): what a client needs to tokenize as the server does through
/// `/tokenize` and `/detokenize` — the special tokens' text and the chat template
/// (lm-evaluation-harness's remote tokenizer reads it, where it would otherwise need the
/// model's files from a hub). `?model=` picks a model where several are served.
pub(crate) async fn tokenizer_info(
    State(app): State<App>,
    query: Result<
        axum::extract::Query<TokenizerInfoQuery>,
        axum::extract::rejection::QueryRejection,
    >,
) -> Response {
    let model = match query {
        Ok(q) => q.0.model,
        Err(e) => return invalid("model", format!("invalid query: {e}")).into_response(),
    };
    let served = match app.tokenizer_of(model.as_deref()) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let dir = served.preprocess.model();
    Json(json!({
        "model": &*served.name,
        // A Hugging Face `tokenizer.json` (or a GGUF vocabulary read as one).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": dir.bos_token,
        "eos_token": dir.eos_token,
        "pad_token": null,
        "chat_template": dir.chat_template,
        "model_max_length": dir.context_length,
        "vocab_size": dir.vocab_size,
    }))
    .into_response()
}

/// `POST /tokenize` (vLLM's): the prompt's tokens as the model reads it, the chat template
/// applied to messages.
pub(crate) async fn tokenize(
    State(app): State<App>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match tokenize_answer(&app, body).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn tokenize_answer(
    app: &App,
    body: Result<Bytes, BytesRejection>,
) -> Result<Value, ApiError> {
    let body = body.map_err(super::body_error)?;
    let b: TokenizeBody = super::parse_json(&body)?;
    let served = app.tokenizer_of(b.model.as_deref())?;
    if b.chat_template.is_some() {
        return Err(ApiError::invalid(
            "unsupported_parameter",
            "chat_template is not supported: the model's own template is applied",
        )
        .with_param("chat_template"));
    }
    // vLLM's other options: asked for, they are refused rather than ignored.
    for (name, v) in [
        ("chat_template_kwargs", &b.chat_template_kwargs),
        ("mm_processor_kwargs", &b.mm_processor_kwargs),
        ("media_io_kwargs", &b.media_io_kwargs),
    ] {
        if v.as_ref().is_some_and(|v| !empty(v)) {
            return Err(ApiError::invalid(
                "unsupported_parameter",
                format!("{name} is not supported"),
            )
            .with_param(name));
        }
    }
    if b.continue_final_message {
        return Err(ApiError::invalid(
            "unsupported_parameter",
            "continue_final_message is not supported",
        )
        .with_param("continue_final_message"));
    }
    let prompt = match (b.prompt, b.messages) {
        (Some(p), None) => Prompt::Text(p),
        (None, Some(m)) => Prompt::Messages(chat_messages(m)?),
        _ => {
            return Err(ApiError::invalid(
                "invalid_request",
                "give either `prompt` (a string) or `messages`",
            ));
        }
    };
    let p = &served.preprocess;
    let tools = b.tools.unwrap_or_default();
    let ids = p
        .tokenize(
            prompt,
            &tools,
            b.add_special_tokens,
            b.add_generation_prompt.unwrap_or(true),
        )
        .await
        .map_err(ApiError::from)?;
    let strs = b
        .return_token_strs
        .unwrap_or(false)
        .then(|| p.token_strs(&ids));
    Ok(json!({
        "count": ids.len(),
        "max_model_len": p.context_length(),
        "tokens": ids,
        "token_strs": strs,
    }))
}

/// `POST /detokenize` (vLLM's): the tokens' text, special tokens kept.
pub(crate) async fn detokenize(
    State(app): State<App>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match detokenize_answer(&app, body) {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

fn detokenize_answer(app: &App, body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let body = body.map_err(super::body_error)?;
    let b: DetokenizeBody = super::parse_json(&body)?;
    let served = app.tokenizer_of(b.model.as_deref())?;
    let ids: Vec<u32> = b
        .tokens
        .iter()
        .map(|&t| u32::try_from(t))
        .collect::<Result<_, _>>()
        .map_err(|_| invalid("tokens", "token ids are below 2^32"))?;
    let text = served.preprocess.detokenize(&ids).map_err(ApiError::from)?;
    Ok(json!({"prompt": text}))
}
