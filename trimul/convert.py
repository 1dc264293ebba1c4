"""Weights from other projects' triangle multiplicative update modules.

Each function takes the other module (or its state_dict) and returns a
`trimul.TriangleMultiplication` that computes the same function. Key names and
conventions as in those projects' sources:

- OpenFold `TriangleMultiplicationOutgoing/Incoming` (and the
  `TriangleMultiplicativeUpdate` base): linear_a_p, linear_a_g, linear_b_p,
  linear_b_g, linear_g, linear_z, layer_norm_in, layer_norm_out; the output gate
  reads the normalized input. Its fused variant (`FusedTriangleMultiplicativeUpdate`)
  packs a and b into linear_ab_p / linear_ab_g, rows [a; b].
- Boltz `TriangleMultiplicationOutgoing/Incoming`: norm_in, p_in and g_in
  (2·dim rows, [a; b], no bias), norm_out, p_out, g_out (no bias); gate from the
  normalized input.
- cuEquivariance's argument set: see `from_cuequivariance`.
"""
from typing import Mapping, Optional, Union

import torch
from torch import nn

from .functional import _halves
from .modules import TriangleMultiplication

StateOrModule = Union[nn.Module, Mapping[str, torch.Tensor]]


def _state(source: StateOrModule) -> Mapping[str, torch.Tensor]:
    return source.state_dict() if isinstance(source, nn.Module) else source


def _direction(source: StateOrModule, direction: Optional[str], outgoing_attrs=("_outgoing", "outgoing")) -> str:
    if direction is not None:
        return direction
    if isinstance(source, nn.Module):
        for attr in outgoing_attrs:
            if isinstance(getattr(source, attr, None), bool):
                return "outgoing" if getattr(source, attr) else "incoming"
        name = type(source).__name__.lower()
        for d in ("outgoing", "incoming"):
            if d in name:
                return d
    raise ValueError("trimul.convert: cannot tell the direction from a state_dict; pass direction='outgoing' or "
                     "'incoming'")


def _build(params: Mapping[str, Optional[torch.Tensor]], direction: str, eps: float) -> TriangleMultiplication:
    """A module with trimul's parameter names from a complete mapping of them."""
    w = params["proj_a.weight"]
    hidden, pair = w.shape
    bias = params.get("proj_a.bias") is not None
    module = TriangleMultiplication(pair, hidden, direction=direction, gate_input="normalized", bias=bias, eps=eps)
    module = module.to(dtype=w.dtype, device=w.device)
    module.load_state_dict({k: v for k, v in params.items() if v is not None})
    return module


def from_openfold(source: StateOrModule, direction: Optional[str] = None, eps: float = 1e-5) -> TriangleMultiplication:
    """From OpenFold's TriangleMultiplication{Outgoing,Incoming} or its fused variant."""
    sd = _state(source)
    p = {"layer_norm_in.weight": sd["layer_norm_in.weight"], "layer_norm_in.bias": sd["layer_norm_in.bias"],
         "layer_norm_out.weight": sd["layer_norm_out.weight"], "layer_norm_out.bias": sd["layer_norm_out.bias"],
         "out_proj.weight": sd["linear_z.weight"], "out_proj.bias": sd.get("linear_z.bias"),
         "out_gate.weight": sd["linear_g.weight"], "out_gate.bias": sd.get("linear_g.bias")}
    if "linear_ab_p.weight" in sd:  # fused: rows [a; b]
        for kind, ours in (("p", "proj"), ("g", "gate")):
            wa, wb = _halves(sd[f"linear_ab_{kind}.weight"], f"linear_ab_{kind}.weight")
            ba, bb = _halves(sd.get(f"linear_ab_{kind}.bias"), f"linear_ab_{kind}.bias")
            p.update({f"{ours}_a.weight": wa, f"{ours}_a.bias": ba, f"{ours}_b.weight": wb, f"{ours}_b.bias": bb})
    else:
        for side in ("a", "b"):
            for kind, ours in (("p", "proj"), ("g", "gate")):
                p[f"{ours}_{side}.weight"] = sd[f"linear_{side}_{kind}.weight"]
                p[f"{ours}_{side}.bias"] = sd.get(f"linear_{side}_{kind}.bias")
    return _build(p, _direction(source, direction), eps)


def from_boltz(source: StateOrModule, direction: Optional[str] = None, eps: float = 1e-5) -> TriangleMultiplication:
    """From Boltz's TriangleMultiplication{Outgoing,Incoming} (no biases in its linear layers)."""
    sd = _state(source)
    pa, pb = _halves(sd["p_in.weight"], "p_in.weight")
    ga, gb = _halves(sd["g_in.weight"], "g_in.weight")
    p = {"layer_norm_in.weight": sd["norm_in.weight"], "layer_norm_in.bias": sd["norm_in.bias"],
         "proj_a.weight": pa, "gate_a.weight": ga, "proj_b.weight": pb, "gate_b.weight": gb,
         "layer_norm_out.weight": sd["norm_out.weight"], "layer_norm_out.bias": sd["norm_out.bias"],
         "out_proj.weight": sd["p_out.weight"], "out_gate.weight": sd["g_out.weight"]}
    return _build(p, _direction(source, direction), eps)


def from_cuequivariance(norm_in_weight, norm_in_bias, p_in_weight, p_in_bias, g_in_weight, g_in_bias,
                        norm_out_weight, norm_out_bias, p_out_weight, p_out_bias, g_out_weight, g_out_bias,
                        direction: str = "outgoing", eps: float = 1e-5) -> TriangleMultiplication:
    """From the tensors of a cuEquivariance `triangle_multiplicative_update` call (packed
    (2H, P) input weights, rows [a; b]; gate from the normalized input). All biases must
    be given or all left None."""
    pa, pb = _halves(p_in_weight, "p_in_weight")
    ga, gb = _halves(g_in_weight, "g_in_weight")
    pab, pbb = _halves(p_in_bias, "p_in_bias")
    gab, gbb = _halves(g_in_bias, "g_in_bias")
    P = p_in_weight.shape[1]
    H = p_in_weight.shape[0] // 2
    ones = lambda n: torch.ones(n, dtype=p_in_weight.dtype, device=p_in_weight.device)
    zeros = lambda n: torch.zeros(n, dtype=p_in_weight.dtype, device=p_in_weight.device)
    p = {"layer_norm_in.weight": ones(P) if norm_in_weight is None else norm_in_weight,
         "layer_norm_in.bias": zeros(P) if norm_in_bias is None else norm_in_bias,
         "proj_a.weight": pa, "proj_a.bias": pab, "gate_a.weight": ga, "gate_a.bias": gab,
         "proj_b.weight": pb, "proj_b.bias": pbb, "gate_b.weight": gb, "gate_b.bias": gbb,
         "layer_norm_out.weight": ones(H) if norm_out_weight is None else norm_out_weight,
         "layer_norm_out.bias": zeros(H) if norm_out_bias is None else norm_out_bias,
         "out_proj.weight": p_out_weight, "out_proj.bias": p_out_bias,
         "out_gate.weight": g_out_weight, "out_gate.bias": g_out_bias}
    biases = [p_in_bias, g_in_bias, p_out_bias, g_out_bias]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise ValueError("trimul.convert.from_cuequivariance: give all four projection biases or none")
    return _build(p, direction, eps)
