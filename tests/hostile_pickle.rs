//! Hostile `pytorch_model.bin` archives are errors, never panics, aborts or huge allocations:
//! tensors larger than their storage, storages larger than their archive entry, pickle bombs,
//! oversized pickles and archives that are not zip files or are cut short.

mod common;

use std::path::PathBuf;

use candle_core::{DType, Device, Result};
use common::hostile::{assert_contains, err, fixture, Tmp, BIN};
use mamba2::model::Checkpoint;

/// A `.bin` tensor: name, storage key, storage size, offset, size, stride.
type TensorSpec<'a> = (&'a str, &'a str, i32, i32, &'a [i32], &'a [i32]);

/// A pickle op stream, written as `torch.save` (protocol 2) writes a state dict.
#[derive(Default)]
struct Pickle(Vec<u8>);

impl Pickle {
    fn op(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.extend_from_slice(bytes);
        self
    }

    fn global(&mut self, module: &str, name: &str) -> &mut Self {
        self.op(format!("c{module}\n{name}\n").as_bytes())
    }

    fn str(&mut self, s: &str) -> &mut Self {
        self.op(b"X")
            .op(&(s.len() as u32).to_le_bytes())
            .op(s.as_bytes())
    }

    fn int(&mut self, i: i32) -> &mut Self {
        self.op(b"J").op(&i.to_le_bytes())
    }

    fn ints(&mut self, v: &[i32]) -> &mut Self {
        self.op(b"(");
        for &i in v {
            self.int(i);
        }
        self.op(b"t")
    }

    /// A state dict of `tensors`, all of f32 storages.
    fn state_dict(tensors: &[TensorSpec]) -> Vec<u8> {
        let mut p = Pickle::default();
        p.op(b"\x80\x02")
            .global("collections", "OrderedDict")
            .op(b")R(");
        for &(name, key, len, offset, size, stride) in tensors {
            p.str(name)
                .global("torch._utils", "_rebuild_tensor_v2")
                .op(b"((");
            p.str("storage")
                .global("torch", "FloatStorage")
                .str(key)
                .str("cpu")
                .int(len)
                .op(b"tQ");
            p.int(offset).ints(size).ints(stride).op(b"\x89");
            p.global("collections", "OrderedDict").op(b")R").op(b"tR");
        }
        p.op(b"u.");
        p.0
    }
}

