"""The fused backward's weight-gradient products, timed alone (benchmarks/NOTES.md, "The weight
gradients' products by slices of positions"):

    python3 benchmarks/weight_products.py [--sizes 768,1024] [--slices 16,32,64,128,256,512]

For each N and output width M (128: dy^T chat, dgp^T u; 512: dpre^T x), a^T b over R = N^2
positions (bf16 operands a [R, M], b [R, 128], fp32 result) as cuBLAS's one product (split-K) and
as a batched product over S slices of the positions with a sum over the slices (what
csrc/trimul.cpp's positions_product does from 2^19 positions, at S = 64). Prints each form's
median time (do_bench), the sum of its kernels' times (torch.profiler), the operands' bytes over
that, and its error against float64. Needs a CUDA GPU."""
import argparse
import sys

import torch

from trimul.bench import kernel_times, median_ms


def one_product(a, b):
    return torch.ops.aten.mm.dtype(a.t(), b, torch.float32)


def sliced_product(a, b, slices):
    R, M = a.shape
    parts = torch.ops.aten.bmm.dtype(a.view(slices, R // slices, M).transpose(1, 2),
                                     b.view(slices, R // slices, b.shape[1]), torch.float32)
    return parts.sum(0)


def time_forms(N, M, slice_counts):
    """Prints a line for each form of a^T b at (N, M)."""
    R = N * N
    a = torch.randn(R, M, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(R, 128, device="cuda", dtype=torch.bfloat16)
    exact = a.double().t() @ b.double()
    forms = [("one product", lambda: one_product(a, b))]
    forms += [(f"{S} slices", lambda S=S: sliced_product(a, b, S)) for S in slice_counts if R % S == 0]
    for name, fn in forms:
        out = fn()
        err = ((out.double() - exact).norm() / exact.norm()).item()
        repeatable = torch.equal(fn(), out)
        ms = median_ms(fn)
        kernels_ms = sum(kernel_times(fn, ()).values())
        tbs = R * (M + 128) * 2 / (kernels_ms * 1e-3) / 1e12
        print(f"N={N} M={M} {name:12s} do_bench {1e3 * ms:7.1f} us  kernels {1e3 * kernels_ms:7.1f} us "
              f"({tbs:.2f} TB/s)  error {err:.1e}  repeatable {repeatable}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="768,1024", help="N values, comma-separated")
    ap.add_argument("--slices", default="16,32,64,128,256,512", help="slice counts, comma-separated")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("weight_products.py: no CUDA GPU found; it times cuBLAS's products")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    torch.manual_seed(0)
    for N in (int(v) for v in args.sizes.split(",")):
        for M in (128, 512):
            time_forms(N, M, [int(v) for v in args.slices.split(",")])
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
