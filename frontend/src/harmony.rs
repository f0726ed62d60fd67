//! OpenAI's harmony format (gpt-oss): the answer is a run of messages, each a header and a
//! body written between special tokens, and one parse gives all three things a chat answer
//! carries: reasoning (the `analysis` channel), the answer (`final`, or `commentary` addressed
//! to no one: a preamble) and tool calls (a message addressed `to=functions.NAME`):
//!
//! ```text
//! <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
//! ```
//!
//! The recipient may also stand before the channel (`<|start|>assistant to=functions.f<|channel|>…`),
//! and `<|call|>` and `<|return|>` end the answer (they are eos tokens, so they rarely reach
//! the text). This mapping is vLLM's. The special tokens reach the parser because the frontend
//! asks postprocess to keep them for harmony models. Text is held back only while it may be
//! the start of a marker; a message's body streams as it comes, except a call's arguments,
//! which go out whole, as the other formats' calls do.

use crate::pieces::{Piece, ToolCall, held};

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const CONSTRAIN: &str = "<|constrain|>";
/// What ends a message's body.
const ENDS: [&str; 4] = ["<|end|>", "<|call|>", "<|return|>", START];

/// The optional reasoning message a grammar lets a harmony model write first, as vLLM's
/// structural tags for gpt-oss do: the model reasons before it answers or calls.
const ANALYSIS: &str = "analysis: <|channel|> \"analysis\" <|message|> THINKING <|end|> <|start|> \"assistant\"\nTHINKING: /(.|\\n)*/";

/// A grammar for an answer in the `final` channel that matches `answer` (a Lark expression
/// and the definitions it refers to, [`dyn_llm::grammar::lark_expr`]): `response_format` for
/// a harmony model.
pub fn answer_grammar((answer, defs): &(String, String)) -> String {
    format!(
        "start: analysis? <|channel|> \"final\" <|message|> answer\nanswer: {answer}\n{ANALYSIS}\n{defs}"
    )
}

/// A grammar for one call of one of `tools` (name, parameters schema): a forced
/// `tool_choice`. A harmony answer holds one call at most (`<|call|>` ends it).
pub fn call_grammar(tools: &[(&str, serde_json::Value)]) -> String {
    let alts: Vec<String> = tools
        .iter()
        .map(|(name, params)| {
            let mut schema = params.clone();
            schema["x-guidance"] = dyn_llm::grammar::compact_json();
            let head = serde_json::to_string(&format!("commentary to=functions.{name} "))
                .unwrap_or_default();
            format!("<|channel|> {head} <|constrain|> \"json\" <|message|> %json {schema}")
        })
        .collect();
    format!(
        "start: analysis? call\ncall: {}\n{ANALYSIS}",
        alts.join(" | ")
    )
}

/// Where a message's body goes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Body {
    Reasoning,
    Content,
    /// A call to this function: the arguments are collected whole.
    Call(String),
    /// Addressed to a tool that is not a function (a built-in): not the client's to see.
    Ignored,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Reading a header, up to `<|message|>`.
    Header,
    Body(Body),
    /// The model wrote text that is not harmony (a grammar shaped it, say): all of it is the
    /// answer.
    Plain,
}

/// Splits streamed harmony text into reasoning, answer text and calls ([`HarmonyParser::push`]
/// each delta, then [`HarmonyParser::finish`]).
#[derive(Debug)]
pub struct HarmonyParser {
    state: State,
    buf: String,
}

impl Default for HarmonyParser {
    fn default() -> Self {
        Self {
            state: State::Header,
            buf: String::new(),
        }
    }
}

impl HarmonyParser {
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.step(&mut out, false);
        out
    }

    /// The answer ended: a body cut short still counts (a call's arguments as they stand).
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        self.step(&mut out, true);
        out
    }

    fn step(&mut self, out: &mut Vec<Piece>, end: bool) {
        loop {
            match &self.state {
                State::Plain => {
                    push_text(out, std::mem::take(&mut self.buf));
                    return;
                }
                State::Header => {
                    if let Some(at) = self.buf.find(MESSAGE) {
                        let body = body_of(&self.buf[..at]);
                        self.buf.drain(..at + MESSAGE.len());
                        self.state = State::Body(body);
                    } else if !looks_like_header(&self.buf) {
                        self.state = State::Plain;
                    } else {
                        // An unfinished header at the end says nothing: dropped.
                        if end {
                            self.buf.clear();
                        }
                        return;
                    }
                }
                State::Body(body) => {
                    let found = ENDS
                        .iter()
                        .filter_map(|m| self.buf.find(m).map(|at| (at, m.len())))
                        .min();
                    let (take, skip, done) = match found {
                        Some((at, len)) => {
                            // `<|start|>` opens the next message's header: keep it there.
                            let skip = if self.buf[at..].starts_with(START) {
                                0
                            } else {
                                len
                            };
                            (at, skip, true)
                        }
                        None if end => (self.buf.len(), 0, true),
                        None => {
                            let keep = ENDS.iter().map(|m| held(&self.buf, m)).max();
                            (self.buf.len() - keep.unwrap_or(0), 0, false)
                        }
                    };
                    match body {
                        Body::Reasoning if take > 0 => {
                            out.push(Piece::Reasoning(self.buf[..take].to_owned()));
                        }
                        Body::Content => push_text(out, self.buf[..take].to_owned()),
                        Body::Call(name) if done => out.push(Piece::Call(ToolCall {
                            name: name.clone(),
                            arguments: self.buf[..take].trim().to_owned(),
                        })),
                        // Arguments wait for their end.
                        Body::Call(_) => return,
                        Body::Reasoning | Body::Ignored => {}
                    }
                    self.buf.drain(..take + skip);
                    if !done {
                        return;
                    }
                    self.state = State::Header;
                    if end && self.buf.is_empty() {
                        return;
                    }
                }
            }
        }
    }
}

