"""Train a small transformer block with data x tensor parallelism, written with ``es.shard_map``.

The main example. A pre-norm transformer block (causal multi-head attention
and an MLP) is trained with SGD on a 2 x 4 mesh of 8 CPU ranks: ``dp`` (2)
splits the batch, ``tp`` (4) splits the attention heads and the MLP's hidden
units. The whole training step is one ``shard_map``-decorated function over
a dict of parameters: forward, ``torch.autograd.grad``, SGD update. There is
no hand-written all-reduce anywhere: the replicated parameters (layer norms,
output bias) meet per-rank data in plain torch ops, and ``check_vma=True``
marks them varying there (``pvary``), so their gradients are summed over the
ranks automatically; ``es.einshard`` inserts the tensor-parallel collectives.

The same training is done in one process on whole tensors, and the script
prints the loss of every step and the largest difference between the two
(parameters after training and losses), which is at rounding level
(float64).

Run it from the repository root::

    python examples/train.py                              # starts 8 gloo ranks itself
    torchrun --nproc-per-node 8 examples/train.py         # or under torchrun (GPUs if it has 8, else CPUs)
    torchrun --nproc-per-node 8 examples/train.py --device cuda   # one GPU per rank over NCCL
"""

from __future__ import annotations

import math
import sys
import time

import torch
import torch.nn.functional as F

import einshard as es
from einshard.testing import device_mesh, launch, parse_device, rank_device

B, N, C = 8, 6, 16  # batch, sequence length, model width
H, D, FF = 4, 4, 32  # heads, head width, MLP hidden units
STEPS, LR = 8, 0.5
DTYPE = torch.float64

# Where each parameter lives: heads and hidden units split over tp, the rest replicated.
PARAM_SPECS = {
    "ln1_w": "c",
    "ln1_b": "c",
    "wq": "h/tp d c",
    "wk": "h/tp d c",
    "wv": "h/tp d c",
    "wo": "c h/tp d",
    "ln2_w": "c",
    "ln2_b": "c",
    "w1": "f/tp c",
    "b1": "f/tp",
    "w2": "c f/tp",
    "b2": "c",
}


