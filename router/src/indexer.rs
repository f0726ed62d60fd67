//! The KV indexer: which worker holds which prefix, built from the workers' KV events, asked
//! by the router how many leading blocks of a prompt each worker already has.
//!
//! It is a radix tree over blocks in which each node is one prefix, addressed by the
//! router's own sequence hash of that prefix (the chain of local hashes, see [`kv`]).
//! Addressing nodes by prefix hash instead of walking child maps means a lookup computes the
//! prompt's sequence hashes once and then probes one flat table per block: the probes do not
//! depend on each other, so the CPU overlaps their cache misses, which is what keeps a
//! 512-block lookup in a million-block tree in the microseconds.
//!
//! Workers name their blocks with their own hashes (`block_hash`, opaque here) and give each
//! block's local hash (`tokens_hash`), which the indexer chains onto the parent to find the
//! node. Each worker keeps a map from its block hashes to nodes, so removals, clears and a
//! worker's departure touch only that worker's blocks. Node membership is a bit set over
//! worker slots ([`MAX_WORKERS`] of them). A node lives while a worker holds it or it has
//! children; the last one out prunes it and any parent left empty.
//!
//! Blocks may be held in a worker's offload tiers too (events with `medium` `CPU` or `DISK`):
//! each worker's block carries a mask of the tiers holding it, and a node held by a worker
//! only below its pool has that worker's bit in a side table ([`Indexer::find_tiered`]
//! counts those blocks per tier). Without tiers the side table is empty and lookups never
//! touch it.
//!
//! Event ids must start at 0 and increase by one per worker. A gap (or a first event that is
//! not 0: a router that joined late) means events were lost: the worker's blocks are dropped
//! and its events ignored until it sends a full dump, which starts with `cleared` (see
//! [`Applied::Gap`]).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use dyn_protocol::kv::{KvCacheEvent, KvEventData, Medium, chain_hash};

/// The most workers one indexer tracks (the width of the membership bit set).
pub const MAX_WORKERS: usize = 128;

const NONE: u32 = u32::MAX;

/// Keys are xxh3 outputs already: hashing them again would only cost time.
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are used; fold anything else in so it still works.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// A map keyed by block hashes, which are hashes already.
pub(crate) type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;

/// A prefix in the tree (its membership lives in the [`Slot`] of `by_seq`).
#[derive(Debug, Clone, Copy)]
struct Node {
    /// The router's sequence hash of this prefix.
    seq: u64,
    parent: u32,
    children: u32,
}

/// What a lookup needs, kept in the hash table itself so a probe is the only memory access
/// per block.
#[derive(Debug, Clone, Copy)]
struct Slot {
    /// Bit `s` set: the worker in slot `s` holds this prefix. Two `u64`s rather than a
    /// `u128`: 8-byte alignment keeps a table entry at 32 bytes, two to a cache line.
    workers: [u64; 2],
    node: u32,
}

impl Slot {
    fn workers(&self) -> u128 {
        u128::from(self.workers[0]) | (u128::from(self.workers[1]) << 64)
    }
    fn set_workers(&mut self, w: u128) {
        self.workers = [w as u64, (w >> 64) as u64];
    }
}

#[derive(Debug, Default)]
struct WorkerBlocks {
    slot: usize,
    /// The worker's own block hash → node, and the tiers holding it ([`Medium::bit`]).
    blocks: IdMap<(u32, u8)>,
    last_event: Option<u64>,
    /// Events were lost: ignore everything until a dump (starting with `cleared`) arrives.
    awaiting_dump: bool,
}

/// What applying one event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    Ok,
    /// Event ids jumped from `expected` to `got`. The worker's blocks were dropped; ask it for
    /// a dump.
    Gap {
        expected: u64,
        got: u64,
    },
    /// Ignored while waiting for a dump.
    AwaitingDump,
    /// A stored chain whose parent the worker does not hold (here); it was dropped.
    Orphan,
    /// No free worker slot.
    Full,
}

/// Sizes, for `dyn inspect` and the memory figure.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct prefixes (tree nodes).
    pub nodes: usize,
    /// Blocks per worker, summed: a prefix held by two workers counts twice.
    pub worker_blocks: usize,
    /// Approximate heap bytes of the whole index.
    pub bytes: usize,
}

