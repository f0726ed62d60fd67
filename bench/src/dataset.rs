//! What the benchmark sends: synthetic prompts of a chosen length (optionally in shared-prefix
//! groups), a Mooncake trace replayed on its own timestamps, or a JSONL file of chat messages.
//!
//! Synthetic text is a sequence of " word" pieces. With `--tokenizer`, the pieces are the
//! tokenizer's own vocabulary entries that are one token each and never merge with a
//! neighbour (byte-level BPE and SentencePiece split before every space), so a prompt of N
//! pieces is N tokens; every prompt is still encoded once and trimmed or padded until its
//! length is exact. Without a tokenizer a built-in list of common English words stands in and
//! lengths are approximate (about one token per word).

use std::path::{Path, PathBuf};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};
use serde::Deserialize;
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::Error;

/// The prompt of one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Plain text: the user message of a chat request, or a completion prompt.
    Text(String),
    /// A full chat message list (from a prompts file); chat endpoint only.
    Messages(Vec<Value>),
}

/// One request to send.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub prompt: Prompt,
    /// Prompt length in tokens when the dataset knows it exactly.
    pub input_tokens: Option<usize>,
    /// `max_tokens` for this request.
    pub output_tokens: u32,
    /// Send time relative to the start of the run (trace replay only).
    pub at: Option<Duration>,
    /// Where the prompt shares a prefix with others: it opens with `ids.len()` units of
    /// `unit` tokens, equal ids at a position naming the same text up to there (a Mooncake
    /// trace's hash ids, a prefix group). What the cache [`crate::oracle`] works from.
    pub shared: Shared,
    /// The conversation it is a turn of (a trace's `session_id`): sent as `x-session-id`.
    pub session: Option<String>,
}

/// A prompt's shared leading units (see [`Entry::shared`]); empty for unrelated prompts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Shared {
    pub ids: Vec<u64>,
    pub unit: usize,
}

/// Synthetic prompt settings.
#[derive(Debug, Clone)]
pub struct Synthetic {
    pub isl: usize,
    pub isl_stddev: f64,
    pub osl: u32,
    pub osl_stddev: f64,
    /// Each request belongs to one of this many groups, drawn at random; a group's prompts
    /// share their first `prefix_len` tokens. 0 = no shared prefixes.
    pub prefix_groups: usize,
    pub prefix_len: usize,
    /// Seed of the prefixes' text (default: the run's seed), so clients with different seeds
    /// can share the same prefixes.
    pub prefix_seed: Option<u64>,
}

/// Where entries come from.
#[derive(Debug, Clone)]
pub enum Source {
    Synthetic(Synthetic),
    /// A Mooncake trace, `speed` times faster than recorded, `block_size` tokens per hash id.
    Trace {
        path: PathBuf,
        speed: f64,
        block_size: usize,
    },
    /// A JSONL prompts file; `osl` where a line gives no `max_tokens`.
    Prompts {
        path: PathBuf,
        osl: u32,
    },
}

impl Source {
    /// The entries: `count` synthetic ones, or every line of a file.
    pub fn load(&self, words: &Words, count: usize, seed: u64) -> Result<Vec<Entry>, Error> {
        match self {
            Source::Synthetic(s) => synthetic(s, words, count, seed),
            Source::Trace {
                path,
                speed,
                block_size,
            } => trace(path, *speed, *block_size, words, seed),
            Source::Prompts { path, osl } => prompts_file(path, *osl),
        }
    }
}

/// Builds text of an exact token length from single-token " word" pieces.
pub struct Words {
    pieces: Vec<String>,
    tokenizer: Option<Tokenizer>,
}

/// Common English words, each usually one token: the stand-in vocabulary without a tokenizer.
const FALLBACK_WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "time", "out", "up", "into",
    "some", "could", "them", "other", "than", "then", "only", "its", "two", "first", "new", "made",
    "work", "way", "many", "may", "like", "over", "such", "also", "most", "after",
];

