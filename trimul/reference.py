"""The triangle multiplicative update in plain PyTorch: the definition the
kernels are held to (SPEC section 1), used by the tests, the CPU path and the
row-sharded version (trimul.distributed). Written as its three stages."""
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def _cast(params: Sequence[Optional[Tensor]], dtype: torch.dtype):
    return [None if t is None else t.to(dtype) for t in params]


def layer_norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a LayerNorm of `dtype` values is evaluated in: float32's in float64, whose statistics of
    a row whose mean is large against its spread lose what the ieee bound needs (x offset by 100 of
    its spread: the update 2.5e-5 off float64 in float32, 1e-6 this way)."""
    return torch.float64 if dtype == torch.float32 else dtype


def layer_norm(x: Tensor, w: Optional[Tensor], b: Optional[Tensor], eps: float) -> Tensor:
    """LayerNorm over the last dim, in x's dtype, evaluated in layer_norm_dtype's."""
    work = layer_norm_dtype(x.dtype)
    return F.layer_norm(x.to(work), x.shape[-1:], *_cast([w, b], work), eps).to(x.dtype)


def input_stage(x: Tensor, mask: Optional[Tensor], params: Sequence[Optional[Tensor]], eps: float, dtype: torch.dtype):
    """xn = LayerNorm(x) and the masked, gated projections a and b (SPEC steps 1-2),
    in `dtype`; params in trimul.forward's order."""
    lnw, lnb, wpa, bpa, wga, bga, wpb, bpb, wgb, bgb = _cast(params[:10], dtype)
    x = x.to(dtype)
    xn = layer_norm(x, lnw, lnb, eps)
    m = 1.0 if mask is None else mask.to(dtype).unsqueeze(-1)
    a = F.linear(xn, wpa, bpa) * torch.sigmoid(F.linear(xn, wga, bga)) * m
    b = F.linear(xn, wpb, bpb) * torch.sigmoid(F.linear(xn, wgb, bgb)) * m
    return xn, a, b


def contract(a: Tensor, b: Tensor, direction: str) -> Tensor:
    """The triangle product, summed over k (SPEC step 3)."""
    if direction == "incoming":
        return torch.einsum("...kih,...kjh->...ijh", a, b)
    return torch.einsum("...ikh,...jkh->...ijh", a, b)


def output_stage(c: Tensor, x: Tensor, xn: Tensor, params: Sequence[Optional[Tensor]], gate_input: str, eps: float):
    """LayerNorm(c), output projection and gate (SPEC steps 4-5), in c's dtype."""
    low, lob, wo, bo, wg, bg = _cast(params[10:], c.dtype)
    y = F.linear(layer_norm(c, low, lob, eps), wo, bo)
    u = x.to(c.dtype) if gate_input == "input" else xn
    return y * torch.sigmoid(F.linear(u, wg, bg))


def triangle_multiplication_reference(
    x: Tensor,
    mask: Optional[Tensor],
    ln_in_weight: Optional[Tensor],
    ln_in_bias: Optional[Tensor],
    proj_a_weight: Tensor,
    proj_a_bias: Optional[Tensor],
    gate_a_weight: Tensor,
    gate_a_bias: Optional[Tensor],
    proj_b_weight: Tensor,
    proj_b_bias: Optional[Tensor],
    gate_b_weight: Tensor,
    gate_b_bias: Optional[Tensor],
    ln_out_weight: Optional[Tensor],
    ln_out_bias: Optional[Tensor],
    out_proj_weight: Tensor,
    out_proj_bias: Optional[Tensor],
    out_gate_weight: Tensor,
    out_gate_bias: Optional[Tensor],
    direction: str = "incoming",
    gate_input: str = "input",
    eps: float = 1e-5,
    dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """Evaluates the update with every tensor cast to `dtype` (default: x's
    dtype, at least float32) and returns the result in that dtype."""
    dtype = dtype or torch.promote_types(x.dtype, torch.float32)
    params = [ln_in_weight, ln_in_bias, proj_a_weight, proj_a_bias, gate_a_weight, gate_a_bias, proj_b_weight,
              proj_b_bias, gate_b_weight, gate_b_bias, ln_out_weight, ln_out_bias, out_proj_weight, out_proj_bias,
              out_gate_weight, out_gate_bias]
    xn, a, b = input_stage(x, mask, params, eps, dtype)
    return output_stage(contract(a, b, direction), x, xn, params, gate_input, eps)
