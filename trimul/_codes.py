"""The integer codes the compiled ops (csrc/trimul.h, csrc/trimul.cpp) take for
precisions, element types and kernel paths."""
import torch

PRECISION_CODE = {"ieee": 0, "tf32": 1, "bf16": 2, "fp16": 3}  # Precision
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 2, torch.float16: 3}  # DType, the kernels' storage types
DTYPE_OF_CODE = {code: dtype for dtype, code in DTYPE_CODE.items()}
# The matrix products' operand type at each precision (csrc/trimul.cpp: operand_dtype)
OPERAND_DTYPE = {"ieee": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION_OF_CODE = {code: name for name, code in PRECISION_CODE.items()}
# Path: the kernels a CUDA call runs ("tiled_sync": the tensor-core stages without wgmma;
# "tiled_chunked": the wgmma input stage streaming its weights instead of holding them resident;
# both forced only)
PATH_CODE = {"tiled_fp32": 0, "tiled": 1, "fused_small": 2, "tiled_sync": 3, "tiled_chunked": 4}
PATH_OF_CODE = {code: path for path, code in PATH_CODE.items()}
AUTO_PATH = -1  # the dispatcher chooses
# The mask dtypes the kernels read (csrc/trimul.cpp: dtype_of); kernel_mask brings others to float32
MASK_DTYPES = frozenset((torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                         torch.float16, torch.bfloat16, torch.float32, torch.float64))


def kernel_mask(mask):
    """The mask as the CUDA kernels take it: itself where they read its dtype, else in float32 (the
    unsigned 16- to 64-bit integers, float8), whose values its own dtype converts to; a complex mask
    as it is, for the checks to reject before anything is copied or launched."""
    if mask is None or mask.dtype in MASK_DTYPES or mask.is_complex():
        return mask
    return mask.to(torch.float32)
