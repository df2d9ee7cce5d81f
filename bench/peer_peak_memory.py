# Peak GPU memory of one forward + backward of mamba_ssm's Triton SSD (`mamba_chunk_scan_combined`,
# gradients of x, dt, A, B, C, D and the initial state), above its inputs: the figures `bench_ssd
# --cuda --backward` prints for ours as "peak MiB" (the memory pool's high mark during one call
# above the inputs). Two ways: y's gradient made before the call (as `bench_ssd`'s direct
# column) and made inside it as ones (as candle's `y.backward()` does for its autograd column).
# Same inputs as ../shared/bench/ssd_peers_bwd.py; one warm-up call first (Triton's autotuning),
# then the measured ones with the previous gradients freed.
#   MAMBA_SRC=DIR SHAPES="B,H,N,L;..." python3 bench/peer_peak_memory.py
import os, sys, types, torch, torch.nn.functional as F

src = os.path.join(os.environ["MAMBA_SRC"], "mamba_ssm")
pkg = types.ModuleType("mamba_ssm")
pkg.__path__ = [src]
sys.modules["mamba_ssm"] = pkg
from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

shapes = [tuple(map(int, s.split(","))) for s in os.environ.get(
    "SHAPES", "4,8,128,4096;4,8,128,16384;4,8,64,16384;4,8,256,16384").split(";")]
P, G, cs = 64, 1, 128
torch.manual_seed(0)
print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; P={P} G={G} chunk={cs} bf16")
print("| B, H, N, L | Triton fwd+bwd peak MiB, dy made before | dy made inside (ones) |")
print("|---|---|---|")
for b, h, n, l in shapes:
    mk = lambda *s, **k: torch.randn(*s, device="cuda", **k)
    x = mk(b, l, h, P, dtype=torch.bfloat16).requires_grad_()
    bm = mk(b, l, G, n, dtype=torch.bfloat16).requires_grad_()
    cm = mk(b, l, G, n, dtype=torch.bfloat16).requires_grad_()
    dt = F.softplus(mk(b, l, h) * 0.5 - 3.0).detach().requires_grad_()
    a = (-torch.empty(h, device="cuda").uniform_(1, 16)).requires_grad_()
    d = mk(h).requires_grad_()
    h0 = torch.zeros(b, h, P, n, device="cuda").requires_grad_()
    gy = mk(b, l, h, P, dtype=torch.bfloat16)
    inputs = [x, bm, cm, dt, a, d, h0]

    def call(inside):
        y = mamba_chunk_scan_combined(x, dt, a, bm, cm, cs, D=d, initial_states=h0)
        torch.autograd.backward(y, torch.ones_like(y) if inside else gy)

    def peak(inside):
        for t in inputs:
            t.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        call(inside)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    call(False)
    before, inside = peak(False), peak(True)
    print(f"| {b}, {h}, {n}, {l} | {before:.0f} | {inside:.0f} |", flush=True)
    del x, bm, cm, gy, inputs
    torch.cuda.empty_cache()
