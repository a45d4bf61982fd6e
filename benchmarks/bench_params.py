"""Gradient reduction of an ``nn.Module`` with registered layouts: bytes, calls and step time.

The transformer block of ``examples/train_module.py`` (heads and hidden
units over ``tp``, everything replicated over ``dp``) is trained on a 2 x 4
mesh of 8 gloo CPU ranks in three ways, timed interleaved (one step of each
per repeat, after a warm-up):

- ``formula``: the weights used in formulas carry no gradient duty, so each
  formula's backward all-reduces its weight's gradient over ``dp`` (one
  small synchronous all-reduce per use); the parameters used in plain torch
  ops (norms, biases) are summed by ``reduce_module_grads_`` after backward;
- ``sync``: every parameter has the duty ``grad=dp``; the formulas leave the
  gradients partial and ``reduce_module_grads_`` sums them after backward,
  one all-reduce per parameter;
- ``async``: every parameter has ``grad=dp:async``; the native hooks sum them
  in buckets (``--bucket-bytes``), each bucket's all-reduce started during
  backward as soon as its gradients are accumulated.

Every all-reduce over the ``dp`` group is counted by ``es.count_communication``
(calls, and bytes each rank sends in a ring all-reduce, ``2 (n - 1) / n`` of the buffer). The lower
bound is the same formula applied to all parameter gradients once; ``ratio``
is measured / lower bound (1.00: each gradient reduced exactly once, nothing
else). ``step_ms`` is the median wall time of forward, backward, reduction
and the SGD update; ``speedup_vs_sync`` compares with the ``sync`` variant
measured in the same run. One JSON line per variant::

    python benchmarks/bench_params.py
    python benchmarks/bench_params.py --repeats 31 --bucket-bytes 4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import einshard as es
from einshard.comm.comm_stats import group_label
from einshard.comm.helpers import compute_split_shapes
from einshard.testing import add_device_argument, device_mesh, launch, rank_device, synchronize

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_module import FF, H, LAYOUTS, LR, Block, batch  # noqa: E402

PLAIN_TORCH = ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "b1", "b2")  # not formula operands
VARIANTS = ("formula", "sync", "async")


def _dp_reduces(stats, label):
    """(calls, ring bytes sent per rank) of the all-reduces over the ``dp`` group recorded in ``stats``."""
    rows = [r for (kind, lab, _direction), r in stats.records.items() if kind == "all_reduce" and lab == label]
    return sum(r.calls for r in rows), sum(r.sent_bytes for r in rows)


def _model(mesh, variant, seed, bucket_bytes):
    tp, i = mesh.size("tp"), mesh.index("tp")
    torch.manual_seed(seed)
    model = Block(compute_split_shapes(H, tp)[i], compute_split_shapes(FF, tp)[i]).to(rank_device())
    if variant == "formula":
        grad = {k: "dp" for k in PLAIN_TORCH}
    else:
        grad = "dp:async" if variant == "async" else "dp"
    es.params.register_module_parameter_layouts_(model, LAYOUTS, mesh=mesh, grad=grad)
    es.params.init_params_(model, mesh)
    handle = es.params.register_native_grad_reduction_hooks_(model, mesh, bucket_bytes=bucket_bytes) if variant == "async" else None
    return model, handle, torch.optim.SGD(model.parameters(), lr=LR)


def _step(model, handle, opt, mesh, x, target, scale):
    loss = ((model(x) - target) ** 2).sum() * scale
    loss.backward()
    if handle is not None:
        handle.wait()
    else:
        es.params.reduce_module_grads_(model, mesh)
    opt.step()
    opt.zero_grad(set_to_none=True)


def run(repeats: int, warmup: int, bucket_bytes: int) -> list[dict]:
    torch.set_num_threads(1)
    mesh = es.wrap_mesh(device_mesh((2, 4), ("dp", "tp")))
    models = {v: _model(mesh, v, 0, bucket_bytes) for v in VARIANTS}
    x0, _ = batch(0)
    scale = 1.0 / x0.numel()
    dp = group_label(mesh.group("dp"))
    n = mesh.size("dp")
    params = list(models["sync"][0].parameters())
    lower = 2 * (n - 1) / n * sum(p.numel() * p.element_size() for p in params)
    times = {v: [] for v in VARIANTS}
    counts = {}
    with es.use_mesh(mesh):
        for r in range(warmup + repeats):
            x, target = es.tree_shard(batch(r), "b/dp n c")
            for v in VARIANTS:
                model, handle, opt = models[v]
                dist.barrier()
                with es.count_communication() as stats:
                    synchronize()
                    start = time.perf_counter()
                    _step(model, handle, opt, mesh, x, target, scale)
                    synchronize()
                    elapsed = time.perf_counter() - start
                if r >= warmup:
                    times[v].append(elapsed)
                counts[v] = _dp_reduces(stats, dp)
    # the slowest rank decides a step
    medians = torch.tensor([statistics.median(times[v]) for v in VARIANTS], dtype=torch.float64, device=rank_device())
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    out = []
    sync_ms = medians[VARIANTS.index("sync")].item() * 1e3
    for k, v in enumerate(VARIANTS):
        calls, sent = counts[v]
        ms = medians[k].item() * 1e3
        out.append({
            "variant": v,
            "mesh": "dp=2,tp=4",
            "dp_all_reduce_calls_per_step": calls,
            "dp_bytes_per_rank": sent,
            "lower_bound_bytes": lower,
            "ratio": round(sent / lower, 4),
            "step_ms": round(ms, 3),
            "speedup_vs_sync": round(sync_ms / ms, 3),
            "bucket_bytes": bucket_bytes if v == "async" else None,
            "repeats": repeats,
            "torch_version": torch.__version__,
        })
    for _, handle, _ in models.values():
        if handle is not None:
            handle.remove()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket-bytes", type=int, default=25 * 2**20)
    add_device_argument(parser)
    args = parser.parse_args()
    # cross-rank checks off: they add an agreement collective to every formula call
    results = launch(run, 8, args=(args.repeats, args.warmup, args.bucket_bytes), timeout=600, checks=False,
                     device=args.device)
    if results is not None:
        for line in results[0]:
            print(json.dumps(line), flush=True)
        for line in results[0]:
            print(f"{line['variant']:>8}: {line['dp_all_reduce_calls_per_step']:>3} dp all-reduces/step, "
                  f"ratio {line['ratio']:.2f}, {line['step_ms']:.2f} ms/step", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
