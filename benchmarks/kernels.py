"""trimul's and cuEquivariance's kernels side by side, one call at a time:

    python3 benchmarks/kernels.py [--forward 1024] [--step 768] [--rounds 2] [--json out.json]

For each forward size N (B = 1, P = H = 128, bf16, outgoing, gate from the normalized input, a
bool mask: trimul.bench's inputs) and each training-step size, both implementations in one
process, alternating over the rounds, each with do_bench's median and then every kernel one call
launches (torch.profiler over 5 calls): its time a call, its launches a call and its full name
(template instances apart, unlike trimul.bench's table), the heaviest first. The time a call runs
at depends on the clock the power cap leaves it (benchmarks/NOTES.md, "Power"), so the rounds
alternate the implementations and the table says which ran first. Needs a CUDA GPU and
cuequivariance_torch."""
import argparse
import json
import sys

import torch

from trimul.bench import implementations, kernel_launches, make_inputs, median_ms, training_step

NAME_CHARS = 160  # of a kernel's name in the table (the JSON keeps them whole)
CALLS = 5


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forward", type=int, nargs="*", default=[1024], metavar="N")
    ap.add_argument("--step", type=int, nargs="*", default=[768], metavar="N")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py: no CUDA GPU found; it times GPU implementations")
    impls = implementations("default")
    if "cuequivariance" not in impls:
        sys.exit("benchmarks/kernels.py: cuequivariance_torch is not installed; it times trimul beside it")
    names = ["trimul", "cuequivariance"]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16, B = 1, P = H = 128")
    results = []
    for mode, sizes in (("forward", args.forward), ("step", args.step)):
        grad = mode == "step"
        for N in sizes:
            inputs = make_inputs(1, N, 128, 128, "bfloat16", requires_grad=grad)
            for r in range(args.rounds):
                order = names if r % 2 == 0 else names[::-1]
                for name in order:
                    fn = training_step(impls[name]) if grad else impls[name]
                    with torch.set_grad_enabled(grad):
                        ms = median_ms(lambda: fn(*inputs))
                    kernels = {k: (1e3 * t, n) for k, (t, n) in kernel_launches(fn, inputs, CALLS, grad).items()}
                    total = sum(us for us, _ in kernels.values())
                    print(f"\n{mode} N={N}, round {r + 1} ({' then '.join(order)}): {name} do_bench {ms:.3f} ms, "
                          f"kernels {total:.1f} us a call")
                    for key, (us, launches) in kernels.items():
                        print(f"  {us:8.1f} us  x{launches:g}  {key[:NAME_CHARS]}")
                    results.append({"mode": mode, "N": N, "round": r + 1, "impl": name, "first": order[0],
                                    "do_bench_ms": ms, "kernels_us": total,
                                    "kernels": {k: {"us": us, "launches": n} for k, (us, n) in kernels.items()}})
            del inputs
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
