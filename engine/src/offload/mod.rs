//! KV offload tiers below an engine's block pool, per worker: G2 host memory and G3 local
//! disk ([`disk`]). G1 is the engine's own pool, unchanged.
//!
//! When the pool evicts a cached block to reuse it, the engine thread copies the block's bytes
//! out (the backend's export: a memcpy on CPU, a device→host copy on CUDA) before the step
//! overwrites it, and queues them to this worker's offload thread — a bounded queue: when it
//! is full the block is dropped, never waited for. The offload thread puts the block in host
//! memory (LRU, `host_blocks`); what host memory evicts goes to disk (LRU, `disk_blocks`),
//! written by this thread, never by the engine's. A prompt whose prefix continues past the pool
//! into host memory has those blocks copied back into fresh pool blocks (onboarded) in the
//! step that admits it, and its prefill continues after them. Blocks only on disk are read by
//! the offload thread first, into host memory, while the request waits aside and others run.
//! Host memory is inclusive: an onboarded block stays there too, so evicting it again costs
//! no copy.
//!
//! Each move is a KV event in the tier it concerns ([`Medium`]: `CPU`, `DISK`), so routers
//! know what each worker holds where and price an onboard between a hit and a recompute.
//! The mocker runs the same tiers with its simulated blocks and charges the transfer time its
//! bandwidths give ([`Modelled`]).

pub mod disk;
#[cfg(test)]
mod tests;

use std::collections::HashSet;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dyn_core::Invalid;
use dyn_protocol::kv::{BlockHash, HeldBlock, KvEventData, Medium, push_stored};
use lru::LruCache;
use parking_lot::Mutex;
use serde::Deserialize;

use super::events::KvPublisher;
use disk::DiskDir;

/// `offload:` of an engine's config: the tiers below its pool. Off unless `host_blocks` is
/// set.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OffloadConfig {
    /// G2: blocks kept in host memory (0: no offload).
    pub host_blocks: u32,
    /// G3: directory for blocks on local disk, relative to the graph file; none: the user's
    /// cache directory ([`disk::default_dir`]). Each worker locks its own slot directory under
    /// `{disk_dir}/{node}/` and reuses it after a restart.
    pub disk_dir: Option<String>,
    /// G3: blocks kept on disk (0: no disk tier).
    pub disk_blocks: u32,
    /// Evicted blocks waiting for the offload thread, at most; more are dropped.
    pub queue_blocks: u32,
    /// Mocker: modelled host↔device bandwidth, GB/s (onboarding from host memory).
    pub host_gbps: f64,
    /// Mocker: modelled disk read bandwidth, GB/s.
    pub disk_gbps: f64,
}

impl Default for OffloadConfig {
    fn default() -> Self {
        Self {
            host_blocks: 0,
            disk_dir: None,
            disk_blocks: 0,
            queue_blocks: 256,
            // One PCIe 5 x16 direction, and one NVMe drive.
            host_gbps: 25.0,
            disk_gbps: 3.0,
        }
    }
}

impl OffloadConfig {
    pub fn enabled(&self) -> bool {
        self.host_blocks > 0
    }

    /// Every problem, field names under `prefix` (`config.native.offload.`).
    pub fn validate(&self, prefix: &str) -> Vec<Invalid> {
        let mut out = Vec::new();
        let field = |f: &str| format!("{prefix}{f}");
        if self.disk_blocks > 0 && self.host_blocks == 0 {
            out.push(Invalid::field(
                field("host_blocks"),
                "the disk tier needs a host tier: blocks reach disk through host memory",
            ));
        }
        if self.queue_blocks == 0 {
            out.push(Invalid::field(field("queue_blocks"), "must be at least 1"));
        }
        for (name, v) in [("host_gbps", self.host_gbps), ("disk_gbps", self.disk_gbps)] {
            if !(v.is_finite() && v > 0.0) {
                out.push(Invalid::field(field(name), "must be a positive number"));
            }
        }
        out
    }
}

/// A block's place in its prefix: what its KV event and a disk file name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Meta {
    pub parent: Option<u64>,
    pub tokens_hash: u64,
}

