//! Structured output: a request's [`Constraint`] (a JSON Schema, any JSON object, a regex, a
//! choice of strings or a Lark grammar) compiled by `llguidance` into a token mask per
//! position, so the engine only ever samples tokens that keep the output inside the grammar.
//! llguidance is the grammar engine llama.cpp, vLLM and SGLang use; its parser walks a trie of
//! the model's vocabulary ([`toktrie`]) built here once per model from the tokenizer.
//!
//! [`Grammars`] holds the compiled vocabulary. A constraint is measured against the bounds of
//! [`bounds`] and compiled by [`Grammars::compile`] on a compile thread of its own, once per
//! content ([`compile`]): preprocess does so to refuse a constraint the library rejects (400
//! naming the problem), and engines before a request is queued, so no step waits on a compile.
//! Each request's [`Guide`] starts from a copy of the compiled parser and hands out one mask
//! per sampled token (the native engine computes them on helper threads while the forward
//! pass runs).
//!
//! Text the grammar forces (a forced tool call's `<tool_call>\n{"name": "`, a schema's keys) is
//! written in the tokenizer's own tokens ([`canonical`]): after each sampled token the guide
//! hands the engine the run of tokens the grammar forces next ([`Guide::take_forced`]), which
//! the engine appends to the output without sampling them (their KV is computed with the next
//! step, as a short chunk), so a forced call costs about its own length in tokens and steps.
//!
//! JSON is generated compactly with Python's separators (`", "`, `": "`) and no free
//! whitespace: with flexible whitespace a small model can spend its whole budget on newlines
//! inside an object, and the text a client parses is the same.
//!
//! A grammar cannot stop a model that loops inside what the grammar leaves unbounded (the
//! digits of a fraction, a string without `maxLength`, a map's keys) until `max_tokens` cuts
//! the answer into text no parser takes. So a guide knows its budget, and over its last tokens
//! ([`closing_reserve`]) it steers toward the end ([`Steer`]): eos wherever the grammar is
//! complete and, for JSON, inside a string the tokens that end it, outside one those that close
//! an object or array, then short values and punctuation; the model still chooses among the
//! tokens left. An answer ended that way reports `finish_reason: length` (the budget shaped
//! it), and parses.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{self, SimpleVob, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};
use tokenizers::{DecoderWrapper, Tokenizer};

use dyn_protocol::types::{Calls, Constraint};

pub mod bounds;
mod canonical;
mod compile;

pub use compile::{CompileError, Compiled};

/// A model's vocabulary compiled for llguidance: shared by every request on the model.
pub struct Grammars {
    factory: ParserFactory,
    eos: Vec<u32>,
    /// What a guide prefers when its budget runs out, and every token's bytes (to follow
    /// whether a JSON answer is inside a string).
    steer: Steer,
    compiler: compile::Compiler,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").field("eos", &self.eos).finish()
    }
}

impl Grammars {
    /// The vocabulary of `tokenizer`, `vocab_size` ids long (the model's logits; ids past the
    /// tokenizer's are never allowed), ending on any of `eos`. Forced text is tokenized by
    /// `tokenizer` ([`canonical`]).
    pub fn new(tokenizer: &Arc<Tokenizer>, vocab_size: u32, eos: &[u32]) -> Result<Self, String> {
        let first = *eos
            .first()
            .ok_or("structured output needs an eos token, and the model has none")?;
        let words = token_bytes(tokenizer, vocab_size);
        // toktrie asserts on what it does not expect; a tokenizer is input, so a panic there
        // becomes an error for the requests that needed a grammar, not a dead process.
        let built = std::panic::catch_unwind(|| {
            let trie =
                TokTrie::from(&TokRxInfo::new(vocab_size, first), &words).with_eos_tokens(eos);
            let env: toktrie::TokEnv =
                Arc::new(canonical::CanonicalEnv::new(trie, tokenizer.clone()));
            ParserFactory::new_simple(&env)
        })
        .map_err(|_| "the tokenizer's vocabulary could not be compiled for grammars".to_string())?;
        let mut factory = built.map_err(|e| format!("grammar vocabulary: {e}"))?;
        factory.quiet();
        Ok(Self {
            factory,
            eos: eos.to_vec(),
            steer: Steer::new(words),
            compiler: compile::Compiler::default(),
        })
    }

