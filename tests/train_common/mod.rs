//! What the train example's tests share: scratch directories, a seeded corpus, a tiny config,
//! and the flags of a tiny run (for the tests that include the example's modules as `crate::`).
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use clap::Parser;

use crate::{checkpoint, cli, curve, data};

pub const TOKENIZER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/weights/tokenizer.json");

/// A fresh scratch directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mamba2-train-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch directory");
    dir
}

/// `books` books of seeded pseudo-English sentences, separated by `<|endoftext|>`.
pub fn write_corpus(dir: &Path, books: usize) -> PathBuf {
    let words = "the old man looked at the sea and the boy said that it was a dark and stormy \
                 night while elizabeth walked home across the field";
    let words: Vec<&str> = words.split_whitespace().collect();
    let mut state = 7u64;
    let mut next = |n: usize| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as usize % n
    };
    let book = |next: &mut dyn FnMut(usize) -> usize| {
        let lines: Vec<String> = (0..25)
            .map(|_| {
                let s: Vec<&str> = (0..12).map(|_| words[next(words.len())]).collect();
                format!("{}.", s.join(" "))
            })
            .collect();
        format!("\n\n{}\n", lines.join("\n"))
    };
    let text: Vec<String> = (0..books).map(|_| book(&mut next)).collect();
    let file = dir.join("corpus.txt");
    std::fs::write(&file, text.join(data::EOT)).expect("corpus");
    file
}

pub fn write_config(dir: &Path, name: &str, hidden: usize, heads: usize) -> PathBuf {
    let config = serde_json::json!({
        "model_type": "mamba2", "hidden_size": hidden, "num_hidden_layers": 2,
        "vocab_size": 8192, "state_size": 16, "head_dim": 32, "num_heads": heads, "expand": 2,
        "n_groups": 1, "conv_kernel": 4, "chunk_size": 256, "tie_word_embeddings": true,
        "use_bias": false, "use_conv_bias": true, "residual_in_fp32": true, "eos_token_id": 0
    });
    let file = dir.join(name);
    std::fs::write(&file, config.to_string()).expect("config");
    file
}

/// The flags of a tiny run on `data` into `out` (4 sequences of 32 tokens a step unless `extra`
/// says otherwise), then `extra`.
pub fn args(data: &Path, config: &Path, out: &Path, extra: &[&str]) -> cli::Args {
    let mut argv: Vec<String> = vec!["train".into(), "--tokenizer".into(), TOKENIZER.into()];
    for (flag, path) in [("--data", data), ("--config", config), ("--out", out)] {
        argv.push(flag.into());
        argv.push(path.display().to_string());
    }
    for (flag, value) in [("--batch-size", "4"), ("--seq-len", "32")] {
        if !extra.contains(&flag) {
            argv.extend([flag.to_string(), value.to_string()]);
        }
    }
    argv.extend(extra.iter().map(|s| s.to_string()));
    cli::Args::try_parse_from(argv).expect("valid flags")
}

pub fn resume(dir: &Path, extra: &[&str]) -> cli::Args {
    let mut argv = vec![
        "train".to_string(),
        "--resume".into(),
        dir.display().to_string(),
    ];
    argv.extend(extra.iter().map(|s| s.to_string()));
    cli::Args::try_parse_from(argv).expect("valid flags")
}

pub fn rows(out: &Path) -> Vec<curve::Row> {
    let text = std::fs::read_to_string(out.join(checkpoint::LOG)).expect("train_log.csv");
    curve::from_csv(&text).expect("a CSV of the train example")
}
