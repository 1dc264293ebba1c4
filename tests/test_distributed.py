"""trimul.distributed on CPU processes with the gloo backend: each rank's rows of
the output and of every gradient equal the single-process op's, for 2 and 4
processes, both directions, even and uneven row blocks."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import trimul
from trimul import distributed

P, H = 12, 8


def inputs(N):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(2, N, N, P, generator=g, dtype=torch.float64)
    mask = (torch.rand(2, N, N, generator=g) > 0.2).double()
    torch.manual_seed(5)
    module = trimul.TriangleMultiplication(P, H).double()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.1)
    grad = torch.randn(2, N, N, P, generator=g, dtype=torch.float64)
    return x, mask, module, grad


def worker(rank, world, port, N, direction, gate_input):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x, mask, module, grad = inputs(N)
        module.direction, module.gate_input = direction, gate_input
        params = module.parameters_in_op_order()

        # single process, the whole pair
        x_full = x.clone().requires_grad_()
        out_full = torch.ops.trimul.forward(x_full, mask, *params, direction, gate_input, 1e-5, "default")
        full_grads = torch.autograd.grad(out_full, [x_full, *params], grad)

        # this rank's rows
        rows = distributed.row_block(N, rank, world)
        x_rows = x[:, rows].clone().requires_grad_()
        out_rows = distributed.triangle_multiplication(x_rows, mask[:, rows], module)
        grads = torch.autograd.grad(out_rows, [x_rows, *params], grad[:, rows])

        def close(a, b):
            return ((a - b).norm() / b.norm().clamp_min(1e-30)).item() < 1e-10

        assert close(out_rows, out_full[:, rows].detach()), "forward"
        assert close(grads[0], full_grads[0][:, rows]), "grad of x"
        for name, g_rank, g_full in zip(trimul.ops.PARAM_NAMES, grads[1:], full_grads[1:]):
            total = g_rank.clone()
            dist.all_reduce(total)  # parameters are replicated: their gradient is the sum over ranks
            assert close(total, g_full), f"grad of {name}"
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world,N", [(2, 8), (2, 7), (4, 10)])
@pytest.mark.parametrize("direction,gate_input", [("incoming", "input"), ("outgoing", "normalized")])
def test_matches_single_process(world, N, direction, gate_input):
    mp.spawn(worker, args=(world, free_port(), N, direction, gate_input), nprocs=world, join=True)


def test_row_block_covers_all_rows():
    for n, w in [(10, 4), (7, 2), (3, 4)]:
        blocks = [distributed.row_block(n, r, w) for r in range(w)]
        assert [i for b in blocks for i in range(b.start, b.stop)] == list(range(n))