    /// Compile `c` on the calling thread, without the cache (tests; a caller with a thread of
    /// its own): `Err` names the bound exceeded or what the grammar library rejects.
    pub fn check(&self, c: &Constraint) -> Result<(), String> {
        self.compile_here(c).map(drop)
    }

    /// [`Grammars::compile`] on the calling thread, without the cache (tests; a caller on a
    /// thread with a stack of its own).
    pub fn compile_here(&self, c: &Constraint) -> Result<Compiled, String> {
        bounds::check(c)?;
        Ok(Compiled::new(self.parser(c)?, c))
    }

    /// The parser of `c`; recurses as deep as `c` nests (see [`bounds`]).
    fn parser(&self, c: &Constraint) -> Result<Matcher, String> {
        let parser = self
            .factory
            .create_parser(top_level(c))
            .map_err(|e| e.to_string())?;
        Ok(Matcher::new(Ok(parser)))
    }

    /// A guide for one request of the constraint `c` ([`Grammars::compile`]) whose output so
    /// far is `generated` (non-empty when a migrated request resumes) and that may write
    /// `max_tokens` more; it fast-forwards forced text unless told otherwise
    /// ([`Guide::with_fast_forward`]).
    pub fn guide(self: &Arc<Self>, c: &Compiled, generated: Vec<u32>, max_tokens: u32) -> Guide {
        let mut json = c.json.then(JsonText::default);
        if let Some(j) = &mut json {
            generated.iter().for_each(|&t| j.feed(self.word(t)));
        }
        Guide {
            json,
            state: State::Pending {
                grammars: self.clone(),
                matcher: Box::new(c.start()),
                replay: generated,
            },
            left: max_tokens,
            reserve: closing_reserve(max_tokens),
            steered: false,
            fast_forward: true,
            forced: Vec::new(),
        }
    }

    fn word(&self, token: u32) -> &[u8] {
        self.steer
            .words
            .get(token as usize)
            .map_or(&[], Vec::as_slice)
    }

    /// Narrows `mask` toward the end of the grammar (see the module docs): eos alone where
    /// the grammar is complete, else (JSON, `json` telling whether inside a string) the
    /// preferred tokens; whether it changed.
    fn steer(&self, mask: &mut SimpleVob, json: Option<JsonText>) -> bool {
        if self.eos.iter().any(|&t| mask.is_allowed(t)) {
            let only = self.eos_only(mask.len());
            let changed = only.num_set() != mask.num_set();
            *mask = only;
            return changed;
        }
        self.steer.narrow(mask, json.map(|j| j.in_string))
    }

    fn eos_only(&self, vocab: usize) -> SimpleVob {
        let mut v = SimpleVob::alloc(vocab);
        for &t in &self.eos {
            if (t as usize) < vocab {
                v.allow_token(t);
            }
        }
        v
    }
}

/// Classes of text tokens by their bytes, for steering an answer to its end.
struct Steer {
    words: Vec<Vec<u8>>,
    /// A `"` (and no backslash): ends a JSON string, or starts one.
    quote: SimpleVob,
    /// A `}` or `]` (no quote, no backslash): closes an object or array.
    close: SimpleVob,
    /// Digits only: the shortest values.
    digits: SimpleVob,
    /// Punctuation only (no letters, digits or quotes; not only whitespace).
    punctuation: SimpleVob,
}

