//! OpenAI's `POST /v1/embeddings` on the `http` ingress.
//!
//! Each input (a string, or token ids; one or a list) runs down the graph as a request of its
//! own whose sampling asks for an embedding ([`Sampling::embed`], with the model's pooling):
//! the engine computes the prompt in its batches beside everything else and answers with the
//! final hidden states pooled and normalised, sampling nothing. Up to 64 inputs run at once,
//! so the engine's scheduler batches them; the answer lists them in order, as floats or as base64
//! (little-endian f32, OpenAI's `encoding_format: base64`). External workers ask their
//! server's own `/v1/embeddings` (vLLM's pooling runner, llama-server with `--embeddings`).
//! Where there are no embeddings (a simulated engine, a pooling dyn does not compute) the
//! request is refused with a 400 naming why.
//!
//! [`Sampling::embed`]: dyn_protocol::types::Sampling::embed

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use dyn_protocol::types::Prompt;
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{ApiError, KeyTenant, invalid};
use crate::app::App;
use crate::pipeline::{self, Options, Started};
use dyn_protocol::types::{Endpoint, Limits, LlmRequest, Routing, Sampling};

/// The most inputs one request may carry (OpenAI's limit).
const MAX_INPUTS: usize = 2048;

/// Inputs of one request running at once (an engine's batch holds 64 sequences by default).
const IN_FLIGHT: usize = 64;

