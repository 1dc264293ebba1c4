"""Forward (or forward+backward) time and peak extra memory of trimul next to
eager PyTorch, torch.compile and NVIDIA cuEquivariance (whichever is
installed), side by side in one process on one GPU. Prints progress and a
table, writes JSON and a PNG plot of time and memory against N.

    python -m trimul.bench [--shapes default|quick|model|training|power] [--backward] [--json out.json]
                           [--plot out.png] [--profile] [--gpu-time] [--sustained [SECONDS]]

--backward times one training step: the forward, then the backward of
(out * g).sum() into x and every parameter. --gpu-time adds each implementation's
GPU time (the sum of a call's kernel times), a second table: where it is well
below the do_bench figure, the host holds that implementation back.
--sustained adds a table of each implementation over SECONDS (default 2) of calls
back to back, each after the same L2 flush as do_bench's: time and energy per call
(NVML's energy counter), both net of the flushes. From N ~ 512 on an H200 such a
run sits at the GPU's power limit, where a call's time follows its energy.
"""
import argparse
import ctypes
import json
import math
import sys
import time

import torch

import trimul
from trimul.reference import triangle_multiplication_reference

# (B, N, P, H, x dtype, precision for trimul and cuEquivariance)
SHAPES = {
    "default": [
        (2, 32, 64, 32, "float32", "ieee"),
        (1, 256, 128, 128, "bfloat16", "default"),
        (1, 512, 128, 128, "bfloat16", "default"),
        (1, 1024, 128, 128, "bfloat16", "default"),
        (1, 2048, 128, 128, "bfloat16", "default"),
        (1, 1024, 128, 128, "float32", "tf32"),
        (1, 1024, 128, 128, "float32", "ieee"),
    ],
    "quick": [(2, 32, 64, 32, "float32", "ieee"), (1, 256, 128, 128, "bfloat16", "default")],
    "model": [(1, 1024, 128, 128, "bfloat16", "default"), (1, 1024, 128, 128, "float32", "tf32")],
    "fp32": [(1, 512, 128, 128, "float32", "tf32"), (1, 1024, 128, 128, "float32", "tf32"),
             (1, 512, 128, 128, "float32", "ieee"), (1, 1024, 128, 128, "float32", "ieee")],
    # the sizes where a sustained run reaches an H200's power limit (run with --sustained)
    "power": [(1, N, 128, 128, "bfloat16", "default") for N in (512, 768, 1024, 2048)],
    # the training issue's shapes (run with --backward)
    "training": [
        (2, 32, 64, 32, "float32", "ieee"),
        (1, 256, 128, 128, "bfloat16", "default"),
        (1, 768, 128, 128, "bfloat16", "default"),
        (1, 768, 128, 128, "float32", "tf32"),
        (1, 1536, 128, 128, "bfloat16", "default"),
    ],
}
MATMUL_TFLOPS = {"bfloat16": 679.0, "float16": 679.0, "tf32": 350.0, "ieee": 51.0}  # measured, GPU.md
COPY_TBPS = 4.27
COMPILE_MAX_N = 1024