impl Steer {
    fn new(words: Vec<Vec<u8>>) -> Self {
        let n = words.len();
        let (mut quote, mut close, mut digits, mut punctuation) = (
            SimpleVob::alloc(n),
            SimpleVob::alloc(n),
            SimpleVob::alloc(n),
            SimpleVob::alloc(n),
        );
        for (id, w) in words.iter().enumerate() {
            if w.is_empty() || w[0] == TokTrie::SPECIAL_TOKEN_MARKER || w.contains(&b'\\') {
                continue;
            }
            let has = |c: &[u8]| w.iter().any(|b| c.contains(b));
            if has(b"\"") {
                quote.set(id, true);
            } else if has(b"}]") {
                close.set(id, true);
            } else if w.iter().all(u8::is_ascii_digit) {
                digits.set(id, true);
            } else if !w.iter().any(u8::is_ascii_alphanumeric)
                && !w.iter().all(u8::is_ascii_whitespace)
            {
                punctuation.set(id, true);
            }
        }
        Self {
            words,
            quote,
            close,
            digits,
            punctuation,
        }
    }

    /// Narrows `mask` to the first preferred class it allows; whether it changed. Inside a
    /// JSON string: what ends it, then punctuation (a formatted string's separators). Outside:
    /// what closes, then digits, then a quote (a string that ends on the next token), then
    /// punctuation. Other grammars are only ended where they are complete (by the caller).
    fn narrow(&self, mask: &mut SimpleVob, json: Option<bool>) -> bool {
        let order: &[&SimpleVob] = match json {
            Some(true) => &[&self.quote, &self.punctuation],
            Some(false) => &[&self.close, &self.digits, &self.quote, &self.punctuation],
            None => &[],
        };
        for prefer in order {
            if prefer.len() == mask.len() && !mask.and_is_zero(prefer) {
                let before = mask.num_set();
                mask.and(prefer);
                return mask.num_set() != before;
            }
        }
        false
    }
}

/// Where a JSON answer's text stands: inside a string or not, after a backslash or not.
#[derive(Debug, Default, Clone, Copy)]
struct JsonText {
    in_string: bool,
    escaped: bool,
}

impl JsonText {
    fn feed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if !self.in_string {
                self.in_string = b == b'"';
            } else if self.escaped {
                self.escaped = false;
            } else if b == b'\\' {
                self.escaped = true;
            } else if b == b'"' {
                self.in_string = false;
            }
        }
    }
}

/// The last tokens of a structured output's budget, over which its guide steers toward the
/// end: a quarter of it, from 8 to 64 tokens (closing a nested JSON value takes a few tokens
/// per level and per required property still missing).
pub fn closing_reserve(max_tokens: u32) -> u32 {
    (max_tokens / 4).clamp(8, 64)
}

/// llguidance's JSON options (`x-guidance`) for the JSON dyn's grammars produce: Python's
/// separators and no free whitespace, so a small model cannot loop on newlines.
pub fn compact_json() -> Value {
    json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
    })
}

/// The JSON Schema a JSON constraint compiles (`None` for the others), with the compact
/// options unless the schema sets its own (`x-guidance`).
fn json_schema(c: &Constraint) -> Option<Value> {
    match c {
        Constraint::JsonObject => Some(json!({"type": "object", "x-guidance": compact_json()})),
        Constraint::JsonSchema(schema) => Some(with_compact(schema)),
        _ => None,
    }
}

/// `schema` asking for the compact form (unless it sets its own `x-guidance`).
fn with_compact(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Value::Object(o) = &mut schema {
        o.entry("x-guidance").or_insert_with(compact_json);
    }
    schema
}

/// A choice of strings as a Lark expression (its literals take JSON's escapes).
fn choice_expr(options: &[String]) -> String {
    let alts: Vec<String> = options
        .iter()
        .map(|o| serde_json::to_string(o).unwrap_or_default())
        .collect();
    alts.join(" | ")
}