impl Words {
    /// The built-in word list; lengths are approximate.
    pub fn approximate() -> Self {
        Self {
            pieces: FALLBACK_WORDS.iter().map(|w| format!(" {w}")).collect(),
            tokenizer: None,
        }
    }

    /// Pieces from `DIR/tokenizer.json` (or a tokenizer.json path); lengths are exact.
    pub fn from_tokenizer(path: &Path) -> Result<Self, Error> {
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        let tokenizer = Tokenizer::from_file(&file).map_err(|e| Error::Tokenizer {
            path: file.clone(),
            message: e.to_string(),
        })?;
        let mut pieces = Vec::new();
        for id in 0..tokenizer.get_vocab_size(true) as u32 {
            let Ok(s) = tokenizer.decode(&[id], true) else {
                continue;
            };
            let Some(word) = s.strip_prefix(' ') else {
                continue;
            };
            if !(2..=10).contains(&word.len()) || !word.bytes().all(|b| b.is_ascii_lowercase()) {
                continue;
            }
            if let Ok(enc) = tokenizer.encode(s.as_str(), false)
                && enc.get_ids() == [id]
            {
                pieces.push(s);
            }
        }
        if pieces.len() < 16 {
            return Err(Error::Tokenizer {
                path: file,
                message: format!(
                    "only {} single-token words in its vocabulary; cannot build prompts",
                    pieces.len()
                ),
            });
        }
        Ok(Self {
            pieces,
            tokenizer: Some(tokenizer),
        })
    }

    /// The tokenizer, when there is one.
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    /// Whether lengths are exact (a tokenizer is loaded).
    pub fn is_exact(&self) -> bool {
        self.tokenizer.is_some()
    }

    /// `n` random pieces.
    pub fn random(&self, rng: &mut impl Rng, n: usize, out: &mut String) {
        for _ in 0..n {
            out.push_str(&self.pieces[rng.random_range(0..self.pieces.len())]);
        }
    }

    /// Count tokens of `text` (None without a tokenizer).
    pub fn count(&self, text: &str) -> Option<usize> {
        let tok = self.tokenizer.as_ref()?;
        tok.encode_fast(text, false).ok().map(|e| e.len())
    }

    /// Make `text` exactly `n` tokens by dropping or adding pieces at its end. Pieces never
    /// merge in the tokenizers this is meant for, so one pass is enough; a few more guard
    /// against one that does.
    pub fn fix_length(&self, text: &mut String, n: usize, rng: &mut impl Rng) -> Result<(), Error> {
        let Some(_) = &self.tokenizer else {
            return Ok(());
        };
        for _ in 0..8 {
            let have = self.count(text).unwrap_or(0);
            if have == n {
                return Ok(());
            }
            if have > n {
                for _ in 0..have - n {
                    match text.rfind(' ') {
                        Some(i) => text.truncate(i),
                        None => text.clear(),
                    }
                }
            } else {
                self.random(rng, n - have, text);
            }
        }
        Err(Error::Invalid(format!(
            "cannot build a prompt of exactly {n} tokens with this tokenizer"
        )))
    }
}

fn sample_len(rng: &mut StdRng, mean: f64, stddev: f64) -> usize {
    if stddev <= 0.0 {
        return mean.round().max(1.0) as usize;
    }
    let v = Normal::new(mean, stddev).map_or(mean, |d| d.sample(rng));
    v.round().max(1.0) as usize
}

