#!/usr/bin/env python3
"""Train the small Mamba-2 language model shipped in ``weights/``.

The model is ``transformers.Mamba2ForCausalLM`` (so the saved tensors carry HF key names and load
with ``Mamba2ForCausalLM.from_pretrained``), trained on the first 111 books of
``gutenberg-114.txt`` with the tokenizer from ``tools/train_tokenizer.py``, under a wall-clock
budget (``--minutes``: the whole script, startup to the last file written).

Without ``mamba_ssm`` transformers runs Mamba-2 through its reference PyTorch path whose chunk
scan broadcasts ``[b, c, l, l, h, n]`` and ``[b, c, l, l, h, p]`` products (tens of GB at
training sizes).  For training only, this script swaps that one function
(``modeling_mamba2.mamba2_chunk_scan``) for :func:`ssd_chunk_scan_fast`, the same SSD maths
written as batched matmuls over small chunks (``--train-chunk``; the chunk length is a
computational detail, the result does not depend on it).  Everything else is HF's code.  The
swap is checked against HF's function (outputs, final states and gradients) by ``--smoke`` and by
``--check-ssd``, and the final held-out perplexity is computed with HF's ORIGINAL function in
float32 (no autocast, no TF32); the fast path's number is reported next to it.

Held-out perplexity (the number the Rust ``perplexity`` example reproduces):
  held-out text = the last 3 books = everything after the 111th ``<|endoftext|>`` of the corpus
  (``.data/tok/heldout.txt``), encoded as ONE stream with ``tokenizer.encode(text)`` -- the two
  ``<|endoftext|>`` separators between the 3 books are included as token 0; no BOS is added.
  The ids are cut into consecutive non-overlapping windows of W=1024 tokens (the last, partial
  window is kept if it has >= 2 tokens); each window is run from an empty state, tokens
  1..len-1 of the window are predicted from the earlier tokens of that window only;
  ppl = exp(sum NLL / number of predicted tokens).

Outputs in ``--out`` (default ``weights/``): ``config.json``, ``model.safetensors`` or
``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json`` (f32, tied head -> no
``lm_head.weight``), ``train_log.csv``, ``train_summary.json``, ``loss.png``.  ``--bundle DIR``
additionally copies the shards into DIR and tars the small files into ``DIR/meta.tar`` (so that
at most ~6 files come back from a device run).

See ``tools/train_README.md``.
"""

from __future__ import annotations

import time

T_SCRIPT_START = time.time()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import csv  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import transformers  # noqa: E402
from transformers import Mamba2Config, Mamba2ForCausalLM  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2 as hf_m2  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOT_ID = 0
EVAL_WINDOW = 1024
PROMPTS = ["It was a dark and stormy night", "The old man looked at", "Elizabeth said"]
HARD_FILE_LIMIT = 16 * 1024 * 1024  # each shipped file must stay <= 16 MiB


def log(*a):
    print(f"[{time.time() - T_SCRIPT_START:7.1f}s]", *a, flush=True)


# ----------------------------------------------------------------------------------------------
# Fast SSD chunk scan (drop-in for transformers' mamba2_chunk_scan torch path)
# ----------------------------------------------------------------------------------------------
HF_CHUNK_SCAN = hf_m2.mamba2_chunk_scan  # HF's reference (wrapped) function
FAST_CHUNK = [64]  # chunk length used by the fast scan (independent of config.chunk_size)


def ssd_chunk_scan_fast(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                        dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    """Same contract and maths as transformers' ``mamba2_chunk_scan`` torch path.

    hidden_states [b, T, h, p], dt [b, T, h], A [h], B/C [b, T, g, n], D [h], dt_bias [h],
    initial_states [b, h, p, n].  Returns y [b, T, h, p] (and the final state [b, h, p, n]).
    The decays (cumsum, exp) stay in float32; the matmuls follow autocast (bf16 in training).
    """
    b, T, h, p = hidden_states.shape
    g, n = B.shape[2], B.shape[3]
    hg = h // g
    cs = int(FAST_CHUNK[0] or chunk_size)
    acc = torch.promote_types(hidden_states.dtype, torch.float32)  # fp32 (fp64 in tests)
    dt = dt.to(acc)
    if dt_bias is not None:
        dt = dt + dt_bias.to(acc)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    x = hidden_states
    pad = (-T) % cs
    if pad:  # dt = 0 on the padding: no decay, no input -> final state unaffected
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))
    Tp = T + pad
    c = Tp // cs
    xf = x.to(acc)
    dA = dt * A.to(acc).view(1, 1, h)  # [b, Tp, h]
    A_cum = dA.view(b, c, cs, g, hg).permute(0, 1, 3, 4, 2).cumsum(-1)  # [b, c, g, hg, l] fp32
    xdt = (xf * dt[..., None]).view(b, c, cs, g, hg, p).permute(0, 1, 3, 4, 2, 5)  # [b,c,g,hg,l,p]
    Bc = B.view(b, c, cs, g, n).permute(0, 1, 3, 2, 4).unsqueeze(3)  # [b, c, g, 1, l, n]
    Cc = C.view(b, c, cs, g, n).permute(0, 1, 3, 2, 4).unsqueeze(3)  # [b, c, g, 1, l, n]

    # 1. intra-chunk (diagonal blocks): y_l = sum_{s<=l} C_l.B_s exp(Acum_l - Acum_s) xdt_s
    causal = torch.ones(cs, cs, dtype=torch.bool, device=x.device).tril()
    seg = (A_cum[..., :, None] - A_cum[..., None, :]).masked_fill(~causal, float("-inf"))
    CB = torch.matmul(Cc, Bc.transpose(-1, -2))  # [b, c, g, 1, l, s]
    y = torch.matmul(CB * torch.exp(seg), xdt)  # [b, c, g, hg, l, p]

    # 2. per-chunk end states: S_c = sum_l exp(Acum_last - Acum_l) xdt_l B_l^T   [b,c,g,hg,p,n]
    decay_states = torch.exp(A_cum[..., -1:] - A_cum)
    states = torch.matmul((xdt * decay_states[..., None]).transpose(-1, -2), Bc)

    # 3. inter-chunk recurrence over chunk boundaries (HF's stable segment_sum on the short axis)
    if initial_states is None:
        init_s = torch.zeros_like(states[:, :1])
    else:
        init_s = initial_states.reshape(b, 1, g, hg, p, n).to(states.dtype)
    states = torch.cat([init_s, states], dim=1)  # [b, c+1, g, hg, p, n]
    A_last = F.pad(A_cum[..., -1].permute(0, 2, 3, 1), (1, 0))  # [b, g, hg, c+1]
    decay_chunk = torch.exp(hf_m2.segment_sum(A_last))  # [b, g, hg, c+1(z), c+1(j)]
    st = states.to(acc).permute(0, 2, 3, 1, 4, 5).reshape(b, g, hg, c + 1, p * n)
    with torch.autocast(x.device.type, enabled=False):  # state passing in fp32 (small)
        new_states = torch.matmul(decay_chunk, st)
    new_states = new_states.view(b, g, hg, c + 1, p, n)
    prev_states = new_states[:, :, :, :-1].permute(0, 3, 1, 2, 4, 5)  # [b, c, g, hg, p, n]
    final_state = new_states[:, :, :, -1].reshape(b, h, p, n)

    # 4. inter-chunk output: y_l += exp(Acum_l) C_l . S_prev
    y_off = torch.matmul(Cc, prev_states.transpose(-1, -2)) * torch.exp(A_cum)[..., None]
    y = (y + y_off).permute(0, 1, 4, 2, 3, 5).reshape(b, Tp, h, p)
    if D is not None:
        y = y + xf * D.to(acc)[:, None]
    if pad:
        y = y[:, :T]
    if return_final_states:
        return y, final_state
    return y


