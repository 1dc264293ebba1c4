"""The operator `torch.ops.trimul.forward`: schema, argument checks, the CPU
and CUDA implementations, the fake (meta) implementation for torch.compile,
and autograd.

The CUDA implementation resolves the options here and calls the compiled
internal op `trimul::_forward_cuda` (csrc/trimul.cpp), which runs the kernels.
"""
import contextlib
from typing import Optional, Sequence

import torch

from . import archs
from ._codes import (AUTO_PATH, DTYPE_CODE, DTYPE_OF_CODE, OPERAND_DTYPE, PATH_CODE, PRECISION_CODE,
                     PRECISION_OF_CODE, kernel_mask)
from .backward import backward_plan, narrow_widths, product_reused, triangle_multiplication_backward
from .reference import triangle_multiplication_reference

Tensor = torch.Tensor

PARAM_NAMES = (
    "ln_in_weight", "ln_in_bias",
    "proj_a_weight", "proj_a_bias", "gate_a_weight", "gate_a_bias",
    "proj_b_weight", "proj_b_bias", "gate_b_weight", "gate_b_bias",
    "ln_out_weight", "ln_out_bias",
    "out_proj_weight", "out_proj_bias", "out_gate_weight", "out_gate_bias",
)
REQUIRED_PARAMS = {"proj_a_weight", "gate_a_weight", "proj_b_weight", "gate_b_weight",
                   "out_proj_weight", "out_gate_weight"}
DIRECTIONS = ("incoming", "outgoing")
GATE_INPUTS = ("input", "normalized")
PRECISIONS = ("default", "ieee", "tf32", "bf16", "fp16")
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_FLOAT_DTYPES = frozenset(_X_DTYPES)

SCHEMA = (
    "forward(Tensor x, Tensor? mask, "
    + ", ".join(f"Tensor{'' if n in REQUIRED_PARAMS else '?'} {n}" for n in PARAM_NAMES)
    + ", str direction='incoming', str gate_input='input', float eps=1e-05, "
      "str precision='default') -> Tensor"
)


class TrimulValueError(ValueError, RuntimeError):
    """A bad shape, device or option. Also a RuntimeError, like torch's own checks."""


class TrimulTypeError(TypeError, RuntimeError):
    """A bad dtype. Also a RuntimeError, like torch's own checks."""


def _shape(t) -> tuple:
    return tuple(t.shape)


def check_options(where: str, direction, gate_input, precision):
    """Raises for an unknown direction, gate_input or precision."""
    for name, value, allowed in (("direction", direction, DIRECTIONS), ("gate_input", gate_input, GATE_INPUTS),
                                 ("precision", precision, PRECISIONS)):
        if value not in allowed:
            raise TrimulValueError(f"{where}: unknown {name} {value!r}, expected one of {', '.join(map(repr, allowed))}")


def _expected_shapes(P, H):
    """The shape of each parameter, in PARAM_NAMES' order."""
    return ((P,), (P,), (H, P), (H,), (H, P), (H,), (H, P), (H,), (H, P), (H,), (H,), (H,), (P, H), (P,), (P, P), (P,))