/// `count` synthetic entries. Entry `i` is drawn from a generator seeded by (seed, i), so the
/// same arguments give the same prompts.
pub fn synthetic(
    s: &Synthetic,
    words: &Words,
    count: usize,
    seed: u64,
) -> Result<Vec<Entry>, Error> {
    if s.prefix_groups > 0 && s.prefix_len == 0 {
        return Err(Error::Invalid(
            "--prefix-groups needs --prefix-len (the shared prefix length in tokens)".into(),
        ));
    }
    let prefixes: Vec<String> = (0..s.prefix_groups)
        .map(|g| {
            let base = s.prefix_seed.unwrap_or(seed);
            let mut rng = StdRng::seed_from_u64(base ^ 0x9e37_79b9_7f4a_7c15 ^ g as u64);
            let mut p = String::new();
            words.random(&mut rng, s.prefix_len, &mut p);
            p
        })
        .collect();
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        let mut rng = StdRng::seed_from_u64(seed.wrapping_add(i as u64));
        // A random group, not `i % groups`: a fixed rotation would line up with a
        // round-robin router over a divisor of the group count and fake perfect affinity.
        let group = (!prefixes.is_empty()).then(|| rng.random_range(0..prefixes.len()));
        let mut isl = sample_len(&mut rng, s.isl as f64, s.isl_stddev);
        let osl = sample_len(&mut rng, s.osl as f64, s.osl_stddev) as u32;
        let mut text = String::new();
        if let Some(prefix) = group.map(|g| &prefixes[g]) {
            isl = isl.max(s.prefix_len);
            text.push_str(prefix);
            words.random(&mut rng, isl - s.prefix_len, &mut text);
        } else {
            words.random(&mut rng, isl, &mut text);
        }
        words.fix_length(&mut text, isl, &mut rng)?;
        out.push(Entry {
            prompt: Prompt::Text(text),
            input_tokens: words.is_exact().then_some(isl),
            output_tokens: osl.max(1),
            at: None,
            shared: group.map_or_else(Shared::default, |g| Shared {
                ids: vec![g as u64],
                unit: s.prefix_len,
            }),
            session: None,
        });
    }
    Ok(out)
}

/// One line of a Mooncake trace, as Mooncake, Dynamo and AIPerf write them: `timestamp` may be
/// left out on a session's later turns, which then follow the previous turn by `delay` ms
/// (or on the previous line's timestamp); `text_input` replaces the synthetic text.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TraceLine {
    /// Milliseconds from the start of the trace.
    #[serde(default)]
    timestamp: Option<f64>,
    #[serde(default)]
    input_length: Option<usize>,
    output_length: u32,
    #[serde(default)]
    hash_ids: Vec<u64>,
    #[serde(default)]
    session_id: Option<Value>,
    #[serde(default)]
    delay: Option<f64>,
    #[serde(default)]
    text_input: Option<String>,
}

