//! A bounded cache of tokenized conversation prefixes, so that a turn which extends a
//! conversation tokenizes only what is new.
//!
//! A stateless chat API resends the whole history every turn; an agent's conversation of
//! 40 turns and 32k tokens would be tokenized 40 times over (Dynamo issue 9466). Here, after a
//! chat prompt is tokenized, its tokens up to the last added token (`<|eot_id|>`,
//! `<|im_start|>`, …) are kept under the hash of its messages (and of the scope the caller
//! names: the tenant, the cache salt, the tools). The next turn of the same conversation finds
//! the entry under the hash of its first messages, checks that its own rendered text starts
//! with the text the entry stands for (a hash of that text: a template that renders earlier
//! messages differently once more follow is a miss, not a wrong prompt), and tokenizes only
//! the text after it.
//!
//! Why cutting after an added token gives the tokens a full encode would: tokenizers split
//! the text at added tokens before anything else and encode the pieces between them on their
//! own, so the tokens before the cut do not depend on the text after it. Only added tokens
//! for which that holds are cut points: none that strips the whitespace around it or matches
//! only a single word (its match depends on the text after it), none matched after
//! normalization, none whose text begins another added token's. And each cut point is probed
//! when the cache is made, by encoding texts around it whole and in two parts; a tokenizer
//! that fails (a Metaspace that prefixes only the first piece, say) gets no cache
//! ([`PrefixCache::new`] returns `None`).
//!
//! An entry made from a turn that extended a cached prefix shares that prefix's tokens
//! ([`Pieces`]): a conversation's turns hold its tokens once, not once per turn, and a turn
//! copies only what it added into the cache.
//!
//! Keys and text hashes are seeded per process, so no client can aim a collision. Bounded by
//! entries and by tokens held (each entry counted whole, shared pieces too), least recently
//! used first out.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::num::NonZeroUsize;
use std::sync::Arc;

use dyn_protocol::types::ChatMessage;
use lru::LruCache;
use parking_lot::Mutex;
use tokenizers::AddedToken;
use xxhash_rust::xxh3::{Xxh3, xxh3_64_with_seed};

use crate::encoder::Encoder;

/// The cache of one model and chat template.
pub struct PrefixCache {
    /// The added tokens a tokenization may be cut after: their ids and text.
    added: HashMap<u32, String>,
    /// Seeds every hash: random per process.
    seed: u64,
    max_tokens: usize,
    inner: Mutex<Entries>,
}

struct Entries {
    lru: LruCache<u64, Arc<Entry>>,
    /// Tokens held by every entry together.
    tokens: usize,
}

/// A tokenized prefix: the text's first `cut` bytes, which hash to `text_hash`, encode to
/// `tokens`.
struct Entry {
    cut: usize,
    text_hash: u64,
    tokens: Pieces,
}

/// What a lookup found: the prompt's first `cut` bytes encode to `tokens`.
pub struct Hit {
    pub cut: usize,
    pub tokens: Pieces,
}

/// A prefix's tokens, in the pieces successive turns added: shared between the entries of one
/// conversation.
#[derive(Clone, Default)]
pub struct Pieces {
    parts: Vec<Arc<[u32]>>,
    len: usize,
}

/// Pieces past which an entry's tokens are joined into one (a conversation of many short
/// turns would otherwise make every lookup walk a long list).
const MAX_PIECES: usize = 64;

impl Pieces {
    /// Tokens in all pieces.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many pieces the tokens are kept in.
    pub fn pieces(&self) -> usize {
        self.parts.len()
    }

    /// The tokens, appended to `out`.
    pub fn extend_into(&self, out: &mut Vec<u32>) {
        for p in &self.parts {
            out.extend_from_slice(p);
        }
    }

    /// `whole`, which starts with these pieces' tokens: these pieces and a new one for the
    /// rest (all of `whole` as one piece when there are many).
    fn then(&self, whole: &[u32]) -> Pieces {
        if self.parts.len() >= MAX_PIECES {
            return Pieces::from(whole);
        }
        let mut parts = self.parts.clone();
        let tail = &whole[self.len..];
        if !tail.is_empty() {
            parts.push(tail.into());
        }
        Pieces {
            parts,
            len: whole.len(),
        }
    }
}

