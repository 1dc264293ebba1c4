"""cuEquivariance's argument set: `trimul.triangle_multiplicative_update` takes
the names and semantics of `cuequivariance_torch.triangle_multiplicative_update`
(0.13), so a model switches by changing one import.

Their conventions, read from cuequivariance_ops_torch 0.13: `p_in_weight` and
`g_in_weight` are (2H, P) with rows [a; b] (the first H rows make `a`), biases
likewise; the output gate reads the normalized input; default direction
"outgoing"; a missing LayerNorm affine means weight 1 / bias 0, and a missing
projection weight is drawn afresh (LeCun-normal, H = P) on every call, as there.
"""
import math
from typing import Optional

import torch

from . import ops

Tensor = torch.Tensor

# cuEquivariance's precision names (strings or its TriMulPrecision enum) -> ours
_PRECISION_ALIASES = {"none": "default", "default": "default", "ieee": "ieee", "tf32": "tf32",
                      "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}


def _precision(precision) -> str:
    if precision is None:
        return "default"
    name = precision if isinstance(precision, str) else getattr(precision, "name", str(precision))
    try:
        return _PRECISION_ALIASES[name.lower()]
    except KeyError:
        raise ops.TrimulValueError(f"triangle_multiplicative_update: unknown precision {precision!r}, expected "
                                   f"None or one of {', '.join(map(repr, _PRECISION_ALIASES))}") from None


def _lecun_normal_(w: Tensor) -> Tensor:
    # truncated normal on [-2, 2] scaled so its standard deviation is 1/sqrt(fan_in)
    std = math.sqrt(1.0 / w.shape[1]) / 0.87962566103423978
    return torch.nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std)


def _halves(t: Optional[Tensor], name: str):
    if t is None:
        return None, None
    if t.dim() < 1 or t.shape[0] % 2:
        raise ops.TrimulValueError(f"trimul: {name} must have an even first dimension (2H rows: a then b), "
                                   f"got {tuple(t.shape)}")
    h = t.shape[0] // 2
    return t[:h], t[h:]


def triangle_multiplicative_update(
    x: Tensor,
    direction: str = "outgoing",
    mask: Optional[Tensor] = None,
    norm_in_weight: Optional[Tensor] = None,
    norm_in_bias: Optional[Tensor] = None,
    p_in_weight: Optional[Tensor] = None,
    p_in_bias: Optional[Tensor] = None,
    g_in_weight: Optional[Tensor] = None,
    g_in_bias: Optional[Tensor] = None,
    norm_out_weight: Optional[Tensor] = None,
    norm_out_bias: Optional[Tensor] = None,
    p_out_weight: Optional[Tensor] = None,
    p_out_bias: Optional[Tensor] = None,
    g_out_weight: Optional[Tensor] = None,
    g_out_bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    precision=None,
) -> Tensor:
    """Triangle multiplicative update with cuEquivariance's arguments; x is (*batch, N, N, P)."""
    if not isinstance(x, Tensor):
        raise ops.TrimulTypeError(f"triangle_multiplicative_update: x must be a tensor, got {type(x).__name__}")
    P = x.shape[-1]
    prec = _precision(precision)
    # weights cuEquivariance draws afresh where they are missing: allocated here, checked with the
    # other arguments, and drawn only then (no kernel, and no draw from the generator, ahead of an
    # argument error)
    drawn = []

    def missing(rows: int) -> Tensor:
        drawn.append(torch.empty(rows, P, dtype=x.dtype, device=x.device))
        return drawn[-1]

    if p_in_weight is None:
        p_in_weight = missing(2 * P)
    if g_in_weight is None:
        g_in_weight = missing(2 * P)
    if p_out_weight is None:
        p_out_weight = missing(P)
    if g_out_weight is None:
        g_out_weight = missing(P)
    proj_a, proj_b = _halves(p_in_weight, "p_in_weight")
    gate_a, gate_b = _halves(g_in_weight, "g_in_weight")
    proj_a_bias, proj_b_bias = _halves(p_in_bias, "p_in_bias")
    gate_a_bias, gate_b_bias = _halves(g_in_bias, "g_in_bias")
    params = [norm_in_weight, norm_in_bias, proj_a, proj_a_bias, gate_a, gate_a_bias, proj_b, proj_b_bias,
              gate_b, gate_b_bias, norm_out_weight, norm_out_bias, p_out_weight, p_out_bias, g_out_weight, g_out_bias]
    if drawn:
        ops.check_inputs(x, mask, params, direction, "normalized", eps, prec)
        for w in drawn:
            _lecun_normal_(w)
    return torch.ops.trimul.forward(x, mask, *params, direction, "normalized", eps, prec)
