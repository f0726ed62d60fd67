//! Reasoning separated from the answer: models that think in `<think>…</think>` before they
//! answer (Qwen3, DeepSeek R1, SmolLM3) get their thinking in chat's `reasoning_content` and
//! only the answer in `content`, streamed as it comes, as vLLM and SGLang return it.
//!
//! Two shapes exist. Qwen3-style models open the block themselves (`<think>` is the first
//! thing they write, or nothing when thinking is off); DeepSeek R1-style templates end the
//! prompt with `<think>`, so the answer starts inside the block and only `</think>` shows. The
//! parser holds back text only while it may be the start of a tag, so a partial tag never
//! reaches the client and other text is never delayed.

use serde::Deserialize;

use crate::pieces::held;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// How a model writes its reasoning (`model.reasoning_parser` in a graph).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReasoningFormat {
    /// `<think>…</think>` at the start of the answer, when the model thinks.
    Qwen3,
    /// The answer starts inside a block the template opened; reasoning runs to `</think>`.
    DeepseekR1,
}

impl ReasoningFormat {
    /// The format a chat template implies: none unless it mentions `<think>`; R1's when its
    /// generation prompt (the text the template adds for the answer) opens the block.
    pub fn detect(template: Option<&str>, generation_prompt: Option<&str>) -> Option<Self> {
        if !template.is_some_and(|t| t.contains(OPEN)) {
            return None;
        }
        let opens = generation_prompt.is_some_and(|g| {
            let g = g.trim_end();
            g.ends_with(OPEN)
        });
        Some(if opens {
            ReasoningFormat::DeepseekR1
        } else {
            ReasoningFormat::Qwen3
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet: the answer may still open a block.
    Start,
    Reasoning,
    Answer,
}

/// Text split into reasoning and answer, incrementally.
#[derive(Debug)]
pub struct ReasoningParser {
    state: State,
    /// Without an opening tag the answer starts as reasoning (R1: the template opened it).
    inside: bool,
    buf: String,
}

/// What a piece of text turned out to be.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

impl ReasoningParser {
    pub fn new(format: ReasoningFormat) -> Self {
        Self {
            // Both start by looking for an opening tag: some R1 distills write it anyway.
            state: State::Start,
            inside: format == ReasoningFormat::DeepseekR1,
            buf: String::new(),
        }
    }

    /// The next piece of the answer's text; what can be told apart so far.
    pub fn push(&mut self, text: &str) -> Split {
        self.feed(text, false)
    }

    /// The answer ended: whatever was held back, as what it was.
    pub fn finish(&mut self) -> Split {
        self.feed("", true)
    }

    /// [`ReasoningParser::push`], and with `end` [`ReasoningParser::finish`] too.
    pub fn feed(&mut self, text: &str, end: bool) -> Split {
        self.buf.push_str(text);
        let mut out = Split::default();
        self.step(&mut out, end);
        out
    }

    fn step(&mut self, out: &mut Split, end: bool) {
        loop {
            match self.state {
                State::Start => {
                    let t = self.buf.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.buf = rest.to_owned();
                        self.state = State::Reasoning;
                    } else if !end && (t.is_empty() || OPEN.starts_with(t)) {
                        return;
                    } else {
                        self.state = if self.inside {
                            State::Reasoning
                        } else {
                            State::Answer
                        };
                    }
                }
                State::Reasoning => {
                    if let Some(at) = self.buf.find(CLOSE) {
                        out.reasoning.push_str(&self.buf[..at]);
                        self.buf.drain(..at + CLOSE.len());
                        self.state = State::Answer;
                    } else {
                        let keep = if end { 0 } else { held(&self.buf, CLOSE) };
                        out.reasoning.push_str(&self.buf[..self.buf.len() - keep]);
                        self.buf.drain(..self.buf.len() - keep);
                        return;
                    }
                }
                State::Answer => {
                    out.content.push_str(&self.buf);
                    self.buf.clear();
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Answers as the models write them (Qwen3's and R1's model cards and chat templates).
    fn cases() -> Vec<(ReasoningFormat, &'static str, &'static str, &'static str)> {
        use ReasoningFormat::*;
        vec![
            (
                Qwen3,
                "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
                "\nThe user greets me.\n",
                "\n\nHello! How can I help?",
            ),
            // Thinking off: the template wrote an empty block, the answer has none.
            (
                Qwen3,
                "Hello! How can I help?",
                "",
                "Hello! How can I help?",
            ),
            (Qwen3, "<thin is not a tag", "", "<thin is not a tag"),
            (
                Qwen3,
                "a <think> later is text",
                "",
                "a <think> later is text",
            ),
            (
                DeepseekR1,
                "Okay, 2 + 2 < 5 and </thin is text.\n</think>\n\nIt is 4.",
                "Okay, 2 + 2 < 5 and </thin is text.\n",
                "\n\nIt is 4.",
            ),
            (DeepseekR1, "<think>x</think>y", "x", "y"),
            // Cut off while thinking: all of it was reasoning.
            (
                DeepseekR1,
                "still thinking </thi",
                "still thinking </thi",
                "",
            ),
        ]
    }

    fn parse(format: ReasoningFormat, chunks: &[&str]) -> Split {
        let mut p = ReasoningParser::new(format);
        let mut all = Split::default();
        let mut splits: Vec<Split> = chunks.iter().map(|c| p.push(c)).collect();
        splits.push(p.finish());
        for c in splits {
            all.reasoning.push_str(&c.reasoning);
            all.content.push_str(&c.content);
        }
        all
    }

    #[test]
    fn whole_answers_split_into_reasoning_and_content() {
        for (format, text, reasoning, content) in cases() {
            let got = parse(format, &[text]);
            assert_eq!(
                (got.reasoning.as_str(), got.content.as_str()),
                (reasoning, content),
                "{text}"
            );
        }
    }

    proptest! {
        #[test]
        fn every_split_gives_what_the_whole_text_gives(
            case in 0usize..7,
            cuts in proptest::collection::vec(0usize..100, 0..8),
        ) {
            let (format, text, reasoning, content) = cases().swap_remove(case);
            let got = parse(format, &crate::tools::tests::split_at(text, cuts));
            prop_assert_eq!(got.reasoning, reasoning);
            prop_assert_eq!(got.content, content);
        }
    }

    #[test]
    fn a_tag_is_never_streamed_and_nothing_else_waits() {
        let mut p = ReasoningParser::new(ReasoningFormat::Qwen3);
        assert_eq!(p.push("<thi"), Split::default());
        let s = p.push("nk>Let me see</th");
        assert_eq!(
            (s.reasoning.as_str(), s.content.as_str()),
            ("Let me see", "")
        );
        let s = p.push("ink>Yes");
        assert_eq!((s.reasoning.as_str(), s.content.as_str()), ("", "Yes"));
    }

    #[test]
    fn the_format_is_detected_from_the_template() {
        let qwen3 = "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}";
        assert_eq!(
            ReasoningFormat::detect(Some(qwen3), Some("<|im_start|>assistant\n")),
            Some(ReasoningFormat::Qwen3)
        );
        assert_eq!(
            ReasoningFormat::detect(
                Some("{{'<｜Assistant｜><think>\\n'}}"),
                Some("<｜Assistant｜><think>\n")
            ),
            Some(ReasoningFormat::DeepseekR1)
        );
        assert_eq!(
            ReasoningFormat::detect(Some("{{ messages }}"), Some("x")),
            None
        );
        assert_eq!(ReasoningFormat::detect(None, None), None);
    }
}
