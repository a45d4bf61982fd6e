"""Train a small GPT with data x sequence x tensor parallelism (dp x sp x tp) on 8 ranks (CPUs, or GPUs under torchrun).

A decoder-only language model (token and position embeddings, pre-norm blocks of causal
multi-head attention and an MLP, an output head tied to the token embedding) learns a
synthetic corpus the script generates: every sequence counts up modulo the vocabulary
from a random start with a random stride, so the next token follows from the two
before it. The model is a tree of ``nn.Module``s; where each parameter lives is one
layout string per parameter (``model_layouts()``):

- ``tp`` splits the attention heads and the MLP's hidden units (column-parallel in,
  row-parallel out) and the vocabulary (vocabulary-parallel embedding, tied head and
  cross-entropy: the logits are never gathered);
- the residual stream lives as ``b/dp n/sp-tp c``: the batch over ``dp``, the sequence
  over ``sp`` and, for norms and residuals, over ``tp`` too (sequence parallelism).
  Entering a tensor-parallel region all-gathers the sequence over ``tp`` inside the
  column-parallel formula (``b/dp n/sp-tp c, f/tp c -> b/dp n/sp f/tp``: in backward
  the input's gradient is reduce-scattered); leaving it reduce-scatters
  (``b/dp n/sp f/tp, c f/tp -> b/dp n/sp-tp c``). Attention keeps queries split over
  ``sp`` and gathers keys and values over ``sp`` (context parallelism); ``--attention ring``
  passes them around the ``sp`` ring instead (``es.attention.ring_attention``, the sequence in zigzag
  order so that causal work is even) and ``--attention ulysses`` swaps the sequence split for
  a head split and back (``es.attention.ulysses_attention``).

Every collective comes from a formula; there is no hand-written all-reduce. The training
step comes in two styles (``--style``):

- ``shard_map`` (default): forward and ``loss.backward()`` are one ``es.shard_map`` body with
  ``check_vma=True``, so the replicated parameters (norms, biases, position embeddings) receive
  gradients summed over every rank they meet;
- ``einshard``: the model runs under ``es.use_mesh`` with no ``shard_map``; every parameter
  carries a gradient duty (``grad=dp-sp:async``, ...), the formulas leave those gradients
  partial, and bucketed asynchronous all-reduces started during backward sum them.

Adam then updates every rank's blocks. Half-way, the model and Adam's state are saved with
``torch.distributed.checkpoint`` (``es.params.to_dtensor``: placements from the registered layouts)
and training resumes on a different mesh (dp=4, sp=1, tp=2), resharded by DCP. The same model
is trained in one process on whole tensors (float64) and the losses are compared step by step,
before and after the resume.

Run it from the repository root::

    python examples/gpt.py                               # starts 8 gloo ranks itself
    python examples/gpt.py --style einshard              # without shard_map, gradient hooks
    python examples/gpt.py --attention ring              # ring attention (or: ulysses)
    torchrun --nproc-per-node 8 examples/gpt.py          # or under torchrun (GPUs if it has 8, else CPUs)
    torchrun --nproc-per-node 8 examples/gpt.py --device cuda   # one GPU per rank over NCCL

The whole tensors (data, initial values, the one-process reference) are made on the CPU from
seeded generators and moved to the rank's device (``es.testing.rank_device()``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

import einshard as es
from einshard.attention import zigzag_indices
from einshard.testing import add_device_argument, device_mesh, launch, rank_device

@dataclass(frozen=True)
class Config:
    vocab: int = 32
    seq: int = 8
    width: int = 16
    heads: int = 4
    head_width: int = 4
    hidden: int = 32  # MLP hidden units
    layers: int = 2
    batch: int = 8  # sequences per step
    dtype: torch.dtype = torch.float64
    attention: str = "gather"  # context parallelism: "gather" keys and values, "ring" or "ulysses"


CONFIG = Config()
STEPS, LR = 10, 3e-2
MESH = (("dp", 2), ("sp", 2), ("tp", 2))  # the first half of training
RESUME_MESH = (("dp", 4), ("sp", 1), ("tp", 2))  # the second half, from the checkpoint

X = "b/dp n/sp-tp c"  # the residual stream: batch over dp, sequence over sp and tp

BLOCK_LAYOUTS = {
    "ln1.weight": "c", "ln1.bias": "c",
    "wqkv": "t h/tp d c", "wo": "c h/tp d",  # t: query, key, value
    "ln2.weight": "c", "ln2.bias": "c",
    "w1": "f/tp c", "b1": "f/tp", "w2": "c f/tp", "b2": "c",
}


def model_layouts(cfg: Config = CONFIG) -> dict[str, str]:
    """Where each parameter of :class:`GPT` lives, by parameter name."""
    return {
        "wte": "v/tp c",  # vocabulary-parallel embedding, tied to the output head
        "wpe": "n c",
        **{f"blocks.{i}.{k}": v for i in range(cfg.layers) for k, v in BLOCK_LAYOUTS.items()},
        "ln_f.weight": "c", "ln_f.bias": "c",
    }


# -- the model: per-rank code (the parameters are this rank's blocks) ---------------------------


class Block(nn.Module):
    """A pre-norm transformer block on the residual stream ``b/dp n/sp-tp c``."""

    def __init__(self, cfg: Config):
        super().__init__()
        C, H, D, FF = cfg.width, cfg.heads, cfg.head_width, cfg.hidden

        def param(*shape):
            return nn.Parameter(torch.empty(shape, dtype=cfg.dtype))

        self.scale = D**-0.5
        self.attention = cfg.attention
        self.ln1, self.ln2 = nn.LayerNorm(C, dtype=cfg.dtype), nn.LayerNorm(C, dtype=cfg.dtype)
        self.wqkv, self.wo = param(3, H, D, C), param(C, H, D)
        self.w1, self.b1, self.w2, self.b2 = param(FF, C), param(FF), param(C, FF), param(C)

    def forward(self, x, mask):
        # sequence parallelism + column-parallel in one formula: the sequence is all-gathered over tp
        # in forward, and the input's gradient reduce-scattered back over tp in backward
        qkv = es.einshard(f"{X}, t h/tp d c -> t b/dp h/tp n/sp d", self.ln1(x), self.wqkv)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if self.attention == "gather":
            # queries stay split over sp; the formula gathers the keys (and below the values) over sp
            s = es.einshard("b/dp h/tp q/sp d, b/dp h/tp k/sp d -> b/dp h/tp q/sp k", q, k) * self.scale
            p = (s + mask).softmax(-1)
            o = es.einshard("b/dp h/tp q/sp k, b/dp h/tp k/sp d -> b/dp h/tp q/sp d", p, v)
        elif self.attention == "ring":  # keys and values travel around sp; the sequence is in zigzag order
            o = es.attention.ring_attention(q, k, v, "sp", causal=True, layout="zigzag")
        else:  # an all-to-all gives each sp rank whole sequences of some heads, and one takes them back
            o = es.attention.ulysses_attention(q, k, v, "sp", causal=True)
        x = x + es.einshard(f"b/dp h/tp n/sp d, c h/tp d -> {X}", o, self.wo)  # row-parallel: reduce-scatter
        u = F.gelu(es.einshard(f"{X}, f/tp c -> b/dp n/sp f/tp", self.ln2(x), self.w1) + self.b1)
        return x + es.einshard(f"b/dp n/sp f/tp, c f/tp -> {X}", u, self.w2) + self.b2


class GPT(nn.Module):
    """The language model; ``model(tokens, targets, mask, positions)`` is the mean next-token loss."""

    def __init__(self, cfg: Config = CONFIG):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Parameter(torch.empty(cfg.vocab, cfg.width, dtype=cfg.dtype))
        self.wpe = nn.Parameter(torch.empty(cfg.seq, cfg.width, dtype=cfg.dtype))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width, dtype=cfg.dtype)

    def embed(self, tokens):
        """Vocabulary-parallel embedding: look up the ids this rank's rows hold, sum over tp."""
        rows = self.wte.shape[0]
        local = tokens - es.spmd.axis_index("tp") * rows
        mine = (local >= 0) & (local < rows)
        e = F.embedding(local.clamp(0, rows - 1), self.wte) * mine[..., None]  # this rank's share
        return es.einshard(f"b/dp n/sp c // tp -> {X}", e)  # summed over tp, sequence split over tp

    def forward(self, tokens, targets, mask, positions=None):
        """The mean next-token cross-entropy; ``tokens``/``targets`` are ``b/dp n/sp``, the sequence in the order
        of ``positions`` (``None``: its own)."""
        # this rank's positions; '// dp' (pvary) says they meet data that varies over dp, so the
        # gradient arriving in backward holds per-rank contributions that must be summed over dp
        if positions is None:
            wpe = es.einshard("n c -> n/sp-tp c // dp", self.wpe)
        else:  # the rows in the sequence's order (a formula on the parameter itself keeps its gradient duty)
            wpe = es.einshard("n c -> n/sp-tp c", es.einshard("n c -> n c // dp", self.wpe)[positions])
        x = self.embed(tokens) + wpe
        for block in self.blocks:
            x = block(x, mask)
        logits = es.einshard(f"{X}, v/tp c -> b/dp n/sp v/tp", self.ln_f(x), self.wte)  # tied head
        return vocab_parallel_cross_entropy(logits, targets) / (self.cfg.batch * self.cfg.seq)


