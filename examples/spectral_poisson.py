"""A periodic Poisson problem on a 3-D grid sharded over a 2x4 mesh, solved spectrally with einfft.

    -∇²u = f   on the periodic box [0, 2π)³,   mean(u) = 0

with the manufactured solution ``u = sin(x) cos(2y) sin(3z) + cos(4x + y) + sin(2y - 3z)``
(so ``f = 14 sin(x) cos(2y) sin(3z) + 17 cos(4x + y) + 13 sin(2y - 3z)``). The grid
``x y z`` lives sharded as ``x/px y/py z`` (pencils: every rank holds one column of
blocks). Every rank

1. transforms its block of ``f`` with a real 3-D FFT whose spectrum comes out in the
   transposed pencil layout ``kx ky/px kz/py`` (two all-to-alls, no rank ever holds a
   whole axis of the grid),
2. divides its block of the spectrum by ``|k|²`` (the wavenumbers of its own block),
3. transforms back to ``x/px y/py z`` with the inverse real FFT (``signal_sizes`` gives
   the odd grid length along z),

then compares its block of ``u`` with the analytic solution; the script prints the
largest error over all ranks. The grid is deliberately not a multiple of the mesh
(uneven blocks) and odd along z.

Run it as a plain script (it starts 8 gloo CPU ranks itself)::

    python examples/spectral_poisson.py

or under torchrun on 8 processes::

    torchrun --nproc-per-node 8 examples/spectral_poisson.py
    torchrun --nproc-per-node 8 examples/spectral_poisson.py --device cuda   # one GPU per rank over NCCL
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

import einshard as es
from einshard.comm.helpers import compute_split_shapes as split
from einshard.testing import device_mesh, launch, parse_device, rank_device

N = (34, 30, 27)  # grid points along x, y, z: uneven over the 2x4 mesh, odd along z
GRID = "x/px y/py z"
SPECTRUM = "kx ky/px kz/py"
AXES = {"x": "kx", "y": "ky", "z": "kz"}  # the last entry, z, is the half-spectrum axis


def split_shapes() -> dict:
    """The blocks of every sharded axis (uneven ones must be given: each rank only sees its own)."""
    return {
        "px": {"x": split(N[0], 2), "ky": split(N[1], 2)},
        "py": {"y": split(N[1], 4), "kz": split(N[2] // 2 + 1, 4)},
    }


def solution(x, y, z):
    return torch.sin(x) * torch.cos(2 * y) * torch.sin(3 * z) + torch.cos(4 * x + y) + torch.sin(2 * y - 3 * z)


def source(x, y, z):
    return (
        14 * torch.sin(x) * torch.cos(2 * y) * torch.sin(3 * z)
        + 17 * torch.cos(4 * x + y)
        + 13 * torch.sin(2 * y - 3 * z)
    )


def solve() -> dict:
    """Runs on every rank: build this rank's block of f, solve, compare with the analytic u."""
    mesh = es.wrap_mesh(device_mesh((2, 4), ("px", "py")))
    shapes = split_shapes()

    # this rank's grid coordinates: split the whole 1-D coordinate vectors like the grid
    def coords(n, spec):
        whole = torch.arange(n, dtype=torch.float64, device=rank_device()) * (2 * math.pi / n)
        return es.einshard(f"{spec.split('/')[0]} -> {spec}", whole, mesh=mesh) if "/" in spec else whole

    x = coords(N[0], "x/px")[:, None, None]
    y = coords(N[1], "y/py")[None, :, None]
    z = coords(N[2], "z")[None, None, :]
    f = source(x, y, z)

    def poisson(f):
        f_hat = es.einfft(f"{GRID} -> {SPECTRUM}", f, AXES, real=True, mesh=mesh, shapes=shapes)

        # wavenumbers of this rank's block of the spectrum (integers: the box has length 2π)
        def wavenumbers(n, spec, half=False):
            k = torch.fft.rfftfreq(n, 1 / n) if half else torch.fft.fftfreq(n, 1 / n)
            k = k.to(rank_device(), torch.float64)
            return es.einshard(f"{spec.split('/')[0]} -> {spec}", k, mesh=mesh) if "/" in spec else k

        kx = wavenumbers(N[0], "kx")[:, None, None]
        ky = wavenumbers(N[1], "ky/px")[None, :, None]
        kz = wavenumbers(N[2], "kz/py", half=True)[None, None, :]
        k2 = kx**2 + ky**2 + kz**2
        u_hat = torch.where(k2 > 0, f_hat / torch.where(k2 > 0, k2, 1.0), 0)  # mean(u) = 0
        u = es.einfft(f"{SPECTRUM} -> {GRID}", u_hat, {v: k for k, v in AXES.items()}, real=True, inverse=True,
                   mesh=mesh, shapes=shapes, signal_sizes={"z": N[2]})
        return u, f_hat

    poisson(f)  # the first call plans both transforms; later calls only run them
    start = time.perf_counter()
    with es.count_communication() as stats:
        u, f_hat = poisson(f)
    seconds = time.perf_counter() - start

    error = torch.tensor([(u - solution(x, y, z)).abs().max().item()], dtype=torch.float64, device=u.device)
    dist.all_reduce(error, op=dist.ReduceOp.MAX)
    plan = es.einfft(f"{GRID} -> {SPECTRUM}", f, AXES, real=True, mesh=mesh, shapes=shapes, explain=True)
    return {
        "rank": dist.get_rank(),
        "block": tuple(f.shape),
        "spectrum_block": tuple(f_hat.shape),
        "error": error.item(),
        "seconds": seconds,
        "sent_bytes": stats.sent_bytes,
        "plan": str(plan),
    }


def report(results: list[dict]) -> None:
    first = results[0]
    print(f"periodic Poisson problem on a {N[0]}x{N[1]}x{N[2]} grid sharded '{GRID}' over a 2x4 mesh (8 ranks)")
    print(first["plan"])
    for res in results:
        print(f"  rank {res['rank']}: grid block {res['block']}, spectrum block {res['spectrum_block']}, "
              f"{res['sent_bytes']:,} bytes sent for both transforms")
    print(f"steady-state solve time (forward FFT, divide, inverse FFT): {max(r['seconds'] for r in results) * 1e3:.1f} ms")
    print(f"max error vs the analytic solution: {first['error']:.3e}")
    if not first["error"] < 1e-10:
        raise SystemExit("the spectral solution does not match the analytic one")


def main(argv=None) -> None:
    # under torchrun/srun this process is one rank (on a GPU with --device cuda); otherwise 8 gloo ranks start here
    results = launch(solve, 8, timeout=120, device=parse_device(argv, __doc__.splitlines()[0]))
    if results is not None:
        report(results)


if __name__ == "__main__":
    main()
