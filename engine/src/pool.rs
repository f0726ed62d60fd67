//! The mocker's paged KV block pool with prefix caching, modelled on vLLM's.
//!
//! A block is *active* while a sequence holds it (reference counted, so sequences sharing a
//! prefix share blocks), *cached* when no one holds it but it still has a sequence hash and
//! can be reused by a later prompt with the same prefix, or *empty*. New blocks come from the
//! empty list first, then by evicting the least recently used cached block. Registering and
//! evicting blocks produce the KV events routers index.

use std::collections::{BTreeMap, HashMap};

use dyn_protocol::kv::{BlockHash, KvEventData, push_stored};

pub type BlockId = u32;

#[derive(Debug, Clone, Default)]
struct Block {
    refs: u32,
    /// Sequence hash, once the block is full and registered.
    hash: Option<u64>,
    /// The parent's sequence hash and this block's local hash, for a full dump.
    parent: Option<u64>,
    tokens_hash: u64,
    /// Position in the LRU while cached.
    lru_tick: Option<u64>,
}

#[derive(Debug)]
pub struct Pool {
    blocks: Vec<Block>,
    empty: Vec<BlockId>,
    by_hash: HashMap<u64, BlockId>,
    /// Cached (unreferenced, hashed) blocks by last use: the first entry is evicted first.
    lru: BTreeMap<u64, BlockId>,
    tick: u64,
    active: u32,
    /// Events since the last [`Pool::take_events`]; removals are merged into one event.
    events: Vec<KvEventData>,
    removed: Vec<u64>,
    /// Cached blocks evicted for reuse since the last [`Pool::take_evicted`], while a tier
    /// below wants them (their bytes must be copied out before the step overwrites them).
    evicted: Option<Vec<Evicted>>,
}

/// A cached block evicted to be reused: where it is and which prefix it held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Evicted {
    pub id: BlockId,
    pub hash: u64,
    pub parent: Option<u64>,
    pub tokens_hash: u64,
}

impl Pool {
    pub fn new(num_blocks: u32) -> Self {
        Self {
            blocks: vec![Block::default(); num_blocks as usize],
            empty: (0..num_blocks).rev().collect(),
            by_hash: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            active: 0,
            events: Vec::new(),
            removed: Vec::new(),
            evicted: None,
        }
    }

    /// Keep a list of evicted blocks for [`Pool::take_evicted`] (an offload tier is below).
    pub fn track_evictions(&mut self) {
        self.evicted.get_or_insert_with(Vec::new);
    }

    /// Blocks evicted since the last call.
    pub fn take_evicted(&mut self) -> Vec<Evicted> {
        self.evicted
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    pub fn total(&self) -> u32 {
        self.blocks.len() as u32
    }

    /// Blocks held by at least one sequence.
    pub fn active(&self) -> u32 {
        self.active
    }

    /// Blocks that could be handed out now (empty or evictable).
    pub fn available(&self) -> u32 {
        (self.empty.len() + self.lru.len()) as u32
    }

    /// How many leading blocks of `hashes` (sequence hashes) the cache holds.
    pub fn cached_prefix(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.by_hash.contains_key(h))
            .count()
    }

    /// Take a reference to the cached block with sequence hash `hash`.
    pub fn acquire_cached(&mut self, hash: u64) -> Option<BlockId> {
        let id = *self.by_hash.get(&hash)?;
        self.take_ref(id);
        Some(id)
    }

    fn take_ref(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        if b.refs == 0 {
            self.active += 1;
            if let Some(t) = b.lru_tick.take() {
                self.lru.remove(&t);
            }
        }
        b.refs += 1;
    }