def vocab_parallel_cross_entropy(logits, targets):
    """Summed cross-entropy of ``b/dp n/sp v/tp`` logits without gathering the vocabulary."""
    rows = logits.shape[-1]
    top = es.spmd.pmax(logits.detach().amax(-1), "tp")  # for a stable log-sum-exp
    lse = es.spmd.psum(torch.exp(logits - top[..., None]).sum(-1), "tp").log() + top
    local = targets - es.spmd.axis_index("tp") * rows
    mine = (local >= 0) & (local < rows)
    picked = logits.gather(-1, local.clamp(0, rows - 1)[..., None])[..., 0] * mine
    return es.spmd.psum((lse - es.spmd.psum(picked, "tp")).sum(), ("dp", "sp"))


def causal_mask(mesh, cfg: Config = CONFIG):
    """This rank's rows (queries) of the additive causal mask: ``q/sp k``."""
    above = torch.ones(cfg.seq, cfg.seq, dtype=torch.bool, device=rank_device()).triu(1)
    whole = torch.zeros(cfg.seq, cfg.seq, dtype=cfg.dtype, device=rank_device()).masked_fill(above, float("-inf"))
    return es.einshard("q k -> q/sp k", whole, mesh=mesh)


# -- data and initial values -----------------------------------------------------------------------


