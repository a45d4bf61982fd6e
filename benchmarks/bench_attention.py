"""Context-parallel attention, forward + backward, on 4 gloo ranks: gather, ring and Ulysses side by side.

Queries, keys and values ``(b, h, n, d)`` (float32) are split along the sequence over ``sp``;
one step is a causal attention's forward and ``backward`` of a fixed cotangent. Variants, timed
interleaved in one job (a barrier before every step):

- ``gather``: the form of ``examples/gpt.py``: ``b h q/sp d, b h k/sp d -> b h q/sp k`` (the formula
  all-gathers the keys), an additive causal mask block, softmax, and ``b h q/sp k, b h k/sp d -> b h q/sp d``
  (all-gathers the values). Every rank holds the whole sequence's keys and values and an
  ``n/sp x n`` block of scores. The baseline: its ``ratio`` is 1.
- ``ring``: ``es.ring_attention`` on the zigzag layout (``causal=True, layout="zigzag"``);
- ``ring_contiguous``: the same on contiguous blocks (the last rank does most of the causal work);
- ``ulysses``: ``es.ulysses_attention`` (all-to-all to a head split, ``F.scaled_dot_product_attention``
  on whole sequences, all-to-all back);
- ``torch_context_parallel``: PyTorch's ``torch.distributed.tensor.experimental.context_parallel``
  around ``F.scaled_dot_product_attention``; where it does not run (CPU), its line carries the error.

Every variant's output is checked first against attention on the whole tensors in one process
(float32 tolerance). One JSON line per
variant and sequence length on stdout::

    {"case": "attention", "variant": ..., "seq": ..., "ms": ..., "peak_mem_bytes": ..., "ratio": ..., "mem_ratio": ...}

``ms`` is the median over ``--repeats`` of the slowest rank's step; ``peak_mem_bytes`` the peak of CPU
memory allocated by tensors during one step above what was allocated before it (``torch.profiler``
memory events, as ``bench_gpt.py``; the largest over ranks; the inputs, the cotangent and the gather
form's mask block are allocated before); ``ratio`` and ``mem_ratio`` are against ``gather`` at the
same length. Progress goes to stderr::

    python benchmarks/bench_attention.py                       # 2k, 4k and 8k tokens: a few minutes
    python benchmarks/bench_attention.py --seqs 1024 --repeats 3
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
from bench_gpt import peak_memory  # (the same measure as the GPT benchmark's)
from einshard.attention import zigzag_indices
from einshard.testing import MeshSpec, add_device_argument, launch, rank_device, synchronize


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _gather(mesh, n):
    size, block = mesh.size("sp"), mesh.index("sp")
    rows = n // size
    above = torch.ones(rows, n, dtype=torch.bool, device=rank_device()).triu(1 + block * rows)  # this rank's rows
    mask = torch.zeros(rows, n, device=rank_device()).masked_fill(above, float("-inf"))  # of the causal mask

    def attend(q, k, v):
        with es.use_mesh(mesh):
            s = es.einshard("b h q/sp d, b h k/sp d -> b h q/sp k", q, k) * q.shape[-1] ** -0.5
            return es.einshard("b h q/sp k, b h k/sp d -> b h q/sp d", (s + mask).softmax(-1), v)

    return attend


def _layer(mesh, fn, **kw):
    def attend(q, k, v):
        with es.use_mesh(mesh):
            return fn(q, k, v, "sp", causal=True, **kw)

    return attend


def _context_parallel(device_mesh, whole):
    """PyTorch's context parallelism: shards the whole buffers itself (its own load-balanced layout)."""
    from torch.distributed.tensor.experimental import context_parallel

    def attend():
        q, k, v = (t.clone() for t in whole)
        with context_parallel(device_mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))  # the buffers themselves are restored
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.sum().backward()
        return o

    return attend


def _blocks(whole, positions):
    return [t[:, :, positions].clone() for t in whole]


