//! What the answer parsers cut a model's text into ([`Piece`]: text, tool calls, reasoning),
//! shared by the tool-call parsers ([`crate::tools`]), harmony's ([`crate::harmony`]) and the
//! reasoning parsers ([`crate::reasoning`]), and the one rule they hold text back by
//! ([`held`]).

/// A call parsed from the model's text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as JSON text (OpenAI's wire form).
    pub arguments: String,
}

/// A piece of the answer: text for `content`, a call, or (harmony, whose messages carry
/// both) reasoning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    Call(ToolCall),
    Reasoning(String),
}

/// How many bytes at the end of `buf` are a proper prefix of `marker` (text held back, since
/// the marker may be arriving).
pub(crate) fn held(buf: &str, marker: &str) -> usize {
    (1..marker.len().min(buf.len() + 1))
        .rev()
        .find(|&n| buf.is_char_boundary(buf.len() - n) && marker.starts_with(&buf[buf.len() - n..]))
        .unwrap_or(0)
}
