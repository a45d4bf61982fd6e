"""The stateful differential harness: random training-loop event sequences, sharded and whole, step by step.

One small model (a scale vector ``norm.g``, then two linear maps ``up.w`` and ``down.w`` with a ``tanh``
between them; loss ``sum(y ** 2)``) is held twice on every rank:

- **sharded**, by one gradient *mechanism* (:data:`MECHANISMS`): gradient duties summed by the native
  hooks (sync ``dp`` or bucketed ``dp:async``), a ``shard_map(check_vma=True)`` body (deferred sums),
  a per-rank ``shard_map(check_vma=False)`` body with the hooks, parameters stored over ``dp``
  (``store=``, ZeRO-3) with the hooks' gathers or in ``shard_map``, and compiled (``aot_eager``);
  data parallel over ``dp`` and tensor parallel over ``tp`` (hidden units ``f/tp``), on a mesh of
  4 ranks in ascending or permuted rank order (:data:`MESHES`), with even or uneven blocks;
- **whole**, as plain tensors in one process (float64): the same model in plain torch.

A sequence of *events* (:data:`EVENTS`: forward, backward, ``retain_graph``, ``torch.autograd.grad``
with an ``inputs`` subset, a ``no_sync`` micro-batch, an exception raised in the middle of backward,
an auxiliary loss term switched on or off, an in-place update or a reload of the weights, a partial ``no_grad`` forward, ``functional_call``,
a DCP save and load on another mesh, an optimizer step, ``zero_grad``) is generated in the pytest
process (by hypothesis, which shrinks it) and :func:`run_sequence` runs the whole sequence on every
rank: each event is applied to both models, and after it the values it returned, every parameter
and every gradient must be equal (torch's default float64 tolerances), or both sides must have
raised. The first event where they differ is reported with the sequence up to it, on every rank.

:data:`KNOWN_FAILING` (temporary) lists the events and situations that fail before the fixes of the
bugs the harness found; the runs leave them out or step around them, and ``EINSHARD_LOOPS_ALL=1``
runs everything. ``tests/integration/test_training_loops.py`` runs the harness (docs/testing.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch._functorch import config as functorch_config
from torch.distributed.device_mesh import DeviceMesh

import einshard as es
from einshard.comm.helpers import compute_split_shapes
from einshard.testing import local_block

DT = torch.float64
PARAMS = ("norm.g", "up.w", "down.w")
SIZES = {"even": {"b": 4, "c": 4, "f": 4}, "uneven": {"b": 5, "c": 5, "f": 7}}

# global rank tensors of the 4-rank meshes; each one's "other" is where a DCP checkpoint is loaded
MESHES = {
    "2x2": ([[0, 1], [2, 3]], ("dp", "tp")),
    "cols": ([[0, 2], [1, 3]], ("dp", "tp")),
    "rev": ([[3, 1], [2, 0]], ("dp", "tp")),
    "4": ([0, 1, 2, 3], ("dp",)),
    "4-perm": ([3, 1, 0, 2], ("dp",)),
}
OTHER = {"2x2": "rev", "cols": "2x2", "rev": "cols", "4": "4-perm", "4-perm": "4"}


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """How the sharded model's gradients are summed.

    ``style``: ``"hooks"`` (formulas in the modules' forwards, outside ``shard_map``) or ``"shard_map"``
    (the model code run by ``functional_call`` in a body); ``grad``: the duty registered on every
    parameter; ``store``: stored over ``dp``; ``vma``: the body's ``check_vma``; ``hooks``: the native
    hooks installed; ``compiled``: the body under ``torch.compile(backend="aot_eager")``; ``parent``: the
    model reads ``norm.g`` outside ``norm``'s forward too; ``units``: the hooks' ``units=[model]``;
    ``refused``: the library refuses the model (an ``EinshardError`` containing this text, on every rank),
    as documented, and the sequence ends there.
    """

    style: str
    grad: str | None
    store: bool = False
    vma: bool = True
    hooks: bool = False
    compiled: bool = False
    parent: bool = False
    units: bool = False
    refused: str = ""


MECHANISMS = {
    "hooks-sync": Mechanism("hooks", "dp", hooks=True),
    "hooks-async": Mechanism("hooks", "dp:async", hooks=True),
    "shard_map": Mechanism("shard_map", "dp"),
    "shard_map-novma": Mechanism("shard_map", "dp:async", vma=False, hooks=True),
    "zero-hooks": Mechanism("hooks", "dp", store=True, hooks=True),
    "zero-hooks-units": Mechanism("hooks", "dp", store=True, hooks=True, parent=True, units=True),
    "zero-hooks-parent": Mechanism("hooks", "dp", store=True, hooks=True, parent=True,
                                   refused="outside the forward of the module that gathers it"),
    "zero-shard_map": Mechanism("shard_map", "dp", store=True),
    "zero-shard_map-novma": Mechanism("shard_map", "dp", store=True, vma=False, refused="shard_map(check_vma=False)"),
    "compiled": Mechanism("shard_map", None, compiled=True),
    "zero-compiled-novma": Mechanism("shard_map", "dp", store=True, vma=False, compiled=True,
                                     refused="shard_map(check_vma=False)"),
}

EVENTS = ("forward", "backward", "retain", "grad", "no_sync", "raise", "aux", "inplace", "reload", "partial",
          "functional", "dcp", "step", "zero_grad")

# Situations a loop can be in when an event comes; a KNOWN_FAILING entry naming one makes the loop step
# around it (see Loop.avoid) instead of leaving the event out.
SITUATIONS = {
    "live-update": "the weights change (in place, reload, DCP load, optimizer step) while a forward's graph "
                   "is alive: the loop drops the graph first",
    "grad-no_sync": "torch.autograd.grad inside no_sync() or with a no_sync micro-batch held: the loop "
                    "waits first and calls it outside no_sync()",
    "zero_grad-no_sync": "zero_grad with a no_sync micro-batch held: the loop waits first",
    "partial-prefetch": "a partial forward (a module left out): the loop calls the hooks' wait() after it",
}

CAUSES = {  # the values of KNOWN_FAILING: what this harness found beyond issue 29's table
    "F1": "a check_vma=True body with stored parameters under torch.no_grad(): AttributeError in params.zero "
          "(fixed)",
    "F2": "a formula on a parameter with a duty that does not vary over dp ('c, c ->'), outside a check_vma "
          "body: its gradient is summed over dp (dp times too large) (fixed)",
    "F4": "a tensor hook registered inside a compiled shard_map body: InternalTorchDynamoError in _leaf_key "
          "(fixed)",
    "F5": "torch.func.functional_call with the ZeRO hooks: a parent's read of a child's scale outside the "
          "child's forward used the passed storage block (a slice) unguarded (fixed)",
}
# TEMPORARY: what still fails, by cause (CAUSES; F1, F2, F4, F5 are fixed, each with a regression test in
# tests/integration/test_training_loops.py). Each entry is (mechanism, mesh or "*", event, situation or "*"): the runs
# do not draw that event, step around that situation (SITUATIONS), or (with "*") leave the mechanism out on
# that mesh. Once those are fixed this is empty (EINSHARD_LOOPS_ALL=1 ignores it).
KNOWN_FAILING: dict = {}


def known_failing(mechanism: str, mesh: str, event: str = "*") -> bool:
    """Whether the event or situation ``event`` (``"*"``: the mechanism itself) fails on ``mesh`` on this
    branch (never with ``EINSHARD_LOOPS_ALL=1``)."""
    if os.environ.get("EINSHARD_LOOPS_ALL") == "1":
        return False
    return any(m == mechanism and s in ("*", mesh) and e in ("*", event) for m, s, e in KNOWN_FAILING)


# -- the model, whole and sharded ---------------------------------------------------------------------------


def _tp(mesh_names) -> str:
    return "/tp" if "tp" in mesh_names else ""


def compute_layouts(mesh_names) -> dict:
    t = _tp(mesh_names)
    return {"norm.g": "c", "up.w": f"f{t} c", "down.w": f"c f{t}"}


def whole_params(sizes: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(1000 + seed)
    c, f = sizes["c"], sizes["f"]
    return {"norm.g": 1 + 0.1 * torch.randn(c, generator=g, dtype=DT),
            "up.w": torch.randn(f, c, generator=g, dtype=DT) / c,
            "down.w": torch.randn(c, f, generator=g, dtype=DT) / f}


def batch(sizes: dict, seed: int) -> torch.Tensor:
    return torch.randn(sizes["b"], sizes["c"], generator=torch.Generator().manual_seed(seed), dtype=DT)


class RaiseInBackward(Exception):
    """What the tap of a ``raise`` event throws when backward reaches it."""


def _raise(grad):
    raise RaiseInBackward("raised in the middle of backward")


class Scale(torch.nn.Module):
    """``x * g`` and an auxiliary loss ``0.5 * sum(g ** 2)`` (a formula on the sharded side: a use of ``g``
    that does not vary over ``dp``)."""

    def __init__(self, g, sharded=False):
        super().__init__()
        self.g = torch.nn.Parameter(g)
        self.sharded = sharded

    def forward(self, x):
        aux = es.einshard("c, c -> ", self.g, self.g) if self.sharded else self.g @ self.g
        return x * self.g, 0.5 * aux


class Linear(torch.nn.Module):
    """``formula`` applied to the input and ``w`` (a plain matmul in the whole model)."""

    def __init__(self, w, formula=None, sizes=None):
        super().__init__()
        self.w = torch.nn.Parameter(w)
        self.formula, self.sizes = formula, sizes

    def forward(self, x):
        if self.formula is None:
            return x @ self.w.T
        return es.einshard(self.formula, x, self.w, sizes=self.sizes)


class Net(torch.nn.Module):
    """``y = tanh((x * g) @ up.T) @ down.T``, loss ``sum(y ** 2)`` (``+ 0.5 * sum(g ** 2)`` with ``aux``); with ``parent``,
    ``y`` is scaled by ``g`` again, read by this module (outside ``norm``'s forward);
    ``forward(x, partial=True)`` stops at the hidden units.

    ``tap``, when set, is called on the hidden activation (the ``raise`` event hooks it)."""

    def __init__(self, params, mesh_names=None, sizes=None, parent=False):
        super().__init__()
        t = _tp(mesh_names or ())
        up = None if mesh_names is None else f"b/dp c, f{t} c -> b/dp f{t}"
        down = None if mesh_names is None else f"b/dp f{t}, c f{t} -> b/dp c"
        self.norm = Scale(params["norm.g"].clone(), mesh_names is not None)
        self.up = Linear(params["up.w"].clone(), up, sizes)
        self.down = Linear(params["down.w"].clone(), down, sizes)
        self.sharded, self.sizes, self.parent, self.tap, self.aux = mesh_names is not None, sizes, parent, None, False

    def forward(self, x, partial=False):
        x, aux = self.norm(x)
        h = torch.tanh(self.up(x))
        if partial:
            return h
        if self.tap is not None:
            self.tap(h)
        y = self.down(h)
        if self.parent:
            y = y * self.norm.g
        if not self.sharded:
            loss = (y * y).sum()
        else:
            loss = es.einshard("b/dp c -> ", y * y, sizes=self.sizes and {"b": self.sizes["b"]})
        return loss + aux if self.aux else loss


# -- the sharded side ------------------------------------------------------------------------------------


def build_mesh(kind: str):
    """The wrapped mesh ``kind`` (built once per rank process and world group)."""
    world = dist.group.WORLD
    hit = _BUILT.get(kind)
    if hit is not None and hit[0] is world:
        return hit[1]
    ranks, names = MESHES[kind]
    mesh = es.wrap_mesh(DeviceMesh("cpu", ranks, mesh_dim_names=names))
    _BUILT[kind] = (world, mesh)
    return mesh


_BUILT: dict = {}


class Sharded:
    """The model held by one mechanism on one mesh: its steps, each the sharded twin of the whole one."""

    def __init__(self, mech: Mechanism, mesh, sizes: dict, params: dict):
        self.mech, self.mesh, self.sizes = mech, mesh, sizes
        names = mesh.names
        layouts = compute_layouts(names)
        blocks = {k: local_block(v, layouts[k], mesh, sizes=sizes).clone() for k, v in params.items()}
        hooks_style = mech.style == "hooks"
        self.net = Net(blocks, names, sizes if hooks_style else None, mech.parent)
        es.params.register_module_parameter_layouts_(self.net, layouts, mesh=mesh, grad=mech.grad,
                                              store="dp" if mech.store else None,
                                              sizes={"c": sizes["c"], "f": sizes["f"]})
        self.specs = dict(es.params.param_specs(self.net))
        units = [self.net] if mech.units else None
        self.handle = es.params.register_native_grad_reduction_hooks_(self.net, mesh, units=units) if mech.hooks else None
        if not hooks_style:
            shapes = {"tp": {"f": compute_split_shapes(sizes["f"], mesh.size("tp"))}} if "tp" in names else None
            t = _tp(names)

            def body(params, x, partial=False):
                return torch.func.functional_call(self.net, params, (x,), {"partial": partial})

            def hidden(params, x):
                return body(params, x, True)

            kw = dict(mesh=mesh, check_vma=mech.vma, shapes=shapes)
            self.loss_fn = es.shard_map(body, (self.specs, "b c -> b/dp c"), "", **kw)
            self.hidden_fn = es.shard_map(hidden, (self.specs, "b c -> b/dp c"), f"b/dp f{t}", **kw)
            # other weights (plain tensors, no state): this rank's compute blocks, as the body sees them
            self.other_fn = es.shard_map(body, (layouts, "b c -> b/dp c"), "", **kw)
            if mech.compiled:
                torch._dynamo.reset()
                self.loss_fn, self.hidden_fn, self.other_fn = (
                    torch.compile(f, backend="aot_eager") for f in (self.loss_fn, self.hidden_fn, self.other_fn))

    def params(self) -> dict:
        return dict(self.net.named_parameters())

    def blocks(self, whole: dict, specs=None) -> dict:
        """This rank's blocks (by default in the storage layout, the parameters' shapes) of whole values."""
        specs = specs or self.specs
        return {k: local_block(v, specs[k], self.mesh, sizes=self.sizes).clone() for k, v in whole.items()}

    def loss(self, x):
        if self.mech.style == "hooks":
            xb = local_block(x, "b/dp c", self.mesh, sizes=self.sizes)
            with es.use_mesh(self.mesh):
                return self.net(xb)
        return self.loss_fn(self.params(), x)

    def functional_loss(self, x, whole: dict):
        """The loss with other weights: ``functional_call`` of the module with blocks shaped like its
        parameters (hooks), or the body given the compute blocks as plain tensors (``shard_map``)."""
        if self.mech.style == "hooks":
            xb = local_block(x, "b/dp c", self.mesh, sizes=self.sizes)
            with es.use_mesh(self.mesh):
                return torch.func.functional_call(self.net, self.blocks(whole), (xb,))
        return self.other_fn(self.blocks(whole, compute_layouts(self.mesh.names)), x)

    def hidden(self, x):
        if self.mech.style == "hooks":
            xb = local_block(x, "b/dp c", self.mesh, sizes=self.sizes)
            with es.use_mesh(self.mesh):
                return self.net(xb, partial=True)
        return self.hidden_fn(self.params(), x)

    def no_sync(self):
        return self.handle.no_sync() if self.handle is not None else contextlib.nullcontext()

    def wait(self):
        if self.handle is not None:
            self.handle.wait()

    def hidden_block(self, whole_h):
        return local_block(whole_h, f"b/dp f{_tp(self.mesh.names)}", self.mesh, sizes=self.sizes)


# -- one sequence ------------------------------------------------------------------------------------------


class Diverged(AssertionError):
    """The sharded model and the whole one differ after an event."""


def _where(exc, frames: int = 4) -> str:
    """The innermost frames of ``exc``'s traceback (where the sharded side raised)."""
    return "".join(traceback.format_tb(exc.__traceback__)[-frames:])


def _attempt(fn):
    """``(result, None)`` or ``(None, exception)``."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - any exception is an outcome to compare
        return None, exc


def _close(got, want, what: str) -> str | None:
    if want is None or got is None:
        return None if got is None and want is None else f"{what}: {'no value' if got is None else got} " \
                                                          f"where the whole model has {want}"
    try:
        torch.testing.assert_close(got.detach(), want.detach())
    except AssertionError as err:
        return f"{what}: {err}"
    return None


class Loop:
    """Both models and what a loop holds between events: the last loss (a graph) and held gradients."""

    def __init__(self, mech_name: str, mesh_kind: str, size: str, optimizer: str, ckpt_dir: str):
        self.mech, self.mesh_kind, self.sizes = MECHANISMS[mech_name], mesh_kind, SIZES[size]
        self.mech_name, self.size, self.optimizer = mech_name, size, optimizer
        self.mesh = build_mesh(mesh_kind)
        params = whole_params(self.sizes, 0)
        self.whole = Net(params, parent=self.mech.parent)
        self.sharded = Sharded(self.mech, self.mesh, self.sizes, params)
        self.opts = [_optimizer(optimizer, m.parameters()) for m in (self.whole, self.sharded.net)]
        self.pending = None  # (whole loss, sharded loss) of the last forward, while its graph is alive
        self.held = False  # gradients accumulated under no_sync and not summed yet
        self.ckpt_dir, self.saves = ckpt_dir, 0
        self.avoid = {x for x in SITUATIONS if known_failing(mech_name, mesh_kind, x)}  # see KNOWN_FAILING

    # each event returns the problems it found (strings); the parameters and gradients are checked after it

    def forward(self, seed: int) -> list:
        x = batch(self.sizes, seed)
        (want, e1), (got, e2) = _attempt(lambda: self.whole(x)), _attempt(lambda: self.sharded.loss(x))
        self.pending = (want, got) if e1 is None and e2 is None else None
        return self._outcome(e1, e2) or [p for p in [_close(got, want, "loss")] if p]

    def backward(self, retain: bool) -> list:
        problems = self._ensure_pending()
        if self.pending is None:  # the forward raised (on both sides, or the problem is reported)
            return problems
        want, got = self.pending
        e1 = _attempt(lambda: want.backward(retain_graph=retain))[1]
        e2 = _attempt(lambda: (got.backward(retain_graph=retain), self.sharded.wait()))[1]
        return problems + self._after_backward(e1, e2, keep=retain)

    def retain(self, _=None) -> list:
        """``backward(retain_graph=True)`` twice on one loss (each followed by the hooks' wait)."""
        return self.backward(True) or self.backward(False)

    def grad(self, arg: tuple) -> list:
        """``torch.autograd.grad`` of the loss for the parameters ``names`` (inside ``no_sync()`` if asked):
        the one-process gradients come back, ``.grad`` is left as it was."""
        names, in_no_sync = arg
        if "grad-no_sync" in self.avoid and (in_no_sync or self.held):
            in_no_sync = self._sync()
        problems = self._ensure_pending()
        if self.pending is None:  # the forward raised (on both sides, or the problem is reported)
            return problems
        want, got = self.pending
        wp, sp = self.whole.get_parameter, self.sharded.net.get_parameter
        wg, e1 = _attempt(lambda: torch.autograd.grad(want, [wp(k) for k in names]))
        with self.sharded.no_sync() if in_no_sync else contextlib.nullcontext():
            sg, e2 = _attempt(lambda: torch.autograd.grad(got, [sp(k) for k in names]))
        e2 = e2 or (None if in_no_sync else _attempt(self.sharded.wait)[1])
        problems += self._after_backward(e1, e2, keep=False, wait=not in_no_sync)
        if e1 is None and e2 is None:
            specs = self.sharded.specs
            for k, g, w in zip(names, sg, wg):
                problems += [p for p in [_close(g, self._block(w, specs[k]), f"autograd.grad of {k}")] if p]
        return problems

    def no_sync(self, seed: int) -> list:
        """A micro-batch: forward and backward inside ``no_sync()`` (plain for the mechanisms without it)."""
        problems = self.forward(seed)
        if self.pending is None:
            return problems
        want, got = self.pending
        e1 = _attempt(want.backward)[1]
        with self.sharded.no_sync():
            e2 = _attempt(got.backward)[1]
        self.held = self.held or (e2 is None and self.sharded.handle is not None)
        return problems + self._after_backward(e1, e2, keep=False, wait=False)

    def raise_(self, seed: int) -> list:
        """A forward whose backward raises where it reaches the hidden activation (a NaN check, say)."""
        for net in (self.whole, self.sharded.net):
            net.tap = lambda h: h.register_hook(_raise) if h.requires_grad else None
        try:
            problems = self.forward(seed)
        finally:
            self.whole.tap = self.sharded.net.tap = None
        if self.pending is None:
            return problems
        want, got = self.pending
        e1 = _attempt(want.backward)[1]
        e2 = _attempt(lambda: (got.backward(), self.sharded.wait()))[1]
        return problems + self._after_backward(e1, e2, keep=False)

    def aux(self, on: bool) -> list:
        """From now on the loss has (or has not) the auxiliary term ``0.5 * sum(g ** 2)``."""
        self.whole.aux = self.sharded.net.aux = on
        return []

    def inplace(self, seed: int) -> list:
        self._before_update()
        delta = {k: 0.05 * v for k, v in whole_params(self.sizes, seed).items()}
        blocks = self.sharded.blocks(delta)
        with torch.no_grad():
            for k, p in self.whole.named_parameters():
                p.add_(delta[k])
            for k, p in self.sharded.net.named_parameters():
                p.add_(blocks[k])
        return []

    def reload(self, seed: int) -> list:
        self._before_update()
        new = whole_params(self.sizes, seed)
        e1 = _attempt(lambda: self.whole.load_state_dict(new))[1]
        e2 = _attempt(lambda: self.sharded.net.load_state_dict(self.sharded.blocks(new)))[1]
        return self._outcome(e1, e2)

    def partial(self, seed: int) -> list:
        """The first modules only (to the hidden units), under ``no_grad``: an evaluation."""
        x = batch(self.sizes, seed)
        with torch.no_grad():
            (want, e1), (got, e2) = _attempt(lambda: self.whole(x, True)), _attempt(lambda: self.sharded.hidden(x))
        if "partial-prefetch" in self.avoid:
            self._sync()
        if e1 is None and e2 is None:
            return [p for p in [_close(got, self.sharded.hidden_block(want), "hidden units")] if p]
        return self._outcome(e1, e2)

    def functional(self, seed: int) -> list:
        """``torch.func.functional_call`` with other weights: their loss (the registered ones are untouched)."""
        x, other = batch(self.sizes, seed), whole_params(self.sizes, seed + 50)
        want, e1 = _attempt(lambda: torch.func.functional_call(self.whole, other, (x,)))
        got, e2 = _attempt(lambda: self.sharded.functional_loss(x, other))
        return self._outcome(e1, e2) or [p for p in [_close(got, want, "functional_call loss")] if p]

    def dcp(self, _=None) -> list:
        """A DCP save (its DTensors' ``full_tensor()`` checked), a load into the model registered on another mesh
    (checked there), a load back."""
        self._before_update()
        path = os.path.join(self.ckpt_dir, f"save{self.saves}")
        self.saves += 1
        s = self.sharded
        saved = es.params.to_dtensor(s.net, mesh=s.mesh)
        problems = [p for k, v in self.whole.state_dict().items()  # the DTensors handed out agree with the whole
                    for p in [_close(saved[k].full_tensor(), v, f"es.params.to_dtensor of {k}: full_tensor()")] if p]
        dcp.save(saved, checkpoint_id=path)
        other_mesh = build_mesh(OTHER[self.mesh_kind])
        layouts = compute_layouts(other_mesh.names)
        zeros = {k: torch.zeros_like(local_block(v, layouts[k], other_mesh, sizes=self.sizes))
                 for k, v in self.whole.state_dict().items()}
        other = Net(zeros, other_mesh.names, self.sizes)
        es.params.register_module_parameter_layouts_(other, layouts, mesh=other_mesh,
                                              sizes={"c": self.sizes["c"], "f": self.sizes["f"]})
        state = es.params.to_dtensor(other, mesh=other_mesh)
        dcp.load(state, checkpoint_id=path)
        es.params.load_from_dtensor_(other, state, mesh=other_mesh)
        for k, v in self.whole.state_dict().items():
            want = local_block(v, layouts[k], other_mesh, sizes=self.sizes)
            problems += [p for p in [_close(other.get_parameter(k), want, f"{k} loaded on the other mesh")] if p]
        state = es.params.to_dtensor(s.net, mesh=s.mesh)
        dcp.load(state, checkpoint_id=path)
        es.params.load_from_dtensor_(s.net, state, mesh=s.mesh)
        self.whole.load_state_dict(self.whole.state_dict())  # the same values, copied in (as the load does)
        return problems

    def step(self, _=None) -> list:
        self._before_update()
        e2 = _attempt(self.sharded.wait)[1]  # the documented order: wait() before the step
        self.held = False if e2 is None else self.held
        e1 = None
        if e2 is None:
            e1, e2 = _attempt(self.opts[0].step)[1], _attempt(self.opts[1].step)[1]
        return self._outcome(e1, e2)

    def zero_grad(self, set_to_none: bool) -> list:
        if "zero_grad-no_sync" in self.avoid and self.held:
            self._sync()
        for opt in self.opts:
            opt.zero_grad(set_to_none=set_to_none)
        self.held = False
        return []

    # helpers

    def _before_update(self) -> None:
        if "live-update" in self.avoid:
            self.pending = None

    def _sync(self) -> bool:
        """The hooks' ``wait()`` (where the loop steps around a known failure); returns ``False``."""
        self.sharded.wait()
        self.held = False
        return False

    def _ensure_pending(self) -> list:
        return self.forward(0) if self.pending is None else []

    def _after_backward(self, e1, e2, keep: bool, wait: bool = True) -> list:
        """After a backward on both sides: one that raised leaves the gradients undefined, so the loop
        zeroes them (as a loop that skips the step does); the graph is kept only with ``retain_graph``."""
        if not keep or e1 is not None or e2 is not None:
            self.pending = None
        if e1 is None and e2 is None and wait:
            self.held = False
        if e1 is not None and e2 is not None:
            self.zero_grad(True)
        return self._outcome(e1, e2)

    def _outcome(self, e1, e2) -> list:
        if (e1 is None) == (e2 is None):
            return []
        if e1 is not None:
            return [f"the whole model raised {type(e1).__name__}: {e1}; the sharded one did not"]
        return [f"the sharded model raised {type(e2).__name__}: {e2}; the whole one did not\n{_where(e2)}"]

    def _block(self, whole_tensor, spec):
        return None if whole_tensor is None else local_block(whole_tensor, spec, self.mesh, sizes=self.sizes)

    def check_state(self) -> list:
        problems = []
        for k, p in self.whole.named_parameters():
            q, spec = self.sharded.net.get_parameter(k), self.sharded.specs[k]
            problems += [x for x in [_close(q, self._block(p, spec), f"parameter {k}")] if x]
            if not self.held:
                problems += [x for x in [_close(q.grad, self._block(p.grad, spec), f"gradient of {k}")] if x]
        return problems


def _refused_as_documented(mech: Mechanism, everyone: list) -> bool:
    """Whether every rank's one problem is the sharded side's documented refusal of ``mech``."""
    expected = "the sharded model raised EinshardError"
    return bool(mech.refused) and all(len(p) == 1 and p[0].startswith(expected) and mech.refused in p[0]
                                      for p in everyone)


def _optimizer(name: str, params):
    params = list(params)
    return torch.optim.Adam(params, lr=0.05) if name == "adam" else torch.optim.SGD(params, lr=0.1, momentum=0.5)


def describe(events) -> str:
    return "; ".join(f"{k}({a!r})" if a is not None else k for k, a in events)


def run_sequence(mechanism: str, mesh: str, size: str, optimizer: str, events, ckpt_dir: str,
                 step_around: bool = True) -> int:
    """On every rank: apply ``events`` to both models; raise :class:`Diverged` at the first event after which
    they differ (on any rank: every rank raises the same message). Returns the number of events run.
    ``step_around=False``: the loop steps around no situation of :data:`KNOWN_FAILING`."""
    # a compiled backward with donated buffers refuses retain_graph=True (torch's rule, not einshard's)
    compiled = MECHANISMS[mechanism].compiled
    with functorch_config.patch(donated_buffer=False) if compiled else contextlib.nullcontext():
        loop = Loop(mechanism, mesh, size, optimizer, ckpt_dir)
        loop.avoid = loop.avoid if step_around else set()
        return _run(loop, events)


def _run(loop: Loop, events) -> int:
    mechanism, mesh = loop.mech_name, loop.mesh_kind
    size, optimizer = loop.size, loop.optimizer
    for i, (kind, arg) in enumerate(events):
        problems, exc = _attempt(lambda: getattr(loop, "raise_" if kind == "raise" else kind)(arg))
        problems = problems or []
        if exc is not None:
            problems.append(f"the harness step itself raised {type(exc).__name__}: {exc}\n{_where(exc)}")
        else:
            problems += loop.check_state()
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, problems[:3])
        if _refused_as_documented(loop.mech, everyone):
            return i
        if any(everyone):
            grouped: dict = {}
            for r, p in enumerate(everyone):
                if p:
                    grouped.setdefault("\n    ".join(p), []).append(str(r))
            where = [f"  ranks {', '.join(r)}: {p}" for p, r in grouped.items()]
            raise Diverged(f"{mechanism} on mesh {mesh} ({size}, {optimizer}): event {i} {kind}({arg!r}) "
                           f"diverged\n  sequence: {describe(events[:i + 1])}\n" + "\n".join(where))
    return len(events)
