"""Train an ``nn.Module`` whose parameters carry their layouts, outside ``shard_map``.

A pre-norm transformer block (causal multi-head attention, an MLP, layer
norms) is an ordinary ``nn.Module`` holding this rank's blocks of its
parameters: the attention heads and the MLP hidden units are split over
``tp`` (column-parallel in, row-parallel out; 30 hidden units over 4 ranks is
uneven), everything is replicated over ``dp``, which splits the batch. Each
parameter's layout is registered on it, with the gradient duty
``grad=dp:async``:

- ``es.params.init_params_`` makes the replicated copies equal (broadcasts over the
  groups each parameter is replicated on), although every rank starts from
  its own random seed;
- the forward pass is plain ``es.einshard`` formulas and torch ops; since the
  parameters have a gradient duty over ``dp``, the formulas leave their
  gradients partial over ``dp`` (no all-reduce per formula);
- ``es.params.register_native_grad_reduction_hooks_`` sums them over ``dp``,
  bucketed, starting each bucket's all-reduce during backward as soon as its
  gradients are accumulated; ``handle.wait()`` before the optimizer step.

The same training runs in one process on whole tensors (initialised with the
gathered initial parameters); the last line is the largest difference (float64).

Run it from the repository root::

    python examples/train_module.py                          # starts 8 gloo ranks itself
    torchrun --nproc-per-node 8 examples/train_module.py     # or under torchrun (GPUs if it has 8, else CPUs)
    torchrun --nproc-per-node 8 examples/train_module.py --device cuda   # one GPU per rank over NCCL
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import einshard as es
from einshard.comm.helpers import compute_split_shapes
from einshard.testing import device_mesh, launch, parse_device, rank_device

B, N, C = 8, 6, 12  # batch, sequence length, model width
H, D, FF = 4, 3, 30  # heads, head width, MLP hidden units (30 over 4 ranks: uneven)
STEPS, LR = 6, 0.3
DTYPE = torch.float64

LAYOUTS = {
    "ln1.weight": "c", "ln1.bias": "c",
    "wq": "h/tp d c", "wk": "h/tp d c", "wv": "h/tp d c",  # column-parallel: heads over tp
    "wo": "c h/tp d",  # row-parallel: the heads are summed over tp
    "ln2.weight": "c", "ln2.bias": "c",
    "w1": "f/tp c", "b1": "f/tp",  # column-parallel
    "w2": "c f/tp", "b2": "c",  # row-parallel
}


def causal(like):
    """The causal mask (``q k``: true above the diagonal) on ``like``'s device."""
    return torch.ones(N, N, dtype=torch.bool, device=like.device).triu(1)


class Block(torch.nn.Module):
    """A transformer block holding this rank's blocks (``heads`` and ``hidden`` local sizes)."""

    def __init__(self, heads: int = H, hidden: int = FF):
        super().__init__()

        def param(*shape, scale):
            return torch.nn.Parameter(torch.randn(*shape, dtype=DTYPE) * scale)

        self.ln1 = torch.nn.LayerNorm(C, dtype=DTYPE)
        self.ln2 = torch.nn.LayerNorm(C, dtype=DTYPE)
        with torch.no_grad():
            for ln in (self.ln1, self.ln2):
                ln.weight.add_(torch.randn(C, dtype=DTYPE) * 0.1)
                ln.bias.add_(torch.randn(C, dtype=DTYPE) * 0.1)
        self.wq, self.wk, self.wv = (param(heads, D, C, scale=C**-0.5) for _ in range(3))
        self.wo = param(C, heads, D, scale=(H * D) ** -0.5)
        self.w1, self.b1 = param(hidden, C, scale=C**-0.5), param(hidden, scale=0.1)
        self.w2, self.b2 = param(C, hidden, scale=FF**-0.5), param(C, scale=0.1)

    def forward(self, x):
        """``x``: this rank's rows of the batch, ``b/dp n c`` (replicated over tp)."""
        a = self.ln1(x)
        q = es.einshard("b/dp n c, h/tp d c -> b/dp h/tp n d", a, self.wq)
        k = es.einshard("b/dp n c, h/tp d c -> b/dp h/tp n d", a, self.wk)
        v = es.einshard("b/dp n c, h/tp d c -> b/dp h/tp n d", a, self.wv)
        s = es.einshard("b/dp h/tp q d, b/dp h/tp k d -> b/dp h/tp q k", q, k) / math.sqrt(D)
        o = es.einshard("b/dp h/tp q k, b/dp h/tp k d -> b/dp h/tp q d", s.masked_fill(causal(s), -math.inf).softmax(-1), v)
        x = x + es.einshard("b/dp h/tp n d, c h/tp d -> b/dp n c", o, self.wo)
        f = {"f": FF}  # the whole size: the hidden units are split unevenly (8, 8, 8, 6)
        u = F.gelu(es.einshard("b/dp n c, f/tp c -> b/dp n f/tp", self.ln2(x), self.w1, sizes=f) + self.b1)
        return x + es.einshard("b/dp n f/tp, c f/tp -> b/dp n c", u, self.w2, sizes=f) + self.b2


