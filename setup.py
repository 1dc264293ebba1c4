"""Builds trimul: the Python package and, where nvcc is found, the CUDA kernels
as trimul._C through the LibTorch stable ABI (one cp39-abi3 wheel for torch >= 2.10).

Environment:
  TORCH_CUDA_ARCH_LIST   architectures to compile, e.g. "9.0a" or "8.0;9.0a+PTX"
                         (default: 8.0 8.6 8.9 9.0a 10.0 12.0+PTX); 9.0a (H100, H200)
                         in place of 9.0 adds the input stage's wgmma products
  TRIMUL_CPU_ONLY=1      skip the CUDA extension (CPU path only)
  MAX_JOBS               parallel compile jobs
"""
import glob
import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "8.0;8.6;8.9;9.0a;10.0;12.0+PTX"
# torch 2.10.0 as [major][minor][patch][abi tag]: expose only the stable ABI of that release
TORCH_TARGET_VERSION = "0x020a000000000000"


def cutlass_include():
    try:
        import cutlass_library
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    return path if os.path.isdir(os.path.join(path, "cutlass")) else None


def extensions():
    if os.environ.get("TRIMUL_CPU_ONLY") == "1":
        print("trimul: TRIMUL_CPU_ONLY=1, building without CUDA kernels (CPU path only)", file=sys.stderr)
        return [], {}
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

    if CUDA_HOME is None:
        print("trimul: no CUDA toolkit found (set CUDA_HOME), building without CUDA kernels: "
              "CUDA inputs will raise, CPU inputs run the CPU path", file=sys.stderr)
        return [], {}
    cutlass = cutlass_include()
    if cutlass is None:
        raise RuntimeError("trimul: CUTLASS headers not found; pip install nvidia-cutlass")
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
    defines = [f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}"]  # CUDAExtension defines Py_LIMITED_API
    archs = [item.partition("+")[0].strip() for item in os.environ["TORCH_CUDA_ARCH_LIST"].replace(";", " ").split()]
    if "9.0a" in archs:  # sm_90a machine code: the host may launch the wgmma kernels on 9.0 devices
        defines.append("-DTRIMUL_SM90A=1")
    sources = [os.path.relpath(p, ROOT) for p in
               sorted(glob.glob(os.path.join(ROOT, "csrc", "*.cpp")) + glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))]
    ext = CUDAExtension(
        "trimul._C",
        sources,
        include_dirs=[os.path.join(ROOT, "csrc"), cutlass],
        extra_compile_args={
            # csrc/compat: keep the binary within glibc 2.28 (manylinux_2_28) on any build machine
            "cxx": ["-O3", "-std=c++17", "-DUSE_CUDA", *defines, "-I" + os.path.join(ROOT, "csrc", "compat"),
                    "-include", os.path.join(ROOT, "csrc", "compat", "glibc_compat.h")],
            "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-DUSE_CUDA", *defines],
        },
        py_limited_api=True,
    )
    return [ext], {"build_ext": BuildExtension}


def write_build_info(arch_list, cuda_version):
    """trimul/_build_info.py: what this build holds, for trimul.info and the arch check, and the
    CUDA version of the torch it was built against (its kernels' CUDA runtime has that major)."""
    with open(os.path.join(ROOT, "trimul", "_build_info.py"), "w") as f:
        f.write('"""Written by setup.py at build time."""\n')
        f.write(f"CUDA_ARCH_LIST = {arch_list!r}\n")
        f.write(f"CUDA_VERSION = {cuda_version!r}\n")


ext_modules, cmdclass = extensions()
if ext_modules:
    import torch

    write_build_info(os.environ["TORCH_CUDA_ARCH_LIST"], torch.version.cuda)
else:
    write_build_info("", None)
setup(
    packages=find_packages(include=["trimul", "trimul.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
