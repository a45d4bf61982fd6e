"""Bytes moved by einhalo / einwindow / einconv / einroll, over the bytes that must move.

For every case each of 8 gloo CPU ranks (started by this script) runs the
operation once to plan it, then once under ``es.count_communication()``;
the bytes each rank sent (forward, and received in backward, which is the
reverse exchange) are compared with the bytes that *must* move, computed
independently from the split shapes with set arithmetic:

- halo / window / conv: for every other rank of the exchange group, the
  distinct cells of this rank's block that the other rank's widened block
  reads (corner cells included; a cell read twice by one rank counts once);
- roll: the cells of this rank's block whose rolled position lies in
  another rank's block.

``ratio = sum of bytes sent / sum of bytes that must move`` (target 1.00);
``max_rank_ratio`` is the worst rank. One JSON object per case on stdout,
then a summary table on stderr::

    python benchmarks/bench_halo.py                 # all cases
    python benchmarks/bench_halo.py --case roll_2d  # one case
    python benchmarks/bench_halo.py --check         # exit 1 if a ratio is not 1.00
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

MESHES = {"8": ((8,), ("tp",)), "2x4": ((2, 4), ("dp", "tp")), "2x2x2": ((2, 2, 2), ("dp", "sp", "tp"))}

# name, op, mesh, spec (or formula), global shape, op arguments, shapes=
CASES = [
    ("halo_2d_r1", "halo", "2x4", "h/dp w/tp", (256, 256), {"halos": {"h": 1, "w": 1}}, None),
    ("halo_2d_periodic_uneven", "halo", "2x4", "h/dp w/tp c", (250, 257, 2),
     {"halos": {"h": (2, 3), "w": 1}, "boundary": "periodic"}, {"dp": [125, 125], "tp": [65, 65, 65, 62]}),
    ("halo_1d_wider_than_shard", "halo", "8", "b h/tp", (4, 64), {"halos": {"h": 20}, "boundary": "periodic"}, None),
    ("halo_1d_empty_shards", "halo", "8", "h/tp w", (30, 16), {"halos": {"h": 3}},
     {"tp": [8, 0, 6, 0, 4, 4, 0, 8]}),
    ("halo_3d_replicate", "halo", "2x2x2", "a/dp b/sp c/tp", (32, 32, 32),
     {"halos": {"a": 1, "b": 1, "c": 1}, "boundary": "replicate"}, None),
    ("window_2d_r2", "window", "2x4", "b h/dp w/tp c -> b h/dp w/tp kh kw c", (2, 64, 64, 4),
     {"windows": {"h": "kh", "w": "kw"}, "radius": {"h": 2, "w": 2}, "boundary": "periodic"}, None),
    ("window_3d_r1", "window", "2x2x2", "a/dp b/sp c/tp -> a/dp b/sp c/tp ka kb kc", (16, 16, 16),
     {"windows": {"a": "ka", "b": "kb", "c": "kc"}, "radius": {"a": 1, "b": 1, "c": 1}}, None),
    ("conv_2d_3x3", "conv", "2x4", "b h/dp w/tp c, o c kh kw -> b h/dp w/tp o", (2, 64, 64, 4),
     {"windows": {"h": "kh", "w": "kw"}, "weight": (8, 4, 3, 3), "boundary": "periodic"}, None),
    ("roll_1d", "roll", "8", "h/tp w", (64, 16), {"shifts": {"h": 5}}, None),
    ("roll_2d_uneven", "roll", "2x4", "h/dp w/tp", (100, 130), {"shifts": {"h": 37, "w": -11}},
     {"dp": [50, 50], "tp": [33, 33, 33, 31]}),
    ("roll_3d", "roll", "2x2x2", "a/dp b/sp c/tp", (16, 16, 16), {"shifts": {"a": 3, "b": -5, "c": 9}}, None),
]


# -- what must move (independent of the implementation) ---------------------------------------------


def _blocks(mesh, spec, gshape, shapes):
    """Per axis: (name, intervals per block, this rank's block index, sharded over more than one rank)."""
    from einshard.core._split import compute_split_shapes, resolve_split_shapes
    from einshard.notation import expand

    out = []
    for axis, n in zip(expand(spec).inputs[0].axes, gshape):
        if not axis.mesh:
            out.append((axis.name, [(0, n)], 0, False))
            continue
        dims = mesh.dims(axis.mesh)
        split = None
        if shapes is not None:
            split = resolve_split_shapes(shapes, mesh.label(dims), axis.name)
        if split is None:
            split = compute_split_shapes(n, mesh.size(dims))
        starts = [sum(split[:k]) for k in range(len(split))]
        out.append((axis.name, [(s, s + z) for s, z in zip(starts, split)], mesh.index(dims), len(split) > 1))
    return out


def must_halo(mesh, spec, gshape, widths, boundary, shapes):
    blocks = _blocks(mesh, spec, gshape, shapes)

    def reads(dim, s, e):
        n = gshape[dim]
        l, r = widths[blocks[dim][0]]
        out = set()
        for p in range(s - l, e + r):
            if 0 <= p < n:
                out.add(p)
            elif boundary == "periodic":
                out.add(p % n)
            elif boundary == "replicate":
                out.add(min(max(p, 0), n - 1))
        return out

    halo_dims = [d for d, b in enumerate(blocks) if b[0] in widths and any(widths[b[0]]) and b[3]]
    mine = tuple(b[2] for b in blocks)
    total = 0
    for combo in itertools.product(*(range(len(blocks[d][1])) for d in halo_dims)):
        peer = list(mine)
        for d, k in zip(halo_dims, combo):
            peer[d] = k
        if tuple(peer) == mine:
            continue
        cells = 1
        for d, (_, iv, k, _) in enumerate(blocks):
            a, b = iv[k]
            cells *= len(reads(d, *iv[peer[d]]) & set(range(a, b))) if d in halo_dims else b - a
        total += cells
    return total


def must_roll(mesh, spec, gshape, shifts, shapes):
    blocks = _blocks(mesh, spec, gshape, shapes)
    total = stay = 1
    for d, (name, iv, k, sharded) in enumerate(blocks):
        a, b = iv[k]
        total *= b - a
        n = gshape[d]
        if name in shifts and sharded and n:
            stay *= sum(1 for j in range(a, b) if a <= (j + shifts[name]) % n < b)
        else:
            stay *= b - a
    return total - stay


# -- running a case on the ranks ----------------------------------------------------------------


def _pairs(d):
    return {k: (v, v) if isinstance(v, int) else tuple(v) for k, v in d.items()}


def run_case(case, repeats):
    import einshard as es
    from einshard.ops.conv import einconv
    from einshard.ops.halo import einhalo
    from einshard.ops.roll import einroll
    from einshard.ops.window import einwindow
    from einshard.testing import local_block, make_mesh, rank_device, synchronize

    name, op, mesh_name, spec, gshape, args, shapes = case
    mesh = es.wrap_mesh(make_mesh(*MESHES[mesh_name]))
    in_spec = spec.split("->")[0].split(",")[0].strip()
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(gshape, generator=g).to(rank_device())
    x = local_block(whole, in_spec, mesh, shapes=shapes).clone().requires_grad_()
    args = dict(args)
    boundary = args.get("boundary", "constant")
    if op == "halo":
        fn = lambda: einhalo(spec, x, args["halos"], boundary=boundary, mesh=mesh, shapes=shapes)  # noqa: E731
        must = must_halo(mesh, in_spec, gshape, _pairs(args["halos"]), boundary, shapes)
    elif op == "window":
        fn = lambda: einwindow(spec, x, args["windows"], args["radius"], boundary=boundary, mesh=mesh,  # noqa: E731
                               shapes=shapes)
        must = must_halo(mesh, in_spec, gshape, _pairs(args["radius"]), boundary, shapes)
    elif op == "conv":
        w = torch.randn(args["weight"], generator=g).to(rank_device())
        fn = lambda: einconv(spec, x, w, args["windows"], boundary=boundary, mesh=mesh, shapes=shapes,  # noqa: E731
                             checkpoint=False)
        k = dict(zip(("o", "c", "kh", "kw"), args["weight"]))
        must = must_halo(mesh, in_spec, gshape, {"h": ((k["kh"] - 1) // 2,) * 2, "w": ((k["kw"] - 1) // 2,) * 2},
                         boundary, shapes)
    else:
        fn = lambda: einroll(spec, x, args["shifts"], mesh=mesh, shapes=shapes)  # noqa: E731
        must = must_roll(mesh, in_spec, gshape, args["shifts"], shapes)
    fn()  # plan
    with es.count_communication() as stats:
        y = fn()
        y.backward(torch.ones_like(y))
    stats = stats.data  # the cells moved (a call with shapes= also agrees across ranks: kind 'check')
    times = []
    for _ in range(repeats):
        dist.barrier()
        synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            fn()
        synchronize()
        times.append(time.perf_counter() - t0)
    itemsize = x.element_size()
    return {
        "sent": stats.forward.sent_bytes,
        "calls": stats.forward.calls,
        "bwd_received": stats.backward.received_bytes,
        "must": must * itemsize,
        "ms": statistics.median(times) * 1e3 if times else None,
    }


def run_all(cases, repeats):
    return [run_case(case, repeats) for case in cases]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help="run only these cases (repeatable)")
    parser.add_argument("--repeats", type=int, default=5, help="timed forward calls per case (median)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless every ratio is 1.00")
    from einshard.testing import add_device_argument, launch

    add_device_argument(parser)
    opts = parser.parse_args(argv)
    cases = [c for c in CASES if not opts.case or c[0] in opts.case]
    if not cases:
        parser.error(f"unknown case; cases: {[c[0] for c in CASES]}")
    per_rank = launch(run_all, 8, args=(cases, opts.repeats), timeout=600, checks=False, device=opts.device)
    if per_rank is None:  # another rank under torchrun: rank 0 prints
        return 0
    rows = []
    ok = True
    for k, case in enumerate(cases):
        name, op, mesh_name, spec, gshape, args, shapes = case
        ranks = [r[k] for r in per_rank]
        sent = [r["sent"] for r in ranks]
        must = [r["must"] for r in ranks]
        bwd = [r["bwd_received"] for r in ranks]
        ratio = sum(sent) / sum(must) if sum(must) else (1.0 if not sum(sent) else float("inf"))
        bwd_ratio = sum(bwd) / sum(must) if sum(must) else (1.0 if not sum(bwd) else float("inf"))
        per = [s / m if m else (1.0 if not s else float("inf")) for s, m in zip(sent, must)]
        line = {
            "case": name, "op": op, "mesh": mesh_name, "spec": spec, "shape": list(gshape),
            "args": {k2: v for k2, v in args.items()}, "shapes": shapes, "dtype": "float32",
            "sent_bytes_per_rank": sent, "must_bytes_per_rank": must, "backward_received_bytes_per_rank": bwd,
            "ratio": round(ratio, 4), "max_rank_ratio": round(max(per), 4), "backward_ratio": round(bwd_ratio, 4),
            "calls_forward": max(r["calls"] for r in ranks),
            "forward_ms": round(max(r["ms"] for r in ranks), 3) if ranks[0]["ms"] is not None else None,
        }
        print(json.dumps(line), flush=True)
        ok &= abs(ratio - 1) < 1e-9 and abs(max(per) - 1) < 1e-9 and abs(bwd_ratio - 1) < 1e-9
        rows.append((name, op, mesh_name, str(sum(sent)), str(sum(must)), f"{ratio:.2f}", f"{max(per):.2f}",
                     f"{bwd_ratio:.2f}", str(line["calls_forward"])))
    header = ("case", "op", "mesh", "sent B (all ranks)", "must B", "ratio", "worst rank", "backward", "calls")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)), file=sys.stderr)
    return 0 if ok or not opts.check else 1


if __name__ == "__main__":
    sys.exit(main())