HF_CONV1D = hf_m2.causal_conv1d_fn


def causal_conv1d_fast(hidden_states, weight, bias=None, activation=None, **kwargs):
    """Same as transformers' ``causal_conv1d_fn`` torch path (depthwise causal conv + act) as K shifted
    multiply-adds, which torch.compile fuses with the activation (no cuDNN depthwise conv).
    hidden_states [b, d, T], weight [d, K], bias [d]."""
    K, T = weight.shape[-1], hidden_states.shape[-1]
    xp = F.pad(hidden_states, (K - 1, 0))
    out = xp[..., 0:T] * weight[:, 0:1]
    for k in range(1, K):
        out = out + xp[..., k:k + T] * weight[:, k:k + 1]
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = hf_m2.ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


HF_IMPLS = {"mamba2_chunk_scan": HF_CHUNK_SCAN, "causal_conv1d_fn": HF_CONV1D}
FAST_IMPLS = {"mamba2_chunk_scan": ssd_chunk_scan_fast, "causal_conv1d_fn": causal_conv1d_fast}


def set_impls(impls):
    """Mamba2Mixer.forward looks these names up in its module's globals at call time."""
    for k, v in impls.items():
        setattr(hf_m2, k, v)


@contextlib.contextmanager
def impls(which):
    old = {k: getattr(hf_m2, k) for k in which}
    set_impls(which)
    try:
        yield
    finally:
        set_impls(old)


