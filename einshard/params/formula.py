"""Formulas and gradient duties: who reduces a parameter's gradient, and annotations that record.

One rule decides who sums a gradient over the mesh:

- an operand with **no duty** (a plain tensor, a Parameter without a state, or
  with ``grad=none``) gets its whole gradient from the formula's backward;
- an operand with a **duty over groups G** (``[param, grad=G]`` in the formula,
  or a state registered on the Parameter; native, async, ddp or external) gets
  its gradient left *partial over G* by the formula: the planner skips the
  adjoint of ``pvary`` there (and prices the plan that way), and the duty's
  executor (bucketed hooks, ``reduce_grad_``, the DDP hook, the external
  system) sums it once. A *pending* duty is resolved by the planner: G is the
  set of mesh dimensions the gradient comes back partial over.

``[param]`` annotations record: :class:`FormulaRecorder` builds and merges the
states before anything runs (metadata errors come before any communication)
and attaches them only after the operation succeeds.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch

from ..comm.mesh import Mesh
from ..core import _context
from ..core._cache import BoundedCache
from ..errors import EinshardError
from ..notation import expand_unchecked
from ..plan.contraction import ANY
from .merge import merge_states
from .names import mesh_names
from .operand import is_rank_local, parameter_operand_state
from .state import ParameterGradComm, ParameterState, check_state
from .store import PARAM_STATE_ATTR, prepare_registration, set_parameter_state

__all__ = ["check_not_stored", "duty_of", "state_duties", "recorded_shapes", "explain_duties", "FormulaRecorder",
           "recorder_for", "formula_names", "check_params_first"]

_TENSOR = torch.Tensor
_NO_DUTY_BACKENDS = ("none", "vma")  # vma: satisfied inside shard_map only; outside, the formula reduces


def duty_of(state) -> object:
    """The planner's view of a state's gradient duty: ``None``, ``ANY`` (pending) or the groups.

    >>> from einshard.params import ParameterState
    >>> duty_of(ParameterState.from_layout("c", grad="dp:async"))
    ('dp',)
    >>> duty_of(ParameterState.from_layout("c")) is None
    True
    """
    if state is None:
        return None
    gc = state.grad_comm
    if gc.mode == "none" or gc.backend in _NO_DUTY_BACKENDS:
        return None
    return ANY if gc.pending_inference else gc.mesh_dims


def state_duties(tensors) -> tuple:
    """Per operand, the duty of the state attached to it; ``()`` when none has one (the fast path)."""
    found: list | None = None
    for k, t in enumerate(tensors):
        if type(t) is _TENSOR:
            continue
        duty = duty_of(getattr(t, PARAM_STATE_ATTR, None))
        if duty is not None:
            if found is None:
                found = [None] * len(tensors)
            found[k] = duty
    return () if found is None else tuple(found)


def check_not_stored(tensors, formula: str) -> None:
    """ValueError for a parameter stored sharded (``store=``) given to a formula as it is: the formula
    would compute with its storage slice. Its module's gather (the gradient hooks) gives the compute block."""
    for k, t in enumerate(tensors):
        if type(t) is _TENSOR or not isinstance(t, torch.nn.Parameter):
            continue
        state = getattr(t, PARAM_STATE_ATTR, None)
        if state is not None and state.store is not None:
            raise EinshardError(
                f"{formula!r}: operand {k} is a parameter stored sharded over {state.store!r} (store=, layout "
                f"{state.layout!r}), used without its gather: it holds a slice of its compute block "
                f"{state.compute_layout!r}. Use it inside the forward of the module that owns it, with the hooks "
                "installed (es.params.register_native_grad_reduction_hooks_(model, mesh)), or pass it to es.shard_map "
                "with its es.params.param_specs"
            )


def recorded_shapes(tensors) -> tuple:
    """Per operand, the global shape recorded on its state (``None``: unknown); ``()`` when none has one."""
    found: list | None = None
    for k, t in enumerate(tensors):
        if type(t) is _TENSOR:
            continue
        state = getattr(t, PARAM_STATE_ATTR, None)
        if state is not None and state.global_shape is not None:
            if found is None:
                found = [None] * len(tensors)
            found[k] = state.global_shape
    return () if found is None else tuple(found)