/// A worker's match for a prompt: leading blocks it holds anywhere, and how many of those it
/// holds only in host memory, or only on disk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierMatch {
    pub blocks: usize,
    pub host: usize,
    pub disk: usize,
}

impl TierMatch {
    /// Blocks in the worker's pool.
    pub fn device(&self) -> usize {
        self.blocks - self.host - self.disk
    }
}

#[derive(Default)]
pub struct Indexer {
    nodes: Vec<Node>,
    free: Vec<u32>,
    by_seq: IdMap<Slot>,
    /// Sequence hash → workers holding it only in host memory, and only on disk.
    off: IdMap<[u128; 2]>,
    workers: HashMap<u64, WorkerBlocks>,
    slots: Vec<Option<u64>>,
}

impl Indexer {
    pub fn new() -> Self {
        Self {
            slots: vec![None; MAX_WORKERS],
            ..Self::default()
        }
    }

    fn worker(&mut self, id: u64) -> Option<&mut WorkerBlocks> {
        if !self.workers.contains_key(&id) {
            let slot = self.slots.iter().position(Option::is_none)?;
            self.slots[slot] = Some(id);
            self.workers.insert(
                id,
                WorkerBlocks {
                    slot,
                    ..WorkerBlocks::default()
                },
            );
        }
        self.workers.get_mut(&id)
    }

    /// Apply one event of worker `worker_id`.
    pub fn apply(&mut self, worker_id: u64, ev: &KvCacheEvent) -> Applied {
        let Some(w) = self.worker(worker_id) else {
            return Applied::Full;
        };
        // A worker's first event must be its first ever: a router that starts (or forgot the
        // worker) in the middle of its stream needs the dump too.
        let expected = Some(w.last_event.map_or(0, |l| l.wrapping_add(1)));
        w.last_event = Some(ev.event_id);
        if ev.data == KvEventData::Cleared {
            // Whatever came before, `cleared` and what follows define the worker's cache: it
            // is how a dump starts.
            w.awaiting_dump = false;
        } else if w.awaiting_dump {
            return Applied::AwaitingDump;
        } else if let Some(expected) = expected
            && ev.event_id != expected
        {
            self.clear(worker_id);
            if let Some(w) = self.workers.get_mut(&worker_id) {
                w.awaiting_dump = true;
            }
            return Applied::Gap {
                expected,
                got: ev.event_id,
            };
        }
        self.apply_in(worker_id, ev.medium, &ev.data)
    }

    /// Apply an event's data without event-id bookkeeping: for the router's own records in
    /// approximate mode.
    pub fn apply_data(&mut self, worker_id: u64, data: &KvEventData) -> Applied {
        self.apply_in(worker_id, Medium::Gpu, data)
    }

    fn apply_in(&mut self, worker_id: u64, medium: Medium, data: &KvEventData) -> Applied {
        if self.worker(worker_id).is_none() {
            return Applied::Full;
        }
        match data {
            KvEventData::Stored {
                parent_hash,
                blocks,
            } => self.store(worker_id, medium, *parent_hash, blocks),
            KvEventData::Removed { block_hashes } => {
                for h in block_hashes {
                    self.remove_block(worker_id, medium, *h);
                }
                Applied::Ok
            }
            KvEventData::Cleared => {
                self.clear(worker_id);
                Applied::Ok
            }
        }
    }

