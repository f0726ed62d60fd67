//! KV-cache block identity and KV events, shared by engines (which publish them) and routers
//! (which index them).
//!
//! Hashing follows Dynamo so indexes and events interoperate: only full blocks are hashed; a
//! block's local hash is XXH3-64 (seed 1337) over its token ids as little-endian `u32`; its
//! sequence hash is the local hash for the first block and, after that, XXH3-64 (seed 1337)
//! over the parent's sequence hash and the local hash as little-endian `u64`s. The sequence
//! hash therefore names the whole prefix up to and including the block.
//!
//! A request's `cache_salt` (vLLM's field) makes its prefix its own: the salt, hashed by
//! [`salt_hash`], stands for a parent of the first block, so the first block's local hash is
//! [`chain_hash`] of the salt and the tokens' local hash ([`salted_local`]), and every
//! sequence hash after it differs from the unsalted prompt's and from any other salt's.
//! Events carry that salted local hash as the first block's `tokens_hash`, so a router's
//! index (which chains `tokens_hash`es, see [`crate::indexer`]) names the block exactly as
//! the router hashes the salted prompt. Without a salt nothing changes.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

pub const HASH_SEED: u64 = 1337;

// The block hashes below are `#[inline]`: the router's index chains them per block on its hot
// path, and without it a call across the crate boundary is not inlined (no LTO).

/// Local hash of one block's tokens.
#[inline]
pub fn local_hash(tokens: &[u32]) -> u64 {
    // Blocks are small (16–64 tokens): serialize on the stack, not the heap.
    const STACK_TOKENS: usize = 64;
    let fill = |bytes: &mut [u8]| {
        for (chunk, t) in bytes.chunks_exact_mut(4).zip(tokens) {
            chunk.copy_from_slice(&t.to_le_bytes());
        }
    };
    if tokens.len() <= STACK_TOKENS {
        let mut buf = [0u8; STACK_TOKENS * 4];
        let bytes = &mut buf[..tokens.len() * 4];
        fill(bytes);
        xxh3_64_with_seed(bytes, HASH_SEED)
    } else {
        let mut bytes = vec![0u8; tokens.len() * 4];
        fill(&mut bytes);
        xxh3_64_with_seed(&bytes, HASH_SEED)
    }
}

/// Sequence hash of a block given its parent's sequence hash.
#[inline]
pub fn chain_hash(parent: Option<u64>, local: u64) -> u64 {
    match parent {
        None => local,
        Some(p) => {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&p.to_le_bytes());
            bytes[8..].copy_from_slice(&local.to_le_bytes());
            xxh3_64_with_seed(&bytes, HASH_SEED)
        }
    }
}

/// A request's `cache_salt` as a hash: the first 8 bytes (little-endian) of SHA-256 over a
/// domain tag and the salt. Cryptographic, unlike the block hashes, so that no one can find
/// another salt standing for the same parent (a tenant's default salt is its name, which
/// others may know).
pub fn salt_hash(salt: &str) -> u64 {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(b"dyn.cache_salt\0");
    ctx.update(salt.as_bytes());
    let digest = ctx.finish();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest.as_ref()[..8]);
    u64::from_le_bytes(first)
}

/// The salt a request's blocks are hashed with: its `cache_salt` and its LoRA adapter's name
/// (`None` with neither: the unsalted hashes). The adapter is joined after a NUL, which no
/// `cache_salt` may hold, so no salt can stand for another's adapter.
pub fn salt_of(cache_salt: Option<&str>, lora: Option<&str>) -> Option<u64> {
    match (cache_salt, lora) {
        (None, None) => None,
        (salt, None) => salt.map(salt_hash),
        (salt, Some(lora)) => Some(salt_hash(&format!(
            "{}\0lora:{lora}",
            salt.unwrap_or_default()
        ))),
    }
}

/// [`salt_of`] a request's routing: its `cache_salt` and its adapter's key.
pub fn request_salt(s: &crate::types::Routing) -> Option<u64> {
    let lora = s.lora.as_ref().map(crate::types::LoraRef::key);
    salt_of(s.cache_salt.as_deref(), lora.as_deref())
}