impl From<&[u32]> for Pieces {
    fn from(tokens: &[u32]) -> Pieces {
        Pieces {
            parts: vec![tokens.into()],
            len: tokens.len(),
        }
    }
}

impl PrefixCache {
    /// A cache of at most `max_entries` prefixes and `max_tokens` tokens for the tokenizer
    /// behind `encoder`, whose added tokens are `added`; `None` when none of them is a safe
    /// cut point, or the tokenizer cannot be cut after one (see the module docs).
    pub fn new(
        encoder: &Encoder,
        added: impl IntoIterator<Item = (u32, AddedToken)>,
        max_entries: usize,
        max_tokens: usize,
    ) -> Option<Self> {
        let cap = NonZeroUsize::new(max_entries)?;
        let added = cut_points(added);
        if added.is_empty() || max_tokens == 0 || !splits_at_added_tokens(encoder, &added) {
            return None;
        }
        Some(Self {
            added,
            seed: std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish(),
            max_tokens,
            inner: Mutex::new(Entries {
                lru: LruCache::new(cap),
                tokens: 0,
            }),
        })
    }

    /// The key of each prefix of `messages` (`keys[k]`: the first `k` messages) within
    /// `scope`. One pass over the messages' bytes.
    pub fn keys(&self, scope: &[&[u8]], messages: &[ChatMessage]) -> Vec<u64> {
        let mut h = Xxh3::with_seed(self.seed);
        for part in scope {
            feed(&mut h, part);
        }
        let mut keys = Vec::with_capacity(messages.len() + 1);
        keys.push(h.digest());
        for m in messages {
            feed(&mut h, m.role.as_bytes());
            feed(&mut h, m.content.as_bytes());
            let calls = m.tool_calls.as_ref().map(|c| c.to_string());
            for part in [
                calls.as_deref(),
                m.tool_call_id.as_deref(),
                m.name.as_deref(),
            ] {
                match part {
                    Some(p) => feed(&mut h, p.as_bytes()),
                    None => h.update(&[0xff]),
                }
            }
            keys.push(h.digest());
        }
        keys
    }

    /// The longest cached prefix of the conversation whose prefix keys are `keys` (its whole
    /// self excluded) and whose rendered prompt is `text`.
    pub fn lookup(&self, keys: &[u64], text: &str) -> Option<Hit> {
        let found: Vec<Arc<Entry>> = {
            let mut inner = self.inner.lock();
            let last = keys.len().saturating_sub(1);
            keys[..last]
                .iter()
                .rev()
                .filter_map(|k| inner.lru.get(k).cloned())
                .collect()
        };
        // Hashed outside the lock; a prefix the template rendered otherwise this time is passed
        // over for a shorter one.
        found.into_iter().find_map(|e| {
            let prefix = text.as_bytes().get(..e.cut)?;
            (xxh3_64_with_seed(prefix, self.seed) == e.text_hash).then(|| Hit {
                cut: e.cut,
                tokens: e.tokens.clone(),
            })
        })
    }

