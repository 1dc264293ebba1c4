"""One forward call at a model shape, for profilers (ncu):
    python3 ci/profile_case.py [N] [dtype] [precision]"""
import sys

import torch

import trimul

N = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
dtype = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.bfloat16
precision = sys.argv[3] if len(sys.argv) > 3 else "default"
m = trimul.TriangleMultiplication(128, 128, direction="outgoing", gate_input="normalized",
                                  precision=precision).cuda().to(dtype)
x = torch.randn(1, N, N, 128, device="cuda", dtype=dtype)
mask = torch.rand(1, N, N, device="cuda") > 0.1
with torch.no_grad():
    for _ in range(2):
        m(x, mask)
torch.cuda.synchronize()
print("profile case done")