/// Replay a Mooncake trace: each line is one request at `timestamp / speed` milliseconds;
/// its prompt is the blocks named by `hash_ids` (each id maps to the same `block_size` tokens
/// everywhere, so equal ids share a prefix), cut or extended to `input_length` tokens.
pub fn trace(
    path: &Path,
    speed: f64,
    block_size: usize,
    words: &Words,
    seed: u64,
) -> Result<Vec<Entry>, Error> {
    if !(speed.is_finite() && speed > 0.0) {
        return Err(Error::Invalid(format!(
            "--trace-speed must be a positive number, got {speed}"
        )));
    }
    if block_size == 0 {
        return Err(Error::Invalid(
            "the trace block size must be positive".into(),
        ));
    }
    let text = read(path)?;
    let mut blocks: std::collections::HashMap<u64, String> = Default::default();
    let mut sessions: std::collections::HashMap<String, f64> = Default::default();
    let mut out = Vec::new();
    let mut first = None;
    let mut previous = 0.0;
    for (n, line) in jsonl(&text) {
        let bad = line_error(path, n);
        let t: TraceLine = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        // A string id as it is, another JSON value (a number) as its JSON.
        let session = t.session_id.as_ref().map(|v| match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        });
        let after = session.as_ref().and_then(|s| sessions.get(s)).copied();
        let timestamp = match (t.timestamp, t.delay) {
            (Some(ts), _) => ts,
            (None, delay) => after.unwrap_or(previous) + delay.unwrap_or(0.0),
        };
        if !(timestamp.is_finite() && timestamp >= 0.0) {
            return Err(bad(format!("bad timestamp {timestamp}")));
        }
        if let Some(s) = &session {
            sessions.insert(s.clone(), timestamp);
        }
        previous = timestamp;
        let input_length = match (&t.text_input, t.input_length) {
            (_, Some(n)) => n,
            (Some(_), None) => 1,
            (None, None) => return Err(bad("input_length (or text_input) is required".into())),
        };
        if input_length == 0 || t.output_length == 0 {
            return Err(bad("input_length and output_length must be positive".into()));
        }
        let start = *first.get_or_insert(timestamp);
        if timestamp < start {
            return Err(bad(format!(
                "timestamp {timestamp} is before the first line's {start}; the trace must be sorted"
            )));
        }
        let ms = (timestamp - start) / speed;
        let at = Some(Duration::try_from_secs_f64(ms / 1000.0).unwrap_or(Duration::MAX));
        let shared = Shared {
            ids: t.hash_ids.clone(),
            unit: block_size,
        };
        if let Some(text) = t.text_input {
            out.push(Entry {
                input_tokens: t.input_length.filter(|_| words.is_exact()),
                prompt: Prompt::Text(text),
                output_tokens: t.output_length,
                at,
                shared,
                session,
            });
            continue;
        }
        let mut prompt = String::new();
        for id in &t.hash_ids {
            let block = blocks.entry(*id).or_insert_with(|| {
                let mut rng = StdRng::seed_from_u64(seed ^ id.wrapping_mul(0x2545_f491_4f6c_dd1d));
                let mut b = String::new();
                words.random(&mut rng, block_size, &mut b);
                b
            });
            prompt.push_str(block);
        }
        let mut rng = StdRng::seed_from_u64(seed.wrapping_add(n as u64));
        let covered = t.hash_ids.len() * block_size;
        if covered > input_length {
            // Cut the last block: drop whole pieces from the end.
            for _ in 0..covered - input_length {
                if let Some(i) = prompt.rfind(' ') {
                    prompt.truncate(i);
                }
            }
        } else {
            words.random(&mut rng, input_length - covered, &mut prompt);
        }
        words.fix_length(&mut prompt, input_length, &mut rng)?;
        out.push(Entry {
            prompt: Prompt::Text(prompt),
            input_tokens: words.is_exact().then_some(input_length),
            output_tokens: t.output_length,
            at,
            shared,
            session,
        });
    }
    if out.is_empty() {
        return Err(Error::Invalid(format!(
            "{}: the trace is empty",
            path.display()
        )));
    }
    // Turns timed by their session's delay may fall between later lines.
    out.sort_by_key(|e| e.at);
    Ok(out)
}

/// A prompts file: one JSON value per line, either `{"messages": [...], "max_tokens": N}`
/// (`max_tokens` optional), a bare message list, or `{"text": "..."}`.
pub fn prompts_file(path: &Path, osl: u32) -> Result<Vec<Entry>, Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Line {
        Messages {
            messages: Vec<Value>,
            #[serde(default)]
            max_tokens: Option<u32>,
        },
        Text {
            text: String,
            #[serde(default)]
            max_tokens: Option<u32>,
        },
        Bare(Vec<Value>),
    }
    let text = read(path)?;
    let mut out = Vec::new();
    for (n, line) in jsonl(&text) {
        let bad = line_error(path, n);
        let parsed: Line = serde_json::from_str(line).map_err(|e| {
            bad(format!(
                "expected {{\"messages\": [...]}}, {{\"text\": \"...\"}} or a message list ({e})"
            ))
        })?;
        let (prompt, max) = match parsed {
            Line::Messages {
                messages,
                max_tokens,
            } => (Prompt::Messages(messages), max_tokens),
            Line::Bare(messages) => (Prompt::Messages(messages), None),
            Line::Text { text, max_tokens } => (Prompt::Text(text), max_tokens),
        };
        if let Prompt::Messages(m) = &prompt
            && (m.is_empty() || !m.iter().all(|v| v.get("role").is_some()))
        {
            return Err(bad(
                "every message needs a \"role\"; the list may not be empty".into(),
            ));
        }
        out.push(Entry {
            prompt,
            input_tokens: None,
            output_tokens: max.unwrap_or(osl).max(1),
            at: None,
            shared: Shared::default(),
            session: None,
        });
    }
    if out.is_empty() {
        return Err(Error::Invalid(format!("{}: no prompts", path.display())));
    }
    Ok(out)
}