    /// Keep `tokens`, the encoding of `text`, up to its last added token, under `key`; `base`
    /// is the hit they were made from (their first tokens), whose pieces the entry shares.
    pub fn insert(&self, key: u64, text: &str, tokens: &[u32], base: Option<&Pieces>) {
        let Some((i, content)) = tokens
            .iter()
            .enumerate()
            .rev()
            .find_map(|(i, t)| Some((i, self.added.get(t)?)))
        else {
            return;
        };
        // No added token follows token `i`, so its text is the last occurrence of its content
        // — when every occurrence of that content was encoded as the token (an added token
        // with `lstrip` or `single_word` rules may leave one as text, and then the cut would
        // not be where token `i` ends).
        let id = tokens[i];
        if text.matches(content.as_str()).count() != tokens.iter().filter(|&&t| t == id).count() {
            return;
        }
        let Some(start) = text.rfind(content.as_str()) else {
            return;
        };
        let cut = start + content.len();
        let kept = &tokens[..=i];
        let tokens = match base {
            Some(b) if b.len() <= kept.len() => b.then(kept),
            _ => Pieces::from(kept),
        };
        let entry = Arc::new(Entry {
            cut,
            text_hash: xxh3_64_with_seed(&text.as_bytes()[..cut], self.seed),
            tokens,
        });
        let held = entry.tokens.len();
        if held > self.max_tokens {
            return;
        }
        let mut inner = self.inner.lock();
        if let Some((_, old)) = inner.lru.push(key, entry) {
            inner.tokens -= old.tokens.len();
        }
        inner.tokens += held;
        while inner.tokens > self.max_tokens {
            match inner.lru.pop_lru() {
                Some((_, old)) => inner.tokens -= old.tokens.len(),
                None => break,
            }
        }
    }

    /// Entries and tokens held (for tests and logs).
    pub fn held(&self) -> (usize, usize) {
        let inner = self.inner.lock();
        (inner.lru.len(), inner.tokens)
    }
}

/// A part of a key, length first so that no two sequences of parts feed the same bytes.
fn feed(h: &mut Xxh3, bytes: &[u8]) {
    h.update(&(bytes.len() as u64).to_le_bytes());
    h.update(bytes);
}

/// The added tokens after which a text may be cut: matched as they are (not normalized),
/// whatever stands next to them (no whitespace stripping, not a single word only), and not
/// the beginning of another added token's text.
fn cut_points(added: impl IntoIterator<Item = (u32, AddedToken)>) -> HashMap<u32, String> {
    let added: Vec<(u32, AddedToken)> = added.into_iter().collect();
    let contents: Vec<String> = added.iter().map(|(_, t)| t.content.clone()).collect();
    added
        .into_iter()
        .filter(|(_, t)| {
            let plain =
                !(t.content.is_empty() || t.normalized || t.lstrip || t.rstrip || t.single_word);
            let begins_another = contents
                .iter()
                .any(|c| c.len() > t.content.len() && c.starts_with(&t.content));
            plain && !begins_another
        })
        .map(|(id, t)| (id, t.content))
        .collect()
}

/// Whether encoding a text in two parts cut right after an added token gives the tokens of
/// encoding it whole, on probe texts around every cut point.
fn splits_at_added_tokens(encoder: &Encoder, added: &HashMap<u32, String>) -> bool {
    const AROUND: &[(&str, &str)] = &[
        ("Hello there.", " How are you?"),
        ("line one\n", "\n\nline two"),
        ("x", "y"),
        ("  spaced  ", "  out  "),
        ("", "Start"),
        ("end", ""),
    ];
    added.values().all(|tok| {
        AROUND.iter().all(|(before, after)| {
            let head = format!("{before}{tok}");
            let whole = format!("{head}{after}");
            match (
                encoder.encode(&whole, false),
                encoder.encode(&head, false),
                encoder.encode(after, false),
            ) {
                (Ok(w), Ok(mut h), Ok(a)) => {
                    h.extend(a);
                    w == h
                }
                _ => false,
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A token whose match depends on what follows it (stripping, single word, normalized,
    /// or the beginning of a longer token) is never a cut point.
    #[test]
    fn only_tokens_matched_whatever_follows_are_cut_points() {
        let t = |s: &str| AddedToken::from(s, true);
        let added = [
            (1, t("<|eot_id|>")),
            (2, t("<|end|>").rstrip(true)),
            (3, t("<|start|>").lstrip(true)),
            (4, t("word").single_word(true)),
            (5, t("<n>").normalized(true)),
            (6, t("  ")),
            (7, t("   ")),
            (8, t("")),
        ];
        let cuts = cut_points(added);
        let mut kept: Vec<&str> = cuts.values().map(String::as_str).collect();
        kept.sort();
        assert_eq!(kept, ["   ", "<|eot_id|>"]);
    }
}