fn push_text(out: &mut Vec<Piece>, text: String) {
    if !text.is_empty() {
        out.push(Piece::Text(text));
    }
}

/// Whether `buf` may still be (the start of) a message header: it begins with a marker, a
/// role or ` to=`; anything else is plain text.
fn looks_like_header(buf: &str) -> bool {
    let t = buf.trim_start();
    let starts = [START, CHANNEL, CONSTRAIN, "to=", "assistant"];
    t.is_empty() || starts.iter().any(|s| t.starts_with(s) || s.starts_with(t))
}

/// A header's destination: `<|start|>assistant to=functions.f<|channel|>commentary json`, in
/// any of the orders gpt-oss writes.
fn body_of(header: &str) -> Body {
    let header = header.split(CONSTRAIN).next().unwrap_or_default();
    let mut channel = "";
    let mut recipient = None;
    for (i, part) in header.split(CHANNEL).enumerate() {
        let mut words = part.split_whitespace();
        if i > 0 {
            channel = words.next().unwrap_or_default();
        }
        for w in words {
            if let Some(r) = w.strip_prefix("to=") {
                recipient = Some(r);
            }
        }
    }
    match recipient {
        Some(r) if r.starts_with("functions.") && r.len() > "functions.".len() => {
            Body::Call(r["functions.".len()..].to_owned())
        }
        Some(_) => Body::Ignored,
        None if channel == "analysis" => Body::Reasoning,
        // `final`, and `commentary` to no one (a preamble the user may see).
        None if channel == "final" || channel == "commentary" => Body::Content,
        None => Body::Ignored,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Reasoning, text and calls, pieces of a kind merged.
    fn parse(chunks: &[&str]) -> (String, String, Vec<ToolCall>) {
        let mut p = HarmonyParser::default();
        let mut pieces: Vec<Piece> = chunks.iter().flat_map(|c| p.push(c)).collect();
        pieces.extend(p.finish());
        let (mut r, mut t, mut calls) = (String::new(), String::new(), Vec::new());
        for piece in pieces {
            match piece {
                Piece::Reasoning(s) => r += &s,
                Piece::Text(s) => t += &s,
                Piece::Call(c) => calls.push(c),
            }
        }
        (r, t, calls)
    }

    /// Answers as gpt-oss writes them (OpenAI's harmony guide): a final answer, a call with the
    /// recipient in either place, a preamble before a call, a built-in tool.
    const ANSWER: &str = "<|channel|>analysis<|message|>User asks: \"What is 2 + 2?\" Simple arithmetic. Provide answer.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.";
    const CALL: &str = "<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\":\"San Francisco\"}";
    const CALL_ROLE: &str = "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"location\": \"Tokyo\"}<|call|>";
    const PREAMBLE: &str = "<|channel|>analysis<|message|>Two lookups.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking both cities.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\":\"Paris\"}<|call|>";
    const BUILTIN: &str = "<|channel|>analysis<|message|>Search it.<|end|><|start|>assistant<|channel|>analysis to=browser.search code<|message|>{\"query\":\"x\"}<|call|>";

    fn call(name: &str, args: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: args.into(),
        }
    }

    #[test]
    fn channels_become_reasoning_answer_and_calls() {
        assert_eq!(
            parse(&[ANSWER]),
            (
                "User asks: \"What is 2 + 2?\" Simple arithmetic. Provide answer.".into(),
                "2 + 2 = 4.".into(),
                vec![]
            )
        );
        assert_eq!(
            parse(&[CALL]),
            (
                "Need to use function get_weather.".into(),
                String::new(),
                vec![call("get_weather", "{\"location\":\"San Francisco\"}")]
            )
        );
        assert_eq!(
            parse(&[CALL_ROLE]),
            (
                String::new(),
                String::new(),
                vec![call("get_weather", "{\"location\": \"Tokyo\"}")]
            )
        );
        assert_eq!(
            parse(&[PREAMBLE]),
            (
                "Two lookups.".into(),
                "Checking both cities.".into(),
                vec![call("get_weather", "{\"location\":\"Paris\"}")]
            )
        );
        assert_eq!(
            parse(&[BUILTIN]),
            ("Search it.".into(), String::new(), vec![])
        );
    }

    #[test]
    fn text_that_is_not_harmony_is_the_answer() {
        // What a grammar shapes (a bare JSON answer), or a model that ignores the format.
        assert_eq!(
            parse(&["{\"a\": ", "1}"]),
            (String::new(), "{\"a\": 1}".into(), vec![])
        );
        assert_eq!(
            parse(&["<", "b>hi"]),
            (String::new(), "<b>hi".into(), vec![])
        );
    }

    #[test]
    fn bodies_stream_and_hold_back_only_a_possible_marker() {
        let mut p = HarmonyParser::default();
        assert_eq!(
            p.push("<|channel|>final<|message|>Hel"),
            vec![Piece::Text("Hel".into())]
        );
        assert_eq!(p.push("lo <|"), vec![Piece::Text("lo ".into())]);
        assert_eq!(p.push("x"), vec![Piece::Text("<|x".into())]);
        assert_eq!(p.finish(), vec![]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn any_split_gives_what_the_whole_text_gives(
            which in 0usize..5,
            cuts in proptest::collection::vec(0usize..400, 0..8),
        ) {
            let text = [ANSWER, CALL, CALL_ROLE, PREAMBLE, BUILTIN][which];
            let chunks = crate::tools::tests::split_at(text, cuts);
            prop_assert_eq!(parse(&chunks), parse(&[text]));
        }
    }
}
