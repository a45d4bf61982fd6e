"""A GPT training step: einshard against PyTorch's own parallel stack, on 8 gloo CPU ranks.

The model, data and optimizer (Adam) are those of ``examples/gpt.py`` in float32. Variants,
timed interleaved in one job (a barrier before every step):

- ``torch``: PyTorch's native stack on a ``dp x tp`` = 4 x 2 mesh: ``parallelize_module`` with
  ``RowwiseParallel`` (vocabulary-parallel embedding), ``SequenceParallel`` (norms, position
  embedding), ``PrepareModuleInput`` + ``ColwiseParallel``/``RowwiseParallel`` (attention and MLP),
  a ``ColwiseParallel`` tied head with ``loss_parallel`` (vocabulary-parallel cross-entropy), and
  ``fully_shard`` (FSDP2) over ``dp``. The baseline: its ``ratio`` is 1.
- ``einshard``: the example's model and ``shard_map`` step on the same decomposition
  (``dp x sp x tp`` = 4 x 1 x 2: batch over dp, sequence parallelism over tp);
- ``einshard_hooks``: the example's ``--style einshard`` step (no ``shard_map``; gradient duties
  summed by bucketed asynchronous all-reduces started during backward) on 4 x 1 x 2;
- ``einshard_compiled``: the ``shard_map`` loss compiled with ``torch.compile`` (inductor, its all-reduces
  bucketed: ``bucket_all_reduces_fx``) on 4 x 1 x 2;
- ``einshard_3d``: the ``shard_map`` step on ``dp x sp x tp`` = 2 x 2 x 2 (sequence over sp too);
- ``einshard_no_vma``: the ``shard_map`` step with ``check_vma=False`` and the gradient sums of the
  parameters plain torch ops use written by hand (``es.spmd.pvary``), on 4 x 1 x 2: what variance tracking
  costs is ``einshard`` against it;
- ``einshard_zero``: ``einshard_hooks`` with the example's ``--zero``: parameters, gradients and Adam
  states stored sharded over ``dp`` (ZeRO-3; gathered before use, prefetched, freed after forward,
  reduce-scattered in buckets during backward), on 4 x 1 x 2, as FSDP2 does in ``torch``;
- ``einshard_zero_shard_map``: the ``shard_map`` step with ``--zero`` (gathered on entry to the body).

Before timing, every variant trains the same first steps from the same initial values and their
losses must agree (float32 tolerance). One JSON line per variant on stdout::

    {"case": "gpt_step", "variant": ..., "ms": ..., "bytes_per_rank": ..., "peak_mem_bytes": ...,
     "state_bytes_per_rank": ..., "ratio": ...}

``ms`` is the median step time (the slowest rank's median), ``bytes_per_rank`` the bytes this rank
sends in one step (the largest over ranks), counted for every variant by the same dispatch-mode
counter on the ``c10d`` and functional-collective ops with the byte rules of
``es.count_communication`` (ring all-reduce ``2(P-1)N/P``, gather/scatter the other ranks' blocks),
and ``peak_mem_bytes`` the peak of CPU memory allocated by tensors during one step above what was
allocated before it (``torch.profiler`` memory events; the largest over ranks), and
``state_bytes_per_rank`` the bytes of the parameters, gradients and optimizer states this rank holds
between steps, measured from the tensors themselves (the local blocks of DTensors; each storage once;
the largest over ranks). Progress goes to stderr::

    python benchmarks/bench_gpt.py                 # about four minutes on 2 idle cores (inductor compiles included)
    python benchmarks/bench_gpt.py --steps 20 --width 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import gpt  # noqa: E402  (examples/gpt.py: the model, data and reference)

import einshard as es  # noqa: E402
from einshard.testing import add_device_argument, device_mesh, launch, rank_device, synchronize  # noqa: E402


def log(*args):
    print(*args, file=sys.stderr, flush=True)


# -- counting bytes: one dispatch mode for every variant ----------------------------------------------


def _group_size(args) -> int:
    for a in args:
        if type(a).__name__ == "ScriptObject":
            try:
                return dist.ProcessGroup.unbox(a).size()
            except RuntimeError:  # a ReduceOp, not a group
                continue
        if isinstance(a, str):
            try:
                return dist.distributed_c10d._resolve_process_group(a).size()
            except (RuntimeError, ValueError, KeyError):
                continue
    return 1


def _bytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_bytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class SentBytes(TorchDispatchMode):
    """Counts the bytes this rank sends through ``c10d`` and functional collectives."""

    def __init__(self):
        super().__init__()
        self.sent = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace in ("c10d", "_c10d_functional"):
            p = _group_size(args)
            if p > 1:
                self.sent += self._sent(name, args, p)
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _sent(name: str, args, p: int) -> int:
        if name in ("allreduce_", "all_reduce", "all_reduce_coalesced", "allreduce_coalesced_"):
            return 2 * (p - 1) * _bytes(args[0]) // p
        if name in ("_allgather_base_", "all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
            inp = args[1] if name == "_allgather_base_" else args[0]
            return (p - 1) * _bytes(inp)
        if name in ("allgather_", "allgather_into_tensor_coalesced_"):
            return (p - 1) * _bytes(args[1])
        if name in ("_reduce_scatter_base_", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced",
                    "reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
            inp = args[1] if name.endswith("_") else args[0]
            return (p - 1) * _bytes(inp) // p
        if name in ("alltoall_base_", "all_to_all_single", "alltoall_"):
            inp = args[1] if name.endswith("_") else args[0]
            return (p - 1) * _bytes(inp) // p
        if name in ("broadcast_",):
            return _bytes(args[0]) if dist.get_rank() == 0 else 0
        if name in ("send",):
            return _bytes(args[0])
        return 0


def peak_memory(step) -> int:
    """Peak tensor bytes allocated during ``step()`` above the level before it (profiler events; on a GPU rank
    the CUDA caching allocator's peak)."""
    device = rank_device()
    if device.type == "cuda":
        synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        synchronize()
        return torch.cuda.max_memory_allocated(device) - before
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    level = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        level += event.nbytes()
        peak = max(peak, level)
    return peak


# -- the variants ------------------------------------------------------------------------------------


def state_bytes(model, optimizer) -> int:
    """Bytes of the parameters, their gradients and the optimizer's states this rank holds (each storage once)."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        t = t.to_local() if hasattr(t, "to_local") else t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()

    for p in model.parameters():
        add(p)
        if p.grad is not None:
            add(p.grad)
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                add(v)
    return total


def einshard_variant(cfg, values, dims, style="shard_map", compile=False, check_vma=True, zero=False):
    mesh = gpt.make_mesh(dims)
    model = gpt.sharded_model(mesh, values, cfg, style, zero)
    step_fn = gpt.make_step(model, mesh, style, compile=compile) if check_vma else untracked_step(model, mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=gpt.LR)

    def step(i):
        with es.use_mesh(mesh):
            optimizer.zero_grad(set_to_none=True)
            loss = step_fn(*gpt.batch(i, cfg))
            optimizer.step()
        return loss.item()

    step.states = (model, optimizer)
    return step


def untracked_step(model, mesh):
    """The example's ``shard_map`` step with ``check_vma=False``, the gradient sums variance tracking inserts
    written by hand instead: ``es.spmd.pvary`` of each replicated parameter where a plain torch op meets it with
    per-rank data (the formulas sum their operands' gradients themselves). The cost of variance tracking is
    the ``einshard`` variant's step time against this one's."""
    mask = gpt.causal_mask(mesh, model.cfg)
    stream = ("dp", "sp", "tp")  # the residual stream b/dp n/sp-tp c varies over every mesh dimension

    def layer_norm(x, ln):
        return F.layer_norm(x, ln.normalized_shape, es.spmd.pvary(ln.weight, stream), es.spmd.pvary(ln.bias, stream), ln.eps)

    def block(self, x, mask):
        qkv = es.einshard(f"{gpt.X}, t h/tp d c -> t b/dp h/tp n/sp d", layer_norm(x, self.ln1), self.wqkv)
        s = es.einshard("b/dp h/tp q/sp d, b/dp h/tp k/sp d -> b/dp h/tp q/sp k", qkv[0], qkv[1]) * self.scale
        o = es.einshard("b/dp h/tp q/sp k, b/dp h/tp k/sp d -> b/dp h/tp q/sp d", (s + mask).softmax(-1), qkv[2])
        x = x + es.einshard(f"b/dp h/tp n/sp d, c h/tp d -> {gpt.X}", o, self.wo)
        u = F.gelu(es.einshard(f"{gpt.X}, f/tp c -> b/dp n/sp f/tp", layer_norm(x, self.ln2), self.w1)
                   + es.spmd.pvary(self.b1, ("dp", "sp")))
        return x + es.einshard(f"b/dp n/sp f/tp, c f/tp -> {gpt.X}", u, self.w2) + es.spmd.pvary(self.b2, stream)

    class HandSummed(nn.Module):  # the model's own forward with the sums by hand; functional_call swaps its parameters
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, tokens, targets):
            return hand_summed(self.model, tokens, targets)

    def hand_summed(model, tokens, targets):
        rows = model.wte.shape[0]
        local = tokens - es.spmd.axis_index("tp") * rows
        mine = (local >= 0) & (local < rows)
        e = F.embedding(local.clamp(0, rows - 1), es.spmd.pvary(model.wte, ("dp", "sp"))) * mine[..., None]
        x = es.einshard(f"b/dp n/sp c // tp -> {gpt.X}", e) + es.einshard("n c -> n/sp-tp c // dp", model.wpe)
        for b in model.blocks:
            x = block(b, x, mask)
        logits = es.einshard(f"{gpt.X}, v/tp c -> b/dp n/sp v/tp", layer_norm(x, model.ln_f), model.wte)
        return gpt.vocab_parallel_cross_entropy(logits, targets) / (model.cfg.batch * model.cfg.seq)

    wrapper = HandSummed()

    @es.shard_map(in_specs=(es.params.param_specs(model), "b n -> b/dp n/sp", "b n -> b/dp n/sp"), out_specs="", mesh=mesh,
                  check_vma=False)
    def loss_fn(params, tokens, targets):  # as the example's step: parameters in, functional_call
        return torch.func.functional_call(wrapper, {f"model.{k}": v for k, v in params.items()}, (tokens, targets),
                                          strict=True)

    def step(tokens, targets):
        loss = loss_fn(dict(model.named_parameters()), tokens, targets)
        loss.backward()
        return loss.detach()

    return step


class _Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.head_width = cfg.head_width
        inner = cfg.heads * cfg.head_width
        self.q, self.k, self.v = (nn.Linear(cfg.width, inner, bias=False) for _ in range(3))
        self.o = nn.Linear(inner, cfg.width, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (m(x).view(b, n, -1, self.head_width).transpose(1, 2) for m in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, -1))


class _MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(cfg.width, cfg.hidden), nn.Linear(cfg.hidden, cfg.width)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class _Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.width), _Attention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.width), _MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _Position(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.seq, cfg.width))

    def forward(self, x):
        return x + self.weight


class TorchGPT(nn.Module):
    """The example's GPT written the way PyTorch's tensor-parallel styles expect (``nn.Linear``s)."""

    def __init__(self, cfg):
        super().__init__()
        self.tok, self.pos = nn.Embedding(cfg.vocab, cfg.width), _Position(cfg)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.ln_f, self.head = nn.LayerNorm(cfg.width), nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, tokens):
        x = self.pos(self.tok(tokens))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def load(self, values, cfg):
        """Copy the example's whole parameters in (names and shapes differ, the numbers do not)."""
        with torch.no_grad():
            self.tok.weight.copy_(values["wte"])
            self.pos.weight.copy_(values["wpe"])
            self.ln_f.weight.copy_(values["ln_f.weight"])
            self.ln_f.bias.copy_(values["ln_f.bias"])
            for i, b in enumerate(self.blocks):
                v = {k[len(f"blocks.{i}."):]: t for k, t in values.items() if k.startswith(f"blocks.{i}.")}
                for ours, theirs in (("ln1", "ln1"), ("ln2", "ln2")):
                    getattr(b, ours).weight.copy_(v[f"{theirs}.weight"])
                    getattr(b, ours).bias.copy_(v[f"{theirs}.bias"])
                for w, whole in zip("qkv", v["wqkv"]):
                    getattr(b.attn, w).weight.copy_(whole.reshape(-1, cfg.width))
                b.attn.o.weight.copy_(v["wo"].reshape(cfg.width, -1))
                b.mlp.fc1.weight.copy_(v["w1"])
                b.mlp.fc1.bias.copy_(v["b1"])
                b.mlp.fc2.weight.copy_(v["w2"])
                b.mlp.fc2.bias.copy_(v["b2"])


def torch_variant(cfg, values, dp, tp):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, loss_parallel, parallelize_module)

    mesh = device_mesh((dp, tp), ("dp", "tp"))
    model = TorchGPT(cfg).to(rank_device())
    model.load(values, cfg)
    gathered = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "pos": SequenceParallel(use_local_output=True),
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(cfg.layers):
        plan.update({
            f"blocks.{i}.ln1": SequenceParallel(), f"blocks.{i}.ln2": SequenceParallel(),
            f"blocks.{i}.attn": gathered, f"blocks.{i}.mlp": gathered,
            **{f"blocks.{i}.attn.{w}": ColwiseParallel() for w in "qkv"},
            f"blocks.{i}.attn.o": RowwiseParallel(output_layouts=Shard(1)),
            f"blocks.{i}.mlp.fc1": ColwiseParallel(),
            f"blocks.{i}.mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
        })
    parallelize_module(model, mesh["tp"], plan)
    model.head.weight = model.tok.weight  # tied again: both are Shard(0) over tp
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.Adam(model.parameters(), lr=gpt.LR)
    rows = cfg.batch // dp
    first = mesh["dp"].get_local_rank() * rows

    def step(i):
        tokens, targets = (t[first:first + rows] for t in gpt.batch(i, cfg))
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
            loss.backward()
        optimizer.step()
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh["dp"].get_group())  # the mean over the whole batch
        return total.item() / dp

    step.states = (model, optimizer)
    return step