/// A zip archive of stored entries, as `torch.save` writes one (CRCs left 0: no reader here
/// checks them); with `zip64`, the central directory keeps every size, offset and count in zip64
/// fields, as `torch.save` does for archives above 4 GiB.
fn zip(entries: &[(&str, &[u8])], zip64: bool) -> Vec<u8> {
    let mut out = Vec::new();
    let mut central = Vec::new();
    let le16 = |v: usize| (v as u16).to_le_bytes();
    let le32 = |v: usize| (v as u32).to_le_bytes();
    let le64 = |v: usize| (v as u64).to_le_bytes();
    for (name, data) in entries {
        let offset = out.len();
        out.extend_from_slice(b"PK\x03\x04\x14\0\0\0\0\0\0\0\0\0\0\0\0\0");
        out.extend_from_slice(&le32(data.len()));
        out.extend_from_slice(&le32(data.len()));
        out.extend_from_slice(&le16(name.len()));
        out.extend_from_slice(&le16(0));
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(data);
        // Zip64 extra field 1: uncompressed size, compressed size, local header offset.
        let (size, offset, extra) = match zip64 {
            true => (
                u32::MAX as usize,
                u32::MAX as usize,
                [
                    &[1, 0, 24, 0][..],
                    &le64(data.len()),
                    &le64(data.len()),
                    &le64(offset),
                ]
                .concat(),
            ),
            false => (data.len(), offset, Vec::new()),
        };
        central.extend_from_slice(b"PK\x01\x02\x14\0\x14\0\0\0\0\0\0\0\0\0\0\0\0\0");
        central.extend_from_slice(&le32(size));
        central.extend_from_slice(&le32(size));
        central.extend_from_slice(&le16(name.len()));
        central.extend_from_slice(&le16(extra.len()));
        central.extend_from_slice(&[0; 10]);
        central.extend_from_slice(&le32(offset));
        central.extend_from_slice(name.as_bytes());
        central.extend_from_slice(&extra);
    }
    let start = out.len();
    out.extend_from_slice(&central);
    let (mut count, mut size, mut offset) = (entries.len(), central.len(), start);
    if zip64 {
        // The zip64 end record (44 bytes after its size field), then its locator.
        let record = out.len();
        out.extend_from_slice(b"PK\x06\x06");
        out.extend_from_slice(&le64(44));
        out.extend_from_slice(&[45, 0, 45, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        for v in [count, count, size, offset] {
            out.extend_from_slice(&le64(v));
        }
        out.extend_from_slice(b"PK\x06\x07\0\0\0\0");
        out.extend_from_slice(&le64(record));
        out.extend_from_slice(&le32(1));
        (count, size, offset) = (0xFFFF, u32::MAX as usize, u32::MAX as usize);
    }
    out.extend_from_slice(b"PK\x05\x06\0\0\0\0");
    out.extend_from_slice(&le16(count));
    out.extend_from_slice(&le16(count));
    out.extend_from_slice(&le32(size));
    out.extend_from_slice(&le32(offset));
    out.extend_from_slice(&le16(0));
    out
}

/// A `pytorch_model.bin` of `pickle` and one f32 storage "0" holding `values`.
fn write_bin(tmp: &Tmp, pickle: &[u8], values: &[f32]) -> Result<PathBuf> {
    let storage: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let archive = zip(
        &[
            ("archive/data.pkl", pickle),
            ("archive/byteorder", b"little"),
            ("archive/data/0", &storage),
        ],
        false,
    );
    std::fs::write(tmp.path("pytorch_model.bin"), archive)?;
    Ok(tmp.0.clone())
}

#[test]
fn bin_tensors_are_checked_against_their_storage() -> Result<()> {
    let tmp = Tmp::new("bin");
    let values: Vec<f32> = (0..12).map(|v| v as f32).collect();
    // Row-major, column-major and offset views read back the right numbers.
    let pickle = Pickle::state_dict(&[
        ("rows", "0", 12, 0, &[2, 3], &[3, 1]),
        ("cols", "0", 12, 0, &[2, 3], &[1, 2]),
        ("tail", "0", 12, 6, &[6], &[1]),
    ]);
    let dir = write_bin(&tmp, &pickle, &values)?;
    let checkpoint = Checkpoint::open(&dir)?;
    assert_eq!(checkpoint.names(), ["cols", "rows", "tail"]);
    let vb = checkpoint.var_builder(DType::F32, &Device::Cpu);
    let rows = vb.get((2, 3), "rows")?.to_vec2::<f32>()?;
    assert_eq!(rows, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]);
    let cols = vb.get((2, 3), "cols")?.to_vec2::<f32>()?;
    assert_eq!(cols, [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]]);
    assert_eq!(
        vb.get(6, "tail")?.to_vec1::<f32>()?,
        [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]
    );

    let open_err = |tensors: &[TensorSpec]| -> Result<String> {
        let dir = write_bin(&tmp, &Pickle::state_dict(tensors), &values)?;
        Ok(err(Checkpoint::open(dir).map(|_| ())))
    };
    // The shape exceeds its storage; the storage exceeds its archive entry.
    let msg = open_err(&[("w", "0", 8, 0, &[4, 4], &[4, 1])])?;
    assert_contains(&msg, "pytorch_model.bin");
    assert_contains(&msg, "tensor w");
    assert_contains(
        &msg,
        "shape [4, 4] from offset 0 needs 16 elements but its storage 0 holds 8",
    );
    assert_contains(
        &open_err(&[("w", "0", 12, 10, &[3], &[1])])?,
        "shape [3] from offset 10 needs 13 elements but its storage 0 holds 12",
    );
    assert_contains(
        &open_err(&[("w", "0", 1 << 30, 0, &[4], &[1])])?,
        "its storage archive/data/0 of 1073741824 F32 elements needs more than the entry's 48 bytes",
    );
    assert_contains(
        &open_err(&[("w", "0", 12, 0, &[65536, 65536, 65536], &[1, 1, 1])])?,
        "is not contiguous",
    );
    assert_contains(
        &open_err(&[("w", "0", 12, 0, &[-4], &[1])])?,
        "size -4 is negative or too large",
    );
    assert_contains(
        &open_err(&[("w", "1", 12, 0, &[4], &[1])])?,
        "its storage archive/data/1 is not in the archive",
    );
    assert_contains(
        &open_err(&[("w", "0", 12, 0, &[4, 3], &[1])])?,
        "2 dims but 1 strides",
    );
    assert_contains(
        &open_err(&[("w", "0", 12, 0, &[4], &[1]), ("w", "0", 12, 4, &[4], &[1])])?,
        "tensor w appears twice in the state dict",
    );
    Ok(())
}