    fn store(
        &mut self,
        worker_id: u64,
        medium: Medium,
        parent_hash: Option<u64>,
        blocks: &[dyn_protocol::kv::BlockHash],
    ) -> Applied {
        let Some(w) = self.workers.get_mut(&worker_id) else {
            return Applied::Full;
        };
        let bit = 1u128 << w.slot;
        let (mut parent, mut parent_seq) = match parent_hash {
            None => (NONE, None),
            Some(h) => match w.blocks.get(&h) {
                Some(&(n, _)) => (n, Some(self.nodes[n as usize].seq)),
                None => return Applied::Orphan,
            },
        };
        for b in blocks {
            let seq = chain_hash(parent_seq, b.tokens_hash);
            let (nodes, free) = (&mut self.nodes, &mut self.free);
            let slot = self.by_seq.entry(seq).or_insert_with(|| {
                let n = Node {
                    seq,
                    parent,
                    children: 0,
                };
                let id = match free.pop() {
                    Some(id) => {
                        nodes[id as usize] = n;
                        id
                    }
                    None => {
                        nodes.push(n);
                        (nodes.len() - 1) as u32
                    }
                };
                if parent != NONE {
                    nodes[parent as usize].children += 1;
                }
                Slot {
                    workers: [0; 2],
                    node: id,
                }
            });
            slot.set_workers(slot.workers() | bit);
            let node = slot.node;
            let mask = match w.blocks.get(&b.block_hash) {
                Some(&(old, mask)) if old == node => mask | medium.bit(),
                Some(&(old, _)) => {
                    // The worker reused a block hash for another prefix: the old one is gone.
                    let old_seq = self.nodes[old as usize].seq;
                    set_off(&mut self.off, old_seq, bit, 0);
                    Self::drop_bit(&mut self.nodes, &mut self.free, &mut self.by_seq, old, bit);
                    medium.bit()
                }
                None => medium.bit(),
            };
            w.blocks.insert(b.block_hash, (node, mask));
            set_off(&mut self.off, seq, bit, mask);
            parent = node;
            parent_seq = Some(seq);
        }
        Applied::Ok
    }

    fn remove_block(&mut self, worker_id: u64, medium: Medium, hash: u64) {
        let Some(w) = self.workers.get_mut(&worker_id) else {
            return;
        };
        let Some(&(node, mask)) = w.blocks.get(&hash) else {
            return;
        };
        let bit = 1u128 << w.slot;
        let seq = self.nodes[node as usize].seq;
        let mask = mask & !medium.bit();
        set_off(&mut self.off, seq, bit, mask);
        if mask == 0 {
            w.blocks.remove(&hash);
            Self::drop_bit(&mut self.nodes, &mut self.free, &mut self.by_seq, node, bit);
        } else {
            w.blocks.insert(hash, (node, mask));
        }
    }

    /// Clear `bit` on `node` and prune it and its ancestors while they are empty leaves.
    fn drop_bit(
        nodes: &mut [Node],
        free: &mut Vec<u32>,
        by_seq: &mut IdMap<Slot>,
        node: u32,
        bit: u128,
    ) {
        if let Some(slot) = by_seq.get_mut(&nodes[node as usize].seq) {
            slot.set_workers(slot.workers() & !bit);
        }
        let mut n = node;
        while n != NONE {
            let node = nodes[n as usize];
            let held = by_seq.get(&node.seq).is_some_and(|s| s.workers() != 0);
            if held || node.children != 0 {
                break;
            }
            by_seq.remove(&node.seq);
            free.push(n);
            if node.parent != NONE {
                nodes[node.parent as usize].children -= 1;
            }
            n = node.parent;
        }
    }

    /// Drop every block of a worker (its cache was cleared).
    pub fn clear(&mut self, worker_id: u64) {
        let Some(w) = self.workers.get_mut(&worker_id) else {
            return;
        };
        let bit = 1u128 << w.slot;
        for (_, (node, _)) in w.blocks.drain() {
            set_off(&mut self.off, self.nodes[node as usize].seq, bit, 0);
            Self::drop_bit(&mut self.nodes, &mut self.free, &mut self.by_seq, node, bit);
        }
    }

    /// A worker left: drop its blocks and free its slot.
    pub fn remove_worker(&mut self, worker_id: u64) {
        self.clear(worker_id);
        if let Some(w) = self.workers.remove(&worker_id) {
            self.slots[w.slot] = None;
        }
    }