/// The mocker's transfer times: its blocks are tiny stand-ins, so the time is charged for the
/// bytes a real model's block would have.
#[derive(Debug, Clone, Copy)]
pub struct Modelled {
    pub block_bytes: f64,
    pub host_gbps: f64,
    pub disk_gbps: f64,
    pub speedup: f64,
}

impl Modelled {
    fn time(&self, blocks: usize, gbps: f64) -> Duration {
        Duration::from_secs_f64(blocks as f64 * self.block_bytes / (gbps * 1e9) / self.speedup)
    }

    /// Copying `blocks` from host memory into the pool.
    pub fn onboard(&self, blocks: usize) -> Duration {
        self.time(blocks, self.host_gbps)
    }
}

/// What the tiers did, for `/metrics`, `dyn inspect kv` and tests.
#[derive(Debug, Default)]
pub struct Stats {
    /// Blocks written to host memory / to disk.
    pub offloaded_host: AtomicU64,
    pub offloaded_disk: AtomicU64,
    /// Evicted blocks dropped because the offload queue was full.
    pub dropped: AtomicU64,
    /// Prompt blocks served from host memory (that were there) / read from disk.
    pub hits_host: AtomicU64,
    pub hits_disk: AtomicU64,
    /// Disk blocks that failed their checks (recomputed).
    pub corrupt: AtomicU64,
    /// Bytes copied out of the pool, and back into it.
    pub bytes_out: AtomicU64,
    pub bytes_in: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

struct HostBlock {
    meta: Meta,
    data: Bytes,
    /// The mocker's modelled disk read ends here.
    ready_at: Option<Instant>,
    /// Read from disk and not onboarded since: its next hit is a disk hit.
    from_disk: bool,
}

struct Inner {
    host: LruCache<u64, HostBlock>,
    /// Blocks on disk (the files themselves are the offload thread's).
    disk: Option<LruCache<u64, Meta>>,
    /// Blocks being read from disk.
    fetching: HashSet<u64>,
}

enum Job {
    Store(Vec<(u64, Meta, Bytes)>),
    Fetch(Vec<u64>),
}

/// A worker's G2 and G3: shared by its engine thread (lookups, onboarding, offers) and its
/// offload thread (every write, every disk access).
pub struct Tiers {
    inner: Mutex<Inner>,
    jobs: std_mpsc::SyncSender<Job>,
    pub stats: Stats,
    model: Option<Modelled>,
    events: Arc<KvPublisher>,
    host_capacity: usize,
    disk_capacity: usize,
    /// Evicted blocks queued for the offload thread, and how many may be.
    queued: AtomicUsize,
    queue_capacity: usize,
}

impl Tiers {
    /// Open the tiers (locking and scanning the disk directory, `disk_dir` resolved already;
    /// none: [`disk::default_dir`]) and start the offload thread. Blocks a previous run left on
    /// disk are announced.
    pub fn start(
        config: &OffloadConfig,
        disk_dir: Option<PathBuf>,
        node: &str,
        format: &str,
        model: Option<Modelled>,
        events: Arc<KvPublisher>,
    ) -> std::io::Result<Arc<Tiers>> {
        let host_capacity = config.host_blocks.max(1) as usize;
        let disk_capacity = config.disk_blocks as usize;
        let dir = match (disk_dir, NonZeroUsize::new(disk_capacity)) {
            (_, None) => None,
            (Some(base), Some(_)) => Some(DiskDir::open(&base, node, format)?),
            (None, Some(_)) => Some(DiskDir::open(&disk::default_dir()?, node, format)?),
        };
        let mut disk = NonZeroUsize::new(disk_capacity)
            .filter(|_| dir.is_some())
            .map(LruCache::new);
        if let (Some(dir), Some(index)) = (&dir, &mut disk) {
            let found = dir.scan();
            let mut kept = Vec::new();
            for (h, meta) in found {
                if let Some((old, _)) = index.push(h, meta) {
                    dir.remove(old);
                }
            }
            for (h, meta) in index.iter() {
                kept.push((Medium::Disk, *h, meta.parent, meta.tokens_hash));
            }
            if !kept.is_empty() {
                tracing::info!(
                    dir = %dir.dir.display(),
                    blocks = kept.len(),
                    "Reusing the KV blocks a previous worker left on disk"
                );
                let stored = dyn_protocol::kv::dump_events(kept)
                    .into_iter()
                    .filter(|(_, e)| *e != KvEventData::Cleared)
                    .collect();
                events.publish_mixed(stored);
            }
        }
        let (jobs, rx) = std_mpsc::sync_channel(config.queue_blocks.max(1) as usize);
        let tiers = Arc::new(Tiers {
            inner: Mutex::new(Inner {
                host: LruCache::new(NonZeroUsize::new(host_capacity).unwrap_or(NonZeroUsize::MIN)),
                disk,
                fetching: HashSet::new(),
            }),
            jobs,
            stats: Stats::default(),
            model,
            events,
            host_capacity,
            disk_capacity,
            queued: AtomicUsize::new(0),
            queue_capacity: config.queue_blocks.max(1) as usize,
        });
        let weak = Arc::downgrade(&tiers);
        std::thread::Builder::new()
            .name(format!("kv-offload-{node}"))
            .spawn(move || offload_thread(weak, rx, dir))?;
        Ok(tiers)
    }

