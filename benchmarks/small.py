"""Small problems, where launches and host work set the time: trimul's single
launch (fused_small) against eager PyTorch, eager replayed as a CUDA graph,
torch.compile(mode="reduce-overhead") and cuEquivariance, side by side in one
process; then the crossover between fused_small and the tiled pipeline.

    python benchmarks/small.py [--json out.json] [--no-sweep]

Times are medians of triton's do_bench (CUDA events; a host-bound call is timed
by its host work). Convention of trimul.bench: outgoing, gate from the
normalized input, bool mask.
"""
import argparse
import json
import sys
import time

import torch

import trimul
from trimul.bench import implementations, make_inputs, median_ms, rel_err
from trimul.ops import kernel_override

SHAPES = [(2, 32, 64, 32), (1, 64, 128, 128), (4, 48, 64, 32)]
SWEEP_N = [16, 24, 32, 48, 64, 96, 128, 192]
SWEEP_PH = [(64, 32), (128, 128)]


def as_graph(fn):
    """fn captured in a CUDA graph (after warm-up on a side stream); returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def us(fn):
    return median_ms(fn) * 1e3


def graph_floor_us():
    """Replay time of a CUDA graph holding one tiny kernel: the floor of every "CUDA graph" row."""
    t = torch.zeros(1, device="cuda")
    return us(as_graph(lambda: t.add_(1)))


def seed_graph_floors_us():
    """Replay times of CUDA graphs holding 1, 2 or 3 dependent elementwise kernels over the seed's
    pair (2, 32, 32, 64) fp32, each reading the last one's result and writing one of x's size: what
    any graph must cost that reads x, writes out and has that many phases, whatever they compute.
    (The update has at least two: each product c[i, j] needs a and b at every k.)"""
    x = torch.randn(2, 32, 32, 64, device="cuda")
    bufs = [torch.empty_like(x) for _ in range(3)]

    def phases(n):
        def run():
            src = x
            for out in bufs[:n]:
                torch.mul(src, 1.5, out=out)
                src = out
        return run

    return {n: us(as_graph(phases(n))) for n in (1, 2, 3)}


def small_rows():
    rows = []
    for B, N, P, H in SHAPES:
        print(f"B={B} N={N} P={P} H={H}", file=sys.stderr, flush=True)
        torch.backends.cuda.matmul.allow_tf32 = False
        x, mask, p = make_inputs(B, N, P, H, "float32")
        ref = trimul.triangle_multiplication_reference(x, mask, *p, direction="outgoing", gate_input="normalized",
                                                       dtype=torch.float64)
        impls = implementations("ieee")
        row = {"B": B, "N": N, "P": P, "H": H, "us": {}, "rel_err": {}}
        with torch.no_grad():
            for prec in ("ieee", "tf32", "bf16"):
                op = lambda prec=prec: torch.ops.trimul.forward(x, mask, *p, "outgoing", "normalized", 1e-5, prec)
                row["rel_err"][f"trimul {prec}"] = rel_err(op(), ref)
                row["us"][f"trimul {prec}, CUDA graph"] = us(as_graph(op))
                row["us"][f"trimul {prec}, eager op"] = us(op)
            xb = x.to(torch.bfloat16)
            opb = lambda: torch.ops.trimul.forward(xb, mask, *p, "outgoing", "normalized", 1e-5, "default")
            row["us"]["trimul bf16 x, CUDA graph"] = us(as_graph(opb))
            with kernel_override("tiled"):
                row["us"]["trimul ieee tiled pipeline, CUDA graph"] = us(as_graph(
                    lambda: torch.ops.trimul.forward(x, mask, *p, "outgoing", "normalized", 1e-5, "ieee")))
        module = trimul.TriangleMultiplication(P, H, direction="outgoing", gate_input="normalized",
                                               precision="ieee").cuda()
        with torch.no_grad():
            for mine, theirs in zip(module.parameters_in_op_order(), p):
                if mine is not None:
                    mine.copy_(theirs)
        row["us"]["trimul module, eager, params requiring grad"] = us(lambda: module(x, mask))
        with torch.no_grad():
            row["us"]["trimul module, eager, no_grad"] = us(lambda: module(x, mask))
            row["us"]["eager"] = us(lambda: impls["eager"](x, mask, p))
            row["us"]["eager, CUDA graph"] = us(as_graph(lambda: impls["eager"](x, mask, p)))
            torch._dynamo.reset()
            ro = torch.compile(impls["eager"], mode="reduce-overhead")
            for _ in range(3):
                ro(x, mask, p)
            row["us"]["compile reduce-overhead"] = us(lambda: ro(x, mask, p))
            if "cuequivariance" in impls:
                try:
                    row["rel_err"]["cuequivariance"] = rel_err(impls["cuequivariance"](x, mask, p), ref)
                    row["us"]["cuequivariance"] = us(lambda: impls["cuequivariance"](x, mask, p))
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"  cuequivariance: {type(e).__name__}: {e}", file=sys.stderr)
        for k, v in row["us"].items():
            print(f"  {v:9.2f} us  {k}", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def sweep_rows():
    """Graph-replay time of both paths over N: where the dispatcher should switch."""
    rows = []
    with torch.no_grad():
        for (P, H), dtype, prec in [(ph, d, pr) for ph in SWEEP_PH
                                    for d, pr in (("float32", "ieee"), ("bfloat16", "default"))]:
            for N in SWEEP_N:
                x, mask, p = make_inputs(1, N, P, H, dtype)
                row = {"N": N, "P": P, "H": H, "dtype": dtype, "precision": prec}
                # fp32: the tensor-core stages (tiled) and the CUDA-core ones (tiled_fp32)
                paths = ("fused_small", "tiled", "tiled_fp32") if dtype == "float32" else ("fused_small", "tiled")
                for path in paths:
                    with kernel_override(path):
                        row[path] = us(as_graph(
                            lambda: torch.ops.trimul.forward(x, mask, *p, "outgoing", "normalized", 1e-5, prec)))
                row["auto"] = us(as_graph(
                    lambda: torch.ops.trimul.forward(x, mask, *p, "outgoing", "normalized", 1e-5, prec)))
                cuda_core = f", tiled_fp32 {row['tiled_fp32']:.1f} us" if "tiled_fp32" in row else ""
                print(f"  sweep P={P} H={H} {dtype} N={N}: fused {row['fused_small']:.1f} us, tiled {row['tiled']:.1f} us"
                      f"{cuda_core}, auto {row['auto']:.1f} us", file=sys.stderr, flush=True)
                rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "graph_floor_us": graph_floor_us(), "seed_graph_floors_us": seed_graph_floors_us(),
              "small": small_rows(),
              "sweep": [] if args.no_sweep else sweep_rows()}
    print(f"\nA CUDA graph holding one one-element add_: {result['graph_floor_us']:.2f} us per replay")
    print("A CUDA graph of 1, 2, 3 dependent elementwise kernels over the seed's pair: "
          + ", ".join(f"{v:.2f}" for v in result["seed_graph_floors_us"].values()) + " us per replay")
    for r in result["small"]:
        print(f"\n(B, N, P, H) = ({r['B']}, {r['N']}, {r['P']}, {r['H']}), microseconds per call:")
        for k, v in r["us"].items():
            print(f"| {k} | {v:.2f} |")
        print("rel. error vs float64: " + ", ".join(f"{k} {v:.2e}" for k, v in r["rel_err"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