#[test]
fn pickle_bombs_are_refused() -> Result<()> {
    let tmp = Tmp::new("pickle_bombs");
    let open_err = |pickle: &[u8]| -> Result<String> {
        let dir = write_bin(&tmp, pickle, &[0.0; 4])?;
        Ok(err(Checkpoint::open(dir).map(|_| ())))
    };
    // Doubling through the memo: 2^100 objects for a reader that copies memo entries.
    let mut p = Pickle::default();
    p.op(b"\x80\x02]");
    for _ in 0..100 {
        p.op(b"q\x00h\x00\x86");
    }
    assert_contains(
        &open_err(&p.op(b".").0)?,
        "pickle objects nest deeper than 64",
    );
    // Growing a memoized list one item at a time: each write copies it.
    let mut p = Pickle::default();
    p.op(b"\x80\x02]q\x00");
    for _ in 0..2000 {
        p.op(b"h\x00K\x01aq\x00");
    }
    assert_contains(&open_err(&p.op(b".").0)?, "pickle copies more than");
    // A million nested tuples would overflow the stack when dropped.
    let mut p = Pickle::default();
    p.op(b"\x80\x02)");
    p.op(&vec![0x85; 1 << 20]);
    assert_contains(
        &open_err(&p.op(b".").0)?,
        "pickle objects nest deeper than 64",
    );
    // A 4 GiB string, an oversized integer, a memo never written, an unknown op.
    for (pickle, needle) in [
        (
            &b"\x80\x02X\xff\xff\xff\xff."[..],
            "pickle ends inside an op",
        ),
        (b"\x80\x02\x8a\x40\x01.", "pickle integer of 64 bytes"),
        (
            b"\x80\x02h\x07.",
            "pickle reads memo 7, which was never written",
        ),
        (b"\x80\x02\xff.", "unsupported pickle op 0xff"),
        (b"\x80\x02)", "pickle ends inside an op"),
        (b"\x80\x02K\x01.", "data.pkl does not hold a state dict"),
    ] {
        assert_contains(&open_err(pickle)?, needle);
    }
    // A pickle above the size limit is not read at all.
    let big = vec![b'N'; Checkpoint::MAX_PICKLE_BYTES as usize + 1];
    assert_contains(
        &open_err(&big)?,
        "data.pkl is 16777217 bytes, above the limit of 16777216",
    );
    // Not a zip archive, or one cut short.
    std::fs::write(tmp.path("pytorch_model.bin"), b"not a zip")?;
    assert_contains(
        &err(Checkpoint::open(&tmp.0).map(|_| ())),
        "not a zip archive",
    );
    let good = std::fs::read(fixture(BIN).join("pytorch_model.bin"))?;
    std::fs::write(tmp.path("pytorch_model.bin"), &good[..good.len() - 30])?;
    assert_contains(
        &err(Checkpoint::open(&tmp.0).map(|_| ())),
        "not a zip archive",
    );
    Ok(())
}

#[test]
fn zip64_archives_are_read_and_only_stored_entries() -> Result<()> {
    let tmp = Tmp::new("zip64");
    let storage: Vec<u8> = (0..12).flat_map(|v| (v as f32).to_le_bytes()).collect();
    let pickle = Pickle::state_dict(&[("rows", "0", 12, 0, &[2, 3], &[3, 1])]);
    let entries = [
        ("archive/data.pkl", &pickle[..]),
        ("archive/byteorder", b"little"),
        ("archive/data/0", &storage),
    ];
    let open = |archive: &[u8]| -> Result<Checkpoint> {
        std::fs::write(tmp.path("pytorch_model.bin"), archive)?;
        Checkpoint::open(&tmp.0)
    };
    for zip64 in [false, true] {
        let archive = zip(&entries, zip64);
        let vb = open(&archive)?.var_builder(DType::F32, &Device::Cpu);
        let rows = vb.get((2, 3), "rows")?.to_vec2::<f32>()?;
        assert_eq!(rows, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], "zip64 {zip64}");
        // Cut inside the end records or the central directory.
        for cut in [10, 30, 60, 100] {
            let msg = err(open(&archive[..archive.len() - cut]).map(|_| ()));
            assert_contains(&msg, "not a zip archive");
        }
        // data.pkl deflated (method 8) or encrypted (flag bit 0) in the central directory.
        let central = archive
            .windows(4)
            .position(|w| w == b"PK\x01\x02")
            .expect("a central directory");
        for (at, byte, shown) in [(10, 8, "method Deflated"), (8, 1, "method Stored")] {
            let mut edited = archive.clone();
            edited[central + at] = byte;
            let msg = err(open(&edited).map(|_| ()));
            assert_contains(
                &msg,
                "archive entry archive/data.pkl is compressed or encrypted",
            );
            assert_contains(&msg, shown);
        }
    }
    Ok(())
}

#[test]
fn oversized_zip_directories_are_refused() -> Result<()> {
    let tmp = Tmp::new("zip_directory");
    // 280 entries with names of 65000 bytes: a central directory of 18 MB.
    let names: Vec<String> = (0..280)
        .map(|i| format!("{i:03}{}", "x".repeat(65000)))
        .collect();
    let entries: Vec<(&str, &[u8])> = names.iter().map(|n| (n.as_str(), &b""[..])).collect();
    std::fs::write(tmp.path("pytorch_model.bin"), zip(&entries, false))?;
    assert_contains(
        &err(Checkpoint::open(&tmp.0).map(|_| ())),
        "zip central directory above the limit of 16777216 bytes",
    );
    Ok(())
}