/// The local hash of a prompt's first block under `salt` (a [`salt_hash`]): the salt chained
/// before the tokens' local hash, as if it were the sequence hash of a parent block; `local`
/// itself without a salt.
#[inline]
pub fn salted_local(salt: Option<u64>, local: u64) -> u64 {
    match salt {
        None => local,
        Some(s) => chain_hash(Some(s), local),
    }
}

/// `(local, sequence)` hashes of every full block of `tokens`.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    block_hashes_salted(tokens, block_size, None)
}

/// [`block_hashes`] of a prompt with a `cache_salt` ([`salt_hash`]; `None`: unsalted, the
/// same hashes as [`block_hashes`]): the first block's local hash is [`salted_local`].
pub fn block_hashes_salted(tokens: &[u32], block_size: usize, salt: Option<u64>) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    let mut parent = None;
    for block in tokens.chunks_exact(block_size.max(1)) {
        let local = local_hash(block);
        let local = if parent.is_none() {
            salted_local(salt, local)
        } else {
            local
        };
        let seq = chain_hash(parent, local);
        out.push(BlockHash {
            tokens_hash: local,
            block_hash: seq,
        });
        parent = Some(seq);
    }
    out
}

/// A request's block hashes, computed once and kept with it in this process: with pools, the
/// router prices the prompt in each pool, routes it, and the engine's scheduler admits it,
/// and each would otherwise hash the whole prompt again (tens of microseconds at 32k tokens,
/// each time). Keyed by block size, salt and full blocks: the tokens asked about are always
/// a prefix of the request's `token_ids`, which only grow (a resumed request appends its
/// output), so equal keys mean equal hashes. It never crosses a process boundary
/// (`#[serde(skip)]` where it is carried): 16 bytes a block in JSON cost more to send and
/// parse than hashing them again on the other side. A clone starts empty: a request's
/// choices are clones, and each appends its own output to its tokens when resumed, so a
/// shared memo could answer one choice with another's hashes; [`PromptHashes::share`] hands
/// the same memo on where the tokens stay the request's (its engine sequence).
#[derive(Default)]
pub struct PromptHashes(std::sync::Arc<std::sync::Mutex<Vec<Memo>>>);

impl Clone for PromptHashes {
    fn clone(&self) -> Self {
        Self::default()
    }
}

struct Memo {
    block_size: usize,
    salt: Option<u64>,
    blocks: usize,
    hashes: std::sync::Arc<[BlockHash]>,
}

/// Kinds of hashes one request asks for at most (block sizes × salts); more are not kept.
const MEMOS: usize = 4;

impl PromptHashes {
    /// [`block_hashes_salted`] of `tokens` (a prefix of the request's tokens), from the memo
    /// when this request's were hashed so before.
    pub fn get(
        &self,
        tokens: &[u32],
        block_size: usize,
        salt: Option<u64>,
    ) -> std::sync::Arc<[BlockHash]> {
        let blocks = tokens.len() / block_size.max(1);
        let same = |m: &Memo| m.block_size == block_size && m.salt == salt && m.blocks == blocks;
        // A poisoned lock only means a panic elsewhere mid-push: the memo is a cache.
        {
            let memo = self.lock();
            if let Some(m) = memo.iter().find(|m| same(m)) {
                return m.hashes.clone();
            }
            // Hashes chain, so a longer list's head is this one (an engine admits a prompt
            // whose length is a whole number of blocks with one block less, its last token
            // computed): a copy of 16 bytes a block, not a hash of the tokens.
            if let Some(m) = memo
                .iter()
                .find(|m| m.block_size == block_size && m.salt == salt && m.blocks > blocks)
            {
                return m.hashes[..blocks].into();
            }
        }
        // Hashed outside the lock: two callers racing both hash, and one result is kept.
        let hashes: std::sync::Arc<[BlockHash]> =
            block_hashes_salted(tokens, block_size, salt).into();
        let mut memo = self.lock();
        if memo.len() < MEMOS && !memo.iter().any(same) {
            memo.push(Memo {
                block_size,
                salt,
                blocks,
                hashes: hashes.clone(),
            });
        }
        hashes
    }

