"""trimul.convert against each project's own formula, written from its source
(OpenFold's triangular_multiplicative_update.py, Boltz's triangular_mult.py,
cuEquivariance's reference); their packages are not dependencies."""
import pytest
import torch
from torch import nn

import trimul
from trimul import convert

from conftest import make_mask, make_x, rel_err

F = torch.nn.functional


class OpenFoldLike(nn.Module):
    """OpenFold's TriangleMultiplicativeUpdate, parameter names and forward as in its source."""

    def __init__(self, c_z, c_hidden, _outgoing=True, fused=False):
        super().__init__()
        self._outgoing, self.fused, self.c_hidden = _outgoing, fused, c_hidden
        if fused:
            self.linear_ab_p = nn.Linear(c_z, 2 * c_hidden)
            self.linear_ab_g = nn.Linear(c_z, 2 * c_hidden)
        else:
            self.linear_a_p = nn.Linear(c_z, c_hidden)
            self.linear_a_g = nn.Linear(c_z, c_hidden)
            self.linear_b_p = nn.Linear(c_z, c_hidden)
            self.linear_b_g = nn.Linear(c_z, c_hidden)
        self.linear_g = nn.Linear(c_z, c_z)
        self.linear_z = nn.Linear(c_hidden, c_z)
        self.layer_norm_in = nn.LayerNorm(c_z)
        self.layer_norm_out = nn.LayerNorm(c_hidden)

    def forward(self, z, mask):
        mask = mask.unsqueeze(-1)
        z = self.layer_norm_in(z)
        if self.fused:
            ab = mask * torch.sigmoid(self.linear_ab_g(z)) * self.linear_ab_p(z)
            a, b = ab[..., :self.c_hidden], ab[..., self.c_hidden:]
        else:
            a = self.linear_a_p(z) * torch.sigmoid(self.linear_a_g(z)) * mask
            b = self.linear_b_p(z) * torch.sigmoid(self.linear_b_g(z)) * mask
        if self._outgoing:  # [*, C, N_i, N_k] @ [*, C, N_k, N_j]
            p = torch.matmul(a.permute(0, 3, 1, 2), b.permute(0, 3, 2, 1))
        else:
            p = torch.matmul(a.permute(0, 3, 2, 1), b.permute(0, 3, 1, 2))
        x = self.linear_z(self.layer_norm_out(p.permute(0, 2, 3, 1)))
        return x * torch.sigmoid(self.linear_g(z))


class BoltzLike(nn.Module):
    """Boltz's TriangleMultiplication{Outgoing,Incoming}, as in its source."""

    def __init__(self, dim, outgoing=True):
        super().__init__()
        self.outgoing = outgoing
        self.norm_in = nn.LayerNorm(dim, eps=1e-5)
        self.p_in = nn.Linear(dim, 2 * dim, bias=False)
        self.g_in = nn.Linear(dim, 2 * dim, bias=False)
        self.norm_out = nn.LayerNorm(dim)
        self.p_out = nn.Linear(dim, dim, bias=False)
        self.g_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x, mask):
        x = self.norm_in(x)
        x_in = x
        x = self.p_in(x) * self.g_in(x).sigmoid()
        x = x * mask.unsqueeze(-1)
        # Boltz: x.float(); here "at least float32", so the float64 check stays float64
        a, b = torch.chunk(x.to(torch.promote_types(x.dtype, torch.float32)), 2, dim=-1)
        eq = "bikd,bjkd->bijd" if self.outgoing else "bkid,bkjd->bijd"
        x = torch.einsum(eq, a, b)
        return self.p_out(self.norm_out(x)) * self.g_out(x_in).sigmoid()


def perturb_(module):
    """Random values everywhere (LayerNorm affines too), so a swapped tensor shows."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() == 1 else p.shape[-1] ** -0.5) + (p.dim() == 1))
    return module.double()


@pytest.mark.parametrize("outgoing", [True, False])
@pytest.mark.parametrize("fused", [False, True])
def test_from_openfold(outgoing, fused):
    torch.manual_seed(0)
    theirs = perturb_(OpenFoldLike(12, 8, _outgoing=outgoing, fused=fused))
    ours = convert.from_openfold(theirs)
    assert ours.direction == ("outgoing" if outgoing else "incoming") and ours.gate_input == "normalized"
    x = make_x((2, 7, 7, 12), dtype=torch.float64)
    mask = make_mask((2, 7, 7), "float").double()
    with torch.no_grad():
        assert rel_err(ours(x, mask), theirs(x, mask)) < 1e-10
    # from a state_dict the direction must be given
    with pytest.raises(ValueError, match="direction"):
        convert.from_openfold(theirs.state_dict())
    again = convert.from_openfold(theirs.state_dict(), direction=ours.direction)
    with torch.no_grad():
        assert torch.equal(again(x, mask), ours(x, mask))


@pytest.mark.parametrize("outgoing", [True, False])
def test_from_boltz(outgoing):
    torch.manual_seed(1)
    theirs = perturb_(BoltzLike(16, outgoing=outgoing))
    ours = convert.from_boltz(theirs, direction="outgoing" if outgoing else "incoming")
    assert ours.proj_a.bias is None
    x = make_x((1, 9, 9, 16), dtype=torch.float64)
    mask = make_mask((1, 9, 9), "bool").double()
    with torch.no_grad():
        assert rel_err(ours(x, mask), theirs(x, mask)) < 1e-10


def test_from_cuequivariance_matches_functional():
    torch.manual_seed(2)
    P, H = 12, 8
    r = lambda *s: torch.randn(*s, dtype=torch.float64) * 0.5
    args = dict(norm_in_weight=1 + r(P), norm_in_bias=r(P), p_in_weight=r(2 * H, P), p_in_bias=r(2 * H),
                g_in_weight=r(2 * H, P), g_in_bias=r(2 * H), norm_out_weight=1 + r(H), norm_out_bias=r(H),
                p_out_weight=r(P, H), p_out_bias=r(P), g_out_weight=r(P, P), g_out_bias=r(P))
    x = make_x((1, 6, 6, P), dtype=torch.float64)
    mask = make_mask((1, 6, 6), "float").double()
    module = convert.from_cuequivariance(**args, direction="incoming")
    with torch.no_grad():
        out = module(x, mask)
    assert torch.allclose(out, trimul.triangle_multiplicative_update(x, "incoming", mask, **args), atol=0, rtol=1e-12)
    with pytest.raises(ValueError, match="biases"):
        convert.from_cuequivariance(**{**args, "g_in_bias": None})