def floor_ms(B, N, P, H, dtype, precision):
    flops = 2 * B * N * N * P * 4 * H + 2 * B * N ** 3 * H + 2 * B * N * N * H * P + 2 * B * N * N * P * P
    elt = torch.finfo(getattr(torch, dtype)).bits // 8
    nbytes = B * N * N * (2 * P * elt + 1)
    rate = MATMUL_TFLOPS["tf32" if precision == "tf32" else "ieee"] if dtype == "float32" else MATMUL_TFLOPS[dtype]
    return max(flops / rate / 1e9, nbytes / COPY_TBPS / 1e9)


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| against a float64 reference."""
    return ((out.double() - ref).norm() / ref.norm()).item()


def make_inputs(B, N, P, H, dtype, seed=0, requires_grad=False, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    dt = getattr(torch, dtype)
    x = torch.randn(B, N, N, P, device=device, dtype=dt, generator=g).requires_grad_(requires_grad)
    mask = torch.rand(B, N, N, device=device, generator=g) > 0.1
    m = trimul.TriangleMultiplication(P, H, direction="outgoing", gate_input="normalized").to(device, dt)
    return x, mask, [None if t is None else t.detach().requires_grad_(requires_grad)
                     for t in m.parameters_in_op_order()]


def implementations(precision):
    impls = {}

    def ours(x, mask, p):
        return torch.ops.trimul.forward(x, mask, *p, "outgoing", "normalized", 1e-5, precision)

    def eager(x, mask, p):
        return triangle_multiplication_reference(x, mask, *p, direction="outgoing", gate_input="normalized",
                                                 dtype=x.dtype)

    impls["trimul"] = ours
    impls["eager"] = eager
    impls["compile"] = torch.compile(eager, dynamic=False)
    try:
        from cuequivariance_torch import triangle_multiplicative_update as cueq
    except Exception:  # not installed
        cueq = None
    if cueq is not None:
        cueq_precision = "IEEE" if precision == "ieee" else None
        packed = {}  # its packed (2H, P) input weights and mask dtype, prepared once per input set

        def cueq_fn(x, mask, p):
            key = (id(x), id(mask), id(p))
            if key not in packed:  # its own parameters: leaves, with grads where ours have them
                def cat(a, b):
                    return None if a is None else torch.cat([a, b]).detach().requires_grad_(a.requires_grad)

                packed.clear()
                packed[key] = (mask.to(x.dtype), cat(p[2], p[6]), cat(p[3], p[7]), cat(p[4], p[8]),
                               cat(p[5], p[9]))
            m, piw, pib, giw, gib = packed[key]
            return cueq(x, "outgoing", m, p[0], p[1], piw, pib, giw, gib, p[10], p[11], p[12], p[13], p[14], p[15],
                        precision=cueq_precision)

        impls["cuequivariance"] = cueq_fn
    return impls


def median_ms(fn):
    """Median milliseconds of fn: triton's do_bench where triton is installed, else CUDA events."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    for _ in range(10):
        fn()
    times = []
    for _ in range(50):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


# NVML's clock-event reasons that hold the SM clock down under load (nvml.h, nvmlClocksEventReason*)
CLOCK_REASONS = {0x4: "power cap", 0x8: "hardware slowdown", 0x20: "software thermal", 0x40: "hardware thermal",
                 0x80: "power brake"}
NVML_CLOCK_SM = 1


class GpuClock:
    """The current CUDA device's SM clock and what holds it down, read through NVML (the driver's
    libnvidia-ml). An H200 running the update at N >= 768 reaches its power limit within a
    do_bench run and lowers the clock by up to a fifth (benchmarks/NOTES.md, "Power"), so each
    measurement records the clock before and after it. read() returns None where NVML is not found."""

    def __init__(self):
        self._nvml = self._handle = self._get_reasons = None
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            get_reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            if get_reasons is None:  # its name in older drivers
                get_reasons = nvml.nvmlDeviceGetCurrentClocksThrottleReasons
            if nvml.nvmlInit_v2() != 0:
                return
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0".encode()
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByPciBusId_v2(bus, ctypes.byref(handle)) == 0:
                self._nvml, self._handle, self._get_reasons = nvml, handle, get_reasons
        except (OSError, AttributeError, RuntimeError, AssertionError):  # no driver library or GPU
            pass

    def read(self):
        """(SM clock in MHz, the active clock-event reasons as NVML's bit mask), or None."""
        if self._nvml is None:
            return None
        clock, reasons = ctypes.c_uint(), ctypes.c_ulonglong()
        if (self._nvml.nvmlDeviceGetClockInfo(self._handle, NVML_CLOCK_SM, ctypes.byref(clock)) != 0
                or self._get_reasons(self._handle, ctypes.byref(reasons)) != 0):
            return None
        return clock.value, reasons.value

    def energy_mj(self):
        """The GPU's energy counter (mJ since the driver loaded), or None."""
        if self._nvml is None:
            return None
        energy = ctypes.c_ulonglong()
        if self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle, ctypes.byref(energy)) != 0:
            return None
        return energy.value


