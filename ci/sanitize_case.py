"""One call of each kernel path, small enough for compute-sanitizer: every
precision, both directions, an unaligned shape (scalar copies, scalar
LayerNorm) and an aligned one (cp.async, vectorized LayerNorm)."""
import torch

import trimul

for B, N, P, H in [(2, 37, 40, 24), (1, 33, 64, 32)]:
    for dtype, precision in [(torch.float32, "ieee"), (torch.float32, "tf32"), (torch.bfloat16, "default"),
                             (torch.float16, "default"), (torch.float32, "bf16")]:
        for direction in ("incoming", "outgoing"):
            m = trimul.TriangleMultiplication(P, H, direction=direction, gate_input="normalized",
                                              precision=precision).cuda()
            x = torch.randn(B, N, N, P, device="cuda", dtype=dtype)
            mask = torch.rand(B, N, N, device="cuda") > 0.3
            with torch.no_grad():
                out = m(x, mask)
            torch.cuda.synchronize()
            assert torch.isfinite(out).all()
print("sanitize cases done")