def check_ssd(device, dtype=torch.float32, verbose=True):
    """Fast scan == HF reference scan (outputs, final states, gradients), several shapes."""
    g0 = torch.Generator().manual_seed(1234)
    worst = 0.0
    cases = [  # b, T, h, p, g, n, hf_chunk, fast_chunk, init
        (2, 100, 4, 8, 1, 16, 32, 16, False),
        (1, 64, 4, 8, 2, 8, 16, 32, True),
        (2, 37, 6, 4, 3, 8, 256, 8, True),
        (1, 256, 2, 16, 1, 16, 256, 64, False),
    ]
    saved = FAST_CHUNK[0]
    try:
        for (b, T, h, p, g, n, hcs, fcs, init) in cases:
            def mk(*s, scale=1.0):
                return (torch.randn(*s, generator=g0, dtype=torch.float64) * scale).to(device=device, dtype=dtype)
            x, dt = mk(b, T, h, p), mk(b, T, h, scale=0.5)
            Bm, Cm = mk(b, T, g, n), mk(b, T, g, n)
            A = -torch.exp(mk(h, scale=0.5))
            Dp, dtb = mk(h), mk(h, scale=0.5)
            ist = mk(b, h, p, n) if init else None
            outs = []
            for fn, cs in ((HF_CHUNK_SCAN, None), (ssd_chunk_scan_fast, fcs)):
                FAST_CHUNK[0] = cs or saved
                leaves = [t.clone().requires_grad_(True) for t in (x, dt, Bm, Cm, A, Dp, dtb)]
                y, fs = fn(leaves[0], leaves[1], leaves[4], leaves[2], leaves[3], chunk_size=hcs, D=leaves[5],
                           dt_bias=leaves[6], initial_states=ist, dt_softplus=True, return_final_states=True)
                loss = (y * torch.linspace(-1, 1, y.numel(), device=device).view_as(y)).sum() + fs.square().sum() * 0.1
                grads = torch.autograd.grad(loss, leaves)
                outs.append((y.detach(), fs.detach(), grads))
            for a, bb, name in [(outs[0][0], outs[1][0], "y"), (outs[0][1], outs[1][1], "final_state")] + [
                    (ga, gb, "grad" + str(i)) for i, (ga, gb) in enumerate(zip(outs[0][2], outs[1][2]))]:
                err = ((a - bb).abs().max() / (a.abs().max() + 1e-6)).item()
                worst = max(worst, err)
                if err > 1e-4:
                    raise AssertionError(f"fast SSD mismatch in {name} for case {(b, T, h, p, g, n)}: rel err {err:.2e}")
    finally:
        FAST_CHUNK[0] = saved
    # causal conv1d
    for (b, d, T, K) in [(2, 12, 50, 4), (1, 8, 3, 4), (2, 5, 17, 3)]:
        x = torch.randn(b, d, T, generator=g0, dtype=torch.float64).to(device=device, dtype=dtype)
        w = torch.randn(d, K, generator=g0, dtype=torch.float64).to(device=device, dtype=dtype)
        bias = torch.randn(d, generator=g0, dtype=torch.float64).to(device=device, dtype=dtype)
        res = []
        for fn in (HF_CONV1D, causal_conv1d_fast):
            leaves = [t.clone().requires_grad_(True) for t in (x, w, bias)]
            y = fn(leaves[0], leaves[1], leaves[2], activation="silu")
            gr = torch.autograd.grad((y * y.detach().sin()).sum(), leaves)
            res.append([y.detach(), *gr])
        for a, bb in zip(*res):
            err = ((a - bb).abs().max() / (a.abs().max() + 1e-6)).item()
            worst = max(worst, err)
            if err > 1e-4:
                raise AssertionError(f"fast causal conv mismatch: rel err {err:.2e}")
    if verbose:
        log(f"fast SSD chunk scan + causal conv == HF reference (outputs, final states, grads): "
            f"worst rel err {worst:.2e}")
    return worst


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------
def sha256_file(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def load_tokens(args):
    """Return (train_ids np.uint16, heldout_ids np.uint16, meta dict)."""
    tok_path = args.tokenizer
    tok_sha = sha256_file(tok_path)
    d = args.data_dir
    tr, ho, mp = (os.path.join(d, f) for f in ("train_tokens.npy", "heldout_tokens.npy", "meta.json"))
    if os.path.exists(tr) and os.path.exists(ho) and os.path.exists(mp):
        meta = json.load(open(mp))
        if meta.get("tokenizer_sha256") != tok_sha:
            raise SystemExit(f"{d} was tokenized with another tokenizer.json (sha mismatch); rerun "
                             "tools/train_tokenizer.py or delete the folder")
        train_ids, held_ids = np.load(tr), np.load(ho)
        log(f"loaded {train_ids.size:,} train / {held_ids.size:,} held-out tokens from {d}")
        return train_ids, held_ids, meta
    # Fallback: tokenize here from the corpus (needs the text; ~2 min on 2 cores, less with more).
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import train_tokenizer as tt
    from tokenizers import Tokenizer

    log(f"{d} incomplete: tokenizing the corpus with {tok_path}")
    tok = Tokenizer.from_file(tok_path)
    books, held_text = tt.load_split(args.corpus)
    train_ids = tt.encode_stream(tok, books)
    held_ids = np.asarray(tok.encode(held_text).ids, dtype=np.uint16)
    meta = {"tokenizer_sha256": tok_sha, "train_tokens": int(train_ids.size), "heldout_tokens": int(held_ids.size)}
    return train_ids, held_ids, meta


def heldout_windows(held_ids, W=EVAL_WINDOW):
    ids = [held_ids[i:i + W] for i in range(0, len(held_ids), W)]
    return [w for w in ids if len(w) >= 2]


# ----------------------------------------------------------------------------------------------
# Model helpers
# ----------------------------------------------------------------------------------------------
def make_config(args, vocab_size):
    inter = args.expand * args.hidden
    assert inter % args.head_dim == 0
    return Mamba2Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        state_size=args.state,
        head_dim=args.head_dim,
        num_heads=inter // args.head_dim,
        expand=args.expand,
        n_groups=args.n_groups,
        conv_kernel=4,
        chunk_size=256,
        use_bias=False,
        use_conv_bias=True,
        hidden_act="silu",
        layer_norm_epsilon=1e-5,
        residual_in_fp32=True,
        tie_word_embeddings=True,
        # NOT True in the saved config: transformers 5.17 re-applies the 1/sqrt(n_layers) rescale to
        # out_proj when LOADING such a checkpoint (from_pretrained), corrupting it.  The rescaled
        # init is applied by hand in main() instead (init_rescale_out_proj).
        rescale_prenorm_residual=False,
        initializer_range=0.02,
        time_step_min=0.001,
        time_step_max=0.1,
        time_step_floor=1e-4,
        bos_token_id=EOT_ID,
        eos_token_id=EOT_ID,
        pad_token_id=EOT_ID,
        use_cache=True,
    )


def count_params(model):
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def set_fp32_matmul(precise: bool):
    with contextlib.suppress(Exception):
        torch.set_float32_matmul_precision("highest" if precise else "high")
    with contextlib.suppress(Exception):
        torch.backends.cudnn.allow_tf32 = not precise


