"""The update's backward, written out stage by stage (PyTorch ops, any device).

Saved from the forward: the inputs only. Recomputed: LayerNorm statistics,
projections and gates, a and b. Per-position work (both LayerNorms, the four
input projections, the output projection and gate) runs over chunks of
positions, so its intermediates never exist for the whole pair at once; only
a, b, dc and their gradients span it (at most four N²·H tensors alive at a
time, against a dozen for autograd through the reference formula). Weight
gradients accumulate chunk after chunk in a fixed order: bitwise repeatable.

Notation as SPEC section 1: xn = LN(x), a = (xn·Wpaᵀ + bpa) · σ(xn·Wgaᵀ + bga) · m,
b likewise, c = the triangle product of a and b, out = (LN(c)·Woᵀ + bo) · σ(u·Wgᵀ + bg).
"""
from typing import List, Optional, Sequence

import torch

from .reference import contract

Tensor = torch.Tensor

# The per-position stages run in about CHUNKS chunks of positions (none smaller
# than MIN_CHUNK_ROWS): their intermediates, ~16 values per position and hidden
# unit, then take about one N²·H tensor's worth at a time, and the number of
# launches stays fixed as N grows.
CHUNKS = 16
MIN_CHUNK_ROWS = 4096


def _layer_norm_parts(v: Tensor, eps: float):
    """(v - mean) · rstd over the last dim, and rstd."""
    mu = v.mean(-1, keepdim=True)
    d = v - mu
    rstd = torch.rsqrt((d * d).mean(-1, keepdim=True) + eps)
    return d * rstd, rstd


def _layer_norm_backward(dvhat: Tensor, vhat: Tensor, rstd: Tensor) -> Tensor:
    """Gradient of (v - mean) · rstd given the gradient of its output."""
    return rstd * (dvhat - dvhat.mean(-1, keepdim=True) - vhat * (dvhat * vhat).mean(-1, keepdim=True))


def _affine(t: Optional[Tensor], fill: float, n: int, like: Tensor) -> Tensor:
    return torch.full((n,), fill, dtype=like.dtype, device=like.device) if t is None else t


def _grad_a(dc: Tensor, b: Tensor, direction: str) -> Tensor:
    """Gradient of the triangle product for a, from dc and b."""
    if direction == "incoming":  # c[i,j] = sum_k a[k,i] b[k,j]
        return torch.einsum("...ijh,...kjh->...kih", dc, b)
    return torch.einsum("...ijh,...jkh->...ikh", dc, b)  # c[i,j] = sum_k a[i,k] b[j,k]


def _grad_b(dc: Tensor, a: Tensor, direction: str) -> Tensor:
    """Gradient of the triangle product for b, from dc and a."""
    if direction == "incoming":
        return torch.einsum("...ijh,...kih->...kjh", dc, a)
    return torch.einsum("...ijh,...ikh->...jkh", dc, a)