def _groups_of(dims, names) -> tuple[str, ...]:
    """Planner dimensions as duty groups: the atomic names, in mesh order."""
    return tuple(n for n in names if n in dims)


def resolve_pending(tensors, duties, partials, names) -> None:
    """Attached pending duties take the groups the plan left their gradients partial over."""
    for k, duty in enumerate(duties):
        if duty == ANY:
            p = tensors[k]
            set_parameter_state(p, _resolved(getattr(p, PARAM_STATE_ATTR), partials[k], names))


def _resolved(state, dims, names):
    groups = _groups_of(dims, names)
    gc = replace(state.grad_comm, mesh_dims=groups) if groups else ParameterGradComm()
    state = replace(state, grad_comm=gc)
    check_state(state)
    return state


class FormulaRecorder:
    """The ``[param]`` operands of one formula: prepare their states, then attach them after success."""

    __slots__ = ("formula", "parsed", "indices", "local", "_cache", "_steady")

    def __init__(self, formula: str, parsed, indices):
        self.formula = formula
        self.parsed = parsed
        self.indices = tuple(indices)
        self.local = is_rank_local(parsed.inputs, parsed.output)  # pending duties inferred here, else planned
        self._cache = BoundedCache(256)
        # (names, backend, operand ids) -> (weak refs, the states committed last, what to prepare next)
        self._steady = BoundedCache(256)

    def prepare(self, tensors, names, backend=None) -> dict:
        """``{id(p): (p, merged state)}`` for every ``[param]`` operand; raises before anything runs.

        ``backend="vma"``: inside ``shard_map(check_vma=True)``, a gradient duty is recorded as
        satisfied by the body's own reductions. The steady state (the same Parameters, still
        carrying what the last call attached) costs a few identity checks.
        """
        if len(tensors) > max(self.indices):
            key = (names, backend, *[id(tensors[k]) for k in self.indices])
            hit = self._steady.get(key)
            if hit is not None:
                refs, states, prepared = hit
                if all(r() is tensors[k] and getattr(tensors[k], PARAM_STATE_ATTR, None) is s
                       for r, k, s in zip(refs, self.indices, states)):
                    return dict(prepared)
            out = self._prepare(tensors, names, backend)
            out["key"] = key
            return out
        return self._prepare(tensors, names, backend)

    def _prepare(self, tensors, names, backend) -> dict:
        accumulated: dict = {}
        where: dict = {}  # id(p) -> its first operand index
        for k in self.indices:
            if k >= len(tensors):
                raise EinshardError(f"{self.formula!r}: operand {k} is annotated "
                                    "[param] but no tensor was given for it")
            p = tensors[k]
            if not isinstance(p, torch.nn.Parameter) and getattr(p, PARAM_STATE_ATTR, None) is not None:
                raise EinshardError(
                    f"{self.formula!r}: operand {k} is annotated [param] but is the gathered block of a parameter "
                    "stored sharded (store=); its registered state gives its layout and duty: drop the annotation"
                )
            if not isinstance(p, torch.nn.Parameter):
                raise TypeError(
                    f"{self.formula!r}: operand {k} is annotated [param] and must be a torch.nn.Parameter, "
                    f"got {type(p).__name__}"
                )
            try:
                new = parameter_operand_state(
                    p, self.parsed.inputs, self.parsed.output, k, mesh_dim_names=names, source="formula",
                    infer_grad=self.local,
                )
            except ValueError as err:
                raise EinshardError(f"{self.formula!r}: operand {k}: {err}") from None
            if backend is not None and new.grad_comm.mode != "none":
                new = replace(new, grad_comm=replace(new.grad_comm, backend=backend, schedule="backend_default"))
            prev = accumulated.get(id(p))
            if prev is not None:
                new = merge_states(prev[1], new)
            accumulated[id(p)] = (p, new)
            where.setdefault(id(p), k)
        out = {}
        for key, (p, state) in accumulated.items():
            attached = getattr(p, PARAM_STATE_ATTR, None)
            cache_key = (key, names, state)
            hit = self._cache.get(cache_key)
            if hit is not None and hit[0] is attached:
                out[key] = (p, hit[1])
                continue
            try:
                merged = prepare_registration(p, state)
            except ValueError as err:
                raise EinshardError(f"{self.formula!r}: operand {where[key]}: {err}") from None
            if attached is not None and merged.grad_comm.pending_inference and not attached.grad_comm.pending_inference:
                if attached.grad_comm.mode != "none" and attached.grad_comm.backend == merged.grad_comm.backend:
                    # already resolved by an earlier call: keep those groups (one partial layout per gradient)
                    grad_comm = replace(merged.grad_comm, mesh_dims=attached.grad_comm.mesh_dims)
                    merged = replace(merged, grad_comm=grad_comm)
            self._cache.put(cache_key, (attached, merged))
            out[key] = (p, merged)
        return out

    def duties(self, tensors, prepared) -> tuple:
        """Per operand: the prepared state's duty for ``[param]`` operands (and for their Parameter given as
        another operand too), the attached one's elsewhere."""
        base = list(state_duties(tensors) or [None] * len(tensors))
        for k, t in enumerate(tensors):
            entry = prepared.get(id(t))
            if entry is not None:
                base[k] = duty_of(entry[1])
        return tuple(base) if any(d is not None for d in base) else ()

    def commit(self, tensors, prepared, partials=None, names=()) -> None:
        """Attach the prepared states; a pending duty takes the groups the plan left partial (``partials``)."""
        key = prepared.pop("key", None)
        committed = {}
        for k in self.indices:
            p = tensors[k]
            entry = prepared.get(id(p))
            if entry is None:
                continue  # already committed (a Parameter used twice)
            state = entry[1]
            gc = state.grad_comm
            if gc.pending_inference and gc.backend not in _NO_DUTY_BACKENDS and partials is not None:
                state = _resolved(state, partials[k], names)
            if state is not getattr(p, PARAM_STATE_ATTR, None):
                set_parameter_state(p, state)
            committed[id(p)] = (p, getattr(p, PARAM_STATE_ATTR))
            del prepared[id(p)]
        if key is not None:  # the next call with these Parameters, unchanged, prepares exactly this
            refs = tuple(weakref.ref(tensors[k]) for k in self.indices)
            states = tuple(committed[id(tensors[k])][1] for k in self.indices)
            self._steady.put(key, (refs, states, committed))


