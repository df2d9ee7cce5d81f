//! Hostile model directories are errors naming the problem: shard names and symlinks that leave
//! the directory (config.json included), a tensor stored in two shards, and oversized or
//! truncated files and safetensors headers.

mod common;

use std::path::PathBuf;

use candle_core::{DType, Device, Result};
use common::hostile::{
    assert_contains, err, first_line, fixture, load, raw_safetensors, shard_file, sharded, Tmp, G1,
};
use mamba2::model::{Checkpoint, Config, SHARD_INDEX};

#[test]
fn shard_names_must_be_plain_file_names() -> Result<()> {
    let tmp = Tmp::new("names");
    sharded(&tmp)?;
    load(&tmp.0)?;
    let index = std::fs::read_to_string(tmp.path(SHARD_INDEX))?;
    for bad in [
        "../x.safetensors",
        "/abs/path.safetensors",
        "sub/model-00001-of-00003.safetensors",
        "..",
        ".",
        "",
        "a\\\\b.safetensors",
    ] {
        let edited = index.replacen(&shard_file(0), bad, 1);
        std::fs::write(tmp.path(SHARD_INDEX), edited)?;
        let msg = err(load(&tmp.0));
        assert_contains(&msg, "is not a plain file name inside the model directory");
        assert_contains(&msg, "weight_map entry for");
        let msg = err(Checkpoint::open(&tmp.0).map(|_| ()));
        assert_contains(&msg, SHARD_INDEX);
    }
    Ok(())
}

#[cfg(unix)]
#[test]
fn a_symlinked_shard_must_stay_inside_the_directory() -> Result<()> {
    use std::os::unix::fs::symlink;
    let tmp = Tmp::new("symlink");
    let model = tmp.path("model");
    std::fs::create_dir(&model)?;
    let inner = Tmp(model.clone());
    sharded(&inner)?;
    let shard = shard_file(1);
    // The same bytes outside the directory: a link to them is refused, and a link to a file that
    // does not exist outside gets the very same message.
    std::fs::rename(inner.path(&shard), tmp.path("outside.safetensors"))?;
    symlink(tmp.path("outside.safetensors"), inner.path(&shard))?;
    let outside = err(load(&model));
    assert_contains(
        &outside,
        &format!(
            "shard {} listed in {} is a symbolic link that does not resolve to a file inside the \
             model directory",
            inner.path(&shard).display(),
            inner.path(SHARD_INDEX).display()
        ),
    );
    std::fs::remove_file(inner.path(&shard))?;
    symlink(tmp.path("no-such-file.safetensors"), inner.path(&shard))?;
    assert_eq!(first_line(&err(load(&model))), first_line(&outside));
    std::fs::remove_file(inner.path(&shard))?;
    symlink("../outside.safetensors", inner.path(&shard))?;
    assert_eq!(first_line(&err(load(&model))), first_line(&outside));

    // A link to a file inside the directory is fine, as is a Hugging Face cache snapshot, whose
    // files link to the repository's blobs.
    std::fs::remove_file(inner.path(&shard))?;
    std::fs::rename(
        tmp.path("outside.safetensors"),
        inner.path("real.safetensors"),
    )?;
    symlink("real.safetensors", inner.path(&shard))?;
    load(&model)?;
    let snapshot = tmp.path("models--x--y/snapshots/0123abcd");
    std::fs::create_dir_all(&snapshot)?;
    std::fs::create_dir_all(tmp.path("models--x--y/blobs"))?;
    for name in [
        "config.json".to_string(),
        SHARD_INDEX.to_string(),
        shard_file(0),
        shard_file(1),
        shard_file(2),
    ] {
        let blob = tmp.path("models--x--y/blobs").join(format!("blob-{name}"));
        std::fs::copy(inner.path(&name), &blob)?;
        symlink(format!("../../blobs/blob-{name}"), snapshot.join(&name))?;
    }
    load(&snapshot)?;
    // The index itself and a single-file checkpoint follow the same rule.
    std::fs::remove_file(inner.path(SHARD_INDEX))?;
    symlink(
        tmp.path("models--x--y/blobs")
            .join(format!("blob-{SHARD_INDEX}")),
        inner.path(SHARD_INDEX),
    )?;
    assert_contains(
        &err(load(&model)),
        "is a symbolic link that does not resolve to a file",
    );
    std::fs::remove_file(inner.path(SHARD_INDEX))?;
    symlink(
        fixture(G1).join("model.safetensors"),
        inner.path("model.safetensors"),
    )?;
    assert_contains(
        &err(load(&model)),
        &format!(
            "weights {} is a symbolic link that does not resolve to a file inside the model \
             directory",
            inner.path("model.safetensors").display()
        ),
    );
    Ok(())
}

