"""The kernels as built (no GPU needed): none of them spills registers or keeps a
stack frame. Local memory slows a kernel down without failing any GPU test, and a
change to a shared tile constant can cause it in a kernel the change never named.
And the limits and layout the Python side keeps copies of agree with the build's."""
import importlib.util
import os
import subprocess
import sys

import pytest

import trimul

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ci_module(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "ci", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not trimul.HAS_CUDA_KERNELS, reason="trimul was built without its CUDA kernels")
def test_no_kernel_uses_local_memory():
    check = _ci_module("check_archs")
    tool = check.find_cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton) to read the kernels with")
    kernels, spilling = check.local_memory_users(importlib.util.find_spec("trimul._C").origin, tool)
    assert kernels > 0, "cuobjdump listed no kernels"
    assert not spilling, f"kernels using local memory (name, stack bytes, local bytes): {spilling}"


@pytest.mark.skipif(not trimul.HAS_CUDA_KERNELS, reason="trimul was built without its CUDA kernels")
def test_resident_stages_hold_wgmma_on_sm90a():
    """The sm_90a build's resident stages multiply by wgmma (HGMMA) and copy by tensor maps: a build
    that compiled them without (a lost define, a wrong arch flag) passes every other test, slower.
    Checked with SM90A_INSTRUCTIONS and two rules added that no build meets (the parameter pack has no
    products or tensor maps; a family that does not exist), whose gaps alone the check must report."""
    check = _ci_module("check_archs")
    tool = check.find_cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton) to read the kernels with")
    built = {item.partition("+")[0] for item in (trimul.archs.CUDA_ARCH_LIST or "").replace(";", " ").split()}
    if "9.0a" not in built:
        pytest.skip("this build holds no sm_90a code")
    lib = importlib.util.find_spec("trimul._C").origin
    rules = dict(check.SM90A_INSTRUCTIONS)
    rules["pack_kernel"] = {"every": ("HGMMA",), "some": ("UTMASTG",)}
    rules["no_such_kernel"] = {"every": ("HGMMA",), "some": ()}
    gaps, kernels = check.sm90a_instruction_gaps(lib, tool, rules)
    assert kernels > 0, "cuobjdump listed no sm_90a kernel in a build for 9.0a"
    assert len(gaps) == 3, gaps
    assert gaps[0].endswith("pack_kernel instances without HGMMA"), gaps
    assert gaps[1:] == ["no pack_kernel instance with UTMASTG", "no no_such_kernel in the sm_90a code"], gaps


