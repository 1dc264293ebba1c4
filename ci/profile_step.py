"""Training steps at one shape, for profilers (ncu) and a kernel table:
    python3 ci/profile_step.py [B N P H] [dtype] [steps] [--table]
Each step is the module's forward (outgoing, gate from the normalized input, a bool mask) and the
backward of (out * g).sum() into x and every parameter, gradients dropped after it. `steps` steps
run first (default 3: ncu's --launch-skip 2 --launch-count 1 then takes a kernel of the third);
--table then prints do_bench's median of a step and each kernel's time a step (torch.profiler,
mean of 5 steps), the heaviest first. Runs on the CPU too (no table there)."""
import collections
import json
import sys

import torch

import trimul

args = [a for a in sys.argv[1:] if not a.startswith("--")]
B, N, P, H = (int(v) for v in args[:4]) if len(args) >= 4 else (1, 768, 128, 128)
dtype = getattr(torch, args[4]) if len(args) > 4 else torch.bfloat16
steps = int(args[5]) if len(args) > 5 else 3
device = "cuda" if torch.cuda.is_available() else "cpu"

torch.manual_seed(0)
m = trimul.TriangleMultiplication(P, H, direction="outgoing", gate_input="normalized").to(device, dtype)
x = torch.randn(B, N, N, P, device=device, dtype=dtype, requires_grad=True)
mask = torch.rand(B, N, N, device=device) > 0.1
g = torch.randn(B, N, N, P, device=device, dtype=dtype)


def step():
    m(x, mask).backward(g)
    x.grad = None
    for q in m.parameters():
        q.grad = None


for _ in range(steps):
    step()
if device == "cuda":
    torch.cuda.synchronize()
    if "--table" in sys.argv:
        import triton.testing
        from torch.profiler import ProfilerActivity, profile

        ms = triton.testing.do_bench(step, warmup=25, rep=200)
        reps = 5
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                step()
            torch.cuda.synchronize()
        kernels = collections.defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name] += e.device_time / reps
        print(json.dumps({"shape": [B, N, P, H], "dtype": str(dtype), "do_bench_ms": ms,
                          "kernels_us": sum(kernels.values())}))
        for name, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
            print(f"{us:9.1f}  {name[:100]}")
print(f"profile step done: ({B}, {N}, {P}, {H}) {dtype} on {device}, {steps} steps")
