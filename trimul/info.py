"""What this installation of trimul can do here.

    python -m trimul.info [--shape B N P H] [--dtype bfloat16] [--precision default]

Prints the trimul and torch versions, the architectures compiled in, the GPU
found and whether a kernel for it is present, and, for a shape, which kernels
the dispatcher takes.
"""
import argparse

import torch

import trimul

from . import archs, ops
from ._codes import DTYPE_CODE, PATH_OF_CODE, PRECISION_CODE


def _product16(B, N, H, operand, device) -> str:
    """The 16-bit forward product on planes past trimul's own GEMM's size, in words."""
    from . import _C

    bmm = f"the contraction through torch's bmm (cuBLAS, {operand})"
    pick = _C.blas_lt_pick(device, B * H, N, operand == "fp16")
    if pick is None:
        return bmm
    picked, rank, candidates, differed = pick
    if not picked:
        return (f"{bmm} or cuBLASLt, whichever is timed faster at the size's first call and gives bmm's bits "
                "(torch's bmm under a stream capture before it)")
    if candidates == 0:
        return f"{bmm}: cuBLASLt offered no candidate without workspace and split k"
    others = (f"; {differed} faster candidate{'s' if differed > 1 else ''} gave other bits" if differed else "")
    if rank < 0:
        if differed:
            return f"{bmm}: none of cuBLASLt's {candidates} candidates was both faster and bit for bit the same{others}"
        return f"{bmm}: timed faster than cuBLASLt's {candidates} candidates"
    return (f"the contraction through cuBLASLt ({operand}; candidate {rank} of the {candidates} timed, "
            f"faster than torch's bmm and bit for bit its result{others})")


def kernel_path(B, N, P, H, dtype, precision, device=0) -> str:
    """The kernels a CUDA forward with these arguments runs (x contiguous, no backward to follow),
    in words."""
    if dtype == torch.float64:
        return "float64: the reference formula in PyTorch on the GPU (no float64 kernels)"
    resolved = ops.resolve_precision(dtype, precision)
    code = PRECISION_CODE[resolved]
    path_code, wgmma, resident, out_resident = torch.ops.trimul._plan(B, N, P, H, code, DTYPE_CODE[dtype], device)
    path = PATH_OF_CODE[path_code]
    if ops.reference_runs(B, N, P, H, dtype, resolved, device):
        if resolved == "ieee":
            return (f"precision ieee at P = {P}, H = {H}: the reference formula in PyTorch, float64 on the GPU "
                    "(float32's rounding puts a LayerNorm over so few channels past the bound now and then)")
        return (f"precision {resolved} at H = {H}: the reference formula in PyTorch, float32 on the GPU "
                "(rounded operands put a LayerNorm over so few channels past the bound)")
    if path == "fused_small":
        return (f"precision {resolved}: fused_small (the whole update in one cooperative launch, "
                "fp32 CUDA cores, ieee accuracy)")
    from . import _C

    if resolved == "tf32" and dtype == torch.float32 and P % 4 == 0 and _C.tf32_on_fp16(B, N, P, H, device):
        return ("precision tf32 on the fp16 stages: range_bounds, range_normalize (x normalized into fp16), "
                "pack_params, ln_proj_gate (tensor-core stages (wgmma, resident weights, fp16 operands under "
                "power-of-two scales)), " + ("triangle_gemm (CUTLASS sm80 tensor cores, fp16: small planes)"
                                              if _C.own_contraction(B * H, N, PRECISION_CODE["fp16"], False) else
                                              _product16(B, N, H, "fp16", device)) +
                ", ln_out_proj_gate (tensor-core stages (wgmma, resident weights, fp16 operands), fp32 output)")
    operands = {"ieee": "fp32 operands as tf32 pairs, 3xTF32", "tf32": "tf32 operands",
                "bf16": "bf16 operands", "fp16": "fp16 operands"}[resolved]
    if path != "tiled":
        stages = out_stages = "fp32 CUDA-core stages"
    else:
        form = "wgmma, resident weights" if resident else "wgmma" if wgmma else "mma.sync"
        stages = f"tensor-core stages ({form}, {operands})"
        out_stages = f"tensor-core stages ({'wgmma, resident weights' if out_resident else 'mma.sync'}, {operands})"
    own = _C.own_contraction(B * H, N, code, ops.matmul_tf32())
    gemm = {"ieee": "triangle_gemm (CUTLASS sm80 tensor cores, 3xTF32)",
            "tf32": ("triangle_gemm (CUTLASS sm80 tensor cores, TF32)" if own else
                     "the contraction through torch's bmm (cuBLAS, TF32: torch's TF32 setting)"),
            "bf16": "triangle_gemm (CUTLASS sm80 tensor cores, bf16: small planes)" if own else
                    _product16(B, N, H, "bf16", device),
            "fp16": "triangle_gemm (CUTLASS sm80 tensor cores, fp16: small planes)" if own else
                    _product16(B, N, H, "fp16", device)}[resolved]
    return f"precision {resolved}: pack_params, ln_proj_gate ({stages}), {gemm}, ln_out_proj_gate ({out_stages})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=4, metavar=("B", "N", "P", "H"))
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16", "float64"])
    ap.add_argument("--precision", default="default", choices=list(ops.PRECISIONS))
    args = ap.parse_args()
    print(f"trimul {trimul.__version__} ({trimul.__file__})")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"compiled: {archs.describe()}"
          f"{f' with CUDA {archs.CUDA_VERSION}' if archs.CUDA_VERSION else ''}; "
          f"CUDA kernels loaded: {trimul.HAS_CUDA_KERNELS}")
    mismatch = archs.cuda_mismatch(torch.version.cuda)
    if mismatch:
        print(f"note: {mismatch}")
    if torch.version.cuda is None:
        print("this torch is built without CUDA: CPU inputs run the CPU path (the reference formula)")
        return
    if not torch.cuda.is_available():
        print("GPU: none found; CPU inputs run the CPU path (the reference formula)")
        return
    for i in range(torch.cuda.device_count()):
        cc = torch.cuda.get_device_capability(i)
        ok = archs.has_kernel_for(cc)
        state = {True: "kernel present", False: "NO kernel for it in this build", None: "unknown"}[ok]
        print(f"GPU {i}: {torch.cuda.get_device_name(i)}, compute capability {cc[0]}.{cc[1]}: {state}")
    if args.shape:
        B, N, P, H = args.shape
        if not trimul.HAS_CUDA_KERNELS:
            print("dispatch: no CUDA kernels in this installation")
            return
        print(f"dispatch for (B={B}, N={N}, P={P}, H={H}) {args.dtype}: "
              f"{kernel_path(B, N, P, H, getattr(torch, args.dtype), args.precision)}")


if __name__ == "__main__":
    main()