/// A constraint as a Lark expression for a grammar that embeds it (harmony's final channel),
/// with the definitions it refers to (lines to append to that grammar); `None` for a Lark
/// grammar, which is a whole grammar of its own.
pub fn lark_expr(c: &Constraint) -> Option<(String, String)> {
    let alone = |e: String| Some((e, String::new()));
    match c {
        Constraint::JsonObject | Constraint::JsonSchema(_) => {
            json_schema(c).and_then(|s| alone(format!("%json {s}")))
        }
        Constraint::Regex(rx) => alone(format!("/{}/", rx.replace('/', "\\/"))),
        // A terminal, as at the top level: a rule's alternation stops at llguidance's 2,000
        // items a row.
        Constraint::Choice(options) => Some((
            "DYN_CHOICE".into(),
            format!("DYN_CHOICE: {}", choice_expr(options)),
        )),
        Constraint::Lark(_) | Constraint::Calls(_) => None,
    }
}

/// Forced calls as a Lark grammar, their JSON in the compact form (unless a schema sets its
/// own `x-guidance`).
pub fn calls_lark(c: &Calls) -> String {
    // A Lark string literal (JSON's escapes); nothing for empty text.
    let lit = |s: &str| match s {
        "" => String::new(),
        s => serde_json::to_string(s).unwrap_or_default(),
    };
    let join = crate::gbnf::seq;
    let forms: Vec<String> = c
        .forms
        .iter()
        .map(|f| {
            let schema = with_compact(&f.schema);
            join(&[lit(&f.before), format!("%json {schema}"), lit(&f.after)])
        })
        .collect();
    let more = match c.sep.as_deref() {
        None => String::new(),
        Some("") => "call*".into(),
        Some(sep) => format!("({} call)*", lit(sep)),
    };
    format!(
        "start: {}\ncall: {}",
        join(&[lit(&c.open), "call".into(), more, lit(&c.close)]),
        forms.join(" | ")
    )
}

/// llguidance's grammar for a constraint.
fn top_level(c: &Constraint) -> TopLevelGrammar {
    match c {
        Constraint::JsonObject | Constraint::JsonSchema(_) => {
            TopLevelGrammar::from_json_schema(json_schema(c).unwrap_or_default())
        }
        Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
        // One terminal (a lexeme), not a rule of alternatives: a rule keeps an Earley item per
        // alternative, and llguidance ends a row at 2,000 items (a choice of more ended after
        // its first token).
        Constraint::Choice(options) => {
            TopLevelGrammar::from_lark(format!("start: CHOICE\nCHOICE: {}", choice_expr(options)))
        }
        Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        Constraint::Calls(c) => TopLevelGrammar::from_lark(calls_lark(c)),
    }
}

