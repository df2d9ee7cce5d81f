//! The zip archive of a `.bin`, listed by the `zip` crate: each entry's name, where its bytes
//! start in the file and how many there are. Entries are read here, uncompressed, by seeking into
//! the file, because `torch.save` stores them so and tensors are read on demand.

use std::cell::Cell;
use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};

use candle_core::{bail, Result};
use zip::read::{ArchiveOffset, Config};
use zip::{CompressionMethod, ZipArchive};

use super::Checkpoint;

/// The bytes read to find the end records: the 22-byte end of central directory with a comment
/// of at most 65535 bytes, the zip64 locator and record, and room for the reader's buffering.
const END_RECORDS_BYTES: u64 = 1 << 17;

/// An entry of a zip archive: `size` bytes from `start`.
pub(super) struct ZipEntry {
    name: String,
    pub(super) start: u64,
    pub(super) size: u64,
    /// Stored for `torch.save` archives; anything else is compressed.
    method: CompressionMethod,
    /// The uncompressed size, which a stored entry's `size` must equal.
    uncompressed: u64,
    encrypted: bool,
}

impl ZipEntry {
    /// The entry's bytes, refused above `limit`.
    pub(super) fn read(&self, file: &mut File, limit: u64, what: &str) -> Result<Vec<u8>> {
        self.check_stored()?;
        if self.size > limit {
            bail!("{what} is {} bytes, above the limit of {limit}", self.size)
        }
        let mut bytes = vec![0u8; self.size as usize];
        file.seek(SeekFrom::Start(self.start))?;
        file.read_exact(&mut bytes)?;
        Ok(bytes)
    }

    pub(super) fn check_stored(&self) -> Result<()> {
        if self.encrypted
            || self.method != CompressionMethod::Stored
            || self.uncompressed != self.size
        {
            bail!(
                "archive entry {} is compressed or encrypted (method {}, {} bytes for {}); \
                 torch.save stores entries uncompressed",
                self.name,
                self.method,
                self.size,
                self.uncompressed
            )
        }
        Ok(())
    }
}

/// A file that refuses reads past a budget of bytes, so that a hostile central directory costs at
/// most the budget in reading and memory.
struct Budget<'a> {
    file: &'a File,
    /// Bytes that may still be read; `None` once the budget is spent.
    left: &'a Cell<Option<u64>>,
}

impl Read for Budget<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.file.read(buf)?;
        let left = self.left.get().and_then(|left| left.checked_sub(n as u64));
        self.left.set(left);
        match left {
            Some(_) => Ok(n),
            None => Err(io::Error::other("zip central directory above the limit")),
        }
    }
}

impl Seek for Budget<'_> {
    fn seek(&mut self, pos: SeekFrom) -> io::Result<u64> {
        self.file.seek(pos)
    }
}

/// The entries of the zip archive `file` (zip64 included), each checked to lie inside the file.
/// The central directory is read up to [`Checkpoint::MAX_ZIP_DIRECTORY_BYTES`].
pub(super) fn zip_entries(file: &File) -> Result<HashMap<String, ZipEntry>> {
    let len = file.metadata()?.len();
    let bad = |what: &dyn std::fmt::Display| {
        candle_core::Error::msg(format!("not a zip archive: {what}"))
    };
    let limit = Checkpoint::MAX_ZIP_DIRECTORY_BYTES;
    let left = Cell::new(Some(limit + END_RECORDS_BYTES));
    let budget = Budget { file, left: &left };
    // torch.save writes the archive at the start of the file: a known offset spares the crate's
    // search for one, which would scan the whole file.
    let config = Config {
        archive_offset: ArchiveOffset::Known(0),
    };
    let mut archive = match ZipArchive::with_config(config, budget) {
        Ok(archive) => archive,
        Err(_) if left.get().is_none() => {
            bail!("zip central directory above the limit of {limit} bytes")
        }
        Err(e) => return Err(bad(&e)),
    };
    if archive.has_duplicate_names() {
        return Err(bad(&"two entries have the same name"));
    }
    // The directory is read: the local headers that locate each entry's bytes are not counted.
    left.set(Some(u64::MAX));
    let mut entries = HashMap::new();
    for i in 0..archive.len() {
        let entry = archive.by_index_raw(i).map_err(|e| bad(&e))?;
        let Ok(name) = std::str::from_utf8(entry.name_raw()) else {
            return Err(bad(&"entry name is not UTF-8"));
        };
        let (size, start) = (entry.compressed_size(), entry.data_start());
        let Some(start) = start.filter(|s| s.checked_add(size).is_some_and(|end| end <= len))
        else {
            return Err(bad(&format!(
                "entry {name} of {size} bytes runs past the end of the file"
            )));
        };
        let zip_entry = ZipEntry {
            name: name.to_string(),
            start,
            size,
            method: entry.compression(),
            uncompressed: entry.size(),
            encrypted: entry.encrypted(),
        };
        entries.insert(name.to_string(), zip_entry);
    }
    Ok(entries)
}
