"""Train a small GPT with data x sequence x tensor parallelism (dp x sp x tp) on 8 CPU ranks.

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
  ``sp`` and gathers keys and values over ``sp`` (context parallelism).

Every collective comes from a formula; there is no hand-written all-reduce. The whole
training step (forward, ``loss.backward()``) is one ``es.shard_map`` body with
``check_vma=True``, so the replicated parameters (norms, biases, position embeddings)
receive gradients summed over every rank they meet; the optimizer (Adam) then updates
every rank's blocks. The same model is trained in one process on whole tensors
(float64) and the losses are compared step by step.

Run it from the repository root::

    python examples/gpt.py                               # starts 8 gloo ranks itself
    torchrun --nproc-per-node 8 examples/gpt.py          # or under torchrun
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import einshard as es
from einshard.testing import launch

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


CONFIG = Config()
STEPS, LR = 10, 3e-2
MESH = (("dp", 2), ("sp", 2), ("tp", 2))

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
        self.ln1, self.ln2 = nn.LayerNorm(C, dtype=cfg.dtype), nn.LayerNorm(C, dtype=cfg.dtype)
        self.wqkv, self.wo = param(3, H, D, C), param(C, H, D)
        self.w1, self.b1, self.w2, self.b2 = param(FF, C), param(FF), param(C, FF), param(C)

    def forward(self, x, mask):
        # sequence parallelism + column-parallel in one formula: the sequence is all-gathered over tp
        # in forward, and the input's gradient reduce-scattered back over tp in backward
        q, k, v = es.einshard(f"{X}, t h/tp d c -> t b/dp h/tp n/sp d", self.ln1(x), self.wqkv).unbind(0)
        # queries stay split over sp; the formula gathers the keys (and below the values) over sp
        s = es.einshard("b/dp h/tp q/sp d, b/dp h/tp k/sp d -> b/dp h/tp q/sp k", q, k) * self.scale
        p = (s + mask).softmax(-1)
        o = es.einshard("b/dp h/tp q/sp k, b/dp h/tp k/sp d -> b/dp h/tp q/sp d", p, v)
        x = x + es.einshard(f"b/dp h/tp n/sp d, c h/tp d -> {X}", o, self.wo)  # row-parallel: reduce-scatter
        u = F.gelu(es.einshard(f"{X}, f/tp c -> b/dp n/sp f/tp", self.ln2(x), self.w1) + self.b1)
        return x + es.einshard(f"b/dp n/sp f/tp, c f/tp -> {X}", u, self.w2) + self.b2


class GPT(nn.Module):
    """The language model; ``model(tokens, targets, mask)`` is the mean next-token loss."""

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
        local = tokens - es.axis_index("tp") * rows
        mine = (local >= 0) & (local < rows)
        e = F.embedding(local.clamp(0, rows - 1), self.wte) * mine[..., None]  # this rank's share
        return es.einshard(f"b/dp n/sp c // tp -> {X}", e)  # summed over tp, sequence split over tp

    def forward(self, tokens, targets, mask):
        """The mean next-token cross-entropy; ``tokens``/``targets`` are ``b/dp n/sp``."""
        x = self.embed(tokens) + es.einshard(f"n c -> n/sp-tp c", self.wpe)
        for block in self.blocks:
            x = block(x, mask)
        logits = es.einshard(f"{X}, v/tp c -> b/dp n/sp v/tp", self.ln_f(x), self.wte)  # tied head
        return vocab_parallel_cross_entropy(logits, targets) / (self.cfg.batch * self.cfg.seq)


def vocab_parallel_cross_entropy(logits, targets):
    """Summed cross-entropy of ``b/dp n/sp v/tp`` logits without gathering the vocabulary."""
    rows = logits.shape[-1]
    top = es.pmax(logits.detach().amax(-1), "tp")  # for a stable log-sum-exp
    lse = es.psum(torch.exp(logits - top[..., None]).sum(-1), "tp").log() + top
    local = targets - es.axis_index("tp") * rows
    mine = (local >= 0) & (local < rows)
    picked = logits.gather(-1, local.clamp(0, rows - 1)[..., None])[..., 0] * mine
    return es.psum((lse - es.psum(picked, "tp")).sum(), ("dp", "sp"))


def causal_mask(mesh, cfg: Config = CONFIG):
    """This rank's rows (queries) of the additive causal mask: ``q/sp k``."""
    above = torch.ones(cfg.seq, cfg.seq, dtype=torch.bool).triu(1)
    whole = torch.zeros(cfg.seq, cfg.seq, dtype=cfg.dtype).masked_fill(above, float("-inf"))
    return es.einshard("q k -> q/sp k", whole, mesh=mesh)


