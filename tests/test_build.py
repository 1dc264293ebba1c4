"""The kernels as built (no GPU needed): none of them spills registers or keeps a
stack frame. Local memory slows a kernel down without failing any GPU test, and a
change to a shared tile constant can cause it in a kernel the change never named.
And the limits and layout the Python side keeps copies of agree with the build's."""
import importlib.util
import os

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


@pytest.mark.skipif(not trimul.HAS_CUDA_KERNELS, reason="trimul was built without its CUDA kernels")
def test_kernel_limits_and_pack_layout_exported():
    """The backward reads the kernels' limits and unpacks the fp32 parameter pack by position
    (ln_in_w, ln_in_b, w_in, b_in, ln_out_w, ln_out_b, w_out, b_out, w_gate, b_gate)."""
    from trimul import _C

    assert _C.MAX_ROWS_LEN >= 128 and _C.OUT_BACK_MAX_WIDTH >= 128 and _C.OUT_STAGE_BACK_SMEM > 0
    for P, H in ((128, 128), (64, 32), (48, 80), (5, 3), (384, 128)):
        assert list(_C.packed_sizes(P, H)) == [P, P, 4 * H * P, 4 * H, H, H, P * H, P, P * P, P]
