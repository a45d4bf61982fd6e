"""The differential harness: a multi-rank scenario written once, run eagerly and compiled.

A :class:`Scenario` is a per-rank program (formulas, named collectives in
``shard_map`` bodies, grid ops, parameters with gradient duties) and the same
program on whole tensors. :func:`check` runs it on the ranks of a mesh:

1. make the whole inputs (seeded, float64) and cut the block each rank holds
   (``einshard.testing.local_block``; a partial input gets an equal share);
2. run the program eagerly, or compiled with ``torch.compile`` (``aot_eager``
   or ``inductor``; ``fullgraph=True`` unless the scenario has a graph
   break on purpose);
3. back-propagate a seeded cotangent, cut like the output;
4. compare the output (summed over the ranks it is partial over) and every
   input's gradient with the whole-tensor program's, cut the same way.

Each scenario runs with even and uneven blocks (``Scenario.sizes``: one size
per axis for each variant; odd sizes split unevenly, and the split shapes are
passed to the program as ``shapes``). ``tests/test_differential.py`` runs the
table; a scenario is added here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import einshard as es
from einshard._split import compute_split_shapes
from einshard.checks import checks_enabled
from einshard.testing import local_block, make_mesh

DT = torch.float64
MODES = ("eager", "aot_eager", "inductor")


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One program, per rank and whole.

    ``inputs``: name -> spec of the block each rank holds (axes named by
    single letters of ``sizes``); ``outputs``: the spec of each output.
    ``program(mesh, shapes)`` returns the per-rank function (called with the
    blocks as keywords, returning the output blocks: a tensor or a tuple);
    ``reference(**whole)`` returns the whole outputs. ``grads``: the
    inputs that get gradients (default all floating ones). ``modes``: the
    modes it runs in; ``fullgraph``: compiled without graph breaks.
    """

    name: str
    mesh: tuple  # (shape, names)
    sizes: dict  # variant -> {axis letter: size}
    inputs: dict
    outputs: tuple
    program: Callable
    reference: Callable
    grads: tuple | None = None
    modes: tuple = MODES
    fullgraph: bool = True
    complex_inputs: tuple = ()

    @property
    def ranks(self) -> int:
        return math.prod(self.mesh[0])


SCENARIOS: dict[str, Scenario] = {}


def scenario(name, mesh, inputs, outputs, reference, sizes, **kw):
    """Register the decorated per-rank program as scenario ``name``."""

    def register(program):
        outs = (outputs,) if isinstance(outputs, str) else tuple(outputs)
        SCENARIOS[name] = Scenario(name, mesh, sizes, inputs, outs, program, reference, **kw)
        return program

    return register


# -- running one -------------------------------------------------------------------------------


def _randn(shape, seed, dtype=DT):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        return torch.complex(torch.randn(shape, generator=g, dtype=DT), torch.randn(shape, generator=g, dtype=DT))
    return torch.randn(shape, generator=g, dtype=dtype)


def _spec(spec: str):
    return es.parse_sharding(spec).inputs[0]


def _axes(spec: str) -> list[str]:
    return [a.name for a in _spec(spec).axes]


def _shape(spec: str, sizes: dict) -> tuple:
    return tuple(sizes[a] for a in _axes(spec))


def _split_shapes(mesh, sizes: dict) -> dict:
    """The default split of every axis over every (compound) mesh dimension: ``shapes=`` for uneven blocks."""
    labels = list(mesh.names)
    for k in range(2, len(labels) + 1):
        labels.append("-".join(labels[:k]))
    return {label: {a: compute_split_shapes(n, mesh.size(label)) for a, n in sizes.items()} for label in labels}


def _partial_dims(spec: str) -> tuple:
    return tuple(d for p in _spec(spec).partial for d in p.split("-"))


def _block(whole, spec, mesh, shapes):
    block = local_block(whole, spec, mesh, shapes=shapes)
    partial = _partial_dims(spec)
    if partial:  # a share: every rank holds whole / n, which sums to the whole
        block = block / mesh.size(partial)
    return block


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def check(name: str, variant: str, mode: str) -> None:
    """Run scenario ``name`` (``variant`` of its sizes) in ``mode`` on this rank and compare (see the module)."""
    checks = checks_enabled()
    if mode != "eager":
        es.set_checks(False)  # cross-rank checks under compile: see test_compile_fullgraph
    try:
        _check(SCENARIOS[name], variant, mode)
    finally:
        es.set_checks(checks)


