//! The hit rate a cache-perfect router would reach on a workload: the yardstick for a KV-aware
//! router's achieved prefix-cache hit rate.
//!
//! [`hit_rate`] replays the entries in send order over `workers` caches of `blocks` blocks of
//! `block_size` tokens each (LRU, as the engines evict): every request goes to the worker
//! caching the longest prefix of its prompt, a prompt nobody caches to the emptiest cache (so
//! each shared prefix lives on one worker and the working set spreads). Load is ignored and
//! so are the blocks requests hold while they run: it is the hit rate of routing on cache
//! alone, the ceiling a router trading cache against load approaches where the caches hold
//! the working set. A block is shared when it lies wholly inside the entry's shared units
//! ([`crate::dataset::Shared`]); the rest of the prompt is unique to the request. Templates
//! the server adds around a prompt shift its blocks by a few tokens, so the servers' own
//! figures differ slightly.

use std::collections::{BTreeMap, HashMap};

use crate::dataset::Entry;

/// One worker's LRU cache of block ids.
#[derive(Default)]
struct Lru {
    /// Block → last use; use → block (oldest first).
    at: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
}

impl Lru {
    fn touch(&mut self, block: u64, clock: u64) {
        if let Some(old) = self.at.insert(block, clock) {
            self.order.remove(&old);
        }
        self.order.insert(clock, block);
    }

    fn evict_to(&mut self, capacity: usize) {
        while self.at.len() > capacity {
            let Some((_, block)) = self.order.pop_first() else {
                break;
            };
            self.at.remove(&block);
        }
    }
}

/// Block ids of an entry's prompt: shared blocks named by their units' ids and position,
/// the others unique to entry `n`.
fn blocks(e: &Entry, n: usize, block_size: usize) -> Vec<u64> {
    let tokens = e
        .input_tokens
        .unwrap_or(e.shared.ids.len() * e.shared.unit)
        .max(1);
    let shared_tokens = (e.shared.ids.len() * e.shared.unit).min(tokens);
    (0..tokens / block_size)
        .map(|k| {
            let end = (k + 1) * block_size;
            if end <= shared_tokens && e.shared.unit > 0 {
                // The id of the unit holding the block's last token names its whole prefix.
                let unit = e.shared.ids[(end - 1) / e.shared.unit];
                mix(unit ^ 0x5bd1_e995, k as u64)
            } else {
                mix(!(n as u64), k as u64)
            }
        })
        .collect()
}

fn mix(a: u64, b: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64(&[a.to_le_bytes(), b.to_le_bytes()].concat())
}

/// Fraction of full prompt blocks found cached, routing `entries` in order.
pub fn hit_rate<'a>(
    entries: impl IntoIterator<Item = &'a Entry>,
    workers: usize,
    capacity: usize,
    block_size: usize,
) -> f64 {
    let workers = workers.max(1);
    let block_size = block_size.max(1);
    let mut caches: Vec<Lru> = (0..workers).map(|_| Lru::default()).collect();
    let (mut total, mut hits, mut clock) = (0u64, 0u64, 0u64);
    for (n, e) in entries.into_iter().enumerate() {
        let ids = blocks(e, n, block_size);
        let held = |c: &Lru| ids.iter().take_while(|b| c.at.contains_key(b)).count();
        let (w, hit) = caches
            .iter()
            .enumerate()
            .map(|(w, c)| (w, held(c)))
            .max_by_key(|&(w, h)| (h, std::cmp::Reverse(caches[w].at.len())))
            .unwrap_or((0, 0));
        total += ids.len() as u64;
        hits += hit as u64;
        for b in &ids {
            clock += 1;
            caches[w].touch(*b, clock);
        }
        caches[w].evict_to(capacity);
    }
    if total == 0 {
        0.0
    } else {
        hits as f64 / total as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::{Prompt, Shared};

    fn entry(group: Option<u64>, prefix: usize, tokens: usize) -> Entry {
        Entry {
            prompt: Prompt::Text(String::new()),
            input_tokens: Some(tokens),
            output_tokens: 1,
            at: None,
            shared: group.map_or_else(Shared::default, |g| Shared {
                ids: vec![g],
                unit: prefix,
            }),
            session: None,
        }
    }

    #[test]
    fn each_prefix_misses_once_where_the_caches_hold_them_all() {
        // 8 groups × 4 blocks of prefix + 1 unique block, 64 requests, room for everything.
        let entries: Vec<Entry> = (0..64).map(|i| entry(Some(i % 8), 64, 80)).collect();
        let r = hit_rate(&entries, 4, 1000, 16);
        // 56 repeats × 4 of 5 blocks.
        assert!((r - 56.0 * 4.0 / (64.0 * 5.0)).abs() < 1e-9, "{r}");
        // Unrelated prompts never hit.
        let cold: Vec<Entry> = (0..10).map(|_| entry(None, 0, 64)).collect();
        assert_eq!(hit_rate(&cold, 4, 1000, 16), 0.0);
    }

    #[test]
    fn caches_too_small_for_the_working_set_lose_hits() {
        let entries: Vec<Entry> = (0..400)
            .map(|i| entry(Some((i * 7919) % 40), 160, 176))
            .collect();
        let roomy = hit_rate(&entries, 4, 1000, 16);
        let tight = hit_rate(&entries, 4, 30, 16);
        assert!(roomy > 0.8 && tight < roomy / 2.0, "{roomy} {tight}");
    }

    #[test]
    fn trace_ids_share_blocks_up_to_where_they_differ() {
        let trace = |ids: Vec<u64>| Entry {
            shared: Shared { ids, unit: 32 },
            ..entry(None, 0, 96)
        };
        // Same first unit, different second: 2 of 6 blocks hit on the second request.
        let r = hit_rate(&[trace(vec![1, 2, 3]), trace(vec![1, 9, 3])], 2, 100, 16);
        assert!((r - 2.0 / 12.0).abs() < 1e-9, "{r}");
    }
}
