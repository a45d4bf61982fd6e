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
   input's gradient with the whole-tensor program's, cut the same way; no
   warning may point at einshard's own code (dynamo's about its caches, say).

Each scenario runs with even and uneven blocks (``Scenario.sizes``: one size
per axis for each variant; odd sizes split unevenly, and the split shapes are
passed to the program as ``shapes``). ``tests/integration/test_differential.py`` runs the
table; a scenario is added here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import einshard as es
from einshard.core._split import compute_split_shapes
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
    labels = ["-".join(p) for k in range(1, len(mesh.names) + 1) for p in itertools.permutations(mesh.names, k)]
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
    _check(SCENARIOS[name], variant, mode)


def check_in(sc: Scenario, variant: str, mode: str, fullgraph: bool | None = None) -> None:
    """:func:`check` of a scenario object as it is (no change of checks); ``fullgraph`` overrides its own."""
    if fullgraph is not None:
        sc = dataclasses.replace(sc, fullgraph=fullgraph)
    _check(sc, variant, mode)


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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _as_tuple(program(**blocks))
    ours = [str(w.message) for w in caught if os.sep + "einshard" + os.sep in str(w.message)]
    assert not ours, f"{name} [{variant}, {mode}]: warnings about einshard's own code: {ours}"
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
EVEN_UNEVEN = {"even": {"a": 4, "b": 4, "c": 6, "d": 3, "f": 8, "h": 4, "n": 2, "o": 3, "k": 3, "t": 2, "u": 1},
               "uneven": {"a": 5, "b": 3, "c": 6, "d": 3, "f": 7, "h": 5, "n": 2, "o": 3, "k": 3, "t": 2, "u": 1}}
T4 = {v: {**d, "t": 4} for v, d in EVEN_UNEVEN.items()}  # t: one row per rank of a 4-rank dimension


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
    "transpose_T": lambda x, w1, w2: es.spmd.psum(F.gelu(x @ w1.T) @ w2.T, "tp"),
    "transpose_mT": lambda x, w1, w2: es.spmd.psum(F.gelu(x @ w1.mT) @ w2.mT, "tp"),
    "transpose_mH": lambda x, w1, w2: es.spmd.psum(F.gelu(x @ w1.mH) @ w2.mH, "tp"),
    "transpose_of_x": lambda x, w1, w2: es.spmd.psum(F.gelu((w1 @ x.T).T) @ w2.T, "tp"),
    "iterate_rows": lambda x, w1, w2: es.spmd.psum(F.gelu(torch.stack([x @ row for row in w1], -1)) @ w2.T, "tp"),
    "unpack_rows": lambda x, w1, w2: es.spmd.psum(F.gelu(torch.stack([x @ r for r in [*w1]], -1)) @ w2.T, "tp"),
    "builtin_abs": lambda x, w1, w2: es.spmd.psum(F.gelu(abs(x @ w1.T)) @ w2.T, "tp"),
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
    loss = es.spmd.psum(F.gelu(x @ w1.T) @ w2.T, "tp").square().mean()
    g1, g2 = torch.autograd.grad(loss, [w1, w2])
    with torch.no_grad():
        return w1 - 0.1 * g1, w2 - 0.1 * g2, loss.detach()


@scenario("shard_map_autograd_grad_step", TP2, _MLP_IN, ("f/tp c", "c f/tp", ""), _train_reference, EVEN_UNEVEN,
          grads=(), fullgraph=False)
def _train_step(mesh, shapes):
    step = es.shard_map(_train_body, in_specs=("b c", "f/tp c", "c f/tp"), out_specs=("f/tp c", "c f/tp", ""),
                        mesh=mesh, shapes=shapes)
    return lambda x, w1, w2: step(x, w1.requires_grad_(), w2.requires_grad_())


# -- formulas of each planner kind (es.einshard with a mesh, outside shard_map) ------------------------


def restrict(shapes: dict, text: str) -> dict:
    """The entries of ``shapes`` (by mesh dimension, then axis) for the sharded axes of ``text``."""
    sharded = {}
    for word in text.replace(",", " ").replace("->", " ").split():
        if "/" in word and not word.startswith("//"):
            axis, label = word.split("/")
            sharded.setdefault(label, set()).add(axis)
    return {label: {a: shapes[label][a] for a in axes} for label, axes in sharded.items()}