    /// `(blocks, capacity)` in host memory and on disk.
    pub fn occupancy(&self) -> [(usize, usize); 2] {
        let g = self.inner.lock();
        [
            (g.host.len(), self.host_capacity),
            (g.disk.as_ref().map_or(0, LruCache::len), self.disk_capacity),
        ]
    }

    /// Everything counted so far.
    pub fn counts(&self) -> crate::metrics::TierCounts {
        let s = &self.stats;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        crate::metrics::TierCounts {
            occupancy: self.occupancy(),
            offloaded: [get(&s.offloaded_host), get(&s.offloaded_disk)],
            hits: [get(&s.hits_host), get(&s.hits_disk)],
            dropped: get(&s.dropped),
            corrupt: get(&s.corrupt),
            bytes_out: get(&s.bytes_out),
            bytes_in: get(&s.bytes_in),
        }
    }

    /// How many leading blocks of `hashes` host memory holds, ready to onboard.
    pub fn ready(&self, hashes: &[u64]) -> usize {
        let now = Instant::now();
        let g = self.inner.lock();
        hashes
            .iter()
            .take_while(|h| {
                g.host
                    .peek(h)
                    .is_some_and(|b| b.ready_at.is_none_or(|t| t <= now))
            })
            .count()
    }

    /// The items (evicted blocks, by `hash`) host memory lacks; those it holds count as just
    /// used and need no copy. One lock for the whole step's evictions.
    pub fn lacking<'a, E>(&self, items: &'a [E], hash: impl Fn(&E) -> u64) -> Vec<&'a E> {
        let mut g = self.inner.lock();
        items
            .iter()
            .filter(|e| g.host.get(&hash(e)).is_none())
            .collect()
    }

    /// Queue evicted blocks for the offload thread; dropped when its queue is full.
    pub fn offload(&self, blocks: Vec<(u64, Meta, Bytes)>) {
        if blocks.is_empty() {
            return;
        }
        let n = blocks.len();
        let bytes: usize = blocks.iter().map(|b| b.2.len()).sum();
        let drop = |t: &Tiers| {
            t.queued.fetch_sub(n, Ordering::AcqRel);
            add(&t.stats.dropped, n as u64);
        };
        if self.queued.fetch_add(n, Ordering::AcqRel) + n > self.queue_capacity {
            return drop(self);
        }
        match self.jobs.try_send(Job::Store(blocks)) {
            Ok(()) => add(&self.stats.bytes_out, bytes as u64),
            Err(_) => drop(self),
        }
    }

    /// The bytes of the leading blocks of `hashes` that host memory holds and are ready, for
    /// onboarding.
    pub fn take(&self, hashes: &[u64]) -> Vec<Bytes> {
        let now = Instant::now();
        let mut g = self.inner.lock();
        let mut out = Vec::new();
        let (mut host, mut disk) = (0, 0);
        for h in hashes {
            let Some(b) = g.host.get_mut(h) else { break };
            if b.ready_at.is_some_and(|t| t > now) {
                break;
            }
            if std::mem::take(&mut b.from_disk) {
                disk += 1;
            } else {
                host += 1;
            }
            out.push(b.data.clone());
        }
        drop(g);
        add(&self.stats.hits_host, host);
        add(&self.stats.hits_disk, disk);
        add(
            &self.stats.bytes_in,
            out.iter().map(|b| b.len() as u64).sum(),
        );
        out
    }

    /// Start reading the blocks on disk in the prefix of `hashes` the tiers hold (host
    /// memory and disk in any order, as much as host memory holds); how many are (or were
    /// already) on their way. 0: nothing to wait for. The prefix's blocks already in host
    /// memory count as just used, so the read does not push them out.
    pub fn fetch(&self, hashes: &[u64]) -> usize {
        let mut g = self.inner.lock();
        let Some(disk) = &g.disk else { return 0 };
        let run: Vec<(u64, bool)> = hashes
            .iter()
            .map_while(|h| {
                if g.host.contains(h) {
                    Some((*h, true))
                } else {
                    disk.contains(h).then_some((*h, false))
                }
            })
            .take(self.host_capacity)
            .collect();
        let mut want = Vec::new();
        for &(h, in_host) in run.iter().rev() {
            if in_host {
                g.host.promote(&h);
            } else {
                want.push(h);
            }
        }
        want.reverse();
        let new: Vec<u64> = want
            .iter()
            .filter(|h| !g.fetching.contains(h))
            .copied()
            .collect();
        if new.is_empty() {
            return want.len();
        }
        g.fetching.extend(new.iter().copied());
        if self.jobs.try_send(Job::Fetch(new.clone())).is_err() {
            for h in &new {
                g.fetching.remove(h);
            }
            return 0;
        }
        want.len()
    }

    /// Whether a leading block of `hashes` is still being read from disk.
    pub fn pending(&self, hashes: &[u64]) -> bool {
        let now = Instant::now();
        let g = self.inner.lock();
        hashes.iter().any(|h| {
            g.fetching.contains(h) || g.host.peek(h).is_some_and(|b| b.ready_at > Some(now))
        })
    }

    /// Every block the tiers hold, for a full dump.
    pub fn held(&self) -> Vec<HeldBlock> {
        let g = self.inner.lock();
        let host = g
            .host
            .iter()
            .map(|(h, b)| (Medium::Cpu, *h, b.meta.parent, b.meta.tokens_hash));
        let disk = g
            .disk
            .iter()
            .flat_map(|d| d.iter())
            .map(|(h, m)| (Medium::Disk, *h, m.parent, m.tokens_hash));
        host.chain(disk).collect()
    }

    /// Put blocks in host memory; what it evicts goes to disk. Runs on the offload thread.
    fn store(
        &self,
        blocks: Vec<(u64, Meta, Bytes)>,
        ready_at: Option<Instant>,
        dir: Option<&DiskDir>,
    ) {
        // Only blocks read from disk come with a time they are ready at.
        let from_disk = ready_at.is_some();
        let (mut stored, mut removed, mut victims) = (Vec::new(), Vec::new(), Vec::new());
        {
            let mut g = self.inner.lock();
            for (hash, meta, data) in blocks {
                if g.host.get(&hash).is_some() {
                    continue;
                }
                let block = HostBlock {
                    meta,
                    data,
                    ready_at,
                    from_disk,
                };
                if let Some((old, b)) = g.host.push(hash, block) {
                    removed.push(old);
                    victims.push((old, b));
                }
                push_stored(
                    &mut stored,
                    meta.parent,
                    BlockHash {
                        block_hash: hash,
                        tokens_hash: meta.tokens_hash,
                    },
                );
                add(&self.stats.offloaded_host, 1);
            }
        }
        self.removed(Medium::Cpu, removed);
        self.events.publish(Medium::Cpu, stored);
        if let Some(dir) = dir {
            self.spill(victims, dir);
        }
    }

    /// Write blocks host memory evicted to disk (unless there already).
    fn spill(&self, victims: Vec<(u64, HostBlock)>, dir: &DiskDir) {
        let (mut stored, mut removed) = (Vec::new(), Vec::new());
        for (hash, b) in victims {
            if self
                .inner
                .lock()
                .disk
                .as_mut()
                .is_none_or(|d| d.get(&hash).is_some())
            {
                continue;
            }
            if let Err(e) = dir.write(hash, b.meta, &b.data) {
                tracing::warn!(error = %e, dir = %dir.dir.display(), "Cannot write a KV block to disk; dropped");
                dir.remove(hash);
                continue;
            }
            let evicted = self
                .inner
                .lock()
                .disk
                .as_mut()
                .and_then(|d| d.push(hash, b.meta));
            if let Some((old, _)) = evicted {
                dir.remove(old);
                removed.push(old);
            }
            push_stored(
                &mut stored,
                b.meta.parent,
                BlockHash {
                    block_hash: hash,
                    tokens_hash: b.meta.tokens_hash,
                },
            );
            add(&self.stats.offloaded_disk, 1);
        }
        self.removed(Medium::Disk, removed);
        self.events.publish(Medium::Disk, stored);
    }

    /// Read blocks from disk into host memory; a block that fails its checks is dropped (and
    /// its prefix's later blocks are not read: no prompt reaches them through it).
    fn fetch_from(&self, hashes: Vec<u64>, dir: &DiskDir) {
        let mut read = Vec::new();
        let mut bad = None;
        for &h in &hashes {
            let meta = self
                .inner
                .lock()
                .disk
                .as_mut()
                .and_then(|d| d.get(&h).copied());
            let Some(meta) = meta else { break };
            match dir.read(h) {
                Ok(data) => read.push((h, meta, data)),
                Err(e) => {
                    tracing::warn!(block = format_args!("{h:016x}"), error = %e, "A KV block on disk is unusable; it will be recomputed");
                    add(&self.stats.corrupt, 1);
                    bad = Some(h);
                    break;
                }
            }
        }
        if let Some(h) = bad {
            dir.remove(h);
            self.inner.lock().disk.as_mut().map(|d| d.pop(&h));
            self.removed(Medium::Disk, vec![h]);
        }
        let ready_at = Instant::now()
            + self
                .model
                .map_or(Duration::ZERO, |m| m.time(read.len(), m.disk_gbps));
        self.store(read, Some(ready_at), Some(dir));
        let mut g = self.inner.lock();
        for h in &hashes {
            g.fetching.remove(h);
        }
    }

    fn removed(&self, medium: Medium, hashes: Vec<u64>) {
        if !hashes.is_empty() {
            self.events.publish(
                medium,
                vec![KvEventData::Removed {
                    block_hashes: hashes,
                }],
            );
        }
    }
}

