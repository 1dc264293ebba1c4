"""Builds of trimul side by side on one GPU: each wheel installed into a folder of its own and
timed in a process of its own, the processes alternating round by round, so that the GPU's
clock history and a process's host speed fall on every build alike (on an H200 the same
kernels read up to ±10 % apart from one process or run order to the next: benchmarks/NOTES.md,
"Power").

    python3 benchmarks/ab.py OLD.whl NEW.whl [--rounds 2] [--n 256 512 1024] [--step 768]
                             [--dtype bfloat16] [--precision default] [--json out.json]

Per process: for each N of --n, the forward (trimul.TriangleMultiplication, outgoing, gate from
the normalized input, a bool mask keeping 90 %, B = 1, P = H = 128; no grad), and for each N of
--step one training step (the backward of (out * g).sum() into x and every parameter): each
kernel's mean time per call over 20 calls (torch.profiler), summed per stage, and do_bench's
median of the call. The table has a row per case and stage and a column per wheel and round,
then each wheel's mean over the rounds against the first wheel's.
"""
import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile

# Kernel name fragments -> stage, first match wins (InputBackParams before ln_proj_gate: the
# input stage's backward is a form of the same kernel template).
STAGES = (
    ("InputBackParams", "input_back"),
    ("pack_kernel", "pack"),
    ("range_", "range"),
    ("ln_out_proj_gate", "output stage"),
    ("ln_proj_gate", "input stage"),
    ("out_stage_back", "out_stage_back"),
    ("backward_rows", "row kernels"),
    ("out_back_weights", "parameters"),
    ("param_grads", "parameters"),
    ("nvjet", "products"),
    ("gemm", "products"),  # (triangle_gemm's too)
    ("Gemm", "products"),
    ("splitK", "products"),
)
REPS = 20


def stage_of(kernel: str) -> str:
    for fragment, stage in STAGES:
        if fragment in kernel:
            return stage
    return "other"


def child(args) -> None:
    """One process's measurements, as JSON lines on stdout."""
    import torch
    import trimul

    if not torch.cuda.is_available():
        sys.exit("benchmarks/ab.py: no CUDA GPU found")
    from torch.profiler import ProfilerActivity, profile

    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    dtype = getattr(torch, args.dtype)
    print(json.dumps({"trimul": os.path.dirname(trimul.__file__), "gpu": torch.cuda.get_device_name()}), flush=True)
    cases = [("forward", n) for n in args.n] + [("step", n) for n in args.step]
    for kind, N in cases:
        torch.manual_seed(0)
        m = trimul.TriangleMultiplication(128, 128, direction="outgoing", gate_input="normalized",
                                          precision=args.precision).to("cuda", dtype)
        x = torch.randn(1, N, N, 128, device="cuda", dtype=dtype, requires_grad=kind == "step")
        mask = torch.rand(1, N, N, device="cuda") > 0.1
        g = torch.randn(1, N, N, 128, device="cuda", dtype=dtype) if kind == "step" else None

        def call():
            if kind == "forward":
                with torch.no_grad():
                    m(x, mask)
                return
            m(x, mask).backward(g)
            for t in [x, *m.parameters()]:
                t.grad = None

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        ms = do_bench(call, warmup=25, rep=200, return_mode="median") if do_bench is not None else float("nan")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(REPS):
                call()
            torch.cuda.synchronize()
        stages = collections.defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                stages[stage_of(e.name)] += e.device_time / REPS
        print(json.dumps({"case": f"{kind} N={N}", "do_bench_ms": ms, "us": dict(stages)}), flush=True)


def install(wheel: str, root: str) -> str:
    target = os.path.join(root, os.path.basename(wheel).replace(".whl", ""))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", target,
                    wheel], check=True)
    return target


def run_child(site: str, args) -> list:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--dtype", args.dtype, "--precision",
           args.precision, "--n", *map(str, args.n), "--step", *map(str, args.step)]
    # from outside any source tree, so that `import trimul` finds the wheel's
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir(),
                          env=dict(os.environ, PYTHONPATH=site))
    if done.returncode != 0:
        sys.exit(f"benchmarks/ab.py: the process for {site} failed:\n{done.stderr[-4000:]}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines or not os.path.realpath(lines[0]["trimul"]).startswith(os.path.realpath(site)):
        sys.exit(f"benchmarks/ab.py: the process for {site} did not import trimul from it: {lines[:1]}")
    return lines


def value(result: dict, key: str) -> float:
    """One case's `key` in one process: do_bench's ms, the kernels' µs summed, or a stage's µs."""
    if key == "do_bench ms":
        return result["do_bench_ms"]
    if key == "kernels µs":
        return sum(result["us"].values())
    return result["us"].get(key, 0.0)


def table(names: list, runs: dict) -> str:
    """Markdown: a row per case and key (do_bench's ms, the kernels' µs, then each stage's), a column
    per wheel and round, then each wheel's mean over its rounds against the first wheel's.
    runs[name]: per round the process's lines (a header, then a result per case)."""
    cases = [r["case"] for r in runs[names[0]][0][1:]]
    head = ["case", "stage"] + [f"{n} #{i + 1}" for n in names for i in range(len(runs[n]))]
    head += [f"{n} / {names[0]}" for n in names[1:]]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c, case in enumerate(cases):
        stages = sorted({s for n in names for run in runs[n] for s in run[c + 1]["us"]})
        for key in ["do_bench ms", "kernels µs"] + stages:
            per_wheel = {n: [value(run[c + 1], key) for run in runs[n]] for n in names}
            cells = [case, key]
            for n in names:
                cells += [f"{v:.4f}" if key == "do_bench ms" else f"{v:.1f}" for v in per_wheel[n]]
            base = sum(per_wheel[names[0]]) / len(per_wheel[names[0]])
            for n in names[1:]:
                mean = sum(per_wheel[n]) / len(per_wheel[n])
                cells.append(f"{mean / base:.3f}" if base > 0 else "—")
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheels", nargs="*", help="trimul wheels, the first the baseline")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--n", type=int, nargs="*", default=[256, 512, 1024], help="forward sizes")
    ap.add_argument("--step", type=int, nargs="*", default=[], help="training-step sizes")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--precision", default="default")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if len(args.wheels) < 2:
        ap.error("give two wheels or more")
    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/ab.py: no CUDA GPU found")
    # (wheels of one version share a file name: each is named by its position and folder)
    names = [f"{i}:{os.path.basename(os.path.dirname(os.path.abspath(w)))}" for i, w in enumerate(args.wheels)]
    runs = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as root:
        sites = [install(w, os.path.join(root, str(i))) for i, w in enumerate(args.wheels)]
        for r in range(args.rounds):
            for name, site in zip(names, sites):
                print(f"round {r + 1}: {name}", file=sys.stderr, flush=True)
                runs[name].append(run_child(site, args))
    print(f"GPU: {runs[names[0]][0][0]['gpu']}; each wheel in its own process, alternating, {args.rounds} rounds")
    print(table(names, runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