def _formula(formula):
    def program(mesh, shapes):
        mine = restrict(shapes, formula)
        return lambda **xs: es.einshard(formula, *xs.values(), mesh=mesh, shapes=mine)

    return program


def _formula_scenario(name, mesh, formula, reference):
    lhs, rhs = (side.strip() for side in formula.split("->"))
    inputs = {f"x{i}": spec.strip() for i, spec in enumerate(lhs.split(","))}
    scenario(f"formula_{name}", mesh, inputs, rhs, reference, EVEN_UNEVEN)(_formula(formula))


_ident = lambda x0: x0  # noqa: E731
for _name, _mesh, _formula_text, _ref in [
    ("gather", TP2, "a/tp b -> a b", _ident),
    ("split", TP2, "a b -> a/tp b", _ident),
    ("all_to_all", TP2, "a/tp b -> a b/tp", _ident),
    ("reduce_scatter", TP2, "a b // tp -> a/tp b", _ident),
    ("all_reduce", TP2, "a b // tp -> a b", _ident),
    ("mesh_move", DPTP, "a/dp b -> a/tp b", _ident),
    ("swap", DPTP, "a/dp b/tp -> a/tp b/dp", _ident),
    ("compound_gather", DPTP, "a/dp-tp b -> a b", _ident),
    ("compound_split_reversed", DPTP, "a b/dp -> a/tp-dp b", _ident),
    ("column_parallel", TP2, "b c, f/tp c -> b f/tp", lambda x0, x1: x0 @ x1.T),
    ("row_parallel", TP2, "b f/tp, c f/tp -> b c", lambda x0, x1: x0 @ x1.T),
    ("two_dims", DPTP, "b/dp c/tp, f c/tp -> b/dp f", lambda x0, x1: x0 @ x1.T),
    ("three_operands", DPTP, "a b, b/tp c, c d -> a/dp d", lambda x0, x1, x2: x0 @ x1 @ x2),
]:
    _formula_scenario(_name, _mesh, _formula_text, _ref)


# -- named collectives in shard_map bodies (variance tracked), forward and backward -------------------


def _body(body, in_specs, out_specs, mesh_shapes=True):
    def program(mesh, shapes):
        step = es.shard_map(body, in_specs=in_specs, out_specs=out_specs, mesh=mesh,
                            shapes=shapes if mesh_shapes else None)
        return lambda **xs: step(*xs.values())

    return program


def _body_scenario(name, mesh, inputs, outputs, reference, body, sizes=EVEN_UNEVEN, **kw):
    outs = (outputs,) if isinstance(outputs, str) else tuple(outputs)
    out_specs = outs[0] if isinstance(outputs, str) else outs
    scenario(name, mesh, inputs, outputs, reference, sizes, **kw)(_body(body, tuple(inputs.values()), out_specs))


def _halves(shapes, label, axis):
    return shapes[label][axis]


_body_scenario("named_psum", DPTP, {"x": "a/dp b // tp", "w": "b"}, "a/dp b", lambda x, w: x * w,
               lambda x, w: es.spmd.psum(x, "tp") * w)
_body_scenario("named_pmean", DPTP, {"x": "a/dp b // tp", "w": "b"}, "a/dp b", lambda x, w: x / 2 * w,
               lambda x, w: es.spmd.pmean(x, "tp") * w)
_body_scenario("named_pmax", DPTP, {"x": "t/tp a/dp b", "w": "b"}, "u a/dp b",
               lambda x, w: x.amax(0, keepdim=True) * w, lambda x, w: es.spmd.pmax(x, "tp") * w)
_body_scenario("named_pmin", DPTP, {"x": "t/tp a/dp b", "w": "b"}, "u a/dp b",
               lambda x, w: x.amin(0, keepdim=True) * w, lambda x, w: es.spmd.pmin(x, "tp") * w)
_body_scenario("named_ppermute", DPTP, {"x": "t/tp a/dp b", "w": "b"}, "t/tp a/dp b",
               lambda x, w: x.roll(1, 0) * w, lambda x, w: es.spmd.ppermute(x, "tp", [(0, 1), (1, 0)]) * w)