def check_inputs(x, mask, params: Sequence[Optional[Tensor]], direction, gate_input, eps, precision):
    """Raises a clear error for every invalid argument of trimul.forward; returns (N, P, H)."""
    op = "trimul.forward"
    if not isinstance(x, torch.Tensor):
        raise TrimulTypeError(f"{op}: x must be a tensor, got {type(x).__name__}")
    if x.dtype not in _X_DTYPES:
        raise TrimulTypeError(f"{op}: x must be float32, bfloat16, float16 or float64, got {x.dtype}")
    if x.dim() < 3:
        raise TrimulValueError(f"{op}: x must have shape (*batch, N, N, P), got {_shape(x)}")
    if x.shape[-3] != x.shape[-2]:
        raise TrimulValueError(
            f"{op}: x must be a square pair representation (*batch, N, N, P), got {_shape(x)} "
            f"({x.shape[-3]} != {x.shape[-2]})")
    check_options(op, direction, gate_input, precision)
    if not eps >= 0.0:
        raise TrimulValueError(f"{op}: eps must be a non-negative number, got {eps}")
    P = x.shape[-1]
    if P < 1:
        raise TrimulValueError(f"{op}: the pair dim P (x.shape[-1]) must be at least 1, got {_shape(x)}")
    wa = params[2]
    if not isinstance(wa, torch.Tensor) or wa.dim() != 2 or wa.shape[0] < 1:
        raise TrimulValueError(f"{op}: proj_a_weight must have shape (H, P) with H >= 1, got "
                               f"{_shape(wa) if isinstance(wa, torch.Tensor) else type(wa).__name__}")
    H = wa.shape[0]
    device = x.device
    for name, t, shape in zip(PARAM_NAMES, params, _expected_shapes(P, H)):
        if t is None:
            if name in REQUIRED_PARAMS:
                raise TrimulValueError(f"{op}: {name} is required, got None")
        elif type(t) is not torch.Tensor and not isinstance(t, torch.Tensor):
            raise TrimulTypeError(f"{op}: {name} must be a tensor or None, got {type(t).__name__}")
        elif t.shape != shape:
            raise TrimulValueError(f"{op}: {name} must have shape {shape} (P={P}, H={H}), got {_shape(t)}")
        elif t.dtype not in _FLOAT_DTYPES and not t.is_floating_point():
            raise TrimulTypeError(f"{op}: {name} must be a floating-point tensor, got {t.dtype}")
        elif t.device != device:
            raise TrimulValueError(f"{op}: {name} is on {t.device} but x is on {x.device}; "
                                   "all tensors must be on one device")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TrimulTypeError(f"{op}: mask must be a tensor or None, got {type(mask).__name__}")
        if _shape(mask) != _shape(x)[:-1]:
            raise TrimulValueError(f"{op}: mask must have shape {_shape(x)[:-1]} (x.shape[:-1]), got {_shape(mask)}")
        if mask.is_complex():
            raise TrimulTypeError(f"{op}: mask must be bool, integer or floating, got {mask.dtype}")
        if mask.device != x.device:
            raise TrimulValueError(f"{op}: mask is on {mask.device} but x is on {x.device}; "
                                   "all tensors must be on one device")
    return x.shape[-2], P, H


def matmul_tf32() -> bool:
    """Whether torch's CUDA matmuls take fp32 operands as TF32. torch keeps the setting twice: the
    flag `torch.backends.cuda.matmul.allow_tf32` (with `torch.set_float32_matmul_precision`) and
    `fp32_precision` (torch.backends.cuda.matmul's, else torch.backends' where that is "none"); its
    getters of the first raise once the second was set apart from it, and cuBLAS then follows the
    second."""
    try:
        return torch.backends.cuda.matmul.allow_tf32
    except RuntimeError:
        pass
    for precision in (torch.backends.cuda.matmul.fp32_precision, torch.backends.fp32_precision):
        if precision != "none":
            return precision == "tf32"
    return False


@contextlib.contextmanager
def cublas_tf32(on: bool = True):
    """torch's CUDA matmuls take fp32 operands as TF32 within, or with `on` False as full fp32 ones
    (both of torch's settings, so that they agree there); the settings as they were after."""
    if matmul_tf32() == on:
        yield
        return
    mm = torch.backends.cuda.matmul
    was = mm.fp32_precision
    mm.allow_tf32 = on
    try:
        yield
    finally:
        mm.allow_tf32 = not on
        mm.fp32_precision = was


def resolve_precision(dtype: torch.dtype, precision: str, tf32: Optional[bool] = None) -> str:
    """The precision a call runs at (SPEC section 3); `tf32`: matmul_tf32() where the caller has
    read it already."""
    if precision != "default":
        return precision
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if tf32 is None:
        tf32 = matmul_tf32()
    return "tf32" if dtype == torch.float32 and tf32 else "ieee"


_lib = torch.library.Library("trimul", "FRAGMENT")
_lib.define(SCHEMA)


def _reference(x, mask, params, direction, gate_input, eps, dtype=None):
    out = triangle_multiplication_reference(x, mask, *params, direction=direction, gate_input=gate_input, eps=eps,
                                            dtype=dtype)
    return out.to(x.dtype)


OPTION_DEFAULTS = {"direction": "incoming", "gate_input": "input", "eps": 1e-5, "precision": "default"}


