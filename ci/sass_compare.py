"""Whether a change left a kernel's machine code as it was: the SASS of every instantiation of
a kernel in two builds of trimul._C, compared body by body.

    python3 ci/sass_compare.py OLD/_C.abi3.so NEW/_C.abi3.so out_stage_back_resident_kernel

For each function of the new build whose name contains the given text, prints its instruction
count and the old function with an identical body, if any (instructions compared without their
addresses and encodings, so the same code at other addresses or under another mangled name
matches); then the old build's functions. Needs cuobjdump (the CUDA toolkit of the GPU
machine). What `benchmarks/NOTES.md` cites where a template flag kept a kernel's code unchanged.
"""
import argparse
import hashlib
import re
import subprocess


def functions(so, name):
    """{mangled name: [instruction text, ...]} of the functions in `so` whose names contain `name`."""
    sass = subprocess.run(["cuobjdump", "-sass", so], capture_output=True, text=True, check=True).stdout
    found, current, body = {}, None, []
    for line in sass.splitlines():
        start = re.match(r"\s*Function : (\S+)", line)
        if start:
            if current:
                found[current] = body
            current, body = (start.group(1) if name in start.group(1) else None), []
            continue
        address = re.match(r"\s*/\*[0-9a-f]{4,}\*/(.*)", line)  # an instruction line: /*0a10*/ OPCODE ... ;
        if current and address:
            body.append(address.group(1).split(";")[0].strip())
    if current:
        found[current] = body
    return found


def digest(body):
    return hashlib.sha1("\n".join(body).encode()).hexdigest()[:12]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("name", help="text the kernels' mangled names contain")
    args = ap.parse_args()
    old, new = functions(args.old, args.name), functions(args.new, args.name)
    by_digest = {digest(body): name for name, body in old.items()}
    for name, body in new.items():
        same = by_digest.get(digest(body))
        print(f"new {name}: {len(body)} instructions; " + (f"identical to old {same}" if same else "no identical old body"))
    for name, body in old.items():
        print(f"old {name}: {len(body)} instructions")


if __name__ == "__main__":
    main()