_body_scenario("named_pvary", DPTP, {"x": "a/dp b", "w": "b"}, "a/dp b // tp", lambda x, w: 2 * x * w,
               lambda x, w: es.spmd.pvary(w, "tp") * x)
_body_scenario("named_axis_index", DPTP, {"x": "a/dp b"}, "a/dp b // tp", lambda x: 3 * x,
               lambda x: x * (es.spmd.axis_index("tp") + 1))


def _named_uneven(collective):
    """A body ``collective(x * w, "tp", axis=0, shapes=...)`` with the split of ``a`` over ``tp`` (uneven blocks)."""

    def program(mesh, shapes):
        def body(x, w):
            return collective(x * w, "tp", axis=0, shapes=shapes["tp"]["a"])

        return _body(body, program.in_specs, program.out_specs)(mesh, shapes)

    return program


def _named_uneven_scenario(name, in_x, out, collective):
    program = _named_uneven(collective)
    program.in_specs, program.out_specs = (in_x, "b"), out
    scenario(name, DPTP, {"x": in_x, "w": "b"}, out, lambda x, w: x * w, EVEN_UNEVEN)(program)


_named_uneven_scenario("named_all_gather", "a/tp b", "a b", es.spmd.all_gather)
_named_uneven_scenario("named_psum_scatter", "a b // tp", "a/tp b", es.spmd.psum_scatter)
_body_scenario("named_all_to_all", TP2, {"x": "a/tp b", "w": "b"}, "a b/tp", lambda x, w: x * w,
               lambda x, w: es.spmd.all_to_all(x * w, "tp", split_axis=1, concat_axis=0),
               sizes={"even": EVEN_UNEVEN["even"]})  # (the named all-to-all takes equal blocks only)


# -- shard_map bodies: in-place ops, loops over layers, pytrees, partial and varying out-specs --------


def _inplace_body(x, w1, w2):
    h = F.gelu(x @ w1.T)
    acc = x.new_zeros(x.shape[0], w2.shape[0])  # invariant; the in-place sum makes it vary over tp
    acc += h @ w2.T
    acc[0] *= 2.0
    return es.spmd.psum(acc, "tp")


def _inplace_reference(x, w1, w2):
    acc = _mlp(x, w1, w2)
    return torch.cat([acc[:1] * 2.0, acc[1:]])


scenario("shard_map_inplace", TP2, _MLP_IN, "b c", _inplace_reference, EVEN_UNEVEN)(_mlp_body(_inplace_body))


_LAYERS = {"x": "b c", "w1": "f/tp c", "w2": "c f/tp", "v1": "f/tp c", "v2": "c f/tp"}


def _layers_body(x, params):
    for layer in params["layers"]:
        x = x + es.spmd.psum(F.gelu(x @ layer["w1"].T) @ layer["w2"].T, "tp")
    return x


def _layers_program(mesh, shapes):
    specs = {"layers": [{"w1": "f/tp c", "w2": "c f/tp"}] * 2}
    step = es.shard_map(_layers_body, in_specs=("b c", specs), out_specs="b c", mesh=mesh, shapes=shapes)
    return lambda x, w1, w2, v1, v2: step(x, {"layers": [{"w1": w1, "w2": w2}, {"w1": v1, "w2": v2}]})


def _layers_reference(x, w1, w2, v1, v2):
    x = x + _mlp(x, w1, w2)
    return x + _mlp(x, v1, v2)


scenario("shard_map_layers_pytree", TP2, _LAYERS, "b c", _layers_reference, EVEN_UNEVEN)(_layers_program)

_body_scenario("shard_map_partial_out", TP2, _MLP_IN, "b c // tp", _mlp,
               lambda x, w1, w2: F.gelu(x @ w1.T) @ w2.T)
_body_scenario("shard_map_varying_out", TP2, _MLP_IN, ("b f/tp", "b c"), lambda x, w1, w2: (x @ w1.T, _mlp(x, w1, w2)),
               lambda x, w1, w2: (x @ w1.T, es.spmd.psum(F.gelu(x @ w1.T) @ w2.T, "tp")))