def _unpack(args, kwargs):
    """(params, options) of a call as the dispatcher passes it: trailing
    arguments left at their schema defaults are not passed at all."""
    if len(args) == 20:  # every argument given (trimul.call's eager path always does)
        return args[:16], args[16:]
    params = list(args[:16]) + [kwargs.get(n) for n in PARAM_NAMES[len(args):]]
    given = dict(zip(OPTION_DEFAULTS, args[16:]))
    options = [given.get(k, kwargs.get(k, d)) for k, d in OPTION_DEFAULTS.items()]
    return params, options


def _forward_cpu(x, mask, *args, **kwargs):
    """The reference, in float32 (float64 for float64 pairs) whatever the precision, and in float64
    up to PYTORCH_BACKWARD_MAX_H (or _P), as the backward computes there (backward_plan):
    LayerNorm over so few channels of c turns float32's own rounding of c into errors past the ieee
    bound now and then at H = 2 (up to 1.7e-5; benchmarks/NOTES.md, "float32 arithmetic at a small H")."""
    params, (direction, gate_input, eps, precision) = _unpack(args, kwargs)
    check_inputs(x, mask, params, direction, gate_input, eps, precision)
    return _reference(x, mask, params, direction, gate_input, eps, backward_plan(x, params[2].shape[0], None)[0])


def _forward_cuda(x, mask, *args, **kwargs):
    return _run_cuda(x, mask, *_unpack(args, kwargs), False)[0]


_DIRECTION_CODE = {name: i for i, name in enumerate(DIRECTIONS)}
_GATE_INPUT_CODE = {name: i for i, name in enumerate(GATE_INPUTS)}


def _run_cuda(x, mask, params, options, keep_product: bool):
    """(out, product): the forward, and with `keep_product` its contraction's result where the
    backward will read it instead of computing it again (backward.product_reused; held from the
    forward to the backward: one N²·H tensor in the operand type); else None.

    The compiled op checks every argument itself (csrc/trimul.cpp: check_arguments), so
    check_inputs, whose checks of 16 parameters in Python cost more host time than the seed
    shape's kernel, runs first only where no kernel would check the call or where x or the mask
    is copied ahead of the op (not (B, N, N, P) with contiguous channels), and otherwise once a
    call has failed, to say which argument is at fault."""
    try:
        return _launch(x, mask, params, options, keep_product)
    except Exception:
        error = _argument_error(x, mask, params, options)
        if error is None:
            raise
        raise error from None


def _argument_error(x, mask, params, options):
    """check_inputs' error for these arguments, or None where it finds none."""
    try:
        check_inputs(x, mask, params, *options)
    except (TrimulValueError, TrimulTypeError) as e:
        return e
    return None


def _launch(x, mask, params, options, keep_product: bool):
    direction, gate_input, eps, precision = options
    shape = x.shape
    if x.dtype == torch.float64 or x.numel() == 0 or len(shape) < 3:  # no kernel runs to check the call
        check_inputs(x, mask, params, *options)
        if x.dtype == torch.float64:  # no float64 kernels: the reference, on the GPU
            return _reference(x, mask, params, direction, gate_input, eps), None
        _check_device_supported(x.get_device())
        return torch.empty(shape, dtype=x.dtype, device=x.device), None
    N, P = shape[-2], shape[-1]
    batched = len(shape) == 4  # (B, N, N, P) as the kernels take it: no views to make (each costs host time)
    if (shape[-3] != N or not eps >= 0 or (mask is not None and mask.shape != shape[:-1])
            or not batched or x.stride(-1) != 1):
        # what the op could not tell from the views it gets; and where x or the mask may be copied
        # below, before that copy (no kernel runs ahead of an argument error: SPEC section 4)
        check_inputs(x, mask, params, *options)
    _check_device_supported(x.get_device())
    x4 = x if batched else x.reshape(-1, N, N, P)
    if x4.stride(-1) != 1:
        x4 = x4.contiguous()
    m3 = kernel_mask(mask if mask is None or batched else mask.reshape(-1, N, N))
    # (at tf32 the contraction goes through torch's matmul where that takes fp32 products as TF32;
    # the setting matters to calls that may run at tf32 alone)
    tf32 = (x.dtype == torch.float32 or precision == "tf32") and matmul_tf32()
    resolved = resolve_precision(x.dtype, precision, tf32)
    if reference_runs(x4.shape[0], N, P, params[2].shape[0], x4.dtype, resolved, x4.get_device()):
        check_inputs(x, mask, params, *options)  # (the compiled op would have)
        with cublas_tf32(False):
            return _reference(x, mask, params, direction, gate_input, eps,
                              torch.float64 if resolved == "ieee" else None), None
    args = (x4, m3, *params, _DIRECTION_CODE[direction], _GATE_INPUT_CODE[gate_input], float(eps),
            PRECISION_CODE[resolved], _kernel_choice, tf32)
    product = None
    if keep_product and product_reused(x4, P, *backward_plan(x4, params[2].shape[0], resolved)[1:]):
        out, product = torch.ops.trimul._forward_keep_product_cuda(*args)
        if product.numel() == 0:  # (the call took a path without one: fused_small)
            product = None
    else:
        out = torch.ops.trimul._forward_cuda(*args)
    return (out if batched else out.view(shape)), product


