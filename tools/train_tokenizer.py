#!/usr/bin/env python3
"""Train the byte-level BPE tokenizer shipped in ``weights/tokenizer.json``.

Corpus: ``gutenberg-114.txt(.xz)`` -- 114 public-domain books separated by lines ``<|endoftext|>``.
Split (shared with ``tools/train.py``, which imports :func:`load_split` from here):

* the raw text is split on the literal string ``<|endoftext|>`` into 114 parts (one per book);
* TRAIN    = ``"<|endoftext|>".join(parts[:-3])`` (first 111 books),
* HELD-OUT = ``"<|endoftext|>".join(parts[-3:])``  (last 3 books), i.e. everything after the 111th
  ``<|endoftext|>`` of the file, byte for byte (it starts with the ``"\\n\\n"`` that follows that
  separator and contains the two separators between the three held-out books).

The tokenizer is trained on the TRAIN books only.  It is a plain GPT-2-style byte-level BPE:
``<|endoftext|>`` is special token id 0, ids 1..256 are the 256 byte symbols, then the merges;
ByteLevel pre-tokenizer (add_prefix_space=false, GPT-2 regex), ByteLevel decoder, ByteLevel
post-processor (trim_offsets=false), no normalizer.  Everything in the JSON is a standard
component, so the Rust ``tokenizers`` crate 0.23 (feature ``onig``) loads it.

Besides ``weights/tokenizer.json`` the script writes, into ``--data-dir`` (default ``.data/tok``,
git-ignored; carry this folder to the GPU machine):

* ``train_tokens.npy``   uint16, the TRAIN text encoded as one stream (the ``<|endoftext|>``
  separators become token 0);
* ``heldout_tokens.npy`` uint16, the HELD-OUT text encoded as one stream, exactly
  ``tokenizer.encode(heldout_text)`` (so it includes the two separator tokens 0);
* ``heldout.txt``        the HELD-OUT raw text (UTF-8, byte-exact), for the Rust ``perplexity`` example;
* ``meta.json``          counts, bytes/token and the sha256 of the tokenizer.json they were made with.

Deterministic: the same corpus gives byte-identical tokenizer.json and token files
(checked with ``--check-determinism``, which trains twice).

Usage::

    /opt/pyref/bin/python tools/train_tokenizer.py                      # defaults below
    /opt/pyref/bin/python tools/train_tokenizer.py --vocab-size 8192 \
        --corpus ../shared/data/gutenberg-114.txt.xz --out weights/tokenizer.json --data-dir .data/tok
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import sys
import time

import numpy as np

EOT = "<|endoftext|>"
N_HELDOUT_BOOKS = 3
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CORPUS_CANDIDATES = [
    os.path.join(REPO, ".data", "raw", "gutenberg-114.txt"),
    os.path.join(REPO, ".data", "gutenberg-114.txt"),
    os.path.join(REPO, "..", "shared", "data", "gutenberg-114.txt.xz"),
    "/work/shared/data/gutenberg-114.txt.xz",
]


def find_corpus(path: str | None) -> str:
    if path:
        return path
    for c in DEFAULT_CORPUS_CANDIDATES:
        if os.path.exists(c):
            return c
    raise FileNotFoundError("corpus not found; pass --corpus (tried: %s)" % DEFAULT_CORPUS_CANDIDATES)


def read_corpus(path: str) -> str:
    if path.endswith(".xz"):
        with lzma.open(path, "rb") as f:
            raw = f.read()
    else:
        with open(path, "rb") as f:
            raw = f.read()
    return raw.decode("utf-8")  # strict: the corpus is UTF-8


def load_split(path: str | None = None, n_heldout: int = N_HELDOUT_BOOKS):
    """Return (train_books, heldout_text).

    train_books: list of the first N-n_heldout book strings (separators removed; the training
    stream is ``EOT.join(train_books)``); heldout_text: ``EOT.join(last n_heldout parts)``.
    """
    text = read_corpus(find_corpus(path))
    parts = text.split(EOT)
    if len(parts) <= n_heldout:
        raise ValueError(f"corpus has only {len(parts)} parts separated by {EOT!r}")
    return parts[:-n_heldout], EOT.join(parts[-n_heldout:])


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.BPE())  # byte-level: every byte is in the alphabet, no unk needed
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def train_tokenizer(train_books, vocab_size: int):
    from tokenizers import pre_tokenizers, trainers

    tok = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[EOT],  # -> id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes -> ids 1..256
    )
    tok.train_from_iterator(train_books, trainer=trainer, length=len(train_books))
    assert tok.token_to_id(EOT) == 0, "special token must be id 0"
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return tok


def encode_stream(tok, books) -> np.ndarray:
    """Encode EOT.join(books) as one stream.

    Identical to ``tok.encode(EOT.join(books)).ids`` because the special token splits the text
    before pre-tokenization, but parallel and memory-friendly (checked in main() on a sample).
    """
    encs = tok.encode_batch(list(books), add_special_tokens=False)
    out = []
    for i, e in enumerate(encs):
        if i:
            out.append(np.zeros(1, dtype=np.uint16))  # EOT = 0
        ids = np.asarray(e.ids, dtype=np.int64)
        assert ids.size == 0 or ids.max() < 65536
        out.append(ids.astype(np.uint16))
    return np.concatenate(out)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=None, help="gutenberg-114.txt or .txt.xz")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--out", default=os.path.join(REPO, "weights", "tokenizer.json"))
    ap.add_argument("--data-dir", default=os.path.join(REPO, ".data", "tok"))
    ap.add_argument("--no-tokens", action="store_true", help="only write tokenizer.json")
    ap.add_argument("--check-determinism", action="store_true", help="train twice and compare")
    args = ap.parse_args()

    t0 = time.time()
    corpus = find_corpus(args.corpus)
    train_books, heldout_text = load_split(corpus)
    train_bytes = sum(len(b.encode("utf-8")) for b in train_books) + len(EOT.encode()) * (len(train_books) - 1)
    heldout_bytes = len(heldout_text.encode("utf-8"))
    print(f"corpus {corpus}: {len(train_books)} train books ({train_bytes} bytes), "
          f"{N_HELDOUT_BOOKS} held-out books ({heldout_bytes} bytes)", flush=True)

    tok = train_tokenizer(train_books, args.vocab_size)
    js = tok.to_str(pretty=True)
    print(f"trained BPE vocab={tok.get_vocab_size()} in {time.time() - t0:.1f}s", flush=True)
    if args.check_determinism:
        js2 = train_tokenizer(train_books, args.vocab_size).to_str(pretty=True)
        assert js == js2, "tokenizer training is not deterministic"
        print("determinism check: second training gave an identical tokenizer.json", flush=True)

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(js)
    print(f"wrote {args.out} sha256={sha256_file(args.out)}", flush=True)

    # Reload from disk (what Rust will see) and sanity-check round trips incl. multi-byte UTF-8.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(args.out)
    for s in ["Hello, world!", "naïve café — “quotes” ‘single’ … 1½ €5 日本語 🙂",
              f"end.{EOT}\n\nNext book", "  leading spaces\n\n\ttab"]:
        ids = tok.encode(s).ids
        back = tok.decode(ids, skip_special_tokens=False)
        assert back == s, (s, back)
    assert tok.encode(EOT).ids == [0]

    if args.no_tokens:
        return
    os.makedirs(args.data_dir, exist_ok=True)
    t1 = time.time()
    train_ids = encode_stream(tok, train_books)
    held_ids = np.asarray(tok.encode(heldout_text).ids, dtype=np.uint16)
    # the split-encoding equals whole-stream encoding (check on the held-out text and a train slice)
    assert np.array_equal(encode_stream(tok, heldout_text.split(EOT)), held_ids)
    sample = EOT.join(train_books[-4:])
    assert np.array_equal(encode_stream(tok, train_books[-4:]), np.asarray(tok.encode(sample).ids, dtype=np.uint16))
    assert tok.decode(held_ids.tolist(), skip_special_tokens=False) == heldout_text
    np.save(os.path.join(args.data_dir, "train_tokens.npy"), train_ids)
    np.save(os.path.join(args.data_dir, "heldout_tokens.npy"), held_ids)
    with open(os.path.join(args.data_dir, "heldout.txt"), "wb") as f:
        f.write(heldout_text.encode("utf-8"))
    meta = {
        "tokenizer_sha256": sha256_file(args.out),
        "vocab_size": tok.get_vocab_size(),
        "eot_id": 0,
        "train_books": len(train_books),
        "heldout_books": N_HELDOUT_BOOKS,
        "train_bytes": train_bytes,
        "train_tokens": int(train_ids.size),
        "train_bytes_per_token": train_bytes / train_ids.size,
        "heldout_bytes": heldout_bytes,
        "heldout_tokens": int(held_ids.size),
        "heldout_bytes_per_token": heldout_bytes / held_ids.size,
        "heldout_eot_tokens": int((held_ids == 0).sum()),
        "split": "text.split('<|endoftext|>'): train = first 111 parts joined by it, heldout = last 3 joined by it",
    }
    with open(os.path.join(args.data_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    print(f"encoded in {time.time() - t1:.1f}s", flush=True)
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    sys.exit(main())