#[cfg(unix)]
#[test]
fn a_symlinked_config_must_stay_inside_the_directory() -> Result<()> {
    use std::os::unix::fs::symlink;
    let tmp = Tmp::new("config_link");
    let model = tmp.path("model");
    std::fs::create_dir(&model)?;
    let weights = fixture(G1).join("model.safetensors");
    std::fs::copy(&weights, model.join("model.safetensors"))?;
    // A valid config outside the directory: a link to it is refused, and a link to a file that
    // does not exist outside, absolute or relative, gets the very same message.
    std::fs::copy(fixture(G1).join("config.json"), tmp.path("outside.json"))?;
    let link = model.join("config.json");
    symlink(tmp.path("outside.json"), &link)?;
    let outside = err(load(&model));
    assert_contains(
        &outside,
        &format!(
            "config {} is a symbolic link that does not resolve to a file inside the model \
             directory",
            link.display()
        ),
    );
    for target in [
        tmp.path("no-such-file.json"),
        PathBuf::from("../outside.json"),
    ] {
        std::fs::remove_file(&link)?;
        symlink(target, &link)?;
        assert_eq!(first_line(&err(load(&model))), first_line(&outside));
    }
    // A link to a file inside the directory is fine.
    std::fs::remove_file(&link)?;
    std::fs::rename(tmp.path("outside.json"), model.join("real.json"))?;
    symlink("real.json", &link)?;
    load(&model)?;

    // In a Hugging Face cache snapshot, config.json may link into the repository's blobs, and
    // nowhere else.
    let snapshot = tmp.path("models--x--y/snapshots/0123abcd");
    std::fs::create_dir_all(&snapshot)?;
    std::fs::create_dir_all(tmp.path("models--x--y/blobs"))?;
    std::fs::copy(&weights, snapshot.join("model.safetensors"))?;
    std::fs::copy(
        fixture(G1).join("config.json"),
        tmp.path("models--x--y/blobs/config-blob"),
    )?;
    symlink("../../blobs/config-blob", snapshot.join("config.json"))?;
    load(&snapshot)?;
    std::fs::remove_file(snapshot.join("config.json"))?;
    symlink(model.join("real.json"), snapshot.join("config.json"))?;
    assert_contains(
        &err(load(&snapshot)),
        "is a symbolic link that does not resolve to a file inside the model directory",
    );
    Ok(())
}

#[test]
fn a_tensor_in_two_shards_is_refused() -> Result<()> {
    let tmp = Tmp::new("duplicate");
    sharded(&tmp)?;
    // Shard 3 gets a second copy of a tensor of shard 1 (the index still names shard 1 for it).
    let first = candle_core::safetensors::load(tmp.path(&shard_file(0)), &Device::Cpu)?;
    let mut third = candle_core::safetensors::load(tmp.path(&shard_file(2)), &Device::Cpu)?;
    let (name, tensor) = first.iter().next().expect("shard 1 has tensors");
    third.insert(name.clone(), (tensor * 2.0)?);
    candle_core::safetensors::save(&third, tmp.path(&shard_file(2)))?;
    let msg = err(load(&tmp.0));
    assert_contains(
        &msg,
        &format!(
            "tensor {name} is stored twice: in shard {} and in shard {} of {}",
            shard_file(0),
            shard_file(2),
            tmp.path(SHARD_INDEX).display()
        ),
    );
    Ok(())
}