/// Every id's bytes as llguidance wants them: special tokens behind its marker byte (so no
/// grammar text can produce them), byte-level and byte-fallback tokens as the bytes they
/// decode to. A duplicate of an earlier token's bytes is left empty (never generated under a
/// grammar): the trie holds one id per byte string.
///
/// Written here rather than taken from `llguidance::token_bytes_from_tokenizer_json`, which
/// panics on vocabularies it does not expect; this reads the tokenizer dyn already loaded.
fn token_bytes(t: &Tokenizer, vocab_size: u32) -> Vec<Vec<u8>> {
    let byte_level = matches!(t.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
    let chars = super::detok::byte_level_chars();
    let added = t.get_added_vocabulary();
    let mut seen = std::collections::HashSet::new();
    (0..vocab_size)
        .map(|id| {
            let Some(tok) = t.id_to_token(id) else {
                return Vec::new();
            };
            let bytes = if added.is_special_token(&tok) {
                let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                b.extend_from_slice(tok.as_bytes());
                b
            } else if byte_level {
                let mapped: Option<Vec<u8>> = tok.chars().map(|c| chars.get(&c).copied()).collect();
                mapped.unwrap_or_else(|| tok.into_bytes())
            } else if let Some(b) = byte_fallback(&tok) {
                vec![b]
            } else {
                // SentencePiece: `▁` is a space.
                tok.replace('\u{2581}', " ").into_bytes()
            };
            if bytes.is_empty() || !seen.insert(bytes.clone()) {
                Vec::new()
            } else {
                bytes
            }
        })
        .collect()
}

/// `<0xAB>`, a SentencePiece byte-fallback token.
fn byte_fallback(tok: &str) -> Option<u8> {
    let hex = tok.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

enum State {
    /// Compiled, the output so far not yet replayed (a migrated request's tokens: replayed on
    /// the first mask, on the engine's mask threads rather than where the request is queued).
    Pending {
        grammars: Arc<Grammars>,
        matcher: Box<Matcher>,
        replay: Vec<u32>,
    },
    Ready {
        grammars: Arc<Grammars>,
        matcher: Box<Matcher>,
    },
    /// The grammar failed (it was checked when the request came in, so a library limit hit
    /// mid-output): only eos is allowed, so the output ends.
    Broken(Arc<Grammars>),
    /// Only while a pending guide is replayed.
    Replaying,
}

/// One request's grammar state: [`Guide::mask`] before each sampled token, [`Guide::commit`]
/// after.
pub struct Guide {
    state: State,
    /// Tokens the output may still take, and from how many left it steers toward its end.
    left: u32,
    reserve: u32,
    /// The budget steered the output toward its end (see the module docs).
    steered: bool,
    /// A JSON answer: where its text stands.
    json: Option<JsonText>,
    /// After each commit, consume the tokens the grammar forces next into `forced`.
    fast_forward: bool,
    forced: Vec<u32>,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match &self.state {
            State::Pending { .. } => "pending",
            State::Ready { .. } => "ready",
            State::Broken(_) => "broken",
            State::Replaying => "replaying",
        };
        f.debug_struct("Guide").field("state", &s).finish()
    }
}

impl Guide {
    /// The tokens allowed next, for a vocabulary of `vocab` ids; eos only once the grammar is
    /// complete (or broken).
    pub fn mask(&mut self, vocab: usize) -> SimpleVob {
        if matches!(self.state, State::Pending { .. }) {
            let State::Pending {
                grammars,
                mut matcher,
                replay,
            } = std::mem::replace(&mut self.state, State::Replaying)
            else {
                unreachable!("matched above")
            };
            self.state = match matcher.consume_tokens(&replay) {
                Ok(()) => State::Ready { grammars, matcher },
                Err(e) => {
                    tracing::warn!(error = %e, "The request's output so far does not fit its grammar; ending its output");
                    State::Broken(grammars)
                }
            };
        }
        let broken = match &mut self.state {
            State::Ready { grammars, matcher } => match matcher.compute_mask_or_eos() {
                Ok(mut m) if m.num_set() > 0 => {
                    if m.len() != vocab {
                        m.resize(vocab.max(m.len()));
                    }
                    if self.left <= self.reserve && grammars.steer(&mut m, self.json) {
                        self.steered = true;
                    }
                    return m;
                }
                Ok(_) => grammars.clone(),
                Err(e) => {
                    tracing::warn!(error = %e, "The request's grammar failed; ending its output");
                    grammars.clone()
                }
            },
            State::Broken(g) => g.clone(),
            State::Pending { .. } | State::Replaying => unreachable!("replayed above"),
        };
        let eos = broken.eos_only(vocab);
        self.state = State::Broken(broken);
        eos
    }

    /// Whether the budget steered the output toward its end (it then ends as if cut by
    /// `max_tokens`, but parses).
    pub fn steered(&self) -> bool {
        self.steered
    }

    /// Whether it fast-forwards forced text (on by default). Off, the mask still allows only
    /// the tokenizer's own first token of forced text, so such text costs a step per token
    /// but no more tokens than its normal tokenization.
    pub fn with_fast_forward(mut self, on: bool) -> Self {
        self.fast_forward = on;
        self
    }

    /// The token sampled under the last mask; with fast-forward, then the tokens the grammar
    /// forces after it, at most as many as the budget has left, for [`Guide::take_forced`].
    pub fn commit(&mut self, token: u32) {
        self.forced.clear();
        self.advance(token);
        if !self.fast_forward || self.left == 0 {
            return;
        }
        let State::Ready { matcher, .. } = &mut self.state else {
            return;
        };
        // llguidance tokenizes the forced bytes as the tokenizer would (across the token just
        // taken) and holds back a suffix later text could tokenize differently.
        let mut forced = matcher.compute_ff_tokens();
        forced.truncate(self.left as usize);
        for t in forced {
            self.advance(t);
            if !matches!(self.state, State::Ready { .. }) {
                // Refused (a library limit): the output ends at the next mask.
                break;
            }
            self.forced.push(t);
        }
    }

    /// The tokens the grammar forced after the last committed one (empty without
    /// fast-forward): already taken by the grammar, they go into the output as they are,
    /// counted against `max_tokens`, without being sampled. Taken once.
    pub fn take_forced(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.forced)
    }

    /// The grammar takes `token`.
    fn advance(&mut self, token: u32) {
        self.left = self.left.saturating_sub(1);
        if let (Some(j), State::Ready { grammars, .. } | State::Broken(grammars)) =
            (&mut self.json, &self.state)
        {
            j.feed(grammars.word(token));
        }
        if let State::Ready { grammars, matcher } = &mut self.state
            && let Err(e) = matcher.consume_token(token)
        {
            // eos after a complete grammar is not an error; anything else ends the output.
            if !grammars.eos.contains(&token) {
                tracing::warn!(error = %e, token, "A token the grammar refused; ending its output");
            }
            self.state = State::Broken(grammars.clone());
        }
    }
}