def triangle_multiplication_backward(grad: Tensor, x: Tensor, mask: Optional[Tensor],
                                     params: Sequence[Optional[Tensor]], direction: str, gate_input: str,
                                     eps: float, dtype: torch.dtype) -> List[Optional[Tensor]]:
    """Gradients of the update for x and the 16 parameters (trimul.forward's
    order; None for absent parameters), computed in `dtype` and returned in it."""
    shape = x.shape
    P = shape[-1]
    N = shape[-2]
    x4 = x.to(dtype).reshape(-1, N, N, P)
    g4 = grad.to(dtype).reshape(-1, N, N, P)
    m3 = None if mask is None else mask.to(dtype).reshape(-1, N, N)
    p = [None if t is None else t.to(dtype) for t in params]
    lnw_in, lnb_in, wpa, bpa, wga, bga, wpb, bpb, wgb, bgb, lnw_out, lnb_out, wo, bo, wg, bg = p
    H = wpa.shape[0]
    lnw_in = _affine(lnw_in, 1.0, P, x4)
    lnw_out = _affine(lnw_out, 1.0, H, x4)
    w_in = torch.cat([wpa, wga, wpb, wgb])  # (4H, P)
    b_in = torch.cat([_affine(t, 0.0, H, x4) for t in (bpa, bga, bpb, bgb)])
    rows = x4.shape[0] * N * N
    xr, gr = x4.reshape(rows, P), g4.reshape(rows, P)
    mr = None if m3 is None else m3.reshape(rows, 1)
    step = max(MIN_CHUNK_ROWS, -(-rows // CHUNKS))
    chunks = [(r0, min(r0 + step, rows)) for r0 in range(0, rows, step)]

    def normalized_input(r0, r1):
        xhat, rstd = _layer_norm_parts(xr[r0:r1], eps)
        return xhat, rstd, xhat * lnw_in + (0.0 if lnb_in is None else lnb_in)

    def input_chunk(r0, r1):
        xhat, rstd, xn = normalized_input(r0, r1)
        pre = torch.nn.functional.linear(xn, w_in, b_in)  # (rows, 4H): pa, ga, pb, gb
        return xhat, rstd, xn, pre

    # a, b for the whole pair
    a = torch.empty(rows, H, dtype=dtype, device=x.device)
    b = torch.empty(rows, H, dtype=dtype, device=x.device)
    for r0, r1 in chunks:
        _, _, _, pre = input_chunk(r0, r1)
        pa, ga, pb, gb = pre.split(H, dim=-1)
        m = 1.0 if mr is None else mr[r0:r1]
        a[r0:r1] = pa * torch.sigmoid(ga) * m
        b[r0:r1] = pb * torch.sigmoid(gb) * m
        del pre, pa, ga, pb, gb
    a4, b4 = a.view(-1, N, N, H), b.view(-1, N, N, H)
    c = contract(a4, b4, direction).reshape(rows, H)

    # output stage, per chunk; c is overwritten by dc
    d_lnw_out = torch.zeros(H, dtype=dtype, device=x.device)
    d_lnb_out = torch.zeros(H, dtype=dtype, device=x.device)
    d_wo = torch.zeros_like(wo)
    d_bo = torch.zeros(P, dtype=dtype, device=x.device)
    d_wg = torch.zeros_like(wg)
    d_bg = torch.zeros(P, dtype=dtype, device=x.device)
    # the gradient of the gate's input u; the input stage below turns it into dx in place
    dx = torch.empty(rows, P, dtype=dtype, device=x.device)
    for r0, r1 in chunks:
        chat, rstd_c = _layer_norm_parts(c[r0:r1], eps)
        cn = chat * lnw_out + (0.0 if lnb_out is None else lnb_out)
        y = torch.nn.functional.linear(cn, wo, bo)
        u = xr[r0:r1] if gate_input == "input" else normalized_input(r0, r1)[2]
        sg = torch.sigmoid(torch.nn.functional.linear(u, wg, bg))
        G = gr[r0:r1]
        dy = G * sg
        dgp = G * y * sg * (1 - sg)
        d_wg += dgp.t() @ u
        d_bg += dgp.sum(0)
        dx[r0:r1] = dgp @ wg
        d_wo += dy.t() @ cn
        d_bo += dy.sum(0)
        dcn = dy @ wo
        d_lnw_out += (dcn * chat).sum(0)
        d_lnb_out += dcn.sum(0)
        c[r0:r1] = _layer_norm_backward(dcn * lnw_out, chat, rstd_c)
    dc4 = c.view(-1, N, N, H)
    da = _grad_a(dc4, b4, direction)
    del b4, b  # da needs b, db needs a: four N²·H tensors at most
    db = _grad_b(dc4, a4, direction)
    del dc4, c, a4, a
    da, db = da.reshape(rows, H), db.reshape(rows, H)

    # input stage, per chunk
    d_w_in = torch.zeros_like(w_in)
    d_b_in = torch.zeros(4 * H, dtype=dtype, device=x.device)
    d_lnw_in = torch.zeros(P, dtype=dtype, device=x.device)
    d_lnb_in = torch.zeros(P, dtype=dtype, device=x.device)
    for r0, r1 in chunks:
        xhat, rstd, xn, pre = input_chunk(r0, r1)
        pa, ga, pb, gb = pre.split(H, dim=-1)
        sa, sb = torch.sigmoid(ga), torch.sigmoid(gb)
        m = 1.0 if mr is None else mr[r0:r1]
        da_m, db_m = da[r0:r1] * m, db[r0:r1] * m
        dpre = torch.cat([da_m * sa, da_m * pa * sa * (1 - sa), db_m * sb, db_m * pb * sb * (1 - sb)], dim=-1)
        d_w_in += dpre.t() @ xn
        d_b_in += dpre.sum(0)
        dxn = dpre @ w_in
        du = dx[r0:r1]
        if gate_input == "normalized":
            dxn = dxn + du
        d_lnw_in += (dxn * xhat).sum(0)
        d_lnb_in += dxn.sum(0)
        dxr = _layer_norm_backward(dxn * lnw_in, xhat, rstd)
        if gate_input == "input":
            dxr = dxr + du
        dx[r0:r1] = dxr

    dwpa, dwga, dwpb, dwgb = d_w_in.split(H)
    dbpa, dbga, dbpb, dbgb = d_b_in.split(H)
    grads = [d_lnw_in, d_lnb_in, dwpa, dbpa, dwga, dbga, dwpb, dbpb, dwgb, dbgb, d_lnw_out, d_lnb_out,
             d_wo, d_bo, d_wg, d_bg]
    grads = [None if t is None else d for t, d in zip(params, grads)]
    return [dx.view(shape)] + grads