_kernel_choice = AUTO_PATH

# Up to this hidden width a call at a rounded precision (bf16, fp16, tf32) that the dispatcher
# sends to the tiled stages runs the reference formula in float32 instead: LayerNorm over so few
# channels of c turns the operands' rounding into errors past the bound (over two channels it is
# +-1 by the sign of c1 - c2). Counted with rounded operands: bf16 at H = 2 past 1.2e-2 in most
# draws (up to 0.15), at H = 3 in about one in ten (up to 0.058), at H = 4 within it (0.011);
# tf32 at H = 2 past 2e-3 in 70 of 100 draws, at H = 3 in 3 (benchmarks/NOTES.md, "A small H at
# rounded precisions"). fused_small computes in fp32 at every precision and keeps the shapes it takes,
# but for an fp32 pair at ieee: float32's own rounding of c passes the ieee bound now and then at
# H = 2 (up to 1.7e-5 on the CPU), so up to PYTORCH_BACKWARD_MAX_H (or PYTORCH_BACKWARD_MAX_P, the
# input LayerNorm's) that call runs the reference in float64, as its backward does
# (benchmarks/NOTES.md, "float32 arithmetic at a small H").
FLOAT32_FORWARD_MAX_H = 4


def reference_runs(B: int, N: int, P: int, H: int, dtype: torch.dtype, resolved: str, device: int) -> bool:
    """Whether a CUDA call on a (B, N, N, P) pair of a kernel dtype with hidden width H at the
    resolved precision runs the reference rather than the kernels: in float32 at a rounded
    precision (FLOAT32_FORWARD_MAX_H, where the dispatcher picks the tiled stages), in float64 for an
    fp32 pair at ieee (PYTORCH_BACKWARD_MAX_H or _P, whatever it picks); not where a path is forced."""
    if _kernel_choice != AUTO_PATH:
        return False
    if resolved == "ieee":
        return dtype == torch.float32 and narrow_widths(P, H)
    if H > FLOAT32_FORWARD_MAX_H:
        return False
    path = torch.ops.trimul._plan(B, N, P, H, PRECISION_CODE[resolved], DTYPE_CODE[dtype], device)[0]
    return path != PATH_CODE["fused_small"]


@contextlib.contextmanager
def kernel_override(path: str):
    """Within the block, CUDA calls take `path` ("fused_small", "tiled",
    "tiled_sync": the tensor-core stages without wgmma, "tiled_chunked": the
    wgmma input stage streaming its weights, or "tiled_fp32")
    instead of the dispatcher's choice, where it can run; for tests and
    benchmarks."""
    global _kernel_choice
    if path not in PATH_CODE:
        raise TrimulValueError(f"kernel_override: unknown path {path!r}, expected one of "
                               f"{', '.join(map(repr, PATH_CODE))}")
    saved, _kernel_choice = _kernel_choice, PATH_CODE[path]
    try:
        yield
    finally:
        _kernel_choice = saved


_DEVICE_SUPPORTED = {}


def _check_device_supported(index: int):
    """A clear error, before any launch, where this build has no kernel for the GPU `index`."""
    known = _DEVICE_SUPPORTED.get(index)
    if known is None:
        if not hasattr(torch.ops.trimul, "_forward_cuda"):
            known = ("trimul was installed without its CUDA kernels (trimul._C is missing or failed to load; "
                     "see `python -m trimul.info`), so it cannot run on CUDA tensors")
        else:
            cc = torch.cuda.get_device_capability(index)
            ok = archs.has_kernel_for(cc)
            known = "" if ok in (True, None) else (
                f"trimul: this build has no kernel for {torch.cuda.get_device_name(index)} (compute capability "
                f"{cc[0]}.{cc[1]}); it holds {archs.describe()}. Install a wheel built with "
                f"TORCH_CUDA_ARCH_LIST including {cc[0]}.{cc[1]} (see `python -m trimul.info`)")
        _DEVICE_SUPPORTED[index] = known
    if known:
        raise RuntimeError(known)


