"""Per-call overhead of ``es.shard_map``, with and without ``check_vma``, over calling the body directly.

One process (a gloo group of one rank, or NCCL on one GPU with ``--device cuda``; ``auto``: a GPU where there
is one) and a 1 x 1 mesh ``(dp, tp)``, so the
collectives of the body are no-ops and what is measured is the Python work:
flattening the arguments, finding the cached plan (specs matched, local
shapes checked, conversions planned on the first call), pushing the ambient
context, the variance tracking of every torch op in the body
(``check_vma=True``), checking and converting the outputs. The baseline calls
the same body directly under ``es.use_mesh(mesh)`` on the same tensors.

The three variants are timed interleaved after a warm-up; each repeat times
``--number`` calls and the reported times are medians over ``--repeats``
repeats. One JSON line per case::

    python benchmarks/bench_shard_map.py
    python benchmarks/bench_shard_map.py --case torch_ops_32 --repeats 21

Fields: ``case``, ``what``, ``leaves`` (tensor arguments), ``torch_ops``
(plain torch calls the body makes), ``direct_us``, ``shard_map_us``,
``shard_map_check_vma_us`` (median µs per call), ``overhead_us`` and
``overhead_check_vma_us`` (over the direct call), ``tracking_us_per_op``
(the check_vma overhead beyond check_vma=False, per plain torch op of the
body), the same overheads from the fastest repeat (``*_min_us``); for the cases with
a backward pass, ``backward_direct_us``, ``backward_shard_map_us`` and
``backward_check_vma_us`` (median µs per call of the backward part alone, from a
second interleaved pass; ``null`` elsewhere); ``number``,
``repeats``, ``threads``, ``clock`` (``--clock cpu`` times this thread's CPU
time instead of wall time: steadier on a busy machine), ``torch_version``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import einshard as es
from einshard.spmd.shard_map import shard_map
from einshard.testing import add_device_argument, local_device


def _init(device):
    """A 1 x 1 mesh on ``device``: a one-rank gloo group on the CPU, NCCL on a GPU."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1,
                                **({"device_id": device} if cuda else {}))
    from torch.distributed.device_mesh import init_device_mesh

    return es.wrap_mesh(init_device_mesh(device.type, (1, 1), mesh_dim_names=("dp", "tp")))


MLP_SPECS = {"w1": "f/tp c", "b1": "f/tp", "w2": "c f/tp", "b2": "c"}


def _mlp(p, x):
    h = F.gelu(es.einshard("b/dp n c, f/tp c -> b/dp n f/tp", x, p["w1"]) + p["b1"])
    return es.einshard("b/dp n f/tp, c f/tp -> b/dp n c", h, p["w2"]) + p["b2"]


def _cases(device):
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device)

    params = {k: randn(*shape).requires_grad_() for k, shape in (("w1", (32, 16)), ("b1", (32,)), ("w2", (16, 32)),
                                                                 ("b2", (16,)))}
    x = randn(4, 8, 16)
    small = randn(8)
    many = {f"p{i}": randn(4) for i in range(32)}

    def ops32(a):
        for _ in range(16):
            a = torch.sin(a) * 1.0001  # 2 torch ops per iteration
        return a

    def first(p):
        return p["p0"] * 2

    def ident(xb):
        return xb

    return [
        dict(case="mlp_einshard", what="TP MLP: 2 einshard + 3 torch ops, dict of 4 params + batch",
             body=_mlp, in_specs=(MLP_SPECS, "b/dp n c"), out_specs="b/dp n c", args=(params, x), leaves=5, ops=3),
        dict(case="mlp_einshard_backward", what="the MLP, forward + backward of .sum()",
             body=_mlp, in_specs=(MLP_SPECS, "b/dp n c"), out_specs="b/dp n c", args=(params, x), leaves=5, ops=3,
             backward=True),
        dict(case="torch_ops_32", what="32 plain torch ops on a varying 8-vector",
             body=ops32, in_specs="a/dp", out_specs="a/dp", args=(small,), leaves=1, ops=32),
        dict(case="pytree_32_leaves", what="dict of 32 tensors, body touches one",
             body=first, in_specs="a", out_specs="a", args=(many,), leaves=32, ops=1),
        dict(case="conversions", what="whole -> 'b/dp n c/tp' on entry and back on exit",
             body=ident, in_specs="b n c -> b/dp n c/tp", out_specs="b/dp n c/tp -> b n c", args=(x,), leaves=1,
             ops=0),
    ]


_CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}
_clock = time.perf_counter_ns


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _time_us(fn, number: int) -> float:
    _sync()
    start = _clock()
    for _ in range(number):
        fn()
    _sync()
    return (_clock() - start) / number / 1000.0


def _time_backward_us(forward, number: int) -> float:
    """Per call, the time of ``forward().sum().backward()`` spent in the backward part alone."""
    total = 0
    for _ in range(number):
        loss = forward().sum()
        _sync()
        start = _clock()
        loss.backward()
        _sync()
        total += _clock() - start
    return total / number / 1000.0


def run_case(case, mesh, number, repeats, warmup):
    body, args = case["body"], case["args"]
    plain = shard_map(body, case["in_specs"], case["out_specs"], mesh=mesh, check_vma=False)
    tracked = shard_map(body, case["in_specs"], case["out_specs"], mesh=mesh, check_vma=True)
    backward = case.get("backward", False)

    def body_direct():
        with es.use_mesh(mesh):
            return body(*args)

    def direct():
        out = body_direct()
        if backward:
            out.sum().backward()
        return out

    def call(sm):
        def run():
            out = sm(*args)
            if backward:
                out.sum().backward()
            return out

        return run

    variants = {"direct": direct, "plain": call(plain), "tracked": call(tracked)}
    forwards = {"direct": body_direct, "plain": lambda: plain(*args), "tracked": lambda: tracked(*args)}
    ref = direct()
    for name, fn in variants.items():
        got = fn()
        if not torch.allclose(got, ref):
            raise AssertionError(f"{case['case']}: {name} disagrees with the direct call")
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    times = {k: [] for k in variants}
    back = {k: [] for k in variants}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            for k, fn in variants.items():
                times[k].append(_time_us(fn, number))
        if backward:  # a second interleaved pass: where the time goes (the backward part alone)
            for _ in range(repeats):
                for k, fn in forwards.items():
                    back[k].append(_time_backward_us(fn, number))
    finally:
        if gc_was_enabled:
            gc.enable()
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    ops = case["ops"]
    bmed = {k: round(statistics.median(v), 2) if v else None for k, v in back.items()}
    return {
        "case": case["case"],
        "what": case["what"],
        "leaves": case["leaves"],
        "torch_ops": ops,
        "direct_us": round(med["direct"], 2),
        "shard_map_us": round(med["plain"], 2),
        "shard_map_check_vma_us": round(med["tracked"], 2),
        "overhead_us": round(med["plain"] - med["direct"], 2),
        "overhead_check_vma_us": round(med["tracked"] - med["direct"], 2),
        "tracking_us_per_op": round((med["tracked"] - med["plain"]) / ops, 2) if ops else None,
        "overhead_min_us": round(best["plain"] - best["direct"], 2),
        "overhead_check_vma_min_us": round(best["tracked"] - best["direct"], 2),
        "backward_direct_us": bmed["direct"],
        "backward_shard_map_us": bmed["plain"],
        "backward_check_vma_us": bmed["tracked"],
        "number": number,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "clock": "cpu" if _clock is time.thread_time_ns else "wall",
        "torch_version": torch.__version__,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=300, help="calls per repeat (default 300)")
    parser.add_argument("--repeats", type=int, default=7, help="repeats; the median is reported (default 7)")
    parser.add_argument("--warmup", type=int, default=50, help="warm-up calls of each (default 50)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--case", action="append", help="run only this case (may be repeated)")
    parser.add_argument("--clock", choices=sorted(_CLOCKS), default="wall",
                        help="wall time, or this thread's CPU time (steadier on a busy machine; default wall)")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    global _clock
    _clock = _CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    device = local_device(args.device)
    mesh = _init(device)
    try:
        for case in _cases(device):
            if args.case and case["case"] not in args.case:
                continue
            print(json.dumps(run_case(case, mesh, args.number, args.repeats, args.warmup)), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