#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "a string, a list of strings, a list of token ids, or a list of lists of token ids"
)]
enum InputIn {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
struct EmbeddingsBody {
    model: String,
    input: InputIn,
    #[serde(default)]
    encoding_format: Option<String>,
    #[serde(default)]
    dimensions: Option<u32>,
    #[serde(default)]
    user: Option<String>,
    /// OpenAI's body has no other field: any other that asks for something is refused.
    #[serde(flatten)]
    other: serde_json::Map<String, Value>,
}

/// The inputs as prompts; empty ones are refused (OpenAI refuses them too).
fn prompts(input: InputIn) -> Result<Vec<Prompt>, ApiError> {
    let prompts: Vec<Prompt> = match input {
        InputIn::Text(t) => vec![Prompt::Text(t)],
        InputIn::Texts(v) => v.into_iter().map(Prompt::Text).collect(),
        InputIn::Tokens(t) => vec![Prompt::Tokens(t)],
        InputIn::TokenLists(v) => v.into_iter().map(Prompt::Tokens).collect(),
    };
    if prompts.is_empty() {
        return Err(invalid("input", "input must not be empty"));
    }
    if prompts.len() > MAX_INPUTS {
        return Err(invalid(
            "input",
            format!(
                "at most {MAX_INPUTS} inputs per request, got {}",
                prompts.len()
            ),
        ));
    }
    if let Some(i) = prompts.iter().position(|p| match p {
        Prompt::Text(t) => t.is_empty(),
        Prompt::Tokens(t) => t.is_empty(),
        _ => false,
    }) {
        return Err(invalid(format!("input[{i}]"), "an input must not be empty"));
    }
    Ok(prompts)
}

/// `POST /v1/embeddings`.
pub(crate) async fn create(
    State(app): State<App>,
    key: Option<Extension<KeyTenant>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match answer(&app, key.map(|k| k.0), &headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/embeddings`'s answer: the list and its usage, serialised straight from the
/// vectors (a `serde_json::Value` per float would cost tens of bytes each).
#[derive(Serialize)]
struct Answer<'a> {
    object: &'static str,
    data: Vec<Datum<'a>>,
    model: &'a str,
    usage: Counted,
}

#[derive(Serialize)]
struct Datum<'a> {
    object: &'static str,
    index: usize,
    embedding: Vector<'a>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Vector<'a> {
    Floats(&'a [f32]),
    /// Little-endian f32, base64 (OpenAI's `encoding_format: base64`).
    Base64(String),
}

#[derive(Serialize)]
struct Counted {
    prompt_tokens: u64,
    total_tokens: u64,
}

async fn answer(
    app: &App,
    key: Option<KeyTenant>,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(super::body_error)?;
    let b: EmbeddingsBody = super::parse_json(&body)?;
    if let Some((name, _)) = b.other.iter().find(|(_, v)| !v.is_null()) {
        return Err(ApiError::invalid(
            "unsupported_parameter",
            format!("`{name}` is not supported by this server"),
        )
        .with_param(name.clone()));
    }
    let base64 = match b.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(invalid(
                "encoding_format",
                format!("encoding_format must be float or base64, got {other:?}"),
            ));
        }
    };
    // Only a model that was trained to (Matryoshka) may be cut short: these are not.
    let own_width = || {
        invalid(
            "dimensions",
            format!(
                "model `{}` embeds in its own width only; leave dimensions out",
                b.model
            ),
        )
    };
    if let Some(d) = b.dimensions
        && embedding_width(app, &b.model)?.is_some_and(|w| w != d)
    {
        return Err(own_width());
    }
    let prompts = prompts(b.input)?;
    // What the model cannot do is one error, before anything runs.
    embedding_request(app, &b.model, Prompt::Tokens(Vec::new()), None)?;
    // One context for the request (its deadline counts from now), a part per input; up to a
    // batch's worth in flight (the engine batches them; all of a large request at once would
    // fill its queue). The first failure ends the request, and the inputs still running with it.
    let parent = pipeline::request_ctx(app, headers)?;
    let key = key.as_ref();
    let runs = prompts.into_iter().enumerate().map(|(i, prompt)| {
        let parsed = embedding_request(app, &b.model, prompt, b.user.as_deref());
        let parent = &parent;
        async move {
            let started =
                pipeline::start_part(app, "embeddings", key, headers, parsed, Some((parent, i)));
            embedding(started.await?.0).await
        }
    });
    let done: Vec<(Vec<f32>, u32)> = futures::stream::iter(runs)
        .buffered(IN_FLIGHT)
        .try_collect()
        .await?;
    if let Some(d) = b.dimensions
        && done.first().is_some_and(|(v, _)| v.len() != d as usize)
    {
        return Err(own_width());
    }
    let data = done
        .iter()
        .enumerate()
        .map(|(index, (v, _))| Datum {
            object: "embedding",
            index,
            embedding: match base64 {
                true => {
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    Vector::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
                }
                false => Vector::Floats(v),
            },
        })
        .collect();
    let tokens = done.iter().map(|(_, t)| u64::from(*t)).sum();
    Ok(Json(Answer {
        object: "list",
        data,
        model: &b.model,
        usage: Counted {
            prompt_tokens: tokens,
            total_tokens: tokens,
        },
    })
    .into_response())
}

/// A started embeddings run's vector and its prompt's tokens.
async fn embedding(started: Started) -> Result<(Vec<f32>, u32), ApiError> {
    let Started {
        first,
        mut out,
        guards,
        mut track,
        ..
    } = started;
    let mut next = first;
    while let Some((_, item)) = next.take() {
        let d = match item {
            Ok(d) => d,
            Err(e) => {
                track.finish("error");
                return Err(ApiError::from(e));
            }
        };
        track.delta(&d);
        if let Some(v) = d.embedding {
            guards
                .into_iter()
                .for_each(dyn_core::ctx::KillOnDrop::disarm);
            track.finish("success");
            return Ok((v, d.usage.map_or(0, |u| u.prompt_tokens)));
        }
        if d.finish.is_some() {
            break;
        }
        next = out.next().await;
    }
    track.finish("error");
    Err(ApiError::from(dyn_core::OpError::internal(
        "the engine answered an embeddings request without its vector",
    )))
}

/// One input of an embeddings request, for `model` (an adapter's name runs its adapter): the
/// model's pooling, nothing sampled.
pub(crate) fn embedding_request(
    app: &App,
    model: &str,
    prompt: Prompt,
    user: Option<&str>,
) -> Result<(LlmRequest, Options), ApiError> {
    let (at, lora) = app.catalog.resolve(model)?;
    let served = &app.served[at];
    let pooling = served.preprocess.pooling().map_err(|why| {
        invalid(
            "model",
            format!("model `{model}` has no embeddings here: {why}"),
        )
    })?;
    Ok((
        LlmRequest {
            endpoint: Endpoint::Completion,
            model: served.name.to_string(),
            prompt,
            sampling: Sampling {
                embed: Some(pooling),
                ..Sampling::default()
            },
            routing: Routing {
                lora,
                session: user
                    .filter(|u| !u.is_empty() && u.len() <= crate::SESSION_MAX)
                    .map(str::to_owned),
                ..Routing::default()
            },
            limits: Limits::default(),
            tools: Vec::new(),
        },
        Options {
            named: model.into(),
            stream: false,
            include_usage: false,
            tools: None,
            logprobs: false,
            echo: None,
            n: 1,
            more_prompts: Vec::new(),
            token_ids: false,
            reasoning: None,
        },
    ))
}

/// The width of `model`'s embeddings, where its config says.
pub(crate) fn embedding_width(app: &App, model: &str) -> Result<Option<u32>, ApiError> {
    let (at, _) = app.catalog.resolve(model)?;
    Ok(app.served[at].preprocess.hidden_size())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn inputs_of_every_shape_become_prompts_and_empty_ones_are_refused() {
        let read = |v: Value| prompts(serde_json::from_value(v).unwrap());
        assert_eq!(read(json!("a")).unwrap(), vec![Prompt::Text("a".into())]);
        assert_eq!(read(json!(["a", "b"])).unwrap().len(), 2);
        assert_eq!(
            read(json!([1, 2])).unwrap(),
            vec![Prompt::Tokens(vec![1, 2])]
        );
        assert_eq!(read(json!([[1], [2, 3]])).unwrap().len(), 2);
        assert_eq!(read(json!([])).unwrap_err().param.as_deref(), Some("input"));
        assert_eq!(
            read(json!(["a", ""])).unwrap_err().param.as_deref(),
            Some("input[1]")
        );
        let many: Vec<String> = (0..=MAX_INPUTS).map(|i| i.to_string()).collect();
        assert!(read(json!(many)).is_err());
    }
}
