"""One call of each kernel path, small enough for compute-sanitizer."""
import torch

import trimul

for dtype, precision in [(torch.float32, "ieee"), (torch.float32, "tf32"), (torch.bfloat16, "default"),
                         (torch.float16, "default")]:
    for direction in ("incoming", "outgoing"):
        m = trimul.TriangleMultiplication(40, 24, direction=direction, precision=precision).cuda().to(dtype)
        x = torch.randn(2, 37, 37, 40, device="cuda", dtype=dtype)
        mask = torch.rand(2, 37, 37, device="cuda") > 0.3
        with torch.no_grad():
            out = m(x, mask)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
print("sanitize cases done")
