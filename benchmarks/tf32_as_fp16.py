"""tf32 operands as fp16 with power-of-two scales, emulated on the CPU (benchmarks/NOTES.md, "fp32 on
tensor cores"): the forward's relative error against float64 when its input-stage and contraction
operands are rounded to tf32, and when they are instead scaled by powers of two chosen from the
parameters alone and rounded to fp16 (γ folded into the weights, xhat unscaled; a and b per plane
h by |a_h| <= (sum_i |W'_hi| sqrt(P - 1) + |b'_h|) max|mask|). Products in float64; the output stage
at tf32 in both.

    python benchmarks/tf32_as_fp16.py
"""
import math

import torch

import trimul
from trimul.bench import rel_err


def inputs(P, H, N, heavy):
    """A pair (normal, or Student-t with 3 degrees of freedom), a 0/1 mask, parameters as the tests
    draw them (trimul.forward's order), float64."""
    if heavy:
        x = torch.distributions.StudentT(torch.tensor(3.0, dtype=torch.float64)).sample((1, N, N, P))
    else:
        x = torch.randn(1, N, N, P, dtype=torch.float64)
    mask = (torch.rand(1, N, N, dtype=torch.float64) > 0.2).double()

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, dtype=torch.float64) * scale

    def w():
        return rnd(H, P, scale=P ** -0.5)

    p = [1 + 0.3 * rnd(P), 0.2 * rnd(P), w(), 0.1 * rnd(H), w(), 0.1 * rnd(H), w(), 0.1 * rnd(H), w(), 0.1 * rnd(H),
         1 + 0.3 * rnd(H), 0.2 * rnd(H), rnd(P, H, scale=H ** -0.5), 0.1 * rnd(P), rnd(P, P, scale=P ** -0.5),
         0.1 * rnd(P)]
    return x, mask, p


def tf32(t):
    """t rounded to tf32 (10 stored significand bits, halves away from zero, as cvt.rna)."""
    i = t.float().view(torch.int32)
    return ((i + 0x1000) & ~0x1FFF).view(torch.float32).double()


def pow2_scale(bound):
    """The largest power of two that keeps `bound` at or below 2^15 (fp16's largest is 65504)."""
    return 2.0 ** math.floor(math.log2(32768.0 / bound))


def forward(x, mask, p, scaled):
    lnw, lnb, wpa, bpa, wga, bga, wpb, bpb, wgb, bgb, low, lob, wo, bo, wg, bg = p
    P = x.shape[-1]
    xhat = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
    xn = xhat * lnw + lnb
    m = mask[..., None]

    def gated(wp, bp, wg_, bg_):
        if not scaled:
            return (tf32(xn) @ tf32(wp).T + bp) * torch.sigmoid(tf32(xn) @ tf32(wg_).T + bg_) * m
        xh = xhat.half().double()  # |xhat| <= sqrt(P - 1): in range unscaled

        def proj(w, b):
            wf, bf = w * lnw, w @ lnb + b
            s = pow2_scale(wf.abs().max().item())
            return xh @ ((wf * s).half().double() / s).T + bf

        t = proj(wp, bp) * torch.sigmoid(proj(wg_, bg_)) * m
        bound = ((wp * lnw).abs().sum(1) * math.sqrt(P - 1) + (wp @ lnb + bp).abs()) * mask.abs().max()
        s = torch.tensor([pow2_scale(v) for v in bound.tolist()], dtype=torch.float64)
        return (t * s).half().double() / s, (t.abs().amax(dim=(0, 1, 2)) / bound).max().item()

    if scaled:
        (a, fa), (b, fb) = gated(wpa, bpa, wga, bga), gated(wpb, bpb, wgb, bgb)
        fill = max(fa, fb)
    else:
        a, b, fill = tf32(gated(wpa, bpa, wga, bga)), tf32(gated(wpb, bpb, wgb, bgb)), None
    c = torch.einsum("...ikh,...jkh->...ijh", a, b)
    cn = (c - c.mean(-1, keepdim=True)) / torch.sqrt(c.var(-1, unbiased=False, keepdim=True) + 1e-5) * low + lob
    return (tf32(cn) @ tf32(wo).T + bo) * torch.sigmoid(tf32(xn) @ tf32(wg).T + bg), fill


def main():
    torch.manual_seed(0)
    print("| P, H | x | tf32 operands | fp16, power-of-two scales | largest abs(a) over its plane's bound |")
    print("|---|---|---|---|---|")
    for P, H in ((128, 128), (64, 32)):
        for heavy in (False, True):
            x, mask, p = inputs(P, H, 48, heavy)
            ref = trimul.triangle_multiplication_reference(x, mask, *p, direction="outgoing", gate_input="normalized",
                                                           dtype=torch.float64)
            e_tf32 = rel_err(forward(x, mask, p, False)[0], ref)
            out, fill = forward(x, mask, p, True)
            print(f"| {P}, {H} | {'heavy-tailed' if heavy else 'normal'} | {e_tf32:.2e} | {rel_err(out, ref):.2e} "
                  f"| {fill:.2e} |")


if __name__ == "__main__":
    main()
