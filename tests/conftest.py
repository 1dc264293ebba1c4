import math

import pytest
import torch

import trimul
from trimul.ops import PARAM_NAMES

HAS_GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")

# SPEC section 3: ||out - ref|| / ||ref|| against float64
BOUNDS = {"ieee": 1e-5, "tf32": 2e-3, "bf16": 1.2e-2, "fp16": 1.2e-2}


def make_params(P, H, *, dtype=torch.float32, device="cpu", bias=True, ln_affine=True, generator=None):
    """Random parameters in trimul.forward's order; LayerNorm affines away from (1, 0)
    so that using the wrong one shows."""
    g = generator

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)

    p = {
        "ln_in_weight": 1 + 0.3 * rnd(P), "ln_in_bias": 0.2 * rnd(P),
        "proj_a_weight": rnd(H, P, scale=P ** -0.5), "proj_a_bias": 0.1 * rnd(H),
        "gate_a_weight": rnd(H, P, scale=P ** -0.5), "gate_a_bias": 0.1 * rnd(H),
        "proj_b_weight": rnd(H, P, scale=P ** -0.5), "proj_b_bias": 0.1 * rnd(H),
        "gate_b_weight": rnd(H, P, scale=P ** -0.5), "gate_b_bias": 0.1 * rnd(H),
        "ln_out_weight": 1 + 0.3 * rnd(H), "ln_out_bias": 0.2 * rnd(H),
        "out_proj_weight": rnd(P, H, scale=H ** -0.5), "out_proj_bias": 0.1 * rnd(P),
        "out_gate_weight": rnd(P, P, scale=P ** -0.5), "out_gate_bias": 0.1 * rnd(P),
    }
    if not bias:
        for k in [k for k in p if k.endswith("_bias") and not k.startswith("ln_")]:
            p[k] = None
    if not ln_affine:
        for k in [k for k in p if k.startswith("ln_")]:
            p[k] = None
    return [p[n] for n in PARAM_NAMES]


def make_x(shape, *, dtype=torch.float32, device="cpu", heavy=False, generator=None):
    if heavy:  # Student-t with 3 degrees of freedom: occasional large entries
        t = torch.distributions.StudentT(torch.tensor(3.0, dtype=torch.float64))
        x = t.sample(shape)
    else:
        x = torch.randn(shape, generator=generator, dtype=torch.float64)
    return x.to(dtype).to(device)


def make_mask(shape, kind, device="cpu"):
    if kind is None:
        return None
    keep = torch.rand(shape, dtype=torch.float64) > 0.2
    if kind == "bool":
        m = keep
    elif kind == "int":
        m = keep.to(torch.int32)
    elif kind == "float":  # soft mask values, not only 0/1
        m = keep.to(torch.float32) * torch.rand(shape, dtype=torch.float64).to(torch.float32)
    else:
        raise ValueError(kind)
    return m.to(device)


def reference64(x, mask, params, direction="incoming", gate_input="input", eps=1e-5):
    return trimul.triangle_multiplication_reference(
        x, mask, *params, direction=direction, gate_input=gate_input, eps=eps, dtype=torch.float64)


def reference_grads64(x, mask, params, grad, direction="incoming", gate_input="input", eps=1e-5):
    """Gradients for x and every parameter by float64 autograd through the reference, at the
    values of x and params (whatever their dtypes), for the output gradient `grad`; None for
    an absent parameter."""
    x64 = x.detach().double().requires_grad_()
    p64 = [None if t is None else t.detach().double().requires_grad_() for t in params]
    out = reference64(x64, mask, p64, direction, gate_input, eps)
    leaves = [t for t in (x64, *p64) if t is not None]
    grads = iter(torch.autograd.grad(out, leaves, grad.double()))
    return [None if t is None else next(grads) for t in (x64, *p64)]


def gradient_errors(out, x, mask, params, grad, direction="incoming", gate_input="input", eps=1e-5):
    """(name, gradient, its error against float64 autograd) for x and each parameter, in the op's
    argument order: the gradients of the op's output `out` for `grad`."""
    mine = torch.autograd.grad(out, [x, *params], grad)
    ref = reference_grads64(x, mask, params, grad, direction, gate_input, eps)
    return [(name, a, rel_err(a, b)) for name, a, b in zip(["x", *PARAM_NAMES], mine, ref)]


def training_loss_curves(pair_dim, hidden_dim, x, target, steps=15):
    """The loss curves (trimul's, the plain module's) of two stacked updates trained for `steps`
    Adam steps on (x, target), on x's device: trimul.TriangleMultiplication against the seed's
    plain PyTorch module holding the same weights (asserted), which computes in fp32 from x with
    an all-ones mask and returns x's dtype."""
    from trimul.demo import SeedModel

    class Plain(torch.nn.Module):
        def __init__(self, pair_dim, hidden_dim):
            super().__init__()
            self.inner = SeedModel(pair_dim, hidden_dim)

        def forward(self, x):
            return self.inner(x.float(), torch.ones(x.shape[:-1], device=x.device)).to(x.dtype)

    def model(cls):
        torch.manual_seed(3)
        return torch.nn.Sequential(cls(pair_dim, hidden_dim), cls(pair_dim, hidden_dim)).to(x.device)

    ours, plain = model(trimul.TriangleMultiplication), model(Plain)
    for a, b in zip(ours.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    curves = []
    for m in (ours, plain):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x).float(), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(losses)
    return curves


def rel_err(out, ref):
    out = out.to(torch.float64)
    assert not torch.isnan(out).any(), "output holds NaN"
    den = ref.norm().item()
    return (out - ref).norm().item() / (den if den > 0 else 1.0)


def poison_cuda_allocator():
    """Fills freed blocks of the caching allocator with NaN, so that an output
    element a kernel forgets to write reads as NaN."""
    blocks = [torch.empty(s, dtype=torch.float32, device="cuda").fill_(math.nan)
              for s in [1 << 16] * 16 + [1 << 24] * 6]
    del blocks


# worst rel. error seen per precision bound, reported at the end of the run
WORST = {}


def record(bound_key, err, case):
    if err > WORST.get(bound_key, (-1.0, None))[0]:
        WORST[bound_key] = (err, case)


def pytest_terminal_summary(terminalreporter):
    if WORST:
        terminalreporter.write_line("worst rel. error against float64, per precision (bound):")
        for key, (err, case) in sorted(WORST.items()):
            terminalreporter.write_line(f"  {key:5s} ({BOUNDS[key]:.1e}): {err:.3e}  at {case}")
