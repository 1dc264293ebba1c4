"""One call of each kernel path, small enough for compute-sanitizer: the single
launch and the tiled pipeline, every precision, both directions, an unaligned
shape (scalar copies, scalar LayerNorm), an aligned one (cp.async,
vectorized LayerNorm) and one whose input weights take two chunks of the tensor-core stage;
"tiled" also runs the resident stages with the statistics the input stage hands the output
stage (16-bit x and parameters, P = H = 128 and a ragged P = H = 120), tf32 on the fp16 stages, and
fp16 operands under c's headroom (range_headroom with and without the mask's blocks);
"backward" runs forward
and backward (the backward's pair_layout, backward_rows, input_back and out_stage_back kernels, at
P = 128 with either gate input; the last at 16-bit operands with P and H multiples of 16, x in the
operand type and in fp32; at P = 128, H = 120 input_back finishing the stage-by-stage sequence, with
centered_rows; at tf32 with P = H = 128, the contraction's gradients on fp16 operands:
range_grad_amax and pair_layout's fp16 form; at fp16 under c's headroom, fused (P = H = 128) and
stage by stage (P = 48, H = 24)).
fused_small's shapes take both of its forms (two phases, three phases) and groups of weight tiles per
phase-1 item.
    python3 ci/sanitize_case.py [fused_small] [tiled] [backward]    (default: all three)"""
import itertools
import sys

import torch

import trimul
from trimul.ops import kernel_override

paths = sys.argv[1:] or ["fused_small", "tiled", "backward"]
if "backward" in paths:
    paths.remove("backward")
    for (B, N, P, H), (dtype, precision), direction in itertools.product(
            [(2, 37, 40, 24), (1, 70, 64, 32), (1, 70, 128, 128), (1, 70, 128, 120)],
            [(torch.float32, "ieee"), (torch.float32, "tf32"), (torch.bfloat16, "default"), (torch.float32, "bf16")],
            ("incoming", "outgoing")):
        # both gates where out_stage_back's resident form (one kernel per gate) may take the call
        for gate_input in ("input", "normalized") if P == 128 else ("input",):
            m = trimul.TriangleMultiplication(P, H, direction=direction, gate_input=gate_input,
                                              precision=precision).cuda()
            x = torch.randn(B, N, N, P, device="cuda", dtype=dtype, requires_grad=True)
            mask = torch.rand(B, N, N, device="cuda") > 0.3
            m(x, mask).square().sum().backward()
            torch.cuda.synchronize()
            assert torch.isfinite(x.grad).all() and all(torch.isfinite(q.grad).all() for q in m.parameters())
    # fp16 under c's headroom (the projections' biases +40: t > 0): the fused backward at P = H = 128,
    # the stage-by-stage one at P = 48, H = 24 (range_headroom's scale as a value)
    for P, H in [(128, 128), (48, 24)]:
        m = trimul.TriangleMultiplication(P, H, direction="outgoing").cuda().half()
        with torch.no_grad():
            m.proj_a.bias += 40.0
            m.proj_b.bias += 40.0
        x = torch.randn(1, 70, 70, P, device="cuda", dtype=torch.float16, requires_grad=True)
        m(x, torch.rand(1, 70, 70, device="cuda") > 0.3).float().sum().backward()
        torch.cuda.synchronize()
        assert torch.isfinite(x.grad).all() and all(torch.isfinite(q.grad).all() for q in m.parameters())
for path, (B, N, P, H) in itertools.product(paths, [(2, 37, 40, 24), (1, 33, 64, 32), (1, 24, 64, 64)]):
    for dtype, precision in [(torch.float32, "ieee"), (torch.float32, "tf32"), (torch.bfloat16, "default"),
                             (torch.float16, "default"), (torch.float32, "bf16")]:
        for direction in ("incoming", "outgoing"):
            m = trimul.TriangleMultiplication(P, H, direction=direction, gate_input="normalized",
                                              precision=precision).cuda()
            x = torch.randn(B, N, N, P, device="cuda", dtype=dtype)
            mask = torch.rand(B, N, N, device="cuda") > 0.3
            with torch.no_grad(), kernel_override(path):
                out = m(x, mask)
            torch.cuda.synchronize()
            assert torch.isfinite(out).all()
if "fused_small" in paths:
    # a phase-1 item whose group of weight tiles holds a/b and gate tiles, the gate reading x itself
    # (gate tiles first, then LayerNorm in place); three phases (H > 32); P = 36 with three weight
    # tiles an item, whose products read k up to 40, past the 36 columns staged
    for (B, N, P, H), direction in itertools.product([(1, 48, 64, 48), (1, 64, 36, 60)], ("incoming", "outgoing")):
        m = trimul.TriangleMultiplication(P, H, direction=direction, gate_input="input", precision="ieee").cuda()
        x = torch.randn(B, N, N, P, device="cuda")
        with torch.no_grad(), kernel_override("fused_small"):
            out = m(x, torch.rand(B, N, N, device="cuda") > 0.3)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
if "tiled" in paths:
    for (B, N, P, H), dtype, direction, gate in itertools.product(
            [(1, 70, 128, 128), (2, 45, 120, 120)], (torch.bfloat16, torch.float16), ("incoming", "outgoing"),
            ("input", "normalized")):
        m = trimul.TriangleMultiplication(P, H, direction=direction, gate_input=gate).cuda().to(dtype)
        x = torch.randn(B, N, N, P, device="cuda", dtype=dtype)
        with torch.no_grad():
            out = m(x, torch.rand(B, N, N, device="cuda") > 0.3)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
    # fp32 x at tf32, by the dispatcher's own choice: on an H100/H200 the fp16 stages under
    # power-of-two scales (range_bounds, range_normalize and the resident stages' tf32 forms), a
    # mask of 0 and 3, the gate from the normalized input or from x
    for (B, N, P, H), direction, gate in [((1, 70, 128, 128), "incoming", "normalized"),
                                          ((1, 70, 128, 128), "outgoing", "input"),
                                          ((2, 75, 120, 128), "outgoing", "normalized")]:
        m = trimul.TriangleMultiplication(P, H, direction=direction, gate_input=gate, precision="tf32").cuda()
        x = torch.randn(B, N, N, P, device="cuda")
        with torch.no_grad():
            out = m(x, (torch.rand(B, N, N, device="cuda") > 0.3).float() * 3)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
    # fp16 operands with c past fp16's range (the projections' biases +40): c's headroom, a float mask
    # (range_headroom's mask blocks) or none, at P = H = 128 (the resident stages) and P = 64, H = 32
    # (the output stage's mma.sync form)
    for (B, N, P, H), direction, with_mask in [((1, 160, 128, 128), "outgoing", True),
                                               ((2, 96, 64, 32), "incoming", False)]:
        m = trimul.TriangleMultiplication(P, H, direction=direction).cuda().half()
        with torch.no_grad():
            m.proj_a.bias += 40.0
            m.proj_b.bias += 40.0
            x = torch.randn(B, N, N, P, device="cuda", dtype=torch.float16)
            mask = (torch.rand(B, N, N, device="cuda") > 0.3).half() * 2 if with_mask else None
            out = m(x, mask)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
print("sanitize cases done")
