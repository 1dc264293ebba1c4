"""Checks that a built trimul wheel (or _C library) holds machine code for every
architecture we claim and PTX for the newest, that no kernel in it spills
registers or keeps a stack frame (local memory: slower, yet no GPU test fails),
and that its sm_90a kernels of the resident stages multiply by wgmma and copy by
tensor maps (a build that lost them still passes every test, at a fraction of the
speed), with cuobjdump.

    python ci/check_archs.py dist/trimul-*.whl [--expect "8.0;8.6;8.9;9.0a;10.0;12.0+PTX"]
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

DEFAULT_EXPECT = "8.0;8.6;8.9;9.0a;10.0;12.0+PTX"


def find_toolkit_binary(name):
    """The path of a CUDA toolkit program (on PATH or in $CUDA_HOME/bin), or None."""
    for candidate in (shutil.which(name), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", name)):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def find_cuobjdump():
    """The path of a cuobjdump, or None."""
    tool = find_toolkit_binary("cuobjdump")
    if tool is not None:
        return tool
    try:  # triton, a dependency of torch's CUDA wheels, carries one
        import triton

        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        if os.path.exists(path):
            return path
    except ImportError:
        pass
    return None


def local_memory_users(lib, tool):
    """(number of kernels, [(kernel, stack bytes, local bytes)] of those using local memory)."""
    usage = subprocess.run([tool, "--dump-resource-usage", lib], capture_output=True, text=True, check=True).stdout
    rows = re.findall(r"Function ([^\s:]+):\s*\n\s*REG:\d+ STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
    return len(rows), [(name, int(stack), int(local)) for name, stack, local in rows if int(stack) or int(local)]


# The sm_90a kernels' instructions that the speed rests on (SASS opcodes): every instance of a
# family holds those of "every", at least one instance those of "some". A family is matched by
# its name inside the mangled kernel name.
SM90A_INSTRUCTIONS = {
    "ln_proj_gate_resident_kernel": {"every": ("HGMMA",), "some": ("UTMASTG",)},
    "ln_out_proj_gate_resident_kernel": {"every": ("HGMMA",), "some": ("UTMALDG", "UTMASTG")},
    "out_stage_back_resident_kernel": {"every": ("HGMMA",), "some": ()},
}


def sm90a_instruction_gaps(lib, tool, rules=SM90A_INSTRUCTIONS):
    """The missing entries of `rules` (as SM90A_INSTRUCTIONS) in `lib`'s sm_90a machine code, as
    messages (none where it holds them all), and the number of sm_90a kernels read."""
    opcodes = {op for rule in rules.values() for ops in rule.values() for op in ops}
    found = {family: [] for family in rules}  # per family: each instance's opcodes
    kernels, current = 0, None
    with subprocess.Popen([tool, "-sass", "-arch", "sm_90a", lib], stdout=subprocess.PIPE, text=True) as dump:
        for line in dump.stdout:
            name = re.match(r"\s*Function : (\S+)", line)
            if name:
                kernels += 1
                family = next((f for f in rules if f in name.group(1)), None)
                current = set() if family else None
                if family:
                    found[family].append(current)
            elif current is not None:
                op = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
                if op and op.group(1) in opcodes:
                    current.add(op.group(1))
    if dump.returncode:
        raise subprocess.CalledProcessError(dump.returncode, dump.args)
    gaps = []
    for family, rule in rules.items():
        instances = found[family]
        if not instances:
            gaps.append(f"no {family} in the sm_90a code")
            continue
        for op in rule["every"]:
            lacking = sum(op not in ops for ops in instances)
            if lacking:
                gaps.append(f"{lacking} of {len(instances)} {family} instances without {op}")
        gaps += [f"no {family} instance with {op}" for op in rule["some"] if not any(op in ops for ops in instances)]
    return gaps, kernels


def expected(spec):
    sass, ptx = set(), set()
    for item in spec.replace(";", " ").split():
        name, _, extra = item.partition("+")
        arch = name.replace(".", "")
        sass.add(arch)
        if extra.upper() == "PTX":
            ptx.add(arch)
    return sass, ptx


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", help="a trimul wheel or a _C shared library")
    ap.add_argument("--expect", default=DEFAULT_EXPECT)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lib = args.artifact
        if lib.endswith(".whl"):
            with zipfile.ZipFile(lib) as z:
                names = [n for n in z.namelist() if re.search(r"trimul/_C.*\.so$", n)]
                if not names:
                    sys.exit(f"check_archs: no trimul/_C library in {lib}")
                lib = z.extract(names[0], tmp)
        tool = find_cuobjdump()
        if tool is None:
            sys.exit("check_archs: cuobjdump not found (install the CUDA toolkit or triton)")
        elf = subprocess.run([tool, "--list-elf", lib], capture_output=True, text=True, check=True).stdout
        ptx = subprocess.run([tool, "--list-ptx", lib], capture_output=True, text=True, check=True).stdout
        kernels, spilling = local_memory_users(lib, tool)
        gaps, sm90a_kernels = [], 0
        if ".sm_90a.cubin" in elf:
            gaps, sm90a_kernels = sm90a_instruction_gaps(lib, tool)
    have_sass = set(re.findall(r"\.sm_(\d+a?)\.cubin", elf))
    have_ptx = set(re.findall(r"\.sm_(\d+a?)\.ptx", ptx))
    want_sass, want_ptx = expected(args.expect)
    print(f"machine code: {', '.join('sm_' + a for a in sorted(have_sass, key=lambda a: int(a.rstrip('a'))))}")
    print(f"PTX:          {', '.join('sm_' + a for a in sorted(have_ptx, key=lambda a: int(a.rstrip('a'))))}")
    missing = [f"sm_{a} machine code" for a in sorted(want_sass - have_sass)] + \
              [f"sm_{a} PTX" for a in sorted(want_ptx - have_ptx)]
    if missing:
        sys.exit("check_archs: missing " + ", ".join(missing))
    print("check_archs: every expected architecture is present")
    if not kernels:
        sys.exit("check_archs: cuobjdump listed no kernel resources")
    if spilling:
        sys.exit("check_archs: kernels using local memory (stack, local bytes): " +
                 "; ".join(f"{name} ({stack}, {local})" for name, stack, local in spilling))
    print(f"check_archs: none of {kernels} kernels uses local memory")
    if "90a" in have_sass:
        if gaps:
            sys.exit("check_archs: " + "; ".join(gaps))
        print(f"check_archs: the resident stages' sm_90a kernels (of {sm90a_kernels}) hold wgmma and "
              "tensor-map copies")


if __name__ == "__main__":
    main()
