//! Streams text from a Mamba-2 model, then prints one stats line (prefill and decode tokens/s).
//!
//! ```sh
//! cargo run --release --example generate -- --prompt "It was a dark and stormy night"
//! cargo run --release --example generate -- --model-id state-spaces/mamba2-130m --prompt "Hi"
//! cargo run --release --example generate -- --weights tests/fixtures/mamba2-130m-hf --prompt hello
//! cargo run --release --example generate -- --prompt-file prompts.txt --max-new-tokens 50
//! ```
//!
//! `--prompt-file FILE` generates for every line of the file at once (blank lines are skipped):
//! the prompts are prefilled packed in one call and decode together, each stopping on its own
//! (a `mamba2::model::Batch`). Every completion streams to stdout line by line, each line labelled
//! `[N]` with its prompt's line number; each one's stats line and then the batch's (prompts,
//! tokens, tokens/s) go to stderr.
//!
//! The tokenizer is `--tokenizer FILE`, else the model's `tokenizer.json` (for `--model-id`
//! without one, `--tokenizer-id`'s). A directory without a tokenizer still runs: with a
//! vocabulary of at least 256 tokens a text prompt goes through the byte-level stand-in (id =
//! byte value; say so on stderr, as the output is only meaningful for a byte-level model), and
//! `--prompt-ids 1,2,3` feeds ids directly and prints generated ids.
//!
//! The sampling flags are checked (by the library) before the model is loaded: `--top-p 1.5`,
//! `--temperature -1` or `--repetition-penalty nan` are errors naming the parameter and value
//! (negative numbers reach the check rather than being taken for flags).

mod common;

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use mamba2::model::{
    byte_tokenizer, eos_token_ids, id_tokenizer, GenerationConfig, Generator, SamplingParams,
    BYTE_VOCAB,
};

/// The prompts of `file`: (line number, text) of every non-blank line.
fn read_prompts(file: &Path) -> Result<Vec<(usize, String)>> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("reading the prompt file {}", file.display()))?;
    let prompts: Vec<(usize, String)> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| (i + 1, l.to_string()))
        .collect();
    if prompts.is_empty() {
        bail!(
            "the prompt file {} has no prompts (no non-blank lines)",
            file.display()
        )
    }
    Ok(prompts)
}