_body_scenario("shard_map_formulas", DPTP, {"x": "b/dp n c", "w1": "f/tp c", "w2": "c f/tp", "g": "c"}, "b/dp n c",
               lambda x, w1, w2, g: F.gelu(x @ w1.T) @ w2.T * g,
               lambda x, w1, w2, g: es.einshard("b/dp n f/tp, c f/tp -> b/dp n c",
                                                F.gelu(es.einshard("b/dp n c, f/tp c -> b/dp n f/tp", x, w1)), w2) * g)


# -- grid ops: FFTs, halos, rolls, windows, convolutions on sharded grids -----------------------------


def _grid(fn, text):
    def program(mesh, shapes):
        mine = restrict(shapes, text)
        return lambda **xs: fn(mesh, mine, *xs.values())

    return program


def _grid_scenario(name, mesh, inputs, output, reference, fn, sizes=EVEN_UNEVEN):
    text = ", ".join(inputs.values()) + " -> " + output
    scenario(name, mesh, inputs, output, reference, sizes)(_grid(fn, text))


_grid_scenario("grid_einfft", TP2, {"x": "a/tp b"}, "a b/tp", lambda x: torch.fft.fftn(x.to(torch.complex128)),
               lambda mesh, shapes, x: es.einfft("a/tp b -> a b/tp", x.to(torch.complex128),
                                                 axes={"a": "a", "b": "b"}, mesh=mesh, shapes=shapes))
_grid_scenario("grid_einhalo", TP2, {"x": "a h/tp"}, "a h/tp", lambda x: x.roll(-1, 1) - x.roll(1, 1),
               lambda mesh, shapes, x: _central(es.einhalo("a h/tp", x, {"h": 1}, boundary="periodic", mesh=mesh,
                                                           shapes=shapes)))
_grid_scenario("grid_einroll", TP2, {"x": "a h/tp"}, "a h/tp", lambda x: x.roll(3, 1),
               lambda mesh, shapes, x: es.einroll("a h/tp", x, {"h": 3}, mesh=mesh, shapes=shapes))
_grid_scenario("grid_einwindow", TP2, {"x": "a h/tp"}, "a h/tp k", lambda x: F.pad(x, (1, 1)).unfold(1, 3, 1),
               lambda mesh, shapes, x: es.einwindow("a h/tp -> a h/tp k", x, {"h": "k"}, {"h": 1}, mesh=mesh,
                                                    shapes=shapes))
_grid_scenario("grid_einconv", TP2, {"x": "a h/tp c", "w": "o c k"}, "a h/tp o",
               lambda x, w: F.conv1d(x.permute(0, 2, 1), w, padding=1).permute(0, 2, 1),
               lambda mesh, shapes, x, w: es.einconv("a h/tp c, o c k -> a h/tp o", x, w, {"h": "k"}, mesh=mesh,
                                                     shapes=shapes))


def _central(y):
    return y[:, 2:] - y[:, :-2]


def _roll_body(x, w):
    return es.einroll("a h/tp", x * w, {"h": 3})


_body_scenario("shard_map_einroll", TP2, {"x": "a h/tp", "w": "h/tp"}, "a h/tp", lambda x, w: (x * w).roll(3, 1),
               _roll_body)


def _inplace_grad_body(x, w1, w2, g):
    acc = g * 1.0  # invariant and requires grad: the in-place sum makes it vary, its old value is pvary-ed
    acc += F.gelu(x @ w1.T) @ w2.T
    return es.spmd.psum(acc, "tp")


scenario("shard_map_inplace_requires_grad", TP2, {**_MLP_IN, "g": "b c"}, "b c",
         lambda x, w1, w2, g: 2 * g + _mlp(x, w1, w2), EVEN_UNEVEN)(
    _body(_inplace_grad_body, ("b c", "f/tp c", "c f/tp", "b c"), "b c"))


_body_scenario("shard_map_unflatten", TP2, _MLP_IN, "b c", _mlp,
               lambda x, w1, w2: es.spmd.psum(F.gelu((x @ w1.T).unflatten(1, (1, -1)).flatten(1)) @ w2.T, "tp"))
