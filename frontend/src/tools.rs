//! Tool calling in the frontend: reading a request's `tools` and `tool_choice`, forcing a
//! call with a grammar when the client requires one, and parsing the calls out of the model's
//! text, streamed, in the format the model was trained to emit.
//!
//! Formats ([`ToolFormat`]): Hermes/Qwen (`<tool_call>{"name", "arguments"}</tool_call>`, any
//! number, text around them), Llama 3's JSON (the whole answer is `{"name", "parameters"}`,
//! optionally after `<|python_tag|>`), and Mistral's (`[TOOL_CALLS]` then a JSON list of calls).
//! The format is detected from the chat template, Hermes where the template says nothing.
//!
//! Streaming holds back only text that may still be the start of a call (a prefix of the
//! opening marker, or the first characters of a Llama 3 answer), so no markup reaches the
//! client, and text that only looked like a call is released as text. `required` and a named
//! `tool_choice` become a Lark grammar in the model's format whose arguments are the tool's
//! JSON Schema: the engine then cannot produce anything but a valid call.

use dyn_protocol::types::{CallForm, Calls, Constraint};
use serde_json::{Value, json};

use super::{ApiError, invalid};

/// How a model writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
    Mistral,
    /// A Python list of calls, `[get_weather(city="Paris")]` (Llama 3.2 and Llama 4).
    Pythonic,
    /// DeepSeek V3's `<｜tool▁calls▁begin｜>…` blocks.
    DeepseekV3,
    /// OpenAI's harmony messages (gpt-oss), which carry reasoning too ([`super::harmony`]).
    Harmony,
}

impl From<dyn_core::ToolParserName> for ToolFormat {
    fn from(n: dyn_core::ToolParserName) -> Self {
        match n {
            dyn_core::ToolParserName::Hermes => ToolFormat::Hermes,
            dyn_core::ToolParserName::Llama3Json => ToolFormat::Llama3Json,
            dyn_core::ToolParserName::Mistral => ToolFormat::Mistral,
            dyn_core::ToolParserName::Pythonic => ToolFormat::Pythonic,
            dyn_core::ToolParserName::DeepseekV3 => ToolFormat::DeepseekV3,
            dyn_core::ToolParserName::Harmony => ToolFormat::Harmony,
        }
    }
}

impl ToolFormat {
    /// The format a chat template renders tool calls in; Hermes (the most common, and what
    /// the forcing grammar uses) when the template does not say.
    pub fn detect(template: Option<&str>) -> Self {
        let t = template.unwrap_or("");
        if t.contains(HARMONY_CHANNEL) {
            ToolFormat::Harmony
        } else if t.contains("[TOOL_CALLS]") {
            ToolFormat::Mistral
        } else if t.contains(DEEPSEEK_OPEN) {
            ToolFormat::DeepseekV3
        } else if t.contains(PYTHON_START) || t.contains("[func_name1(") {
            ToolFormat::Pythonic
        } else if t.contains("<tool_call>") {
            ToolFormat::Hermes
        } else if t.contains("<|python_tag|>") || t.contains("ipython") {
            ToolFormat::Llama3Json
        } else {
            ToolFormat::Hermes
        }
    }
}

/// What `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A request's tools, checked.
#[derive(Debug, Clone)]
pub struct ToolRequest {
    /// OpenAI's tool objects, as sent (the chat template reads them).
    pub tools: Vec<Value>,
    pub choice: ToolChoice,
    pub parallel: bool,
}

/// A tool's name and parameters schema.
fn function(tool: &Value) -> (&str, Value) {
    let f = &tool["function"];
    let params = match &f["parameters"] {
        Value::Null => json!({"type": "object"}),
        p => p.clone(),
    };
    (f["name"].as_str().unwrap_or(""), params)
}

