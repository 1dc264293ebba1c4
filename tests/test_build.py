"""The kernels as built (no GPU needed): none of them spills registers or keeps a
stack frame. Local memory slows a kernel down without failing any GPU test, and a
change to a shared tile constant can cause it in a kernel the change never named."""
import importlib.util
import os

import pytest

import trimul

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check_archs():
    spec = importlib.util.spec_from_file_location("check_archs", os.path.join(ROOT, "ci", "check_archs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not trimul.HAS_CUDA_KERNELS, reason="trimul was built without its CUDA kernels")
def test_no_kernel_uses_local_memory():
    check = _check_archs()
    tool = check.find_cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton) to read the kernels with")
    kernels, spilling = check.local_memory_users(importlib.util.find_spec("trimul._C").origin, tool)
    assert kernels > 0, "cuobjdump listed no kernels"
    assert not spilling, f"kernels using local memory (name, stack bytes, local bytes): {spilling}"