def explain_duties(parsed, operands) -> tuple:
    """The duties ``es.explain`` plans with: ``[param]`` annotations, else the states of tensor operands."""
    out = list(state_duties([t for t in operands if isinstance(t, _TENSOR)]) or [])
    out = [None] * len(operands) if not out else out
    if len(out) != len(operands):  # shapes among the operands: read the tensors one by one
        out = [duty_of(getattr(t, PARAM_STATE_ATTR, None)) if isinstance(t, _TENSOR) else None for t in operands]
    for k, spec in enumerate(parsed.inputs):
        if k < len(out) and any(a.key == "param" for a in spec.annotations):
            duty = duty_of(ParameterState.from_spec(spec))
            if duty == ANY and out[k] is not None:
                duty = out[k]  # an attached concrete duty decides
            out[k] = duty
    return tuple(out) if any(d is not None for d in out) else ()


def formula_names(mesh) -> tuple:
    """The mesh names a ``[param]`` formula records (the ambient mesh when ``mesh`` is ``None``); fast for
    ``es.Mesh``."""
    if mesh is None:
        mesh = _context.current().mesh
    if type(mesh) is Mesh:
        return mesh.names
    return mesh_names(mesh)


def check_params_first(formula: str, families, tensors, names) -> None:
    """For a formula its meaning rejects: raise its ``[param]`` operands' metadata errors first.

    The states are prepared (and nothing is attached) as for a valid formula, so a layout or duty
    error is reported before the formula's own; returns when there is none (the caller re-raises).
    """
    try:
        unchecked = expand_unchecked(formula, families)
    except ValueError:
        return
    recorder = recorder_for(formula, unchecked)
    if recorder is not None:
        recorder.prepare(tensors, names)


def recorder_for(formula: str, parsed) -> FormulaRecorder | None:
    """The recorder of a parsed formula, or ``None`` when no operand is annotated ``[param]``."""
    indices = [k for k, spec in enumerate(parsed.inputs) if any(a.key == "param" for a in spec.annotations)]
    return FormulaRecorder(formula, parsed, indices) if indices else None