impl ToolRequest {
    /// `tools`, `tool_choice` and `parallel_tool_calls` as a client sent them; `None` when no
    /// tools are offered or `tool_choice` is `none`.
    pub fn read(
        tools: Option<&Value>,
        choice: Option<&Value>,
        parallel: Option<bool>,
    ) -> Result<Option<Self>, ApiError> {
        let tools: Vec<Value> = match tools {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a.clone(),
            Some(_) => return Err(invalid("tools", "tools must be a list")),
        };
        for (i, t) in tools.iter().enumerate() {
            if t["type"] != "function" {
                return Err(invalid(
                    format!("tools[{i}].type"),
                    "only tools of type `function` are supported",
                ));
            }
            let name = t["function"]["name"].as_str().unwrap_or("");
            if name.is_empty() {
                return Err(invalid(
                    format!("tools[{i}].function.name"),
                    "a function needs a name",
                ));
            }
            let p = &t["function"]["parameters"];
            if !(p.is_null() || p.is_object()) {
                return Err(invalid(
                    format!("tools[{i}].function.parameters"),
                    "parameters must be a JSON Schema object",
                ));
            }
        }
        let choice = match choice {
            None | Some(Value::Null) => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => ToolChoice::None,
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                other => {
                    return Err(invalid(
                        "tool_choice",
                        format!(
                            "tool_choice must be none, auto, required or a function, got {other:?}"
                        ),
                    ));
                }
            },
            Some(v) => match v["function"]["name"].as_str() {
                Some(name) if v["type"] == "function" => ToolChoice::Named(name.to_owned()),
                _ => {
                    return Err(invalid(
                        "tool_choice",
                        "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": …}}",
                    ));
                }
            },
        };
        if tools.is_empty() {
            return match choice {
                ToolChoice::None | ToolChoice::Auto => Ok(None),
                _ => Err(invalid("tool_choice", "tool_choice needs tools")),
            };
        }
        if let ToolChoice::Named(n) = &choice
            && !tools.iter().any(|t| function(t).0 == n)
        {
            return Err(invalid(
                "tool_choice",
                format!("tool_choice names `{n}`, which is not among the tools"),
            ));
        }
        Ok(Some(Self {
            tools,
            choice,
            parallel: parallel.unwrap_or(true),
        }))
    }

    /// Whether the answer is parsed for calls.
    pub fn parses(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The choice forces a call (`required`, or a named function).
    pub fn forcing(&self) -> bool {
        matches!(self.choice, ToolChoice::Required | ToolChoice::Named(_))
    }

    /// The grammar that forces a call (`required`, or a named function), in `format`.
    pub fn forced(&self, format: ToolFormat) -> Option<Constraint> {
        let allowed: Vec<(&str, Value)> = match &self.choice {
            ToolChoice::Required => self.tools.iter().map(function).collect(),
            ToolChoice::Named(n) => self
                .tools
                .iter()
                .map(function)
                .filter(|(name, _)| name == n)
                .collect(),
            ToolChoice::None | ToolChoice::Auto => return None,
        };
        // Python's keyword syntax has no JSON Schema grammar: those calls are not forced
        // (`None`; the frontend refuses such a tool_choice).
        match format {
            ToolFormat::Pythonic => return None,
            ToolFormat::Harmony => {
                return Some(Constraint::Lark(super::harmony::call_grammar(&allowed)));
            }
            _ => {}
        }
        let args = if format == ToolFormat::Llama3Json {
            "parameters"
        } else {
            "arguments"
        };
        // Each tool's parameters sit inside the call's schema: their `$defs` move to its root
        // and their local references follow, as grammar engines resolve them from the root.
        let mut defs = serde_json::Map::new();
        let one = allowed.len() == 1;
        let calls: Vec<Value> = allowed
            .iter()
            .enumerate()
            .map(|(i, (name, params))| {
                let at = if one {
                    format!("/properties/{args}")
                } else {
                    format!("/anyOf/{i}/properties/{args}")
                };
                let params = rehome(params, i, &at, &mut defs);
                json!({
                    "type": "object",
                    "properties": {"name": {"const": name}, args: params},
                    "required": ["name", args],
                    "additionalProperties": false,
                })
            })
            .collect();
        let mut schema = if one {
            calls.into_iter().next().unwrap_or_default()
        } else {
            json!({"anyOf": calls})
        };
        if !defs.is_empty() {
            schema["$defs"] = Value::Object(defs);
        }
        let whole = |before: &str, after: &str| {
            vec![CallForm {
                before: before.into(),
                schema: schema.clone(),
                after: after.into(),
            }]
        };
        // More calls after the first only where the client allows parallel calls.
        let sep = |sep: &str| self.parallel.then(|| sep.to_string());
        let calls = match format {
            ToolFormat::Hermes => Calls {
                open: String::new(),
                close: String::new(),
                sep: sep("\n"),
                forms: whole("<tool_call>\n", "\n</tool_call>"),
            },
            ToolFormat::Llama3Json => Calls {
                open: String::new(),
                close: String::new(),
                sep: None,
                forms: whole("", ""),
            },
            ToolFormat::Mistral => Calls {
                open: "[TOOL_CALLS][".into(),
                close: "]".into(),
                sep: sep(", "),
                forms: whole("", ""),
            },
            ToolFormat::Pythonic | ToolFormat::Harmony => return None,
            // DeepSeek names the function outside the JSON: one form per tool, its arguments
            // in JSON.
            ToolFormat::DeepseekV3 => Calls {
                open: DEEPSEEK_OPEN.into(),
                close: DEEPSEEK_CLOSE.into(),
                sep: sep(""),
                forms: allowed
                    .iter()
                    .map(|(name, params)| CallForm {
                        before: format!("{DEEPSEEK_CALL}function{DEEPSEEK_SEP}{name}\n```json\n"),
                        schema: params.clone(),
                        after: format!("\n```{DEEPSEEK_CALL_END}"),
                    })
                    .collect(),
            },
        };
        Some(Constraint::Calls(calls))
    }
}