# -- data and initial values -----------------------------------------------------------------------


def batch(step: int, cfg: Config = CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole inputs and next-token targets of one step: counting sequences (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, cfg.vocab, (cfg.batch, 1), generator=g)
    stride = torch.randint(1, 4, (cfg.batch, 1), generator=g)
    seq = (start + stride * torch.arange(cfg.seq + 1)) % cfg.vocab
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
    return values


def sharded_model(mesh, values, cfg: Config = CONFIG) -> GPT:
    """A GPT whose parameters are this rank's blocks of the whole ``values``."""
    with torch.device("meta"):
        model = GPT(cfg)
    for name, block in es.tree_shard(values, model_layouts(cfg), mesh=mesh).items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, nn.Parameter(block))
    return model


# -- the sharded training step ------------------------------------------------------------------------


def make_step(model: GPT, mesh):
    """One training step (forward and backward) as a ``shard_map`` body over this rank's blocks."""
    mask = causal_mask(mesh, model.cfg)

    @es.shard_map(
        in_specs=(model_layouts(model.cfg), "b n -> b/dp n/sp", "b n -> b/dp n/sp"),  # the batch arrives whole
        out_specs="",
        mesh=mesh,
        check_vma=True,
    )
    def step(params, tokens, targets):
        loss = torch.func.functional_call(model, params, (tokens, targets, mask), strict=True)
        loss.backward()  # the gradients land on the parameters' .grad, summed where they are replicated
        return loss.detach()

    return lambda tokens, targets: step(dict(model.named_parameters()), tokens, targets)


def train(mesh, model: GPT, steps: int) -> list[float]:
    step_fn = make_step(model, mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_fn(*batch(step, model.cfg)).item())
        optimizer.step()
    return losses


# -- the same model in one process ---------------------------------------------------------------------


def reference_loss(p, tokens, targets, cfg: Config = CONFIG):
    """The same model on whole tensors with plain torch."""
    causal = torch.ones(cfg.seq, cfg.seq, dtype=torch.bool).triu(1)
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


def reference_training(steps: int, cfg: Config = CONFIG) -> list[float]:
    params = {k: v.clone().requires_grad_() for k, v in init_values(cfg).items()}
    optimizer = torch.optim.Adam(params.values(), lr=LR)
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = reference_loss(params, *batch(step, cfg), cfg)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


# -- driver -------------------------------------------------------------------------------------------


def make_mesh(dims=MESH):
    names, shape = zip(*dims)
    return es.wrap_mesh(init_device_mesh("cpu", shape, mesh_dim_names=names))


def on_rank(steps: int) -> list[str]:
    """What every rank runs: train on the dp x sp x tp mesh, compare with one process."""
    torch.set_num_threads(1)
    cfg = CONFIG
    mesh = make_mesh()
    model = sharded_model(mesh, init_values(cfg), cfg)
    start = time.perf_counter()
    with es.use_mesh(mesh):
        losses = train(mesh, model, steps)
    elapsed = time.perf_counter() - start
    ref = reference_training(steps, cfg)
    lines = [f"GPT ({cfg.layers} layers, width {cfg.width}, {cfg.heads} heads, vocabulary {cfg.vocab}) "
             f"on mesh {dict(MESH)}, {steps} Adam steps, {cfg.dtype}"]
    lines += [f"step {i}: loss {a:.10f}   single process {b:.10f}" for i, (a, b) in enumerate(zip(losses, ref))]
    lines.append(f"sharded training took {elapsed:.2f} s")
    diff = max(abs(a - b) for a, b in zip(losses, ref))
    lines.append(f"max loss difference from single-process training: {diff:.3e}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args(argv)
    # under torchrun/srun this process is one rank; otherwise 8 gloo ranks are started here
    results = launch(on_rank, 8, args=(args.steps,), timeout=600)
    if results is not None:
        print("\n".join(results[0]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