#[test]
fn oversized_or_truncated_safetensors_headers_are_refused() -> Result<()> {
    let tmp = Tmp::new("header");
    std::fs::copy(fixture(G1).join("config.json"), tmp.path("config.json"))?;
    let file = tmp.path("model.safetensors");
    let good = std::fs::read(fixture(G1).join("model.safetensors"))?;
    let n = u64::from_le_bytes(good[..8].try_into().expect("8 bytes"));
    let (header, data) = good[8..].split_at(n as usize);
    let shown = file.display().to_string();
    let data_len = data.len();
    let json_end = header
        .iter()
        .rposition(|&b| b == b'}')
        .expect("a JSON header") as u64;
    for (len, needle) in [
        (
            1u64 << 40,
            "declares a safetensors header of 1099511627776 bytes, above the limit of 16777216"
                .to_string(),
        ),
        (
            u64::MAX,
            format!(
                "declares a safetensors header of {} bytes, above the limit",
                u64::MAX
            ),
        ),
        (
            n + data_len as u64 + 1,
            format!(
                "declares a safetensors header of {} bytes but has {} after the length",
                n + data_len as u64 + 1,
                n + data_len as u64
            ),
        ),
        // A length that ends the header before its closing brace.
        (json_end, "invalid safetensors header".to_string()),
    ] {
        raw_safetensors(&file, len, header, data)?;
        let msg = err(load(&tmp.0));
        assert_contains(&msg, &shown);
        assert_contains(&msg, &needle);
    }
    // Truncated data: the last tensor's bytes run past the end of the file.
    raw_safetensors(&file, n, header, &data[..data_len - 100])?;
    assert_contains(
        &err(load(&tmp.0)),
        &format!(
            "data_offsets must be [start, end] with start <= end <= {}",
            data_len - 100
        ),
    );
    // Inflated sizes: a data_offsets end far past the file.
    let text = std::str::from_utf8(header).expect("header is UTF-8");
    let end = format!(",{data_len}]");
    let inflated = text.replacen(&end, ",99999999999999]", 1);
    assert_ne!(inflated, text, "the last tensor ends at {data_len}");
    raw_safetensors(&file, inflated.len() as u64, inflated.as_bytes(), data)?;
    assert_contains(&err(load(&tmp.0)), "data_offsets must be [start, end]");
    // Too short for the length field.
    std::fs::write(&file, [1, 2, 3, 4, 5])?;
    assert_contains(
        &err(load(&tmp.0)),
        "is 5 bytes: too short for a safetensors file",
    );
    // A tensor stored as integers is not a weight.
    let mut tensors =
        candle_core::safetensors::load(fixture(G1).join("model.safetensors"), &Device::Cpu)?;
    let d = tensors["backbone.layers.0.mixer.D"].to_dtype(DType::U8)?;
    tensors.insert("backbone.layers.0.mixer.D".into(), d);
    candle_core::safetensors::save(&tensors, &file)?;
    assert_contains(&err(load(&tmp.0)), "tensor backbone.layers.0.mixer.D in ");
    assert_contains(&err(load(&tmp.0)), "is stored as U8, not as a float");
    Ok(())
}

#[test]
fn oversized_config_and_index_files_are_refused() -> Result<()> {
    let tmp = Tmp::new("big_files");
    sharded(&tmp)?;
    let config = std::fs::read_to_string(tmp.path("config.json"))?;
    let padded = format!("{config}{}", " ".repeat(Config::MAX_FILE_BYTES as usize));
    std::fs::write(tmp.path("config.json"), padded)?;
    assert_contains(&err(load(&tmp.0)), "larger than the limit of 1048576 bytes");
    std::fs::write(tmp.path("config.json"), config)?;
    let index = std::fs::read_to_string(tmp.path(SHARD_INDEX))?;
    let padded = format!(
        "{index}{}",
        " ".repeat(Checkpoint::MAX_INDEX_BYTES as usize)
    );
    std::fs::write(tmp.path(SHARD_INDEX), padded)?;
    let msg = err(load(&tmp.0));
    assert_contains(&msg, SHARD_INDEX);
    assert_contains(&msg, "larger than the limit of 16777216 bytes");
    Ok(())
}
