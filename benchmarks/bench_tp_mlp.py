"""Tensor-parallel MLP, forward + backward, on 4 gloo ranks: einshard against hand-written code.

One job of ``--ranks`` gloo CPU processes (started here) runs, interleaved,
one training step (forward, ``.square().sum().backward()``) of the same
Megatron-style MLP ``y = gelu(x W1^T + b1) W2^T + b2`` (``W1``, ``b1``
column-parallel, ``W2`` row-parallel over ``tp``) written as:

- ``floor``: hand-written autograd Functions (Megatron's "copy to" and
  "reduce from" the tensor-parallel region) around ``torch`` matmuls;
- ``dtensor``: ``nn.Linear`` layers parallelised with DTensor's
  ``ColwiseParallel`` / ``RowwiseParallel``;
- ``einshard``: two ``es.einshard`` formulas;
- ``shard_map``: the same body in ``es.shard_map`` (``check_vma=True``);
- ``einshard_compiled``, ``shard_map_compiled``: the last two under
  ``torch.compile(fullgraph=True)`` (``--backend``, default inductor).

Every variant's output and gradients (``x``, both weights, both biases) are
checked against the floor first. Each repeat times ``--number`` steps of
every variant in turn; the reported time is the median over repeats of the
slowest rank. One JSON line per variant (``variant``, ``ms_per_step``,
``ratio`` to the floor, ``ratio_paired``: the median over repeats of the
ratio within a repeat, steadier on a busy machine, ``min_ms``, sizes); a
table on stderr::

    python benchmarks/bench_tp_mlp.py                 # about a minute
    python benchmarks/bench_tp_mlp.py --no-compile    # skip the compiled variants
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import einshard as es
from einshard.testing import MeshSpec, add_device_argument, launch, rank_device, synchronize


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _floor(group):
    def step(x, w1, b1, w2, b2):
        h = F.gelu(F.linear(_CopyToTP.apply(x, group), w1, b1))
        return _ReduceFromTP.apply(F.linear(h, w2), group) + b2

    return step


def _einshard_body(x, w1, b1, w2, b2):
    h = F.gelu(es.einshard("b n c, f/tp c -> b n f/tp", x, w1) + b1)
    return es.einshard("b n f/tp, c f/tp -> b n c", h, w2) + b2


def _einshard(mesh):
    def step(x, w1, b1, w2, b2):
        with es.use_mesh(mesh):
            return _einshard_body(x, w1, b1, w2, b2)

    return step


def _shard_map(mesh):
    return es.shard_map(_einshard_body, in_specs=("b n c", "f/tp c", "f/tp", "c f/tp", "c"), out_specs="b n c",
                        mesh=mesh, check_vma=True)


def _dtensor(device_mesh, w1, b1, w2, b2):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    c, f = w1.shape[1], w2.shape[1]
    model = torch.nn.Sequential(torch.nn.Linear(c, f), torch.nn.GELU(), torch.nn.Linear(f, c))
    with torch.no_grad():  # the whole weights: parallelize_module keeps this rank's shard
        model[0].weight.copy_(w1), model[0].bias.copy_(b1), model[2].weight.copy_(w2), model[2].bias.copy_(b2)
    model = parallelize_module(model, device_mesh, {"0": ColwiseParallel(input_layouts=Replicate()),
                                                    "2": RowwiseParallel(output_layouts=Replicate())})

    def step(x):
        return model(x)

    return step, model


def _job(ranks, b, n, c, f, number, repeats, warmup, backend, compile_):
    torch.manual_seed(0)
    mesh = es.wrap_mesh(MeshSpec((ranks,), ("tp",)).build())
    group = mesh.group("tp")
    r, fl = dist.get_rank(), f // ranks
    x = torch.randn(b, n, c).to(rank_device())
    w1, b1, w2, b2 = (t.to(rank_device()) for t in (torch.randn(f, c) / c**0.5, torch.randn(f) / 10,
                                                    torch.randn(c, f) / f**0.5, torch.randn(c) / 10))
    local = [w1[r * fl : (r + 1) * fl], b1[r * fl : (r + 1) * fl], w2[:, r * fl : (r + 1) * fl], b2]
    leaves = [x.clone().requires_grad_()] + [p.clone().requires_grad_() for p in local]

    def tensors_step(fn):
        def run():
            for t in leaves:
                t.grad = None
            fn(*leaves).square().sum().backward()

        return run

    variants = {"floor": tensors_step(_floor(group)), "einshard": tensors_step(_einshard(mesh)),
                "shard_map": tensors_step(_shard_map(mesh))}
    dt_step, model = _dtensor(mesh.device_mesh, w1, b1, w2, b2)

    def dtensor_run():
        model.zero_grad(set_to_none=True)
        leaves[0].grad = None
        dt_step(leaves[0]).square().sum().backward()

    variants["dtensor"] = dtensor_run
    if compile_:
        variants["einshard_compiled"] = tensors_step(torch.compile(_einshard(mesh), fullgraph=True, backend=backend))
        variants["shard_map_compiled"] = tensors_step(torch.compile(_shard_map(mesh), fullgraph=True,
                                                                    backend=backend))
    # correctness against the floor
    variants["floor"]()
    want = [t.grad.clone() for t in leaves]
    errors = {}
    for name, run in variants.items():
        run()
        if name == "dtensor":
            got = [leaves[0].grad] + [p.grad.to_local() for p in (model[0].weight, model[0].bias, model[2].weight,
                                                                   model[2].bias)]
        else:
            got = [t.grad for t in leaves]
        errors[name] = max(float((g - w).abs().max()) / (float(w.abs().max()) + 1e-30) for g, w in zip(got, want))
    for _ in range(warmup):
        for run in variants.values():
            run()
    times = {k: [] for k in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            dist.barrier()
            synchronize()
            t0 = time.perf_counter()
            for _ in range(number):
                run()
            synchronize()
            times[name].append((time.perf_counter() - t0) / number * 1e3)
    # the slowest rank's time per repeat
    tt = torch.tensor([times[k] for k in variants], dtype=torch.float64, device=rank_device())
    dist.all_reduce(tt, op=dist.ReduceOp.MAX)
    return {k: (tt[i].tolist(), errors[k]) for i, k in enumerate(variants)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256, help="c (default 256); f = 4c")
    parser.add_argument("--number", type=int, default=10, help="steps per repeat (default 10)")
    parser.add_argument("--repeats", type=int, default=9, help="repeats; medians reported (default 9)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled variants")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    c = args.hidden
    res = launch(_job, args.ranks, args=(args.ranks, args.batch, args.seq, c, 4 * c, args.number, args.repeats,
                                         args.warmup, args.backend, not args.no_compile), timeout=1200, checks=False,
                 device=args.device)
    if res is None:  # another rank under torchrun: rank 0 prints
        return 0
    res = res[0]
    floor = statistics.median(res["floor"][0])
    for name, (ts, err) in res.items():
        med = statistics.median(ts)
        paired = statistics.median(t / f for t, f in zip(ts, res["floor"][0]))
        line = {"bench": "tp_mlp", "variant": name, "ms_per_step": round(med, 3), "ratio": round(med / floor, 3),
                "ratio_paired": round(paired, 3),
                "min_ms": round(min(ts), 3), "max_rel_grad_error": float(f"{err:.2e}"), "ranks": args.ranks,
                "shape": [args.batch, args.seq, c, 4 * c], "number": args.number, "repeats": args.repeats,
                "backend": args.backend if name.endswith("compiled") else None}
        print(json.dumps(line), flush=True)
        print(f"{name:>20}: {med:8.3f} ms/step  x{med / floor:.3f}  (grad err {err:.1e})", file=sys.stderr)
        if err > 1e-3:
            print(f"{name}: gradients disagree with the floor (relative error {err:.1e})", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