class RegionalCompile:
    """torch.compile of each Mamba2 block (same code for all blocks -> compiled once and reused).

    pause()/resume() switch the blocks back to eager (eval and generation run eager), disable()
    drops the compiled versions for good (fallback when compilation fails)."""

    def __init__(self, blocks):
        self.blocks, self.impls, self.active = blocks, [], False

    def enable(self):
        import torch._dynamo

        with contextlib.suppress(Exception):
            torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
        with contextlib.suppress(Exception):
            torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)
        self.impls = [torch.compile(blk._call_impl, dynamic=False) for blk in self.blocks]
        self.active = True
        self.resume()

    def pause(self):
        for blk in self.blocks:
            blk._compiled_call_impl = None

    def resume(self):
        if self.active:
            for blk, impl in zip(self.blocks, self.impls):
                blk._compiled_call_impl = impl

    def disable(self):
        self.active = False
        self.impls = []
        self.pause()


def train_loss(model, x, y):
    """Same computation as Mamba2ForCausalLM.forward (no cache, no mask) + mean next-token CE."""
    bb = model.backbone
    h = bb.embeddings(x)
    for blk in bb.layers:
        h = blk(h)
    return head_loss(h, bb.norm_f.weight, model.lm_head.weight, y, bb.norm_f.variance_epsilon)


def _head_loss(h, norm_w, head_w, y, eps):
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    hn = norm_w * hf.to(h.dtype)  # == Mamba2RMSNorm
    logits = F.linear(hn, head_w)
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))


head_loss = _head_loss


