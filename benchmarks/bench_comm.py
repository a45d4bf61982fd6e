"""Bytes each rank sends for einshard transitions and contractions, against lower bounds.

Runs on 8 gloo CPU ranks (started here). For every case it records, with
``es.count_communication``, the bytes each rank sends in forward and in
backward, averages them over the ranks and divides by an analytic lower
bound written out below (independent of the planner). Prints one JSON line
per case and direction, then a table::

    python benchmarks/bench_comm.py [--size 256] [--policy training]

A ratio of 1.00 means the library moved exactly the bytes the bound says
must move. Zero bounds (local slices) report ratio 1.0 when nothing moved.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

import einshard as es
from einshard.comm.helpers import compute_split_shapes
from einshard.testing import MeshSpec, add_device_argument, launch, local_block, rank_device

ITEM = 4  # float32


def _cases(n: int):
    """(name, mesh, formula, global shapes, fwd bound, bwd bound) in elements per rank."""
    P = 8
    N = n * n
    ag = (P - 1) / P * N  # every rank lacks (P-1)/P of the whole tensor
    ar = 2 * (P - 1) / P * N  # bandwidth-optimal all-reduce
    rs = (P - 1) / P * N
    m8, m24, m24s = "8", "2x4", "2x4sp"
    u = n - 6
    blocks = compute_split_shapes(u, P)
    # rank r needs all of a for its b-block and holds its own a-block of it
    a2a_uneven = sum(u * s - s * s for s in blocks) / P
    return [
        # transitions
        ("split", m8, "a b -> a/tp b", [(n, n)], 0, ag),
        ("gather", m8, "a/tp b -> a b", [(n, n)], ag, 0),
        ("all-reduce", m8, "a b // tp -> a b", [(n, n)], ar, 0),
        ("reduce-scatter output", m8, "a b // tp -> a/tp b", [(n, n)], rs, ag),
        ("axis-to-axis repartition", m8, "a/tp b -> a b/tp", [(n, n)], (P - 1) / P * N / P, (P - 1) / P * N / P),
        # a/dp -> a/tp on dp=2, tp=4: rank (i, j) needs quarter j, held locally when j // 2 == i;
        # backward a/tp -> a/dp: it needs half i and holds quarter j, which lies in half i when j // 2 == i
        ("mesh-dimension move", m24, "a/dp b -> a/tp b", [(n, n)], N / 8, 3 * N / 8),
        # rank (i, j) holds a-half i x b-quarter j, needs a-quarter j x b-half i: 3/32 N on average
        ("owner swap", m24, "a/dp b/tp -> a/tp b/dp", [(n, n)], 3 * N / 32, 3 * N / 32),
        # contractions (Megatron volumes): x is (b*s, c), w is (h, c)
        ("column-parallel linear", m8, "b c, h/tp c -> b h/tp", [(n, n), (n, n)], 0, ar),
        ("row-parallel linear", m8, "b c/tp, h c/tp -> b h", [(n, n), (n, n)], ar, 0),
        ("sequence-parallel MLP up", m8, "s/tp c, h/tp c -> s h/tp", [(n, n), (n, n)], ag, rs),
        ("sequence-parallel MLP down", m8, "s h/tp, c h/tp -> s/tp c", [(n, n), (n, n)], rs, ag),
        # owner computes: rank (i, j) lacks half of its l-rows of op0 and 3/4 of its f-columns of op1
        ("crossed layouts", m24s, "l/sp e/dp, e/sp f/dp -> l/sp f/dp", [(n, n), (n, n)], N / 8 + 3 * N / 8,
         N / 8 + 3 * N / 8),
        # uneven: u = n - 6 is not a multiple of 8 (compute_split_shapes blocks); bounds as above
        ("gather (uneven)", m8, "a/tp b -> a b", [(u, n)], (P - 1) / P * u * n, 0),
        ("reduce-scatter output (uneven)", m8, "a b // tp -> a/tp b", [(u, n)], (P - 1) / P * u * n,
         (P - 1) / P * u * n),
        ("axis-to-axis repartition (uneven)", m8, "a/tp b -> a b/tp", [(u, u)], a2a_uneven, a2a_uneven),
    ]


MESHES = {"8": ((8,), ("tp",)), "2x4": ((2, 4), ("dp", "tp")), "2x4sp": ((2, 4), ("dp", "sp"))}


def _run_case(mesh_key, formula, shapes, policy):
    from einshard.notation import expand

    shape, names = MESHES[mesh_key]
    mesh = es.wrap_mesh(MeshSpec(shape, names).build())
    parsed = expand(formula)
    g = torch.Generator().manual_seed(0)
    inputs = []
    for spec, gshape in zip(parsed.inputs, shapes):
        whole = torch.randn(gshape, generator=g).to(rank_device())
        inputs.append(local_block(whole, str(spec), mesh).requires_grad_())
    table = {}
    for spec, gshape in zip(parsed.inputs, shapes):
        for axis, size in zip(spec.axes, gshape):
            if axis.mesh:
                dims = mesh.dims(axis.mesh)
                table.setdefault(mesh.label(dims), {})[axis.name] = compute_split_shapes(size, mesh.size(dims))
    kwargs = dict(mesh=mesh, shapes=table or None, optimize=policy)
    es.einshard(formula, *inputs, **kwargs)  # plan and warm up
    with es.count_communication() as fwd:
        out = es.einshard(formula, *inputs, **kwargs)
    cot = torch.ones_like(out)
    with es.count_communication() as bwd:
        out.backward(cot)
    # the data moved (a call with shapes= also agrees across ranks: kind 'check', not data)
    sent = torch.tensor([float(fwd.data.sent_bytes), float(bwd.data.sent_bytes)], dtype=torch.float64,
                        device=rank_device())
    dist.all_reduce(sent)
    return (sent / dist.get_world_size()).tolist()


def _all_cases(n, policy):
    return [
        (name, _run_case(mesh_key, formula, shapes, policy), (fb * ITEM, bb * ITEM), formula, mesh_key)
        for name, mesh_key, formula, shapes, fb, bb in _cases(n)
    ]


def _ratio(measured, bound):
    if bound == 0:
        return 1.0 if measured == 0 else float("inf")
    return measured / bound


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256, help="every axis has this length")
    parser.add_argument("--policy", default="training")
    add_device_argument(parser)
    args = parser.parse_args()
    results = launch(_all_cases, 8, args=(args.size, args.policy), timeout=600, checks=False, device=args.device)
    if results is None:  # another rank under torchrun: rank 0 prints
        return
    results = results[0]
    rows = []
    for name, (fwd, bwd), (fb, bb), formula, mesh_key in results:
        for direction, measured, bound in (("forward", fwd, fb), ("backward", bwd, bb)):
            line = {
                "bench": "comm",
                "case": name,
                "formula": formula,
                "mesh": mesh_key,
                "direction": direction,
                "bytes_per_rank": measured,
                "lower_bound": bound,
                "ratio": round(_ratio(measured, bound), 4),
            }
            print(json.dumps(line))
            rows.append(line)
    print(file=sys.stderr)  # the table is for people: stderr, so stdout stays JSON lines
    print(f"{'case':28s} {'dir':8s} {'bytes/rank':>12s} {'bound':>12s} {'ratio':>6s}", file=sys.stderr)
    for r in rows:
        print(
            f"{r['case']:28s} {r['direction']:8s} {r['bytes_per_rank']:12,.0f} {r['lower_bound']:12,.0f} "
            f"{r['ratio']:6.2f}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