/// The non-blank lines of a JSONL file with their 1-based numbers.
fn jsonl(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| (i + 1, l))
}

/// Makes the error for line `line` of `path`.
fn line_error(path: &Path, line: usize) -> impl Fn(String) -> Error + '_ {
    move |message| Error::Line {
        path: path.to_path_buf(),
        line,
        message,
    }
}

fn read(path: &Path) -> Result<String, Error> {
    std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: PathBuf::from(path),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny_tokenizer() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tiny")
    }

    fn write(name: &str, body: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("dyn-bench-{}-{name}", std::process::id()));
        std::fs::write(&dir, body).unwrap();
        dir
    }

    fn synth(isl: usize, groups: usize, prefix: usize) -> Synthetic {
        Synthetic {
            isl,
            isl_stddev: 0.0,
            osl: 8,
            osl_stddev: 0.0,
            prefix_groups: groups,
            prefix_len: prefix,
            prefix_seed: None,
        }
    }

    fn text(e: &Entry) -> &str {
        match &e.prompt {
            Prompt::Text(t) => t,
            Prompt::Messages(_) => panic!("messages"),
        }
    }

    #[test]
    fn synthetic_lengths_are_exact_with_a_tokenizer() {
        let words = Words::from_tokenizer(&tiny_tokenizer()).unwrap();
        for isl in [1, 7, 64, 300] {
            let entries = synthetic(&synth(isl, 0, 0), &words, 5, 1).unwrap();
            for e in &entries {
                assert_eq!(words.count(text(e)), Some(isl));
                assert_eq!(e.input_tokens, Some(isl));
                assert_eq!(e.output_tokens, 8);
            }
        }
    }

    #[test]
    fn prefix_groups_share_exactly_their_prefix() {
        let words = Words::from_tokenizer(&tiny_tokenizer()).unwrap();
        let e = synthetic(&synth(100, 2, 40), &words, 20, 1).unwrap();
        let tok = words.tokenizer.as_ref().unwrap();
        let ids: Vec<Vec<u32>> = e
            .iter()
            .map(|e| tok.encode(text(e), false).unwrap().get_ids().to_vec())
            .collect();
        let prefixes: std::collections::HashSet<&[u32]> = ids.iter().map(|i| &i[..40]).collect();
        assert_eq!(prefixes.len(), 2, "two groups, both used");
        let suffixes: std::collections::HashSet<&[u32]> = ids.iter().map(|i| &i[40..]).collect();
        assert_eq!(suffixes.len(), 20, "suffixes differ");
    }

    #[test]
    fn stddev_varies_lengths_and_stays_positive() {
        let words = Words::approximate();
        let mut s = synth(4, 0, 0);
        s.isl_stddev = 10.0;
        s.osl_stddev = 10.0;
        let e = synthetic(&s, &words, 200, 1).unwrap();
        assert!(
            e.iter()
                .all(|e| e.output_tokens >= 1 && !text(e).is_empty())
        );
        let distinct: std::collections::HashSet<_> = e.iter().map(|e| e.output_tokens).collect();
        assert!(distinct.len() > 5);
    }

    #[test]
    fn trace_blocks_map_hash_ids_to_shared_prefixes() {
        let words = Words::from_tokenizer(&tiny_tokenizer()).unwrap();
        let path = write(
            "trace.jsonl",
            r#"{"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]}
{"timestamp": 1500, "input_length": 600, "output_length": 7, "hash_ids": [1, 9]}

{"timestamp": 3000, "input_length": 20, "output_length": 1, "hash_ids": [4]}
"#,
        );
        let e = trace(&path, 2.0, 512, &words, 0).unwrap();
        assert_eq!(e.len(), 3);
        assert_eq!(
            e.iter()
                .map(|e| e.at.unwrap().as_millis())
                .collect::<Vec<_>>(),
            [0, 250, 1000],
            "timestamps relative to the first, divided by the speed"
        );
        let tok = words.tokenizer.as_ref().unwrap();
        let ids: Vec<Vec<u32>> = e
            .iter()
            .map(|e| tok.encode(text(e), false).unwrap().get_ids().to_vec())
            .collect();
        assert_eq!(
            ids.iter().map(Vec::len).collect::<Vec<_>>(),
            [1100, 600, 20]
        );
        assert_eq!(ids[0][..512], ids[1][..512], "hash id 1 is the same block");
        assert_ne!(ids[0][512..600], ids[1][512..600], "ids 2 and 9 differ");
        assert_eq!(e[1].output_tokens, 7);
    }

    #[test]
    fn dynamo_and_aiperf_trace_fields_are_read() {
        let words = Words::approximate();
        // A session's later turns carry `delay` instead of `timestamp`; `text_input` is the
        // prompt itself.
        let path = write(
            "sessions.jsonl",
            r#"{"session_id": "a", "timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [1]}
{"session_id": "b", "timestamp": 100, "input_length": 40, "output_length": 2, "hash_ids": [2]}
{"session_id": "a", "delay": 500, "input_length": 80, "output_length": 2, "hash_ids": [1, 3]}
{"session_id": 7, "timestamp": 200, "text_input": "hello there", "output_length": 3}
"#,
        );
        let e = trace(&path, 1.0, 32, &words, 0).unwrap();
        let at: Vec<u128> = e.iter().map(|e| e.at.unwrap().as_millis()).collect();
        assert_eq!(at, [0, 100, 200, 500], "sorted by send time");
        assert_eq!(text(&e[2]), "hello there");
        assert_eq!(e[3].shared.ids, [1, 3]);
        assert_eq!(e[3].shared.unit, 32);
        let sessions: Vec<Option<&str>> = e.iter().map(|e| e.session.as_deref()).collect();
        assert_eq!(sessions, [Some("a"), Some("b"), Some("7"), Some("a")]);
        let path = write(
            "no-length.jsonl",
            r#"{"timestamp": 0, "output_length": 2}
"#,
        );
        let err = trace(&path, 1.0, 32, &words, 0).unwrap_err().to_string();
        assert!(err.contains("no-length.jsonl:1: input_length"), "{err}");
    }

    #[test]
    fn bad_trace_line_names_the_line() {
        let words = Words::approximate();
        let path = write(
            "bad-trace.jsonl",
            "{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1}\n{\"timestamp\": 1, \"input_length\": \"x\"}\n",
        );
        let err = trace(&path, 1.0, 512, &words, 0).unwrap_err().to_string();
        assert!(err.contains("bad-trace.jsonl:2: invalid type"), "{err}");
        let path = write(
            "unsorted.jsonl",
            "{\"timestamp\": 5, \"input_length\": 4, \"output_length\": 1}\n{\"timestamp\": 1, \"input_length\": 4, \"output_length\": 1}\n",
        );
        let err = trace(&path, 1.0, 512, &words, 0).unwrap_err().to_string();
        assert!(
            err.contains("unsorted.jsonl:2: timestamp 1 is before"),
            "{err}"
        );
        let err = trace(Path::new("/nonexistent.jsonl"), 1.0, 512, &words, 0)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("/nonexistent.jsonl: "), "{err}");
    }

    #[test]
    fn prompts_file_shapes_and_errors() {
        let path = write(
            "prompts.jsonl",
            r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
{"text": "once upon"}
"#,
        );
        let e = prompts_file(&path, 9).unwrap();
        assert_eq!(e.len(), 3);
        assert_eq!(e[0].output_tokens, 3);
        assert_eq!(e[1].output_tokens, 9);
        assert!(matches!(&e[1].prompt, Prompt::Messages(m) if m.len() == 2));
        assert_eq!(e[2].prompt, Prompt::Text("once upon".into()));
        let path = write(
            "bad-prompts.jsonl",
            "[{\"role\": \"user\"}]\n{\"messages\": 3}\n",
        );
        let err = prompts_file(&path, 1).unwrap_err().to_string();
        assert!(err.contains("bad-prompts.jsonl:2: expected"), "{err}");
    }
}
