"""``torch_einshard.symbolic``: torch-einshard 1.0's symbolic planner names, over einshard's planner.

- ``TensorState.from_spec(spec, mesh_dim_names)``: each axis's placement, the partials and
  the mesh dimensions the tensor is replicated over.
- ``build_unary_transition_plan`` / ``build_binary_transition_plan``: the forward steps
  einshard's planner chooses for a formula (:func:`einshard.ops.explain.explain` on a
  virtual mesh with two ranks per dimension and even blocks). The step names are
  einshard's (``"all-gather along c"``, ``"all-to-all a -> b"``, ``"exchange ..."``), not
  1.0's mapping names, and each step's ``args`` is ``(mesh dimensions,)``.
- ``ExecutionPlan`` / ``set_last_plan`` / ``last_plan``: a record of named steps. einshard's
  own calls do not record one (``es.explain`` shows the plan of a call).
- ``resolve_plan_policy``, ``get_default_policy``, ``get_optimization_policy``: the
  precedence of :mod:`einshard.core.policy`.

>>> from torch_einshard.symbolic import build_binary_transition_plan as plan
>>> plan("a b/tp", "b/tp c", "a c").names()
['all-reduce']
"""

from __future__ import annotations

from dataclasses import dataclass, field

from einshard import notation
from einshard.comm.mesh import Mesh
from einshard.core.policy import (
    PlanPolicy,
    optimize,
    resolve_policy,
    scoped,
    set_default_policy,
)
from einshard.errors import EinshardError
from einshard.ops.explain import explain

from .sharding import as_formula

__all__ = [
    "BinaryTransitionPlan",
    "ExecutionPlan",
    "PlanPolicy",
    "PlanStep",
    "TensorState",
    "UnaryTransitionPlan",
    "build_binary_transition_plan",
    "build_unary_transition_plan",
    "get_default_policy",
    "get_optimization_policy",
    "last_alternatives",
    "last_candidates",
    "last_plan",
    "optimize",
    "resolve_plan_policy",
    "set_default_policy",
    "set_last_plan",
]


# -- tensor states ----------------------------------------------------------------------------


def _spec(spec) -> notation.TensorSpec:
    if isinstance(spec, str):
        return as_formula(spec).inputs[0]
    if not isinstance(spec, notation.TensorSpec):
        raise EinshardError(f"expected a tensor spec (text or a parsed TensorSpec), got {spec!r}")
    return spec


def _components(name: str) -> set[str]:
    return {name, *name.split("-")}


@dataclass(frozen=True)
class TensorState:
    """One tensor's layout by name: ``placements`` ``((axis, mesh dimension or None), ...)``, ``partials``,
    ``replicated_dims`` (the mesh dimensions it neither shards nor is partial over)."""

    axes: tuple
    placements: tuple
    partials: tuple
    replicated_dims: tuple = ()

    @classmethod
    def from_spec(cls, spec, mesh_dim_names=()):
        spec = _spec(spec)
        if spec.has_ellipsis:
            raise EinshardError(f"TensorState needs the '...' of '{spec}' expanded into named axes")
        axes = tuple(spec.axes)
        names = [a.name for a in axes]
        if len(set(names)) != len(names):
            raise EinshardError(f"TensorState needs unique axis names; '{spec}' repeats one")
        used = set()
        for dim in [a.mesh for a in axes if a.mesh] + list(spec.partial):
            used |= _components(dim)
        replicated = tuple(d for d in mesh_dim_names if not _components(d) & used)
        return cls(axes, tuple((a.name, a.mesh) for a in axes), tuple(spec.partial), replicated)

    def placement(self, name):
        """The mesh dimension that shards axis ``name`` (``None``: unsharded); ``KeyError`` for an unknown axis."""
        return self.placement_dict()[name]

    def placement_dict(self):
        return dict(self.placements)

    def axis(self, name):
        for axis in self.axes:
            if axis.name == name:
                return axis
        raise KeyError(name)


# -- execution plans --------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanStep:
    """One step of a plan: its name and arguments."""

    name: str
    args: tuple = ()


@dataclass(frozen=True)
class PlanCandidate:
    """A plan considered for a call, with the steps it would fall back to and the verdict."""

    name: str
    args: tuple = ()
    fallback_steps: tuple = ()
    status: str = "considered"
    reason: str = ""


class ExecutionPlan:
    """The steps a call ran, the candidates it considered and the alternatives it ranked."""

    def __init__(self):
        self.steps: list[PlanStep] = []
        self.candidates: list[PlanCandidate] = []
        self.alternatives: list = []
        self.selected = None

    def add(self, name, *args):
        self.steps.append(PlanStep(name, tuple(args)))

    def execute(self, name, fn, *fn_args, step_args=(), **fn_kwargs):
        """Record step ``name`` and run ``fn(*fn_args, **fn_kwargs)``."""
        self.add(name, *step_args)
        return fn(*fn_args, **fn_kwargs)

    def consider(self, candidate, *args, status="considered", reason="", fallback_steps=()):
        if isinstance(candidate, PlanCandidate):
            self.candidates.append(PlanCandidate(candidate.name, candidate.args, candidate.fallback_steps,
                                                 status, reason))
        else:
            self.candidates.append(PlanCandidate(candidate, tuple(args), tuple(fallback_steps), status, reason))

    def rank(self, alternatives, selected=None, reason=""):
        self.alternatives = list(alternatives)
        self.selected = (selected, reason)

    def names(self):
        return [step.name for step in self.steps]

    def snapshot(self):
        return tuple(self.steps)