def on_rank(seqs, batch, heads, dim, repeats, warmup):
    torch.set_num_threads(1)
    device_mesh = MeshSpec((4,), ("sp",)).build()
    mesh = es.wrap_mesh(device_mesh)
    size, block, rank = mesh.size("sp"), mesh.index("sp"), dist.get_rank()
    rows = []
    for n in seqs:
        g = torch.Generator().manual_seed(n)
        whole = [torch.randn(batch, heads, n, dim, generator=g).to(rank_device()) for _ in range(4)]  # q k v cot.
        contiguous = torch.arange(block * (n // size), (block + 1) * (n // size), device=rank_device())
        zz = zigzag_indices(n, size, device=rank_device())[block * (n // size):(block + 1) * (n // size)]
        variants = {  # name: (attend, positions of this rank's block)
            "gather": (_gather(mesh, n), contiguous),
            "ring": (_layer(mesh, es.ring_attention, layout="zigzag"), zz),
            "ring_contiguous": (_layer(mesh, es.ring_attention), contiguous),
            "ulysses": (_layer(mesh, es.ulysses_attention), contiguous),
        }
        inputs = {name: _blocks(whole, pos) for name, (_, pos) in variants.items()}

        def step(name):
            attend = variants[name][0]
            q, k, v, g = inputs[name]
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            o = attend(q, k, v)
            o.backward(g)
            return o.detach()

        with torch.no_grad():  # the whole attention in this process (flash kernel: no n x n block)
            want = F.scaled_dot_product_attention(*whole[:3], is_causal=True)
        for name, (_, pos) in variants.items():
            got = step(name)
            if not torch.allclose(got, want[:, :, pos], atol=2e-4, rtol=1e-3):
                raise AssertionError(f"{name} differs from whole attention at n={n}: "
                                     f"{(got - want[:, :, pos]).abs().max().item()}")
        del want
        times = {name: [] for name in variants}
        for i in range(warmup + repeats):
            for name in variants:
                dist.barrier()
                synchronize()
                start = time.perf_counter()
                step(name)
                synchronize()
                if i >= warmup:
                    times[name].append(time.perf_counter() - start)
        for name in variants:
            peak = peak_memory(lambda: step(name))
            stats = torch.tensor([statistics.median(times[name]) * 1e3, peak], dtype=torch.float64,
                                 device=rank_device())
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            rows.append({"case": "attention", "variant": name, "seq": n, "ms": round(stats[0].item(), 1),
                         "peak_mem_bytes": int(stats[1].item())})
        if rank == 0:
            log(f"n={n}: " + ", ".join(f"{r['variant']} {r['ms']} ms {r['peak_mem_bytes'] / 2**20:.1f} MiB"
                                      for r in rows if r["seq"] == n))
        row = {"case": "attention", "variant": "torch_context_parallel", "seq": n}
        try:
            _context_parallel(device_mesh, whole[:3])()
            row["error"] = None
        except Exception as err:  # noqa: BLE001 - recorded: PyTorch's context parallelism may not run here
            while err.__context__ is not None:  # the first error, not one raised while leaving the context
                err = err.__context__
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
        rows.append(row)
    for row in rows:
        base = next(r for r in rows if r["seq"] == row["seq"] and r["variant"] == "gather")
        if "ms" in row:
            row["ratio"] = round(row["ms"] / base["ms"], 3)
            row["mem_ratio"] = round(row["peak_mem_bytes"] / base["peak_mem_bytes"], 3)
        row.update(batch=batch, heads=heads, head_dim=dim, ranks=size, repeats=repeats, dtype="float32",
                   torch_version=torch.__version__)
    return rows if rank == 0 else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192], help="sequence lengths")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant (default 5)")
    parser.add_argument("--warmup", type=int, default=1)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    if any(n % 8 for n in args.seqs):
        parser.error("sequence lengths must divide by 8 (2 zigzag chunks per rank on 4 ranks)")
    results = launch(on_rank, 4, args=(args.seqs, args.batch, args.heads, args.head_dim, args.repeats, args.warmup),
                     timeout=3600, checks=False, device=args.device)
    if results is None:  # another rank under torchrun: rank 0 prints
        return 0
    for row in results[0]:
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
