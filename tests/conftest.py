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


def gradient_errors(out, x, mask, params, grad, direction="incoming", gate_input="input", eps=1e-5, mine=None):
    """(name, gradient, its error against float64 autograd) for x and each parameter, in the op's
    argument order: the gradients of the op's output `out` for `grad` (or `mine`, taken already)."""
    if mine is None:
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


# Random calls (check_random_calls): pair and hidden widths from 2 (up to PYTORCH_BACKWARD_MAX_P and
# _H an fp32 pair computes in float64) and, forward only, 1 (a LayerNorm over one channel has no
# gradient but rounding noise: benchmarks/NOTES.md, "float32 arithmetic at a small H")
RANDOM_SIZES = (0, 1, 2, 5, 9, 17)
RANDOM_WIDTHS = (2, 3, 4, 5, 8, 16, 20, 33)
RANDOM_HIDDEN = (2, 3, 5, 8, 12, 16, 24)
RANDOM_NARROW = (1,)


def random_call(rng, g, device):
    """One random call on `device`: (x, mask, params, direction, gate_input, precision, with_grads)."""
    narrow = rng.random() < 0.1
    batch = tuple(rng.choice([1, 2, 3]) for _ in range(rng.choice([0, 1, 2])))
    N = rng.choice(RANDOM_SIZES)
    P = rng.choice(RANDOM_NARROW if narrow else RANDOM_WIDTHS)
    H = rng.choice(RANDOM_NARROW if narrow else RANDOM_HIDDEN)
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16, torch.float64])
    x = make_x((*batch, N, N, P), generator=g, heavy=rng.random() < 0.3)
    if rng.random() < 0.3:  # the pair transposed: a view with strided rows
        x = x.transpose(-2, -3).contiguous().transpose(-2, -3)
    x = x.to(dtype).to(device).requires_grad_()
    kind = rng.choice([None, torch.bool, torch.uint8, torch.int64, torch.float16, torch.float64])
    keep = torch.rand((*batch, N, N), generator=g, dtype=torch.float64)
    mask = None if kind is None else (keep > 0.3).to(kind) if not kind.is_floating_point else keep.to(kind)
    mask = None if mask is None else mask.to(device)
    pdtype = rng.choice([torch.float32, torch.float64, dtype])
    params = make_params(P, H, generator=g, bias=rng.random() < 0.7)
    params = [None if t is None else t.to(pdtype).to(device).requires_grad_() for t in params]
    direction, gate_input = rng.choice(["incoming", "outgoing"]), rng.choice(["input", "normalized"])
    precision = rng.choice(["default", "ieee", "tf32", "bf16", "fp16"])
    return x, mask, params, direction, gate_input, precision, not narrow and x.numel() > 0


def check_random_calls(seed, count, device, before=None):
    """`count` random calls (random_call, from `seed`) on `device`, each after `before()` where given
    (poison_cuda_allocator): the output in x's shape and dtype
    within the bound of the precision (for a 16-bit x, the bf16 one: the output is rounded to it; plus
    what the exact result rounded to an fp16 output exceeds where all of it lies below fp16's normal
    range), each gradient in its input's dtype and shape within twice it, against float64 autograd
    of the reference."""
    import random

    from trimul.ops import resolve_precision

    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    for call in range(count):
        x, mask, params, direction, gate_input, precision, with_grads = random_call(rng, g, device)
        if before is not None:
            before()
        out = torch.ops.trimul.forward(x, mask, *params, direction, gate_input, 1e-5, precision)
        assert out.shape == x.shape and out.dtype == x.dtype, call
        if x.numel() == 0:
            continue
        bound = BOUNDS["bf16" if x.dtype in (torch.bfloat16, torch.float16) else
                       "ieee" if x.dtype == torch.float64 else resolve_precision(x.dtype, precision)]
        detached = [None if t is None else t.detach() for t in params]
        ref = reference64(x.detach(), mask, detached, direction, gate_input)
        unit = torch.finfo(out.dtype).eps / 2
        allowance = max(0.0, rel_err(ref.to(out.dtype), ref) - unit)
        err = rel_err(out, ref)
        assert err < bound + allowance, (call, err)
        if not with_grads:
            continue
        grad = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype).to(device)
        leaves = [x] + [t for t in params if t is not None]
        mine = torch.autograd.grad(out, leaves, grad)
        ref = [r for r in reference_grads64(x.detach(), mask, detached, grad, direction, gate_input) if r is not None]
        for k, (a, r, leaf) in enumerate(zip(mine, ref, leaves)):
            assert a.dtype == leaf.dtype and a.shape == leaf.shape, (call, k)
            assert rel_err(a, r) < 2 * bound, (call, k, rel_err(a, r))


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
