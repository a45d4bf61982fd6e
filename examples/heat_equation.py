"""Explicit time stepping of the 2-D heat equation on a grid sharded over a 2x4 mesh.

    u_t = alpha * (u_xx + u_yy)       on [0, 1)^2, u = 0 outside (Dirichlet)

Forward Euler with the 5-point Laplacian. The grid ``x y`` is sharded as
``x/dp y/tp``: every rank holds one block, and each step it fetches one
ghost row / column from its neighbours with ``einhalo`` (uneven blocks:
the grid size is not a multiple of the mesh), applies the stencil to its
block, and never sees the rest of the grid. At the end every rank compares
its block with the same simulation run on one process and the script prints
the largest difference.

Run it as a plain script (it starts 8 gloo CPU ranks itself)::

    python examples/heat_equation.py

or under torchrun on 8 processes::

    torchrun --nproc-per-node 8 examples/heat_equation.py
    torchrun --nproc-per-node 8 examples/heat_equation.py --device cuda   # one GPU per rank over NCCL
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import einshard as es
from einshard.testing import device_mesh, launch, local_block, parse_device, rank_device

N_X, N_Y = 50, 61  # deliberately not multiples of the mesh: uneven blocks
STEPS = 300
ALPHA = 1.0
LAYOUT = "x/dp y/tp"


def initial_condition() -> torch.Tensor:
    """A hot off-centre Gaussian blob plus a hot stripe, on the whole grid."""
    x = torch.linspace(0, 1, N_X, dtype=torch.float64, device=rank_device())[:, None]
    y = torch.linspace(0, 1, N_Y, dtype=torch.float64, device=rank_device())[None, :]
    blob = torch.exp(-((x - 0.3) ** 2 + (y - 0.6) ** 2) / 0.01)
    stripe = ((y > 0.1) & (y < 0.15)).to(torch.float64) * 0.5
    return blob + stripe


def time_step() -> tuple[float, float]:
    h = 1.0 / max(N_X, N_Y)
    dt = 0.2 * h * h / ALPHA  # stable: dt <= h^2 / (4 alpha)
    return dt, ALPHA * dt / (h * h)


def step_local(u: torch.Tensor, r: float) -> torch.Tensor:
    """One step on the whole grid in one process (the reference)."""
    p = F.pad(u, (1, 1, 1, 1))  # zero Dirichlet boundary
    lap = p[2:, 1:-1] + p[:-2, 1:-1] + p[1:-1, 2:] + p[1:-1, :-2] - 4 * u
    return u + r * lap


def step_sharded(u: torch.Tensor, r: float, mesh, shapes) -> torch.Tensor:
    """One step on this rank's block: halo exchange, then the same stencil."""
    p = es.einhalo(LAYOUT, u, {"x": 1, "y": 1}, boundary="constant", fill=0.0, mesh=mesh, shapes=shapes)
    lap = p[2:, 1:-1] + p[:-2, 1:-1] + p[1:-1, 2:] + p[1:-1, :-2] - 4 * u
    return u + r * lap


def simulate() -> dict:
    """Runs on every rank: the sharded simulation, then the comparison with one process."""
    mesh = es.wrap_mesh(device_mesh((2, 4), ("dp", "tp")))
    shapes = {"dp": es.comm.helpers.compute_split_shapes(N_X, 2), "tp": es.comm.helpers.compute_split_shapes(N_Y, 4)}
    dt, r = time_step()
    u0 = initial_condition()

    u = local_block(u0, LAYOUT, mesh, shapes=shapes).clone()
    start = time.perf_counter()
    with es.count_communication() as stats:
        for _ in range(STEPS):
            u = step_sharded(u, r, mesh, shapes)
    elapsed = time.perf_counter() - start

    ref = u0
    for _ in range(STEPS):
        ref = step_local(ref, r)
    diff = torch.tensor([(u - local_block(ref, LAYOUT, mesh, shapes=shapes)).abs().max().item()], dtype=torch.float64,
                        device=u.device)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    heat = torch.tensor([u.sum().item()], dtype=torch.float64, device=u.device)
    dist.all_reduce(heat)
    return {
        "rank": dist.get_rank(),
        "block": tuple(u.shape),
        "max_diff": diff.item(),
        "total_heat": heat.item(),
        "reference_heat": ref.sum().item(),
        "seconds": elapsed,
        "bytes_sent_per_step": stats.sent_bytes / STEPS,
        "t_end": STEPS * dt,
    }


def report(results: list[dict]) -> None:
    first = results[0]
    print(f"2-D heat equation, {N_X}x{N_Y} grid sharded '{LAYOUT}' over a 2x4 mesh, {STEPS} steps "
          f"(t = {first['t_end']:.4g})")
    for res in results:
        print(f"  rank {res['rank']}: block {res['block']}, {res['bytes_sent_per_step']:.0f} bytes sent per step")
    print(f"total heat: sharded {first['total_heat']:.12g}, one process {first['reference_heat']:.12g}")
    print(f"simulation time: {max(r['seconds'] for r in results):.2f} s")
    print(f"max difference vs the single-process simulation: {first['max_diff']:.3e}")
    if not first["max_diff"] <= 1e-12 or not math.isfinite(first["max_diff"]):
        raise SystemExit("the sharded simulation differs from the single-process one")


def main(argv=None) -> None:
    # under torchrun/srun this process is one rank (on a GPU with --device cuda); otherwise 8 gloo ranks start here
    results = launch(simulate, 8, timeout=120, device=parse_device(argv, __doc__.splitlines()[0]))
    if results is not None:
        report(results)


if __name__ == "__main__":
    main()
