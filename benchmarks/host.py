"""Host time of trimul's calls, where issuing the work is what a small problem
costs: per call, the forward through the op without and with autograd, through
trimul.ops.call (the module's path) with autograd, and a whole training step
(forward, then backward into x and every parameter) through each; issue time
over a loop of calls, then with a synchronize at the end. A one-element add_ is
the scale. Optionally a cProfile of the op's training step.

    python benchmarks/host.py [--device cuda|cpu] [--reps 40] [--profile]

The benchmark convention of trimul.bench: outgoing, gate from the normalized
input, bool mask. The host of a shared machine drifts between processes: compare
builds by alternating them, more than once.
"""
import argparse
import cProfile
import pstats
import time

import torch

import trimul
from trimul.bench import make_inputs

SHAPES = [(2, 32, 64, 32, "float32", "ieee"), (1, 256, 128, 128, "bfloat16", "default")]


def host_us(fn, reps, sync):
    """(µs per call issued, µs per call including a synchronize at the end) over `reps` calls."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return 1e6 * (t1 - t0) / reps, 1e6 * (t2 - t0) / reps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of 20 training steps")
    args = ap.parse_args()
    dev = args.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    print(f"trimul {trimul.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if dev == 'cuda' else 'CPU'}; µs per call")
    for B, N, P, H, dtype, precision in SHAPES:
        x, mask, p = make_inputs(B, N, P, H, dtype, requires_grad=True, device=dev)
        g = torch.randn_like(x)
        args_op = (x, mask, *p, "outgoing", "normalized", 1e-5, precision)

        def op():
            return torch.ops.trimul.forward(*args_op)

        def module_path():
            return trimul.ops.call(x, mask, p, "outgoing", "normalized", 1e-5, precision)

        def op_no_grad():
            with torch.no_grad():
                op()

        cases = [("op, no grad", op_no_grad), ("op, grad", op), ("module path, grad", module_path),
                 ("step through the op", lambda: op().backward(g)),
                 ("step through the module path", lambda: module_path().backward(g)),
                 ("one-element add_", lambda: torch.empty(1, device=dev).add_(1))]
        for label, fn in cases:
            issued, total = host_us(fn, args.reps, sync)
            print(f"{(B, N, P, H)} {dtype} {precision:8s} {label:30s} issued {issued:8.1f}, with sync {total:8.1f}")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(20):
                op().backward(g)
            sync()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
