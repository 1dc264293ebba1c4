"""The integer codes the compiled ops (csrc/trimul.h, csrc/trimul.cpp) take for
precisions and element types."""
import torch

PRECISION_CODE = {"ieee": 0, "tf32": 1, "bf16": 2, "fp16": 3}  # Precision
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 2, torch.float16: 3}  # DType, the kernels' storage types
DTYPE_OF_CODE = {code: dtype for dtype, code in DTYPE_CODE.items()}
