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
//! [`StopMatcher`] holds back text that could be the start of a stop string, so a stop string
//! split across deltas is still found and never sent to the client.

use std::sync::Arc;

use tokenizers::Tokenizer;

const REPLACEMENT: char = '\u{FFFD}';

pub struct Detokenizer {
    tokenizer: Arc<Tokenizer>,
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
    skip_special: bool,
}

impl Detokenizer {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Self {
            tokenizer,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            skip_special: true,
        }
    }

    fn decode(&self, ids: &[u32]) -> Result<String, tokenizers::Error> {
        self.tokenizer.decode(ids, self.skip_special)
    }

    /// Add one token; returns the text that became final (often empty mid-character).
    pub fn push(&mut self, id: u32) -> Result<String, tokenizers::Error> {
        self.ids.push(id);
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
            && let Some(at) = self
                .stops
                .iter()
                .filter_map(|s| self.pending.find(s.as_str()))
                .min()
        {
            let mut out = std::mem::take(&mut self.pending);
            out.truncate(at);
            return Matched::Stop(out);
        }
        let hold = self.held_suffix();
        let keep = self.pending.split_off(self.pending.len() - hold);
        Matched::Continue(std::mem::replace(&mut self.pending, keep))
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
        crate::llm::model::tests::tiny().tokenizer
    }

    fn stream(tok: &Arc<Tokenizer>, ids: &[u32]) -> Vec<String> {
        let mut d = Detokenizer::new(tok.clone());
        let mut out: Vec<String> = ids.iter().map(|&id| d.push(id).expect("push")).collect();
        out.push(d.finish().expect("finish"));
        out
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
