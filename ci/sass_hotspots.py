"""Where a kernel's executed instructions go, from ncu's per-instruction counts.

    ncu --kernel-name regex:ln_proj_gate_mma --launch-count 1 --section SourceCounters -o stage \
        python3 ci/profile_case.py 1 1024 128 128 bfloat16 default tiled
    ncu -i stage.ncu-rep --page source --csv --print-source sass > stage.csv
    python3 ci/sass_hotspots.py stage.csv [--warps W] [--top K]

Prints the warp instructions executed per opcode, and the heaviest straight-line runs
(consecutive instructions executed equally often: loop bodies, unrolled blocks) with how
often each ran per warp (--warps: warps launched, e.g. blocks x 8) and their first
instructions; where the CSV has ncu's warp-state samples per instruction and stall reason (as
`ci/gpu_check.sh` collects them, with the SourceCounters and WarpStateStats sections), also the
stall reasons' shares of all samples and the instructions that drew the most samples, each with
its main reason. What `ci/gpu_check.sh` writes with NCU=1.
"""
import argparse
import collections
import csv


def table(path):
    """(columns, rows) of ncu's source-page CSV: the header row (the one naming "Source" and
    "Instructions Executed") and the rows after it."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = next(i for i, r in enumerate(rows) if "Source" in r and "Instructions Executed" in r)
    return rows[header], rows[header + 1:]


def number(row, i):
    """Cell i of a row as an integer (ncu writes thousands separators), None where it is not one."""
    try:
        return int(row[i].replace(",", ""))
    except (ValueError, IndexError):
        return None


def read(path):
    """[(address, instruction, executed)] in address order."""
    cols, rows = table(path)
    src, count = cols.index("Source"), cols.index("Instructions Executed")
    return [(r[0], r[src].strip(), n) for r in rows if (n := number(r, count)) is not None]


def opcode(instruction):
    words = instruction.split()
    if words and words[0].startswith("@"):  # predicate
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def stalls(path):
    """(samples, by_reason, per_instruction): all warp-state samples, their count per stall reason,
    and per instruction [(samples, index, instruction, main reason)] in address order; None where
    the CSV has no per-instruction stall columns."""
    cols, rows = table(path)
    reasons = [c for c in cols if c.startswith("stall_") and "Not Issued" not in c]
    if "Warp Stall Sampling (All Samples)" not in cols or not reasons:
        return None
    src, all_col = cols.index("Source"), cols.index("Warp Stall Sampling (All Samples)")
    at = {c: cols.index(c) for c in reasons}

    def count(r, i):
        return number(r, i) or 0

    by_reason, per_ins = collections.Counter(), []
    for k, r in enumerate(r for r in rows if len(r) > all_col):
        for c in reasons:
            by_reason[c[len("stall_"):]] += count(r, at[c])
        main = max(reasons, key=lambda c: count(r, at[c]))
        per_ins.append((count(r, all_col), k, r[src].strip(), main[len("stall_"):]))
    return sum(n for n, *_ in per_ins), by_reason, per_ins


def runs(instructions):
    """Maximal runs of consecutive instructions with the same execution count."""
    out = []
    for addr, ins, n in instructions:
        if out and out[-1][1] == n:
            out[-1][2].append(ins)
        else:
            out.append((addr, n, [ins]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--warps", type=int, default=0, help="warps launched (to print runs per warp)")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    instructions = read(args.csv)
    total = sum(n for _, _, n in instructions)
    print(f"{total / 1e6:.1f} M warp instructions executed, {len(instructions)} static")
    by_op = collections.Counter()
    for _, ins, n in instructions:
        by_op[opcode(ins)] += n
    for op, n in by_op.most_common(args.top):
        print(f"  {op:10s} {n / 1e6:8.1f} M  {100 * n / total:5.1f} %")
    print("heaviest runs (address, length, times run" + (" per warp" if args.warps else "") + ", share):")
    for addr, n, body in sorted(runs(instructions), key=lambda r: -r[1] * len(r[2]))[:args.top]:
        times = n / args.warps if args.warps else n
        print(f"  {addr[-6:]} {len(body):4d} x {times:10.2f}  {100 * n * len(body) / total:5.1f} %  "
              + " | ".join(b[:32] for b in body[:6]))
    sampled = stalls(args.csv)
    if sampled is not None and sampled[0] > 0:
        samples, by_reason, per_ins = sampled
        print(f"warp-state samples: {samples}; by reason:")
        for reason, n in by_reason.most_common(args.top):
            if n:
                print(f"  {reason:18s} {100 * n / samples:5.1f} %")
        print("instructions with the most samples (index in address order, share, main reason):")
        for n, k, ins, reason in sorted(per_ins, reverse=True)[:args.top]:
            print(f"  #{k:5d} {100 * n / samples:5.1f} %  {reason:16s} {ins[:60]}")


if __name__ == "__main__":
    main()