def batch(step: int, cfg: Config = CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole inputs and next-token targets of one step: counting sequences (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, cfg.vocab, (cfg.batch, 1), generator=g)
    stride = torch.randint(1, 4, (cfg.batch, 1), generator=g)
    seq = ((start + stride * torch.arange(cfg.seq + 1)) % cfg.vocab).to(rank_device())
    return seq[:, :-1], seq[:, 1:]


def init_values(cfg: Config = CONFIG, seed: int = 0) -> dict[str, torch.Tensor]:
    """The whole initial parameters, by name (seeded: the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in GPT(cfg).named_parameters()}
    values = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=g, dtype=cfg.dtype)
        if len(shape) == 1:  # norms around 1, biases around 0
            values[name] = noise * 0.1 + (1.0 if name.endswith("weight") else 0.0)
        else:
            values[name] = noise * shape[-1] ** -0.5
    return {name: value.to(rank_device()) for name, value in values.items()}


def grad_duties(cfg: Config = CONFIG) -> dict[str, str]:
    """Outside ``shard_map``: the ranks over which each parameter's gradient must be summed.

    A parameter meets data that varies over every mesh dimension the data is split over and
    the parameter is not: the residual stream ``b/dp n/sp-tp c`` varies over all three, the
    tensor-parallel regions over ``dp`` and ``sp``. ``:async`` sums them in buckets while
    backward runs.
    """
    duties = {"wte": "dp-sp", "wpe": "dp", "ln_f.weight": "dp-sp-tp", "ln_f.bias": "dp-sp-tp"}
    block = {"ln1.weight": "dp-sp-tp", "ln1.bias": "dp-sp-tp", "ln2.weight": "dp-sp-tp", "ln2.bias": "dp-sp-tp",
             "wqkv": "dp-sp", "wo": "dp-sp", "w1": "dp-sp", "b1": "dp-sp", "w2": "dp-sp", "b2": "dp-sp-tp"}
    duties.update({f"blocks.{i}.{k}": v for i in range(cfg.layers) for k, v in block.items()})
    return {name: f"{group}:async" for name, group in duties.items()}


def stored_over_dp(cfg: Config = CONFIG) -> dict[str, str]:
    """``--zero``: the parameters stored sharded over ``dp`` (ZeRO-3), by name: every one whose layout leaves an
    axis unsplit (``b1``, ``f/tp``, has none: its hooks sum it as before)."""
    return {name: "dp" for name, layout in model_layouts(cfg).items() if any("/" not in a for a in layout.split())}


def whole_sizes(cfg: Config = CONFIG) -> dict[str, int]:
    """The whole size of every axis of the layouts (``sizes=``: uneven storage slices need them)."""
    return {"v": cfg.vocab, "c": cfg.width, "n": cfg.seq, "t": 3, "h": cfg.heads, "d": cfg.head_width,
            "f": cfg.hidden}


def empty_model(mesh, cfg: Config, style: str, zero: bool = False) -> GPT:
    """A GPT with this rank's (uninitialised) blocks for ``mesh``, its layouts registered (``zero``: stored
    sharded over ``dp``, see :func:`stored_over_dp`)."""
    with torch.device("meta"):
        model = GPT(cfg)
    layouts = model_layouts(cfg)
    blocks = es.tree_shard({k: torch.empty(p.shape, dtype=p.dtype, device=rank_device()) for k, p in model.named_parameters()},
                           layouts, mesh=mesh)
    for name, block in blocks.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, nn.Parameter(block))
    # shard_map style: shard_map's variance tracking sums the gradients; einshard style: the hooks do
    grad = grad_duties(cfg) if style == "einshard" else None
    if zero:  # the parameters hold their compute blocks now; registering store= keeps a 1/|dp| slice of each
        return es.params.register_module_parameter_layouts_(model, layouts, mesh=mesh, grad=grad, store=stored_over_dp(cfg),
                                                     sizes=whole_sizes(cfg))
    return es.params.register_module_parameter_layouts_(model, layouts, mesh=mesh, grad=grad)


def sharded_model(mesh, values, cfg: Config = CONFIG, style: str = "shard_map", zero: bool = False) -> GPT:
    """A GPT whose parameters are this rank's blocks of the whole ``values``."""
    model = empty_model(mesh, cfg, style, zero)
    with torch.no_grad():
        for name, block in es.tree_shard(values, es.params.param_specs(model), mesh=mesh).items():
            model.get_parameter(name).copy_(block)
    return model


