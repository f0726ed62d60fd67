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

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::answer::{self, Event};
use super::{ApiError, KeyTenant, MAX_STORED_RESPONSE_BYTES, invalid};
use crate::app::{App, Store};
use crate::openai::request as openai;
use crate::pipeline;

mod output;
mod translation;

use output::*;
use translation::*;

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
/// request's session (whose ids are bounded alike, [`crate::SESSION_MAX`]).
const MAX_USER: usize = crate::SESSION_MAX;

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
    let parsed = openai::chat_from_body(&app, chat);
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
    use crate::tools::ToolCall;

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
        // The messages the typed translation makes are those the chat dialect reads from the
        // chat body that means the same.
        let same: Vec<openai::MessageIn> = serde_json::from_value(json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "system", "content": "Use tools."},
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "weather", "arguments": "{\"city\":\"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
        ]))
        .unwrap();
        // The stored conversation has no instructions (they are not carried over).
        assert_eq!(t.messages.len(), 6);
        let c = &t.chat.common;
        assert_eq!(
            c.tools,
            Some(
                json!([{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}, "strict": true}}])
            )
        );
        assert_eq!(
            c.tool_choice,
            Some(json!({"type": "function", "function": {"name": "weather"}}))
        );
        assert_eq!(
            c.response_format
                .as_ref()
                .map(|f| &f["json_schema"]["schema"]),
            Some(&json!({"type": "object"}))
        );
        assert_eq!(c.max_tokens, Some(20));
        assert_eq!(
            openai::chat_messages(t.chat.messages).unwrap(),
            openai::chat_messages(same).unwrap()
        );
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