    /// Workers the index knows.
    pub fn worker_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.workers.keys().copied()
    }

    /// Blocks the index holds for `worker_id`.
    pub fn worker_blocks(&self, worker_id: u64) -> usize {
        self.workers.get(&worker_id).map_or(0, |w| w.blocks.len())
    }

    /// Blocks the index holds for `worker_id` per tier (GPU, CPU, DISK); a block in two
    /// tiers counts in both.
    pub fn worker_tier_blocks(&self, worker_id: u64) -> [usize; 3] {
        let mut out = [0; 3];
        if let Some(w) = self.workers.get(&worker_id) {
            for &(_, mask) in w.blocks.values() {
                for (i, m) in Medium::ALL.iter().enumerate() {
                    if mask & m.bit() != 0 {
                        out[i] += 1;
                    }
                }
            }
        }
        out
    }

    /// For a prompt's sequence hashes, how many leading blocks each worker holds (in any
    /// tier); workers holding none are left out.
    pub fn find_matches(&self, seq_hashes: &[u64]) -> Vec<(u64, usize)> {
        self.find_tiered(seq_hashes)
            .into_iter()
            .map(|(w, m)| (w, m.blocks))
            .collect()
    }

    /// [`Indexer::find_matches`], with the blocks each worker holds only below its pool.
    pub fn find_tiered(&self, seq_hashes: &[u64]) -> Vec<(u64, TierMatch)> {
        let mut out = Vec::new();
        let mut active = u128::MAX;
        let mut depth = 0;
        // Per worker slot: blocks of the match only in host memory, only on disk.
        let mut lower: Option<Box<[[u32; 2]; MAX_WORKERS]>> = None;
        for h in seq_hashes {
            let Some(slot) = self.by_seq.get(h) else {
                break;
            };
            let held = slot.workers() & active;
            if depth > 0 {
                self.push_bits(active & !held, depth, lower.as_deref(), &mut out);
            }
            active = held;
            if active == 0 {
                break;
            }
            if !self.off.is_empty()
                && let Some(off) = self.off.get(h)
            {
                let counts = lower.get_or_insert_with(|| Box::new([[0; 2]; MAX_WORKERS]));
                for (tier, bits) in off.iter().enumerate() {
                    let mut b = bits & active;
                    while b != 0 {
                        counts[b.trailing_zeros() as usize][tier] += 1;
                        b &= b - 1;
                    }
                }
            }
            depth += 1;
        }
        if depth > 0 {
            self.push_bits(active, depth, lower.as_deref(), &mut out);
        }
        out
    }

    fn push_bits(
        &self,
        bits: u128,
        depth: usize,
        lower: Option<&[[u32; 2]; MAX_WORKERS]>,
        out: &mut Vec<(u64, TierMatch)>,
    ) {
        out.extend(self.slot_ids(bits).map(|(slot, id)| {
            let [host, disk] = lower.map_or([0; 2], |l| l[slot]);
            let m = TierMatch {
                blocks: depth,
                host: host as usize,
                disk: disk as usize,
            };
            (id, m)
        }));
    }

    /// The workers whose slots are set in `bits`.
    fn ids(&self, bits: u128) -> impl Iterator<Item = u64> + '_ {
        self.slot_ids(bits).map(|(_, id)| id)
    }

    /// `(slot, worker)` for the slots set in `bits`.
    fn slot_ids(&self, mut bits: u128) -> impl Iterator<Item = (usize, u64)> + '_ {
        std::iter::from_fn(move || {
            while bits != 0 {
                let slot = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                if let Some(Some(id)) = self.slots.get(slot) {
                    return Some((slot, *id));
                }
            }
            None
        })
    }

    pub fn stats(&self) -> IndexStats {
        // hashbrown: one control byte per bucket besides the entry.
        let map = |cap: usize, entry: usize| cap * (entry + 1);
        let worker_blocks = self.workers.values().map(|w| w.blocks.len()).sum();
        let bytes = self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.free.capacity() * 4
            + map(self.by_seq.capacity(), 8 + std::mem::size_of::<Slot>())
            + map(self.off.capacity(), 8 + 32)
            + self
                .workers
                .values()
                .map(|w| map(w.blocks.capacity(), 16))
                .sum::<usize>();
        IndexStats {
            nodes: self.by_seq.len(),
            worker_blocks,
            bytes,
        }
    }

    /// The most widely held prefixes: `(depth in blocks, sequence hash, workers holding it)`,
    /// deepest first among those held by the most workers.
    pub fn top_prefixes(&self, n: usize) -> Vec<(usize, u64, Vec<u64>)> {
        let depth = |mut id: u32| {
            let mut d = 0;
            while id != NONE {
                d += 1;
                id = self.nodes[id as usize].parent;
            }
            d
        };
        // A prefix is interesting where it is shared by more workers than any child of it.
        let mut best: Vec<(u32, usize, u32, u128)> = self
            .by_seq
            .values()
            .filter(|s| s.workers().count_ones() > 1)
            .map(|s| (s.workers().count_ones(), depth(s.node), s.node, s.workers()))
            .collect();
        best.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)));
        let mut out: Vec<(usize, u64, Vec<u64>)> = Vec::new();
        for (_, d, id, workers) in best {
            let node = self.nodes[id as usize];
            let mut ws: Vec<u64> = self.ids(workers).collect();
            ws.sort_unstable();
            // Skip ancestors of a prefix already listed with the same workers.
            if out.iter().any(|(_, _, o)| *o == ws) {
                continue;
            }
            out.push((d, node.seq, ws));
            if out.len() == n {
                break;
            }
        }
        out
    }
}