# -- the sharded training step, two ways ----------------------------------------------------------------


def make_step(model: GPT, mesh, style: str = "shard_map", compile: bool = False, precision: str = "fp"):
    """``step(tokens, targets)``: forward and backward on whole batches; returns the loss.

    ``shard_map``: the loss is one ``shard_map`` body; replicated parameters meeting per-rank
    data are marked varying there, so backward sums their gradients. With ``compile=True``
    the body is compiled with ``torch.compile`` (variance decided while tracing; the
    collectives become graph nodes). ``einshard``: the model runs under ``es.use_mesh``;
    every parameter carries its gradient duty (:func:`grad_duties`), the formulas leave those
    gradients partial, and bucketed asynchronous all-reduces started during backward sum them.
    Parameters stored sharded (``--zero``) are gathered before use: by each module's hooks, or on
    entry to the ``shard_map`` body (``es.params.param_specs`` gives their storage specs).
    ``precision="bf16"`` (einshard style): the modules compute in bf16 (``param_dtype``), the stored
    gradients are summed in fp32 (``reduce_dtype``), masters and Adam stay in ``cfg.dtype``.
    """
    mask = causal_mask(mesh, model.cfg)
    # ring attention: the sequence in zigzag order (rank r of sp holds chunks r and 2sp-1-r), so that
    # causal work is the same on every rank; the loss sums over positions, whatever their order
    ring = model.cfg.attention == "ring"
    order = zigzag_indices(model.cfg.seq, mesh.size("sp"), device=rank_device()) if ring else None
    if style == "einshard":
        mp = {}
        if precision == "bf16":
            mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
            mask = mask.to(torch.bfloat16)
        handle = es.params.register_native_grad_reduction_hooks_(model, mesh, **mp)

        def step(tokens, targets):
            tokens, targets = reorder(tokens, targets, order)
            with es.use_mesh(mesh):
                tokens, targets = es.tree_shard((tokens, targets), "b/dp n/sp")  # this rank's part of the batch
                loss = model(tokens, targets, mask, order)
                loss.backward()
            handle.wait()  # the gradient sums still in flight
            return loss.detach()

        return step

    @es.shard_map(
        in_specs=(es.params.param_specs(model), "b n -> b/dp n/sp", "b n -> b/dp n/sp"),  # the batch arrives whole
        out_specs="",
        mesh=mesh,
        check_vma=True,
    )
    def loss_fn(params, tokens, targets):
        return torch.func.functional_call(model, params, (tokens, targets, mask, order), strict=True)

    if compile:  # inductor sums the many per-parameter gradients in a few bucketed all-reduces
        loss_fn = torch.compile(loss_fn, options={"bucket_all_reduces_fx": "all"})

    def step(tokens, targets):
        loss = loss_fn(dict(model.named_parameters()), *reorder(tokens, targets, order))
        loss.backward()  # the gradients land on the parameters' .grad, summed where they are replicated
        return loss.detach()

    return step