    /// How many kinds of hashes (block size, salt, length) are kept.
    pub fn kept(&self) -> usize {
        self.lock().len()
    }

    /// The same memo, for a holder of the same request's tokens.
    pub fn share(&self) -> Self {
        Self(self.0.clone())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Memo>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl std::fmt::Debug for PromptHashes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PromptHashes").field(&self.kept()).finish()
    }
}

/// A memo says nothing about a request's value: two requests are equal whatever each has
/// hashed so far.
impl PartialEq for PromptHashes {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// One stored block in a KV event: `block_hash` is the sequence hash, `tokens_hash` the
/// local one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockHash {
    pub block_hash: u64,
    pub tokens_hash: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvEventData {
    /// Blocks that became reusable, a chain starting after `parent_hash`.
    Stored {
        parent_hash: Option<u64>,
        blocks: Vec<BlockHash>,
    },
    /// Blocks evicted from the cache.
    Removed { block_hashes: Vec<u64> },
    /// The whole cache was dropped.
    Cleared,
}

/// Where a worker holds a block, as vLLM's events name it: `GPU` is the engine's own pool
/// (G1, whatever the device), `CPU` host memory it offloaded to (G2), `DISK` local disk (G3).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Medium {
    #[default]
    Gpu,
    Cpu,
    Disk,
}

impl Medium {
    pub const ALL: [Medium; 3] = [Medium::Gpu, Medium::Cpu, Medium::Disk];

    /// vLLM's name for a tier (`GPU`, `CPU`, `CPU_PINNED`, `DISK`…); `None` for one dyn does
    /// not price.
    pub fn from_vllm(name: &str) -> Option<Medium> {
        let n = name.to_ascii_uppercase();
        match n.as_str() {
            "GPU" | "CUDA" | "DEVICE" => Some(Medium::Gpu),
            "DISK" | "SSD" | "NVME" => Some(Medium::Disk),
            _ if n.starts_with("CPU") || n.starts_with("HOST") => Some(Medium::Cpu),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Disk => "DISK",
        }
    }

    /// Bit of this tier in a per-block mask.
    pub fn bit(self) -> u8 {
        1 << self as u8
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheEvent {
    /// Increases by one per event of a worker; a gap means events were lost.
    pub event_id: u64,
    pub dp_rank: u32,
    /// The tier the event is about; absent means the engine's own pool (`GPU`), so events
    /// of engines without tiers read as before.
    #[serde(default, skip_serializing_if = "is_gpu")]
    pub medium: Medium,
    pub data: KvEventData,
}

fn is_gpu(m: &Medium) -> bool {
    *m == Medium::Gpu
}

/// A KV event as published on the event plane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouterEvent {
    pub worker_id: u64,
    pub event: KvCacheEvent,
}

/// A worker's load, published on the event plane after scheduling steps.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadMetrics {
    pub worker_id: u64,
    pub requests_running: u32,
    pub requests_waiting: u32,
    pub kv_active_blocks: u32,
    pub kv_total_blocks: u32,
    /// Fraction of prompt blocks found in the prefix cache, over the worker's lifetime.
    pub prefix_cache_hit_rate: f64,
    /// Tokens per KV block in the worker's engine: what routers hash prompts with.
    #[serde(default)]
    pub block_size: u32,
    /// Prompt tokens admitted or waiting but not yet computed: the prefill queue the router
    /// prices in time.
    #[serde(default)]
    pub pending_prefill_tokens: u64,
    /// The worker's measured step time (`dyn_engine::step_model`): milliseconds of a step
    /// without prefill at its current batch, and milliseconds per prompt token computed.
    /// 0 = not measured yet (engines that report no step times, like external servers).
    #[serde(default)]
    pub step_ms: f64,
    #[serde(default)]
    pub prefill_ms_per_token: f64,
}

/// Add a stored block to `events`: it extends the last stored chain when it continues it
/// (blocks stored in one step form one event), or starts a new one.
pub fn push_stored(events: &mut Vec<KvEventData>, parent: Option<u64>, block: BlockHash) {
    match events.last_mut() {
        Some(KvEventData::Stored { blocks, .. })
            if blocks.last().map(|b| b.block_hash) == parent =>
        {
            blocks.push(block)
        }
        _ => events.push(KvEventData::Stored {
            parent_hash: parent,
            blocks: vec![block],
        }),
    }
}