def test_fast_div_matches_integer_division(tmp_path):
    """The resident stages divide tile numbers by FastDiv (csrc/cuda/common.cuh): its host form,
    built from the same header, against integer division at every divisor up to 4096, the powers of
    two and their neighbours and random divisors up to 2^31, each at numerators around its multiples
    and at random ones below 2^31."""
    nvcc = _ci_module("check_archs").find_toolkit_binary("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc to build the host check with")
    exe = tmp_path / "fast_div_check"
    subprocess.run([nvcc, "-std=c++17", "-O2", "-I", os.path.join(ROOT, "csrc"), "-o", str(exe),
                    os.path.join(ROOT, "tests", "native", "fast_div_check.cu")], check=True, capture_output=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "checks agree" in run.stdout


def test_sass_hotspots_sums_ncu_counts(tmp_path):
    """ci/sass_hotspots.py reads ncu's source-page CSV: opcodes (predicates dropped) and runs of
    equally often executed instructions."""
    csv = tmp_path / "k.csv"
    csv.write_text('"Kernel Name","k"\n'
                   '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"\n'
                   '"0x10","IMAD R1, R2, R3, RZ","5","8"\n'
                   '"0x20","@!P0 HMMA.16816.F32.BF16 R4, R8, R12, R4","9","8"\n'
                   '"0x30","EXIT","0","2"\n')
    hot = _ci_module("sass_hotspots")
    instructions = hot.read(str(csv))
    assert [n for _, _, n in instructions] == [8, 8, 2]
    assert [hot.opcode(i) for _, i, _ in instructions] == ["IMAD", "HMMA", "EXIT"]
    assert [(n, len(body)) for _, n, body in hot.runs(instructions)] == [(8, 2), (2, 1)]
    assert hot.stalls(str(csv)) is None  # (no per-instruction stall columns)


def test_sass_hotspots_stall_samples(tmp_path):
    """With ncu's per-instruction stall columns, ci/sass_hotspots.py sums the samples by reason and
    names each instruction's main reason."""
    csv = tmp_path / "k.csv"
    csv.write_text('"Kernel Name","k"\n'
                   '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
                   '"stall_wait","stall_barrier","stall_wait (Not Issued)"\n'
                   '"0x10","FFMA R1, R2, R3, R1","7","8","6","1","6"\n'
                   '"0x20","BAR.SYNC 0x0","3","8","0","3","0"\n')
    hot = _ci_module("sass_hotspots")
    samples, by_reason, per_ins = hot.stalls(str(csv))
    assert samples == 10 and dict(by_reason) == {"wait": 6, "barrier": 4}
    assert [(n, k, reason) for n, k, _, reason in per_ins] == [(7, 0, "wait"), (3, 1, "barrier")]


def test_sass_compare_matches_bodies(monkeypatch):
    """ci/sass_compare.py reads cuobjdump's SASS listing: a kernel's instructions without addresses
    and encodings (headers and separators left out), so the same code under another mangled name or
    at other addresses matches, and other code does not."""
    listing = {
        "old.so": "\t\tFunction : _Z3fooILb1EEvv\n\t.headerflags\t@\"EF_CUDA_SM90\"\n"
                  "        /*0000*/                   LDC R1, c[0x0][0x28] ;   /* 0x00000a00ff017b82 */\n"
                  "                                                            /* 0x000fe20000000800 */\n"
                  "        /*0010*/                   EXIT ;\n\t\t..........\n"
                  "\t\tFunction : _Z3barv\n        /*0000*/                   NOP ;\n",
        "new.so": "\t\tFunction : _Z3fooILb1EEvv_v2\n        /*0100*/   LDC R1, c[0x0][0x28] ;\n"
                  "        /*0110*/   EXIT ;\n"
                  "\t\tFunction : _Z3fooILb0EEvv\n        /*0000*/   EXIT ;\n",
    }

    def fake_run(cmd, **kwargs):
        assert cmd[:2] == ["cuobjdump", "-sass"]
        return subprocess.CompletedProcess(cmd, 0, stdout=listing[cmd[2]], stderr="")

    cmp = _ci_module("sass_compare")
    monkeypatch.setattr(cmp.subprocess, "run", fake_run)
    old, new = cmp.functions("old.so", "foo"), cmp.functions("new.so", "foo")
    assert old == {"_Z3fooILb1EEvv": ["LDC R1, c[0x0][0x28]", "EXIT"]}
    assert cmp.digest(new["_Z3fooILb1EEvv_v2"]) == cmp.digest(old["_Z3fooILb1EEvv"])
    assert cmp.digest(new["_Z3fooILb0EEvv"]) != cmp.digest(old["_Z3fooILb1EEvv"])


@pytest.mark.skipif(not trimul.HAS_CUDA_KERNELS, reason="trimul was built without its CUDA kernels")
def test_kernel_limits_and_pack_layout_exported():
    """The backward reads the kernels' limits and unpacks the fp32 parameter pack by position
    (ln_in_w, ln_in_b, w_in, b_in, ln_out_w, ln_out_b, w_out, b_out, w_gate, b_gate)."""
    from trimul import _C

    assert _C.MAX_ROWS_LEN >= 128 and _C.OUT_BACK_MAX_WIDTH >= 128 and _C.OUT_STAGE_BACK_SMEM > 0
    for P, H in ((128, 128), (64, 32), (48, 80), (5, 3), (384, 128)):
        assert list(_C.packed_sizes(P, H)) == [P, P, 4 * H * P, 4 * H, H, H, P * H, P, P * P, P]


@pytest.mark.skipif(not trimul.HAS_CUDA_KERNELS, reason="trimul was built without its CUDA kernels")
def test_backward_chunks_agree_with_the_ops():
    """trimul/backward.py's chunks are those its CUDA ops take for the same step (one rule, written
    in Python for packages without the kernels and in C++ for the ops): every position once, in
    order, runs of a multiple of 8 rows or whole batch entries, of even sizes, at most `step`
    positions each where a chunk can be that small."""
    import trimul.backward as tb
    from trimul import _C

    for B, N, step in ((1, 768, 1 << 18), (1, 768, 1 << 19), (1, 1536, 1 << 18), (1, 1536, 1 << 20), (6, 9, 324),
                       (6, 9, 37), (2, 70, 4000), (3, 5, 30), (1, 130, 4000), (5, 24, 1000), (1, 7, 1), (4, 33, 81)):
        chunks = tb._chunks(B, N, step)
        assert [tuple(c) for c in _C.chunks(B, N, step)] == chunks
        covered = [(b, i) for b0, b1, i0, i1 in chunks for b in range(b0, b1) for i in range(i0, i1)]
        assert covered == [(b, i) for b in range(B) for i in range(N)]
        if N * N <= step:  # whole batch entries, at most step // N² of them, counts differing by one at most
            assert all(i0 == 0 and i1 == N for _, _, i0, i1 in chunks)
            counts = [b1 - b0 for b0, b1, _, _ in chunks]
            assert max(counts) <= step // (N * N) and max(counts) - min(counts) <= 1
        else:  # runs of rows from multiples of 8, at most what step allows (8 at least), even to 8 rows
            # (and the last one's part of a unit)
            rows = [i1 - i0 for _, _, i0, i1 in chunks]
            assert all(b1 == b0 + 1 and i0 % 8 == 0 for b0, b1, i0, _ in chunks)
            assert max(rows) <= max(8, step // N // 8 * 8) and max(rows) - min(rows) < 16
    with pytest.raises(ValueError):
        _C.chunks(1, 0, 10)


@pytest.mark.skipif(not trimul.HAS_CUDA_KERNELS, reason="trimul was built without its CUDA kernels")
def test_own_contraction_rule():
    """The contraction runs trimul's own GEMM at fp32 where torch's matmul would not take TF32 (ieee
    always, tf32 without allow_tf32), and at 16 bits up to 128^4 multiply-adds: batch planes of N
    padded to a multiple of 8, cubed."""
    from trimul import _C
    from trimul._codes import PRECISION_CODE as code

    for prec in ("bf16", "fp16"):
        assert _C.own_contraction(128, 128, code[prec], False)
        assert _C.own_contraction(128, 121, code[prec], True)  # pads to 128
        assert not _C.own_contraction(128, 129, code[prec], False)  # pads to 136
        assert not _C.own_contraction(129, 128, code[prec], False)
        assert _C.own_contraction(1024, 64, code[prec], False) and not _C.own_contraction(1025, 64, code[prec], False)
    assert _C.own_contraction(10 ** 6, 2048, code["ieee"], True)
    assert _C.own_contraction(1, 2048, code["tf32"], False) and not _C.own_contraction(1, 8, code["tf32"], True)


def test_python_sources_run_on_python_3_9():
    """The abi3 wheel serves CPython 3.9 and later (pyproject's requires-python), and its Python
    runs as it is on each: every module of the package parses as Python 3.9, and no annotation
    evaluated at definition time spells a union as X | Y (3.10)."""
    import ast

    package = os.path.join(ROOT, "trimul")
    sources = sorted(f for f in os.listdir(package) if f.endswith(".py"))
    assert sources
    for name in sources:
        text = open(os.path.join(package, name), encoding="utf-8").read()
        tree = ast.parse(text, filename=name, feature_version=(3, 9))
        if "from __future__ import annotations" in text:
            continue
        annotations = [n.annotation for n in ast.walk(tree) if isinstance(n, (ast.arg, ast.AnnAssign))]
        annotations += [n.returns for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for annotation in filter(None, annotations):
            unions = [n for n in ast.walk(annotation) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.BitOr)]
            assert not unions, f"{name}:{annotation.lineno}: a union as X | Y needs Python 3.10"


@pytest.mark.skipif(not trimul.HAS_CUDA_KERNELS, reason="trimul was built without its CUDA kernels")
def test_extension_links_only_the_stable_abi():
    """One wheel serves every torch from 2.10 on only while trimul._C calls torch through the
    LibTorch stable ABI's C functions (aoti_torch_*, torch_*): an undefined symbol of torch's C++
    API (the namespaces c10, at, torch, caffe2, mangled) would tie the binary to one release."""
    import shutil

    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm to list the extension's symbols with")
    lib = importlib.util.find_spec("trimul._C").origin
    listed = subprocess.run([nm, "-D", "--undefined-only", lib], check=True, capture_output=True, text=True).stdout
    symbols = [line.split()[-1] for line in listed.splitlines() if line.strip()]
    assert any(s.startswith("aoti_torch_") for s in symbols), "no stable-ABI call found: is this trimul._C?"
    cxx_api = ("_ZN3c10", "_ZNK3c10", "_ZN2at", "_ZNK2at", "_ZN5torch", "_ZNK5torch", "_ZN6caffe2", "_ZNK6caffe2")
    tied = [s for s in symbols if s.startswith(cxx_api)]
    assert not tied, f"symbols of torch's C++ API: {tied[:10]}"


def _cpu_script_env():
    """The environment for running a script of the repository in a subprocess: no GPU visible, and the
    trimul this process imports."""
    return dict(os.environ, CUDA_VISIBLE_DEVICES="",
                PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(trimul.__file__)),
                                            os.environ.get("PYTHONPATH", "")]))


