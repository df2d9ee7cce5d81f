#!/usr/bin/env python3
"""Reference fixtures for the Rust Mamba-2 implementation, produced with HuggingFace transformers.

Two modes:

1. Fixture mode (default, no arguments):

       /opt/pyref/bin/python tools/hf_reference.py [--out tests/fixtures] [--only CASE ...]

   Builds tiny `Mamba2ForCausalLM` models with seeded random weights, writes each to
   `tests/fixtures/<case>/` (config.json, model.safetensors / pytorch_model.bin, reference.safetensors,
   gradients.safetensors, case.json) and checks the reference against HF as-is and against an independent
   sequential float64 implementation written from mamba_ssm's `Mamba2.step` semantics.
   gradients.safetensors holds the mean next-token cross-entropy and every parameter's gradient (autograd
   on the float64 reference path, checked by finite differences).  See tests/fixtures/README.md.

2. Logits mode (parity fixtures for a real checkpoint):

       python tools/hf_reference.py --weights DIR --prompts-file FILE --out FILE.safetensors

   Loads an HF-format model directory (config.json + model.safetensors or a sharded
   model.safetensors.index.json, or pytorch_model.bin; an original state-spaces directory with a
   `d_model` config also works) and tokenizer.json (via the `tokenizers` package), and writes
   `input_ids.{i}` (int64 [1, L_i]) and `logits.{i}` (f32 [1, L_i, V]) for every non-empty prompt line.

Precision: the reference path runs HF's own torch code in float64 with every internal float32 cast
turned into a no-op (see `RefPatches`), so the stored values are float64 results rounded once to f32.
Pinned to transformers 5.17.0 / torch 2.11.0 (the source rewrites assert that the patched text exists).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import shutil
import sys
import textwrap
import types
import zlib
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import Mamba2Config, Mamba2ForCausalLM  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2 as mm  # noqa: E402

transformers.logging.set_verbosity_error()

EXPECTED_TRANSFORMERS = "5.17.0"
EXPECTED_TORCH = "2.11"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

F64 = torch.float64


# ----------------------------------------------------------------------------------------------------
# HF torch path, forced (no mamba_ssm / causal_conv1d kernels even if installed) and made float64-clean
# ----------------------------------------------------------------------------------------------------

_KERNEL_FUNCS = [
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "mamba2_chunk_scan",
    "mamba2_selective_state_update",
    "mamba2_split_conv1d_scan_combined",
]
# The undecorated torch fallbacks HF ships in modeling_mamba2.py.  `use_kernel_func_from_hub_with_fallback`
# keeps them reachable through `__wrapped__`.
HF_TORCH_FUNCS = {name: inspect.unwrap(getattr(mm, name)) for name in _KERNEL_FUNCS}


def _source(fn) -> str:
    """Dedented source of `fn` without its decorator lines."""
    src = textwrap.dedent(inspect.getsource(fn))
    lines = src.splitlines(keepends=True)
    while lines and lines[0].lstrip().startswith("@"):
        lines.pop(0)
    return "".join(lines)


def _rewrite(src: str, replacements: list[tuple[str, str, int]]) -> str:
    for old, new, count in replacements:
        found = src.count(old)
        if found != count:
            raise RuntimeError(
                f"source rewrite failed: expected {count} x {old!r}, found {found}; "
                f"transformers {transformers.__version__} differs from {EXPECTED_TRANSFORMERS}"
            )
        src = src.replace(old, new)
    return src


def _compile(src: str, name: str, namespace: dict):
    code = compile(src, f"<patched {name}>", "exec")
    exec(code, namespace)
    return namespace[name]


def make_namespace(precise: bool, dt_limit_in_step: tuple[float, float] | None) -> dict:
    """A copy of modeling_mamba2's globals in which the kernel entry points are HF's torch functions.

    precise=True  -> the `.float()` casts of mamba2_chunk_scan / mamba2_selective_state_update become
                     `.to(_UP)` with _UP = float64, i.e. the scan runs in the model dtype (float64).
    dt_limit_in_step -> additionally clamp softplus(dt) in the single-token step (HF and mamba_ssm do not).
    """
    ns = dict(vars(mm))
    ns["_UP"] = F64
    ns["_DT_LIMIT"] = dt_limit_in_step
    ns["causal_conv1d_fn"] = HF_TORCH_FUNCS["causal_conv1d_fn"]
    ns["causal_conv1d_update"] = HF_TORCH_FUNCS["causal_conv1d_update"]
    ns["mamba2_split_conv1d_scan_combined"] = lambda *a, **k: None  # training-only fused path
    if not precise and dt_limit_in_step is None:
        ns["mamba2_chunk_scan"] = HF_TORCH_FUNCS["mamba2_chunk_scan"]
        ns["mamba2_selective_state_update"] = HF_TORCH_FUNCS["mamba2_selective_state_update"]
        return ns
    scan_src = _source(HF_TORCH_FUNCS["mamba2_chunk_scan"])
    step_src = _source(HF_TORCH_FUNCS["mamba2_selective_state_update"])
    if precise:
        # modeling_mamba2.py L278-L289: hidden_states/B/C/dt are cast to float32 for the SSD scan.
        scan_src = _rewrite(scan_src, [(".float()", ".to(_UP)", 5)])
        # modeling_mamba2.py L216: dA = exp(dt.float() * A.float())
        step_src = _rewrite(step_src, [(".float()", ".to(_UP)", 2)])
    if dt_limit_in_step is not None:
        # modeling_mamba2.py L209-L213: the step path never applies time_step_limit; the chunk path does (L276).
        step_src = _rewrite(
            step_src,
            [
                (
                    "    dt = dt[..., None]\n",
                    "    dt = torch.clamp(dt, min=_DT_LIMIT[0], max=_DT_LIMIT[1])\n    dt = dt[..., None]\n",
                    1,
                )
            ],
        )
    ns["mamba2_chunk_scan"] = _compile(scan_src, "mamba2_chunk_scan", ns)
    ns["mamba2_selective_state_update"] = _compile(step_src, "mamba2_selective_state_update", ns)
    return ns


def gated_norm_grouped_forward(self, hidden_states, gate=None):
    """mamba_ssm RMSNormGated(d_ssm, group_size=d_ssm // ngroups, norm_before_gate=False), float64-clean:
    y = rmsnorm_per_group(x * silu(z)) * weight.  With one group this is HF's MambaRMSNormGated."""
    input_dtype = hidden_states.dtype
    cdt = torch.promote_types(input_dtype, torch.float32)
    x = hidden_states.to(cdt)
    if gate is not None:
        x = x * F.silu(gate.to(cdt))
    xg = x.unflatten(-1, (self._ref_ngroups, -1))
    xg = xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * xg.flatten(-2).to(input_dtype)


class RefPatches:
    """Instance-level patches applied to one Mamba2ForCausalLM.

    mode "hf_asis": HF's torch path exactly as shipped (kernel hooks bypassed so a machine with mamba_ssm
                    installed still runs the same code).
    mode "precise": same code with every internal float32 cast removed (A = -exp(A_log.float()), the scan,
                    the step's dA, both RMSNorms, residual_in_fp32's residual.to(float32)); with
                    group_norm=True the gated norm is mamba_ssm's per-group norm; dt_limit_in_step clamps
                    softplus(dt) in the decode step too.
    """

    def __init__(self, model: Mamba2ForCausalLM, mode: str, group_norm: bool = False, dt_limit_in_step=None):
        assert mode in ("hf_asis", "precise")
        precise = mode == "precise"
        ns = make_namespace(precise, dt_limit_in_step)
        mixer_src = _source(mm.Mamba2Mixer.forward)
        if precise:
            mixer_src = _rewrite(mixer_src, [("self.A_log.float()", "self.A_log.to(_UP)", 1)])
        mixer_forward = _compile(mixer_src, "forward", ns)
        block_forward = rms_forward = None
        if precise:
            block_src = _rewrite(
                _source(mm.Mamba2Block.forward),
                [("residual.to(torch.float32)", "residual.to(torch.promote_types(residual.dtype, torch.float32))", 1)],
            )
            block_forward = _compile(block_src, "forward", dict(ns))
            rms_src = _rewrite(
                _source(mm.Mamba2RMSNorm.forward),
                [
                    (
                        "hidden_states.to(torch.float32)",
                        "hidden_states.to(torch.promote_types(hidden_states.dtype, torch.float32))",
                        1,
                    )
                ],
            )
            rms_forward = _compile(rms_src, "forward", dict(ns))
        gated_src = _rewrite(
            _source(mm.MambaRMSNormGated.forward),
            [
                (
                    "hidden_states.to(torch.float32)",
                    "hidden_states.to(torch.promote_types(hidden_states.dtype, torch.float32))",
                    1,
                ),
                ("gate.to(torch.float32)", "gate.to(torch.promote_types(gate.dtype, torch.float32))", 1),
            ],
        )
        gated_precise = _compile(gated_src, "forward", dict(ns))
        ngroups = model.config.n_groups
        for mod in model.modules():
            if isinstance(mod, mm.Mamba2Mixer):
                mod.forward = types.MethodType(mixer_forward, mod)
            elif isinstance(mod, mm.Mamba2Block) and block_forward is not None:
                mod.forward = types.MethodType(block_forward, mod)
            elif isinstance(mod, mm.Mamba2RMSNorm) and rms_forward is not None:
                mod.forward = types.MethodType(rms_forward, mod)
            elif isinstance(mod, mm.MambaRMSNormGated):
                if group_norm:
                    mod._ref_ngroups = ngroups
                    mod.forward = types.MethodType(gated_norm_grouped_forward, mod)
                elif precise:
                    mod.forward = types.MethodType(gated_precise, mod)


# ----------------------------------------------------------------------------------------------------
# Running HF: prefill, cached decode, cache extraction
# ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def hf_logits(model, ids, cache=None, use_cache=False):
    """Logits in the model dtype (HF's Mamba2ForCausalLM.forward ends with `.float()`, so call the parts)."""
    out = model.backbone(input_ids=ids, cache_params=cache, use_cache=use_cache, return_dict=True)
    h = out.last_hidden_state
    logits = model.lm_head(h.to(model.lm_head.weight.dtype))
    return logits, out.cache_params


@torch.no_grad()
def hf_run(model, ids, prefix_len):
    """Returns prefill logits [B,L,V], decode logits [B,L-L0,V] and the cache after a full prefill."""
    logits_prefill, cache = hf_logits(model, ids, use_cache=True)
    states = {}
    for i, layer in enumerate(cache.layers):
        states[f"ssm_state.{i}"] = layer.recurrent_states[0].clone()
        states[f"conv_state.{i}"] = layer.conv_states[0].clone()
    # prefill of the first L0 tokens, then one token at a time through the cache.  Mamba2 in transformers
    # 5.17 takes no cache_position: the DynamicCache's per-layer has_previous_state drives the step path.
    _, cache = hf_logits(model, ids[:, :prefix_len], use_cache=True)
    steps = []
    for t in range(prefix_len, ids.shape[1]):
        lg, cache = hf_logits(model, ids[:, t : t + 1], cache=cache, use_cache=True)
        steps.append(lg)
    logits_decode = torch.cat(steps, dim=1)
    return logits_prefill, logits_decode, states


@torch.no_grad()
def hf_run_continuation(model, ids, prefix_len):
    """Prefill of the first L0 tokens, then ONE multi-token call for the rest (HF: chunk scan with
    initial_states and the cached conv inputs); returns logits [B, L-L0, V]."""
    _, cache = hf_logits(model, ids[:, :prefix_len], use_cache=True)
    logits, _ = hf_logits(model, ids[:, prefix_len:], cache=cache, use_cache=True)
    return logits


# ----------------------------------------------------------------------------------------------------
# Independent sequential float64 implementation (mamba_ssm Mamba2.step semantics, token by token)
# ----------------------------------------------------------------------------------------------------


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.no_grad()
def naive_forward(W: dict, p: "Case", ids: torch.Tensor, state: dict | None = None, clamp_dt: bool = True):
    """Sequential recurrence.  W: HF key -> float64 tensor.  Returns (logits, new_state)."""
    Bsz, L = ids.shape
    di, H, P, N, G, K = p.d_inner, p.num_heads, p.head_dim, p.state_size, p.n_groups, p.conv_kernel
    conv_dim = di + 2 * G * N
    eps = p.eps
    lo, hi = p.time_step_limit if clamp_dt else (0.0, math.inf)
    if state is None:
        state = {}
        for i in range(p.n_layer):
            state[f"conv_state.{i}"] = torch.zeros(Bsz, conv_dim, K, dtype=F64)
            state[f"ssm_state.{i}"] = torch.zeros(Bsz, H, P, N, dtype=F64)
    state = {k: v.clone() for k, v in state.items()}
    h = W["backbone.embeddings.weight"][ids]
    for i in range(p.n_layer):
        pre = f"backbone.layers.{i}."
        x = _rms(h, W[pre + "norm.weight"], eps)
        zxbcdt = x @ W[pre + "mixer.in_proj.weight"].T
        if pre + "mixer.in_proj.bias" in W:
            zxbcdt = zxbcdt + W[pre + "mixer.in_proj.bias"]
        z, xbc, dt = torch.split(zxbcdt, [di, conv_dim, H], dim=-1)
        # causal depthwise conv over [cached K inputs | new inputs]; the window for token t ends at t.
        full = torch.cat([state[f"conv_state.{i}"], xbc.transpose(1, 2)], dim=-1)  # [B, C, K+L]
        cw = W[pre + "mixer.conv1d.weight"][:, 0, :]  # [C, K]
        conv = torch.stack([(full[:, :, t + 1 : t + 1 + K] * cw).sum(-1) for t in range(L)], dim=1)  # [B,L,C]
        if pre + "mixer.conv1d.bias" in W:
            conv = conv + W[pre + "mixer.conv1d.bias"]
        state[f"conv_state.{i}"] = full[:, :, -K:].clone()
        xbc = F.silu(conv)
        xs, Bm, Cm = torch.split(xbc, [di, G * N, G * N], dim=-1)
        dt = F.softplus(dt + W[pre + "mixer.dt_bias"]).clamp(min=lo, max=hi)  # [B, L, H]
        A = -torch.exp(W[pre + "mixer.A_log"])
        Dp = W[pre + "mixer.D"]
        S = state[f"ssm_state.{i}"]
        ys = []
        for t in range(L):
            xt = xs[:, t].reshape(Bsz, H, P)
            Bt = Bm[:, t].reshape(Bsz, G, N).repeat_interleave(H // G, dim=1)  # head h -> group h // (H/G)
            Ct = Cm[:, t].reshape(Bsz, G, N).repeat_interleave(H // G, dim=1)
            dA = torch.exp(dt[:, t] * A)  # [B, H]
            S = S * dA[:, :, None, None] + (dt[:, t, :, None] * xt)[..., None] * Bt[:, :, None, :]
            ys.append((S * Ct[:, :, None, :]).sum(-1) + Dp[:, None] * xt)
        state[f"ssm_state.{i}"] = S
        y = torch.stack(ys, dim=1).reshape(Bsz, L, di)
        y = y * F.silu(z)
        yg = y.reshape(Bsz, L, G, di // G)
        yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + eps)  # mamba_ssm: eps fixed at 1e-5
        y = yg.reshape(Bsz, L, di) * W[pre + "mixer.norm.weight"]
        out = y @ W[pre + "mixer.out_proj.weight"].T
        if pre + "mixer.out_proj.bias" in W:
            out = out + W[pre + "mixer.out_proj.bias"]
        h = h + out
    h = _rms(h, W["backbone.norm_f.weight"], eps)
    head = W.get("lm_head.weight", W["backbone.embeddings.weight"])
    return h @ head.T, state


def naive_run(W, p, ids, prefix_len, clamp_dt=True):
    logits_prefill, states = naive_forward(W, p, ids, clamp_dt=clamp_dt)
    _, st = naive_forward(W, p, ids[:, :prefix_len], clamp_dt=clamp_dt)
    steps = []
    for t in range(prefix_len, ids.shape[1]):
        lg, st = naive_forward(W, p, ids[:, t : t + 1], st, clamp_dt=clamp_dt)
        steps.append(lg)
    return logits_prefill, torch.cat(steps, dim=1), states


# ----------------------------------------------------------------------------------------------------
# Training reference: next-token loss and the gradient of every parameter (gradients.safetensors)
# ----------------------------------------------------------------------------------------------------


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits at positions 0..L-2 against ids 1..L-1, over all V logits."""
    V = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1).to(logits.device))


def hf_loss(model, ids):
    """(loss, logits) with autograd: the same backbone call as hf_run's prefill (use_cache=True), so the
    logits are those of the stored `logits_prefill` before rounding."""
    out = model.backbone(input_ids=ids, use_cache=True, return_dict=True)
    logits = model.lm_head(out.last_hidden_state.to(model.lm_head.weight.dtype))
    return next_token_loss(logits, ids), logits


def hf_gradients(model, ids) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(loss, logits, {HF name: d loss / d param}) by autograd.  named_parameters() lists a tied lm_head once,
    as backbone.embeddings.weight, whose gradient therefore sums the embedding and the lm_head use."""
    named = dict(model.named_parameters())
    with torch.enable_grad():
        loss, logits = hf_loss(model, ids)
        grads = torch.autograd.grad(loss, list(named.values()))
    return loss.detach(), logits.detach(), {k: g.detach() for k, g in zip(named, grads)}


def naive_gradients(W64: dict, p: "Case", ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Loss and gradients by autograd through the independent token-by-token recurrence (`naive_forward`)."""
    leaves = {k: v.clone().requires_grad_(True) for k, v in W64.items()}
    with torch.enable_grad():
        logits, _ = inspect.unwrap(naive_forward)(leaves, p, ids)
        loss = next_token_loss(logits, ids)
        grads = torch.autograd.grad(loss, list(leaves.values()))
    return loss.detach(), {k: g for k, g in zip(leaves, grads)}


@torch.no_grad()
def finite_difference_check(model, ids, grads: dict, seed: int, h: float = 1e-3) -> dict:
    """For every parameter tensor: a seeded random unit direction u, the Richardson-extrapolated central
    difference (4 D(h/2) - D(h)) / 3 of the loss along u (D(h) = (loss(θ+hu) - loss(θ-hu)) / 2h, error O(h^4))
    against the projection <grad, u>.  Returns {name: (fd, projection, relative error)}.  The parameter is
    restored bit for bit afterwards."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, param in model.named_parameters():
        u = torch.randn(param.shape, generator=g, dtype=F64)
        u = (u / u.norm()).to(param.device)
        saved = param.detach().clone()

        def loss_at(step):
            param.copy_(saved + step * u)
            return float(hf_loss(model, ids)[0])

        def central(step):
            return (loss_at(step) - loss_at(-step)) / (2 * step)

        fd = (4 * central(h / 2) - central(h)) / 3
        param.copy_(saved)
        proj = float((grads[name].to(F64) * u).sum())
        out[name] = (fd, proj, abs(fd - proj) / abs(proj))
    return out


# ----------------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    hidden: int
    head_dim: int
    state_size: int
    n_groups: int
    chunk_size: int
    seq_len: int
    prefix_len: int
    vocab_size: int  # HF vocab_size == rows of the embedding (already padded)
    vocab_unpadded: int | None = None  # original-format vocab_size (ids are drawn below this)
    n_layer: int = 2
    expand: int = 2
    conv_kernel: int = 4
    residual_in_fp32: bool = True
    tied: bool = True
    use_bias: bool = False
    use_conv_bias: bool = True
    time_step_limit: tuple = (0.0, math.inf)
    eps: float = 1e-5
    batch: int = 2
    # extra output formats: "original" (state-spaces keys + config) and the three mamba2-130m look-alikes
    original_dir: str | None = None
    mamba2_130m_dirs: bool = False
    description: str = ""

    @property
    def d_inner(self):
        return self.expand * self.hidden

    @property
    def num_heads(self):
        return self.d_inner // self.head_dim

    @property
    def ids_vocab(self):
        return self.vocab_unpadded or self.vocab_size

    @property
    def dt_limited(self):
        return tuple(self.time_step_limit) != (0.0, math.inf)

    def seed(self):
        return zlib.crc32(self.name.encode())

    def hf_config(self, **extra) -> Mamba2Config:
        return Mamba2Config(
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden,
            state_size=self.state_size,
            num_hidden_layers=self.n_layer,
            layer_norm_epsilon=self.eps,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
            expand=self.expand,
            conv_kernel=self.conv_kernel,
            n_groups=self.n_groups,
            use_bias=self.use_bias,
            use_conv_bias=self.use_conv_bias,
            residual_in_fp32=self.residual_in_fp32,
            time_step_limit=tuple(self.time_step_limit),
            chunk_size=self.chunk_size,
            tie_word_embeddings=self.tied,
            **extra,
        )

    def params(self) -> dict:
        return {
            "hidden_size": self.hidden,
            "n_layer": self.n_layer,
            "expand": self.expand,
            "d_inner": self.d_inner,
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "state_size": self.state_size,
            "n_groups": self.n_groups,
            "conv_kernel": self.conv_kernel,
            "conv_dim": self.d_inner + 2 * self.n_groups * self.state_size,
            "chunk_size": self.chunk_size,
            "vocab_size": self.vocab_size,
            "vocab_size_unpadded": self.ids_vocab,
            "residual_in_fp32": self.residual_in_fp32,
            "tie_word_embeddings": self.tied,
            "use_bias": self.use_bias,
            "use_conv_bias": self.use_conv_bias,
            "time_step_limit": [float(x) for x in self.time_step_limit],
            "layer_norm_epsilon": self.eps,
            "batch": self.batch,
            "seq_len": self.seq_len,
        }


CASES = [
    Case(
        "g1_p16_n16_c8_k4_fp32res_tied", hidden=32, head_dim=16, state_size=16, n_groups=1, chunk_size=8,
        seq_len=29, prefix_len=11, vocab_size=64, residual_in_fp32=True, tied=True,
        description="baseline: 1 group, 4 heads of 16, state 16, chunk 8, tied head",
    ),
    Case(
        "g2_p16_n16_c8_k4_nofp32res_untied_v77", hidden=32, head_dim=16, state_size=16, n_groups=2,
        chunk_size=8, seq_len=37, prefix_len=13, vocab_size=80, vocab_unpadded=77, residual_in_fp32=False,
        tied=False, original_dir="g2_p16_n16_c8_k4_nofp32res_untied_v77_original",
        description="2 groups (per-group gated norm), untied head, residual_in_fp32 off, vocab 77 padded to 80; "
        "also saved in the original state-spaces format",
    ),
    Case(
        "g1_p32_n64_c32_k4_fp32res_untied", hidden=64, head_dim=32, state_size=64, n_groups=1, chunk_size=32,
        seq_len=67, prefix_len=37, vocab_size=96, residual_in_fp32=True, tied=False,
        description="head_dim 32, state 64, chunk 32 (L=67 spans 3 chunks, L0=37 spans 2)",
    ),
    Case(
        "g2_p32_n32_c32_k4_bias_tied", hidden=64, head_dim=32, state_size=32, n_groups=2, chunk_size=32,
        seq_len=53, prefix_len=35, vocab_size=112, residual_in_fp32=True, tied=True, use_bias=True,
        description="2 groups, use_bias=True (in_proj.bias, out_proj.bias), tied head",
    ),
    Case(
        "g1_p16_n32_c8_k4_dtlimit", hidden=32, head_dim=16, state_size=32, n_groups=1, chunk_size=8,
        seq_len=30, prefix_len=13, vocab_size=72, residual_in_fp32=True, tied=True, time_step_limit=(0.05, 0.5),
        description="finite time_step_limit (0.05, 0.5): softplus(dt) clamped in prefill AND decode",
    ),
    Case(
        "g4_p16_n16_c8_k3_noconvbias_untied", hidden=32, head_dim=16, state_size=16, n_groups=4, chunk_size=8,
        seq_len=21, prefix_len=10, vocab_size=300, conv_kernel=3, residual_in_fp32=False, tied=False,
        use_conv_bias=False,
        description="4 heads in 4 groups, conv_kernel 3, use_conv_bias=False (no conv1d.bias key), vocab 300",
    ),
    Case(
        "mamba2-130m", hidden=64, head_dim=64, state_size=128, n_groups=1, chunk_size=256, seq_len=40,
        prefix_len=17, vocab_size=288, vocab_unpadded=277, conv_kernel=4, residual_in_fp32=True, tied=True,
        mamba2_130m_dirs=True,
        description="scaled-down state-spaces/mamba2-130m: Mamba2 module defaults (d_state 128, headdim 64, "
        "chunk 256, d_conv 4, expand 2, ngroups 1), d_model 64, 2 layers, vocab 277 padded to 288, tied",
    ),
]


# ----------------------------------------------------------------------------------------------------
# Random weights
# ----------------------------------------------------------------------------------------------------


def inv_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


def random_weights(p: Case) -> dict:
    """Seeded, float32, HF key names.  Not HF's init: every parameter is random and non-trivial."""
    g = torch.Generator().manual_seed(p.seed())

    def normal(*shape, std=1.0, mean=0.0):
        return torch.randn(*shape, generator=g, dtype=F64) * std + mean

    def uniform(*shape, lo=0.0, hi=1.0):
        return torch.rand(*shape, generator=g, dtype=F64) * (hi - lo) + lo

    d, di, H, N, G, K = p.hidden, p.d_inner, p.num_heads, p.state_size, p.n_groups, p.conv_kernel
    conv_dim = di + 2 * G * N
    W = {"backbone.embeddings.weight": normal(p.vocab_size, d)}
    for i in range(p.n_layer):
        pre = f"backbone.layers.{i}."
        W[pre + "norm.weight"] = uniform(d, lo=0.7, hi=1.3)
        in_w = normal(di + conv_dim + H, d, std=0.2)
        in_w[di + conv_dim :] *= 2.0 / d**0.5  # dt rows: std 0.4/sqrt(d), so w.x adds ~N(0, 0.4^2) to dt_bias
        W[pre + "mixer.in_proj.weight"] = in_w
        if p.use_bias:
            W[pre + "mixer.in_proj.bias"] = normal(di + conv_dim + H, std=0.1)
        W[pre + "mixer.conv1d.weight"] = uniform(conv_dim, 1, K, lo=-0.5, hi=0.5)
        if p.use_conv_bias:
            W[pre + "mixer.conv1d.bias"] = uniform(conv_dim, lo=-0.3, hi=0.3)
        # softplus(dt_bias) log-uniform in [0.01, 1]
        W[pre + "mixer.dt_bias"] = inv_softplus(torch.exp(uniform(H, lo=math.log(0.01), hi=math.log(1.0))))
        W[pre + "mixer.A_log"] = torch.log(uniform(H, lo=0.5, hi=8.0))
        W[pre + "mixer.D"] = normal(H)
        W[pre + "mixer.norm.weight"] = uniform(di, lo=0.7, hi=1.3)
        W[pre + "mixer.out_proj.weight"] = normal(d, di, std=0.2)
        if p.use_bias:
            W[pre + "mixer.out_proj.bias"] = normal(d, std=0.1)
    W["backbone.norm_f.weight"] = uniform(d, lo=0.7, hi=1.3)
    if not p.tied:
        W["lm_head.weight"] = normal(p.vocab_size, d, std=0.3)
    return {k: v.to(torch.float32).contiguous() for k, v in W.items()}


def build_hf_model(config: Mamba2Config, W: dict, dtype) -> Mamba2ForCausalLM:
    torch.manual_seed(0)  # HF's init runs before our weights overwrite it; keep it deterministic anyway
    model = Mamba2ForCausalLM(config)
    missing, unexpected = model.load_state_dict(W, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.backbone.embeddings.weight
    return model.to(dtype).eval()


# ----------------------------------------------------------------------------------------------------
# Original (state-spaces / mamba_ssm) format
# ----------------------------------------------------------------------------------------------------


def original_state_dict(W: dict, tied: bool, keep_tied_head: bool) -> dict:
    """HF keys -> mamba_ssm MambaLMHeadModel keys (only the embedding key differs)."""
    sd = {}
    for k, v in W.items():
        sd[k.replace("backbone.embeddings.", "backbone.embedding.")] = v
    if tied and keep_tied_head:
        sd["lm_head.weight"] = sd["backbone.embedding.weight"]  # the same tensor, as MambaLMHeadModel has it
    return sd


def original_config(p: Case, full_ssm_cfg: bool) -> dict:
    ssm_cfg = {"layer": "Mamba2"}
    if full_ssm_cfg:
        ssm_cfg.update(
            d_state=p.state_size,
            d_conv=p.conv_kernel,
            expand=p.expand,
            headdim=p.head_dim,
            ngroups=p.n_groups,
            chunk_size=p.chunk_size,
        )
        if p.use_bias:
            ssm_cfg["bias"] = True
        if not p.use_conv_bias:
            ssm_cfg["conv_bias"] = False
        if p.dt_limited:
            ssm_cfg["dt_limit"] = list(p.time_step_limit)
    return {
        "d_model": p.hidden,
        "d_intermediate": 0,
        "n_layer": p.n_layer,
        "vocab_size": p.ids_vocab,
        "ssm_cfg": ssm_cfg,
        "attn_layer_idx": [],
        "attn_cfg": {},
        "rms_norm": True,
        "residual_in_fp32": p.residual_in_fp32,
        "fused_add_norm": True,
        "pad_vocab_size_multiple": 16,
        "tie_embeddings": p.tied,
    }


# mamba_ssm.modules.mamba2.Mamba2.__init__ defaults
MAMBA2_DEFAULTS = dict(
    d_state=128, d_conv=4, expand=2, headdim=64, ngroups=1, chunk_size=256, bias=False, conv_bias=True,
    dt_limit=(0.0, math.inf), D_has_hdim=False, rmsnorm=True, norm_before_gate=False, d_ssm=None,
)


def hf_config_from_original(orig: dict) -> Mamba2Config:
    ssm = dict(MAMBA2_DEFAULTS)
    cfg = dict(orig.get("ssm_cfg") or {})
    layer = cfg.pop("layer", "Mamba1")
    if layer != "Mamba2":
        raise ValueError(f"ssm_cfg.layer is {layer!r}, only Mamba2 is supported")
    ssm.update(cfg)
    if orig.get("d_intermediate", 0) or orig.get("attn_layer_idx"):
        raise ValueError("MLP / attention layers are not supported")
    if ssm["D_has_hdim"] or not ssm["rmsnorm"] or ssm["norm_before_gate"] or ssm["d_ssm"] is not None:
        raise ValueError(f"ssm_cfg option not representable in HF Mamba2: {cfg}")
    vocab = orig["vocab_size"]
    mult = orig.get("pad_vocab_size_multiple", 8)
    if vocab % mult:
        vocab += mult - vocab % mult
    d_model = orig["d_model"]
    d_inner = ssm["expand"] * d_model
    return Mamba2Config(
        num_heads=d_inner // ssm["headdim"],
        head_dim=ssm["headdim"],
        vocab_size=vocab,
        hidden_size=d_model,
        state_size=ssm["d_state"],
        num_hidden_layers=orig["n_layer"],
        layer_norm_epsilon=1e-5,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        expand=ssm["expand"],
        conv_kernel=ssm["d_conv"],
        n_groups=ssm["ngroups"],
        use_bias=ssm["bias"],
        use_conv_bias=ssm["conv_bias"],
        residual_in_fp32=orig.get("residual_in_fp32", True),
        time_step_limit=tuple(ssm["dt_limit"]),
        chunk_size=ssm["chunk_size"],
        tie_word_embeddings=orig.get("tie_embeddings", True),
    )


# ----------------------------------------------------------------------------------------------------
# Fixture generation
# ----------------------------------------------------------------------------------------------------


def maxdiff(a, b) -> float:
    return float((a.to(F64) - b.to(F64)).abs().max())


def to_f32(t):
    return t.detach().to("cpu", torch.float32).contiguous()


def json_safe(obj):
    """Strict JSON for our own files (case.json, index.json): an infinite float becomes null."""
    if isinstance(obj, float) and math.isinf(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(json_safe(obj), f, indent=2, allow_nan=False)
        f.write("\n")


def save_hf_dir(out_dir, config, W, bare_infinity=False):
    """config.json + model.safetensors exactly as save_pretrained writes them (f32).

    transformers 5.17 writes an infinite time_step_limit as `{"__float__": "Infinity"}`
    (configuration_utils.py `_encode_special_floats`).  bare_infinity=True rewrites that one value to the bare
    `Infinity` that older transformers wrote (json.dumps of inf) and that converted hub checkpoints carry.
    """
    os.makedirs(out_dir, exist_ok=True)
    model = build_hf_model(config, W, torch.float32)
    tmp = out_dir + ".tmp_save"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for fname in ("config.json", "model.safetensors"):
        shutil.move(os.path.join(tmp, fname), os.path.join(out_dir, fname))
    shutil.rmtree(tmp)  # generation_config.json is dropped
    if bare_infinity:
        path = os.path.join(out_dir, "config.json")
        with open(path) as f:
            text = f.read()
        tagged = '{\n      "__float__": "Infinity"\n    }'
        if text.count(tagged) != 1:
            raise RuntimeError(f"unexpected time_step_limit encoding in {path}")
        with open(path, "w") as f:
            f.write(text.replace(tagged, "Infinity"))
        assert Mamba2Config.from_pretrained(out_dir).time_step_limit[1] == math.inf


def save_original_dir(out_dir, p, W, fmt, full_ssm_cfg):
    os.makedirs(out_dir, exist_ok=True)
    write_json(os.path.join(out_dir, "config.json"), original_config(p, full_ssm_cfg))
    if fmt == "bin":
        sd = original_state_dict(W, p.tied, keep_tied_head=True)
        torch.save(sd, os.path.join(out_dir, "pytorch_model.bin"))
    else:
        sd = original_state_dict(W, p.tied, keep_tied_head=False)
        save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def generate_case(p: Case, out_root: str, device: str) -> list[dict]:
    print(f"=== {p.name}", flush=True)
    assert p.hidden * p.expand == p.num_heads * p.head_dim and p.num_heads % p.n_groups == 0
    assert p.seq_len % p.chunk_size != 0 or p.seq_len < p.chunk_size
    W = random_weights(p)
    g = torch.Generator().manual_seed(p.seed() ^ 0x5EED)
    ids = torch.randint(0, p.ids_vocab, (p.batch, p.seq_len), generator=g, dtype=torch.int64)
    config = p.hf_config()
    dev_ids = ids.to(device)
    group_norm = p.n_groups > 1
    step_limit = tuple(p.time_step_limit) if p.dt_limited else None

    # 1. the reference: HF torch code, float64-clean, mamba_ssm semantics where HF departs
    ref_model = build_hf_model(config, W, F64).to(device)
    RefPatches(ref_model, "precise", group_norm=group_norm, dt_limit_in_step=step_limit)
    ref_pre, ref_dec, ref_states = hf_run(ref_model, dev_ids, p.prefix_len)

    # 2. independent sequential float64 implementation
    W64 = {k: v.to(F64) for k, v in W.items()}
    nv_pre, nv_dec, nv_states = naive_run(W64, p, ids, p.prefix_len)

    ref_cont = hf_run_continuation(ref_model, dev_ids, p.prefix_len)
    diffs = {
        "reference_prefill_vs_reference_decode": maxdiff(ref_pre[:, p.prefix_len :], ref_dec),
        "reference_prefill_vs_reference_continuation": maxdiff(ref_pre[:, p.prefix_len :], ref_cont),
        "reference_vs_naive_f64_prefill": maxdiff(ref_pre, nv_pre),
        "reference_vs_naive_f64_decode": maxdiff(ref_dec, nv_dec),
        "reference_vs_naive_f64_states": max(maxdiff(ref_states[k], nv_states[k]) for k in ref_states),
    }

    extra_tensors = {}
    notes = []

    # 3. HF exactly as shipped, float64 model and float32 model
    for dtype, tag in ((F64, "f64"), (torch.float32, "f32")):
        m = build_hf_model(config, W, dtype).to(device)
        RefPatches(m, "hf_asis")
        pre, dec, st = hf_run(m, dev_ids, p.prefix_len)
        diffs[f"hf_{tag}_asis_prefill_vs_decode"] = maxdiff(pre[:, p.prefix_len :], dec)
        diffs[f"hf_{tag}_asis_prefill_vs_reference"] = maxdiff(pre, ref_pre)
        diffs[f"hf_{tag}_asis_decode_vs_reference"] = maxdiff(dec, ref_dec)
        diffs[f"hf_{tag}_asis_states_vs_reference"] = max(maxdiff(st[k], ref_states[k]) for k in st)
        if tag == "f64":
            asis_f64_cache_dtype = str(st["ssm_state.0"].dtype).replace("torch.", "")
        if tag == "f32" and device == "cpu":
            # also the unpatched module, as `model(...)` would run it on this machine
            plain = build_hf_model(config, W, torch.float32)
            with torch.no_grad():
                plain_logits = plain(dev_ids).logits
            diffs["hf_f32_unpatched_model_call_vs_asis"] = maxdiff(plain_logits, pre)

    # 4. the decode-step clamp question
    if p.dt_limited:
        m = build_hf_model(config, W, F64).to(device)
        RefPatches(m, "precise", group_norm=group_norm, dt_limit_in_step=None)
        _, dec_unclamped, _ = hf_run(m, dev_ids, p.prefix_len)
        extra_tensors["logits_decode_unclamped_step"] = to_f32(dec_unclamped)
        diffs["logits_decode_unclamped_step_vs_logits_decode"] = maxdiff(dec_unclamped, ref_dec)
        notes.append(
            "time_step_limit is finite. transformers 5.17 clamps softplus(dt + dt_bias) to the limit in the chunked "
            "(prefill) path (modeling_mamba2.py L276) but NOT in the single-token step "
            "(mamba2_selective_state_update, L209-L213), exactly like mamba_ssm (Mamba2.forward passes dt_limit "
            "to mamba_chunk_scan_combined, Mamba2.step / selective_state_update ignore it). So HF's own decode "
            "disagrees with its prefill. logits_decode here applies the clamp in the step too (consistent with "
            "logits_prefill); logits_decode_unclamped_step is the HF/mamba_ssm behaviour (clamped prefix, "
            "unclamped steps)."
        )
        diffs["dt_clamped_fraction_layer0"] = dt_clamp_fraction(W64, p, ids)

    if group_norm:
        notes.append(
            f"n_groups={p.n_groups} > 1: reference uses mamba_ssm's per-group gated RMSNorm "
            f"(group_size = d_inner/n_groups = {p.d_inner // p.n_groups}); transformers 5.17's MambaRMSNormGated "
            "normalises over the full d_inner, see hf_*_asis_*_vs_reference."
        )
    notes.append(
        "reference = HF 5.17 torch path in float64 with its internal float32 casts removed "
        "(scan, step dA, A=-exp(A_log), RMSNorms, residual), stored as f32; cross-checked against an "
        "independent token-by-token float64 recurrence (reference_vs_naive_f64_*)."
    )

    # sanity: the reference must agree with the independent implementation to float64 round-off,
    # and with its own decode path
    scale = float(ref_pre.abs().max())
    for k in (
        "reference_vs_naive_f64_prefill",
        "reference_vs_naive_f64_decode",
        "reference_vs_naive_f64_states",
        "reference_prefill_vs_reference_decode",
        "reference_prefill_vs_reference_continuation",
    ):
        if diffs[k] > 1e-9 * max(1.0, scale):
            raise RuntimeError(f"{p.name}: {k} = {diffs[k]:.3e} too large")

    # 5. training reference: loss and the gradient of every parameter, by autograd on the same float64 path
    #    (a separate model, so the finite-difference perturbations never touch ref_model)
    grad_model = build_hf_model(config, W, F64).to(device)
    RefPatches(grad_model, "precise", group_norm=group_norm, dt_limit_in_step=step_limit)
    loss, loss_logits, grads = hf_gradients(grad_model, dev_ids)
    if set(grads) != set(W):
        raise RuntimeError(f"{p.name}: parameters {sorted(grads)} != weights {sorted(W)}")
    nv_loss, nv_grads = naive_gradients(W64, p, ids)
    loss_f = float(loss)
    grad_checks = {
        "loss_logits_vs_reference_prefill": maxdiff(loss_logits, ref_pre),
        "loss_vs_loss_of_reference_logits_rel": abs(loss_f - float(next_token_loss(ref_pre, dev_ids))) / loss_f,
        "loss_vs_loss_of_stored_f32_logits_rel": abs(loss_f - float(next_token_loss(to_f32(ref_pre).to(F64), ids)))
        / loss_f,
        "loss_vs_naive_f64_rel": abs(loss_f - float(nv_loss)) / loss_f,
        "grads_vs_naive_f64_rel": max(
            maxdiff(grads[k], nv_grads[k]) / float(nv_grads[k].abs().max()) for k in grads
        ),
    }
    fd = finite_difference_check(grad_model, dev_ids, grads, seed=p.seed() ^ 0xF1D1)
    grad_checks["finite_difference_rel_max"] = max(r for _, _, r in fd.values())
    print(f"  loss {loss_f:.15f}")
    for k, v in grad_checks.items():
        print(f"  {k:48s} {v:.3e}")
    for k, (fdv, proj, rel) in fd.items():
        print(f"    fd {k:44s} {fdv:+.12e} <g,u> {proj:+.12e} rel {rel:.1e}")
    for k, limit in (
        ("loss_vs_loss_of_reference_logits_rel", 1e-12),
        ("loss_vs_naive_f64_rel", 1e-12),
        ("grads_vs_naive_f64_rel", 1e-9),
        ("finite_difference_rel_max", 1e-6),
    ):
        if not grad_checks[k] <= limit:
            raise RuntimeError(f"{p.name}: {k} = {grad_checks[k]:.3e} > {limit:.0e}")

    def grad_tensors(original: bool) -> dict:
        """`loss` (f64 []) and `grad.<key>` under the weight file's key names (original: backbone.embedding.*);
        a tied lm_head has no key of its own, its gradient is part of the embedding's."""
        t = {"loss": loss.to("cpu").reshape(())}
        for k, v in grads.items():
            key = k.replace("backbone.embeddings.", "backbone.embedding.") if original else k
            t["grad." + key] = v.to("cpu").contiguous()
        return t

    ref_tensors = {
        "input_ids": ids.contiguous(),
        "logits_prefill": to_f32(ref_pre),
        "logits_decode": to_f32(ref_dec),
    }
    for k, v in ref_states.items():
        ref_tensors[k] = to_f32(v)
    ref_tensors.update(extra_tensors)

    stats = {
        "logits_prefill_abs_max": scale,
        "logits_prefill_std": float(ref_pre.std()),
        "ssm_state_abs_max": max(float(ref_states[f"ssm_state.{i}"].abs().max()) for i in range(p.n_layer)),
    }
    for k, v in diffs.items():
        print(f"  {k:48s} {v:.3e}")
    print(f"  logits |max| {scale:.2f} std {stats['logits_prefill_std']:.2f}", flush=True)

    case_json = {
        "prefix_len": p.prefix_len,
        "reference": "mamba_ssm" if group_norm else "hf",
        "notes": " ".join(notes),
        "description": p.description,
        "seed": p.seed(),
        "params": p.params(),
        "conv_state_layout": "[B, conv_dim, d_conv]: the last d_conv pre-conv xBC inputs (channels x|B|C), "
        "oldest first, zero-padded on the left if L < d_conv (HF DynamicCache / mamba_ssm layout)",
        "ssm_state_layout": "[B, num_heads, head_dim, state_size]",
        "logits_decode_positions": f"{p.prefix_len}..{p.seq_len - 1} (prefill of tokens 0..{p.prefix_len - 1}, "
        "then one token at a time)",
        "reference_precision": "float64 (stored as f32)",
        "hf_asis_f64_model_ssm_cache_dtype": asis_f64_cache_dtype,
        "max_abs_diff": diffs,
        "stats": stats,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }

    results = []

    def emit(dirname, fmt, extra_json=None, weights_writer=None):
        out_dir = os.path.join(out_root, dirname)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.makedirs(out_dir)
        weights_writer(out_dir)
        save_file(ref_tensors, os.path.join(out_dir, "reference.safetensors"), metadata={"case": p.name})
        save_file(grad_tensors(fmt != "hf"), os.path.join(out_dir, "gradients.safetensors"), metadata={"case": p.name})
        cj = dict(case_json, format=fmt)
        if extra_json:
            cj.update(extra_json)
        write_json(os.path.join(out_dir, "case.json"), cj)
        results.append({"dir": dirname, "format": fmt, "case": p, "diffs": diffs})

    if p.mamba2_130m_dirs:
        hf130 = p.hf_config(rms_norm=True)
        emit(
            "mamba2-130m-original-bin",
            "original-bin",
            {"weights_note": "pytorch_model.bin = torch.save(state_dict) (zip format), original keys, lm_head.weight "
             "stored and sharing storage with backbone.embedding.weight as MambaLMHeadModel.state_dict() has it"},
            lambda d: save_original_dir(d, p, W, "bin", full_ssm_cfg=False),
        )
        emit(
            "mamba2-130m-original-safetensors",
            "original-safetensors",
            {"weights_note": "model.safetensors with original keys; the tied lm_head.weight is DROPPED "
             "(safetensors refuses shared tensors): lm_head = backbone.embedding.weight"},
            lambda d: save_original_dir(d, p, W, "safetensors", full_ssm_cfg=False),
        )
        emit(
            "mamba2-130m-hf",
            "hf",
            {"weights_note": "Mamba2Config.save_pretrained / model.safetensors with HF keys (lm_head dropped: tied)",
             "config_note": "config.json as save_pretrained writes it, except time_step_limit[1] is the bare "
             "`Infinity` of older transformers / hub checkpoints instead of 5.17's {\"__float__\": \"Infinity\"}"},
            lambda d: save_hf_dir(d, hf130, W, bare_infinity=True),
        )
    else:
        emit(p.name, "hf", None, lambda d: save_hf_dir(d, config, W))
        if p.original_dir:
            emit(
                p.original_dir,
                "original-safetensors",
                {"weights_note": "original state-spaces keys and config; embedding"
                 + ("" if p.tied else " and lm_head") + f" rows = {p.vocab_size} (vocab_size "
                 f"{p.ids_vocab} rounded up to pad_vocab_size_multiple 16)"},
                lambda d: save_original_dir(d, p, W, "safetensors", full_ssm_cfg=True),
            )
    # round-trip: every written weights dir must load back to exactly the same tensors
    for r in results:
        check_roundtrip(os.path.join(out_root, r["dir"]), W)
    return results


@torch.no_grad()
def dt_clamp_fraction(W64, p, ids) -> float:
    """Fraction of layer-0 softplus(dt + dt_bias) values outside time_step_limit."""
    x = _rms(W64["backbone.embeddings.weight"][ids], W64["backbone.layers.0.norm.weight"], p.eps)
    proj = x @ W64["backbone.layers.0.mixer.in_proj.weight"].T
    if "backbone.layers.0.mixer.in_proj.bias" in W64:
        proj = proj + W64["backbone.layers.0.mixer.in_proj.bias"]
    dt = F.softplus(proj[..., -p.num_heads :] + W64["backbone.layers.0.mixer.dt_bias"])
    lo, hi = p.time_step_limit
    return float(((dt < lo) | (dt > hi)).to(F64).mean())


def load_weights_dir(d: str) -> tuple[dict, dict]:
    """(config json, state dict) of an HF or original directory (safetensors, sharded or .bin)."""
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    sd = {}
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(d, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        files = []
    for fn in files:
        with safe_open(os.path.join(d, fn), "pt") as f:
            for k in f.keys():
                sd[k] = f.get_tensor(k)
    if not files:
        sd = torch.load(os.path.join(d, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    return cfg, sd


def check_roundtrip(d, W):
    cfg, sd = load_weights_dir(d)
    original = "d_model" in cfg
    for k, v in W.items():
        key = k.replace("backbone.embeddings.", "backbone.embedding.") if original else k
        if not torch.equal(sd[key], v):
            raise RuntimeError(f"{d}: {key} differs after save")
    if original:
        hf = hf_config_from_original(cfg)
        assert hf.vocab_size == W["backbone.embeddings.weight"].shape[0]


def fixtures_main(args):
    out_root = os.path.abspath(args.out or os.path.join(REPO_ROOT, "tests", "fixtures"))
    os.makedirs(out_root, exist_ok=True)
    torch.use_deterministic_algorithms(True, warn_only=True)
    # tiny tensors: more threads only add contention (depthwise conv1d gets ~100x slower on a busy box)
    torch.set_num_threads(args.threads or 1)
    all_results = []
    for p in CASES:
        if args.only and p.name not in args.only:
            continue
        all_results += generate_case(p, out_root, args.device)
    if not args.only:
        write_index(out_root, all_results)
        # drop fixture dirs of cases that no longer exist (only dirs this script wrote: they hold case.json)
        produced = {r["dir"] for r in all_results}
        for name in sorted(os.listdir(out_root)):
            path = os.path.join(out_root, name)
            if name not in produced and os.path.exists(os.path.join(path, "case.json")):
                print(f"removing stale fixture dir {path}")
                shutil.rmtree(path)
    total = 0
    for root, _, files in os.walk(out_root):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    print(f"wrote {len(all_results)} fixture dirs to {out_root}, {total / 1e6:.2f} MB")


def write_index(out_root, results):
    index = []
    for r in results:
        p = r["case"]
        index.append({"dir": r["dir"], "format": r["format"], **p.params(), "prefix_len": p.prefix_len})
    write_json(os.path.join(out_root, "index.json"), index)


# ----------------------------------------------------------------------------------------------------
# --weights mode
# ----------------------------------------------------------------------------------------------------


def weights_main(args):
    from tokenizers import Tokenizer

    dtype = {"float64": F64, "float32": torch.float32}[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg_json, sd = load_weights_dir(args.weights)
    if "d_model" in cfg_json:  # original state-spaces format
        config = hf_config_from_original(cfg_json)
        sd = {k.replace("backbone.embedding.", "backbone.embeddings."): v for k, v in sd.items()}
        if config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
    else:
        config = Mamba2Config.from_pretrained(args.weights)
    sd = {k: v.to(dtype) for k, v in sd.items()}
    with torch.device("meta"):
        model = Mamba2ForCausalLM(config)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.backbone.embeddings.weight
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    model = model.to(args.device).eval()
    # float64: HF's torch path without its float32 casts; float32: HF's torch path as shipped.
    # mamba_ssm semantics: per-group gated RMSNorm when n_groups > 1.
    group_norm = args.semantics == "mamba_ssm" and config.n_groups > 1
    RefPatches(model, "precise" if dtype == F64 else "hf_asis", group_norm=group_norm)

    tok_path = args.tokenizer or os.path.join(args.weights, "tokenizer.json")
    tokenizer = Tokenizer.from_file(tok_path)
    with open(args.prompts_file, encoding="utf-8") as f:
        prompts = [line.rstrip("\n") for line in f if line.strip()]
    tensors = {}
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt, add_special_tokens=not args.no_special_tokens).ids
        ids_t = torch.tensor([ids], dtype=torch.int64)
        logits, _ = hf_logits(model, ids_t.to(args.device))
        tensors[f"input_ids.{i}"] = ids_t
        tensors[f"logits.{i}"] = to_f32(logits)
        print(f"prompt {i}: {len(ids)} tokens, argmax last = {int(logits[0, -1].argmax())}", flush=True)
    meta = {
        "prompts": json.dumps(prompts, ensure_ascii=False),
        "dtype": args.dtype,
        "semantics": args.semantics,
        "n_groups": str(config.n_groups),
        "add_special_tokens": str(not args.no_special_tokens),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    save_file(tensors, args.out, metadata=meta)
    print(f"wrote {len(prompts)} prompts to {args.out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="fixture root (default tests/fixtures) or, with --weights, the output .safetensors")
    ap.add_argument("--only", nargs="*", help="fixture mode: only these case names (index not rewritten)")
    ap.add_argument("--device", default="cpu", help="torch device (default cpu)")
    ap.add_argument("--threads", type=int, help="torch CPU threads (fixture mode default 1, logits mode torch default)")
    ap.add_argument("--weights", help="logits mode: HF-format (or original-format) model directory")
    ap.add_argument("--prompts-file", help="logits mode: one prompt per line (empty lines skipped)")
    ap.add_argument("--tokenizer", help="logits mode: tokenizer.json (default DIR/tokenizer.json)")
    ap.add_argument("--no-special-tokens", action="store_true", help="logits mode: encode with add_special_tokens=False")
    ap.add_argument("--dtype", default="float64", choices=["float64", "float32"], help="logits mode compute dtype")
    ap.add_argument(
        "--semantics", default="mamba_ssm", choices=["mamba_ssm", "hf"],
        help="logits mode: gated-norm semantics for n_groups > 1 (identical when n_groups == 1)",
    )
    args = ap.parse_args()
    if transformers.__version__ != EXPECTED_TRANSFORMERS or not torch.__version__.startswith(EXPECTED_TORCH):
        print(
            f"warning: written for transformers {EXPECTED_TRANSFORMERS} / torch {EXPECTED_TORCH}, running "
            f"transformers {transformers.__version__} / torch {torch.__version__}",
            file=sys.stderr,
        )
    if args.weights:
        if not (args.prompts_file and args.out):
            ap.error("--weights needs --prompts-file and --out")
        weights_main(args)
    else:
        fixtures_main(args)


if __name__ == "__main__":
    main()
