"""Steady-state Python overhead of a distributed einshard call with a cached plan.

Runs on gloo CPU ranks (started here; 2 by default, so the 2-core machine is
not oversubscribed). For each case it times, in the same run and
interleaved, ``es.einshard`` against the same work written by hand (the
local ``torch.einsum`` plus the collectives the plan uses, called directly
through ``einshard.collectives``). Gloo collectives on a shared machine
vary by hundreds of microseconds, so the time spent inside the
``torch.distributed`` calls is measured and subtracted on every call: what
remains is Python and local tensor work, and the difference between the two
versions is the library's overhead above the collectives themselves::

    python benchmarks/bench_distributed.py [--ranks 2] [--calls 200] [--repeats 5]

Prints one JSON line per case (medians in microseconds, on rank 0) on stdout
and its progress on stderr. The defaults finish in about a minute on a
2-core machine; raise ``--calls`` for steadier numbers on an idle one.
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
from einshard import collectives as C
from einshard.testing import MeshSpec, RankPool


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
        _IN_DIST[0] = 0.0
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0 - _IN_DIST[0]) / calls * 1e6)
    return out


def _cases(mesh, n):
    P = mesh.size("tp")
    group = mesh.group("tp")
    x_rep = torch.randn(8, n)
    w_shard = torch.randn(n // P, n)
    x_shard = torch.randn(8, n // P)
    w_cshard = torch.randn(n, n // P)
    a_shard = torch.randn(n // P, n)
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


def _case_names(ranks, n):
    return [name for name, _, _ in _cases(es.wrap_mesh(MeshSpec((ranks,), ("tp",)).build()), n)]


def _run(ranks, calls, repeats, n, index):
    """Case ``index`` on this rank: ``(name, einshard µs, direct µs)``."""
    if not _INSTRUMENTED:
        _instrument()
        _INSTRUMENTED.append(True)
    mesh = es.wrap_mesh(MeshSpec((ranks,), ("tp",)).build())
    name, lib, direct = _cases(mesh, n)[index]
    lib(), direct()  # plan, create groups, warm up
    t_lib, t_direct = [], []
    for _ in range(repeats):  # interleave to share the machine's noise
        t_lib += _time(lib, calls, 1)
        t_direct += _time(direct, calls, 1)
    return name, statistics.median(t_lib), statistics.median(t_direct)


_INSTRUMENTED: list = []


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200, help="calls per repeat (default 200)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats; the median is reported (default 5)")
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args()
    print(f"starting {args.ranks} gloo ranks ...", file=sys.stderr, flush=True)
    with RankPool(args.ranks) as pool:
        names = pool.run(_case_names, args.ranks, args.size, timeout=300)[0]
        for i, case in enumerate(names):
            print(f"[{i + 1}/{len(names)}] {case}: {args.repeats} x {args.calls} calls of each",
                  file=sys.stderr, flush=True)
            name, lib, direct = pool.run(_run, args.ranks, args.calls, args.repeats, args.size, i, timeout=900)[0]
            _print_line(args, name, lib, direct)


def _print_line(args, name, lib, direct):
    line = {
        "bench": "distributed",
        "case": name,
        "ranks": args.ranks,
        "einshard_us_outside_collectives": round(lib, 2),
        "direct_us_outside_collectives": round(direct, 2),
        "overhead_us": round(lib - direct, 2),
        "ratio": round(lib / direct, 3),
    }
    print(json.dumps(line), flush=True)

if __name__ == "__main__":
    main()
