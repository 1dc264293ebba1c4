"""Forward calls at one shape, for profilers (ncu) and a quick timing:
    python3 ci/profile_case.py [B N P H] [dtype] [precision] [path]
path: auto (default), fused_small, tiled, tiled_sync, tiled_fp32. Prints the mean time per call of
back-to-back calls (CUDA events, warm L2) after the profiled ones."""
import contextlib
import sys

import torch

import trimul
from trimul.ops import kernel_override

args = sys.argv[1:]
B, N, P, H = (int(v) for v in args[:4]) if len(args) >= 4 else (1, 1024, 128, 128)
dtype = getattr(torch, args[4]) if len(args) > 4 else torch.bfloat16
precision = args[5] if len(args) > 5 else "default"
path = args[6] if len(args) > 6 else "auto"
m = trimul.TriangleMultiplication(P, H, direction="outgoing", gate_input="normalized",
                                  precision=precision).cuda().to(dtype)
x = torch.randn(B, N, N, P, device="cuda", dtype=dtype)
mask = torch.rand(B, N, N, device="cuda") > 0.1
with torch.no_grad(), (kernel_override(path) if path != "auto" else contextlib.nullcontext()):
    for _ in range(2):
        m(x, mask)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        m(x, mask)
    stop.record()
    stop.synchronize()
print(f"profile case done: {path} ({B}, {N}, {P}, {H}) {dtype} {precision}: "
      f"{start.elapsed_time(stop) / 50 * 1e3:.1f} us per call, back to back")