/// Tool `i`'s parameters to be placed at JSON pointer `at` inside a larger schema: its `$defs`
/// (or `definitions`) go into `defs` as `t{i}-NAME`, and its local `$ref`s are rewritten to
/// resolve from the larger schema's root.
fn rehome(params: &Value, i: usize, at: &str, defs: &mut serde_json::Map<String, Value>) -> Value {
    fn walk(v: &mut Value, i: usize, at: &str) {
        match v {
            Value::Object(o) => {
                if let Some(Value::String(r)) = o.get_mut("$ref")
                    && let Some(rest) = r.strip_prefix('#')
                {
                    let moved = ["/$defs/", "/definitions/"]
                        .iter()
                        .find_map(|p| rest.strip_prefix(p));
                    *r = match moved {
                        Some(def) => format!("#/$defs/t{i}-{def}"),
                        None => format!("#{at}{rest}"),
                    };
                }
                o.values_mut().for_each(|v| walk(v, i, at));
            }
            Value::Array(a) => a.iter_mut().for_each(|v| walk(v, i, at)),
            _ => {}
        }
    }
    let mut params = params.clone();
    if let Value::Object(o) = &mut params {
        for key in ["$defs", "definitions"] {
            if let Some(Value::Object(found)) = o.remove(key) {
                for (name, mut def) in found {
                    walk(&mut def, i, at);
                    defs.insert(format!("t{i}-{name}"), def);
                }
            }
        }
    }
    walk(&mut params, i, at);
    params
}

use crate::pieces::held;
pub use crate::pieces::{Piece, ToolCall};

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_OPEN: &str = "[TOOL_CALLS]";
const PYTHON_TAG: &str = "<|python_tag|>";
const PYTHON_START: &str = "<|python_start|>";
const PYTHON_END: &str = "<|python_end|>";
const DEEPSEEK_OPEN: &str = "<｜tool▁calls▁begin｜>";
const DEEPSEEK_CLOSE: &str = "<｜tool▁calls▁end｜>";
const DEEPSEEK_CALL: &str = "<｜tool▁call▁begin｜>";
const DEEPSEEK_CALL_END: &str = "<｜tool▁call▁end｜>";
const DEEPSEEK_SEP: &str = "<｜tool▁sep｜>";
const HARMONY_CHANNEL: &str = "<|channel|>";

/// Parses calls out of streamed text ([`ToolParser::push`] each delta, then
/// [`ToolParser::finish`]); the pieces, concatenated, are the whole answer.
#[derive(Debug)]
pub struct ToolParser {
    format: ToolFormat,
    /// Text not handed out yet.
    buf: String,
    /// Inside a call (after its opening marker), or (Llama 3) committed to a JSON answer.
    in_call: bool,
    /// Llama 3: the answer's start has been seen to be text.
    decided: bool,
    /// Hermes: a call just closed, and only whitespace came after it so far (held back).
    after_call: bool,
    harmony: super::harmony::HarmonyParser,
}