def reorder(tokens, targets, order):
    """Whole batches with their sequences in ``order`` (``None``: unchanged)."""
    return (tokens, targets) if order is None else (tokens[:, order], targets[:, order])


def train(mesh, model: GPT, optimizer, steps: range, style: str = "shard_map", precision: str = "fp") -> list[float]:
    step_fn = make_step(model, mesh, style, precision=precision)
    losses = []
    for step in steps:
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_fn(*batch(step, model.cfg)).item())
        optimizer.step()
    return losses


# -- checkpoints: torch.distributed.checkpoint reshards between meshes -----------------------------------


def checkpoint_state(model: GPT, optimizer, mesh) -> dict:
    """The model and Adam's state as DTensors (placements from the registered layouts), for DCP."""
    specs = es.params.param_specs(model)
    moments = {name: {k: optimizer.state[p][k] for k in ("exp_avg", "exp_avg_sq")}
               for name, p in model.named_parameters()}
    step = next(iter(optimizer.state.values()))["step"]
    return {"model": es.params.to_dtensor(model, mesh=mesh), "adam": es.params.to_dtensor(moments, specs, mesh=mesh),
            "step": step.clone()}


def load_checkpoint(path: str, mesh, cfg: Config, style: str, zero: bool = False):
    """A model and an Adam optimizer on ``mesh`` with the state saved at ``path`` (from any mesh, stored
    sharded over ``dp`` or not)."""
    model = empty_model(mesh, cfg, style, zero)
    zeros = {name: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
             for name, p in model.named_parameters()}
    specs = es.params.param_specs(model)
    state = {"model": es.params.to_dtensor(model, mesh=mesh), "adam": es.params.to_dtensor(zeros, specs, mesh=mesh),
             "step": torch.zeros(())}
    dcp.load(state, checkpoint_id=path)  # every rank reads the parts its new blocks cover
    es.params.load_from_dtensor_(model, state["model"], mesh=mesh)
    moments = es.params.from_dtensor(state["adam"], specs, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for name, p in model.named_parameters():
        optimizer.state[p] = {"step": state["step"].clone(), **moments[name]}
    return model, optimizer


# -- the same model in one process ---------------------------------------------------------------------


def reference_loss(p, tokens, targets, cfg: Config = CONFIG, precision: str = "fp"):
    """The same model on whole tensors with plain torch (``bf16``: the same mixed-precision recipe)."""
    if precision == "bf16":
        p = {k: v.to(torch.bfloat16) for k, v in p.items()}
    causal = torch.ones(cfg.seq, cfg.seq, dtype=torch.bool, device=tokens.device).triu(1)
    x = p["wte"][tokens] + p["wpe"]
    for i in range(cfg.layers):
        b = {k: p[f"blocks.{i}.{k}"] for k in BLOCK_LAYOUTS}
        a = F.layer_norm(x, (cfg.width,), b["ln1.weight"], b["ln1.bias"])
        q, k, v = torch.einsum("bnc,thdc->tbhnd", a, b["wqkv"]).unbind(0)
        s = (torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(cfg.head_width)).masked_fill(causal, float("-inf"))
        x = x + torch.einsum("bhnd,chd->bnc", torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v), b["wo"])
        a = F.layer_norm(x, (cfg.width,), b["ln2.weight"], b["ln2.bias"])
        u = F.gelu(torch.einsum("bnc,fc->bnf", a, b["w1"]) + b["b1"])
        x = x + torch.einsum("bnf,cf->bnc", u, b["w2"]) + b["b2"]
    logits = F.layer_norm(x, (cfg.width,), p["ln_f.weight"], p["ln_f.bias"]) @ p["wte"].T
    return F.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1))