    /// A fresh block, evicting the least recently used cached one if needed.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let id = match self.empty.pop() {
            Some(id) => id,
            None => {
                let (_, id) = self.lru.pop_first()?;
                let b = &mut self.blocks[id as usize];
                b.lru_tick = None;
                if let Some(h) = b.hash.take() {
                    self.by_hash.remove(&h);
                    self.removed.push(h);
                    if let Some(ev) = &mut self.evicted {
                        ev.push(Evicted {
                            id,
                            hash: h,
                            parent: b.parent,
                            tokens_hash: b.tokens_hash,
                        });
                    }
                }
                id
            }
        };
        self.take_ref(id);
        Some(id)
    }

    /// Drop one reference; an unreferenced block stays cached if it has a hash.
    pub fn release(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        debug_assert!(b.refs > 0, "release of a free block");
        b.refs = b.refs.saturating_sub(1);
        if b.refs > 0 {
            return;
        }
        self.active -= 1;
        if b.hash.is_some() {
            self.tick += 1;
            b.lru_tick = Some(self.tick);
            self.lru.insert(self.tick, id);
        } else {
            self.empty.push(id);
        }
    }

    /// A block became full: make it findable by its sequence hash and announce it. A block
    /// whose hash another block already has stays private (two sequences computed the same
    /// prefix at once); it returns to the empty list when released.
    pub fn register(&mut self, id: BlockId, parent: Option<u64>, hash: BlockHash) {
        if self.by_hash.contains_key(&hash.block_hash) || self.blocks[id as usize].hash.is_some() {
            return;
        }
        let b = &mut self.blocks[id as usize];
        b.hash = Some(hash.block_hash);
        b.parent = parent;
        b.tokens_hash = hash.tokens_hash;
        self.by_hash.insert(hash.block_hash, id);
        push_stored(&mut self.events, parent, hash);
    }

    /// Every hashed block: `(sequence hash, parent, local hash)`, for a full dump
    /// ([`dyn_protocol::kv::dump_events`]).
    pub fn held(&self) -> impl Iterator<Item = (u64, Option<u64>, u64)> + '_ {
        self.blocks
            .iter()
            .filter_map(|b| Some((b.hash?, b.parent, b.tokens_hash)))
    }

    /// Events since the last call, removals first (a store may reuse a just-evicted block).
    pub fn take_events(&mut self) -> Vec<KvEventData> {
        let mut out = Vec::with_capacity(self.events.len() + 1);
        if !self.removed.is_empty() {
            out.push(KvEventData::Removed {
                block_hashes: std::mem::take(&mut self.removed),
            });
        }
        out.append(&mut self.events);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dyn_protocol::kv::{Medium, dump_events};

    fn h(n: u64) -> BlockHash {
        BlockHash {
            block_hash: n,
            tokens_hash: n,
        }
    }

    #[test]
    fn released_hashed_blocks_stay_cached_and_are_reused() {
        let mut p = Pool::new(4);
        let a = p.allocate().expect("block");
        p.register(a, None, h(10));
        p.release(a);
        assert_eq!((p.active(), p.available()), (0, 4));
        assert_eq!(p.cached_prefix(&[10, 11]), 1);
        assert_eq!(p.acquire_cached(10), Some(a));
        assert_eq!(p.active(), 1);
        assert_eq!(
            p.take_events(),
            vec![KvEventData::Stored {
                parent_hash: None,
                blocks: vec![h(10)]
            }]
        );
    }

    #[test]
    fn eviction_takes_the_least_recently_used_cached_block() {
        let mut p = Pool::new(3);
        let ids: Vec<_> = (0..3).map(|_| p.allocate().expect("block")).collect();
        for (i, &id) in ids.iter().enumerate() {
            p.register(id, None, h(100 + i as u64));
        }
        // Release in the order 1, 0, 2: block 1 is the oldest cached one.
        for i in [1, 0, 2] {
            p.release(ids[i]);
        }
        p.take_events();
        assert_eq!(p.allocate(), Some(ids[1]));
        assert_eq!(p.allocate(), Some(ids[0]));
        assert_eq!(
            p.take_events(),
            vec![KvEventData::Removed {
                block_hashes: vec![101, 100]
            }]
        );
        assert_eq!(p.cached_prefix(&[102]), 1);
        assert_eq!(p.cached_prefix(&[100]), 0);
        assert!(p.allocate().is_some());
        assert_eq!(p.allocate(), None, "every block is active");
    }

    fn stored_at(parent: Option<u64>, n: u64) -> KvEventData {
        KvEventData::Stored {
            parent_hash: parent,
            blocks: vec![h(n)],
        }
    }

    #[test]
    fn dump_lists_reachable_blocks_parents_first() {
        let mut p = Pool::new(4);
        let ids: Vec<_> = (0..4).map(|_| p.allocate().expect("block")).collect();
        p.register(ids[0], None, h(1));
        p.register(ids[1], Some(1), h(2));
        p.register(ids[2], Some(1), h(3));
        p.register(ids[3], Some(99), h(4)); // parent long gone
        // Block 5 lives in host memory only, child of 2; block 2 is in both tiers.
        let lower = [(Medium::Cpu, 5, Some(2), 5), (Medium::Cpu, 2, Some(1), 2)];
        let all = p.held().map(|(h, parent, t)| (Medium::Gpu, h, parent, t));
        let d = dump_events(all.chain(lower));
        assert_eq!(d[0], (Medium::Gpu, KvEventData::Cleared));
        assert!(d.contains(&(Medium::Cpu, stored_at(Some(2), 5))));
        assert!(d.contains(&(Medium::Cpu, stored_at(Some(1), 2))));
        let five = d.iter().position(|e| e.1 == stored_at(Some(2), 5));
        let two = d.iter().position(|e| e.1 == stored_at(Some(1), 2));
        assert!(two < five, "parents first: {d:?}");
        let d: Vec<KvEventData> = d
            .into_iter()
            .filter(|(m, _)| *m == Medium::Gpu)
            .map(|(_, e)| e)
            .collect();
        let stored = |parent, n| KvEventData::Stored {
            parent_hash: parent,
            blocks: vec![h(n)],
        };
        assert_eq!(d[1], stored(None, 1));
        assert_eq!(d.len(), 4);
        assert!(d.contains(&stored(Some(1), 2)) && d.contains(&stored(Some(1), 3)));
    }

    #[test]
    fn shared_blocks_are_reference_counted() {
        let mut p = Pool::new(2);
        let a = p.allocate().expect("block");
        p.register(a, None, h(1));
        assert_eq!(p.acquire_cached(1), Some(a));
        p.release(a);
        assert_eq!(p.active(), 1);
        p.release(a);
        assert_eq!(p.active(), 0);
    }

    #[test]
    fn duplicate_hash_stays_private_and_unhashed_blocks_return_empty() {
        let mut p = Pool::new(2);
        let a = p.allocate().expect("block");
        let b = p.allocate().expect("block");
        p.register(a, None, h(5));
        p.register(b, None, h(5));
        p.release(b);
        p.release(a);
        assert_eq!(p.cached_prefix(&[5]), 1);
        assert_eq!(p.take_events().len(), 1);
        // b went back to the empty list: allocating it evicts nothing.
        assert_eq!(p.allocate(), Some(b));
        assert!(p.take_events().is_empty());
    }
}