/// Record in `off` whether the worker with `bit` holds `seq` only in host memory, or only on
/// disk, given the tiers holding it (`mask`; 0 = none).
fn set_off(off: &mut IdMap<[u128; 2]>, seq: u64, bit: u128, mask: u8) {
    let (gpu, cpu, disk) = (Medium::Gpu.bit(), Medium::Cpu.bit(), Medium::Disk.bit());
    let host_only = mask & gpu == 0 && mask & cpu != 0;
    let disk_only = mask & (gpu | cpu) == 0 && mask & disk != 0;
    if !host_only && !disk_only && !off.contains_key(&seq) {
        return;
    }
    let e = off.entry(seq).or_insert([0; 2]);
    for (i, on) in [host_only, disk_only].into_iter().enumerate() {
        if on {
            e[i] |= bit;
        } else {
            e[i] &= !bit;
        }
    }
    if *e == [0; 2] {
        off.remove(&seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dyn_protocol::kv::{BlockHash, block_hashes};
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn ev(id: u64, data: KvEventData) -> KvCacheEvent {
        KvCacheEvent {
            event_id: id,
            dp_rank: 0,
            medium: Default::default(),
            data,
        }
    }

    fn stored(parent: Option<u64>, blocks: &[BlockHash]) -> KvEventData {
        KvEventData::Stored {
            parent_hash: parent,
            blocks: blocks.to_vec(),
        }
    }

    fn seqs(h: &[BlockHash]) -> Vec<u64> {
        h.iter().map(|b| b.block_hash).collect()
    }

    #[test]
    fn matches_shared_prefixes_per_worker() {
        let mut ix = Indexer::new();
        let a = block_hashes(&(0..64).collect::<Vec<_>>(), 16); // 4 blocks
        let mut other: Vec<u32> = (0..32).collect();
        other.extend(100..132);
        let b = block_hashes(&other, 16); // shares 2 blocks with a
        assert_eq!(ix.apply(1, &ev(0, stored(None, &a))), Applied::Ok);
        assert_eq!(ix.apply(2, &ev(0, stored(None, &b[..2]))), Applied::Ok);
        assert_eq!(
            ix.apply(2, &ev(1, stored(Some(b[1].block_hash), &b[2..]))),
            Applied::Ok
        );
        let mut m = ix.find_matches(&seqs(&a));
        m.sort_unstable();
        assert_eq!(m, vec![(1, 4), (2, 2)]);
        let mut m = ix.find_matches(&seqs(&b));
        m.sort_unstable();
        assert_eq!(m, vec![(1, 2), (2, 4)]);
        assert_eq!(ix.stats().nodes, 6);
        assert_eq!(ix.stats().worker_blocks, 8);
        assert_eq!(ix.top_prefixes(5), vec![(2, a[1].block_hash, vec![1, 2])]);

        // Removing worker 1's second block cuts its match there.
        ix.apply(
            1,
            &ev(
                1,
                KvEventData::Removed {
                    block_hashes: vec![a[1].block_hash],
                },
            ),
        );
        let mut m = ix.find_matches(&seqs(&a));
        m.sort_unstable();
        assert_eq!(m, vec![(1, 1), (2, 2)]);
        // A departed worker leaves nothing behind.
        ix.remove_worker(2);
        ix.remove_worker(1);
        assert_eq!(ix.stats().nodes, 0);
        assert!(ix.find_matches(&seqs(&b)).is_empty());
    }

    #[test]
    fn opaque_engine_hashes_are_mapped_through_local_hashes() {
        // An engine that names blocks with its own hashes: the index still finds the prefix.
        let mut ix = Indexer::new();
        let h = block_hashes(&(0..48).collect::<Vec<_>>(), 16);
        let engine: Vec<BlockHash> = h
            .iter()
            .map(|b| BlockHash {
                block_hash: b.block_hash ^ 0xdead,
                tokens_hash: b.tokens_hash,
            })
            .collect();
        ix.apply(7, &ev(0, stored(None, &engine[..1])));
        ix.apply(7, &ev(1, stored(Some(engine[0].block_hash), &engine[1..])));
        assert_eq!(ix.find_matches(&seqs(&h)), vec![(7, 3)]);
        ix.apply(
            7,
            &ev(
                2,
                KvEventData::Removed {
                    block_hashes: vec![engine[2].block_hash],
                },
            ),
        );
        assert_eq!(ix.find_matches(&seqs(&h)), vec![(7, 2)]);
    }

    #[test]
    fn gap_drops_the_worker_until_a_dump() {
        let mut ix = Indexer::new();
        let h = block_hashes(&(0..32).collect::<Vec<_>>(), 16);
        assert_eq!(
            ix.apply(9, &ev(5, stored(None, &h[..1]))),
            Applied::Gap {
                expected: 0,
                got: 5
            },
            "a router that joins late needs a dump"
        );
        ix.apply(1, &ev(0, stored(None, &h[..1])));
        assert_eq!(
            ix.apply(1, &ev(2, stored(Some(h[0].block_hash), &h[1..]))),
            Applied::Gap {
                expected: 1,
                got: 2
            }
        );
        assert!(
            ix.find_matches(&seqs(&h)).is_empty(),
            "blocks dropped at the gap"
        );
        assert_eq!(
            ix.apply(1, &ev(3, stored(None, &h[..1]))),
            Applied::AwaitingDump
        );
        // The dump: cleared, then everything the worker holds.
        assert_eq!(ix.apply(1, &ev(4, KvEventData::Cleared)), Applied::Ok);
        assert_eq!(ix.apply(1, &ev(5, stored(None, &h))), Applied::Ok);
        assert_eq!(ix.find_matches(&seqs(&h)), vec![(1, 2)]);
    }

    #[test]
    fn orphans_and_full_slots() {
        let mut ix = Indexer::new();
        let h = block_hashes(&(0..32).collect::<Vec<_>>(), 16);
        assert_eq!(
            ix.apply(1, &ev(0, stored(Some(h[0].block_hash), &h[1..]))),
            Applied::Orphan
        );
        // Worker 1 holds a slot already (it sent an event).
        for w in 1..MAX_WORKERS as u64 {
            assert_eq!(ix.apply(100 + w, &ev(0, KvEventData::Cleared)), Applied::Ok);
        }
        assert_eq!(ix.apply(1_000, &ev(0, KvEventData::Cleared)), Applied::Full);
        ix.remove_worker(101);
        assert_eq!(ix.apply(1_000, &ev(0, KvEventData::Cleared)), Applied::Ok);
    }

    /// The reference: per worker, the sequence hashes it holds and the tiers holding each.
    #[derive(Default)]
    struct Model {
        held: HashMap<u64, HashMap<u64, u8>>,
    }

    impl Model {
        fn find(&self, hashes: &[u64]) -> Vec<(u64, TierMatch)> {
            let (gpu, cpu, disk) = (Medium::Gpu.bit(), Medium::Cpu.bit(), Medium::Disk.bit());
            let mut out: Vec<(u64, TierMatch)> = self
                .held
                .iter()
                .map(|(w, set)| {
                    let masks: Vec<u8> = hashes.iter().map_while(|h| set.get(h).copied()).collect();
                    let m = TierMatch {
                        blocks: masks.len(),
                        host: masks
                            .iter()
                            .filter(|m| *m & gpu == 0 && *m & cpu != 0)
                            .count(),
                        disk: masks
                            .iter()
                            .filter(|m| *m & (gpu | cpu) == 0 && *m & disk != 0)
                            .count(),
                    };
                    (*w, m)
                })
                .filter(|(_, m)| m.blocks > 0)
                .collect();
            out.sort_unstable_by_key(|(w, _)| *w);
            out
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Worker stores blocks `from..to` of sequence `seq` in a tier.
        Store {
            worker: u64,
            medium: Medium,
            seq: usize,
            from: usize,
            to: usize,
        },
        Remove {
            worker: u64,
            medium: Medium,
            seq: usize,
            block: usize,
        },
        Clear {
            worker: u64,
        },
        Leave {
            worker: u64,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        let w = 0u64..4;
        let m =
            prop_oneof![3 => Just(Medium::Gpu), 1 => Just(Medium::Cpu), 1 => Just(Medium::Disk)];
        prop_oneof![
            6 => (w.clone(), m.clone(), 0usize..4, 0usize..6, 1usize..4).prop_map(|(worker, medium, seq, from, len)| Op::Store { worker, medium, seq, from, to: (from + len).min(6) }),
            3 => (w.clone(), m, 0usize..4, 0usize..6).prop_map(|(worker, medium, seq, block)| Op::Remove { worker, medium, seq, block }),
            1 => w.clone().prop_map(|worker| Op::Clear { worker }),
            1 => w.prop_map(|worker| Op::Leave { worker }),
        ]
    }

    proptest! {
        #[test]
        fn agrees_with_a_naive_model(ops in proptest::collection::vec(op(), 1..60)) {
            // Four token sequences sharing prefixes: 0 and 1 share 2 blocks, 2 shares 1 with 0.
            let base: Vec<u32> = (0..96).collect();
            let mut s1 = base.clone();
            s1[40] = 999;
            let mut s2 = base.clone();
            s2[20] = 999;
            let s3: Vec<u32> = (500..596).collect();
            let seqs_h: Vec<Vec<BlockHash>> = [base, s1, s2, s3].iter().map(|t| block_hashes(t, 16)).collect();
            let mut ix = Indexer::new();
            let mut model = Model::default();
            let mut next_id: HashMap<u64, u64> = HashMap::new();
            for op in ops {
                match op {
                    Op::Store { worker, medium, seq, from, to } => {
                        let h = &seqs_h[seq];
                        let parent = from.checked_sub(1).map(|p| h[p].block_hash);
                        let id = next_id.entry(worker).or_insert(0);
                        let e = KvCacheEvent { medium, ..ev(*id, stored(parent, &h[from..to])) };
                        let r = ix.apply(worker, &e);
                        *id += 1;
                        let set = model.held.entry(worker).or_default();
                        if parent.is_none_or(|p| set.contains_key(&p)) {
                            prop_assert_eq!(r, Applied::Ok);
                            for b in &h[from..to] {
                                *set.entry(b.block_hash).or_default() |= medium.bit();
                            }
                        } else {
                            prop_assert_eq!(r, Applied::Orphan);
                        }
                    }
                    Op::Remove { worker, medium, seq, block } => {
                        let hash = seqs_h[seq][block].block_hash;
                        let id = next_id.entry(worker).or_insert(0);
                        let e = KvCacheEvent { medium, ..ev(*id, KvEventData::Removed { block_hashes: vec![hash] }) };
                        ix.apply(worker, &e);
                        *id += 1;
                        let set = model.held.entry(worker).or_default();
                        if let Some(m) = set.get_mut(&hash) {
                            *m &= !medium.bit();
                            if *m == 0 {
                                set.remove(&hash);
                            }
                        }
                    }
                    Op::Clear { worker } => {
                        let id = next_id.entry(worker).or_insert(0);
                        ix.apply(worker, &ev(*id, KvEventData::Cleared));
                        *id += 1;
                        model.held.entry(worker).or_default().clear();
                    }
                    Op::Leave { worker } => {
                        ix.remove_worker(worker);
                        next_id.remove(&worker);
                        model.held.remove(&worker);
                    }
                }
                for h in &seqs_h {
                    let mut got = ix.find_tiered(&seqs(h));
                    got.sort_unstable_by_key(|(w, _)| *w);
                    prop_assert_eq!(got, model.find(&seqs(h)));
                }
                let held: usize = model.held.values().map(HashMap::len).sum();
                prop_assert_eq!(ix.stats().worker_blocks, held);
            }
            // Everyone leaves: the tree is empty, nothing leaks.
            for w in 0..4 {
                ix.remove_worker(w);
            }
            prop_assert_eq!(ix.stats().nodes, 0);
            prop_assert!(ix.off.is_empty());
            prop_assert_eq!(ix.free.len(), ix.nodes.len());
        }
    }
}
