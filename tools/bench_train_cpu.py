#!/usr/bin/env python3
"""CPU training throughput of the PyTorch model that ``tools/train.py`` trains (the peer of
``cargo run --release --example train`` on the CPU).

One optimizer step = forward + mean next-token cross-entropy + backward + global-norm clipping +
AdamW over ``--batch-size`` windows of ``--seq-len`` tokens, exactly as ``train.py``'s step
(its ``train_loss``, its fast SSD chunk scan and conv, ``torch.optim.AdamW`` with ``foreach``),
without autocast unless ``--dtype bf16``.  The weights are the checkpoint in ``--weights``; the
windows are drawn from ``--data`` (a text file, encoded with the checkpoint's tokenizer) with a
fixed seed.  Prints each step's time and the median tokens/s over the steps after ``--warmup``.

    /opt/pyref/bin/python tools/bench_train_cpu.py --data FILE --weights weights \
        --batch-size 8 --seq-len 256 --steps 12 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import Mamba2ForCausalLM  # noqa: E402

import train  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="text file to draw the training windows from")
    ap.add_argument("--weights", default=os.path.join(train.REPO, "weights"))
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.steps <= args.warmup:
        raise SystemExit("--steps must exceed --warmup")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train.set_fp32_matmul(precise=True)
    train.set_impls(train.FAST_IMPLS)

    with open(args.data, encoding="utf-8") as f:
        ids = Tokenizer.from_file(os.path.join(args.weights, "tokenizer.json")).encode(f.read()).ids
    data = torch.tensor(ids, dtype=torch.long)
    T, B = args.seq_len, args.batch_size
    if data.numel() < T + 2:
        raise SystemExit(f"--data holds {data.numel()} tokens, fewer than one window of {T + 1}")

    model = Mamba2ForCausalLM.from_pretrained(args.weights, dtype=torch.float32)
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True,
    )
    offs = torch.arange(T + 1)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16")

    times = []
    for step in range(args.steps):
        starts = torch.randint(0, data.numel() - T - 1, (B,))
        w = data[starts[:, None] + offs]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = train.train_loss(model, w[:, :-1], w[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dt = time.perf_counter() - t0
        times.append(dt)
        print(f"step {step + 1}: loss {loss.item():.4f}, {dt:.3f} s, {B * T / dt:.0f} tokens/s", flush=True)
    med = statistics.median(times[args.warmup:])
    print(f"pytorch {torch.__version__} {args.dtype} B={B} L={T} threads={args.threads}: "
          f"median step {med:.3f} s, {B * T / med:.0f} tokens/s "
          f"(steps {args.warmup + 1}..{args.steps})")


if __name__ == "__main__":
    main()
