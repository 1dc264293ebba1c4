"""nn.Module drop-ins."""
import torch
from torch import nn

from . import ops


class TriangleMultiplication(nn.Module):
    """The triangle multiplicative update as a module.

    Submodule names and creation order are those of the seed's `Model`, so its
    state_dict loads here and, after the same `torch.manual_seed`, both hold
    identical weights. `bias=False` drops the biases of the linear layers (the
    LayerNorms keep theirs).
    """

    def __init__(self, pair_dim: int, hidden_dim: int, *, direction: str = "incoming", gate_input: str = "input",
                 bias: bool = True, eps: float = 1e-5, precision: str = "default"):
        super().__init__()
        ops.check_options("TriangleMultiplication", direction, gate_input, precision)
        self.direction, self.gate_input, self.eps, self.precision = direction, gate_input, eps, precision
        self.layer_norm_in = nn.LayerNorm(pair_dim, eps=eps)
        self.proj_a = nn.Linear(pair_dim, hidden_dim, bias=bias)
        self.gate_a = nn.Linear(pair_dim, hidden_dim, bias=bias)
        self.proj_b = nn.Linear(pair_dim, hidden_dim, bias=bias)
        self.gate_b = nn.Linear(pair_dim, hidden_dim, bias=bias)
        self.layer_norm_out = nn.LayerNorm(hidden_dim, eps=eps)
        self.out_proj = nn.Linear(hidden_dim, pair_dim, bias=bias)
        self.out_gate = nn.Linear(pair_dim, pair_dim, bias=bias)

    _SUBMODULES = ("layer_norm_in", "proj_a", "gate_a", "proj_b", "gate_b", "layer_norm_out", "out_proj", "out_gate")

    def parameters_in_op_order(self):
        """The 16 parameter tensors (None for absent biases) in trimul.forward's order."""
        out = []
        modules = self._modules  # plain dict lookups: nn.Module.__getattr__ costs more than the seed's kernel
        for name in self._SUBMODULES:
            module = modules[name]
            params = module._parameters
            for key in ("weight", "bias"):  # a parametrized weight is not in _parameters
                out.append(params[key] if key in params else getattr(module, key, None))
        return out

    def forward(self, pair_repr: torch.Tensor, pair_mask: torch.Tensor = None) -> torch.Tensor:
        return ops.call(pair_repr, pair_mask, self.parameters_in_op_order(), self.direction, self.gate_input,
                        self.eps, self.precision)

    def extra_repr(self) -> str:
        return f"direction={self.direction!r}, gate_input={self.gate_input!r}, precision={self.precision!r}"
