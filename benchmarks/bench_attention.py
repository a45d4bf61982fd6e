"""Context-parallel attention, forward + backward: gather, ring and Ulysses side by side, and the kernel floor.

Queries, keys and values ``(b, h, n, d)`` are split along the sequence over ``sp``; one step is a
causal attention's forward and ``backward`` of a fixed cotangent. Two groups of rows, each timed
interleaved in one job (a barrier before every step):

**One rank** (``--ranks 1``; ``--device cpu`` or ``cuda``, ``auto``: CUDA where there is one):

- ``sdpa``: ``F.scaled_dot_product_attention`` on the whole sequence, the fused kernel: the floor,
  and the baseline of these rows (``ratio`` 1);
- ``ring``: ``es.attention.ring_attention`` on a one-rank ``sp`` (the ring is one block: its per-block kernel);
- ``ulysses``: ``es.attention.ulysses_attention`` likewise.

**Four gloo CPU ranks** (``--ranks 4``; ``sp = 4``):

- ``gather``: the form of ``examples/gpt.py``: ``b h q/sp d, b h k/sp d -> b h q/sp k`` (the formula
  all-gathers the keys), an additive causal mask block, softmax, and ``b h q/sp k, b h k/sp d -> b h q/sp d``
  (all-gathers the values). Every rank holds the whole sequence's keys and values and an
  ``n/sp x n`` block of scores. The baseline of these rows: its ``ratio`` is 1.
- ``ring``: ``es.attention.ring_attention`` on the zigzag layout (``causal=True, layout="zigzag"``);
- ``ring_contiguous``: the same on contiguous blocks (the last rank does most of the causal work);
- ``ulysses``: ``es.attention.ulysses_attention`` (all-to-all to a head split, ``F.scaled_dot_product_attention``
  on whole sequences, all-to-all back);
- ``torch_context_parallel``: PyTorch's ``torch.distributed.tensor.experimental.context_parallel``
  around ``F.scaled_dot_product_attention``; where it does not run (CPU), its line carries the error.

Every variant's output is checked first against ``F.scaled_dot_product_attention`` on the whole
tensors in one process (float32: ``atol=2e-4, rtol=1e-3``; bfloat16: ``atol=rtol=2e-2``). One JSON line
per variant, rank count and sequence length on stdout::

    {"case": "attention", "variant": ..., "ranks": ..., "seq": ..., "ms": ..., "peak_mem_bytes": ..., "ratio": ..., "mem_ratio": ...}

``ms`` is the median over ``--repeats`` of the slowest rank's step; ``peak_mem_bytes`` the peak of
memory allocated by tensors during one step above what was allocated before it (CPU: ``torch.profiler``
memory events, as ``bench_gpt.py``; CUDA: ``torch.cuda.max_memory_allocated``; the largest over
ranks; the inputs, the cotangent and the gather form's mask block are allocated before); ``ratio``
and ``mem_ratio`` are against the baseline of the same rank count and length. Progress goes to stderr::

    python benchmarks/bench_attention.py                       # 2k, 4k and 8k tokens: a few minutes
    python benchmarks/bench_attention.py --seqs 1024 --repeats 3
    python benchmarks/bench_attention.py --ranks 1 --device cuda --dtype bfloat16 --heads 16 --head-dim 128 --seqs 4096 16384
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
from torch.nn.attention import SDPBackend

import einshard as es
from bench_gpt import peak_memory  # (the same measure as the GPT benchmark's)
from einshard.attention import kernels as attention_kernels
from einshard.attention import zigzag_indices
from einshard.testing import MeshSpec, spawn


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _gather(mesh, n):
    size, block = mesh.size("sp"), mesh.index("sp")
    rows = n // size
    above = torch.ones(rows, n, dtype=torch.bool).triu(1 + block * rows)  # this rank's rows of the causal mask
    mask = torch.zeros(rows, n).masked_fill(above, float("-inf"))

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


def _peak(step, device: str) -> int:
    if device == "cpu":
        return peak_memory(step)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _variants(mesh, n):
    """Per variant: (attend, positions of this rank's block); the baseline first."""
    size, block = mesh.size("sp"), mesh.index("sp")
    contiguous = torch.arange(block * (n // size), (block + 1) * (n // size))
    if size == 1:
        return {"sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), contiguous),
                "ring": (_layer(mesh, es.attention.ring_attention), contiguous),
                "ulysses": (_layer(mesh, es.attention.ulysses_attention), contiguous)}
    zz = zigzag_indices(n, size)[block * (n // size):(block + 1) * (n // size)]
    return {"gather": (_gather(mesh, n), contiguous),
            "ring": (_layer(mesh, es.attention.ring_attention, layout="zigzag"), zz),
            "ring_contiguous": (_layer(mesh, es.attention.ring_attention), contiguous),
            "ulysses": (_layer(mesh, es.attention.ulysses_attention), contiguous)}


def on_rank(ranks, seqs, batch, heads, dim, repeats, warmup, device, dtype):
    torch.set_num_threads(1)
    dtype = getattr(torch, dtype)
    device_mesh = MeshSpec((ranks,), ("sp",)).build()
    mesh = es.wrap_mesh(device_mesh)
    rank = dist.get_rank()
    tol = dict(atol=2e-4, rtol=1e-3) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    rows = []
    probe = torch.zeros(1, heads, 16, dim, dtype=dtype, device=device)
    # the block kernel the ring runs, and the backend F.scaled_dot_product_attention runs
    kernels = {"ring_blocks": attention_kernels.kernel(str(probe.device.type), dtype, dim, dim).name,
               "sdpa": SDPBackend(torch.ops.aten._fused_sdp_choice(probe, probe, probe)).name}
    for n in seqs:
        g = torch.Generator().manual_seed(n)
        whole = [torch.randn(batch, heads, n, dim, generator=g).to(device=device, dtype=dtype)
                 for _ in range(4)]  # q, k, v, cotangent
        variants = _variants(mesh, n)
        inputs = {name: _blocks(whole, pos.to(device)) for name, (_, pos) in variants.items()}

        def step(name):
            attend = variants[name][0]
            q, k, v, g = inputs[name]
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            o = attend(q, k, v)
            o.backward(g)
            return o.detach()

        with torch.no_grad():  # the whole attention in this process (a fused kernel: no n x n block)
            want = F.scaled_dot_product_attention(*whole[:3], is_causal=True)
        for name, (_, pos) in variants.items():
            got = step(name)
            if not torch.allclose(got, want[:, :, pos.to(device)], **tol):
                raise AssertionError(f"{name} differs from whole attention at n={n}: "
                                     f"{(got - want[:, :, pos.to(device)]).abs().max().item()}")
        del want
        times = {name: [] for name in variants}
        for i in range(warmup + repeats):
            for name in variants:
                _sync(device)
                start = time.perf_counter()
                step(name)
                _sync(device)
                if i >= warmup:
                    times[name].append(time.perf_counter() - start)
        for name in variants:
            peak = _peak(lambda: step(name), device)
            stats = torch.tensor([statistics.median(times[name]) * 1e3, peak], dtype=torch.float64)
            if ranks > 1:
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            rows.append({"case": "attention", "variant": name, "ranks": ranks, "seq": n,
                         "ms": round(stats[0].item(), 2), "peak_mem_bytes": int(stats[1].item())})
        if rank == 0:
            log(f"{ranks} rank(s), n={n}: " + ", ".join(
                f"{r['variant']} {r['ms']} ms {r['peak_mem_bytes'] / 2**20:.1f} MiB" for r in rows if r["seq"] == n))
        if ranks > 1:
            row = {"case": "attention", "variant": "torch_context_parallel", "ranks": ranks, "seq": n}
            try:
                _context_parallel(device_mesh, whole[:3])()
                row["error"] = None
            except Exception as err:  # noqa: BLE001 - recorded: PyTorch's context parallelism may not run here
                while err.__context__ is not None:  # the first error, not one raised while leaving the context
                    err = err.__context__
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            rows.append(row)
    for row in rows:
        base = next(r for r in rows if r["seq"] == row["seq"] and r["variant"] in ("gather", "sdpa"))
        if "ms" in row:
            row["ratio"] = round(row["ms"] / base["ms"], 3)
            row["mem_ratio"] = round(row["peak_mem_bytes"] / max(base["peak_mem_bytes"], 1), 3)
        row.update(batch=batch, heads=heads, head_dim=dim, repeats=repeats, dtype=str(dtype).split(".")[-1],
                   device=device, torch_version=torch.__version__, kernels=kernels)
    return rows if rank == 0 else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192], help="sequence lengths")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4], choices=[1, 4],
                        help="the one-rank rows (against SDPA), the four-rank ones (against gather), or both")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where the one-rank rows run (auto: CUDA where available); four ranks are gloo CPU")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant (default 5)")
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    if any(n % 8 for n in args.seqs):
        parser.error("sequence lengths must divide by 8 (2 zigzag chunks per rank on 4 ranks)")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch sees no CUDA device")
    for ranks in args.ranks:
        where = device if ranks == 1 else "cpu"
        results = spawn(on_rank, ranks, args=(ranks, args.seqs, args.batch, args.heads, args.head_dim,
                                              args.repeats, args.warmup, where, args.dtype),
                        timeout=3600, checks=False)
        for row in results[0]:
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