/// A cached block for a full dump: its tier, sequence hash, parent's and local hash.
pub type HeldBlock = (Medium, u64, Option<u64>, u64);

/// Everything a worker holds, as events a router can rebuild its view from: `Cleared` (in
/// the engine's pool), then one `Stored` per block and tier, parents before children. A block
/// whose parent is held nowhere is left out: no prompt can reach it.
pub fn dump_events(blocks: impl IntoIterator<Item = HeldBlock>) -> Vec<(Medium, KvEventData)> {
    let mut children: std::collections::HashMap<Option<u64>, Vec<(Medium, BlockHash)>> =
        std::collections::HashMap::new();
    for (medium, hash, parent, tokens_hash) in blocks {
        children.entry(parent).or_default().push((
            medium,
            BlockHash {
                block_hash: hash,
                tokens_hash,
            },
        ));
    }
    let mut out = vec![(Medium::Gpu, KvEventData::Cleared)];
    let mut queue: Vec<Option<u64>> = vec![None];
    while let Some(parent) = queue.pop() {
        for (medium, b) in children.remove(&parent).unwrap_or_default() {
            // A block held in two tiers is one node: its children are queued once (the
            // second `remove` of its entry finds nothing).
            queue.push(Some(b.block_hash));
            out.push((
                medium,
                KvEventData::Stored {
                    parent_hash: parent,
                    blocks: vec![b],
                },
            ));
        }
    }
    out
}

/// Event-plane subject of a node's KV events.
pub fn kv_events_subject(namespace: &str, component: &str) -> String {
    format!("dyn.{namespace}.{component}.kv_events")
}

