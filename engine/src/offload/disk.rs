//! G3: KV blocks as files under a worker's own directory.
//!
//! One file per block, `{sequence hash:016x}.kvb`: a header naming the block (its sequence
//! hash, parent, local hash), the layout its bytes are in (`format`: layout, dtype and block
//! size of the engine that wrote it) and an XXH3-64 checksum of the payload, then the payload.
//! A file that does not parse, names another block or layout, is short, or fails its checksum
//! is a miss: the block is recomputed, never onboarded. Files are written under a temporary
//! name and renamed, so a crash leaves no half block under a real name.
//!
//! Each worker locks a slot directory (`{disk_dir}/{node}/{n}`, the first one free), so
//! replicas sharing a `disk_dir` never share files, and a restarted worker takes its old slot
//! back and **reuses** the blocks it finds there (headers checked at start, payloads when
//! read).

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use xxhash_rust::xxh3::xxh3_64;

use super::Meta;

const MAGIC: &[u8; 8] = b"DYNKVB01";
/// Slot directories tried per node before giving up.
const SLOTS: usize = 256;

/// Why a block on disk could not be used.
#[derive(Debug, thiserror::Error)]
pub enum BadBlock {
    #[error("cannot read it: {0}")]
    Io(#[from] io::Error),
    #[error("{0}")]
    Invalid(&'static str),
}

/// A worker's disk tier directory, locked for as long as this lives.
pub struct DiskDir {
    pub dir: PathBuf,
    /// Holds the slot's lock.
    _lock: File,
    format: String,
}

impl DiskDir {
    /// Lock the first free slot under `base/node`, for blocks of `format`.
    pub fn open(base: &Path, node: &str, format: &str) -> io::Result<DiskDir> {
        let root = base.join(node);
        for n in 0..SLOTS {
            let dir = root.join(n.to_string());
            fs::create_dir_all(&dir)?;
            let lock = File::create(dir.join("lock"))?;
            match lock.try_lock() {
                Ok(()) => {
                    return Ok(DiskDir {
                        dir,
                        _lock: lock,
                        format: format.to_string(),
                    });
                }
                Err(fs::TryLockError::WouldBlock) => continue,
                Err(fs::TryLockError::Error(e)) => return Err(e),
            }
        }
        Err(io::Error::other(format!(
            "all {SLOTS} slot directories under {} are locked by other workers",
            root.display()
        )))
    }

    pub fn path(&self, hash: u64) -> PathBuf {
        self.dir.join(format!("{hash:016x}.kvb"))
    }

    /// Blocks a previous worker left here in this format, oldest first; files that are not
    /// (half-written ones, other layouts) are deleted.
    pub fn scan(&self) -> Vec<(u64, Meta)> {
        let mut found = Vec::new();
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        for e in entries.flatten() {
            let path = e.path();
            let name = e.file_name();
            let name = name.to_string_lossy();
            if name == "lock" {
                continue;
            }
            let hash = name
                .strip_suffix(".kvb")
                .and_then(|h| u64::from_str_radix(h, 16).ok());
            let header = hash.and_then(|h| {
                let mut head = Vec::new();
                File::open(&path)
                    .ok()?
                    .take(HEADER_MAX)
                    .read_to_end(&mut head)
                    .ok()?;
                let (meta, _) = parse_header(&head, h, &self.format).ok()?;
                let at = e.metadata().and_then(|m| m.modified()).ok()?;
                Some((at, h, meta))
            });
            match header {
                Some(h) => found.push(h),
                None => {
                    let _ = fs::remove_file(&path);
                }
            }
        }
        found.sort_by_key(|(at, _, _)| *at);
        found.into_iter().map(|(_, h, m)| (h, m)).collect()
    }

    /// Write a block (temporary name, then rename).
    pub fn write(&self, hash: u64, meta: Meta, data: &[u8]) -> io::Result<()> {
        let path = self.path(hash);
        let tmp = path.with_extension("tmp");
        let mut f = File::create(&tmp)?;
        let mut header = Vec::with_capacity(64 + self.format.len());
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&hash.to_le_bytes());
        header.extend_from_slice(&meta.parent.unwrap_or(0).to_le_bytes());
        header.push(u8::from(meta.parent.is_some()));
        header.extend_from_slice(&meta.tokens_hash.to_le_bytes());
        let format = self.format.as_bytes();
        header.extend_from_slice(&(format.len() as u16).to_le_bytes());
        header.extend_from_slice(format);
        header.extend_from_slice(&(data.len() as u64).to_le_bytes());
        header.extend_from_slice(&xxh3_64(data).to_le_bytes());
        f.write_all(&header)?;
        f.write_all(data)?;
        drop(f);
        fs::rename(&tmp, &path)
    }

    /// Read and check a block: one read of the whole file, the payload handed out in place.
    pub fn read(&self, hash: u64) -> Result<Bytes, BadBlock> {
        let file = Bytes::from(fs::read(self.path(hash))?);
        let (_, h) = parse_header(&file, hash, &self.format)?;
        let data = file.slice(h.start..);
        if data.len() as u64 != h.len {
            return Err(BadBlock::Invalid("truncated (or grown) payload"));
        }
        if xxh3_64(&data) != h.checksum {
            return Err(BadBlock::Invalid("checksum mismatch"));
        }
        Ok(data)
    }

    pub fn remove(&self, hash: u64) {
        let _ = fs::remove_file(self.path(hash));
    }
}

/// Headers are read with at most this many bytes (a format name is short).
const HEADER_MAX: u64 = 4096;

/// Where a block file's payload starts, how long it is and its checksum.
struct Payload {
    start: usize,
    len: u64,
    checksum: u64,
}

/// The header at the start of `buf`: the block's meta and where its payload is, if it is the
/// block `hash` in `format`.
fn parse_header(buf: &[u8], hash: u64, format: &str) -> Result<(Meta, Payload), BadBlock> {
    const SHORT: BadBlock = BadBlock::Invalid("truncated header");
    let fixed = buf.get(..35).ok_or(SHORT)?;
    let u64_at = |b: &[u8], i: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[i..i + 8]);
        u64::from_le_bytes(a)
    };
    if &fixed[..8] != MAGIC {
        return Err(BadBlock::Invalid("not a dyn KV block file"));
    }
    if u64_at(fixed, 8) != hash {
        return Err(BadBlock::Invalid("the file holds another block"));
    }
    let parent = (fixed[24] == 1).then(|| u64_at(fixed, 16));
    let tokens_hash = u64_at(fixed, 25);
    let flen = u16::from_le_bytes([fixed[33], fixed[34]]) as usize;
    let fmt = buf.get(35..35 + flen).ok_or(SHORT)?;
    if fmt != format.as_bytes() {
        return Err(BadBlock::Invalid("the block is in another layout"));
    }
    let tail = buf.get(35 + flen..35 + flen + 16).ok_or(SHORT)?;
    let meta = Meta {
        parent,
        tokens_hash,
    };
    let payload = Payload {
        start: 35 + flen + 16,
        len: u64_at(tail, 0),
        checksum: u64_at(tail, 8),
    };
    Ok((meta, payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> Meta {
        Meta {
            parent: Some(7),
            tokens_hash: 9,
        }
    }

    #[test]
    fn blocks_round_trip_and_damage_is_a_miss() {
        let tmp = dyn_tests::scratch_dir("disk-round-trip");
        let d = DiskDir::open(&tmp, "decode", "f32/16").expect("open");
        let data: Vec<u8> = (0..200u32).map(|i| i as u8).collect();
        d.write(5, meta(), &data).expect("write");
        assert_eq!(d.read(5).expect("read").as_ref(), &data[..]);
        assert_eq!(d.scan(), vec![(5, meta())]);

        // One flipped payload byte: the checksum says so.
        let path = d.path(5);
        let mut bytes = fs::read(&path).expect("read");
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        fs::write(&path, &bytes).expect("write");
        assert!(matches!(
            d.read(5),
            Err(BadBlock::Invalid("checksum mismatch"))
        ));
        // Truncated.
        fs::write(&path, &bytes[..bytes.len() - 10]).expect("write");
        assert!(d.read(5).is_err());
        // Truncated inside the header, and a file named for another block.
        fs::write(&path, &bytes[..12]).expect("write");
        assert!(d.read(5).is_err());
        d.write(6, meta(), &data).expect("write");
        fs::copy(d.path(6), d.path(5)).expect("copy");
        assert!(matches!(
            d.read(5),
            Err(BadBlock::Invalid("the file holds another block"))
        ));
        // Another layout is not this worker's block.
        let other = DiskDir {
            dir: d.dir.clone(),
            _lock: File::open(d.dir.join("lock")).expect("lock"),
            format: "f16/16".into(),
        };
        assert!(matches!(
            other.read(6),
            Err(BadBlock::Invalid("the block is in another layout"))
        ));
    }

    #[test]
    fn workers_take_their_own_slot_and_a_restart_finds_its_blocks() {
        let tmp = dyn_tests::scratch_dir("disk-slots");
        let a = DiskDir::open(&tmp, "decode", "x").expect("open");
        let b = DiskDir::open(&tmp, "decode", "x").expect("open");
        assert_ne!(a.dir, b.dir, "a locked slot is not shared");
        a.write(1, meta(), b"abc").expect("write");
        fs::write(a.dir.join("0000000000000002.tmp"), b"half").expect("write");
        fs::write(a.dir.join("0000000000000003.kvb"), b"junk").expect("write");
        let dir = a.dir.clone();
        drop(a);
        let again = DiskDir::open(&tmp, "decode", "x").expect("open");
        assert_eq!(again.dir, dir, "the freed slot is taken again");
        assert_eq!(again.scan(), vec![(1, meta())]);
        assert!(
            !dir.join("0000000000000003.kvb").exists(),
            "junk is removed"
        );
    }
}
