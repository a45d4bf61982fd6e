"""Steady-state Python overhead of a distributed einshard call with a cached plan.

Runs on gloo CPU ranks (started here; 2 by default, so the 2-core machine is
not oversubscribed), or under ``torchrun`` (``--device cuda``: one GPU per rank
over NCCL). For each case it times, in the same run and
interleaved, ``es.einshard`` against the same work written by hand (the
local ``torch.einsum`` plus the collectives the plan uses, called directly
through ``einshard.comm.collectives``). Gloo collectives on a shared machine
vary by hundreds of microseconds, so the time spent inside the
``torch.distributed`` calls is measured and subtracted on every call: what
remains is Python and local tensor work, and the difference between the two
versions is the library's overhead above the collectives themselves::

    python benchmarks/bench_distributed.py [--ranks 2] [--calls 200] [--repeats 5]
    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --device cuda

Prints one JSON line per case (medians in microseconds, on rank 0) on stdout
and its progress on stderr. The defaults finish in about a minute on a
2-core machine; raise ``--calls`` for steadier numbers on an idle one.

The cases above run with checks off. ``"bench": "shapes agreement"`` lines time a planned
formula called with an explicit ``shapes=`` against the same call without it (even blocks, so
both are valid), checks off, interleaved: a ``shapes=`` that one rank's block contradicts must
make every rank raise, so such a call runs one agreement (an all-gather of 8 ``int64`` per rank)
even with checks off, and ``agreement_cost_us`` is its cost per call (collectives included).
Then, for a planned formula and for
``es.spmd.psum``, the whole per-call wall time (collectives included: the check
*is* a collective) with ``es.set_checks(True)`` against ``False``,
interleaved, and their difference: what checks cost per call
(``"bench": "checks"`` lines); ``"checks, outside collectives"`` lines give
the same without the time spent inside ``torch.distributed`` (the Python side
of a check, which a busy machine moves much less).
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
from einshard.comm import collectives as C
from einshard.testing import MeshSpec, add_device_argument, launch, rank_device, synchronize


_IN_DIST = [0.0]


def _timed(fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _IN_DIST[0] += time.perf_counter() - t0

    return wrapper


def _instrument():
    """Accumulate the time spent inside the torch.distributed calls the collectives make."""
    for name in ("all_reduce", "all_to_all_single", "all_gather_single", "all_gather_into_tensor",
                 "reduce_scatter_single", "reduce_scatter_tensor", "batch_isend_irecv"):
        if hasattr(dist, name):
            setattr(dist, name, _timed(getattr(dist, name)))
    C._all_gather_tensor = _timed(C._all_gather_tensor)
    C._reduce_scatter_tensor = _timed(C._reduce_scatter_tensor)


def _time(fn, calls, repeats):
    """Median over repeats of (wall time - time inside torch.distributed) per call, in µs."""
    out = []
    for _ in range(repeats):
        dist.barrier()
        synchronize()
        _IN_DIST[0] = 0.0
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize()
        out.append((time.perf_counter() - t0 - _IN_DIST[0]) / calls * 1e6)
    return out


def _randn(*shape):
    return torch.randn(*shape).to(rank_device())


def _cases(mesh, n):
    P = mesh.size("tp")
    group = mesh.group("tp")
    x_rep = _randn(8, n)
    w_shard = _randn(n // P, n)
    x_shard = _randn(8, n // P)
    w_cshard = _randn(n, n // P)
    a_shard = _randn(n // P, n)
    shapes = [n // P] * P
    return [
        (
            "column-parallel linear (no communication)",
            lambda: es.einshard("b c, h/tp c -> b h/tp", x_rep, w_shard, mesh=mesh),
            lambda: torch.einsum("bc,hc->bh", x_rep, w_shard),
        ),
        (
            "row-parallel linear (all-reduce)",
            lambda: es.einshard("b c/tp, h c/tp -> b h", x_shard, w_cshard, mesh=mesh),
            lambda: C.all_reduce(torch.einsum("bc,hc->bh", x_shard, w_cshard), group),
        ),
        (
            "gather transition (all-gather)",
            lambda: es.einshard("a/tp b -> a b", a_shard, mesh=mesh),
            lambda: C.all_gather(a_shard, group, 0, shapes),
        ),
        (
            "gather with shapes= (all-gather)",
            lambda: es.einshard("a/tp b -> a b", a_shard, mesh=mesh, shapes={"tp": shapes}),
            lambda: C.all_gather(a_shard, group, 0, shapes),
        ),
    ]


def _wall(fn, calls):
    """(wall time, wall time - time inside torch.distributed) per call, in µs."""
    dist.barrier()
    synchronize()
    _IN_DIST[0] = 0.0
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize()
    wall = (time.perf_counter() - t0) / calls * 1e6
    return wall, wall - _IN_DIST[0] / calls * 1e6


def _checks_cases(mesh, n):
    a_shard = _randn(n // mesh.size("tp"), n)
    x = _randn(8, n)
    return [
        ("planned formula 'a/tp b -> a b' (all-gather)", lambda: es.einshard("a/tp b -> a b", a_shard, mesh=mesh)),
        ("es.spmd.psum over tp", lambda: es.spmd.psum(x, "tp", mesh=mesh)),
    ]


def _run_checks(ranks, calls, repeats, n, index):
    """Checks case ``index`` with checks on and off, interleaved: ``(name, on, off)``, each
    ``(wall µs, µs outside torch.distributed)`` per call (medians)."""
    _ensure_instrumented()
    mesh = es.wrap_mesh(MeshSpec((ranks,), ("tp",)).build())
    name, fn = _checks_cases(mesh, n)[index]
    times = {True: [], False: []}
    for flag in (True, False):  # warm up both (plans, groups)
        es.set_checks(flag)
        fn()
    for _ in range(repeats):
        for flag in (True, False):
            es.set_checks(flag)
            times[flag].append(_wall(fn, calls))
    on, off = ([statistics.median(t[k] for t in times[flag]) for k in (0, 1)] for flag in (True, False))
    return name, on, off


def _run_shapes(ranks, calls, repeats, n):
    """The same planned formula with and without ``shapes=`` (checks off), interleaved:
    ``(name, with, without)``, each ``(wall µs, µs outside torch.distributed)`` per call (medians)."""
    _ensure_instrumented()
    mesh = es.wrap_mesh(MeshSpec((ranks,), ("tp",)).build())
    P = mesh.size("tp")
    a_shard = _randn(n // P, n)
    shapes = {"tp": [n // P] * P}
    cases = {True: lambda: es.einshard("a/tp b -> a b", a_shard, mesh=mesh, shapes=shapes),
             False: lambda: es.einshard("a/tp b -> a b", a_shard, mesh=mesh)}
    es.set_checks(False)
    for fn in cases.values():  # warm up both (plans, groups)
        fn()
    times = {True: [], False: []}
    for _ in range(repeats):
        for flag, fn in cases.items():
            times[flag].append(_wall(fn, calls))
    on, off = ([statistics.median(t[k] for t in times[flag]) for k in (0, 1)] for flag in (True, False))
    return "planned formula 'a/tp b -> a b' (all-gather) with shapes= against without", on, off


def _ensure_instrumented():
    if not _INSTRUMENTED:
        _instrument()
        _INSTRUMENTED.append(True)


def _case_names(ranks, n):
    return [name for name, _, _ in _cases(es.wrap_mesh(MeshSpec((ranks,), ("tp",)).build()), n)]


def _run(ranks, calls, repeats, n, index):
    """Case ``index`` on this rank: ``(name, einshard µs, direct µs)``."""
    _ensure_instrumented()
    mesh = es.wrap_mesh(MeshSpec((ranks,), ("tp",)).build())
    name, lib, direct = _cases(mesh, n)[index]
    lib(), direct()  # plan, create groups, warm up
    t_lib, t_direct = [], []
    for _ in range(repeats):  # interleave to share the machine's noise
        t_lib += _time(lib, calls, 1)
        t_direct += _time(direct, calls, 1)
    return name, statistics.median(t_lib), statistics.median(t_direct)


_INSTRUMENTED: list = []


def _all(ranks, calls, repeats, n) -> list[tuple]:
    """Every case on this rank, in order: ``(bench, name, a_key, a, b_key, b, diff_key)`` lines (checks are set
    per case)."""
    lines = []
    log = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    names = _case_names(ranks, n)
    for i, case in enumerate(names):
        log(f"[{i + 1}/{len(names)}] {case}: {repeats} x {calls} calls of each", file=sys.stderr, flush=True)
        name, lib, direct = _run(ranks, calls, repeats, n, i)
        lines.append(("distributed", name, "einshard_us_outside_collectives", lib, "direct_us_outside_collectives",
                      direct, "overhead_us"))
    log(f"[shapes] {repeats} x {calls} calls with and without shapes=", file=sys.stderr, flush=True)
    name, on, off = _run_shapes(ranks, calls, repeats, n)
    lines.append(("shapes agreement", name, "shapes_us", on[0], "no_shapes_us", off[0], "agreement_cost_us"))
    lines.append(("shapes agreement, outside collectives", name, "shapes_us", on[1], "no_shapes_us", off[1],
                  "agreement_cost_us"))
    for i in range(2):
        log(f"[checks {i + 1}/2] {repeats} x {calls} calls with checks on and off", file=sys.stderr, flush=True)
        name, on, off = _run_checks(ranks, calls, repeats, n, i)
        lines.append(("checks", name, "checks_on_us", on[0], "checks_off_us", off[0], "check_cost_us"))
        lines.append(("checks, outside collectives", name, "checks_on_us", on[1], "checks_off_us", off[1],
                      "check_cost_us"))
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200, help="calls per repeat (default 200)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats; the median is reported (default 5)")
    parser.add_argument("--size", type=int, default=64)
    add_device_argument(parser)
    args = parser.parse_args()
    print(f"starting {args.ranks} ranks ...", file=sys.stderr, flush=True)
    results = launch(_all, args.ranks, args=(args.ranks, args.calls, args.repeats, args.size), timeout=3600,
                     checks=False, device=args.device)
    if results is None:  # another rank under torchrun: rank 0 prints
        return
    for line in results[0]:
        _print_line(args, *line)


def _print_line(args, bench, name, a_key, a, b_key, b, diff_key):
    line = {"bench": bench, "case": name, "ranks": args.ranks, a_key: round(a, 2), b_key: round(b, 2),
            diff_key: round(a - b, 2), "ratio": round(a / b, 3)}
    print(json.dumps(line), flush=True)

if __name__ == "__main__":
    main()
