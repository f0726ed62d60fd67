//! Files a request names, opened so that no file can stall or exhaust the process: LoRA
//! adapters are read from paths a caller gives at run time (`/v1/load_lora_adapter`), and a
//! path may lead to a FIFO (whose open waits for a writer for ever), a device such as
//! `/dev/zero` (endless), a huge sparse file, or a file replaced between a check and a read.
//!
//! [`open_regular`] opens without blocking (`O_NONBLOCK`), asks the opened descriptor what it
//! is (`fstat`), and accepts only a regular file within a size bound; [`read_regular`] then
//! reads at most that bound from the same descriptor, so what is read is what was checked,
//! whatever happens to the path meanwhile. Every read of an adapter goes through them.

use std::fs::{File, Metadata, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use nix::fcntl::OFlag;

use super::ModelError;

/// The most bytes a JSON config beside an adapter's weights may take: PEFT's
/// `adapter_config.json` is a few KiB.
pub const CONFIG_MAX: u64 = 1 << 20;

/// `path` opened for reading: a regular file of at most `most` bytes, with what `fstat` said
/// of the opened descriptor.
pub fn open_regular(path: &Path, most: u64) -> Result<(File, Metadata), ModelError> {
    let not_regular = |kind: &str| {
        ModelError::io(
            path,
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{kind}, not a regular file"),
            ),
        )
    };
    // What the path says already is refused before it is opened: opening some devices does
    // something (a terminal, a tape). The descriptor is checked again below, since the path
    // may change in between.
    if let Ok(m) = std::fs::metadata(path)
        && let Some(kind) = not_a_file(&m)
    {
        return Err(not_regular(kind));
    }
    // O_NONBLOCK: opening a FIFO with no writer would otherwise wait for one for ever; it
    // changes nothing for a regular file, the only kind read past the check below.
    // O_NOCTTY: a terminal opened here never becomes the process's controlling one.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags((OFlag::O_NONBLOCK | OFlag::O_NOCTTY).bits())
        .open(path)
        .map_err(|e| ModelError::io(path, e))?;
    // The descriptor's own type and size, not the path's: a path swapped after this is not
    // what is read.
    let meta = file.metadata().map_err(|e| ModelError::io(path, e))?;
    if let Some(kind) = not_a_file(&meta) {
        return Err(not_regular(kind));
    }
    if meta.len() > most {
        return Err(ModelError::io(
            path,
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{} bytes, more than the {most} this file may hold",
                    meta.len()
                ),
            ),
        ));
    }
    Ok((file, meta))
}

/// What `meta` is, when it is not a regular file.
fn not_a_file(meta: &Metadata) -> Option<&'static str> {
    let ft = meta.file_type();
    Some(if ft.is_file() {
        return None;
    } else if ft.is_dir() {
        "a directory"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_socket() {
        "a socket"
    } else {
        "of an unknown kind"
    })
}

/// The bytes of the regular file at `path`, at most `most` of them (see [`open_regular`]),
/// with the descriptor's `fstat` as it was opened.
pub fn read_regular(path: &Path, most: u64) -> Result<(Vec<u8>, Metadata), ModelError> {
    let (file, meta) = open_regular(path, most)?;
    // `len <= most`, so the reservation is bounded; a file that grows after the check is
    // read no further than the bound.
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    file.take(most.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| ModelError::io(path, e))?;
    if bytes.len() as u64 > most {
        return Err(ModelError::io(
            path,
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("grew past {most} bytes while it was read"),
            ),
        ));
    }
    Ok((bytes, meta))
}

/// `path` as logs and errors show it: control characters escaped, so a name with a newline
/// cannot forge a log line.
pub fn shown(path: &Path) -> String {
    path.display().to_string().escape_debug().to_string()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is a failure report

    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("dyn-files-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_regular_file_within_the_bound_is_read_whole() {
        let d = scratch("regular");
        let p = d.join("a.json");
        std::fs::write(&p, b"{\"r\": 8}").unwrap();
        let (bytes, meta) = read_regular(&p, 64).unwrap();
        assert_eq!(bytes, b"{\"r\": 8}");
        assert_eq!(meta.len(), 8);
        // Exactly at the bound is fine; one past is not.
        assert!(read_regular(&p, 8).is_ok());
        let e = read_regular(&p, 7).unwrap_err().to_string();
        assert!(e.contains("8 bytes, more than the 7"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn devices_fifos_and_directories_are_refused_without_reading_or_blocking() {
        let d = scratch("kinds");
        let e = read_regular(Path::new("/dev/zero"), CONFIG_MAX)
            .unwrap_err()
            .to_string();
        assert!(e.contains("a character device, not a regular file"), "{e}");
        // Through a symlink too: the descriptor is what is checked.
        let link = d.join("zero");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        let e = read_regular(&link, CONFIG_MAX).unwrap_err().to_string();
        assert!(e.contains("a character device"), "{e}");
        // A FIFO with no writer: refused at once (a blocking open would never return).
        let fifo = d.join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let e = read_regular(&fifo, CONFIG_MAX).unwrap_err().to_string();
        assert!(e.contains("a FIFO, not a regular file"), "{e}");
        let e = read_regular(&d, CONFIG_MAX).unwrap_err().to_string();
        assert!(e.contains("a directory"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_huge_sparse_file_is_refused_by_its_size_alone() {
        let d = scratch("sparse");
        let p = d.join("adapter_config.json");
        let f = File::create(&p).unwrap();
        f.set_len(1 << 30).unwrap();
        let e = read_regular(&p, CONFIG_MAX).unwrap_err().to_string();
        assert!(e.contains("1073741824 bytes, more than"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn paths_are_shown_with_control_characters_escaped() {
        let p = Path::new("/tmp/a\nINFO forged line/adapter_config.json");
        assert_eq!(
            shown(p),
            "/tmp/a\\nINFO forged line/adapter_config.json",
            "{}",
            shown(p)
        );
    }
}