def describe_clock(before, after) -> str:
    """'SM 1980 -> 1605 MHz (power cap)' from two GpuClock readings ('' where there are none)."""
    if before is None or after is None:
        return ""
    held = [name for bit, name in CLOCK_REASONS.items() if after[1] & bit]
    return f"SM {before[0]} -> {after[0]} MHz" + (f" ({', '.join(held)})" if held else "")


def measure(fn, args, grad=False, clock=None):
    """(median ms, peak extra bytes, output, SM clock readings before and after the timing) of
    fn(*args); without autograd unless `grad`. `clock`: a GpuClock (readings None without one)."""
    with torch.set_grad_enabled(grad):
        fn(*args)  # warm-up: compilation, autotuning, one-time preparation stay out of the numbers
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn(*args)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        before = clock.read() if clock is not None else None
        ms = median_ms(lambda: fn(*args))
        after = clock.read() if clock is not None else None
    return ms, peak, out, (before, after)


# do_bench's L2 flush: it zeroes this many bytes before each timed call
FLUSH_BYTES = 256 * 1024 * 1024
SUSTAINED_BATCH = 20  # calls issued between two synchronizations


def sustained(fn, args, clock, seconds=2.0, grad=False):
    """fn(*args) over `seconds` of calls back to back, each after do_bench's L2 flush, and the flushes
    alone over half that span first: {"ms": time a call, "mj": energy a call (None without NVML),
    "sm_mhz": the SM clock at the end}, both net of a flush's time and energy as measured alone.
    Calls are issued in batches of SUSTAINED_BATCH, synchronized after each."""
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")

    def measured(span, with_fn):  # (ms a call, mJ a call or None)
        torch.cuda.synchronize()
        e0 = clock.energy_mj() if clock is not None else None
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < span:
            for _ in range(SUSTAINED_BATCH):
                flush.zero_()
                if with_fn:
                    fn(*args)
            torch.cuda.synchronize()
            calls += SUSTAINED_BATCH
        elapsed = time.perf_counter() - t0
        e1 = clock.energy_mj() if clock is not None else None
        return elapsed * 1e3 / calls, None if e0 is None or e1 is None else (e1 - e0) / calls

    with torch.set_grad_enabled(grad):
        flush_ms, flush_mj = measured(seconds / 2, False)
        ms, mj = measured(seconds, True)
    reading = clock.read() if clock is not None else None
    return {"ms": ms - flush_ms, "mj": None if mj is None or flush_mj is None else mj - flush_mj,
            "sm_mhz": None if reading is None else reading[0]}


def training_step(fn):
    """fn(x, mask, p) -> out, as one training step: forward, then the backward of
    (out * g).sum() into x and the parameters (gradients dropped after each step)."""
    grads = {}

    def step(x, mask, p):
        key = id(x)
        if key not in grads:
            grads.clear()
            grads[key] = torch.randn(x.shape, dtype=x.dtype, device=x.device,
                                     generator=torch.Generator(device=x.device).manual_seed(1))
        out = fn(x, mask, p)
        out.backward(grads[key])
        for t in [x, *p]:
            if t is not None:
                t.grad = None
        return out.detach()

    return step


