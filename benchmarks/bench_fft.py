"""Distributed 3-D FFTs with einfft: bytes sent against the transpose lower bound, time against gathering.

Runs on 8 gloo CPU ranks (started here). For a 3-D FFT of an ``N³`` grid sharded
as slabs (one mesh dimension of 8) and as pencils (a 2x4 mesh), complex and
real, it records per rank with ``es.count_communication`` the bytes einfft sends
for one transform (forward, and its backward), and divides the forward bytes by
the lower bound of **one all-to-all of the local data per transposed mesh
dimension** (``(P_d - 1) / P_d`` of the local spectrum block for every mesh
dimension ``d`` whose shard must move; the transposes run on the spectrum, whose
block is what each rank holds when it sends). It also times, in the same run and
on the same data, einfft against the naive alternative: gather the whole grid on
every rank (``es.einshard``), ``torch.fft`` it, keep this rank's block. One JSON
line per case, then a table::

    python benchmarks/bench_fft.py [--size 64] [--repeats 7]

Fields: ``case``, ``formula``, ``mesh``, ``mode``, ``size``, ``bytes_per_rank``
(einfft, forward, averaged over the ranks), ``backward_bytes_per_rank``,
``lower_bound``, ``ratio`` (bytes / bound), ``collectives`` (einfft forward
calls per rank), ``gather_bytes_per_rank`` (the naive path, forward),
``einfft_ms`` and ``gather_ms`` (median over ``--repeats`` of the slowest rank's
time per transform), ``time_ratio`` (einfft / gather).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

import einshard as es
from einshard.testing import MeshSpec, add_device_argument, launch, local_block, rank_device, synchronize

MESHES = {"8": ((8,), ("p",)), "2x4": ((2, 4), ("a", "b"))}
XYZ = {"x": "kx", "y": "ky", "z": "kz"}

# (case, mesh, formula, real, transposed mesh dimensions)
CASES = [
    ("slab, transposed output", "8", "x/p y z -> kx ky/p kz", False, ("p",)),
    ("slab, same layout", "8", "x/p y z -> kx/p ky kz", False, ("p",)),
    ("pencil, transposed output", "2x4", "x/a y/b z -> kx ky/a kz/b", False, ("a", "b")),
    ("pencil, same layout", "2x4", "x/a y/b z -> kx/a ky/b kz", False, ("a", "b")),
    ("slab real, transposed output", "8", "x/p y z -> kx ky/p kz", True, ("p",)),
    ("pencil real, transposed output", "2x4", "x/a y/b z -> kx ky/a kz/b", True, ("a", "b")),
]


def _strip(spec: str) -> str:
    return " ".join(a.split("/")[0] for a in spec.split())


def _timed(fn, repeats: int) -> float:
    """Median over the repeats of the slowest rank's seconds per call."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        t = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=rank_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times)


def _mean_over_ranks(value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64, device=rank_device())
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _run_case(name, mesh_key, formula, real, transposed, n, repeats):
    from einshard.ops.fft import einfft

    shape, names = MESHES[mesh_key]
    mesh = es.wrap_mesh(MeshSpec(shape, names).build())
    src, dst = (s.strip() for s in formula.split("->"))
    torch.manual_seed(0)
    dtype = torch.float32 if real else torch.complex64
    whole = torch.randn(n, n, n, dtype=dtype).to(rank_device())
    x = local_block(whole, src, mesh).clone()

    def sharded():
        return einfft(formula, x, XYZ, real=real, mesh=mesh)

    fft = torch.fft.rfftn if real else torch.fft.fftn
    gather_formula = f"{src} -> {_strip(src)}"
    slice_formula = f"{_strip(dst)} -> {dst}"

    def gathered():
        full = es.einshard(gather_formula, x, mesh=mesh)
        return es.einshard(slice_formula, fft(full), mesh=mesh)

    y = sharded()  # plan, warm up, and check against the naive path
    ref = gathered()
    err = torch.tensor([(y - ref).abs().max().item()], dtype=torch.float64, device=rank_device())
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    assert err.item() < 1e-3, f"{name}: einfft and the gathered FFT differ by {err.item()}"

    xg = x.clone().requires_grad_()
    with es.count_communication() as fwd:
        out = einfft(formula, xg, XYZ, real=real, mesh=mesh)
    with es.count_communication() as bwd:
        out.backward(torch.ones_like(out))
    with es.count_communication() as naive:
        gathered()

    # lower bound: one all-to-all of the local spectrum block per transposed mesh dimension
    local_spectrum = y.numel() * y.element_size()
    bound = sum((1 - 1 / mesh.size(d)) * local_spectrum for d in transposed)
    bound = _mean_over_ranks(bound)

    t_einfft = _timed(sharded, repeats)
    t_gather = _timed(gathered, repeats)
    sent = _mean_over_ranks(fwd.sent_bytes)
    return {
        "bench": "fft",
        "case": name,
        "formula": formula,
        "mesh": mesh_key,
        "mode": "rfftn" if real else "fftn",
        "size": n,
        "bytes_per_rank": sent,
        "backward_bytes_per_rank": _mean_over_ranks(bwd.sent_bytes),
        "lower_bound": bound,
        "ratio": round(sent / bound, 4) if bound else None,
        "collectives": fwd.calls,
        "gather_bytes_per_rank": _mean_over_ranks(naive.sent_bytes),
        "einfft_ms": round(t_einfft * 1e3, 3),
        "gather_ms": round(t_gather * 1e3, 3),
        "time_ratio": round(t_einfft / t_gather, 3),
    }


def _all_cases(n, repeats, only):
    torch.set_num_threads(1)
    return [_run_case(*case, n, repeats) for case in CASES if only is None or only in case[0]]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64, help="the grid is size^3")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--case", default=None, help="only cases whose name contains this")
    add_device_argument(parser)
    args = parser.parse_args()
    results = launch(_all_cases, 8, args=(args.size, args.repeats, args.case), timeout=900, checks=False,
                     device=args.device)
    if results is None:  # another rank under torchrun: rank 0 prints
        return
    results = results[0]
    for line in results:
        print(json.dumps(line))
    print(file=sys.stderr)  # the table is for people: stderr, so stdout stays JSON lines
    header = f"{'case':32s} {'mesh':4s} {'bytes/rank':>11s} {'bound':>11s} {'ratio':>5s} {'gather B':>11s} " \
             f"{'einfft ms':>9s} {'gather ms':>9s} {'t ratio':>7s}"
    print(header, file=sys.stderr)
    for r in results:
        print(
            f"{r['case']:32s} {r['mesh']:4s} {r['bytes_per_rank']:11,.0f} {r['lower_bound']:11,.0f} "
            f"{r['ratio']:5.2f} {r['gather_bytes_per_rank']:11,.0f} {r['einfft_ms']:9.2f} {r['gather_ms']:9.2f} "
            f"{r['time_ratio']:7.2f}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
