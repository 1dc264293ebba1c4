"""The seed's job: its Model shape (batch 2, N=32, P=64, H=32, fp32) through
trimul next to the plain PyTorch module with the same weights, on the GPU when
there is one, else on the CPU. Prints the agreement of both results and their times.

    python -m trimul.demo [--batch 2] [--n 32] [--pair-dim 64] [--hidden-dim 32] [--device cuda|cpu]
"""
import argparse
import statistics
import time

import torch
from torch import nn

from .modules import TriangleMultiplication


class SeedModel(nn.Module):
    """The plain PyTorch module of the seed (incoming, gate from the raw input)."""

    def __init__(self, pair_dim, hidden_dim):
        super().__init__()
        self.layer_norm_in = nn.LayerNorm(pair_dim)
        self.proj_a = nn.Linear(pair_dim, hidden_dim)
        self.gate_a = nn.Linear(pair_dim, hidden_dim)
        self.proj_b = nn.Linear(pair_dim, hidden_dim)
        self.gate_b = nn.Linear(pair_dim, hidden_dim)
        self.layer_norm_out = nn.LayerNorm(hidden_dim)
        self.out_proj = nn.Linear(hidden_dim, pair_dim)
        self.out_gate = nn.Linear(pair_dim, pair_dim)

    def forward(self, pair_repr, pair_mask):
        x = self.layer_norm_in(pair_repr)
        a = self.proj_a(x) * torch.sigmoid(self.gate_a(x)) * pair_mask.unsqueeze(-1)
        b = self.proj_b(x) * torch.sigmoid(self.gate_b(x)) * pair_mask.unsqueeze(-1)
        c = torch.einsum("bkih,bkjh->bijh", a, b)
        return self.out_proj(self.layer_norm_out(c)) * torch.sigmoid(self.out_gate(pair_repr))


def median_ms(fn, device, reps=50):
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--pair-dim", type=int, default=64)
    ap.add_argument("--hidden-dim", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    seed = SeedModel(args.pair_dim, args.hidden_dim).to(device)
    ours = TriangleMultiplication(args.pair_dim, args.hidden_dim).to(device)
    ours.load_state_dict(seed.state_dict())
    x = torch.randn(args.batch, args.n, args.n, args.pair_dim, device=device)
    mask = (torch.rand(args.batch, args.n, args.n, device=device) > 0.1).float()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"seed shape: batch {args.batch}, N={args.n}, P={args.pair_dim}, H={args.hidden_dim}, float32, on {name}")
    with torch.no_grad():
        ref = seed.double()(x.double(), mask.double())
        seed.float()
        out_seed, out_ours = seed(x, mask), ours(x, mask)
        for label, out in (("PyTorch module", out_seed), ("trimul", out_ours)):
            err = ((out.double() - ref).norm() / ref.norm()).item()
            print(f"  {label:15s} rel. error vs float64: {err:.2e}")
        print(f"  max |trimul - PyTorch| = {(out_ours - out_seed).abs().max().item():.2e}")
        t_seed = median_ms(lambda: seed(x, mask), device)
        t_ours = median_ms(lambda: ours(x, mask), device)
    print(f"  time per call (median): PyTorch module {t_seed:.3f} ms, trimul {t_ours:.3f} ms "
          f"({t_seed / t_ours:.1f}x)")


if __name__ == "__main__":
    main()