_LAST: dict[str, tuple] = {"plan": (), "candidates": (), "alternatives": ()}


def set_last_plan(plan):
    """Record ``plan`` (an :class:`ExecutionPlan`, or a sequence of steps) as the last plan."""
    if isinstance(plan, ExecutionPlan):
        _LAST.update(plan=tuple(plan.steps), candidates=tuple(plan.candidates), alternatives=tuple(plan.alternatives))
    else:
        _LAST.update(plan=tuple(plan), candidates=(), alternatives=())


def last_plan():
    return _LAST["plan"]


def last_candidates():
    return _LAST["candidates"]


def last_alternatives():
    return _LAST["alternatives"]


# -- transition plans -------------------------------------------------------------------------


@dataclass(frozen=True)
class UnaryTransitionPlan:
    """The forward steps that turn one layout into another."""

    formula: str
    steps: tuple = field(default=())

    def names(self):
        return [step.name for step in self.steps]


@dataclass(frozen=True)
class BinaryTransitionPlan:
    """The forward steps of a two-operand formula: on each input, then on the result."""

    formula: str
    input0_steps: tuple = ()
    input1_steps: tuple = ()
    output_steps: tuple = ()

    def steps(self):
        return (*self.input0_steps, *self.input1_steps, *self.output_steps)

    def names(self):
        return [step.name for step in self.steps()]


_RANKS_PER_DIM = 2


def _explained(specs):
    """``explain`` of ``specs[:-1] -> specs[-1]`` on a virtual mesh, two ranks per named mesh dimension."""
    specs = [notation.TensorSpec(_spec(s).items, _spec(s).partial) for s in specs]
    for s in specs:
        if s.has_ellipsis:
            raise EinshardError(f"a transition plan needs the '...' of '{s}' expanded into named axes")
    text = ", ".join(map(str, specs[:-1])) + " -> " + str(specs[-1])
    dims: list[str] = []
    for s in specs:
        for dim in sorted(s.mesh_components):
            if dim not in dims:
                dims.append(dim)
    whole = 2 * _RANKS_PER_DIM ** len(dims)  # every axis: even blocks on every rank
    shapes = []
    for s in specs[:-1]:
        shape = []
        for item in s.items:
            axes = item.axes if isinstance(item, notation.Group) else (item,)
            size = 1
            for a in axes:
                size *= whole // _RANKS_PER_DIM ** len(a.mesh_components)
            shape.append(size)
        shapes.append(tuple(shape))
    mesh = Mesh.virtual((_RANKS_PER_DIM,) * len(dims), dims) if dims else None
    return text, explain(text, *shapes, mesh=mesh)


def _forward(rows, tensor: str | None = None, exclude=()):
    return tuple(
        PlanStep(r.move, (r.mesh_dims,) if r.mesh_dims else ())
        for r in rows
        if r.phase == "forward"
        and (tensor is None or r.tensor.split(": ")[-1].startswith(tensor))
        and not any(r.tensor.split(": ")[-1].startswith(e) for e in exclude)
    )


def build_unary_transition_plan(input_spec, output_spec):
    """The forward steps einshard runs for ``input_spec -> output_spec``."""
    text, e = _explained([input_spec, output_spec])
    return UnaryTransitionPlan(text, _forward(e.rows))


def build_binary_transition_plan(input0_spec, input1_spec, output_spec):
    """The forward steps einshard runs for ``input0_spec, input1_spec -> output_spec``, by tensor."""
    text, e = _explained([input0_spec, input1_spec, output_spec])
    return BinaryTransitionPlan(
        text,
        _forward(e.rows, "operand 0"),
        _forward(e.rows, "operand 1"),
        _forward(e.rows, exclude=("operand 0", "operand 1")),
    )


# -- policies ---------------------------------------------------------------------------------


def resolve_plan_policy(optimize=None, policy=None):
    """``policy=``, else ``optimize=``, else the innermost ``optimize`` scope, else the default, else training.

    Either argument may be a mode name or a ``PlanPolicy``; both at once is an error.
    """
    if isinstance(policy, str):
        if optimize is not None:
            resolve_policy(optimize, PlanPolicy.from_mode(policy))  # raises: both given
        return PlanPolicy.from_mode(policy)
    return resolve_policy(optimize, policy)


def get_default_policy():
    """The policy ``set_default_policy`` set (``"training"`` when none), whatever scope is open."""
    with scoped(None):
        return resolve_policy()


def get_optimization_policy():
    """The policy a call without ``optimize=`` or ``policy=`` uses here (scope, then default)."""
    return resolve_policy()