def kernel_launches(fn, args, reps=10, grad=False):
    """{kernel's full name: (device ms a call, launches a call)} of what fn launches (torch.profiler
    over `reps` calls after one), the heaviest first."""
    from torch.profiler import ProfilerActivity, profile

    with torch.set_grad_enabled(grad):
        fn(*args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn(*args)
            torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.count > 0:
            ms, launches = rows.get(e.key, (0.0, 0.0))
            rows[e.key] = (ms + e.device_time_total / 1e3 / reps, launches + e.count / reps)
    return dict(sorted(rows.items(), key=lambda kv: -kv[1][0]))


def kernel_times(fn, args, reps=10, grad=False):
    """Mean device time per call of each kernel fn launches (torch.profiler), a name of 60 characters
    or more cut to its first 57 (kernels whose names share those summed into one row)."""
    times = {}
    for key, (ms, _) in kernel_launches(fn, args, reps, grad).items():
        name = key if len(key) < 60 else key[:57] + "..."
        times[name] = times.get(name, 0.0) + ms
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="default", choices=sorted(SHAPES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--profile", action="store_true", help="also print trimul's time per kernel")
    ap.add_argument("--backward", action="store_true", help="time forward+backward (one training step)")
    ap.add_argument("--gpu-time", action="store_true",
                    help="also measure each implementation's GPU time (the sum of a call's kernel times)")
    ap.add_argument("--sustained", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                    help="also time each implementation over SECONDS of calls back to back (default 2), "
                         "with its energy a call")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("trimul.bench: no CUDA GPU found; the benchmark compares GPU implementations")
    gpu = torch.cuda.get_device_name()
    clock = GpuClock()
    rows = []
    shapes = SHAPES[args.shapes]
    for n_done, (B, N, P, H, dtype, precision) in enumerate(shapes, 1):
        print(f"[{n_done}/{len(shapes)}] B={B} N={N} P={P} H={H} {dtype} {precision}", file=sys.stderr, flush=True)
        tf32 = precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        inputs = make_inputs(B, N, P, H, dtype, requires_grad=args.backward)
        x, mask, p = inputs
        with torch.no_grad():
            ref = triangle_multiplication_reference(x, mask, *p, direction="outgoing", gate_input="normalized",
                                                    dtype=torch.float64) if N <= 1024 else None
        # a training step does about three times the forward's FLOPs
        floor = floor_ms(B, N, P, H, dtype, precision) * (3 if args.backward else 1)
        row = {"B": B, "N": N, "P": P, "H": H, "dtype": dtype, "precision": precision,
               "mode": "forward+backward" if args.backward else "forward", "floor_ms": floor, "impls": {}}
        for name, fn in implementations(precision).items():
            if name == "compile" and N > COMPILE_MAX_N:
                continue
            t0 = time.time()
            try:
                timed = training_step(fn) if args.backward else fn
                ms, peak, out, (before, after) = measure(timed, inputs, grad=args.backward, clock=clock)
            except Exception as e:  # an implementation that cannot run a shape says so in the table
                row["impls"][name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                print(f"    {name}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                continue
            err = None
            if ref is not None:
                err = rel_err(out, ref)
            row["impls"][name] = {"ms": ms, "peak_mib": peak / 2 ** 20, "rel_err": err,
                                  "sm_mhz": None if before is None or after is None else [before[0], after[0]],
                                  "clock_reasons": None if after is None else after[1]}
            extra = ""  # the optional figures of the progress line
            if args.gpu_time:
                row["impls"][name]["gpu_ms"] = sum(kernel_times(timed, inputs, grad=args.backward).values())
                extra = f", GPU {row['impls'][name]['gpu_ms']:.4f} ms"
            if args.sustained is not None:
                run = sustained(timed, inputs, clock, args.sustained, grad=args.backward)
                row["impls"][name].update(sustained_ms=run["ms"], sustained_mj=run["mj"],
                                          sustained_sm_mhz=run["sm_mhz"])
                extra += f", sustained {run['ms']:.4f} ms" + (
                    f" {run['mj']:.0f} mJ at {run['sm_mhz']} MHz" if run["mj"] is not None else "")
            print(f"    {name}: {ms:.4f} ms{extra}, peak {peak / 2 ** 20:.0f} MiB, rel err {err} "
                  f"({time.time() - t0:.0f} s) {describe_clock(before, after)}", file=sys.stderr, flush=True)
            del out
        if args.profile:
            trimul_fn = implementations(precision)["trimul"]
            row["kernels_ms"] = kernel_times(training_step(trimul_fn) if args.backward else trimul_fn, inputs,
                                             grad=args.backward)
            for k, v in row["kernels_ms"].items():
                print(f"      {v:8.4f} ms  {k}", file=sys.stderr)
        rows.append(row)
        del inputs, x, mask, p, ref
        torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = False

    names = ["trimul", "eager", "compile", "cuequivariance"]
    mode = "forward+backward (one training step; floor = 3x the forward's)" if args.backward else "forward"
    print(f"\n{gpu}, torch {torch.__version__}, trimul {trimul.__version__}; {mode}, median of do_bench (ms); "
          "outgoing, gate from the normalized input, bool mask")
    print("| B, N, P, H | precision | floor | " + " | ".join(names) + " | trimul / cuEq | trimul peak MiB | cuEq peak MiB |")
    print("|---" * (len(names) + 6) + "|")
    for r in rows:
        t, c = r["impls"].get("trimul", {}), r["impls"].get("cuequivariance", {})
        print(table_row(r, names, "ms") + f" {t.get('peak_mib', math.nan):.0f} | {c.get('peak_mib', math.nan):.0f} |")
    if args.gpu_time:
        print("\nGPU time: the sum of one call's kernel times (torch.profiler, mean of 10 calls), ms")
        print("| B, N, P, H | precision | floor | " + " | ".join(names) + " | trimul / cuEq |")
        print("|---" * (len(names) + 4) + "|")
        for r in rows:
            print(table_row(r, names, "gpu_ms"))
    if args.sustained is not None:
        print(f"\nSustained: {args.sustained:g} s of calls back to back, each after do_bench's L2 flush, net of "
              "the flushes; ms a call, then mJ a call (NVML's energy counter)")
        for key, unit, digits in (("sustained_ms", "floor (ms)", 3), ("sustained_mj", "mJ", 0)):
            print(f"| B, N, P, H | precision | {unit} | " + " | ".join(names) + " | trimul / cuEq |")
            print("|---" * (len(names) + 4) + "|")
            for r in rows:
                print(table_row(r, names, key, digits, floor=key == "sustained_ms"))
    print("\nSM clock before -> after each timing, and what NVML said held it down:")
    for r in rows:
        cells = [f"{n} {describe_clock((v['sm_mhz'][0], 0), (v['sm_mhz'][1], v['clock_reasons']))}"
                 for n in names if (v := r["impls"].get(n, {})).get("sm_mhz")]
        print(f"  {r['B']}, {r['N']}, {r['P']}, {r['H']} {r['dtype']} {r['precision']}: " + ("; ".join(cells) or "—"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "rows": rows}, f,
                      indent=1)
    if args.plot:
        plot(rows, args.plot, gpu)


def table_row(r, names, key, digits=3, floor=True) -> str:
    """A row's markdown cells up to the trimul / cuEq ratio, from each implementation's `key`
    (`digits` after the point; "—" where the figure is missing or None), the floor's cell "—"
    unless `floor`."""
    def has(v):
        return v.get(key) is not None

    cells = []
    for n in names:
        v = r["impls"].get(n)
        cells.append("—" if v is None else "error" if "error" in v else f"{v[key]:.{digits}f}" if has(v) else "—")
    t, c = r["impls"].get("trimul", {}), r["impls"].get("cuequivariance", {})
    ratio = f"{t[key] / c[key]:.2f}" if has(t) and has(c) else "—"
    floor_cell = f"{r['floor_ms']:.3f}" if floor else "—"
    return (f"| {r['B']}, {r['N']}, {r['P']}, {r['H']} | {r['dtype']} {r['precision']} | {floor_cell} | "
            + " | ".join(cells) + f" | {ratio} |")


def plot(rows, path, gpu):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    sel = [r for r in rows if r["dtype"] == "bfloat16" and r["P"] == 128 and r["H"] == 128]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for name in ["trimul", "eager", "compile", "cuequivariance"]:
        pts = [(r["N"], r["impls"][name]) for r in sel if "ms" in r["impls"].get(name, {})]
        if pts:
            ax[0].plot([n for n, _ in pts], [v["ms"] for _, v in pts], "o-", label=name)
            ax[1].plot([n for n, _ in pts], [v["peak_mib"] / 1024 for _, v in pts], "o-", label=name)
    ax[0].plot([r["N"] for r in sel], [r["floor_ms"] for r in sel], "k--", label="floor")
    mode = rows[0].get("mode", "forward") if rows else "forward"
    for a, label in zip(ax, [f"{mode} time (ms)", "peak extra memory (GiB)"]):
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("N (B=1, P=H=128, bf16)")
        a.set_ylabel(label)
        a.grid(True, which="both", alpha=0.3)
        a.legend()
    fig.suptitle(f"trimul {mode} on {gpu}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
