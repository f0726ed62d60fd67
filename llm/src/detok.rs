//! Incremental detokenization and stop-string matching, the two stateful halves of
//! postprocess.
//!
//! [`Detokenizer`] turns token ids into text as they arrive. Byte-level tokenizers split
//! multi-byte characters across tokens, and some decoders change a token's text depending on
//! its neighbours, so decoding one token at a time is wrong. It keeps two offsets (the
//! approach vLLM and TGI use): text is decoded from `prefix` (the start of the last emitted
//! window, always a character boundary) and only what lies beyond the already-emitted part is
//! returned, and only once it no longer ends in a replacement character (an incomplete
//! character). [`Detokenizer::finish`] flushes the rest, so the concatenated output always
//! equals a full decode.
//!
//! For byte-level tokenizers (GPT-2 style: Llama 3, SmolLM2, Qwen) the decode is a
//! concatenation of each token's bytes, so [`TokenBytes`] holds every token's bytes once and
//! the detokenizer appends them and emits the complete UTF-8 characters — no decode call, no
//! allocation per token beyond the emitted text. Two Hugging Face decodes per token were the
//! frontend's largest remaining cost per token. The table is built only when the tokenizer's
//! decoder is `ByteLevel` and every token's bytes decode as Hugging Face decodes that token.
//!
//! [`StopMatcher`] holds back text that could be the start of a stop string, so a stop string
//! split across deltas is still found and never sent to the client.

use std::collections::HashMap;
use std::sync::Arc;

use tokenizers::{DecoderWrapper, Tokenizer};

const REPLACEMENT: char = '\u{FFFD}';

/// Every token's bytes for a byte-level tokenizer, special tokens empty (skipped, as serving
/// decodes with `skip_special_tokens`); their text is kept aside for requests that keep them.
pub struct TokenBytes {
    data: Vec<u8>,
    /// Token `i` is `data[ends[i - 1]..ends[i]]` (`ends[-1]` = 0).
    ends: Vec<u32>,
    /// The special tokens' text, for decoding without `skip_special_tokens`.
    special: HashMap<u32, Box<str>>,
}

impl TokenBytes {
    /// `None` unless `t` decodes byte-level and the table agrees with `t` token by token.
    pub fn new(t: &Tokenizer) -> Option<Self> {
        if !matches!(t.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
            return None;
        }
        let chars = byte_level_chars();
        let n = u32::try_from(t.get_vocab_size(true)).ok()?;
        let (mut data, mut ends) = (Vec::new(), Vec::with_capacity(n as usize));
        let mut special = HashMap::new();
        for id in 0..n {
            let tok = t.id_to_token(id);
            if let Some(tok) = &tok
                && t.get_added_vocabulary().is_special_token(tok)
            {
                special.insert(id, tok.as_str().into());
            } else if let Some(tok) = tok {
                // As the ByteLevel decoder does: a token with a char outside the byte map is
                // taken as its UTF-8 bytes (added tokens written as plain text).
                let mapped: Option<Vec<u8>> = tok.chars().map(|c| chars.get(&c).copied()).collect();
                data.extend_from_slice(mapped.as_deref().unwrap_or(tok.as_bytes()));
            }
            ends.push(u32::try_from(data.len()).ok()?);
        }
        let table = Self {
            data,
            ends,
            special,
        };
        // Every token alone decodes as Hugging Face decodes it (lossily where it is part of a
        // character); anything else means a decoder detail this table does not model.
        let agrees = (0..n).all(|id| {
            t.decode(&[id], true)
                .is_ok_and(|d| String::from_utf8_lossy(table.get(id)) == d)
        });
        agrees.then_some(table)
    }

    /// A special token's text (`None` for the others).
    pub(crate) fn special(&self, id: u32) -> Option<&str> {
        self.special.get(&id).map(|s| &**s)
    }

    pub(crate) fn get(&self, id: u32) -> &[u8] {
        let i = id as usize;
        match self.ends.get(i) {
            Some(&end) => {
                let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
                &self.data[start..end as usize]
            }
            None => &[],
        }
    }
}