TEACHER = torch.randn(C, C, generator=torch.Generator().manual_seed(7), dtype=DTYPE) / math.sqrt(C)


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(B, N, C, generator=g, dtype=DTYPE)
    return x.to(rank_device()), torch.tanh(x @ TEACHER).to(rank_device())


def reference_forward(p, x):
    """The same block on whole tensors (``p``: gathered parameters)."""
    a = F.layer_norm(x, (C,), p["ln1.weight"], p["ln1.bias"])
    q, k, v = (torch.einsum("bnc,hdc->bhnd", a, p[w]) for w in ("wq", "wk", "wv"))
    s = (torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(D)).masked_fill(causal(x), -math.inf).softmax(-1)
    x = x + torch.einsum("bhnd,chd->bnc", torch.einsum("bhqk,bhkd->bhqd", s, v), p["wo"])
    u = F.gelu(torch.einsum("bnc,fc->bnf", F.layer_norm(x, (C,), p["ln2.weight"], p["ln2.bias"]), p["w1"]) + p["b1"])
    return x + torch.einsum("bnf,cf->bnc", u, p["w2"]) + p["b2"]


def reference_training(initial):
    params = {k: v.clone().requires_grad_() for k, v in initial.items()}
    opt = torch.optim.SGD(params.values(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, target = batch(step)
        loss = ((reference_forward(params, x) - target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {k: v.detach() for k, v in params.items()}, losses


def run(device_mesh) -> list[str]:
    torch.set_num_threads(1)
    mesh = es.wrap_mesh(device_mesh)
    tp, tp_rank = mesh.size("tp"), mesh.index("tp")
    torch.manual_seed(dist.get_rank())  # every rank its own random initial values
    model = Block(compute_split_shapes(H, tp)[tp_rank], compute_split_shapes(FF, tp)[tp_rank]).to(rank_device())
    es.params.register_module_parameter_layouts_(model, LAYOUTS, mesh=mesh, grad="dp:async")
    es.params.init_params_(model, mesh)  # the replicated copies made equal (broadcasts)
    initial = es.tree_gather(model, mesh=mesh)  # whole initial parameters, for the reference
    handle = es.params.register_native_grad_reduction_hooks_(model, mesh)  # bucketed, started during backward
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    dp_group = mesh.group("dp")
    losses = []
    with es.use_mesh(mesh):  # the formulas' mesh
        for step in range(STEPS):
            x, target = es.tree_shard(batch(step), "b/dp n c")  # this rank's rows
            loss = ((model(x) - target) ** 2).sum() / (B * N * C)  # this rank's share of the mean
            loss.backward()
            handle.wait()  # gradients summed over dp
            opt.step()
            opt.zero_grad(set_to_none=True)
            total = loss.detach().clone()
            dist.all_reduce(total, group=dp_group)
            losses.append(total.item())
    handle.remove()
    trained = es.tree_gather(model, mesh=mesh)
    ref_params, ref_losses = reference_training(initial)
    lines = [f"mesh {dict(zip(mesh.names, mesh.shape))}, {STEPS} SGD steps of an nn.Module transformer block, float64"]
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        lines.append(f"step {step}: loss {a:.10f}   single process {b:.10f}")
    diff = max(max((trained[k] - ref_params[k]).abs().max().item() for k in ref_params),
               max(abs(a - b) for a, b in zip(losses, ref_losses)))
    lines.append(f"max difference from single-process training: {diff:.3e}")
    return lines


def on_rank() -> list[str]:
    return run(device_mesh((2, 4), ("dp", "tp")))


def main(argv=None) -> int:
    # under torchrun/srun this process is one rank (on a GPU with --device cuda); otherwise 8 gloo ranks start here
    results = launch(on_rank, 8, timeout=240, device=parse_device(argv, __doc__.splitlines()[0]))
    if results is not None:
        print("\n".join(results[0]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
