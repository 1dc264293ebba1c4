"""Smoke test of an installed trimul wheel: imports, reports, and runs the CPU
path (and the GPU path where there is a GPU) against the reference."""
import torch

import trimul
from trimul import info

print(f"trimul {trimul.__version__} on torch {torch.__version__}; CUDA kernels: {trimul.HAS_CUDA_KERNELS}")
devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
for device in devices:
    m = trimul.TriangleMultiplication(32, 16, direction="outgoing", gate_input="normalized").to(device)
    x = torch.randn(2, 19, 19, 32, device=device)
    mask = torch.rand(2, 19, 19, device=device) > 0.2
    with torch.no_grad():
        out = m(x, mask)
        ref = trimul.triangle_multiplication_reference(
            x, mask, *m.parameters_in_op_order(), direction="outgoing", gate_input="normalized", dtype=torch.float64)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 2e-3, f"{device}: rel. error {err}"
    print(f"{device}: rel. error {err:.2e}")
print("kernels for this machine:", info.archs.describe())
print("smoke test passed")