def init_params(seed: int = 0) -> dict[str, torch.Tensor]:
    """The whole parameters (the same on every rank: seeded)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale):
        return torch.randn(*shape, generator=g, dtype=DTYPE) * scale

    return {k: v.to(rank_device()) for k, v in {
        "ln1_w": 1 + rand(C, scale=0.1),
        "ln1_b": rand(C, scale=0.1),
        "wq": rand(H, D, C, scale=C**-0.5),
        "wk": rand(H, D, C, scale=C**-0.5),
        "wv": rand(H, D, C, scale=C**-0.5),
        "wo": rand(C, H, D, scale=(H * D) ** -0.5),
        "ln2_w": 1 + rand(C, scale=0.1),
        "ln2_b": rand(C, scale=0.1),
        "w1": rand(FF, C, scale=C**-0.5),
        "b1": rand(FF, scale=0.1),
        "w2": rand(C, FF, scale=FF**-0.5),
        "b2": rand(C, scale=0.1),
    }.items()}


TEACHER = torch.randn(C, C, generator=torch.Generator().manual_seed(7), dtype=DTYPE) / math.sqrt(C)


def batch(step: int):
    """Inputs and regression targets of one step (whole tensors, the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(B, N, C, generator=g, dtype=DTYPE)
    return x.to(rank_device()), torch.tanh(x @ TEACHER).to(rank_device())  # a fixed target function


def causal(like):
    """The causal mask (``q k``: true above the diagonal) on ``like``'s device."""
    return torch.ones(N, N, dtype=torch.bool, device=like.device).triu(1)


# -- the sharded training step --------------------------------------------------------------


def block(p, x):
    """The transformer block on this rank's blocks (x: 'b/dp n c', heads and hidden units over tp)."""
    a = F.layer_norm(x, (C,), p["ln1_w"], p["ln1_b"])  # plain torch: replicated params meet per-rank data
    q = es.einshard("b/dp n c, h/tp d c -> b/dp h/tp n d", a, p["wq"])
    k = es.einshard("b/dp n c, h/tp d c -> b/dp h/tp n d", a, p["wk"])
    v = es.einshard("b/dp n c, h/tp d c -> b/dp h/tp n d", a, p["wv"])
    s = es.einshard("b/dp h/tp q d, b/dp h/tp k d -> b/dp h/tp q k", q, k) / math.sqrt(D)
    s = s.masked_fill(causal(s), float("-inf")).softmax(-1)
    o = es.einshard("b/dp h/tp q k, b/dp h/tp k d -> b/dp h/tp q d", s, v)
    x = x + es.einshard("b/dp h/tp n d, c h/tp d -> b/dp n c", o, p["wo"])  # sums the heads over tp
    a = F.layer_norm(x, (C,), p["ln2_w"], p["ln2_b"])
    u = F.gelu(es.einshard("b/dp n c, f/tp c -> b/dp n f/tp", a, p["w1"]) + p["b1"])
    return x + es.einshard("b/dp n f/tp, c f/tp -> b/dp n c", u, p["w2"]) + p["b2"]


@es.shard_map(
    in_specs=(PARAM_SPECS, "b n c -> b/dp n c", "b n c -> b/dp n c"),  # the batch arrives whole: split it
    out_specs=(PARAM_SPECS, "// dp -> "),  # new parameters; the loss summed over dp on exit
    check_vma=True,
)
def train_step(params, x, target):
    y = block(params, x)
    loss = es.einshard("b/dp n c -> // dp", (y - target) ** 2) / (B * N * C)  # this rank's share of the mean
    names = list(params)
    grads = torch.autograd.grad(loss, [params[k] for k in names])
    with torch.no_grad():
        new = {k: (params[k] - LR * g).requires_grad_() for k, g in zip(names, grads)}
    return new, loss.detach()


# -- the same training in one process --------------------------------------------------------


def reference_block(p, x):
    a = F.layer_norm(x, (C,), p["ln1_w"], p["ln1_b"])
    q = torch.einsum("bnc,hdc->bhnd", a, p["wq"])
    k = torch.einsum("bnc,hdc->bhnd", a, p["wk"])
    v = torch.einsum("bnc,hdc->bhnd", a, p["wv"])
    s = (torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(D)).masked_fill(causal(x), float("-inf")).softmax(-1)
    x = x + torch.einsum("bhnd,chd->bnc", torch.einsum("bhqk,bhkd->bhqd", s, v), p["wo"])
    a = F.layer_norm(x, (C,), p["ln2_w"], p["ln2_b"])
    u = F.gelu(torch.einsum("bnc,fc->bnf", a, p["w1"]) + p["b1"])
    return x + torch.einsum("bnf,cf->bnc", u, p["w2"]) + p["b2"]


def reference_training():
    params = {k: v.clone().requires_grad_() for k, v in init_params().items()}
    losses = []
    for step in range(STEPS):
        x, target = batch(step)
        loss = ((reference_block(params, x) - target) ** 2).mean()
        grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            params = {k: (p - LR * g).requires_grad_() for (k, p), g in zip(params.items(), grads)}
        losses.append(loss.item())
    return {k: v.detach() for k, v in params.items()}, losses


# -- driver -----------------------------------------------------------------------------------


def run(device_mesh) -> list[str]:
    """Train on every rank; returns the report lines (the same on every rank)."""
    torch.set_num_threads(1)
    mesh = es.wrap_mesh(device_mesh)
    start = time.perf_counter()
    with es.use_mesh(mesh):
        params = es.tree_shard(init_params(), PARAM_SPECS)  # this rank's blocks of the initial parameters
        params = {k: v.requires_grad_() for k, v in params.items()}
        losses = []
        for step in range(STEPS):
            x, target = batch(step)
            params, loss = train_step(params, x, target)
            losses.append(loss.item())
        trained = es.tree_gather(params, PARAM_SPECS)  # whole parameters again, on every rank
    elapsed = time.perf_counter() - start
    ref_params, ref_losses = reference_training()
    lines = [f"mesh {dict(zip(mesh.names, mesh.shape))}, {STEPS} SGD steps of a transformer block, float64"]
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        lines.append(f"step {step}: loss {a:.10f}   single process {b:.10f}")
    diff_params = max((trained[k] - ref_params[k]).abs().max().item() for k in ref_params)
    diff_losses = max(abs(a - b) for a, b in zip(losses, ref_losses))
    lines.append(f"sharded training took {elapsed:.2f} s")
    lines.append(f"max difference from single-process training: {max(diff_params, diff_losses):.3e}")
    return lines


def on_rank() -> list[str]:
    """What every rank runs: build the 2 x 4 mesh, train, compare."""
    return run(device_mesh((2, 4), ("dp", "tp")))


def main(argv=None) -> int:
    # under torchrun/srun this process is one rank (on a GPU with --device cuda); otherwise 8 gloo ranks start here
    results = launch(on_rank, 8, timeout=240, device=parse_device(argv, __doc__.splitlines()[0]))
    if results is not None:
        print("\n".join(results[0]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