impl ToolParser {
    pub fn new(format: ToolFormat) -> Self {
        Self {
            format,
            buf: String::new(),
            in_call: false,
            decided: false,
            after_call: false,
            harmony: Default::default(),
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        if self.format == ToolFormat::Harmony {
            return self.harmony.push(text);
        }
        self.buf.push_str(text);
        let mut out = Vec::new();
        match self.format {
            ToolFormat::Hermes => self.hermes(&mut out, false),
            ToolFormat::Mistral => self.marker_to_end(MISTRAL_OPEN, &mut out),
            ToolFormat::DeepseekV3 => self.marker_to_end(DEEPSEEK_OPEN, &mut out),
            ToolFormat::Llama3Json | ToolFormat::Pythonic => self.llama3(&mut out),
            // Parsed by its own parser (above).
            ToolFormat::Harmony => {}
        }
        out
    }

    /// The rest: a call still open is parsed as far as it got (a model may stop at eos
    /// without the closing marker), or released as text if it is not one.
    pub fn finish(&mut self) -> Vec<Piece> {
        if self.format == ToolFormat::Harmony {
            return self.harmony.finish();
        }
        let mut out = Vec::new();
        if self.format == ToolFormat::Hermes {
            self.hermes(&mut out, true);
        }
        let rest = std::mem::take(&mut self.buf);
        if self.in_call {
            let (open, body) = match self.format {
                // Cut off inside the closing marker (at max_tokens): the call is whole.
                ToolFormat::Hermes => {
                    (HERMES_OPEN, &rest[..rest.len() - held(&rest, HERMES_CLOSE)])
                }
                ToolFormat::Mistral => (MISTRAL_OPEN, rest.as_str()),
                ToolFormat::DeepseekV3 => (DEEPSEEK_OPEN, rest.as_str()),
                ToolFormat::Llama3Json | ToolFormat::Pythonic | ToolFormat::Harmony => {
                    ("", rest.as_str())
                }
            };
            match calls(self.format, body) {
                Some(c) => out.extend(c.into_iter().map(Piece::Call)),
                None => out.push(Piece::Text(format!("{open}{body}"))),
            }
        } else if !rest.is_empty() {
            out.push(Piece::Text(rest));
        }
        self.in_call = false;
        out
    }

    /// Hermes: text, `<tool_call>` body `</tool_call>`, text, ….
    fn hermes(&mut self, out: &mut Vec<Piece>, end: bool) {
        loop {
            if self.in_call {
                let Some(close) = self.buf.find(HERMES_CLOSE) else {
                    return;
                };
                let body: String = self.buf[..close].to_owned();
                self.buf.drain(..close + HERMES_CLOSE.len());
                self.in_call = false;
                match calls(ToolFormat::Hermes, &body) {
                    Some(c) => {
                        out.extend(c.into_iter().map(Piece::Call));
                        self.after_call = true;
                    }
                    None => out.push(Piece::Text(format!("{HERMES_OPEN}{body}{HERMES_CLOSE}"))),
                }
            } else if let Some(open) = self.buf.find(HERMES_OPEN) {
                // The newline a model writes between parallel calls is no text of the answer
                // (vLLM's parsers drop it too; an empty text block would show in clients).
                if self.after_call && self.buf[..open].trim().is_empty() {
                    self.buf.drain(..open);
                } else {
                    self.text(out, open);
                }
                self.after_call = false;
                self.buf.drain(..HERMES_OPEN.len());
                self.in_call = true;
            } else {
                let keep = if end { 0 } else { held(&self.buf, HERMES_OPEN) };
                let n = self.buf.len() - keep;
                if self.after_call && self.buf[..n].trim().is_empty() {
                    // Whitespace after a call waits for what follows it: another call (then
                    // it is dropped) or text (then it goes out with it); at the end, dropped.
                    if end {
                        self.buf.clear();
                    }
                    return;
                }
                self.after_call = false;
                self.text(out, n);
                return;
            }
        }
    }

    /// Mistral: text, then `[TOOL_CALLS]` and calls to the end.
    fn marker_to_end(&mut self, open: &str, out: &mut Vec<Piece>) {
        if self.in_call {
            return;
        }
        if let Some(at) = self.buf.find(open) {
            self.text(out, at);
            self.buf.drain(..open.len());
            self.in_call = true;
        } else {
            let keep = held(&self.buf, open);
            self.text(out, self.buf.len() - keep);
        }
    }

    /// Llama 3: an answer that starts with `{` (or the python tag) is a call, to the end;
    /// pythonic: one that starts with `[` (or `<|python_start|>`).
    fn llama3(&mut self, out: &mut Vec<Piece>) {
        if self.in_call {
            return;
        }
        if !self.decided {
            let start = self.buf.trim_start();
            if start.is_empty() {
                return;
            }
            let (opens, tag) = match self.format {
                ToolFormat::Pythonic => ('[', PYTHON_START),
                _ => ('{', PYTHON_TAG),
            };
            if start.starts_with(opens) {
                self.in_call = true;
                return;
            }
            if let Some(rest) = start.strip_prefix(tag) {
                self.buf = rest.to_owned();
                self.in_call = true;
                return;
            }
            if tag.starts_with(start) {
                return;
            }
            self.decided = true;
        }
        self.text(out, self.buf.len());
    }

    /// Hand out `buf[..n]` as text.
    fn text(&mut self, out: &mut Vec<Piece>, n: usize) {
        if n > 0 {
            let t: String = self.buf.drain(..n).collect();
            match out.last_mut() {
                Some(Piece::Text(prev)) => prev.push_str(&t),
                _ => out.push(Piece::Text(t)),
            }
        }
    }
}

/// The calls in one call body of `format`; `None` when it is not calls.
fn calls(format: ToolFormat, body: &str) -> Option<Vec<ToolCall>> {
    match format {
        ToolFormat::Pythonic => return python::calls(body.trim().trim_end_matches(PYTHON_END)),
        ToolFormat::DeepseekV3 => return deepseek_calls(body),
        _ => {}
    }
    let values: Vec<Value> = serde_json::Deserializer::from_str(body.trim())
        .into_iter::<Value>()
        .collect::<Result<_, _>>()
        .ok()?;
    let mut out = Vec::new();
    for v in values {
        match v {
            Value::Array(items) => {
                for item in items {
                    out.push(call(format, &item)?);
                }
            }
            item => out.push(call(format, &item)?),
        }
    }
    (!out.is_empty()).then_some(out)
}

/// DeepSeek V3's calls: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```
/// <｜tool▁call▁end｜>`, or V3.1's `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`,
/// up to the closing marker (or the end, when the model stopped there).
fn deepseek_calls(body: &str) -> Option<Vec<ToolCall>> {
    let body = body.split(DEEPSEEK_CLOSE).next().unwrap_or_default();
    let mut out = Vec::new();
    for part in body.split(DEEPSEEK_CALL).skip(1) {
        let part = part.split(DEEPSEEK_CALL_END).next().unwrap_or_default();
        let (head, rest) = part.split_once(DEEPSEEK_SEP)?;
        let (name, args) = if head.trim() == "function" {
            let (name, args) = rest.split_once('\n')?;
            let args = args
                .trim()
                .trim_start_matches("```json")
                .trim_end_matches("```");
            (name.trim(), args.trim())
        } else {
            (head.trim(), rest.trim())
        };
        let args: Value = serde_json::from_str(args).ok()?;
        if name.is_empty() || !args.is_object() {
            return None;
        }
        out.push(ToolCall {
            name: name.to_owned(),
            arguments: args.to_string(),
        });
    }
    (!out.is_empty()).then_some(out)
}

fn call(format: ToolFormat, v: &Value) -> Option<ToolCall> {
    let name = v["name"].as_str()?.to_owned();
    let args = match format {
        ToolFormat::Llama3Json if !v["parameters"].is_null() => &v["parameters"],
        _ => &v["arguments"],
    };
    let arguments = match args {
        Value::Null => "{}".to_owned(),
        // Some models write the arguments as a JSON string already.
        Value::String(s) if serde_json::from_str::<Value>(s).is_ok() => s.clone(),
        a => a.to_string(),
    };
    Some(ToolCall { name, arguments })
}

/// Python call lists (`[f(a=1, b="x"), g()]`), read as vLLM's pythonic parser reads them:
/// keyword arguments whose values are Python literals (strings, numbers, `True`/`False`/
/// `None`, lists, dicts), written out as JSON. Hand-written on purpose: the Rust Python parsers
/// (`rustpython-parser`, ruff's) bring a whole language's syntax tree for these few literal
/// forms, and a small reader bounds its own nesting.
mod python {
    use serde_json::{Map, Number, Value};

