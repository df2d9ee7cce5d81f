"""HF transformers' own bf16 (and f32) Mamba2ForCausalLM against the f64 reference of every fixture.

The same measure as the Rust tests (max |logits − reference| / max |reference| over the prefill
logits), so the bf16 error the Rust model shows can be set against the error HF's model has when
it runs the same checkpoint in bf16. Cases with n_groups > 1 are listed too, but there HF normalises
the whole d_inner where the reference (mamba_ssm) normalises per group, so HF differs in any dtype.

    /opt/pyref/bin/python tools/hf_bf16_error.py
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import Mamba2ForCausalLM

ROOT = Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def main() -> None:
    for case in json.loads((ROOT / "index.json").read_text()):
        d = ROOT / case["dir"]
        if not (d / "config.json").exists() or "original" in case["dir"]:
            continue
        meta = json.loads((d / "case.json").read_text())
        ref = load_file(str(d / "reference.safetensors"))
        want = ref["logits_prefill"].double()
        errs = []
        for dtype in (torch.bfloat16, torch.float32):
            model = Mamba2ForCausalLM.from_pretrained(str(d), dtype=dtype).eval()
            with torch.no_grad():
                got = model(ref["input_ids"].long()).logits.double()
            errs.append(rel_err(got, want))
        groups = meta["params"].get("n_groups")
        print(f"{case['dir']}: n_groups {groups}, HF bf16 {errs[0]:.2e}, HF f32 {errs[1]:.2e}")


if __name__ == "__main__":
    main()