@torch.no_grad()
def heldout_nll(model, windows, device, autocast_dtype=None, batch=16):
    """(sum NLL, n predicted) over the windows; each window from an empty state."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    full = [w for w in windows if len(w) == EVAL_WINDOW]
    rest = [w for w in windows if len(w) != EVAL_WINDOW]
    groups = [full[i:i + batch] for i in range(0, len(full), batch)] + [[w] for w in rest]
    for grp in groups:
        ids = torch.from_numpy(np.stack([w.astype(np.int64) for w in grp])).to(device)
        ctx = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        with ctx:
            logits = model(input_ids=ids, use_cache=False).logits
        nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                              reduction="sum")
        total += nll.item()
        count += ids.shape[0] * (ids.shape[1] - 1)
    model.train(was_training)
    return total, count


# ----------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------
def save_weights(model, out_dir, max_shard_bytes):
    """HF-format f32 safetensors (+ index when sharded); tied lm_head omitted like save_pretrained."""
    from safetensors.torch import save_file

    sd = model.state_dict()
    if model.config.tie_word_embeddings and "lm_head.weight" in sd:
        assert sd["lm_head.weight"].data_ptr() == sd["backbone.embeddings.weight"].data_ptr()
        del sd["lm_head.weight"]
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in sd.items()}
    total = sum(t.numel() * 4 for t in tensors.values())
    for f in os.listdir(out_dir):  # remove stale weights from an earlier run
        if f.startswith("model") and (f.endswith(".safetensors") or f.endswith(".index.json")):
            os.remove(os.path.join(out_dir, f))
    shards, cur, cur_size = [], {}, 0
    for k, t in tensors.items():
        sz = t.numel() * 4
        if cur and cur_size + sz > max_shard_bytes:
            shards.append(cur)
            cur, cur_size = {}, 0
        cur[k] = t
        cur_size += sz
    if cur:
        shards.append(cur)
    files = []
    if len(shards) == 1:
        name = "model.safetensors"
        save_file(shards[0], os.path.join(out_dir, name), metadata={"format": "pt"})
        files.append(name)
    else:
        weight_map = {}
        for i, sh in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(sh, os.path.join(out_dir, name), metadata={"format": "pt"})
            files.append(name)
            for k in sh:
                weight_map[k] = name
        index = {"metadata": {"total_parameters": sum(t.numel() for t in tensors.values()), "total_size": total},
                 "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
        files.append("model.safetensors.index.json")
    sizes = {f: os.path.getsize(os.path.join(out_dir, f)) for f in files}
    return files, sizes, total


def write_config(cfg, out_dir):
    """config.json as save_pretrained writes it (sorted keys, indent 2), except that
    ``time_step_limit`` is left out when it is HF's default (0, inf): transformers 5 writes the inf as
    ``{"__float__": "Infinity"}``, which plain JSON readers (serde) would have to special-case;
    without the key, HF loads the same default."""
    d = json.loads(cfg.to_json_string(use_diff=False))
    tsl = d.get("time_step_limit")
    if isinstance(tsl, list) and len(tsl) == 2 and tsl[0] == 0.0 and isinstance(tsl[1], dict):
        d.pop("time_step_limit")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(d, f, indent=2, sort_keys=True)
        f.write("\n")
    back = Mamba2Config.from_pretrained(out_dir)
    assert tuple(back.time_step_limit) == (0.0, float("inf")) and back.hidden_size == cfg.hidden_size
    return d


def verify_saved(model, out_dir, device):
    """Reload with from_pretrained and check tensors and logits match the in-memory model."""
    re = Mamba2ForCausalLM.from_pretrained(out_dir, dtype=torch.float32).to(device)
    a, b = model.state_dict(), re.state_dict()
    assert set(a) == set(b), set(a) ^ set(b)
    for k in a:
        assert torch.equal(a[k].float(), b[k].float()), k
    assert re.lm_head.weight.data_ptr() == re.backbone.embeddings.weight.data_ptr(), "lm_head not tied on reload"
    ids = torch.arange(1, 65, device=device).view(1, -1) % model.config.vocab_size
    model.eval()
    re.eval()
    with torch.no_grad():
        d = (model(input_ids=ids).logits - re(input_ids=ids).logits).abs().max().item()
    model.train()
    assert d == 0.0, f"reloaded logits differ by {d}"
    del re


def plot_curves(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [(r["tokens"] / 1e6, r["train_loss"]) for r in rows if r.get("train_loss") not in (None, "")]
    ho = [(r["tokens"] / 1e6, r["heldout_loss"]) for r in rows if r.get("heldout_loss") not in (None, "")]
    lr = [(r["tokens"] / 1e6, r["lr"]) for r in rows if r.get("lr") not in (None, "")]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    if tr:
        ax.plot(*zip(*tr), label="train (mean over log interval)", lw=1.2)
    if ho:
        ax.plot(*zip(*ho), "o-", label="held-out (3 books, bf16)", ms=4)
    ys = [v for _, v in tr + ho]
    if ys:
        ax.set_ylim(min(ys) - 0.1, min(max(ys), min(ys) + 4.0) + 0.1)
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    if lr:
        ax2.plot(*zip(*lr), color="tab:green")
    ax2.set_ylabel("lr")
    ax2.set_xlabel("training tokens (M)")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bundle_outputs(out_dir, bundle_dir, weight_files):
    """Copy the (<=16 MiB) weight files to bundle_dir; tar everything else into bundle_dir/meta.tar."""
    os.makedirs(bundle_dir, exist_ok=True)
    shards = [f for f in weight_files if f.endswith(".safetensors")]
    for f in shards:
        shutil.copy2(os.path.join(out_dir, f), os.path.join(bundle_dir, f))
    rest = sorted(f for f in os.listdir(out_dir) if f not in shards and os.path.isfile(os.path.join(out_dir, f)))
    with tarfile.open(os.path.join(bundle_dir, "meta.tar"), "w") as t:
        for f in rest:
            t.add(os.path.join(out_dir, f), arcname=f)
    return shards + ["meta.tar"], rest


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------
def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=8.0,
                    help="wall-clock budget of the WHOLE script (training stops at minutes*60 - --reserve-s)")
    ap.add_argument("--reserve-s", type=float, default=60.0,
                    help="seconds kept after training for the final eval, samples, saving, plot")
    ap.add_argument("--out", default=os.path.join(REPO, "weights"))
    ap.add_argument("--bundle", default=None, help="also write shards + meta.tar here (for $OUT)")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run into a temp dir (end-to-end test)")
    ap.add_argument("--data-dir", default=os.path.join(REPO, ".data", "tok"))
    ap.add_argument("--corpus", default=None, help="only if --data-dir lacks the token files")
    ap.add_argument("--tokenizer", default=os.path.join(REPO, "weights", "tokenizer.json"))
    ap.add_argument("--device", default=None)
    # model
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--state", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--expand", type=int, default=2)
    ap.add_argument("--n-groups", type=int, default=1)
    # optimisation
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64, help="sequences per optimizer step")
    ap.add_argument("--micro-batch", type=int, default=0, help="sequences per forward (0: = --batch)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--final-lr-frac", type=float, default=0.02)
    ap.add_argument("--warmup", type=int, default=150, help="warmup steps (capped at 10%% of the run)")
    ap.add_argument("--cooldown-frac", type=float, default=0.3, help="WSD: final fraction of steps decaying linearly")
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=0, help="cap the number of steps (0: time decides)")
    ap.add_argument("--train-chunk", type=int, default=64, help="chunk length of the fast SSD scan")
    ap.add_argument("--ssd", choices=["fast", "hf"], default="fast", help="scan used for training")
    ap.add_argument("--compile", choices=["auto", "none", "blocks"], default="auto",
                    help="torch.compile each Mamba2 block + the loss head (auto: on CUDA)")
    ap.add_argument("--check-ssd", action="store_true", help="check fast scan vs HF on this device and exit")
    # logging / output
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--log-csv", default=None, help="default: OUT/train_log.csv")
    ap.add_argument("--max-shard-mib", type=float, default=15.0)
    ap.add_argument("--sample-tokens", type=int, default=100)
    ap.add_argument("--eval-windows", type=int, default=0, help="testing only: use the first N held-out windows")
    ap.add_argument("--vocab-size", type=int, default=0,
                    help="model vocabulary (0: the tokenizer's; larger pads the embedding, e.g. for a 130m-sized model)")
    ap.add_argument("--max-weight-mb", type=float, default=60.0,
                    help="refuse a model whose f32 weights exceed this many MB (0: no limit)")
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.state, args.head_dim = 64, 2, 16, 16
        args.ctx, args.batch, args.train_chunk = 128, 8, 32
        args.warmup, args.log_every, args.eval_every = 10, 5, 25
        args.lr = 3e-3
        if args.minutes == 8.0:
            args.minutes = 1.5
        args.reserve_s = 45.0
        args.max_shard_mib = 0.5 if args.max_shard_mib == 15.0 else args.max_shard_mib
        args.device = args.device or "cpu"
        if args.out == os.path.join(REPO, "weights"):
            args.out = tempfile.mkdtemp(prefix="mamba2_smoke_")
    return args


def main():
    args = parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    is_cuda = device.type == "cuda"
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    set_fp32_matmul(precise=False)
    deadline = T_SCRIPT_START + args.minutes * 60.0 - args.reserve_s
    gpu_name = torch.cuda.get_device_name(device) if is_cuda else "cpu"
    log(f"torch {torch.__version__} transformers {transformers.__version__} device {device} ({gpu_name})")
    log(f"budget: {args.minutes:.2f} min total, training until t={deadline - T_SCRIPT_START:.0f}s")
    if args.check_ssd:
        check_ssd(device)
        return
    os.makedirs(args.out, exist_ok=True)
    FAST_CHUNK[0] = args.train_chunk

    # --- data ---
    train_np, held_np, tok_meta = load_tokens(args)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(args.tokenizer)
    vocab = tok.get_vocab_size()
    if args.vocab_size:
        if args.vocab_size < vocab:
            raise SystemExit(f"--vocab-size {args.vocab_size} is below the tokenizer's {vocab} tokens")
        vocab = args.vocab_size
    assert int(train_np.max()) < vocab and int(held_np.max()) < vocab
    train_data = torch.from_numpy(train_np.astype(np.int32)).to(device)
    n_train = train_data.numel()
    windows = heldout_windows(held_np)
    if args.eval_windows:
        windows = windows[:args.eval_windows]  # testing only: the reported ppl then covers fewer tokens
    log(f"held-out: {held_np.size} tokens -> {len(windows)} windows of <= {EVAL_WINDOW} "
        f"({sum(len(w) - 1 for w in windows)} predicted tokens)")

    # --- model ---
    cfg = make_config(args, vocab)
    model = Mamba2ForCausalLM(cfg).to(device=device, dtype=torch.float32)
    with torch.no_grad():  # GPT-2 / mamba_ssm style: out_proj scaled by 1/sqrt(n_layers) at init
        for blk in model.backbone.layers:
            blk.mixer.out_proj.weight.div_(math.sqrt(cfg.num_hidden_layers))
    model.train()
    n_params = count_params(model)
    n_embed = model.backbone.embeddings.weight.numel()
    log(f"model: hidden {cfg.hidden_size} x {cfg.num_hidden_layers} layers, heads {cfg.num_heads}x{cfg.head_dim}, "
        f"state {cfg.state_size}, groups {cfg.n_groups}, vocab {vocab}: {n_params:,} params "
        f"({n_embed:,} tied embedding) = {n_params * 4 / 1e6:.1f} MB f32")
    if not args.smoke and args.max_weight_mb and n_params * 4 > args.max_weight_mb * 1e6:
        raise SystemExit(f"model exceeds the {args.max_weight_mb:g} MB weight budget (--max-weight-mb)")

    if args.smoke:
        check_ssd(device)
    if args.ssd == "fast":
        set_impls(FAST_IMPLS)
    if args.smoke:  # the training loss function == HF forward + shifted CE (f32, HF code paths)
        xs = torch.from_numpy(train_np[:2 * 65].astype(np.int64)).view(2, 65).to(device)
        with torch.no_grad(), impls(HF_IMPLS):
            ref = F.cross_entropy(model(input_ids=xs[:, :-1]).logits.reshape(-1, vocab), xs[:, 1:].reshape(-1))
            mine = train_loss(model, xs[:, :-1], xs[:, 1:])
        assert abs(ref.item() - mine.item()) < 1e-4, (ref.item(), mine.item())
        log(f"train_loss() == HF Mamba2ForCausalLM forward + CE ({mine.item():.6f} vs {ref.item():.6f})")

    # --- optimizer ---
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}]
    opt_kw = {"fused": True} if is_cuda else {"foreach": True}
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **opt_kw)

    # --- compile (regional: one graph reused by every block) ---
    global head_loss
    use_compile = args.compile == "blocks" or (args.compile == "auto" and is_cuda)
    rc = RegionalCompile(list(model.backbone.layers))
    compile_state = "off"
    if use_compile:
        try:
            rc.enable()
            head_loss = torch.compile(_head_loss, dynamic=False)
            compile_state = "blocks"
        except Exception as e:  # noqa: BLE001
            log(f"torch.compile unavailable ({type(e).__name__}: {e}); running eager")
            rc.disable()
            head_loss = _head_loss

    ac_dtype = torch.bfloat16  # autocast dtype (CPU autocast runs bf16 too, which the smoke test uses)
    T = args.ctx
    micro = args.micro_batch or args.batch
    if args.batch % micro:
        raise SystemExit("--batch must be a multiple of --micro-batch")
    offs = torch.arange(T + 1, device=device)

    def get_batch(bs):
        starts = torch.randint(0, n_train - T - 1, (bs,), device=device)
        w = train_data[starts[:, None] + offs].long()
        return w[:, :-1], w[:, 1:]

    def one_step():
        opt.zero_grad(set_to_none=True)
        n_micro = args.batch // micro
        tot = torch.zeros((), device=device)
        for _ in range(n_micro):
            x, y = get_batch(micro)
            with torch.autocast(device.type, dtype=ac_dtype):
                loss = train_loss(model, x, y)
            (loss / n_micro).backward()
            tot += loss.detach() / n_micro
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        return tot, gn

    # --- log file ---
    csv_path = args.log_csv or os.path.join(args.out, "train_log.csv")
    fields = ["step", "tokens", "elapsed_s", "lr", "train_loss", "grad_norm", "tok_per_s", "heldout_loss",
              "heldout_ppl"]
    csv_f = open(csv_path, "w", newline="")
    writer = csv.DictWriter(csv_f, fieldnames=fields)
    writer.writeheader()
    rows = []

    def write_row(r):
        rows.append(r)
        writer.writerow({k: r.get(k, "") for k in fields})
        csv_f.flush()

    def run_eval(step, tokens):
        t = time.time()
        rc.pause()
        s, c = heldout_nll(model, windows, device, autocast_dtype=ac_dtype)
        rc.resume()
        hl = s / c
        write_row({"step": step, "tokens": tokens, "elapsed_s": round(time.time() - T_SCRIPT_START, 2),
                   "heldout_loss": round(hl, 5), "heldout_ppl": round(math.exp(hl), 3)})
        log(f"step {step:5d} held-out loss {hl:.4f} ppl {math.exp(hl):.2f}  ({time.time() - t:.1f}s)")
        return hl

    # --- schedule: warmup, stable, linear cooldown (WSD).  The stable phase ends when the projected
    # number of steps (from the measured step rate) says the cooldown must start to end on time. ---
    tokens_per_step = args.batch * T
    plan = {"total": None, "cool_start": None, "warmup": args.warmup}

    def lr_at(step):
        w = plan["warmup"]
        if step < w:
            return args.lr * (step + 1) / w
        if plan["cool_start"] is None or step < plan["cool_start"]:
            return args.lr
        frac = (step - plan["cool_start"]) / max(1, plan["total"] - plan["cool_start"])
        return args.lr * (1.0 - (1.0 - args.final_lr_frac) * min(1.0, frac))

    run_eval(0, 0)
    log(f"training: batch {args.batch} x ctx {T} = {tokens_per_step:,} tokens/step, micro-batch {micro}, "
        f"peak lr {args.lr}, compile={compile_state}, ssd={args.ssd} (chunk {FAST_CHUNK[0]})")
    step, tokens = 0, 0
    t_train0 = time.time()
    t_rate0, step_rate0 = None, None  # timing reference (after compile / warm-up steps)
    loss_acc, loss_n = torch.zeros((), device=device), 0
    last_log_t, last_log_tokens = time.time(), 0
    last_train_loss = float("nan")
    first_step_s = None
    stop_reason = "deadline"
    while True:
        now = time.time()
        if now >= deadline and step > 0:
            stop_reason = "deadline"
            break
        if plan["total"] is not None and step >= plan["total"]:
            stop_reason = "planned steps done"
            break
        if args.max_steps and step >= args.max_steps:
            stop_reason = "max steps"
            break
        lr = lr_at(step)
        for gr in opt.param_groups:
            gr["lr"] = lr
        try:
            loss, gn = one_step()
        except Exception as e:  # noqa: BLE001
            if step == 0 and compile_state != "off" and not isinstance(e, torch.cuda.OutOfMemoryError):
                log(f"compiled step failed ({type(e).__name__}: {str(e)[:300]}); falling back to eager")
                rc.disable()
                head_loss = _head_loss
                compile_state = "failed->eager"
                torch._dynamo.reset()
                continue
            if isinstance(e, torch.cuda.OutOfMemoryError) and step < 3 and micro > 1:
                micro //= 2
                log(f"OOM: micro-batch -> {micro} (grad accumulation {args.batch // micro})")
                opt.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                continue
            raise
        if step == 0:
            if is_cuda:
                torch.cuda.synchronize()
            first_step_s = time.time() - now
            log(f"first step (incl. compile) {first_step_s:.1f}s, loss {loss.item():.4f}"
                + (f", max mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if is_cuda else ""))
        step += 1
        tokens += tokens_per_step
        loss_acc += loss
        loss_n += 1
        if step == 3:  # start the timing after compile + first steps
            if is_cuda:
                torch.cuda.synchronize()
            t_rate0, step_rate0 = time.time(), step
        # plan / re-plan while in warmup/stable phase (every few steps; the sync costs little)
        if (t_rate0 is not None and step >= step_rate0 + 5 and plan["cool_start"] is None
                and step % max(1, min(10, args.log_every)) == 0):
            if is_cuda:
                torch.cuda.synchronize()
            per_step = (time.time() - t_rate0) / (step - step_rate0)
            total = step + int(0.98 * (deadline - time.time()) / per_step)
            if args.max_steps:
                total = min(total, args.max_steps)
            if plan["total"] is None:
                plan["warmup"] = max(1, min(args.warmup, total // 10))
                log(f"step time {per_step * 1e3:.1f} ms ({tokens_per_step / per_step:,.0f} tok/s): planning "
                    f"{total} steps, warmup {plan['warmup']}")
            plan["total"] = total
            if step >= int(total * (1 - args.cooldown_frac)):
                plan["cool_start"] = step
                log(f"step {step}: cooldown to step {total}")
        if step % args.log_every == 0:
            avg = (loss_acc / loss_n).item()
            gnv = gn.item()
            now2 = time.time()
            tps = (tokens - last_log_tokens) / (now2 - last_log_t)
            last_log_t, last_log_tokens = now2, tokens
            last_train_loss = avg
            loss_acc.zero_()
            loss_n = 0
            write_row({"step": step, "tokens": tokens, "elapsed_s": round(now2 - T_SCRIPT_START, 2),
                       "lr": float(f"{lr:.4e}"), "train_loss": round(avg, 5), "grad_norm": round(gnv, 4),
                       "tok_per_s": round(tps)})
            log(f"step {step:5d}/{plan['total'] or '?'} tok {tokens / 1e6:7.1f}M loss {avg:.4f} lr {lr:.2e} "
                f"gn {gnv:.2f} {tps:,.0f} tok/s")
            if not math.isfinite(avg):
                raise SystemExit("loss is not finite")
        if step % args.eval_every == 0:
            run_eval(step, tokens)
    if is_cuda:
        torch.cuda.synchronize()
    t_train = time.time() - t_train0
    if loss_n:
        last_train_loss = (loss_acc / loss_n).item()
        write_row({"step": step, "tokens": tokens, "elapsed_s": round(time.time() - T_SCRIPT_START, 2),
                   "lr": float(f"{lr_at(step - 1):.4e}"), "train_loss": round(last_train_loss, 5)})
    steady_tps = (tokens_per_step * (step - step_rate0) / (time.time() - t_rate0)) if t_rate0 and step > step_rate0 else None
    log(f"training done ({stop_reason}): {step} steps, {tokens / 1e6:.1f}M tokens "
        f"({tokens / n_train:.2f} epochs) in {t_train:.0f}s; steady {steady_tps or 0:,.0f} tok/s")
    hl_bf16 = run_eval(step, tokens)
    rc.disable()
    model.eval()
    errors = []

    # --- save first (so a failure below still leaves the weights) ---
    cfg_dict = write_config(cfg, args.out)
    files, sizes, total_bytes = save_weights(model, args.out, int(args.max_shard_mib * 1024 * 1024))
    log(f"saved config.json, {', '.join(f'{f} ({sizes[f] / 2**20:.2f} MiB)' for f in files)}; "
        f"tensors {total_bytes / 1e6:.1f} MB")
    big = [f for f, sz in sizes.items() if sz > HARD_FILE_LIMIT]
    if big and not args.smoke:
        log(f"WARNING: files over 16 MiB: {big}")

    # --- final evaluation in float32 (no autocast, no TF32) with HF's own code ---
    set_fp32_matmul(precise=True)
    ppl_ref = ppl_fast = s_ref = c_ref = None
    try:
        t = time.time()
        with impls(HF_IMPLS):
            s_ref, c_ref = heldout_nll(model, windows, device, autocast_dtype=None, batch=4)
        ppl_ref = math.exp(s_ref / c_ref)
        with impls(FAST_IMPLS):
            s_fast, c_fast = heldout_nll(model, windows, device, autocast_dtype=None, batch=16)
        ppl_fast = math.exp(s_fast / c_fast)
        log(f"HELD-OUT (f32, HF reference code): loss {s_ref / c_ref:.5f} nats/token, perplexity {ppl_ref:.4f} "
            f"over {c_ref} predicted tokens in {len(windows)} windows; fast scan: {ppl_fast:.4f} "
            f"({time.time() - t:.1f}s)")
    except Exception as e:  # noqa: BLE001
        errors.append(f"final eval: {type(e).__name__}: {e}")
        log(errors[-1])

    # --- samples (HF generate, original code paths) ---
    samples = []
    with impls(HF_IMPLS):
        torch.manual_seed(1234)
        for prompt in PROMPTS:
            ids = torch.tensor([tok.encode(prompt).ids], device=device)
            try:
                with torch.no_grad():
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.8,
                                         top_p=0.95, max_new_tokens=args.sample_tokens, pad_token_id=EOT_ID)
                text = tok.decode(out[0].tolist(), skip_special_tokens=False)
            except Exception as e:  # noqa: BLE001
                text = f"<generation failed: {type(e).__name__}: {e}>"
                errors.append(text)
            samples.append({"prompt": prompt, "text": text})
            print(f"--- sample: {prompt!r}\n{text}\n", flush=True)

    try:
        verify_saved(model, args.out, device)
        log("reload check: from_pretrained(out) gives identical tensors and logits (tied lm_head)")
    except Exception as e:  # noqa: BLE001
        errors.append(f"reload check: {type(e).__name__}: {e}")
        log(errors[-1])

    summary = {
        "params": n_params,
        "params_non_embedding": n_params - n_embed,
        "weight_bytes_f32": total_bytes,
        "weight_files": sizes,
        "steps": step,
        "tokens_seen": tokens,
        "epochs": tokens / n_train,
        "train_tokens": int(n_train),
        "heldout_tokens": int(held_np.size),
        "wall_time_total_s": None,
        "wall_time_train_s": t_train,
        "first_step_s": first_step_s,
        "steady_tokens_per_s": steady_tps,
        "stop_reason": stop_reason,
        "device": gpu_name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "compile": compile_state,
        "batch_tokens": tokens_per_step,
        "micro_batch": micro,
        "final_train_loss": last_train_loss,
        "heldout": {
            "definition": "last 3 books (text after the 111th '<|endoftext|>'), tokenizer.encode() as one stream "
                          "incl. the 2 separator tokens; non-overlapping windows of 1024 (last partial kept if >= 2 "
                          "tokens), each from an empty state; predict tokens 1..len-1; ppl = exp(sum NLL / count)",
            "window": EVAL_WINDOW,
            "windows": len(windows),
            "predicted_tokens": c_ref,
            "loss_f32": (s_ref / c_ref) if c_ref else None,
            "ppl_f32": ppl_ref,
            "ppl_f32_fast_scan": ppl_fast,
            "loss_bf16_autocast": hl_bf16,
        },
        "hparams": {k: v for k, v in vars(args).items()},
        "tokenizer_sha256": sha256_file(args.tokenizer),
        "tokenizer_stats": {k: tok_meta.get(k) for k in ("train_tokens", "heldout_tokens", "train_bytes_per_token",
                                                           "heldout_bytes_per_token") if k in tok_meta},
        "config": cfg_dict,
        "samples": samples,
        "errors": errors,
    }

    # --- plot ---
    try:
        ppl_s = f"{ppl_ref:.2f}" if ppl_ref else "?"
        plot_curves(rows, os.path.join(args.out, "loss.png"),
                    f"Mamba2 {n_params / 1e6:.1f}M params, {tokens / 1e6:.0f}M tokens, held-out ppl {ppl_s} "
                    f"({gpu_name})")
    except Exception as e:  # noqa: BLE001
        errors.append(f"plot: {type(e).__name__}: {e}")
        log(errors[-1])
    csv_f.close()
    summary["wall_time_total_s"] = time.time() - T_SCRIPT_START
    with open(os.path.join(args.out, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
        f.write("\n")
    if args.bundle:
        bfiles, tarred = bundle_outputs(args.out, args.bundle, files)
        log(f"bundle {args.bundle}: {bfiles} (meta.tar holds {tarred})")
    log(f"done: out={args.out} total wall {time.time() - T_SCRIPT_START:.0f}s; held-out ppl "
        f"{ppl_ref if ppl_ref is None else round(ppl_ref, 3)}" + (f"; ERRORS: {errors}" if errors else ""))

if __name__ == "__main__":
    main()
