"""Training steps at one shape, for profilers (ncu) and a kernel table:
    python3 ci/profile_step.py [B N P H] [dtype] [steps] [--table]
Each step is trimul.bench's training step (the module's forward, outgoing, gate from the normalized
input, a bool mask; the backward of (out * g).sum() into x and every parameter, gradients dropped
after it). `steps` steps run first (default 3: ncu's --launch-skip 2 --launch-count 1 then takes a
kernel of the third); --table then prints the median time of a step (trimul.bench.median_ms) and
each kernel's time a step (trimul.bench.kernel_times), the heaviest first. Runs on the CPU too (no
table there)."""
import json
import sys

import torch

import trimul
from trimul.bench import kernel_times, median_ms, training_step

args = [a for a in sys.argv[1:] if not a.startswith("--")]
B, N, P, H = (int(v) for v in args[:4]) if len(args) >= 4 else (1, 768, 128, 128)
dtype = getattr(torch, args[4]) if len(args) > 4 else torch.bfloat16
steps = int(args[5]) if len(args) > 5 else 3
device = "cuda" if torch.cuda.is_available() else "cpu"

torch.manual_seed(0)
m = trimul.TriangleMultiplication(P, H, direction="outgoing", gate_input="normalized").to(device, dtype)
x = torch.randn(B, N, N, P, device=device, dtype=dtype, requires_grad=True)
mask = torch.rand(B, N, N, device=device) > 0.1
step = training_step(lambda x, mask, p: m(x, mask))
inputs = (x, mask, list(m.parameters()))

for _ in range(steps):
    step(*inputs)
if device == "cuda":
    torch.cuda.synchronize()
    if "--table" in sys.argv:
        ms = median_ms(lambda: step(*inputs))
        kernels = kernel_times(step, inputs, grad=True)
        print(json.dumps({"shape": [B, N, P, H], "dtype": str(dtype), "median_ms": ms,
                          "kernels_us": 1e3 * sum(kernels.values())}))
        for name, kernel_ms in kernels.items():
            print(f"{1e3 * kernel_ms:9.1f}  {name}")
print(f"profile step done: ({B}, {N}, {P}, {H}) {dtype} on {device}, {steps} steps")