def _forward_fake(x, mask, *args, **kwargs):
    params, (direction, gate_input, eps, precision) = _unpack(args, kwargs)
    check_inputs(x, mask, params, direction, gate_input, eps, precision)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _forward_vmap(info, in_dims, x, mask, *args):
    """torch.func.vmap of the op: a dim mapped over the pair or its mask is one more batch dim of a
    single call (the other of the two expanded along it); one mapped over a parameter (an ensemble
    of layers) takes a call per member."""
    x_dim, mask_dim, param_dims = in_dims[0], in_dims[1], in_dims[2:2 + len(PARAM_NAMES)]
    params, options = args[:len(PARAM_NAMES)], args[len(PARAM_NAMES):]

    def leading(t, dim):  # the mapped dim first, or an unmapped tensor expanded along one
        return t.movedim(dim, 0) if dim is not None else t.expand(info.batch_size, *t.shape)

    if all(d is None for d in param_dims):
        mask = None if mask is None else leading(mask, mask_dim)
        return torch.ops.trimul.forward(leading(x, x_dim), mask, *params, *options), 0

    def member(t, dim, i):
        return t if t is None or dim is None else t.select(dim, i)

    outs = [torch.ops.trimul.forward(member(x, x_dim, i), member(mask, mask_dim, i),
                                     *(member(t, d, i) for t, d in zip(params, param_dims)), *options)
            for i in range(info.batch_size)]
    return torch.stack(outs), 0


_lib.impl("forward", _forward_cpu, "CPU")
_lib.impl("forward", _forward_cuda, "CUDA")
torch.library.register_fake("trimul::forward", _forward_fake, lib=_lib)
torch.library.register_vmap("trimul::forward", _forward_vmap, lib=_lib)