/// Generates for all `prompts` together, streaming each completion's complete lines labelled
/// with its line number.
fn generate_file(generator: &Generator, prompts: &[(usize, String)]) -> Result<()> {
    let start = Instant::now();
    let mut batch = generator.batch();
    let texts: Vec<&str> = prompts.iter().map(|(_, p)| p.as_str()).collect();
    batch
        .add_many(&texts)
        .context("prefilling the prompts (prompt i is the i-th non-blank line, from 0)")?;
    let mut pending: Vec<String> = texts.iter().map(|p| p.to_string()).collect();
    let prefill_secs = start.elapsed().as_secs_f64();
    let mut stdout = std::io::stdout();
    let mut print_lines = |i: usize, text: &mut String, all: bool| -> std::io::Result<()> {
        while let Some(end) = text.find('\n') {
            writeln!(stdout, "[{}] {}", prompts[i].0, &text[..end])?;
            text.drain(..=end);
        }
        if all && !text.is_empty() {
            writeln!(stdout, "[{}] {}", prompts[i].0, text)?;
            text.clear();
        }
        stdout.flush()
    };
    let (mut generated, mut prompt_tokens) = (0, 0);
    while !batch.is_empty() {
        let finished = batch.step(|i, piece| {
            pending[i].push_str(piece);
            print_lines(i, &mut pending[i], false)?;
            Ok(())
        })?;
        for (i, generation) in finished {
            print_lines(i, &mut pending[i], true)?;
            eprintln!("[{}] {generation}", prompts[i].0);
            generated += generation.tokens.len();
            prompt_tokens += generation.prompt_tokens;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "batch: {} prompts, {prompt_tokens} prompt tokens prefilled in {prefill_secs:.2} s, \
         {generated} tokens generated in {secs:.2} s in all: {:.1} tokens/s",
        prompts.len(),
        generated as f64 / secs.max(f64::MIN_POSITIVE)
    );
    Ok(())
}

#[derive(Parser, Debug)]
#[command(about = "Generate text with a Mamba-2 model")]
struct Args {
    /// The prompt text
    #[arg(long, conflicts_with_all = ["prompt_ids", "prompt_file"])]
    prompt: Option<String>,
    /// Generate for every line of this file at once (one prompt per line)
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt_file: Option<std::path::PathBuf>,
    /// The prompt as token ids, e.g. 1,2,3 (for models without a tokenizer)
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    #[command(flatten)]
    model: common::ModelArgs,
    /// Softmax temperature; 0 decodes greedily
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.8)]
    temperature: f64,
    /// Sample among the k most likely tokens only
    #[arg(long)]
    top_k: Option<usize>,
    /// Sample among the most likely tokens of total probability p, in (0, 1] (1 keeps all)
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.95)]
    top_p: f64,
    /// Penalty for tokens among the last --repeat-last-n (1 disables)
    #[arg(long, allow_negative_numbers = true, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    #[arg(long, default_value_t = 299_792_458)]
    seed: u64,
    #[arg(long, default_value_t = 200)]
    max_new_tokens: usize,
    /// Stop when the output contains this string (repeatable)
    #[arg(long)]
    stop: Vec<String>,
    /// Do not stop at the end-of-sequence token
    #[arg(long)]
    ignore_eos: bool,
    /// On CUDA, launch each decode step's kernels one by one instead of replaying a CUDA graph
    #[arg(long)]
    no_cuda_graph: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let prompts = args.prompt_file.as_deref().map(read_prompts).transpose()?;
    let mut config = GenerationConfig {
        max_new_tokens: args.max_new_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: Some(args.top_p),
            repetition_penalty: args.repetition_penalty,
            repeat_last_n: args.repeat_last_n,
            seed: args.seed,
        },
        stop_strings: args.stop.clone(),
        eos_token_ids: Vec::new(),
        no_cuda_graph: args.no_cuda_graph,
    };
    config.validate()?;
    let loaded = args.model.load()?;
    let model = &loaded.model;
    let vocab = model.config().vocab_size;
    if prompts.is_some() && loaded.tokenizer.is_none() {
        bail!(
            "{} has no tokenizer.json: --prompt-file needs one (pass --tokenizer FILE)",
            loaded.dir.display()
        )
    }
    let tokenizer = match (loaded.tokenizer, &args.prompt_ids) {
        (Some(t), _) => t,
        (None, Some(_)) => {
            eprintln!("note: no tokenizer: generated tokens are printed as ids");
            id_tokenizer(vocab)?
        }
        (None, None) if vocab >= BYTE_VOCAB => {
            eprintln!(
                "note: {} has no tokenizer.json and no --tokenizer was given: using the \
                 byte-level stand-in (token id = byte value); output is only text for a \
                 byte-level model",
                loaded.dir.display()
            );
            byte_tokenizer()?
        }
        (None, None) => bail!(
            "{} has no tokenizer.json and its vocabulary ({vocab} tokens) is too small for the \
             byte-level stand-in (256): pass --tokenizer FILE, or the prompt as ids with \
             --prompt-ids 1,2,3",
            loaded.dir.display()
        ),
    };
    if !args.ignore_eos {
        config.eos_token_ids = eos_token_ids(model.config(), &tokenizer);
    }
    let generator = Generator::new(model, &tokenizer, config)?;
    if let Some(prompts) = &prompts {
        return generate_file(&generator, prompts);
    }
    let mut stdout = std::io::stdout();
    let mut print = |text: &str| -> candle_core::Result<()> {
        stdout.write_all(text.as_bytes())?;
        stdout.flush()?;
        Ok(())
    };
    let generation = match (&args.prompt, &args.prompt_ids) {
        (_, Some(ids)) => {
            let prompt = tokenizer.decode(ids, true).map_err(anyhow::Error::msg)?;
            print(&prompt)?;
            generator.generate_from_ids(ids, &mut print)?
        }
        (Some(prompt), None) => {
            print(prompt)?;
            generator.generate(prompt, &mut print)?
        }
        (None, None) => {
            bail!("give a prompt with --prompt TEXT, --prompt-ids 1,2,3 or --prompt-file FILE")
        }
    };
    println!();
    eprintln!("{generation}");
    Ok(())
}