/// Event-plane subject on which routers ask a worker of a node for a full dump of its cache
/// (payload: [`ResyncRequest`]), after they saw a gap in its event ids.
pub fn kv_resync_subject(namespace: &str, component: &str) -> String {
    format!("dyn.{namespace}.{component}.kv_resync")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResyncRequest {
    pub worker_id: u64,
}

/// Event-plane subject of a node's load metrics.
pub fn load_metrics_subject(namespace: &str, component: &str) -> String {
    format!("dyn.{namespace}.{component}.load_metrics")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_requests_hashes_are_kept_per_block_size_salt_and_length() {
        let tokens: Vec<u32> = (0..100).collect();
        let memo = PromptHashes::default();
        let a = memo.get(&tokens, 16, None);
        assert_eq!(&a[..], &block_hashes(&tokens, 16)[..]);
        assert!(std::sync::Arc::ptr_eq(
            &a,
            &memo.get(&tokens[..96], 16, None)
        ));
        let salted = memo.get(&tokens, 16, Some(7));
        assert_eq!(&salted[..], &block_hashes_salted(&tokens, 16, Some(7))[..]);
        assert_eq!(
            &memo.get(&tokens, 32, None)[..],
            &block_hashes(&tokens, 32)[..]
        );
        // A shorter head of what is kept: the same hashes, not kept again.
        assert_eq!(&memo.get(&tokens[..40], 16, None)[..], &a[..2]);
        assert_eq!(memo.kept(), 3);
        // The request grew by a block (a resumed request's output): hashed again.
        let longer: Vec<u32> = (0..120).collect();
        assert_eq!(memo.get(&longer, 16, None).len(), 7);
        assert_eq!(memo.kept(), 4);
        assert_eq!(memo.clone().kept(), 0);
        assert_eq!(memo.share().kept(), 4);
    }

    #[test]
    fn only_full_blocks_are_hashed_and_hashes_chain() {
        let h = block_hashes(&[1, 2, 3, 4, 5], 2);
        assert_eq!(h.len(), 2);
        assert_eq!(h[0].block_hash, h[0].tokens_hash);
        assert_eq!(h[1].tokens_hash, local_hash(&[3, 4]));
        assert_eq!(
            h[1].block_hash,
            chain_hash(Some(h[0].block_hash), h[1].tokens_hash)
        );
        // Same tokens after a different prefix: same local hash, different sequence hash.
        let g = block_hashes(&[9, 9, 3, 4], 2);
        assert_eq!(g[1].tokens_hash, h[1].tokens_hash);
        assert_ne!(g[1].block_hash, h[1].block_hash);
    }

    #[test]
    fn a_salt_changes_every_block_hash_and_no_salt_changes_none() {
        let tokens: Vec<u32> = (0..64).collect();
        let plain = block_hashes(&tokens, 16);
        assert_eq!(block_hashes_salted(&tokens, 16, None), plain);
        let (a, b) = (salt_hash("a"), salt_hash("b"));
        assert_ne!(a, b);
        assert_eq!(a, salt_hash("a"), "deterministic");
        let sa = block_hashes_salted(&tokens, 16, Some(a));
        let sb = block_hashes_salted(&tokens, 16, Some(b));
        assert_eq!(block_hashes_salted(&tokens, 16, Some(a)), sa);
        for i in 0..plain.len() {
            assert_ne!(sa[i].block_hash, plain[i].block_hash, "block {i}");
            assert_ne!(sa[i].block_hash, sb[i].block_hash, "block {i}");
        }
        // The salt is the first block's parent: its local hash is salted, the later ones are
        // the tokens' own, and the chain is the usual one from there.
        assert_eq!(sa[0].tokens_hash, chain_hash(Some(a), plain[0].tokens_hash));
        assert_eq!(sa[0].block_hash, sa[0].tokens_hash);
        for i in 1..plain.len() {
            assert_eq!(sa[i].tokens_hash, plain[i].tokens_hash);
            assert_eq!(
                sa[i].block_hash,
                chain_hash(Some(sa[i - 1].block_hash), sa[i].tokens_hash)
            );
        }
        // Not the salt's bytes hashed the way blocks are (a known hash nobody may aim at).
        assert_ne!(a, xxh3_64_with_seed(b"a", HASH_SEED));
    }

    /// Vectors computed independently with Python's `xxhash` (scripts/make-kv-hash-vectors).
    #[test]
    fn hashes_match_independent_vectors() {
        #[derive(Deserialize)]
        struct Case {
            tokens: Vec<u32>,
            block_size: usize,
            hashes: Vec<BlockHash>,
        }
        #[derive(Deserialize)]
        struct Vectors {
            cases: Vec<Case>,
        }
        let v: Vectors =
            serde_json::from_str(include_str!("../tests/fixtures/kv_hash_vectors.json"))
                .expect("fixture");
        assert_eq!(v.cases.len(), 6);
        for c in v.cases {
            assert_eq!(
                block_hashes(&c.tokens, c.block_size),
                c.hashes,
                "{:?}",
                &c.tokens[..c.tokens.len().min(8)]
            );
        }
    }

    #[test]
    fn events_use_the_brief_wire_format() {
        let e = RouterEvent {
            worker_id: 7,
            event: KvCacheEvent {
                event_id: 3,
                dp_rank: 0,
                medium: Default::default(),
                data: KvEventData::Stored {
                    parent_hash: None,
                    blocks: vec![BlockHash {
                        block_hash: 1,
                        tokens_hash: 2,
                    }],
                },
            },
        };
        assert_eq!(
            serde_json::to_string(&e).expect("json"),
            r#"{"worker_id":7,"event":{"event_id":3,"dp_rank":0,"data":{"stored":{"parent_hash":null,"blocks":[{"block_hash":1,"tokens_hash":2}]}}}}"#
        );
        let cleared = serde_json::to_string(&KvEventData::Cleared).expect("json");
        assert_eq!(cleared, r#""cleared""#);
        // An offload tier's event names it, as vLLM's do; absent reads as the pool.
        let mut e = e.event;
        e.medium = Medium::Cpu;
        let json = serde_json::to_string(&e).expect("json");
        assert!(json.contains(r#""medium":"CPU""#), "{json}");
        assert_eq!(
            serde_json::from_str::<KvCacheEvent>(&json).expect("back"),
            e
        );
        assert_eq!(Medium::from_vllm("CPU_PINNED"), Some(Medium::Cpu));
        assert_eq!(Medium::from_vllm("tape"), None);
    }
}