def register_kernel_fakes():
    """Fake (meta) functions of the compiled internal ops the backward calls on
    CUDA (csrc/trimul.cpp), so that torch.compile can trace it; called once
    trimul._C has registered them."""
    from . import _C

    def input_products(x, mask, *args):
        B, N, _, _ = x.shape
        H = args[2].shape[0]
        S = -(-N // 8) * 8  # csrc/trimul.h: padded_extent
        dtype = OPERAND_DTYPE[PRECISION_OF_CODE[args[-1]]]
        return (x.new_empty((B * H, S, S), dtype=dtype), x.new_empty((B * H, S, S), dtype=dtype),
                x.new_empty((sum(_C.packed_sizes(x.shape[-1], H)),), dtype=torch.float32))

    def fp16_headroom(x, mask, *params):
        return x.new_empty((1,), dtype=torch.float32)

    def input_products_fp16(x, mask, *args):
        a, b, packed = input_products(x, mask, *args, PRECISION_CODE["fp16"])
        return a, b, packed, x.new_empty((_C.RANGE_SCALES_INTS,), dtype=torch.int32)

    def rows_to_pair_fp16(rows, S, scales):
        return (rows.new_empty((rows.shape[0], rows.shape[3], S, S), dtype=torch.float16),
                rows.new_empty((_C.GRAD_SCALE_INTS,), dtype=torch.int32))

    def pair_to_rows_fp16(pair, N, scales):
        return pair.new_empty((pair.shape[0], N, N, pair.shape[1]), dtype=torch.float32)

    def pair_to_rows(t, N, swap):
        return t.new_empty((t.shape[0], N, N, t.shape[1]))

    def rows_to_pair(rows, S, swap):
        return rows.new_empty((rows.shape[0], rows.shape[3], S, S))

    def sums(like, cols):  # the column sums, fp32
        return like.new_empty((cols,), dtype=torch.float32)

    def rows_layer_norm(src, w, b, eps, out_dtype):
        return src.new_empty(src.shape, dtype=DTYPE_OF_CODE[out_dtype])

    def rows_gate_grads(y, gpre, G):
        return y.new_empty(y.shape), y.new_empty(y.shape), sums(y, 2 * y.shape[1])

    def rows_gating_grads(pre, da, db, mask):
        return da.new_empty(pre.shape), sums(pre, pre.shape[1])

    def rows_layer_norm_back(src, g, residual, w, eps, residual_mode, into):
        return sums(src, 2 * src.shape[1])

    def input_stage_back(x, mask, *args):
        # args: the 16 parameters, da, db, dx, direction, gate_input, eps, precision, step
        P, H = x.shape[-1], args[2].shape[0]
        return sums(x, 2 * P), x.new_empty((4 * H, P), dtype=torch.float32), sums(x, 4 * H)

    def backward_fused(grad, x, mask, *args):
        # args: the 16 parameters, direction, gate_input, eps, precision, step, product
        P, H = x.shape[-1], args[2].shape[0]
        dx_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
        n_grads = 4 * P + 4 * H * P + 6 * H + P * H + P * P  # the 16 parameters' sizes
        return x.new_empty(x.shape, dtype=dx_dtype), sums(x, n_grads)

    torch.library.register_fake("trimul::_input_products_cuda", input_products, lib=_lib)
    torch.library.register_fake("trimul::_fp16_headroom_cuda", fp16_headroom, lib=_lib)
    torch.library.register_fake("trimul::_input_products_fp16_cuda", input_products_fp16, lib=_lib)
    torch.library.register_fake("trimul::_rows_to_pair_fp16", rows_to_pair_fp16, lib=_lib)
    torch.library.register_fake("trimul::_pair_to_rows_fp16", pair_to_rows_fp16, lib=_lib)
    torch.library.register_fake("trimul::_backward_fused", backward_fused, lib=_lib)
    torch.library.register_fake("trimul::_input_stage_back_cuda", input_stage_back, lib=_lib)
    torch.library.register_fake("trimul::_rows_layer_norm", rows_layer_norm, lib=_lib)
    torch.library.register_fake("trimul::_rows_gate_grads", rows_gate_grads, lib=_lib)
    torch.library.register_fake("trimul::_rows_gating_grads", rows_gating_grads, lib=_lib)
    torch.library.register_fake("trimul::_rows_layer_norm_back", rows_layer_norm_back, lib=_lib)
    torch.library.register_fake("trimul::_pair_to_rows", pair_to_rows, lib=_lib)
    torch.library.register_fake("trimul::_rows_to_pair", rows_to_pair, lib=_lib)


# ---- autocast ---------------------------------------------------------------
# Under torch.autocast a float32 pair runs at the autocast dtype (its bf16 or
# fp16 path) and the result comes back in that dtype, as a matmul's would.
# Parameters stay as they are: the kernels read any float dtype.

def _autocast_impl(device_type):
    def impl(x, mask, *args, **kwargs):
        dtype = torch.get_autocast_dtype(device_type)
        if x.dtype == torch.float32:
            params, options = _unpack(args, kwargs)
            check_inputs(x, mask, params, *options)  # an argument error before the conversion's kernel
            x = x.to(dtype)
        with torch.autocast(device_type, enabled=False):
            return torch.ops.trimul.forward(x, mask, *args, **kwargs)

    return impl


_lib.impl("forward", _autocast_impl("cuda"), "AutocastCUDA")
_lib.impl("forward", _autocast_impl("cpu"), "AutocastCPU")


# ---- autograd -----------------------------------------------------------------
# Gradients from the update's backward written out stage by stage
# (trimul/backward.py), in float32 (float64 for float64 inputs), from the saved
# inputs: projections, gates, a and b are recomputed, per-position work runs in
# chunks of positions. Matrix products take the forward's precision where kernels
# ran the forward (operands in bf16/fp16 at those precisions, float32 as torch's
# matmul flags say else); at the smallest hidden or pair widths the whole backward
# runs in PyTorch's ops, in float64, and where the reference ran the forward (CPU
# tensors, float64 pairs) in float32 (float64) too: backward.backward_plan.


def _setup_context(ctx, inputs, output):
    x, mask, *rest = inputs
    _save(ctx, x, mask, *_unpack(rest, {}), len(inputs))


def _save(ctx, x, mask, params, options, n_inputs: int):
    """What _gradients reads: the inputs, the options and how many inputs the call had."""
    ctx.options, ctx.n_inputs = options, n_inputs
    ctx.save_for_backward(x, mask, *params)


def _gradients(ctx, grad, wants):
    """The gradients of a call's inputs (x, mask, params..., options as passed), `wants` saying which."""
    x, mask, *params = ctx.saved_tensors
    direction, gate_input, eps, precision = ctx.options
    resolved = resolve_precision(x.dtype, precision)
    # the forward's contraction result, where kept: it becomes dc, so a second backward (retain_graph)
    # computes c again
    product, ctx.product = getattr(ctx, "product", None), None
    dtype, matmul_dtype, kernels_precision = backward_plan(x, params[2].shape[0], resolved)
    leaf_wants = [wants[0], *wants[2:18]]  # x's and the parameters'
    # create_graph=True (the engine runs a backward with grad mode on only then), with something to
    # differentiate: gradients that are differentiable themselves
    if _needs_grad(grad, x, *params):
        result = _differentiable_gradients(grad, x, mask, params, direction, gate_input, eps, dtype, leaf_wants)
    else:
        # the backward's fp32 PyTorch products (cuBLAS) take TF32 operands at tf32 whatever torch's
        # setting (off by default), and full fp32 ones otherwise (ieee, and PyTorch's ops alone at a
        # small H: backward_plan) with the setting on as well; under torch.compile its products run
        # as torch's setting is when they run
        if not x.is_cuda or matmul_dtype != torch.float32:
            products = contextlib.nullcontext()
        else:
            products = cublas_tf32(kernels_precision == "tf32")
        with products:
            grads = triangle_multiplication_backward(grad, x, mask, params, direction, gate_input, eps, dtype,
                                                     matmul_dtype, kernels_precision,
                                                     [t.dtype if t is not None else None for t in (x, *params)],
                                                     product=product)
        result = [g if want else None for g, want in zip(grads, leaf_wants)]
    return (result[0], None, *result[1:], None, None, None, None)[:ctx.n_inputs]


def _differentiable_gradients(grad, x, mask, params, direction, gate_input, eps, dtype, leaf_wants):
    """x's and the parameters' gradients (None where not wanted), for a backward that records its
    own graph (create_graph=True: double backward, gradient penalties, Hessian-vector products):
    autograd of the reference formula in `dtype` (the backward's: float32, float64 for float64
    pairs and the narrow widths), whose operations are differentiable again, where the kernels'
    backward is not. As slow and as large as eager PyTorch's backward."""
    leaves = [x, *params]
    wanted = [t is not None and want for t, want in zip(leaves, leaf_wants)]
    inputs = [t for t, w in zip(leaves, wanted) if w]
    out = triangle_multiplication_reference(x, mask, *params, direction=direction, gate_input=gate_input, eps=eps,
                                            dtype=dtype)
    got = iter(torch.autograd.grad(out, inputs, grad.to(dtype), create_graph=True, allow_unused=True))
    result = []
    for t, w in zip(leaves, wanted):
        g = next(got) if w else None
        if w and g is None:  # (a parameter the output does not depend on)
            g = torch.zeros_like(t)
        result.append(None if g is None else g.to(t.dtype))
    return result


def _needs_grad(*args) -> bool:
    return torch.is_grad_enabled() and torch._C._any_requires_grad(*args)


# The keys below autograd of a plain CUDA call: nothing between autograd and the CUDA kernel
# (ADInplaceOrView, which the dispatcher may leave in, is a fallthrough for this op).
_CUDA_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
_PLAIN_CUDA_KEYS = frozenset((_CUDA_KEYS.raw_repr(), _CUDA_KEYS.add(torch._C.DispatchKey.ADInplaceOrView).raw_repr()))


def _below_autograd(keyset, x, mask, rest, unpacked, keep_product: bool = False):
    """(out, product): the op on from the dispatch keys below autograd (the CUDA kernel, or a mode
    below it), product as _run_cuda keeps it (None after a redispatch); `unpacked` is
    _unpack(rest). With nothing in between, the CUDA kernel is called directly: a redispatch
    costs as much host time as the seed shape's kernel."""
    below = keyset & torch._C._after_autograd_keyset
    with torch._C._AutoDispatchBelowAutograd():
        if below.raw_repr() in _PLAIN_CUDA_KEYS:
            return _run_cuda(x, mask, *unpacked, keep_product)
        return torch.ops.trimul.forward.default.redispatch(below, x, mask, *rest), None


class _Forward(torch.autograd.Function):
    """The op with its gradients: apply(keyset, x, mask, *rest). Given the
    dispatch key set (from the op's CUDA Autograd kernel below), the call goes on
    through the dispatcher below autograd; given None (trimul.call's eager CUDA
    path), straight to the CUDA implementation."""

    # forward(ctx, ...) rather than a separate setup_context: apply() then skips
    # binding the arguments to forward's signature, which costs as much as the rest.
    @staticmethod
    def forward(ctx, keyset, x, mask, *rest):
        # The contraction's result is kept on ctx, out of reach of saved-tensor hooks: none are
        # kept where such hooks run (activation checkpointing, offloading), which would hold it.
        keep = torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        unpacked = _unpack(rest, {})
        out, ctx.product = (_run_cuda(x, mask, *unpacked, keep) if keyset is None
                            else _below_autograd(keyset, x, mask, rest, unpacked, keep_product=keep))
        _save(ctx, x, mask, *unpacked, 2 + len(rest))
        return out

    @staticmethod
    def backward(ctx, grad):
        return (None, *_gradients(ctx, grad, ctx.needs_input_grad[1:]))

    # Function.apply without the Python layer torch before 2.12 puts around it (functorch's
    # checks: for calls made where no functorch transform is active).
    apply_eager = torch._C._FunctionBase.__dict__["apply"]


def _backward(ctx, grad):
    return _gradients(ctx, grad, ctx.needs_input_grad)


torch.library.register_autograd("trimul::forward", _backward, setup_context=_setup_context, lib=_lib)


def _autograd_cuda(keyset, x, mask, *rest):
    """The op's Autograd kernel on CUDA: what register_autograd's kernel (above,
    for every other device) does, with the same setup and backward, without its
    generic wrapper, whose filling in of the schema's defaults alone costs more
    host time than the seed shape's whole forward."""
    if _needs_grad(x, mask, *rest):
        # (under functorch's transforms, Function.apply's own handling of them)
        apply = _Forward.apply if torch._C._are_functorch_transforms_active() else _Forward.apply_eager
        return apply(keyset, x, mask, *rest)
    return _below_autograd(keyset, x, mask, rest, _unpack(rest, {}))[0]


_lib.impl("forward", _autograd_cuda, "AutogradCUDA", with_keyset=True)


def forward(x: Tensor, mask: Optional[Tensor], *params: Optional[Tensor], direction: str = "incoming",
            gate_input: str = "input", eps: float = 1e-5, precision: str = "default") -> Tensor:
    """torch.ops.trimul.forward with keyword options."""
    return call(x, mask, params, direction, gate_input, eps, precision)


# ---- the eager CUDA path ------------------------------------------------------
# What torch.ops.trimul.forward does for plain CUDA tensors in eager mode, with
# less host work: the dispatcher's trip through Python costs more than the seed
# shape's kernel. Anything else (torch.compile, autocast, tensor subclasses,
# dispatch or function modes, functorch transforms, jit tracing, CPU tensors)
# goes through the op.

def _plain_eager_cuda(x) -> bool:
    return (not torch.compiler.is_compiling() and type(x) is torch.Tensor and x.is_cuda
            and not torch.is_autocast_enabled("cuda") and not torch._C._len_torch_dispatch_stack()
            and not torch._C._is_torch_function_mode_enabled()
            and torch._C._functorch.peek_interpreter_stack() is None and not torch._C._get_tracing_state())


def call(x: Tensor, mask: Optional[Tensor], params: Sequence[Optional[Tensor]], direction: str = "incoming",
         gate_input: str = "input", eps: float = 1e-5, precision: str = "default") -> Tensor:
    """torch.ops.trimul.forward(x, mask, *params, direction, gate_input, eps,
    precision), the same results and gradients, with a shorter eager path for
    plain CUDA tensors."""
    if not _plain_eager_cuda(x) or len(params) != len(PARAM_NAMES):
        return torch.ops.trimul.forward(x, mask, *params, direction, gate_input, eps, precision)
    if _needs_grad(x, *params):
        return _Forward.apply_eager(None, x, mask, *params, direction, gate_input, eps, precision)
    return _run_cuda(x, mask, params, (direction, gate_input, eps, precision), False)[0]
