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
//!
//! The blocks are prompts' KV, so on a shared machine nobody else may read them or slip
//! blocks in: the directories dyn makes are 0700 and its files 0600; the node and slot
//! directories must be real directories (no symlink) of this user that nobody else can
//! write, and `disk_dir` one nobody else can rename them out of; no file is opened through a
//! symlink (`O_NOFOLLOW`), so one planted at a block's name is neither read nor written
//! through. Without a `disk_dir` the tier lives in the user's cache directory
//! ([`default_dir`]), never in a shared `/tmp`.

use std::ffi::OsString;
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use nix::fcntl::OFlag;
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
    /// Lock the first free slot under `base/node`, for blocks of `format`. `base` and the
    /// directories under it are made (0700) when missing, and refused when someone else
    /// could reach into them.
    pub fn open(base: &Path, node: &str, format: &str) -> io::Result<DiskDir> {
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(base)
            .map_err(|e| at(base, "cannot create the KV disk tier directory", e))?;
        check_base(base)?;
        let root = base.join(node);
        own_dir(&root)?;
        for n in 0..SLOTS {
            let dir = root.join(n.to_string());
            own_dir(&dir)?;
            let path = dir.join("lock");
            // The lock file is kept across runs (never truncated: it holds nothing).
            let lock = OpenOptions::new()
                .write(true)
                .create(true)
                .mode(0o600)
                .custom_flags(nofollow())
                .open(&path)
                .map_err(|e| at(&path, "cannot open the KV disk tier's lock", e))?;
            match lock.try_lock() {
                Ok(()) => {
                    return Ok(DiskDir {
                        dir,
                        _lock: lock,
                        format: format.to_string(),
                    });
                }
                Err(fs::TryLockError::WouldBlock) => continue,
                Err(fs::TryLockError::Error(e)) => {
                    return Err(at(&path, "cannot lock the KV disk tier's slot", e));
                }
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
            // Only regular files are blocks (the entry's own type: a symlink is not one).
            let hash = name
                .strip_suffix(".kvb")
                .and_then(|h| u64::from_str_radix(h, 16).ok())
                .filter(|_| e.file_type().is_ok_and(|t| t.is_file()));
            let header = hash.and_then(|h| {
                let mut head = Vec::new();
                open_read(&path)
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
        // One a crash left (or anything else at the name: a symlink is unlinked, not
        // followed) goes first, so the file written is always a new one of ours.
        match fs::remove_file(&tmp) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(nofollow())
            .open(&tmp)?;
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
        // A rename replaces the name itself: a symlink there is replaced, its target untouched.
        fs::rename(&tmp, &path)
    }

    /// Read and check a block: one read of the whole file, the payload handed out in place.
    pub fn read(&self, hash: u64) -> Result<Bytes, BadBlock> {
        let mut f = open_read(&self.path(hash))?;
        let mut buf = Vec::with_capacity(f.metadata().map_or(0, |m| m.len() as usize));
        f.read_to_end(&mut buf)?;
        let file = Bytes::from(buf);
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

/// The default `disk_dir`: `dyn/kv-offload` in the user's cache directory
/// (`$XDG_CACHE_HOME`, else `$HOME/.cache`) — the user's own, where `/tmp` is everyone's.
pub fn default_dir() -> io::Result<PathBuf> {
    cache_dir(std::env::var_os("XDG_CACHE_HOME"), std::env::var_os("HOME"))
        .map(|d| d.join("dyn").join("kv-offload"))
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "the KV disk tier has no `disk_dir`, and neither $XDG_CACHE_HOME nor $HOME is an \
                 absolute path to put the default under: set `offload.disk_dir`",
            )
        })
}

/// The user's cache directory from `$XDG_CACHE_HOME` and `$HOME`.
fn cache_dir(xdg_cache_home: Option<OsString>, home: Option<OsString>) -> Option<PathBuf> {
    // The XDG base directory spec: a relative (or empty) path is invalid and ignored.
    let absolute = |v: Option<OsString>| v.map(PathBuf::from).filter(|p| p.is_absolute());
    absolute(xdg_cache_home).or_else(|| absolute(home).map(|h| h.join(".cache")))
}

/// `open(2)`'s flag that fails on a symlink as the path's last component.
fn nofollow() -> i32 {
    OFlag::O_NOFOLLOW.bits()
}

/// Open a block file for reading, never through a symlink.
fn open_read(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(nofollow())
        .open(path)
}

/// `e` with what was being done to `path`.
fn at(path: &Path, what: &str, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{what} {}: {e}", path.display()))
}

/// A refusal to use `path`, saying why.
fn refuse(path: &Path, why: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!(
            "refusing the KV disk tier directory {}: {why}",
            path.display()
        ),
    )
}

/// `disk_dir` is the operator's (it may be reached through symlinks, and be shared, as
/// `/tmp` is): it only has to keep the node directory dyn makes in it from being renamed or
/// replaced by another user — owned by this user or root, and writable by no one else unless
/// sticky (where only an entry's owner may rename it).
fn check_base(path: &Path) -> io::Result<()> {
    let m = fs::metadata(path).map_err(|e| at(path, "cannot inspect", e))?;
    if !m.is_dir() {
        return Err(refuse(path, "not a directory"));
    }
    let me = nix::unistd::geteuid().as_raw();
    if m.uid() != me && m.uid() != 0 {
        return Err(refuse(
            path,
            &format!("owned by uid {}, not this user (uid {me}) or root", m.uid()),
        ));
    }
    // Anyone else who may write here could rename the worker's directory out and put a
    // symlink in its place between checks (O_NOFOLLOW guards a path's last part only), unless
    // the directory is sticky (only an entry's owner may rename it, as in /tmp).
    if m.mode() & 0o022 != 0 && m.mode() & 0o1000 == 0 {
        return Err(refuse(
            path,
            "writable by other users and not sticky (they could rename the worker's \
             directories in it): chmod go-w or +t it, or choose another `disk_dir`",
        ));
    }
    Ok(())
}

/// Make one of dyn's own directories (the node's, a slot) 0700 if missing; if it is there,
/// it must be a real directory of this user that nobody else can write. One that others can
/// read (left by an older dyn under a 022 umask) is made private.
fn own_dir(path: &Path) -> io::Result<()> {
    match DirBuilder::new().mode(0o700).create(path) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => {
            return Err(at(path, "cannot create the KV disk tier directory", e));
        }
        _ => {}
    }
    // The entry itself: a symlink here could send the blocks anywhere.
    let m = fs::symlink_metadata(path).map_err(|e| at(path, "cannot inspect", e))?;
    if m.file_type().is_symlink() {
        return Err(refuse(path, "it is a symbolic link, not a directory"));
    }
    if !m.is_dir() {
        return Err(refuse(path, "not a directory"));
    }
    let me = nix::unistd::geteuid().as_raw();
    if m.uid() != me {
        return Err(refuse(
            path,
            &format!("owned by uid {}, not this user (uid {me})", m.uid()),
        ));
    }
    if m.mode() & 0o022 != 0 {
        return Err(refuse(
            path,
            &format!(
                "writable by its group or other users (mode {:o}): remove it or chmod go-w it",
                m.mode() & 0o7777
            ),
        ));
    }
    if m.mode() & 0o077 != 0 {
        fs::set_permissions(path, fs::Permissions::from_mode(0o700))
            .map_err(|e| at(path, "cannot make private", e))?;
    }
    Ok(())
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
    use std::os::unix::fs::symlink;

    use super::*;

    fn mode(path: &Path) -> u32 {
        fs::symlink_metadata(path).expect("stat").mode() & 0o7777
    }

    fn refused(r: io::Result<DiskDir>) -> String {
        match r {
            Ok(d) => panic!("{} was accepted", d.dir.display()),
            Err(e) => e.to_string(),
        }
    }

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

    #[test]
    fn directories_are_0700_and_files_0600() {
        let tmp = dyn_tests::scratch_dir("disk-modes");
        // Every directory dyn makes, `disk_dir`'s missing parents included.
        let base = tmp.join("cache").join("kv");
        let d = DiskDir::open(&base, "decode", "x").expect("open");
        d.write(1, meta(), b"abc").expect("write");
        for dir in [
            tmp.join("cache"),
            base.clone(),
            base.join("decode"),
            d.dir.clone(),
        ] {
            assert_eq!(mode(&dir), 0o700, "{}", dir.display());
        }
        for file in [d.dir.join("lock"), d.path(1)] {
            assert_eq!(mode(&file), 0o600, "{}", file.display());
        }
        // A stale temporary file (a crash) is replaced by a private one.
        let tmp_file = d.path(2).with_extension("tmp");
        fs::write(&tmp_file, b"half").expect("write");
        fs::set_permissions(&tmp_file, fs::Permissions::from_mode(0o666)).expect("chmod");
        d.write(2, meta(), b"def").expect("write");
        assert_eq!(mode(&d.path(2)), 0o600);
        assert_eq!(d.read(2).expect("read").as_ref(), b"def");

        // Directories an older dyn left readable by others are made private.
        drop(d);
        fs::set_permissions(base.join("decode"), fs::Permissions::from_mode(0o755)).expect("chmod");
        fs::set_permissions(base.join("decode/0"), fs::Permissions::from_mode(0o755))
            .expect("chmod");
        let d = DiskDir::open(&base, "decode", "x").expect("open");
        assert_eq!(mode(&base.join("decode")), 0o700);
        assert_eq!(mode(&d.dir), 0o700);
    }

    #[test]
    fn a_symlinked_directory_is_refused() {
        let tmp = dyn_tests::scratch_dir("disk-symlink-dir");
        let elsewhere = tmp.join("elsewhere");
        fs::create_dir(&elsewhere).expect("mkdir");
        fs::set_permissions(&elsewhere, fs::Permissions::from_mode(0o700)).expect("chmod");

        // The node directory a symlink.
        let base = tmp.join("a");
        fs::create_dir(&base).expect("mkdir");
        symlink(&elsewhere, base.join("decode")).expect("symlink");
        let e = refused(DiskDir::open(&base, "decode", "x"));
        assert!(e.contains("symbolic link"), "{e}");
        assert!(
            e.contains(&base.join("decode").display().to_string()),
            "{e}"
        );

        // A slot directory a symlink.
        let base = tmp.join("b");
        fs::create_dir_all(base.join("decode")).expect("mkdir");
        symlink(&elsewhere, base.join("decode/0")).expect("symlink");
        let e = refused(DiskDir::open(&base, "decode", "x"));
        assert!(e.contains("symbolic link"), "{e}");
        assert!(
            e.contains(&base.join("decode/0").display().to_string()),
            "{e}"
        );
        assert_eq!(
            fs::read_dir(&elsewhere).expect("ls").count(),
            0,
            "nothing is made through the symlink"
        );
    }

    #[test]
    fn a_directory_others_can_write_is_refused() {
        let tmp = dyn_tests::scratch_dir("disk-writable-dir");
        for (n, bits) in [0o770, 0o707, 0o777].into_iter().enumerate() {
            // The slot directory, and the node directory.
            for at in ["decode/0", "decode"] {
                let base = tmp.join(format!("{n}-{}", at.len()));
                fs::create_dir_all(base.join("decode/0")).expect("mkdir");
                let dir = base.join(at);
                fs::set_permissions(&dir, fs::Permissions::from_mode(bits)).expect("chmod");
                let e = refused(DiskDir::open(&base, "decode", "x"));
                assert!(e.contains("writable by its group or other users"), "{e}");
                assert!(e.contains(&dir.display().to_string()), "{e}");
                assert!(!dir.join("lock").exists(), "nothing is made in it");
            }
        }

        // `disk_dir` itself may be shared only when sticky (as /tmp is): nobody else may rename
        // the worker's directory out of it.
        let base = tmp.join("base");
        fs::create_dir(&base).expect("mkdir");
        fs::set_permissions(&base, fs::Permissions::from_mode(0o777)).expect("chmod");
        let e = refused(DiskDir::open(&base, "decode", "x"));
        assert!(e.contains("not sticky"), "{e}");
        assert!(!base.join("decode").exists());
        fs::set_permissions(&base, fs::Permissions::from_mode(0o770)).expect("chmod");
        let e = refused(DiskDir::open(&base, "decode", "x"));
        assert!(e.contains("not sticky"), "{e}");
        for bits in [0o1777, 0o1770, 0o755] {
            fs::set_permissions(&base, fs::Permissions::from_mode(bits)).expect("chmod");
            DiskDir::open(&base, "decode", "x").expect("open");
        }
    }

    #[test]
    fn a_directory_of_another_user_is_refused() {
        // Handing a directory to another user takes root; elsewhere there is nothing to run.
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let tmp = dyn_tests::scratch_dir("disk-other-user");
        for at in ["decode/0", "decode"] {
            let base = tmp.join(at.replace('/', "-"));
            fs::create_dir_all(base.join("decode/0")).expect("mkdir");
            let dir = base.join(at);
            std::os::unix::fs::chown(&dir, Some(4242), None).expect("chown");
            let e = refused(DiskDir::open(&base, "decode", "x"));
            assert!(e.contains("owned by uid 4242"), "{e}");
            assert!(e.contains(&dir.display().to_string()), "{e}");
        }
        // `disk_dir` itself: another user's is refused too (root's is not).
        let base = tmp.join("base");
        fs::create_dir(&base).expect("mkdir");
        std::os::unix::fs::chown(&base, Some(4242), None).expect("chown");
        let e = refused(DiskDir::open(&base, "decode", "x"));
        assert!(e.contains("owned by uid 4242"), "{e}");
    }

    #[test]
    fn a_symlink_at_a_block_path_is_never_followed() {
        let tmp = dyn_tests::scratch_dir("disk-symlink-block");
        let d = DiskDir::open(&tmp.join("kv"), "decode", "x").expect("open");
        // A valid block file of another worker's, outside the directory.
        let other = DiskDir::open(&tmp.join("other"), "decode", "x").expect("open");
        other.write(5, meta(), b"planted").expect("write");
        let target = tmp.join("target.kvb");
        fs::copy(other.path(5), &target).expect("copy");
        let planted = fs::read(&target).expect("read");

        // Not read through: a miss, and not found by a restart's scan either.
        symlink(&target, d.path(5)).expect("symlink");
        assert!(matches!(d.read(5), Err(BadBlock::Io(_))));
        assert_eq!(d.scan(), vec![], "the scan skips (and removes) it");
        assert_eq!(fs::read(&target).expect("read"), planted);

        // Not written through: the write replaces the link, the target is untouched.
        symlink(&target, d.path(5)).expect("symlink");
        d.write(5, meta(), b"ours").expect("write");
        assert!(fs::symlink_metadata(d.path(5)).expect("stat").is_file());
        assert_eq!(d.read(5).expect("read").as_ref(), b"ours");
        assert_eq!(fs::read(&target).expect("read"), planted);

        // Nor through the temporary name.
        symlink(&target, d.path(6).with_extension("tmp")).expect("symlink");
        d.write(6, meta(), b"ours too").expect("write");
        assert_eq!(d.read(6).expect("read").as_ref(), b"ours too");
        assert_eq!(fs::read(&target).expect("read"), planted);
        let mut found: Vec<u64> = d.scan().into_iter().map(|(h, _)| h).collect();
        found.sort_unstable();
        assert_eq!(found, [5, 6], "both are real blocks of ours");
    }

    #[test]
    fn the_default_directory_is_the_users_cache() {
        let some = |s: &str| Some(OsString::from(s));
        assert_eq!(
            cache_dir(some("/xdg"), some("/home/u")),
            Some(PathBuf::from("/xdg"))
        );
        // Unset, empty or relative: `$HOME/.cache`.
        for xdg in [None, some(""), some("rel/cache")] {
            assert_eq!(
                cache_dir(xdg, some("/home/u")),
                Some(PathBuf::from("/home/u/.cache"))
            );
        }
        assert_eq!(cache_dir(None, some("")), None);
        assert_eq!(cache_dir(None, None), None);
        assert!(default_dir().map_or(true, |d| d.ends_with("dyn/kv-offload")));
    }
}