/// GPT-2's map from the printable characters byte-level BPE uses back to the bytes they stand
/// for (`bytes_to_unicode` inverted).
pub(crate) fn byte_level_chars() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            let c = if printable(b) {
                u32::from(b)
            } else {
                next += 1;
                next - 1
            };
            (char::from_u32(c).unwrap_or(REPLACEMENT), b)
        })
        .collect()
}

pub struct Detokenizer {
    tokenizer: Arc<Tokenizer>,
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
    skip_special: bool,
    /// The byte-table path: the table and the bytes not yet emitted (an incomplete character).
    bytes: Option<(Arc<TokenBytes>, Vec<u8>)>,
}

impl Detokenizer {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Self {
            tokenizer,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            skip_special: true,
            bytes: None,
        }
    }

    /// Special tokens come out as their text (`skip_special_tokens: false`), as parsers of
    /// formats written in special tokens need (harmony's channels, Mistral's `[TOOL_CALLS]`).
    pub fn keeping_special(mut self, keep: bool) -> Self {
        self.skip_special = !keep;
        self
    }

    /// Decoding through `table` (built from `tokenizer`).
    pub fn with_bytes(tokenizer: Arc<Tokenizer>, table: Arc<TokenBytes>) -> Self {
        Self {
            bytes: Some((table, Vec::new())),
            ..Self::new(tokenizer)
        }
    }

    /// The byte path's text that became final: complete characters, and U+FFFD for bytes
    /// that can never become one (as `String::from_utf8_lossy` over the whole output); with
    /// `all`, an unfinished character at the end too.
    fn drain_bytes(pending: &mut Vec<u8>, all: bool) -> String {
        let mut out = String::new();
        let mut used = 0;
        while used < pending.len() {
            match std::str::from_utf8(&pending[used..]) {
                Ok(rest) => {
                    out.push_str(rest);
                    used = pending.len();
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // Checked by `from_utf8` just now.
                    out.push_str(std::str::from_utf8(&pending[used..used + valid]).unwrap_or(""));
                    used += valid;
                    match e.error_len() {
                        Some(bad) => used += bad,
                        // A character still arriving: wait for it unless this is the end.
                        None if !all => break,
                        None => used = pending.len(),
                    }
                    out.push(REPLACEMENT);
                }
            }
        }
        pending.drain(..used);
        out
    }

    fn decode(&self, ids: &[u32]) -> Result<String, tokenizers::Error> {
        self.tokenizer.decode(ids, self.skip_special)
    }

    /// Add one token; returns the text that became final (often empty mid-character).
    pub fn push(&mut self, id: u32) -> Result<String, tokenizers::Error> {
        self.ids.push(id);
        if let Some((table, pending)) = &mut self.bytes {
            // (The special-token lookup only for requests that keep them: this is per token.)
            match (!self.skip_special).then(|| table.special(id)).flatten() {
                Some(s) => pending.extend_from_slice(s.as_bytes()),
                None => pending.extend_from_slice(table.get(id)),
            }
            return Ok(Self::drain_bytes(pending, false));
        }
        let before = self.decode(&self.ids[self.prefix..self.read])?;
        let now = self.decode(&self.ids[self.prefix..])?;
        if now.len() > before.len() && !now.ends_with(REPLACEMENT) {
            // `before` is a prefix of `now` for every decoder we know; if one ever breaks
            // that, emit nothing now and let `finish` settle it rather than split a char.
            if let Some(delta) = now.get(before.len()..)
                && now.starts_with(before.as_str())
            {
                let delta = delta.to_owned();
                self.prefix = self.read;
                self.read = self.ids.len();
                return Ok(delta);
            }
        }
        Ok(String::new())
    }

    /// Everything not yet returned, incomplete characters included.
    pub fn finish(&mut self) -> Result<String, tokenizers::Error> {
        if let Some((_, pending)) = &mut self.bytes {
            return Ok(Self::drain_bytes(pending, true));
        }
        let before = self.decode(&self.ids[self.prefix..self.read])?;
        let now = self.decode(&self.ids[self.prefix..])?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(match now.strip_prefix(before.as_str()) {
            Some(rest) => rest.to_owned(),
            None => String::new(),
        })
    }

    pub fn tokens(&self) -> usize {
        self.ids.len()
    }
}

