"""Data movement: einshard against the best hand-written ``torch.distributed`` code for the same bytes.

One job of 4 gloo ranks (started here). For each movement einshard runs
the formula, and a hand-written native version moves the same data with
the primitive that fits it best (point-to-point pairs for a swap, one even
``all_to_all_single`` for a repartition, ``all_gather_into_tensor`` for a
gather, neighbour ``isend``/``irecv`` for a roll and a halo). Both are
checked to agree, then timed interleaved (``--repeats`` repeats of
``--number`` calls each, a barrier before each batch); the time of a repeat
is the slowest rank's. One JSON line per case::

    python benchmarks/bench_movement.py              # about a minute
    python benchmarks/bench_movement.py --scale 4    # the issue's medium sizes

Fields: ``case``, ``formula``, ``shape`` (global), ``einshard_ms``,
``native_ms`` (medians), ``ratio``, ``einshard_cpu_ms`` and ``native_cpu_ms``
(the calling thread's CPU time per call, slowest rank: the Python and
copying cost, steadier than wall time on a shared machine),
``einshard_sent_bytes`` and
``native_sent_bytes`` (per rank, averaged over the ranks; einshard's from
``es.count_communication``), ``bytes_ratio``.
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


def _swap_native(x, partner, me):
    if partner == me:
        return x
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x.contiguous(), partner), dist.P2POp(dist.irecv, out, partner)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return out


def _repartition_native(x, P):
    a, b = x.shape
    send = x.reshape(a, P, b // P).transpose(0, 1).contiguous()
    out = torch.empty_like(send)
    dist.all_to_all_single(out, send)
    return out.reshape(a * P, b // P)


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13


def _gather_native(x, P):
    out = x.new_empty((P * x.shape[0],) + tuple(x.shape[1:]))
    _all_gather(out, x.contiguous())
    return out


def _neighbours(sends, P):
    """sends: {peer: tensor}; receives a tensor shaped like what the peer sends back (same shape here)."""
    r = dist.get_rank()
    ops, got = [], {}
    for peer, (t, recv_shape) in sends.items():
        ops.append(dist.P2POp(dist.isend, t.contiguous(), peer))
        got[peer] = t.new_empty(recv_shape)
        ops.append(dist.P2POp(dist.irecv, got[peer], peer))
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return got, r


def _roll_native(x, s, P):
    r = dist.get_rank()
    nxt, prv = (r + 1) % P, (r - 1) % P
    buf = x.new_empty((s,) + tuple(x.shape[1:]))
    ops = [dist.P2POp(dist.isend, x[-s:].contiguous(), nxt), dist.P2POp(dist.irecv, buf, prv)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return torch.cat([buf, x[:-s]])


def _halo_native(x, P):
    r = dist.get_rank()
    nxt, prv = (r + 1) % P, (r - 1) % P
    top, bottom = x.new_empty((1,) + tuple(x.shape[1:])), x.new_empty((1,) + tuple(x.shape[1:]))
    ops = [dist.P2POp(dist.isend, x[:1].contiguous(), prv), dist.P2POp(dist.isend, x[-1:].contiguous(), nxt),
           dist.P2POp(dist.irecv, top, prv), dist.P2POp(dist.irecv, bottom, nxt)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return torch.cat([top, x, bottom])


def _cases(scale):
    P = 4
    r = dist.get_rank()
    n, h, w, c = 2, 256 * scale, 192 * scale, 8
    m22 = es.wrap_mesh(MeshSpec((2, 2), ("sp1", "sp2")).build())
    mdt = es.wrap_mesh(MeshSpec((2, 2), ("dp", "tp")).build())
    m4 = es.wrap_mesh(MeshSpec((4,), ("tp",)).build())
    i, j = divmod(r, 2)
    g = torch.Generator().manual_seed(0)
    swap = torch.randn(n, h, w, c, generator=g).to(rank_device())
    xs = local_block(swap, "n h/sp1 w/sp2 c", m22)
    a, b = 512 * scale, 512 * scale
    mat = torch.randn(a, b, generator=g).to(rank_device())
    rep = local_block(mat, "a/tp b", m4)
    move = local_block(mat, "a/dp b", mdt)
    split = [a // 4 - 8, a // 4 - 8, a // 4 + 8, a // 4 + 8]  # uneven blocks
    roll_x = mat[sum(split[:r]) : sum(split[: r + 1])].clone()
    isz = 4
    return [
        dict(case="ownership swap", formula="n h/sp1 w/sp2 c -> n h/sp2 w/sp1 c", shape=list(swap.shape),
             einshard=lambda: es.einshard("n h/sp1 w/sp2 c -> n h/sp2 w/sp1 c", xs, mesh=m22),
             native=lambda: _swap_native(xs, j * 2 + i, r), native_bytes=(xs.numel() * isz if i != j else 0)),
        dict(case="axis repartition", formula="a/tp b -> a b/tp", shape=[a, b],
             einshard=lambda: es.einshard("a/tp b -> a b/tp", rep, mesh=m4),
             native=lambda: _repartition_native(rep, P), native_bytes=rep.numel() * isz * (P - 1) // P),
        dict(case="mesh-dimension move", formula="a/dp b -> a/tp b", shape=[a, b],
             einshard=lambda: es.einshard("a/dp b -> a/tp b", move, mesh=mdt),
             native=lambda: _mesh_move_native(move, i, j, r),
             native_bytes=(move.numel() * isz if i != j else 0)),
        dict(case="gather", formula="a/tp b -> a b", shape=[a, b],
             einshard=lambda: es.einshard("a/tp b -> a b", rep, mesh=m4),
             native=lambda: _gather_native(rep, P), native_bytes=rep.numel() * isz * (P - 1)),
        dict(case="roll, split shapes", formula=f"einroll('a/tp b', {{'a': 3}}, shapes={split})", shape=[a, b],
             einshard=lambda: es.einroll("a/tp b", roll_x, {"a": 3}, mesh=m4, shapes={"tp": split}),
             native=lambda: _roll_native(roll_x, 3, P), native_bytes=3 * b * isz),
        dict(case="halo", formula="einhalo('a/tp b', {'a': 1}, periodic)", shape=[a, b],
             einshard=lambda: es.einhalo("a/tp b", rep, {"a": 1}, boundary="periodic", mesh=m4),
             native=lambda: _halo_native(rep, P), native_bytes=2 * b * isz),
    ]


def _mesh_move_native(x, i, j, r):
    """a/dp -> a/tp on (dp, tp) = (2, 2): rank (i, j) holds half i and needs half j: swap with (j, i)."""
    return _swap_native(x, j * 2 + i, r)


def _time(fn, number):
    """(wall ms, this thread's CPU ms) per call: the CPU time is what the caller's Python costs,
    steadier than the wall time on a shared machine."""
    dist.barrier()
    synchronize()
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(number):
        fn()
    synchronize()
    return (time.perf_counter() - t0) / number * 1e3, (time.thread_time() - c0) / number * 1e3


def _job(scale, number, repeats, only):
    torch.set_num_threads(1)
    results = []
    for case in _cases(scale):
        if only and case["case"] not in only:
            continue
        got, want = case["einshard"](), case["native"]()
        ok = torch.equal(got, want)
        with es.count_communication() as stats:
            case["einshard"]()
        # the data moved (a call with shapes= also agrees across ranks: kind 'check', not data)
        sent = torch.tensor([float(stats.data.sent_bytes), float(case["native_bytes"]), float(not ok)],
                            device=rank_device())
        dist.all_reduce(sent)
        t_es, t_nat = [], []
        for _ in range(repeats):
            t_es.append(_time(case["einshard"], number))
            t_nat.append(_time(case["native"], number))
        tt = torch.tensor([t_es, t_nat], dtype=torch.float64, device=rank_device())  # (2, repeats, wall/cpu)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        info = {k: case[k] for k in ("case", "formula", "shape")}
        results.append((info, tt[0].tolist(), tt[1].tolist(), (sent / 4).tolist()))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=1, help="size multiplier (default 1; 4: the issue's sizes)")
    parser.add_argument("--number", type=int, default=5, help="calls per repeat (default 5)")
    parser.add_argument("--repeats", type=int, default=7, help="repeats; medians reported (default 7)")
    parser.add_argument("--case", action="append", help="run only this case (may be repeated)")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    out = launch(_job, 4, args=(args.scale, args.number, args.repeats, args.case), timeout=900, checks=False,
                 device=args.device)
    if out is None:  # another rank under torchrun: rank 0 prints
        return 0
    out = out[0]
    bad = 0
    for case, t_es, t_nat, (es_bytes, nat_bytes, wrong) in out:
        e, n = (statistics.median(t[0] for t in ts) for ts in (t_es, t_nat))
        ec, nc = (statistics.median(t[1] for t in ts) for ts in (t_es, t_nat))
        line = {"bench": "movement", "case": case["case"], "formula": case["formula"], "shape": case["shape"],
                "einshard_ms": round(e, 3), "native_ms": round(n, 3), "ratio": round(e / n, 3),
                "einshard_cpu_ms": round(ec, 3), "native_cpu_ms": round(nc, 3),
                "einshard_sent_bytes": es_bytes, "native_sent_bytes": nat_bytes,
                "bytes_ratio": round(es_bytes / nat_bytes, 3) if nat_bytes else None, "agree": not wrong,
                "number": args.number, "repeats": args.repeats}
        print(json.dumps(line), flush=True)
        print(f"{case['case']:>22}: einshard {e:8.3f} ms  native {n:8.3f} ms  x{e / n:.2f}  "
              f"(cpu {ec:.3f} / {nc:.3f} ms)  bytes x{line['bytes_ratio']}", file=sys.stderr)
        bad += bool(wrong)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