def _check(sc: Scenario, variant: str, mode: str) -> None:
    name = sc.name
    mesh = es.wrap_mesh(make_mesh(*sc.mesh))
    sizes = sc.sizes[variant]
    shapes = _split_shapes(mesh, sizes)
    grads = sc.grads if sc.grads is not None else tuple(sc.inputs)
    whole, blocks = {}, {}
    for i, (k, spec) in enumerate(sc.inputs.items()):
        dtype = torch.complex128 if k in sc.complex_inputs else DT
        whole[k] = _randn(_shape(spec, sizes), 10 + i, dtype)
        blocks[k] = _block(whole[k], spec, mesh, shapes).clone().requires_grad_(k in grads)
        whole[k].requires_grad_(k in grads)
    want = _as_tuple(sc.reference(**whole))
    cots = [_randn(w.shape, 100 + j, w.dtype) for j, w in enumerate(want)]
    if grads:
        torch.autograd.backward(want, cots)

    program = sc.program(mesh, shapes)
    if mode != "eager":
        torch._dynamo.reset()
        program = torch.compile(program, backend=mode, fullgraph=sc.fullgraph)
    got = _as_tuple(program(**blocks))
    assert len(got) == len(want), f"{name}: {len(got)} outputs, the reference has {len(want)}"
    if grads:
        local_cots = [local_block(c, spec, mesh, shapes=shapes) for c, spec in zip(cots, sc.outputs)]
        torch.autograd.backward([g for g in got if g.requires_grad],
                                [c for g, c in zip(got, local_cots) if g.requires_grad])
    where = f"{name} [{variant}, {mode}] on rank {dist.get_rank()}"
    for j, (g, w, spec) in enumerate(zip(got, want, sc.outputs)):
        value = g.detach().clone()
        partial = _partial_dims(spec)
        if partial:
            dist.all_reduce(value, group=mesh.group(partial))
        torch.testing.assert_close(value, local_block(w.detach(), spec, mesh, shapes=shapes),
                                   msg=lambda m: f"{where}: output {j}: {m}")
    for k in grads:
        spec = sc.inputs[k]
        assert blocks[k].grad is not None, f"{where}: input {k!r} got no gradient"
        torch.testing.assert_close(blocks[k].grad, local_block(whole[k].grad, spec, mesh, shapes=shapes),
                                   msg=lambda m: f"{where}: gradient of {k!r}: {m}")


# -- the scenarios -------------------------------------------------------------------------------

TP2 = ((2,), ("tp",))
TP4 = ((4,), ("tp",))
DPTP = ((2, 2), ("dp", "tp"))
EVEN_UNEVEN = {"even": {"a": 4, "b": 4, "c": 6, "f": 8, "h": 4, "n": 2},
               "uneven": {"a": 5, "b": 3, "c": 6, "f": 7, "h": 5, "n": 2}}


def _mlp(x, w1, w2):
    return F.gelu(x @ w1.T) @ w2.T


# shard_map bodies that use tensors dynamo records without torch function modes (property views,
# iteration, unpacking, builtins): every gradient must be the one-process gradient

_MLP_IN = {"x": "b c", "w1": "f/tp c", "w2": "c f/tp"}


def _mlp_body(body):
    def program(mesh, shapes):
        step = es.shard_map(body, in_specs=("b c", "f/tp c", "c f/tp"), out_specs="b c", mesh=mesh, shapes=shapes)
        return lambda x, w1, w2: step(x, w1, w2)

    return program


_BODIES = {
    "transpose_T": lambda x, w1, w2: es.psum(F.gelu(x @ w1.T) @ w2.T, "tp"),
    "transpose_mT": lambda x, w1, w2: es.psum(F.gelu(x @ w1.mT) @ w2.mT, "tp"),
    "transpose_mH": lambda x, w1, w2: es.psum(F.gelu(x @ w1.mH) @ w2.mH, "tp"),
    "transpose_of_x": lambda x, w1, w2: es.psum(F.gelu((w1 @ x.T).T) @ w2.T, "tp"),
    "iterate_rows": lambda x, w1, w2: es.psum(F.gelu(torch.stack([x @ row for row in w1], -1)) @ w2.T, "tp"),
    "unpack_rows": lambda x, w1, w2: es.psum(F.gelu(torch.stack([x @ r for r in [*w1]], -1)) @ w2.T, "tp"),
    "builtin_abs": lambda x, w1, w2: es.psum(F.gelu(abs(x @ w1.T)) @ w2.T, "tp"),
}
_REFERENCES = {"builtin_abs": lambda x, w1, w2: F.gelu(abs(x @ w1.T)) @ w2.T}

for _name, _body in _BODIES.items():
    scenario(f"shard_map_{_name}", TP2, _MLP_IN, "b c", _REFERENCES.get(_name, _mlp), EVEN_UNEVEN)(_mlp_body(_body))


# a training step inside the body: torch.autograd.grad (a graph break under torch.compile), an SGD update

def _train_reference(x, w1, w2):
    ws = [w1.detach().requires_grad_(), w2.detach().requires_grad_()]
    loss = _mlp(x.detach(), *ws).square().mean()
    grads = torch.autograd.grad(loss, ws)
    return tuple(w - 0.1 * g for w, g in zip(ws, grads)) + (loss,)


def _train_body(x, w1, w2):
    loss = es.psum(F.gelu(x @ w1.T) @ w2.T, "tp").square().mean()
    g1, g2 = torch.autograd.grad(loss, [w1, w2])
    with torch.no_grad():
        return w1 - 0.1 * g1, w2 - 0.1 * g2, loss.detach()


@scenario("shard_map_autograd_grad_step", TP2, _MLP_IN, ("f/tp c", "c f/tp", ""), _train_reference, EVEN_UNEVEN,
          grads=(), fullgraph=False)
def _train_step(mesh, shapes):
    step = es.shard_map(_train_body, in_specs=("b c", "f/tp c", "c f/tp"), out_specs=("f/tp c", "c f/tp", ""),
                        mesh=mesh, shapes=shapes)
    return lambda x, w1, w2: step(x, w1.requires_grad_(), w2.requires_grad_())