def test_profile_step_runs():
    """ci/profile_step.py (training steps for ncu and a kernel table) runs its steps, here on the CPU at
    a small shape, with the trimul this process imports."""
    env = _cpu_script_env()
    run = subprocess.run([sys.executable, os.path.join(ROOT, "ci", "profile_step.py"), "2", "6", "8", "4", "float32",
                          "2", "--table"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "profile step done: (2, 6, 8, 4) torch.float32 on cpu, 2 steps" in run.stdout


def test_weight_products_needs_a_gpu():
    """benchmarks/weight_products.py (cuBLAS's weight-gradient product forms, GPU only) says so and
    fails on a machine without one, after parsing its arguments."""
    env = _cpu_script_env()
    script = os.path.join(ROOT, "benchmarks", "weight_products.py")
    run = subprocess.run([sys.executable, script, "--sizes", "64", "--slices", "8"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 1 and "no CUDA GPU found" in run.stderr, run.stdout + run.stderr
    run = subprocess.run([sys.executable, script, "--bad"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 2 and "unrecognized arguments" in run.stderr, run.stdout + run.stderr


def test_kernel_tables_need_a_gpu():
    """benchmarks/kernels.py (trimul's and cuEquivariance's kernels side by side, GPU only) says so
    and fails on a machine without one, after parsing its arguments."""
    env = _cpu_script_env()
    script = os.path.join(ROOT, "benchmarks", "kernels.py")
    run = subprocess.run([sys.executable, script, "--forward", "64", "--step", "--rounds", "1"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 1 and "no CUDA GPU found" in run.stderr, run.stdout + run.stderr
    run = subprocess.run([sys.executable, script, "--bad"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 2 and "unrecognized arguments" in run.stderr, run.stdout + run.stderr


def test_ab_harness_stages_and_table():
    """benchmarks/ab.py (builds side by side, GPU only): kernels named to their stages, the table's
    rows per case and stage with each wheel's mean against the first's; without a GPU it says so and
    fails, after parsing its arguments."""
    spec = importlib.util.spec_from_file_location("ab", os.path.join(ROOT, "benchmarks", "ab.py"))
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    back = "void trimul::ln_proj_gate_resident_kernel<__nv_bfloat16, 128, trimul::InputBackParams, true, false>"
    assert ab.stage_of(back) == "input_back"
    assert ab.stage_of(back.replace("InputBackParams", "LnProjGateParams")) == "input stage"
    assert ab.stage_of("void trimul::ln_out_proj_gate_resident_kernel<__half, __half>") == "output stage"
    assert ab.stage_of("nvjet_sm90_tst_128x128_64x6_2x1_v_bz") == "products"
    assert ab.stage_of("void at::native::vectorized_elementwise_kernel<4>") == "other"
    head = {"trimul": "/site", "gpu": "GPU"}

    def run(ms, pack, stage):
        return [head, {"case": "forward N=256", "do_bench_ms": ms, "us": {"pack": pack, "input stage": stage}}]

    text = ab.table(["0:old", "1:new"], {"0:old": [run(0.08, 6.0, 24.0), run(0.09, 8.0, 26.0)],
                                         "1:new": [run(0.07, 3.0, 24.0), run(0.08, 4.0, 26.0)]})
    lines = text.splitlines()
    assert lines[0] == "| case | stage | 0:old #1 | 0:old #2 | 1:new #1 | 1:new #2 | 1:new / 0:old |"
    assert "| forward N=256 | do_bench ms | 0.0800 | 0.0900 | 0.0700 | 0.0800 | 0.882 |" in lines
    assert "| forward N=256 | kernels µs | 30.0 | 34.0 | 27.0 | 30.0 | 0.891 |" in lines
    assert "| forward N=256 | pack | 6.0 | 8.0 | 3.0 | 4.0 | 0.500 |" in lines
    env = _cpu_script_env()
    script = os.path.join(ROOT, "benchmarks", "ab.py")
    done = subprocess.run([sys.executable, script, "a.whl", "b.whl"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 1 and "no CUDA GPU found" in done.stderr, done.stdout + done.stderr
    done = subprocess.run([sys.executable, script, "a.whl"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2 and "give two wheels or more" in done.stderr, done.stdout + done.stderr
