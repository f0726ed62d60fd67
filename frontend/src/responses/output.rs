//! A response's output items as the answer's events arrive: `reasoning`, `message`
//! (`output_text`) and `function_call` items, streamed as the Responses events or kept whole
//! ([`Output`]).

use axum::body::Bytes;
use dyn_protocol::types::FinishReason;
use serde_json::{Value, json};

use crate::ApiError;
use crate::answer::{Ending, Event};
use crate::tools::ToolCall;

use super::translation::Meta;

/// A response's status from how its answer ended.
pub(super) fn status(end: &Ending) -> &'static str {
    if end.finish == FinishReason::Length {
        "incomplete"
    } else {
        "completed"
    }
}

/// The output item open in a stream.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Open {
    Reasoning,
    Message,
}

/// Builds a response's output items from its answer's events, and (streaming) the Responses
/// events that tell a client so, numbered.
pub(super) struct Output<'a> {
    pub(super) meta: &'a Meta,
    pub(super) streaming: bool,
    /// Finished items.
    pub(super) items: Vec<Value>,
    /// The open item and its text so far.
    pub(super) open: Option<(Open, String)>,
    pub(super) text: String,
    pub(super) calls: Vec<ToolCall>,
    pub(super) sequence: u64,
    /// Events not yet sent.
    pub(super) pending: Vec<Bytes>,
}

impl<'a> Output<'a> {
    pub(super) fn new(meta: &'a Meta, streaming: bool) -> Self {
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

    pub(super) fn emit(&mut self, kind: &str, mut data: Value) {
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
    pub(super) fn open_id(&self, kind: Open) -> String {
        let prefix = match kind {
            Open::Reasoning => "rs",
            Open::Message => "msg",
        };
        self.meta.item_id(prefix, self.items.len())
    }

    pub(super) fn item(&self, kind: Open, text: &str, status: &str) -> Value {
        let id = self.open_id(kind);
        match kind {
            Open::Reasoning => json!({"type": "reasoning", "id": id,
                "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": status}),
            Open::Message => json!({"type": "message", "id": id,
                "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}),
        }
    }

    pub(super) fn open(&mut self, kind: Open) {
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

    pub(super) fn delta(&mut self, kind: Open, delta: String) {
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

    pub(super) fn close(&mut self) {
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

    pub(super) fn call(&mut self, c: ToolCall) {
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

    pub(super) fn feed(&mut self, e: Event) {
        match e {
            Event::Text(t) => self.delta(Open::Message, t),
            Event::Reasoning(r) => self.delta(Open::Reasoning, r),
            Event::Call(c) => self.call(c),
            Event::End(_) | Event::Failed(_) => {}
        }
    }

    /// The answer is over: close what is open (an answer with nothing in it still gets its
    /// empty message).
    pub(super) fn end(&mut self) {
        if self.items.is_empty() && self.open.is_none() {
            self.open(Open::Message);
        }
        self.close();
    }

    /// The answer as the assistant turn of the conversation stored with it. A call whose
    /// arguments are not JSON (a model writing calls without a grammar) is kept with none, so
    /// the next turn's template can still read it.
    pub(super) fn turn(&self) -> Value {
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
pub(super) fn failed(out: &mut Output<'_>, e: &ApiError) {
    let mut r = out.meta.object("failed", &out.items, None);
    r["error"] = json!({"code": e.code, "message": e.message});
    out.emit("response.failed", json!({"response": r}));
}