# -- driver --------------------------------------------------------------------------------------------


VARIANTS = ("torch", "einshard", "einshard_hooks", "einshard_compiled", "einshard_3d", "einshard_no_vma",
            "einshard_zero", "einshard_zero_shard_map")


def on_rank(cfg, steps: int, warmup: int, only=VARIANTS) -> list[dict] | None:
    torch.set_num_threads(1)
    values = gpt.init_values(cfg)
    makers = {
        "torch": lambda: torch_variant(cfg, values, dp=4, tp=2),
        "einshard": lambda: einshard_variant(cfg, values, (("dp", 4), ("sp", 1), ("tp", 2))),
        "einshard_hooks": lambda: einshard_variant(cfg, values, (("dp", 4), ("sp", 1), ("tp", 2)), "einshard"),
        "einshard_compiled": lambda: einshard_variant(cfg, values, (("dp", 4), ("sp", 1), ("tp", 2)), compile=True),
        "einshard_3d": lambda: einshard_variant(cfg, values, (("dp", 2), ("sp", 2), ("tp", 2))),
        "einshard_no_vma": lambda: einshard_variant(cfg, values, (("dp", 4), ("sp", 1), ("tp", 2)), check_vma=False),
        "einshard_zero": lambda: einshard_variant(cfg, values, (("dp", 4), ("sp", 1), ("tp", 2)), "einshard",
                                                  zero=True),
        "einshard_zero_shard_map": lambda: einshard_variant(cfg, values, (("dp", 4), ("sp", 1), ("tp", 2)), zero=True),
    }
    variants = {name: makers[name]() for name in ("torch", *[v for v in only if v != "torch"])}
    rank = dist.get_rank()
    # the same first steps from the same values: the losses must agree
    losses = {name: [step(i) for i in range(warmup)] for name, step in variants.items()}
    for name, got in losses.items():
        for a, b in zip(got, losses["torch"]):
            if abs(a - b) > 1e-4 * max(1.0, abs(b)):
                raise AssertionError(f"{name} loss {got} differs from torch {losses['torch']}")
    if rank == 0:
        log(f"losses agree over {warmup} steps: " + ", ".join(f"{k} {v[-1]:.5f}" for k, v in losses.items()))
    times = {name: [] for name in variants}
    for i in range(warmup, warmup + steps):
        for name, step in variants.items():
            dist.barrier()
            synchronize()
            start = time.perf_counter()
            step(i)
            synchronize()
            times[name].append(time.perf_counter() - start)
        if rank == 0:
            log(f"step {i - warmup + 1}/{steps}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in times.items()))
    rows = []
    for name, step in variants.items():
        with SentBytes() as counter:
            step(warmup + steps)
        peak = peak_memory(lambda: step(warmup + steps + 1))
        held = state_bytes(*step.states)  # after a step: parameters, gradients and Adam states, between steps
        stats = torch.tensor([statistics.median(times[name]) * 1e3, counter.sent, peak, held], dtype=torch.float64,
                             device=rank_device())
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        rows.append({"case": "gpt_step", "variant": name, "ms": round(stats[0].item(), 2),
                     "bytes_per_rank": int(stats[1].item()), "peak_mem_bytes": int(stats[2].item()),
                     "state_bytes_per_rank": int(stats[3].item())})
    base = rows[0]["ms"]
    for row in rows:
        row["ratio"] = round(row["ms"] / base, 3)
        row.update(steps=steps, ranks=dist.get_world_size(), config=str(cfg), torch_version=torch.__version__)
    return rows if rank == 0 else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant (default 8)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps, losses compared (default 2)")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated variants to run besides torch, the baseline (default all)")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    only = tuple(v for v in args.variants.split(",") if v)
    unknown = [v for v in only if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    cfg = gpt.Config(vocab=512, seq=args.seq, width=args.width, heads=4, head_width=args.width // 4,
                     hidden=4 * args.width, layers=args.layers, batch=args.batch, dtype=torch.float32)
    results = launch(on_rank, 8, args=(cfg, args.steps, args.warmup, only), timeout=1200, checks=False,
                     device=args.device)
    if results is None:  # another rank under torchrun: rank 0 prints
        return 0
    for row in results[0]:
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