def reference_training(steps: int, cfg: Config = CONFIG, precision: str = "fp") -> list[float]:
    params = {k: v.clone().requires_grad_() for k, v in init_values(cfg).items()}
    optimizer = torch.optim.Adam(params.values(), lr=LR)
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = reference_loss(params, *batch(step, cfg), cfg, precision)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


# -- driver -------------------------------------------------------------------------------------------


def make_mesh(dims=MESH):
    names, shape = zip(*dims)
    return es.wrap_mesh(device_mesh(shape, names))


def on_rank(steps: int, style: str, path: str, attention: str = "gather", zero: bool = False,
            precision: str = "fp") -> list[str]:
    """What every rank runs: train half the steps on the 2x2x2 mesh, save, resume on 4x1x2, compare."""
    torch.set_num_threads(1)
    cfg = replace(CONFIG, attention=attention)
    half = steps // 2
    mesh = make_mesh()
    model = sharded_model(mesh, init_values(cfg), cfg, style, zero)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    start = time.perf_counter()
    losses = train(mesh, model, optimizer, range(half), style, precision)
    dcp.save(checkpoint_state(model, optimizer, mesh), checkpoint_id=path)
    other = make_mesh(RESUME_MESH)
    model, optimizer = load_checkpoint(path, other, cfg, style, zero)
    resumed = train(other, model, optimizer, range(half, steps), style, precision)
    elapsed = time.perf_counter() - start
    ref = reference_training(steps, cfg, precision)
    extra = (", parameters, gradients and Adam states stored sharded over dp (ZeRO-3)" if zero else "") + (
        ", computed in bf16 (reductions of stored gradients in fp32)" if precision == "bf16" else "")
    lines = [f"GPT ({cfg.layers} layers, width {cfg.width}, {cfg.heads} heads, vocabulary {cfg.vocab}), "
             f"{steps} Adam steps, {cfg.dtype}, {style} style, {attention} attention{extra}: "
             f"steps 0-{half - 1} on mesh {dict(MESH)}, "
             f"checkpointed with torch.distributed.checkpoint, steps {half}-{steps - 1} on mesh {dict(RESUME_MESH)}"]
    for i, (a, b) in enumerate(zip(losses + resumed, ref)):
        lines.append(f"step {i}: loss {a:.10f}   single process {b:.10f}" + ("   (resumed)" if i >= half else ""))
    lines.append(f"sharded training took {elapsed:.2f} s")
    before = max(abs(a - b) for a, b in zip(losses, ref))
    after = max(abs(a - b) for a, b in zip(resumed, ref[half:]))
    lines.append(f"max loss difference from single-process training: {before:.3e}")
    lines.append(f"max loss difference after resuming on another mesh: {after:.3e}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--style", choices=("shard_map", "einshard"), default="shard_map",
                        help="the training step as one shard_map body, or plain formulas with gradient hooks")
    parser.add_argument("--checkpoint-dir", default=os.path.join(tempfile.gettempdir(), "einshard_gpt_checkpoint"),
                        help="where the half-way checkpoint goes (shared by all ranks)")
    parser.add_argument("--attention", choices=("gather", "ring", "ulysses"), default="gather",
                        help="context parallelism: gather keys and values over sp, pass them around the sp ring, "
                             "or swap the sequence split for a head split (all-to-all)")
    parser.add_argument("--zero", action="store_true",
                        help="store parameters, gradients and Adam states sharded over dp (ZeRO-3)")
    parser.add_argument("--precision", choices=("fp", "bf16"), default="fp",
                        help="bf16: compute in bf16, stored gradients summed in fp32 (einshard style)")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    if args.precision == "bf16" and args.style != "einshard":
        parser.error("--precision bf16 needs --style einshard (the hooks cast the parameters)")
    path = os.path.join(args.checkpoint_dir, args.style + ("" if args.attention == "gather" else f"-{args.attention}")
                        + ("-zero" if args.zero else "") + ("" if args.precision == "fp" else f"-{args.precision}"))
    # under torchrun/srun this process is one rank (on a GPU with --device cuda); otherwise 8 gloo ranks start here
    results = launch(on_rank, 8, args=(args.steps, args.style, path, args.attention, args.zero, args.precision),
                     timeout=600, device=args.device)
    if results is not None:
        print("\n".join(results[0]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