impl super::scheduler::Lower for Arc<Tiers> {
    fn ready(&self, hashes: &[u64]) -> usize {
        Tiers::ready(self, hashes)
    }
    fn take(&mut self, hashes: &[u64]) -> Vec<Bytes> {
        Tiers::take(self, hashes)
    }
    fn fetch(&mut self, hashes: &[u64]) -> usize {
        Tiers::fetch(self, hashes)
    }
    fn pending(&self, hashes: &[u64]) -> bool {
        Tiers::pending(self, hashes)
    }
}

/// The offload thread: every tier write and disk access. It ends with the tiers.
fn offload_thread(tiers: Weak<Tiers>, rx: std_mpsc::Receiver<Job>, dir: Option<DiskDir>) {
    while let Ok(job) = rx.recv() {
        let Some(t) = tiers.upgrade() else { break };
        match job {
            Job::Store(blocks) => {
                let n = blocks.len();
                t.store(blocks, None, dir.as_ref());
                t.queued.fetch_sub(n, Ordering::AcqRel);
            }
            Job::Fetch(hashes) => match &dir {
                Some(dir) => t.fetch_from(hashes, dir),
                None => {
                    let mut g = t.inner.lock();
                    for h in &hashes {
                        g.fetching.remove(h);
                    }
                }
            },
        }
    }
}
