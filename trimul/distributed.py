"""The update on a pair representation sharded by rows across processes, on
torch.distributed (NCCL on GPUs, gloo on CPUs).

Each rank holds a contiguous block of rows i of x (and of the mask), the blocks
in rank order; blocks may differ in size by rank. Per rank, with n_r rows:

- outgoing, c[i, j] = sum_k a[i, k] b[j, k]: a rank's rows of c need b for every
  j, so b (N x N x H in all) is all-gathered; each rank receives the other
  ranks' blocks, (W-1)/W of N^2 H elements.
- incoming, c[i, j] = sum_k a[k, i] b[k, j]: the sum runs over rows k, which are
  spread over the ranks; each rank forms the partial sums of its own k for
  every (i, j) and a reduce-scatter over i leaves each rank its rows, moving
  (W-1)/W of N^2 H elements per rank. The alternative (an all-to-all transpose of
  a, then all-gathering b) moves (1 + 1/W) times as much.

Either way the collective carries H channels of the gated projections, not the
P channels of x, and the LayerNorms and the output projection stay row-local.
Blocks are padded to the largest for the collectives. Gradients flow through the
same collectives (all-gather and reduce-scatter are each other's backward). The stages are the
reference's PyTorch formulas (trimul.reference), computed in at least float32.
"""
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from . import ops
from .modules import TriangleMultiplication
from .reference import contract, input_stage, output_stage

Tensor = torch.Tensor


def row_block(n: int, rank: int, world: int) -> slice:
    """The rows [start, stop) of rank `rank` when n rows are split as evenly as possible."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def _block_sizes(n_local: int, device, group) -> list:
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([n_local], dtype=torch.int64, device=device), group=group)
    return [int(s.item()) for s in sizes]


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    """Zero rows appended along dim -3 up to `rows`."""
    missing = rows - t.shape[-3]
    if missing == 0:
        return t.contiguous()
    return torch.cat([t, t.new_zeros(*t.shape[:-3], missing, *t.shape[-2:])], dim=-3)


def _all_gather_stacked(block: Tensor, group) -> Tensor:
    parts = [torch.empty_like(block) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, block.contiguous(), group=group)
    return torch.stack(parts)


# reduce_scatter_single is reduce_scatter_tensor's newer name (same arguments)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _reduce_scatter_stacked(stacked: Tensor, group) -> Tensor:
    out = stacked.new_empty(stacked.shape[1:])
    _reduce_scatter(out, stacked.contiguous().flatten(0, 1), group=group)  # blocks end to end along dim 0
    return out


class _GatherBlocks(torch.autograd.Function):
    """Every rank's equally shaped block, stacked on a new leading dim; the
    gradient of a rank's block is the sum over ranks of its slot (reduce-scatter)."""

    @staticmethod
    def forward(ctx, block, group):
        ctx.group = group
        return _all_gather_stacked(block, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_stacked(grad, ctx.group), None


class _ScatterSum(torch.autograd.Function):
    """From stacked blocks (one per destination rank), this rank's block summed
    over ranks; the gradient is every rank's output gradient (all-gather)."""

    @staticmethod
    def forward(ctx, stacked, group):
        ctx.group = group
        return _reduce_scatter_stacked(stacked, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_stacked(grad, ctx.group), None


def triangle_multiplication(
    x_rows: Tensor,
    mask_rows: Optional[Tensor],
    params: Union[TriangleMultiplication, Sequence[Optional[Tensor]]],
    group=None,
    *,
    direction: str = "incoming",
    gate_input: str = "input",
    eps: float = 1e-5,
) -> Tensor:
    """This rank's rows of the update. x_rows is (*batch, n_r, N, P), mask_rows
    (*batch, n_r, N) or None; params a TriangleMultiplication (whose direction,
    gate_input and eps then apply) or the 16 tensors in trimul.forward's order.
    Returns (*batch, n_r, N, P) in x's dtype."""
    if isinstance(params, TriangleMultiplication):
        direction, gate_input, eps = params.direction, params.gate_input, params.eps
        params = params.parameters_in_op_order()
    params = list(params)
    N = x_rows.shape[-2]
    if mask_rows is not None and tuple(mask_rows.shape) != tuple(x_rows.shape[:-1]):
        raise ops.TrimulValueError(f"trimul.distributed: mask_rows must have shape {tuple(x_rows.shape[:-1])}, "
                                   f"got {tuple(mask_rows.shape)}")
    # the full op's checks on a square stand-in for the whole pair (one element of storage),
    # before any communication
    shape = (*x_rows.shape[:-3], N, N, x_rows.shape[-1])
    square = x_rows.new_empty_strided(shape, [0] * len(shape))
    ops.check_inputs(square, None, params, direction, gate_input, eps, "default")
    group = group if group is not None else dist.group.WORLD
    sizes = _block_sizes(x_rows.shape[-3], x_rows.device, group)
    if sum(sizes) != N:
        raise ops.TrimulValueError(
            f"trimul.distributed: the row blocks hold {sum(sizes)} rows in all ({sizes} by rank) but x_rows has "
            f"N = {N} columns; each rank must pass a contiguous block of rows of one (*batch, N, N, P) pair")

    dtype = torch.promote_types(x_rows.dtype, torch.float32)
    xn, a, b = input_stage(x_rows, mask_rows, params, eps, dtype)
    rank, n_max = dist.get_rank(group), max(sizes)
    if direction == "outgoing":
        blocks = _GatherBlocks.apply(_pad_rows(b, n_max), group)
        b_all = torch.cat([blocks[r, ..., :n, :, :] for r, n in enumerate(sizes)], dim=-3)
        c = contract(a, b_all, direction)
    else:
        partial = contract(a, b, direction)  # (*batch, N, N, H): this rank's k, every i
        stacked = torch.stack([_pad_rows(p, n_max) for p in torch.split(partial, sizes, dim=-3)])
        c = _ScatterSum.apply(stacked, group)[..., :sizes[rank], :, :]
    return output_stage(c, x_rows, xn, params, gate_input, eps).to(x_rows.dtype)
