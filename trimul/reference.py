"""The triangle multiplicative update in plain PyTorch: the definition the
kernels are held to (SPEC section 1), used by the tests and by the CPU path."""
from typing import Optional

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


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

    def cast(t):
        return None if t is None else t.to(dtype)

    x = x.to(dtype)
    xn = F.layer_norm(x, x.shape[-1:], cast(ln_in_weight), cast(ln_in_bias), eps)
    m = 1.0 if mask is None else mask.to(dtype).unsqueeze(-1)
    a = F.linear(xn, cast(proj_a_weight), cast(proj_a_bias)) * torch.sigmoid(
        F.linear(xn, cast(gate_a_weight), cast(gate_a_bias))) * m
    b = F.linear(xn, cast(proj_b_weight), cast(proj_b_bias)) * torch.sigmoid(
        F.linear(xn, cast(gate_b_weight), cast(gate_b_bias))) * m
    if direction == "incoming":
        c = torch.einsum("...kih,...kjh->...ijh", a, b)
    else:
        c = torch.einsum("...ikh,...jkh->...ijh", a, b)
    y = F.linear(F.layer_norm(c, c.shape[-1:], cast(ln_out_weight), cast(ln_out_bias), eps),
                 cast(out_proj_weight), cast(out_proj_bias))
    u = x if gate_input == "input" else xn
    return y * torch.sigmoid(F.linear(u, cast(out_gate_weight), cast(out_gate_bias)))
