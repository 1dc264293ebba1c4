"""The update's backward, written out stage by stage (PyTorch ops, any device).

Saved from the forward: the inputs, and for an eager CUDA call on the tiled
pipeline the contraction's result c, one N²·H tensor in the operand type that
would take a batched GEMM of the forward's size to compute again.
Recomputed: LayerNorm statistics, projections and gates, a and b. Per-position
work (both LayerNorms, the four input projections, the output projection and
gate) runs over chunks of positions (one chunk up to CHUNK_ROWS positions, about
CHUNKS of them beyond), so at large N its intermediates never exist for the
whole pair at once; only a, b, dc and their gradients span it (at most four
N²·H tensors alive at a time, against a dozen for autograd through the
reference formula). The
triangle product and its two gradients take them channel-first, [batch, H, S,
S] with the contraction index contiguous, as plain batched matrix products;
the per-position stages take them position-major, [batch, N, N, H], each
tensor changing layout once as a whole (on CUDA by trimul's pair_layout
kernel, else by a permuted copy). On CUDA, a and b come from the forward's own
input stage (trimul::_input_products_cuda, S = N padded to a multiple of 8),
with every parameter in fp32 as that stage packs them (the fp32 LayerNorm
affines are views of that pack). At bf16/fp16 products with P and H multiples
of 16 up to 128 the same sequence runs as one op, trimul::_backward_fused
(csrc/trimul.cpp), around two kernels: the output stage's backward per chunk
(out_stage_back, which reads c channel-first and writes dc in its place) and
the input stage's front half (input_back: LayerNorm, the products and the
gating gradients, reading da and db as the contraction leaves them; its
resident form at P = 128 with four weight chunks also forms du = dpre W_in and
LayerNorm's gradient, which elsewhere a product and a row kernel do), and its
parameter-sized work, the output stage's weights and the gradients' assembly in
trimul.forward's order, in two small kernels (backward_params.cu). Other
calls on the tensor-core stages (tf32, ieee, 16-bit shapes the fused op does
not take) run the input stage's part through input_back as well
(trimul::_input_stage_back_cuda, where trimul._C.input_back_takes). Weight
gradients accumulate chunk after chunk in a fixed order: bitwise repeatable.

Precision follows the forward's (SPEC section 3): at bf16/fp16 every matrix
product takes operands in that type (fp32 accumulation) and a, b, dc, da, db
are stored in it; elementwise work and LayerNorm statistics stay in fp32. At
fp16 both keep c in fp16's range as the forward does (csrc/trimul.h: the
headroom of c; here on the projections' weights and biases times 2^-t). At
tf32, where the fp16 stages take the shape (the forward keeps c for it as fp32
rows, or c is computed again as they do), the contraction's gradients take fp16
operands, whose 10-bit significands are tf32's:
a and b from the fp16 input stage under the forward's power-of-two scales
(trimul::_input_products_fp16_cuda), dc scaled by a power of two from its largest
magnitude (trimul::_rows_to_pair_fp16); da and db come out in fp32 and
input_back undoes their scale as it reads them (csrc/trimul.h: GradScale).

Notation as SPEC section 1: xn = LN(x), a = (xn·Wpaᵀ + bpa) · σ(xn·Wgaᵀ + bga) · m,
b likewise, c = the triangle product of a and b, out = (LN(c)·Woᵀ + bo) · σ(u·Wgᵀ + bg).
"""
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from ._codes import DTYPE_CODE, OPERAND_DTYPE, PRECISION_CODE, kernel_mask
from .reference import layer_norm as reference_layer_norm
from .reference import layer_norm_dtype

Tensor = torch.Tensor

# Per-position stages run over chunks of at least CHUNK_ROWS positions, about
# CHUNKS of them at large N: their intermediates (~11 values per position and
# hidden unit, in the operand type) then take under one N²·H tensor's worth at
# large N. A chunk costs ~30 launches and, on the H200, ~0.14 ms a step beyond
# its share of the work (the persistent kernels' last tiles, the per-chunk
# weight-gradient products and sums: benchmarks/NOTES.md), so a pair of up to
# 2^20 positions (N = 1024 at batch 1) runs as one chunk.
CHUNKS = 16
CHUNK_ROWS = 1 << 20
_HALF_TYPES = (torch.bfloat16, torch.float16)


def _affine(t: Optional[Tensor], fill: float, n: int, dtype: torch.dtype, device) -> Tensor:
    return torch.full((n,), fill, dtype=dtype, device=device) if t is None else t.to(dtype)