    use super::ToolCall;

    pub(super) fn calls(text: &str) -> Option<Vec<ToolCall>> {
        let mut p = P {
            s: text.as_bytes(),
            i: 0,
        };
        p.eat(b'[')?;
        let mut out = Vec::new();
        loop {
            p.ws();
            if p.peek() == Some(b']') {
                p.i += 1;
                break;
            }
            if !out.is_empty() {
                p.eat(b',')?;
                p.ws();
                if p.peek() == Some(b']') {
                    p.i += 1;
                    break;
                }
            }
            out.push(p.call()?);
        }
        p.ws();
        (p.i == p.s.len() && !out.is_empty()).then_some(out)
    }

    struct P<'a> {
        s: &'a [u8],
        i: usize,
    }

    impl P<'_> {
        fn peek(&self) -> Option<u8> {
            self.s.get(self.i).copied()
        }

        fn ws(&mut self) {
            while self.peek().is_some_and(|c| c.is_ascii_whitespace()) {
                self.i += 1;
            }
        }

        fn eat(&mut self, c: u8) -> Option<()> {
            self.ws();
            (self.peek() == Some(c)).then(|| self.i += 1)
        }

        fn ident(&mut self) -> Option<String> {
            self.ws();
            let start = self.i;
            while self
                .peek()
                .is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'.')
            {
                self.i += 1;
            }
            (self.i > start).then(|| String::from_utf8_lossy(&self.s[start..self.i]).into_owned())
        }

        fn call(&mut self) -> Option<ToolCall> {
            let name = self.ident()?;
            self.eat(b'(')?;
            let mut args = Map::new();
            loop {
                self.ws();
                if self.peek() == Some(b')') {
                    self.i += 1;
                    break;
                }
                if !args.is_empty() {
                    self.eat(b',')?;
                    self.ws();
                    if self.peek() == Some(b')') {
                        self.i += 1;
                        break;
                    }
                }
                let key = self.ident()?;
                self.eat(b'=')?;
                args.insert(key, self.value(0)?);
            }
            Some(ToolCall {
                name,
                arguments: Value::Object(args).to_string(),
            })
        }

        fn value(&mut self, depth: usize) -> Option<Value> {
            if depth > 64 {
                return None;
            }
            self.ws();
            match self.peek()? {
                q @ (b'"' | b'\'') => self.string(q).map(Value::String),
                b'[' | b'(' => {
                    let close = if self.peek() == Some(b'[') {
                        b']'
                    } else {
                        b')'
                    };
                    self.i += 1;
                    let mut items = Vec::new();
                    loop {
                        self.ws();
                        if self.peek() == Some(close) {
                            self.i += 1;
                            return Some(Value::Array(items));
                        }
                        if !items.is_empty() {
                            self.eat(b',')?;
                            self.ws();
                            if self.peek() == Some(close) {
                                self.i += 1;
                                return Some(Value::Array(items));
                            }
                        }
                        items.push(self.value(depth + 1)?);
                    }
                }
                b'{' => {
                    self.i += 1;
                    let mut m = Map::new();
                    loop {
                        self.ws();
                        if self.peek() == Some(b'}') {
                            self.i += 1;
                            return Some(Value::Object(m));
                        }
                        if !m.is_empty() {
                            self.eat(b',')?;
                            self.ws();
                            if self.peek() == Some(b'}') {
                                self.i += 1;
                                return Some(Value::Object(m));
                            }
                        }
                        let key = match self.value(depth + 1)? {
                            Value::String(k) => k,
                            other => other.to_string(),
                        };
                        self.eat(b':')?;
                        m.insert(key, self.value(depth + 1)?);
                    }
                }
                _ => {
                    let word = self.word();
                    match word.as_str() {
                        "True" => Some(Value::Bool(true)),
                        "False" => Some(Value::Bool(false)),
                        "None" => Some(Value::Null),
                        w => {
                            if let Ok(n) = w.parse::<i64>() {
                                Some(Value::Number(n.into()))
                            } else {
                                w.parse::<f64>()
                                    .ok()
                                    .and_then(Number::from_f64)
                                    .map(Value::Number)
                            }
                        }
                    }
                }
            }
        }

        fn word(&mut self) -> String {
            let start = self.i;
            while self.peek().is_some_and(|c| {
                c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-' | b'+')
            }) {
                self.i += 1;
            }
            String::from_utf8_lossy(&self.s[start..self.i]).into_owned()
        }

        /// A quoted string with Python's common escapes.
        fn string(&mut self, quote: u8) -> Option<String> {
            self.i += 1;
            let mut out = Vec::new();
            loop {
                let c = self.peek()?;
                self.i += 1;
                match c {
                    b'\\' => {
                        let e = self.peek()?;
                        self.i += 1;
                        out.push(match e {
                            b'n' => b'\n',
                            b't' => b'\t',
                            b'r' => b'\r',
                            other => other,
                        });
                    }
                    c if c == quote => return String::from_utf8(out).ok(),
                    c => out.push(c),
                }
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Real outputs, as each model's documentation and chat template show them.
    fn cases() -> Vec<(ToolFormat, &'static str, Vec<Piece>)> {
        let weather = |city: &str| {
            Piece::Call(ToolCall {
                name: "get_weather".into(),
                arguments: format!("{{\"city\":\"{city}\"}}"),
            })
        };
        vec![
            (
                ToolFormat::Hermes,
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
                vec![weather("Paris")],
            ),
            (
                ToolFormat::Hermes,
                "Let me check. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>",
                vec![
                    Piece::Text("Let me check. ".into()),
                    weather("Paris"),
                    weather("Oslo"),
                ],
            ),
            (
                ToolFormat::Hermes,
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\nDone.\n",
                vec![weather("Paris"), Piece::Text("\n\nDone.\n".into())],
            ),
            (
                ToolFormat::Hermes,
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n ",
                vec![weather("Paris")],
            ),
            (
                ToolFormat::Hermes,
                "a < b and <tool_ is not a call",
                vec![Piece::Text("a < b and <tool_ is not a call".into())],
            ),
            (
                ToolFormat::Hermes,
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_c",
                vec![weather("Paris")],
            ),
            (
                ToolFormat::Hermes,
                "<tool_call>not json</tool_call> so text",
                vec![Piece::Text(
                    "<tool_call>not json</tool_call> so text".into(),
                )],
            ),
            (
                ToolFormat::Llama3Json,
                "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
                vec![weather("Paris")],
            ),
            (
                ToolFormat::Llama3Json,
                "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
                vec![weather("Paris")],
            ),
            (
                ToolFormat::Llama3Json,
                "The weather is {sunny}",
                vec![Piece::Text("The weather is {sunny}".into())],
            ),
            (
                ToolFormat::Mistral,
                "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}]",
                vec![weather("Paris"), weather("Oslo")],
            ),
            (
                ToolFormat::Mistral,
                "No [TOOL_ here.",
                vec![Piece::Text("No [TOOL_ here.".into())],
            ),
            (
                ToolFormat::Pythonic,
                "[get_weather(city=\"Paris\"), get_weather(city='Oslo')]",
                vec![weather("Paris"), weather("Oslo")],
            ),
            (
                ToolFormat::Pythonic,
                "<|python_start|>[get_weather(city=\"Paris\")]<|python_end|>",
                vec![weather("Paris")],
            ),
            (
                ToolFormat::Pythonic,
                "Lists look like [1, 2] in Python.",
                vec![Piece::Text("Lists look like [1, 2] in Python.".into())],
            ),
            (
                ToolFormat::DeepseekV3,
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Oslo\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                vec![weather("Paris"), weather("Oslo")],
            ),
            (
                ToolFormat::DeepseekV3,
                "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                vec![Piece::Text("Checking.".into()), weather("Paris")],
            ),
        ]
    }

    /// `text` cut at the positions `cuts` name (modulo its length, on character boundaries):
    /// the chunks a stream might deliver it in.
    pub(crate) fn split_at(text: &str, cuts: Vec<usize>) -> Vec<&str> {
        let mut at: Vec<usize> = cuts
            .into_iter()
            .map(|c| c % (text.len() + 1))
            .filter(|&c| text.is_char_boundary(c))
            .collect();
        at.sort_unstable();
        let mut chunks = Vec::new();
        let mut last = 0;
        for c in at {
            chunks.push(&text[last..c]);
            last = c;
        }
        chunks.push(&text[last..]);
        chunks
    }

    /// Pieces with neighbouring texts joined (streaming may split text anywhere).
    fn joined(pieces: Vec<Piece>) -> Vec<Piece> {
        let mut out: Vec<Piece> = Vec::new();
        for p in pieces {
            match (out.last_mut(), p) {
                (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
                (_, p) => out.push(p),
            }
        }
        out
    }

    fn parse(format: ToolFormat, chunks: &[&str]) -> Vec<Piece> {
        let mut p = ToolParser::new(format);
        let mut out: Vec<Piece> = chunks.iter().flat_map(|c| p.push(c)).collect();
        out.extend(p.finish());
        joined(out)
    }

    #[test]
    fn whole_outputs_give_their_calls_and_text_that_only_looks_like_one_is_released() {
        for (format, text, want) in cases() {
            assert_eq!(parse(format, &[text]), want, "{format:?}: {text}");
        }
    }

    proptest! {
        #[test]
        fn every_split_gives_the_same_calls_as_the_whole_text(
            case in 0usize..17,
            cuts in proptest::collection::vec(0usize..400, 0..8),
        ) {
            let (format, text, want) = cases().swap_remove(case);
            prop_assert_eq!(parse(format, &split_at(text, cuts)), want);
        }
    }

    #[test]
    fn no_markup_is_streamed_before_the_call_is_known() {
        let mut p = ToolParser::new(ToolFormat::Hermes);
        assert_eq!(p.push("Sure <tool"), vec![Piece::Text("Sure ".into())]);
        assert_eq!(p.push("_call>\n{\"name\": \"f\", "), vec![]);
        assert_eq!(
            p.push("\"arguments\": {}}\n</tool_call>"),
            vec![Piece::Call(ToolCall {
                name: "f".into(),
                arguments: "{}".into()
            })]
        );
    }

    #[test]
    fn tool_choice_is_checked_against_the_tools() {
        let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
        let named = json!({"type": "function", "function": {"name": "nope"}});
        let e = ToolRequest::read(Some(&tools), Some(&named), None).expect_err("unknown");
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let e = ToolRequest::read(None, Some(&json!("required")), None).expect_err("no tools");
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let none = ToolRequest::read(Some(&tools), Some(&json!("none")), None).expect("ok");
        assert!(!none.expect("tools").parses());
        let bad = json!([{"type": "retrieval"}]);
        let e = ToolRequest::read(Some(&bad), None, None).expect_err("type");
        assert_eq!(e.param.as_deref(), Some("tools[0].type"));
    }

    #[test]
    fn the_forcing_grammar_compiles_and_only_auto_is_free() {
        // Pydantic-style parameters: definitions referred to from inside.
        let nested = json!({"type": "object", "$defs": {"P": {"type": "object",
            "properties": {"x": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/P"}, {"type": "null"}]}},
            "required": ["x"]}}, "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"]});
        let tools = json!([
            {"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
            {"type": "function", "function": {"name": "b"}},
            {"type": "function", "function": {"name": "c", "parameters": nested}}
        ]);
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/tiny");
        let m = dyn_llm::model::ModelDir::load("tiny", std::path::Path::new(dir)).expect("loads");
        let g = m.grammars().expect("grammars");
        for format in [
            ToolFormat::Hermes,
            ToolFormat::Llama3Json,
            ToolFormat::Mistral,
            ToolFormat::DeepseekV3,
        ] {
            for choice in [
                json!("required"),
                json!({"type": "function", "function": {"name": "b"}}),
                json!({"type": "function", "function": {"name": "c"}}),
            ] {
                for parallel in [false, true] {
                    let r = ToolRequest::read(Some(&tools), Some(&choice), Some(parallel))
                        .expect("ok")
                        .expect("tools");
                    let c = r.forced(format).expect("forced");
                    g.check(&c)
                        .unwrap_or_else(|e| panic!("{format:?} {choice}: {e}\n{c:?}"));
                    // llama.cpp workers get the same calls in GBNF.
                    let Constraint::Calls(calls) = &c else {
                        panic!("{c:?}")
                    };
                    dyn_llm::gbnf::calls(calls).unwrap_or_else(|e| panic!("{format:?}: {e}"));
                }
            }
        }
        let auto = ToolRequest::read(Some(&tools), None, None)
            .expect("ok")
            .expect("tools");
        assert_eq!(auto.forced(ToolFormat::Hermes), None);
        // Python's keyword syntax has no JSON Schema grammar: not forced (the frontend
        // refuses such a tool_choice rather than leave it unenforced).
        let required = ToolRequest::read(Some(&tools), Some(&json!("required")), None)
            .expect("ok")
            .expect("tools");
        assert_eq!(required.forced(ToolFormat::Pythonic), None);
    }

    #[test]
    fn python_values_become_json_arguments() {
        let c = python::calls(
            "[f(s='it\\'s', n=-3, x=2.5, ok=True, no=None, l=[1, 'a'], d={'k': (1, 2)})]",
        )
        .expect("a call");
        assert_eq!(c[0].name, "f");
        let v: Value = serde_json::from_str(&c[0].arguments).expect("json");
        assert_eq!(
            v,
            json!({"s": "it's", "n": -3, "x": 2.5, "ok": true, "no": null, "l": [1, "a"], "d": {"k": [1, 2]}})
        );
        for bad in ["[f(1)]", "[f(a=)]", "f(a=1)", "[f(a=1)", "[]", "[f(a='x)]"] {
            assert_eq!(python::calls(bad), None, "{bad}");
        }
    }
}
