//! One generated answer as parsed pieces — reasoning, text, tool calls, then its end — for
//! the endpoints whose wire forms are not chat completions' (Anthropic's Messages, OpenAI's
//! Responses). They translate their bodies into a chat request, start it as chat does
//! ([`start`](crate::pipeline::start)), and render these pieces as their own events; the
//! reasoning and tool-call parsing is chat's, fed the same way.

use futures::{Stream, StreamExt};

use dyn_protocol::types::{FinishReason, Usage};

use super::ApiError;
use super::reasoning::ReasoningParser;
use super::tools::{Piece, ToolCall, ToolParser};
use crate::pipeline::{Options, Started};

/// A piece of one answer, in the order the client should see them.
#[derive(Debug)]
pub(crate) enum Event {
    Text(String),
    Reasoning(String),
    Call(ToolCall),
    /// The answer is over (nothing follows).
    End(Ending),
    /// The answer failed part way (nothing follows).
    Failed(ApiError),
}

/// How an answer ended.
#[derive(Debug, Clone)]
pub(crate) struct Ending {
    /// `ToolCalls` when the answer made calls.
    pub finish: FinishReason,
    pub usage: Usage,
    /// The stop string that ended it, if one did.
    pub stop_string: Option<String>,
}

/// The events of a request's one choice. The request counts as a success once its end is
/// out; dropping the stream before (the client left) kills it in the graph.
pub(crate) fn events(started: Started, opts: &Options) -> impl Stream<Item = Event> + Send + use<> {
    let Started {
        first,
        mut out,
        guards,
        mut track,
        ..
    } = started;
    let mut reasoning = opts.reasoning.map(ReasoningParser::new);
    let mut tools = opts.tools.map(ToolParser::new);
    async_stream::stream! {
        let mut next = first;
        let mut calls = 0usize;
        while let Some((_, item)) = next.take() {
            let d = match item {
                Ok(d) => d,
                Err(e) => {
                    track.finish("error");
                    yield Event::Failed(ApiError::from(e));
                    return;
                }
            };
            track.delta(&d);
            let last = d.finish.is_some();
            let mut text = d.text;
            if let Some(p) = &mut reasoning {
                let split = p.feed(&text, last);
                if !split.reasoning.is_empty() {
                    yield Event::Reasoning(split.reasoning);
                }
                text = split.content;
            }
            let pieces = match &mut tools {
                Some(parser) => {
                    let mut pieces = parser.push(&text);
                    if last {
                        pieces.extend(parser.finish());
                    }
                    pieces
                }
                None if text.is_empty() => Vec::new(),
                None => vec![Piece::Text(text)],
            };
            for piece in pieces {
                yield match piece {
                    Piece::Text(t) => Event::Text(t),
                    Piece::Reasoning(r) => Event::Reasoning(r),
                    Piece::Call(c) => {
                        calls += 1;
                        Event::Call(c)
                    }
                };
            }
            if let Some(f) = d.finish {
                guards.into_iter().for_each(dyn_core::ctx::KillOnDrop::disarm);
                track.finish("success");
                yield Event::End(Ending {
                    finish: if calls > 0 { FinishReason::ToolCalls } else { f },
                    usage: d.usage.unwrap_or_default(),
                    stop_string: d.stop_string,
                });
                return;
            }
            next = out.next().await;
        }
        // Nothing more came and no finish: the request was dropped under us.
        track.finish("error");
        yield Event::Failed(ApiError::from(dyn_core::OpError::internal(
            "the answer ended without a finish reason",
        )));
    }
}

/// A whole answer, for the unary forms.
#[derive(Debug, Default)]
pub(crate) struct Whole {
    pub reasoning: String,
    pub text: String,
    pub calls: Vec<ToolCall>,
}

/// Gather `events` into one answer and its end.
pub(crate) async fn collect(
    events: impl Stream<Item = Event>,
) -> Result<(Whole, Ending), ApiError> {
    let mut w = Whole::default();
    let mut events = std::pin::pin!(events);
    while let Some(e) = events.next().await {
        match e {
            Event::Text(t) => w.text.push_str(&t),
            Event::Reasoning(r) => w.reasoning.push_str(&r),
            Event::Call(c) => w.calls.push(c),
            Event::End(end) => return Ok((w, end)),
            Event::Failed(e) => return Err(e),
        }
    }
    Err(ApiError::from(dyn_core::OpError::internal(
        "the answer ended without a finish reason",
    )))
}
