"""trimul: fused kernels for the triangle multiplicative update of AlphaFold-style models.

    torch.ops.trimul.forward(x, mask, <16 parameters>, direction, gate_input, eps, precision)
    trimul.TriangleMultiplication(pair_dim, hidden_dim, ...)     an nn.Module
    trimul.triangle_multiplicative_update(x, ...)                cuEquivariance's argument set
    trimul.convert.from_openfold / from_boltz / from_cuequivariance  weights from other projects
"""
import importlib
import importlib.util
import warnings

import torch

from . import archs, convert, ops
from .functional import triangle_multiplicative_update
from .modules import TriangleMultiplication
from .reference import triangle_multiplication_reference

__version__ = "0.1.0"


def _load_kernels() -> bool:
    """Loads trimul._C (registers trimul::_forward_cuda). A package built
    without CUDA has none and stays quiet, as does a torch built without CUDA
    (its CPU-only wheels: no CUDA tensor to run the kernels on, and no
    libtorch_cuda for them to link against); one that fails to load says why."""
    if importlib.util.find_spec("trimul._C") is None or torch.version.cuda is None:
        return False
    try:
        importlib.import_module("trimul._C")
    except (ImportError, OSError, RuntimeError) as e:
        mismatch = archs.cuda_mismatch(torch.version.cuda)
        warnings.warn(f"trimul: the CUDA kernels failed to load ({e}{'; ' + mismatch if mismatch else ''}); "
                      "only the CPU path is available", RuntimeWarning, stacklevel=3)
        return False
    return True


HAS_CUDA_KERNELS = _load_kernels()
if HAS_CUDA_KERNELS:
    ops.register_kernel_fakes()

__all__ = ["TriangleMultiplication", "triangle_multiplicative_update", "triangle_multiplication_reference",
           "convert", "ops", "HAS_CUDA_KERNELS", "__version__"]
