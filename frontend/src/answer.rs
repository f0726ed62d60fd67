//! One generated answer as parsed pieces — reasoning, text, tool calls, then its end. [`Feed`]
//! is the one place a choice's text meets the reasoning and tool-call parsers, delta by delta:
//! chat's and completions' server-sent events, their unary answers, and the endpoints whose
//! wire forms are not chat completions' (Anthropic's Messages, OpenAI's Responses, through
//! [`events`]) all feed it. Those translate their bodies into a chat request, start it as chat
//! does ([`start`](crate::pipeline::start)), and render the pieces as their own events.

use futures::{Stream, StreamExt};

use dyn_protocol::types::{FinishReason, Usage};

use super::ApiError;
use super::reasoning::ReasoningParser;
use super::tools::{Piece, ToolCall, ToolParser};
use crate::pipeline::{Options, Started};

/// What one choice's text goes through: reasoning split out first, then tool calls parsed
/// out of the rest, each as the request asked. Without either, text passes as it came.
pub(crate) struct Feed {
    reasoning: Option<ReasoningParser>,
    tools: Option<ToolParser>,
    /// Calls parsed out so far: the answer's finish reason is `tool_calls` after one.
    calls: usize,
}

impl Feed {
    pub(crate) fn new(opts: &Options) -> Self {
        Self {
            reasoning: opts.reasoning.map(ReasoningParser::new),
            tools: opts.tools.map(ToolParser::new),
            calls: 0,
        }
    }

    /// Whether tool calls are parsed out (text then passes only as the parser releases it).
    pub(crate) fn parses_tools(&self) -> bool {
        self.tools.is_some()
    }

    /// The pieces a delta's text releases, in order; `last` on the choice's final delta
    /// flushes what the parsers held back. Empty text is no piece.
    pub(crate) fn feed(&mut self, text: String, last: bool) -> Vec<Piece> {
        let mut pieces = Vec::new();
        let text = match &mut self.reasoning {
            Some(p) => {
                let split = p.feed(&text, last);
                if !split.reasoning.is_empty() {
                    pieces.push(Piece::Reasoning(split.reasoning));
                }
                split.content
            }
            None => text,
        };
        match &mut self.tools {
            Some(parser) => {
                pieces.extend(parser.push(&text));
                if last {
                    pieces.extend(parser.finish());
                }
                self.calls += pieces
                    .iter()
                    .filter(|p| matches!(p, Piece::Call(_)))
                    .count();
            }
            None if text.is_empty() => {}
            None => pieces.push(Piece::Text(text)),
        }
        pieces
    }

    /// Calls parsed out so far.
    pub(crate) fn calls(&self) -> usize {
        self.calls
    }

    /// The choice's finish reason: `tool_calls` once it made a call, else the engine's.
    pub(crate) fn finish(&self, engine: FinishReason) -> FinishReason {
        if self.calls > 0 {
            FinishReason::ToolCalls
        } else {
            engine
        }
    }
}

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
    let mut feed = Feed::new(opts);
    async_stream::stream! {
        let mut next = first;
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
            for piece in feed.feed(d.text, d.finish.is_some()) {
                yield match piece {
                    Piece::Text(t) => Event::Text(t),
                    Piece::Reasoning(r) => Event::Reasoning(r),
                    Piece::Call(c) => Event::Call(c),
                };
            }
            if let Some(f) = d.finish {
                guards.into_iter().for_each(dyn_core::ctx::KillOnDrop::disarm);
                track.finish("success");
                yield Event::End(Ending {
                    finish: feed.finish(f),
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
