"""Which GPU architectures this build of trimul holds kernels for."""
from typing import List, Optional, Tuple

try:
    from ._build_info import CUDA_ARCH_LIST
except ImportError:  # a source tree that setup.py has not built
    CUDA_ARCH_LIST = None
try:
    from ._build_info import CUDA_VERSION  # the build's CUDA, as torch.version.cuda reads
except ImportError:  # (also a build from before it was written)
    CUDA_VERSION = None

Arch = Tuple[int, int]


def compiled_archs() -> Optional[Tuple[List[Arch], List[Arch]]]:
    """(machine code, PTX) architectures of the build, or None when unknown."""
    if CUDA_ARCH_LIST is None:
        return None
    sass, ptx = [], []
    for item in CUDA_ARCH_LIST.replace(";", " ").split():
        name, _, extra = item.partition("+")
        major, _, minor = name.rstrip("af").partition(".")
        arch = (int(major), int(minor[:1] or 0))
        sass.append(arch)
        if extra.upper() == "PTX":
            ptx.append(arch)
    return sass, ptx


def has_kernel_for(capability: Arch) -> Optional[bool]:
    """Whether a GPU of this compute capability can run the build's kernels: machine
    code of the same major version and no newer minor, or PTX no newer than it."""
    archs = compiled_archs()
    if archs is None:
        return None
    sass, ptx = archs
    return (any(a[0] == capability[0] and a[1] <= capability[1] for a in sass)
            or any(a <= capability for a in ptx))


def describe() -> str:
    archs = compiled_archs()
    if archs is None:
        return "unknown (source tree)"
    if not archs[0]:
        return "none (built without CUDA)"
    sass, ptx = [], []
    for item in CUDA_ARCH_LIST.replace(";", " ").split():
        name, _, extra = item.partition("+")
        sass.append("sm_" + name.replace(".", ""))  # 9.0a: sm_90a, machine code for exactly 9.0
        if extra.upper() == "PTX":
            ptx.append(sass[-1])
    return "machine code for " + ", ".join(sass) + ("; PTX for " + ", ".join(ptx) if ptx else "")


def cuda_mismatch(torch_cuda: Optional[str]) -> Optional[str]:
    """Words for a torch whose CUDA major differs from the one this build's kernels were compiled
    for (their CUDA runtime library is that major's), or None where they agree or either is unknown."""
    if not CUDA_VERSION or not torch_cuda or CUDA_VERSION.split(".")[0] == torch_cuda.split(".")[0]:
        return None
    return (f"trimul's kernels are built for CUDA {CUDA_VERSION}, this torch for CUDA {torch_cuda}; "
            f"a CUDA {CUDA_VERSION.split('.')[0]} build of torch runs them")