/// `-∞` for every logit `mask` does not allow.
pub fn apply(mask: &SimpleVob, logits: &mut [f32]) {
    for (i, l) in logits.iter_mut().enumerate() {
        if !mask.is_allowed(i as u32) {
            *l = f32::NEG_INFINITY;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The repository's tiny model: a byte-level BPE vocabulary with Llama 3's specials.
    fn tiny() -> (Arc<Grammars>, Tokenizer) {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/tiny");
        let m = crate::model::ModelDir::load("tiny", std::path::Path::new(dir)).expect("loads");
        let g = Grammars::new(&m.tokenizer, m.vocab_size, &m.eos_token_ids).expect("compiles");
        (Arc::new(g), (*m.tokenizer).clone())
    }

    /// The highest-scoring token (the first of equals), as greedy sampling picks it.
    fn argmax(logits: &[f32]) -> u32 {
        let (best, _) = logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &x)| if x > b.1 { (i, x) } else { b },
            );
        best as u32
    }

    /// Greedy decoding under the mask with a "model" that prefers the highest ids.
    fn run(g: &Arc<Grammars>, t: &Tokenizer, c: Constraint) -> String {
        run_with(g, t, c, 200, |i| (i % 97) as f32).0
    }

    /// Greedy decoding of at most `max_tokens` under the mask, the "model" scoring token `i`
    /// `score(i)`; the text, and whether the budget steered it.
    fn run_with(
        g: &Arc<Grammars>,
        t: &Tokenizer,
        c: Constraint,
        max_tokens: u32,
        score: impl Fn(usize) -> f32,
    ) -> (String, bool) {
        let vocab = t.get_vocab_size(true);
        let compiled = g.compile_here(&c).expect("compiles");
        let mut guide = g.guide(&compiled, Vec::new(), max_tokens);
        let mut out = Vec::new();
        while out.len() < max_tokens as usize {
            let mask = guide.mask(vocab);
            let mut logits: Vec<f32> = (0..vocab).map(&score).collect();
            apply(&mask, &mut logits);
            let tok = argmax(&logits);
            guide.commit(tok);
            if g.eos.contains(&tok) {
                break;
            }
            out.push(tok);
            // What the grammar forced after it, as the engine appends it.
            out.extend(guide.take_forced());
        }
        assert!(out.len() <= max_tokens as usize, "past the budget");
        (t.decode(&out, true).expect("decodes"), guide.steered())
    }

    #[test]
    fn a_model_looping_inside_an_unbounded_string_still_ends_in_valid_json() {
        let (g, t) = tiny();
        // A "model" that always wants the letter `a`: the string never ends by itself.
        let a = t.token_to_id("a").expect("a") as usize;
        let schema = json!({"type": "object", "properties": {"name": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1}},
            "required": ["name", "tags"], "additionalProperties": false});
        for max_tokens in [80, 160, 300] {
            let (s, steered) = run_with(
                &g,
                &t,
                Constraint::JsonSchema(schema.clone()),
                max_tokens,
                |i| {
                    if i == a { 1.0 } else { 0.0 }
                },
            );
            let v: Value = serde_json::from_str(&s).unwrap_or_else(|e| panic!("{s:?}: {e}"));
            assert!(
                v["name"].as_str().is_some_and(|n| n.starts_with('a')),
                "{s}"
            );
            assert!(!v["tags"].as_array().expect("tags").is_empty(), "{s}");
            assert!(steered, "{s}");
        }
        // A "model" that loops in a map's key (`{"||||…`) gets a closed map.
        let (s, steered) = run_with(&g, &t, Constraint::JsonObject, 300, |i| (i % 97) as f32);
        assert!(serde_json::from_str::<Value>(&s).is_ok() && steered, "{s}");
        // An answer that ends by itself well within its budget is not steered.
        let bounded = json!({"type": "object", "properties": {"tag": {"enum": ["a", "b"]}},
            "required": ["tag"], "additionalProperties": false});
        let (s, steered) = run_with(&g, &t, Constraint::JsonSchema(bounded), 300, |i| i as f32);
        assert!(serde_json::from_str::<Value>(&s).is_ok() && !steered, "{s}");
    }

    #[test]
    fn masks_keep_the_output_inside_the_grammar() {
        let (g, t) = tiny();
        let s = run(&g, &t, Constraint::Choice(vec!["yes".into(), "no".into()]));
        assert!(s == "yes" || s == "no", "{s:?}");
        let s = run(&g, &t, Constraint::Regex("[0-9]{3}-[a-c]+".into()));
        let (digits, letters) = s.split_once('-').expect("a dash");
        assert!(
            digits.len() == 3 && digits.chars().all(|c| c.is_ascii_digit()),
            "{s:?}"
        );
        assert!(
            !letters.is_empty() && letters.chars().all(|c| ('a'..='c').contains(&c)),
            "{s:?}"
        );
        let schema = json!({
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["a", "b"]}},
            "required": ["n", "tag"],
            "additionalProperties": false,
        });
        let s = run(&g, &t, Constraint::JsonSchema(schema));
        let v: Value = serde_json::from_str(&s).unwrap_or_else(|e| panic!("{s:?}: {e}"));
        assert!(
            v["n"].is_i64() && (v["tag"] == "a" || v["tag"] == "b"),
            "{s}"
        );
    }

    #[test]
    fn a_schema_the_library_rejects_is_an_error_naming_it() {
        let (g, _) = tiny();
        let e = g
            .check(&Constraint::JsonSchema(json!({"type": "strnig"})))
            .expect_err("no such type");
        assert!(e.contains("strnig"), "{e}");
        assert!(g.check(&Constraint::Regex("(".into())).is_err());
        assert!(g.check(&Constraint::Lark("start: foo".into())).is_err());
        assert!(g.check(&Constraint::JsonObject).is_ok());
    }

    #[test]
    fn a_migrated_request_continues_the_grammar_where_it_was() {
        let (g, t) = tiny();
        let done = t.encode("ye", false).expect("encodes").get_ids().to_vec();
        let c = g
            .compile_here(&Constraint::Choice(vec!["yes".into(), "no".into()]))
            .expect("compiles");
        let mut guide = g.guide(&c, done, 16);
        let mask = guide.mask(t.get_vocab_size(true));
        let s_id = t.token_to_id("s").expect("s");
        let n_id = t.token_to_id("n").expect("n");
        assert!(mask.is_allowed(s_id) && !mask.is_allowed(n_id));
    }

    #[test]
    fn a_choice_of_thousands_of_strings_is_answered_whole() {
        let (g, t) = tiny();
        let options: Vec<String> = (0..bounds::MAX_CHOICES)
            .map(|i| format!("option {i:05}"))
            .collect();
        let s = run(&g, &t, Constraint::Choice(options.clone()));
        assert!(options.contains(&s), "{s:?}");
        // Embedded in another grammar (harmony's final channel), the same.
        let (expr, defs) = lark_expr(&Constraint::Choice(options.clone())).expect("an expression");
        let s = run(
            &g,
            &t,
            Constraint::Lark(format!("start: answer\nanswer: {expr}\n{defs}")),
        );
        assert!(options.contains(&s), "{s:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_same_grammar_sent_at_once_compiles_once() {
        let (g, _) = tiny();
        let c = Constraint::Choice((0..4000).map(|i| format!("once {i:05}")).collect());
        let all = futures::future::join_all((0..6).map(|_| g.compile(&c))).await;
        let first = all[0].as_ref().expect("compiles");
        for other in &all[1..] {
            let other = other.as_ref().expect("compiles");
            assert!(
                Arc::ptr_eq(first, other),
                "a second compile of the same grammar"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiter_whose_lead_is_cancelled_compiles_the_grammar_itself() {
        let (g, _) = tiny();
        // Both turns taken: the lead waits for one.
        let held = g
            .compiler
            .turns
            .clone()
            .acquire_many_owned(2)
            .await
            .expect("turns");
        let c = Constraint::Choice(vec!["left".into(), "right".into()]);
        let lead = tokio::spawn({
            let (g, c) = (g.clone(), c.clone());
            async move { g.compile(&c).await }
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let waiter = tokio::spawn({
            let (g, c) = (g.clone(), c.clone());
            async move { g.compile(&c).await }
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        // The lead's request goes away; the turns come free.
        lead.abort();
        let _ = lead.await;
        drop(held);
        assert!(
            waiter.await.expect("runs").is_ok(),
            "the waiter compiles it"
        );
    }

    #[tokio::test]
    async fn deep_grammars_are_refused_and_the_deepest_allowed_compile_on_the_compile_threads() {
        let (g, _) = tiny();
        // Past the bounds: a 400's message naming the limit, before anything recurses.
        for (c, limit) in [
            (Constraint::JsonSchema(bounds::ref_chain(300)), "64 levels"),
            (Constraint::Lark(bounds::rule_chain(1200)), "128 levels"),
        ] {
            match g.compile(&c).await {
                Err(CompileError::Invalid(e)) => assert!(e.contains(limit), "{e}"),
                Err(e) => panic!("{e:?}"),
                Ok(_) => panic!("compiled"),
            }
        }
        // Just within them: compiled (the compile thread's stack holds the recursion), and
        // the second time taken from the cache.
        for c in [
            Constraint::JsonSchema(bounds::ref_chain(bounds::MAX_SCHEMA_DEPTH - 1)),
            Constraint::Lark(bounds::rule_chain(bounds::MAX_RULE_DEPTH - 2)),
        ] {
            let first = g.compile(&c).await.expect("compiles");
            let again = g.compile(&c).await.expect("cached");
            assert!(Arc::ptr_eq(&first, &again));
        }
    }
}