/// Finds stop strings in streamed text; see the module docs.
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
    /// The stop string that ended the text, once one has.
    matched: Option<String>,
}

/// What to send after feeding text to a [`StopMatcher`].
#[derive(Debug, PartialEq, Eq)]
pub enum Matched {
    /// Send this text and keep going.
    Continue(String),
    /// Send this text (everything before the stop string) and end.
    Stop(String),
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
            matched: None,
        }
    }

    /// Feed new text. With `armed` false (fewer than `min_tokens` so far) stop strings are not
    /// looked for yet, but text is still held back so one completed later is found whole.
    pub fn feed(&mut self, text: &str, armed: bool) -> Matched {
        if self.stops.is_empty() {
            return Matched::Continue(text.to_owned());
        }
        self.pending.push_str(text);
        if armed
            && let Some((at, stop)) = self
                .stops
                .iter()
                .filter_map(|s| Some((self.pending.find(s.as_str())?, s)))
                .min_by_key(|(at, _)| *at)
        {
            self.matched = Some(stop.clone());
            let mut out = std::mem::take(&mut self.pending);
            out.truncate(at);
            return Matched::Stop(out);
        }
        let hold = self.held_suffix();
        let keep = self.pending.split_off(self.pending.len() - hold);
        Matched::Continue(std::mem::replace(&mut self.pending, keep))
    }

    /// The stop string that ended the text (Anthropic's `stop_sequence`, vLLM's
    /// `stop_reason`), once [`Matched::Stop`] was returned.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// Text held back at the end, when the output ends for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Length in bytes of the longest suffix of `pending` that starts some stop string.
    fn held_suffix(&self) -> usize {
        let p = &self.pending;
        p.char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &p[i..];
                self.stops
                    .iter()
                    .any(|s| s.len() > tail.len() && s.starts_with(tail))
            })
            .map_or(0, |i| p.len() - i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn tokenizer() -> Arc<Tokenizer> {
        crate::model::tests::tiny().tokenizer
    }

    fn table() -> Arc<TokenBytes> {
        static T: std::sync::OnceLock<Arc<TokenBytes>> = std::sync::OnceLock::new();
        T.get_or_init(|| Arc::new(TokenBytes::new(&tokenizer()).expect("byte-level")))
            .clone()
    }

    /// The chunks both ways: Hugging Face decodes, then the byte table.
    fn streams(tok: &Arc<Tokenizer>, ids: &[u32]) -> [Vec<String>; 2] {
        [
            Detokenizer::new(tok.clone()),
            Detokenizer::with_bytes(tok.clone(), table()),
        ]
        .map(|mut d| {
            let mut out: Vec<String> = ids.iter().map(|&id| d.push(id).expect("push")).collect();
            assert_eq!(d.tokens(), ids.len());
            out.push(d.finish().expect("finish"));
            out
        })
    }

    fn stream(tok: &Arc<Tokenizer>, ids: &[u32]) -> Vec<String> {
        let [hf, bytes] = streams(tok, ids);
        assert_eq!(hf.concat(), bytes.concat(), "{ids:?}");
        bytes
    }

    #[test]
    fn byte_table_is_built_only_for_byte_level_decoders() {
        assert!(TokenBytes::new(&tokenizer()).is_some());
        let mut t = (*tokenizer()).clone();
        t.with_decoder(Some(tokenizers::decoders::metaspace::Metaspace::default()));
        assert!(TokenBytes::new(&t).is_none());
    }

    #[test]
    fn invalid_bytes_come_out_as_from_utf8_lossy_does() {
        for bytes in [
            &b"ok \xe6\x97\xa5 then \xe6\x97 cut"[..],
            b"\xff\xfe lone",
            b"end \xf0\x9f\x99",
        ] {
            let mut pending = Vec::new();
            let mut out = String::new();
            for b in bytes {
                pending.push(*b);
                out += &Detokenizer::drain_bytes(&mut pending, false);
            }
            out += &Detokenizer::drain_bytes(&mut pending, true);
            assert_eq!(out, String::from_utf8_lossy(bytes), "{bytes:?}");
        }
    }

    #[test]
    fn multibyte_characters_split_across_tokens_come_out_whole() {
        let tok = tokenizer();
        let text = "café 日本語 🙂 done";
        let ids = tok.encode(text, false).expect("encode").get_ids().to_vec();
        let chunks = stream(&tok, &ids);
        assert_eq!(chunks.concat(), text);
        assert!(
            chunks.iter().all(|c| !c.contains(REPLACEMENT)),
            "{chunks:?}"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn special_tokens_kept_come_out_as_their_text(ids in proptest::collection::vec(0u32..689, 0..40)) {
            let tok = tokenizer();
            let full = tok.decode(&ids, false).expect("decode");
            for d in [Detokenizer::new(tok.clone()), Detokenizer::with_bytes(tok.clone(), table())] {
                let mut d = d.keeping_special(true);
                let mut out: String = ids.iter().map(|&id| d.push(id).expect("push")).collect();
                out += &d.finish().expect("finish");
                prop_assert_eq!(&out, &full);
            }
        }

        #[test]
        fn incremental_equals_full_decode(ids in proptest::collection::vec(0u32..689, 0..60)) {
            let tok = tokenizer();
            let full = tok.decode(&ids, true).expect("decode");
            let chunks = stream(&tok, &ids);
            prop_assert_eq!(chunks.concat(), full.clone());
            if !full.contains(REPLACEMENT) {
                prop_assert!(chunks.iter().all(|c| !c.contains(REPLACEMENT)));
            }
        }

        #[test]
        fn valid_text_never_yields_a_replacement_character(text in "\\PC{0,40}") {
            prop_assume!(!text.contains(REPLACEMENT));
            let tok = tokenizer();
            let ids = tok.encode(text.as_str(), false).expect("encode").get_ids().to_vec();
            let chunks = stream(&tok, &ids);
            prop_assert_eq!(chunks.concat(), text);
            prop_assert!(chunks.iter().all(|c| !c.contains(REPLACEMENT)));
        }

        #[test]
        fn stop_strings_are_found_across_any_split(
            text in "[ab ]{0,30}",
            cuts in proptest::collection::vec(0usize..30, 0..6),
        ) {
            let stop = "ab a";
            let mut m = StopMatcher::new(vec![stop.into()]);
            let mut cuts: Vec<usize> = cuts.into_iter().filter(|&c| c <= text.len()).collect();
            cuts.sort_unstable();
            cuts.push(text.len());
            let (mut out, mut last, mut stopped) = (String::new(), 0, false);
            for c in cuts {
                match m.feed(&text[last..c], true) {
                    Matched::Continue(t) => out.push_str(&t),
                    Matched::Stop(t) => { out.push_str(&t); stopped = true; break; }
                }
                last = c;
            }
            if !stopped { out.push_str(&m.finish()); }
            let expected = text.find(stop).map_or(text.as_str(), |i| &text[..i]);
            prop_assert_eq!(out, expected);
            prop_assert_eq!(stopped, text.contains(stop));
        }
    }

    #[test]
    fn stop_matcher_holds_only_possible_starts() {
        let mut m = StopMatcher::new(vec!["STOP".into(), "éx".into()]);
        assert_eq!(m.feed("hello ST", true), Matched::Continue("hello ".into()));
        assert_eq!(m.feed("ART é", true), Matched::Continue("START ".into()));
        assert_eq!(m.feed("xyz", true), Matched::Stop(String::new()));
        // Before `min_tokens`, a stop string is plain text (as in vLLM).
        let mut m = StopMatcher::new(vec!["end".into()]);
        assert_eq!(
            m.feed("the end", false),
            Matched::Continue("the end".into())
        );
        assert_eq!(m.feed(" more en", true), Matched::Continue(" more ".into()));
        assert_eq!(m.finish(), "en");
    }
}