def _chunks(batch: int, N: int, step: int):
    """(b0, b1, i0, i1) blocks of positions [b0:b1, i0:i1, :] of at most about `step`
    positions each: whole batch entries when one holds fewer, else runs of rows, a
    multiple of 8 of them (the chunks trimul::_backward_fused takes too, whose input_back
    reads an incoming chunk's da and db in 16-byte runs from its first row on; trimul._C.chunks
    gives that op's list). As many chunks as `step` asks for, of even sizes."""
    def ceil_div(a: int, b: int) -> int:
        return -(-a // b)

    if N * N <= step:
        n = ceil_div(batch, step // (N * N))
        return [(k * batch // n, (k + 1) * batch // n, 0, N) for k in range(n)]
    units = ceil_div(N, 8)  # n runs of 8-row units each
    n = ceil_div(units, max(1, step // N // 8))
    return [(b, b + 1, 8 * (k * units // n), min(8 * ((k + 1) * units // n), N))
            for b in range(batch) for k in range(n)]


def _permuted_to_rows(t: Tensor, N: int, swap: bool) -> Tensor:
    """[batch, H, S, S] -> [batch, N, N, H] contiguous: rows[b, p, q, h] = t[b, h, p, q] (t[b, h, q, p] with swap)."""
    return t.permute((0, 3, 2, 1) if swap else (0, 2, 3, 1))[:, :N, :N].contiguous()


def _permuted_to_pair(rows: Tensor, S: int, swap: bool) -> Tensor:
    """The inverse of _permuted_to_rows (S == N here)."""
    return rows.permute(0, 3, 2, 1).contiguous() if swap else rows.permute(0, 3, 1, 2).contiguous()


_CUDA_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PROJECTIONS = (2, 3, 6, 7)  # proj_a's and proj_b's weights and biases in trimul.forward's parameters

# Up to this hidden width the backward runs in PyTorch's ops alone, on either device, in float64
# (16-bit pairs too: at a small pair width float32 is not enough for them either, below). There a
# few positions whose c has nearly equal channels dominate every gradient upstream of the output
# LayerNorm (its rstd large there) and carry the operands' rounding amplified: with 16-bit products
# the gradients read 2-20x their bound at H <= 6 and past it now and then at H = 8, with tf32 ones
# up to 14x at H <= 6, and with float32 arithmetic alone (IEEE) up to 150x at H = 2, past it in 1
# of 300 draws at H = 4; at H >= 12 each stays within it (benchmarks/NOTES.md, "A small H at
# rounded precisions" and "float32 arithmetic at a small H").
PYTORCH_BACKWARD_MAX_H = 8
# And up to this pair width, for the input LayerNorm's sake: over so few channels its gradient is a
# near-cancellation wherever a position's values are not nearly equal, which the operands' rounding
# does not share. With bf16 products the gradients read past twice the bound in 55 of 100 draws at
# P = 2 (up to 0.35), 22 at P = 3, 5 at P = 4 and 0.5-3 of 100 at P = 5-8 (the input LayerNorm's
# affine and a gate's weight), none at P >= 12 in 200; with float32 arithmetic at IEEE in 105 of
# 200 at P = 2 (up to 4.8e-4), at P = 3 up to 1.8e-5 of the 2e-5; for 16-bit pairs in float32 x's
# gradient up to 27x its bound at P = 2 (benchmarks/NOTES.md, "float32 arithmetic at a small H").
PYTORCH_BACKWARD_MAX_P = 8


def narrow_widths(P: int, H: int) -> bool:
    """Whether a call with pair width P and hidden width H is as narrow as PYTORCH_BACKWARD_MAX_H or
    _P, where the backward computes in float64 (backward_plan) and so does an fp32 pair's forward
    at ieee (trimul.ops.reference_runs)."""
    return H <= PYTORCH_BACKWARD_MAX_H or P <= PYTORCH_BACKWARD_MAX_P


def backward_plan(x: Tensor, H: int, precision: str):
    """(the dtype the backward computes in, the operand type of its matrix products, the precision
    trimul's kernels run it at, None for PyTorch's ops alone) for a call on x with hidden width H at
    the resolved `precision`. float32 with the forward's operand type where kernels ran the forward;
    up to PYTORCH_BACKWARD_MAX_H (or a pair width up to PYTORCH_BACKWARD_MAX_P) PyTorch's ops in
    float64, whatever the pair's dtype; where the reference ran it (CPU tensors, float64 pairs), its
    float32 (float64) evaluation, whatever the precision: 16-bit operands there would differentiate
    another function than the forward computed, and less accurately."""
    if x.dtype == torch.float64 or narrow_widths(x.shape[-1], H):
        return torch.float64, torch.float64, None
    if not x.is_cuda:
        return torch.float32, torch.float32, None
    return torch.float32, OPERAND_DTYPE[precision], precision


def _grads_of(buf: Tensor, sizes: Sequence[int], params: Sequence[Optional[Tensor]],
              wants: Sequence[Optional[torch.dtype]]) -> List[Optional[Tensor]]:
    """buf split along its first dim at `sizes` into the gradients of `params` (None where a
    parameter is absent), each in its parameter's shape and the dtype wanted: one conversion of
    the whole buffer where the present parameters all want the same dtype."""
    kinds = {w for t, w in zip(params, wants) if t is not None}
    if len(kinds) == 1:
        buf = buf.to(kinds.pop())
    # (a vector's piece has its shape already: no view, whose call costs host time on every step)
    return [None if t is None else _shaped(g if g.dtype == w else g.to(w), t)
            for g, t, w in zip(buf.split_with_sizes(list(sizes)), params, wants)]


def _shaped(g: Tensor, t: Tensor) -> Tensor:
    """g, a 1-D piece of t's numel, in t's shape."""
    return g if t.dim() == 1 else g.view(t.shape)


def _kernels_for(x: Tensor, mdt: torch.dtype, lines: int):
    """The extension trimul._C (its kernels' limits and the pack's layout) where its CUDA kernels
    take this backward (a CUDA pair of a kernel dtype, products in one, something to compute), else None."""
    if not (x.is_cuda and x.dtype in _CUDA_KERNEL_DTYPES and mdt in _CUDA_KERNEL_DTYPES and lines > 0):
        return None
    if not _EXTENSION and hasattr(torch.ops.trimul, "_input_products_cuda"):
        from . import _C  # (an import statement costs host time on every call: kept once loaded)
        _EXTENSION.append(_C)
    return _EXTENSION[0] if _EXTENSION else None


_EXTENSION = []  # trimul._C, once its CUDA ops are registered
# torch's bmm with fp16 operands and an fp32 result (the tf32 backward's fp16 products)
_BMM_FP32_OUT = "dtype" in torch.ops.aten.bmm.overloads()
_MM_FP32_OUT = "dtype" in torch.ops.aten.mm.overloads()


def _pre_activations(u: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    """u wᵀ + b (u and w in the operand type, b as the parameter is), in float32 where the operands
    are 16-bit on CUDA, as the forward's kernels hold it: where a gate saturates, 1 - sigmoid(g) ~
    exp(-g) turns an absolute error of g into a relative one of its gradients, and g rounded to
    bf16 (or its bias) errs by up to 0.03-0.06 at g = 12-20 (3-6 % of the gate's gradients)."""
    if u.dtype in _HALF_TYPES and u.is_cuda and _MM_FP32_OUT:
        out = torch.mm(u, w.t(), out_dtype=torch.float32)
        return out if b is None else out.add_(b)
    return F.linear(u, w, None if b is None else b.to(u.dtype))


def _gate_from_x(x: Tensor, w: Tensor, w_sums: Tensor, b: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    """x wᵀ + b for the output gate that reads x itself, in `dtype`, centred: (x - mean) wᵀ + mean w_sums
    + b, with x - mean in w's (the operand) type and w_sums the row sums of the unrounded weights. x wᵀ
    with x or w rounded errs by about |x| times their rounding, which rows of x with a mean far from zero
    against their spread make large; where the gate saturates its gradients go as exp(-|g|) and carry
    that absolute error as a relative one (benchmarks/NOTES.md, "The output gate's gradients"). Centred,
    the rounding meets x - mean alone."""
    xf = x.to(dtype)
    mean = xf.mean(-1, keepdim=True)
    g = _pre_activations((xf - mean).to(w.dtype), w, None).to(dtype).addcmul_(mean, w_sums)
    return g if b is None else g.add_(b)


def fused_backward_runs(x: Tensor, P: int, H: int, mdt: Optional[torch.dtype], precision: Optional[str]) -> bool:
    """Whether the backward of a call on x (float32 gradients, products in `mdt`) runs as
    trimul::_backward_fused."""
    if mdt not in _HALF_TYPES or precision is None:
        return False
    ext = _kernels_for(x, mdt, x.numel() // P)
    return ext is not None and _out_stage_back_runs(ext, x, P, H)


def product_reused(x: Tensor, P: int, mdt: Optional[torch.dtype], precision: Optional[str]) -> bool:
    """Whether the backward of a call on x (products in `mdt`) takes a product the forward kept
    (trimul::_forward_keep_product_cuda) in place of its own contraction: where the extension's
    kernels run it (the fused op, or the stage-by-stage sequence around the forward's input stage;
    at fp16 products both scale c as the forward does: csrc/trimul.h, "The headroom of c")."""
    return precision is not None and _kernels_for(x, mdt, x.numel() // P) is not None


def _out_stage_back_runs(ext, x: Tensor, P: int, H: int) -> bool:
    """Whether out_stage_back (in the extension `ext`, trimul._C) takes this call: P and H multiples
    of 16 up to its width, and the device's shared memory per block holds what the kernel needs at
    that width."""
    if P % 16 or H % 16 or max(P, H) > ext.OUT_BACK_MAX_WIDTH:
        return False
    fits = _OUT_BACK_FITS.get(x.device)
    if fits is None:
        fits = torch.cuda.get_device_properties(x.device).shared_memory_per_block_optin >= ext.OUT_STAGE_BACK_SMEM
        _OUT_BACK_FITS[x.device] = fits
    return fits


_OUT_BACK_FITS = {}  # device -> whether out_stage_back's shared memory fits there


class _RowOps:
    """The backward's per-position elementwise steps, on rows (positions, values):
    trimul's backward_rows kernels (csrc/cuda/backward_rows.cu) where `kernels`,
    else the same formulas in PyTorch. Values are computed in `dtype`; outputs
    come back in the storage type asked for, column sums in `dtype`."""

    def __init__(self, kernels: bool, dtype: torch.dtype):
        self.kernels, self.dtype = kernels, dtype

    def layer_norm(self, src, w, b, eps, out_dtype):
        if self.kernels:
            return torch.ops.trimul._rows_layer_norm(src.contiguous(), w.contiguous(), b.contiguous(), eps,
                                                    DTYPE_CODE[out_dtype])
        return reference_layer_norm(src.to(self.dtype), w, b, eps).to(out_dtype)

    def gate_grads(self, y, gpre, G):
        """s = sigmoid(gpre): dy = G s, dgp = dy y (1 - s) in y's dtype; the column sums of dy, then dgp.
        1 - s as sigmoid(-gpre): rounded s loses 1 - s where the gate saturates (all of it past
        gpre = 17 in float32, its relative error 1e-4 at gpre = 8)."""
        if self.kernels:
            return torch.ops.trimul._rows_gate_grads(y.contiguous(), gpre.contiguous(), G.contiguous())
        gpre = gpre.to(self.dtype)
        s = torch.sigmoid(gpre)
        dy = G.to(self.dtype) * s
        dgp = dy * y.to(self.dtype) * torch.sigmoid(-gpre)
        return dy.to(y.dtype), dgp.to(y.dtype), torch.cat([dy.sum(0), dgp.sum(0)])

    def gating_grads(self, pre, da, db, m):
        """pre = (pa | ga | pb | gb), a = pa sigmoid(ga) m, b likewise: d(pa | ga | pb | gb) in da's
        dtype (the operand type of the products that read it; pre may be wider) from da, db; its
        column sums. 1 - sigmoid(g) as sigmoid(-g), as in gate_grads."""
        if self.kernels:
            return torch.ops.trimul._rows_gating_grads(pre.contiguous(), da.contiguous(), db.contiguous(),
                                                       None if m is None else m.contiguous())
        H, out_dtype = da.shape[1], da.dtype
        pa, ga, pb, gb = pre.to(self.dtype).split(H, dim=-1)
        sa, sb = torch.sigmoid(ga), torch.sigmoid(gb)
        da, db = da.to(self.dtype), db.to(self.dtype)
        if m is not None:
            da, db = da * m, db * m
        dpa, dpb = da * sa, db * sb
        dpre = torch.cat([dpa, dpa * pa * torch.sigmoid(-ga), dpb, dpb * pb * torch.sigmoid(-gb)], dim=-1)
        return dpre.to(out_dtype), dpre.sum(0)

    def layer_norm_back(self, src, g, residual, mode, w, eps, into):
        """The gradient of LayerNorm(src; w) for the output gradient g, with `residual` added to g
        (mode 1) or to the result (mode 2), written into the rows `into` (contiguous; it may be src
        or the residual itself); returns the column sums of g xhat, then g (w's and b's gradients)."""
        if self.kernels:
            return torch.ops.trimul._rows_layer_norm_back(
                src.contiguous(), g.contiguous(), None if residual is None else residual.contiguous(), w.contiguous(),
                eps, mode, into)
        work = layer_norm_dtype(self.dtype)
        x = src.to(work)
        xhat, mean, rstd = torch.native_layer_norm(x, [x.shape[-1]], None, None, eps)
        g = g.to(work)
        if mode == 1:
            g = g + residual.to(work)
        out = torch.ops.aten.native_layer_norm_backward(g, x, [x.shape[-1]], mean, rstd,
                                                        None if w is None else w.to(work), None,
                                                        [True, False, False])[0]
        if mode == 2:
            out = out + residual.to(work)
        into.copy_(out)
        return torch.cat([(g * xhat).sum(0), g.sum(0)]).to(self.dtype)


def triangle_multiplication_backward(grad: Tensor, x: Tensor, mask: Optional[Tensor],
                                     params: Sequence[Optional[Tensor]], direction: str, gate_input: str,
                                     eps: float, dtype: torch.dtype,
                                     matmul_dtype: Optional[torch.dtype] = None,
                                     precision: Optional[str] = None,
                                     grad_dtypes: Optional[Sequence[Optional[torch.dtype]]] = None,
                                     product: Optional[Tensor] = None) -> List[Optional[Tensor]]:
    """Gradients of the update for x and the 16 parameters (trimul.forward's
    order; None for absent parameters), computed in `dtype` and returned in
    `grad_dtypes` (x's, then each parameter's; default: `dtype`, dx in x's dtype
    when that is bf16/fp16); matrix products take operands in `matmul_dtype`
    (default `dtype`), which also stores the N²·H tensors. `precision`
    (resolved: ieee, tf32, bf16, fp16), where given, lets a CUDA call run trimul's kernels: a
    and b recomputed by the forward's input stage at that precision, and the backward's own; None:
    PyTorch's ops alone (backward_plan says which a call takes). `product`: the forward's contraction
    result where it kept it (trimul::_forward_keep_product_cuda, [batch * H, S, S] in the operand
    type; from the fp16 stages at tf32, fp32 rows [batch, N, N, H]), which the backward takes
    instead of computing c again, and releases (dc overwrites it)."""
    mdt = dtype if matmul_dtype is None else matmul_dtype
    shape = x.shape
    P, N = shape[-1], shape[-2]
    # x, grad and the mask stay in their dtypes; chunks are converted as they are read. (A batched
    # pair, as modules pass it, is taken as it is: each view costs host time on every step.)
    batched = len(shape) == 4
    x4 = x if batched else x.reshape(-1, N, N, P)
    g4 = grad if batched and grad.dim() == 4 else grad.reshape(-1, N, N, P)
    m3 = kernel_mask(mask if mask is None or batched else mask.reshape(-1, N, N))  # as the CUDA ops take it
    batch = x4.shape[0]
    dev = x.device
    if grad_dtypes is None:
        grad_dtypes = [x.dtype if x.dtype in _HALF_TYPES else dtype] + [dtype] * len(params)
    if x.numel() == 0:  # no positions: every gradient is zero
        return [None if t is None else torch.zeros(t.shape, dtype=want, device=t.device)
                for t, want in zip((x, *params), grad_dtypes)]
    lnw_in, lnb_in, wpa, bpa, wga, bga, wpb, bpb, wgb, bgb, lnw_out, lnb_out, wo, bo, wg, bg = params
    H = wpa.shape[0]
    step = max(CHUNK_ROWS, -(-batch * N * N // CHUNKS))
    ext = None if precision is None else _kernels_for(x, mdt, batch * N)
    if dtype == torch.float32 and fused_backward_runs(x4, P, H, mdt, precision):
        dx, buf = torch.ops.trimul._backward_fused(
            g4, x4, m3, *params, 1 if direction == "outgoing" else 0,
            1 if gate_input == "normalized" else 0, float(eps), PRECISION_CODE[precision], step, product)
        sizes = [P, P] + [H * P, H] * 4 + [H, H, P * H, P, P * P, P]  # trimul.forward's parameters
        return [(dx if batched else dx.view(shape)).to(grad_dtypes[0])] + _grads_of(buf, sizes, params,
                                                                                     grad_dtypes[1:])
    m4 = None if mask is None else mask.reshape(-1, N, N, 1)
    # fp16 products: c's headroom as the forward takes it (csrc/trimul.h), 2^-t from the same
    # parameters and mask. The sequence runs on the projections' weights and biases times 2^-t, so a
    # and b come out times 2^-t and c times 2^-2t (as a product the forward kept); the output
    # LayerNorm reads c times 2^2t in fp32 (the same values, eps unchanged) and stores dc times 2^2t
    # (the gradient of the scaled c), and the projections' gradients take 2^-t at the end
    headroom = None
    if mdt == torch.float16 and ext is not None:
        headroom = torch.ops.trimul._fp16_headroom_cuda(x4, m3, *params)
        params = [t if t is None or k not in _PROJECTIONS else t * headroom for k, t in enumerate(params)]
        wpa, bpa, wpb, bpb = (params[k] for k in _PROJECTIONS)
    c_up = None if headroom is None else headroom.reciprocal().square()  # 2^2t
    on_stages = ext is not None and precision is not None  # a and b from the forward's input stage
    # the input stage's backward as one op where the tensor-core kernel takes the call (below)
    input_back = on_stages and ext.input_back_takes(int(P), int(H), PRECISION_CODE[precision],
                                                    DTYPE_CODE[x.dtype], dev.index)
    # c kept by the fp16 stages at tf32: fp32 rows, [batch, N, N, H], its scale undone
    rows_kept = (on_stages and product is not None and product.dim() == 4 and product.dtype == dtype
                 and product.shape == (batch, N, N, H) and product.is_contiguous())
    # tf32: the contraction's gradients on fp16 operands, a and b from the fp16 stages and dc scaled
    # into fp16 (csrc/trimul.h: GradScale), where the extension takes these widths and torch's bmm has
    # its fp32-output form; c is the forward's rows, or computed again as the fp16 stages do (no
    # product: under saved-tensor hooks, as activation checkpointing runs, or in a compiled backward)
    fp16_products = (input_back and precision == "tf32" and x.dtype == torch.float32 and dtype == torch.float32
                     and (rows_kept or product is None) and _BMM_FP32_OUT
                     and ext.tf32_backward_on_fp16(int(P), int(H), dev.index))
    # the matrix operands straight in the operand type; the input projections' only where PyTorch
    # ops below read them (the recomputation of a and b, or the input stage's backward, off the kernels)
    if not input_back:
        w_in_m = torch.cat([wpa, wga, wpb, wgb]).to(mdt)  # (4H, P)
        b_in = torch.cat([_affine(t, 0.0, H, dtype, dev) for t in (bpa, bga, bpb, bgb)])
    wo_m, wg_m = wo.to(mdt), wg.to(mdt)
    wg_sums = wg.to(dtype).sum(1) if gate_input == "input" else None  # (_gate_from_x)

    def acc(total: Optional[Tensor], part: Tensor) -> Tensor:
        """A sum over chunks in chunk order, in `dtype`; a single chunk's part as it is."""
        return part if total is None else total.to(dtype) + part

    chunks = _chunks(batch, N, step)

    def rows(t4, ch):
        b0, b1, i0, i1 = ch
        return t4[b0:b1, i0:i1].reshape(-1, t4.shape[-1])

    def rows_of(t4, ch):
        """A chunk of an input (x, grad, mask) in the compute dtype."""
        return rows(t4, ch).to(dtype)

    def put(t4, ch, v):
        b0, b1, i0, i1 = ch
        t4[b0:b1, i0:i1] = v.view(b1 - b0, i1 - i0, N, -1)

    # outgoing: c[i,j] = sum_k a[i,k] b[j,k], so a position (i, k) is at [h][i][k];
    # incoming: c[i,j] = sum_k a[k,i] b[k,j], so a position (k, i) is at [h][i][k].
    swap = direction == "incoming"
    # a, b channel-first, [batch * H, S, S]
    R = _RowOps(ext is not None and dtype == torch.float32 and max(H, P) <= ext.MAX_ROWS_LEN, dtype)
    if on_stages:
        xk = x4 if x4.stride(-1) == 1 else x4.contiguous()  # the input stage needs its last dim contiguous
        if fp16_products:  # a and b times 2^d, fp16 (scales: their RangeScales)
            a3, b3, packed, scales = torch.ops.trimul._input_products_fp16_cuda(
                xk, m3, *params, 1 if direction == "outgoing" else 0, float(eps))
        else:
            a3, b3, packed = torch.ops.trimul._input_products_cuda(
                xk, m3, *params, 1 if direction == "outgoing" else 0, float(eps), PRECISION_CODE[precision])
        to_rows, to_pair = torch.ops.trimul._pair_to_rows, torch.ops.trimul._rows_to_pair
        # the parameters in fp32 as the kernels read them, defaults filled in (in `dtype`, which the
        # op's backward always makes float32 here)
        pieces = packed.split(ext.packed_sizes(P, H))
        if dtype != torch.float32:
            pieces = [t.to(dtype) for t in pieces]
        lnw_in, lnb_in, _, _, lnw_out, lnb_out, _, _, _, _ = pieces
    else:
        # LayerNorm affines in `dtype`
        lnw_in, lnw_out = _affine(lnw_in, 1.0, P, dtype, dev), _affine(lnw_out, 1.0, H, dtype, dev)
        lnb_in, lnb_out = _affine(lnb_in, 0.0, P, dtype, dev), _affine(lnb_out, 0.0, H, dtype, dev)
        a_cf = torch.empty(batch, H, N, N, dtype=mdt, device=dev)
        b_cf = torch.empty(batch, H, N, N, dtype=mdt, device=dev)
        perm = (0, 3, 2, 1) if swap else (0, 2, 3, 1)
        a4, b4 = a_cf.permute(perm), b_cf.permute(perm)
        for ch in chunks:
            xn = R.layer_norm(rows(x4, ch), lnw_in, lnb_in, eps, mdt)
            pa, ga, pb, gb = _pre_activations(xn, w_in_m, b_in).to(dtype).split(H, dim=-1)  # (rows, H) each
            a_ch, b_ch = pa * torch.sigmoid(ga), pb * torch.sigmoid(gb)
            if m4 is not None:
                m = rows_of(m4, ch)
                a_ch, b_ch = a_ch * m, b_ch * m
            put(a4, ch, a_ch)
            put(b4, ch, b_ch)
            del xn, pa, ga, pb, gb, a_ch, b_ch
        del a4, b4
        a3, b3 = a_cf.view(-1, N, N), b_cf.view(-1, N, N)
        del a_cf, b_cf
        to_rows, to_pair = _permuted_to_rows, _permuted_to_pair
    S = a3.shape[-1]
    kept = (product is not None and on_stages and product.dtype == a3.dtype
            and product.shape == (a3.shape[0], S, S) and product.is_contiguous())

    # output stage, per chunk: c becomes dc. The gate input's gradient goes into dx, which the
    # input stage below turns into the pair's gradient in place. Kept in x's dtype when that is
    # 16-bit (what dx is returned in): half the memory of the largest tensor of the backward. Not
    # where PyTorch's ops alone run it up to PYTORCH_BACKWARD_MAX_P: over so few channels the input
    # LayerNorm's gradient is a near-cancellation that turns the gate part's rounding to 16 bits
    # into errors of several per cent (benchmarks/NOTES.md, "float32 arithmetic at a small H").
    # Column sums: of g xhat and g for the output LayerNorm (ln_sums), of dy and dgp (gate_sums).
    d_wo = d_wg = ln_sums = gate_sums = None
    half_dx = x.dtype in _HALF_TYPES and (precision is not None or P > PYTORCH_BACKWARD_MAX_P)
    dx_dtype = x.dtype if half_dx else dtype
    if rows_kept:
        c4 = product
    elif fp16_products:  # c times 2^2d in fp16, as the forward's contraction leaves it, then fp32 rows
        c4 = torch.ops.trimul._pair_to_rows_fp16(torch.bmm(a3, b3.transpose(1, 2)).view(batch, H, S, S), N, scales)
    else:
        c3 = product if kept else torch.bmm(a3, b3.transpose(1, 2))
        c4 = to_rows(c3.view(batch, H, S, S), N, False)  # [batch, N, N, H]: c[i, j] at [i][j]
        del c3
        if kept:  # its memory goes now: the caller's reference to it would hold it to the end
            product.set_()
    dx = torch.empty(batch, N, N, P, dtype=dx_dtype, device=dev)  # written chunk by chunk
    bo_m = None if bo is None else bo.to(mdt)
    for ch in chunks:
        c_ch = rows(c4, ch)  # a view of c4: dc takes its place
        c_ln = c_ch if c_up is None else c_ch.float() * c_up  # what the output LayerNorm reads
        cn = R.layer_norm(c_ln, lnw_out, lnb_out, eps, mdt)
        y = F.linear(cn, wo_m, bo_m)
        x_ch = rows(x4, ch)
        if gate_input == "input":
            u = x_ch.to(mdt)
            gpre = _gate_from_x(x_ch, wg_m, wg_sums, bg, dtype)
        else:
            u = R.layer_norm(x_ch, lnw_in, lnb_in, eps, mdt)
            gpre = _pre_activations(u, wg_m, bg)
        dy, dgp, sums = R.gate_grads(y, gpre, rows(g4, ch))
        d_wg, gate_sums = acc(d_wg, dgp.t() @ u), acc(gate_sums, sums)
        dx_ch = rows(dx, ch)
        if dx.dtype == dgp.dtype:
            torch.mm(dgp, wg_m, out=dx_ch)
        else:
            dx_ch.copy_(dgp @ wg_m)
        d_wo = acc(d_wo, dy.t() @ cn)
        ln_sums = acc(ln_sums, R.layer_norm_back(c_ln, dy @ wo_m, None, 0, lnw_out, eps, c_ln))  # dc in c's place
        if c_up is not None:
            c_ch.copy_(c_ln * c_up)
        del c_ln, cn, y, u, gpre, dy, dgp
    grad_scale = None
    if fp16_products:  # dc times 2^s in fp16; da and db in fp32, times 2^(s + d) (grad_scale undoes it)
        dc3, grad_scale = torch.ops.trimul._rows_to_pair_fp16(c4, S, scales)
        dc3 = dc3.view(-1, S, S)
    else:
        dc3 = to_pair(c4, S, False).view(-1, S, S)
    del c4
    if rows_kept:  # (as `kept` above, once dc has left it)
        product.set_()
    out_dtype = {"out_dtype": torch.float32} if fp16_products else {}
    da3 = torch.bmm(dc3, b3, **out_dtype)  # da[i,k] = sum_j dc[i,j] b[j,k]
    del b3  # da needs b, db needs a: four N²·H tensors at most
    db3 = torch.bmm(dc3.transpose(1, 2), a3, **out_dtype)  # db[j,k] = sum_i dc[i,j] a[i,k]
    del dc3, a3
    # input stage, per chunk; column sums of dpre (the input biases' gradients) and of
    # g xhat, g for the input LayerNorm (in_sums). Where the tensor-core input stage's backward
    # kernel takes the call, one op: it reads da and db as the contraction leaves them, and forms
    # LayerNorm, the products and the gating gradients on chip
    if input_back:
        in_sums, d_w_in, d_b_in = torch.ops.trimul._input_stage_back_cuda(
            x4, m3, *params, da3, db3, dx,
            1 if direction == "outgoing" else 0, 1 if gate_input == "normalized" else 0, float(eps),
            PRECISION_CODE[precision], step, grad_scale)
        del da3, db3
    else:
        da4 = to_rows(da3.view(batch, H, S, S), N, swap)
        del da3
        db4 = to_rows(db3.view(batch, H, S, S), N, swap)
        del db3
        d_w_in = d_b_in = in_sums = None
        for ch in chunks:
            x_ch = rows(x4, ch)
            xn = R.layer_norm(x_ch, lnw_in, lnb_in, eps, mdt)
            dpre, sums = R.gating_grads(_pre_activations(xn, w_in_m, b_in), rows(da4, ch), rows(db4, ch),
                                        None if m4 is None else rows_of(m4, ch))
            d_w_in, d_b_in = acc(d_w_in, dpre.t() @ xn), acc(d_b_in, sums)
            # dx holds the gate input's gradient: added to LayerNorm's output gradient (gate from the
            # normalized input) or to its input gradient (gate from x); the result takes its place
            dx_ch = rows(dx, ch)
            in_sums = acc(in_sums, R.layer_norm_back(x_ch, dpre @ w_in_m, dx_ch,
                                                     1 if gate_input == "normalized" else 2, lnw_in, eps, dx_ch))
            del xn, dpre

    if headroom is not None:  # the scaled projections' gradients times 2^-t: the projections' own
        d_w_in, d_b_in = d_w_in.to(dtype), d_b_in.to(dtype)  # (not in place in fp16, which 2^-t could underflow)
        d_w_in.view(4, H, P)[0::2] *= headroom
        d_b_in.view(4, H)[0::2] *= headroom

    grads: List[Optional[Tensor]] = [None] * 16
    wants = grad_dtypes[1:]
    for idx, buf, sizes in (((0, 1), in_sums, [P, P]), ((2, 4, 6, 8), d_w_in, [H] * 4),
                            ((3, 5, 7, 9), d_b_in, [H] * 4), ((10, 11), ln_sums, [H, H]),
                            ((12,), d_wo, [P]), ((13, 15), gate_sums, [P, P]), ((14,), d_wg, [P])):
        got = _grads_of(buf, sizes, [params[i] for i in idx], [wants[i] for i in idx])
        for i, g in zip(idx, got):
            grads[i] = g
    return [dx.view(shape).to(grad_dtypes[0])] + grads
