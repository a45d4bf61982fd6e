"""``es.einshard``: the entry point for local and distributed formulas."""

from __future__ import annotations

import operator

import torch

from ..comm import checks
from ..core import _context, _trace
from ..core._cache import BoundedCache
from ..core._torch_compat import compile_in_progress, functorch_transforms_active, in_traced_code
from ..core.policy import resolve_policy
from ..errors import EinshardError
from ..notation import Axis, TensorSpec, expand, freeze_families
from ..params.formula import (
    ANY,
    check_not_stored,
    check_params_first,
    duty_of,
    formula_names,
    recorded_shapes,
    recorder_for,
    resolve_pending,
    state_duties,
)
from ..params.metadata import named_sizes
from ..params.replicated import keep_duties_on_root
from ..params.state import ParameterState
from ..params.store import PARAM_STATE_ATTR
from ..plan.local import build_local_plan, freeze_sizes
from ..runtime import vma as _vma
from ..runtime.dispatch import dispatch
from ..runtime.distributed import run_distributed, traced_run
from ..runtime.pipeline import check_tensors

__all__ = ["einshard", "duties_satisfied"]

# (formula, sizes key, families key, *input shapes) -> LocalPlan
_LOCAL_PLANS = BoundedCache(65536, name="einshard.ops.einshard.local_plans")
# (formula, families key) known to be distributed -> its [param] recorder (None: no [param])
_DISTRIBUTED = BoundedCache(name="einshard.ops.einshard.distributed")
_MAX_DISTRIBUTED = 4096
_MISSING = object()
_shape = operator.attrgetter("shape")
_VMA_RECORDERS = BoundedCache(name="einshard.ops.einshard.vma_recorders")
_transforms_active = functorch_transforms_active
# (key, recorded global shapes) -> the key with their sizes
_SIZED_KEYS = BoundedCache(4096, name="einshard.ops.einshard.sized_keys")
# (formula, sizes key, families key, *local shapes, id(mesh), id(ambient mesh), ambient split shapes, id(policy),
#  grad mode, per operand: dtype, device, requires_grad (and for a tensor subclass: its type, id(its state)))
#  -> (the plan's replay, the objects whose ids the key holds): see _replayed
_REPLAYS = BoundedCache(4096, name="einshard.ops.einshard.replays")
_TENSOR = torch.Tensor
_SATISFIED: list = []  # non-empty inside shard_map(check_vma=True): the body sums every gradient, no duty applies


def einshard(
    formula: str,
    *tensors,
    mesh=None,
    shapes=None,
    sizes=None,
    families=None,
    optimize=None,
    policy=None,
):
    """Evaluate an einsum-like formula on local or sharded tensors.

    Local formulas (no ``/``, no ``//``) lower to ``torch.einsum`` plus
    reshapes. Distributed formulas describe what every rank holds and the
    library inserts the communication (see the notation guide).

    >>> import torch, einshard as es
    >>> x, w = torch.ones(2, 3), torch.ones(4, 3)
    >>> es.einshard("b c, h c -> b h", x, w).shape
    torch.Size([2, 4])
    >>> es.einshard("b (h p) -> b h p", torch.ones(2, 8), sizes={"p": 4}).shape
    torch.Size([2, 2, 4])
    """
    return _EINSHARD(formula, tensors, (mesh, shapes, sizes, families, optimize, policy))


def _eager(formula, tensors, call):
    """The steady state: the local plan of the formula and shapes, or the distributed formula's recorder."""
    mesh, shapes, sizes, families, optimize, policy = call
    if optimize is not None and policy is not None:
        raise EinshardError("einshard: pass either optimize or policy, not both")
    try:
        in_shapes = list(map(_shape, tensors))  # (no Python frame)
    except AttributeError:  # a non-tensor operand: reported by position, whatever is cached
        in_shapes = None
    if in_shapes is None:
        key = (formula, freeze_sizes(sizes), freeze_families(families))
        return _plan_and_run(key, formula, tensors, mesh, shapes, families, optimize, policy)
    if sizes is None and families is None:
        key = (formula, (), (), *in_shapes)
    else:
        key = (formula, freeze_sizes(sizes), freeze_families(families), *in_shapes)
    plan = _LOCAL_PLANS.get(key)
    try:
        if plan is not None:
            if optimize is not None or policy is not None:
                resolve_policy(optimize, policy)  # a cached plan still rejects a bad mode/policy
            if type(plan) is _RecordingPlan:  # [param] operands record the names of this call's mesh
                return plan.run_on(tensors, mesh)
            duties = state_duties(tensors)
            if duties:
                return plan.run(_local_duties(formula, tensors, duties, mesh))
            return plan.run(tensors)
        recorder = _DISTRIBUTED.get((formula, key[2]), _MISSING)
        if recorder is None:  # a distributed formula without [param]: only attached states can carry duties
            return _run_unrecorded(key, tensors, mesh, shapes, optimize, policy)
        if recorder is not _MISSING:
            return _run_recorded(recorder, key, tensors, mesh, shapes, optimize, policy)
    except (AttributeError, TypeError, RuntimeError):
        # a cached plan met operands that are not tensors, or of mixed dtypes: the same
        # ValueError as on the first call, then anything else as it is
        check_tensors(expand(formula, key[2]), tensors)
        raise
    return _plan_and_run(key, formula, tensors, mesh, shapes, families, optimize, policy)


def _plan_and_run(key, formula, tensors, mesh, shapes, families, optimize, policy):
    resolve_policy(optimize, policy)  # validates the mode/policy even where nothing is chosen
    try:
        parsed = expand(formula, key[2])
    except ValueError:
        check_params_first(formula, key[2], tensors, formula_names(mesh))  # [param] metadata errors first
        raise
    recorder = recorder_for(formula, parsed)
    prepared = None
    if recorder is not None and parsed.is_local and not _SATISFIED:
        prepared = recorder.prepare(tensors, formula_names(mesh))  # metadata errors first
    if parsed.is_local:
        check_tensors(parsed, tensors)
        check_not_stored(tensors, formula)
    scalar = _scalar_form(parsed, tensors)
    if scalar is not None:  # 'loss // (sp, dp) -> loss' on 0-d tensors: the same as '// (sp, dp) -> '
        return einshard(scalar, *tensors, mesh=mesh, shapes=shapes, optimize=optimize, policy=policy)
    if not parsed.is_local:
        _known_distributed((formula, key[2]), recorder)
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            # checked by run_distributed, with the other ranks when checks are on (one rank's bad operand
            # must not leave the others waiting in the agreement)
            return run_distributed(key, tensors, mesh, shapes, optimize, policy)
        if recorder is not None:
            return _run_recorded(recorder, key, tensors, mesh, shapes, optimize, policy)
        return _run_unrecorded(key, tensors, mesh, shapes, optimize, policy)
    plan = build_local_plan(parsed, [tuple(t.shape) for t in tensors], key[1], key[2])
    if recorder is not None:
        plan = _RecordingPlan(plan, recorder)
    _LOCAL_PLANS.put(key, plan)
    if recorder is not None:
        if _SATISFIED:
            return plan.plan.run(tensors)
        out = plan.plan.run(_local_duties(formula, tensors, recorder.duties(tensors, prepared), mesh))
        recorder.commit(tensors, prepared)
        return out
    return plan.run(_local_duties(formula, tensors, state_duties(tensors), mesh))


class duties_satisfied:
    """Within the block formulas plan no gradient duty: every gradient is whole (a tracked ``shard_map``
    body, which sums them itself)."""

    __slots__ = ()

    def __enter__(self):
        _SATISFIED.append(True)
        return self

    def __exit__(self, *exc):
        _SATISFIED.pop()
        return False


def _local_duties(formula, tensors, duties, mesh):
    """A local formula's operands with gradient duties (``duties``, per operand), each kept on group rank 0
    of its groups for backward (:mod:`einshard.params.replicated`); as they are in a
    ``shard_map(check_vma=True)`` body, which sums every gradient itself."""
    if not duties or _SATISFIED or _in_tracked_body():
        return tensors
    return keep_duties_on_root(formula, tensors, duties, mesh)


def _in_tracked_body() -> bool:
    """Whether a ``shard_map(check_vma=True)`` body runs here (read from the ambient context, so a
    recompute that restores the body's context plans as its forward did)."""
    return _tracks(_context.current())


def _tracks(ambient) -> bool:
    """Whether ``ambient`` is the context of a ``shard_map(check_vma=True)`` body."""
    body = ambient.shard_map
    return body is not None and body.tracker is not None


def _tracked(ambient, formula, tensors, call):
    """``einshard`` in a body that tracks variance: the variance rules around the untracked call."""
    mesh, shapes, sizes, families, optimize, policy = call
    kwargs = {"mesh": mesh, "shapes": shapes, "sizes": sizes, "families": families, "optimize": optimize,
              "policy": policy}
    tracker = ambient.shard_map.tracker
    if not tracker.traced:  # eager: the body's parameters, whose gradients it sums (see einshard.params.summed)
        for t in tensors:
            if isinstance(t, torch.nn.Parameter):
                tracker.params[id(t)] = t
    recorder = _vma_recorder(formula, kwargs["families"])
    if recorder is None:
        return _vma.formula_op_in(ambient, einshard, formula, tensors, kwargs)
    # [param] here: the body's pvary reduces the gradient, so the duty is recorded as satisfied (vma)
    prepared = recorder.prepare(tensors, formula_names(kwargs["mesh"]), backend="vma")
    _SATISFIED.append(True)
    try:
        out = _vma.formula_op_in(ambient, einshard, formula, tensors, kwargs)
    finally:
        _SATISFIED.pop()
    recorder.commit(tensors, prepared)
    return out


def _vma_recorder(formula, families):
    if in_traced_code():  # looked up at trace time: dynamo would trace the parser, and guard on the cache
        return _trace.lookup(_vma_recorder_at_trace_time(formula, families))
    frozen = None if families is None else freeze_families(families)
    key = formula if frozen is None else (formula, frozen)  # (a plain string: no families)
    found = _VMA_RECORDERS.get(key, _MISSING)
    if found is _MISSING:
        try:
            found = recorder_for(formula, expand(formula, frozen))
        except ValueError:
            found = None  # the op reports a bad formula itself
        _VMA_RECORDERS.put(key, found)
    return found


@_trace.constant_result
def _vma_recorder_at_trace_time(formula, families) -> str:
    return _trace.register(_vma_recorder(formula, families))


def _known_distributed(key, recorder) -> None:
    """Remember that ``(formula, families key)`` is distributed, with its recorder (at most ``_MAX_DISTRIBUTED``)."""
    _DISTRIBUTED.limit = _MAX_DISTRIBUTED
    _DISTRIBUTED.put(key, recorder)


def _with_recorded_sizes(key, tensors):
    """``key`` with the sizes the operands' recorded global shapes give (``sizes=`` for their axes), so the
    formula checks their blocks and knows their split shapes; ``key`` itself when none records one."""
    check_not_stored(tensors, key[0])
    found = recorded_shapes(tensors)
    if not found:
        return key
    memo = (key, found)
    sized = _SIZED_KEYS.get(memo)
    if sized is None:
        sized = _SIZED_KEYS.put(memo, _sized_key(key, found))
    return sized


def _sized_key(key, found):
    parsed = expand(key[0], key[2])
    sizes = dict(key[1])
    for k, whole in enumerate(found):
        if whole is None or k >= len(parsed.inputs):
            continue
        named = named_sizes(parsed.inputs[k], whole)
        sharded = {a.name for a in parsed.inputs[k].axes if a.mesh}  # (unsharded sizes are the local ones)
        for axis, n in (named or {}).items():
            if axis in sharded and sizes.setdefault(axis, n) != n:
                raise EinshardError(f"{key[0]!r}: operand {k}'s recorded global shape {whole} gives axis {axis!r} "
                                    f"the size {n}, but {sizes[axis]} is known for it (sizes= or another operand)")
    return (key[0], freeze_sizes(sizes), *key[2:])


def _run_recorded(recorder, key, tensors, mesh, shapes, optimize, policy):
    """A distributed formula with [param] operands: states prepared first, attached after success."""
    key = _with_recorded_sizes(key, tensors)
    if _SATISFIED or _in_tracked_body():  # in shard_map(check_vma=True): recorded by the caller; the formula reduces
        return run_distributed(key, tensors, mesh, shapes, optimize, policy)
    names = formula_names(mesh)
    prepared = recorder.prepare(tensors, names)
    plans: list = []
    out = run_distributed(key, tensors, mesh, shapes, optimize, policy, recorder.duties(tensors, prepared), plans)
    if plans:
        recorder.commit(tensors, prepared, plans[0].grad_partials(), plans[0].mesh.names)
    else:  # no mesh: a stationary formula ran on the local blocks (rank-local inference only)
        recorder.commit(tensors, prepared)
    return out


def _run_unrecorded(key, tensors, mesh, shapes, optimize, policy):
    """A distributed formula without [param]: replayed (:func:`_replayed`) when checks are off, no argument
    is given to validate and no ``torch.func`` transform is active; else planned and run with its checks."""
    if shapes is None and optimize is None and policy is None and not (checks.ENABLED or _SATISFIED
                                                                       or _transforms_active()):
        return _replayed(key, tensors, mesh)
    return _run_with_states(key, tensors, mesh, shapes, optimize, policy)


def _replayed(key, tensors, mesh):
    """The steady state of a distributed formula without [param], checks off: the replay kept under the
    :data:`_REPLAYS` key of this call, or the call planned (:func:`_run_with_states`) and its replay kept."""
    ambient = _context.current()
    if _tracks(ambient):  # the untracked call in shard_map(check_vma=True)
        return _run_with_states(key, tensors, mesh, None, None, None, ambient=ambient)
    policy = resolve_policy()
    grad = torch.is_grad_enabled()
    facts = [key, id(mesh), id(ambient.mesh), ambient.shapes_key, id(policy), grad]
    for t in tensors:
        if type(t) is _TENSOR:  # (no attached state)
            facts += (t.dtype, t.device, t.requires_grad)
        else:
            facts += (t.dtype, t.device, t.requires_grad, type(t), id(getattr(t, PARAM_STATE_ATTR, None)))
    replay_key = tuple(facts)
    found = _REPLAYS.get(replay_key)
    if found is not None:
        return found[0](tensors)
    return _run_with_states(key, tensors, mesh, None, None, None, ambient=ambient, keep=(replay_key, policy, grad))


def _run_with_states(key, tensors, mesh, shapes, optimize, policy, ambient=None, keep=None):
    """A distributed formula without [param]: the operands' attached states may carry gradient duties.

    ``keep``: ``(replay key, policy, grad mode)`` of :func:`_replayed`: the plan's replay is kept under that key.
    """
    key = _with_recorded_sizes(key, tensors)
    if ambient is None:
        ambient = _context.current()
    if _SATISFIED or _tracks(ambient):  # inside shard_map(check_vma=True): the formula reduces every gradient
        return run_distributed(key, tensors, mesh, shapes, optimize, policy, ambient=ambient)
    duties = state_duties(tensors)
    pending = ANY in duties
    if not pending and keep is None:
        return run_distributed(key, tensors, mesh, shapes, optimize, policy, duties, ambient=ambient)
    plans: list = []  # the plan run: it resolves attached pending duties after success, or its replay is kept
    out = run_distributed(key, tensors, mesh, shapes, optimize, policy, duties, plans, ambient=ambient)
    if plans and pending:
        resolve_pending(tensors, duties, plans[0].grad_partials(), plans[0].mesh.names)
    elif plans and keep is not None:
        _keep_replay(keep, plans[0], tensors, mesh, ambient)
    return out


def _keep_replay(keep, plan, tensors, mesh, ambient) -> None:
    """Keep ``plan``'s replay under the replay key of :func:`_replayed`, with the objects whose ids the key holds
    (so no other object takes one of those ids while the replay is kept)."""
    replay_key, policy, grad = keep
    states = tuple(getattr(t, PARAM_STATE_ATTR, None) for t in tensors if type(t) is not _TENSOR)
    run = plan.replay(tuple(grad and t.requires_grad for t in tensors))
    _REPLAYS.put(replay_key, (run, (mesh, ambient.mesh, policy, states)))


class _RecordingPlan:
    """A local plan whose [param] operands record their states after each successful run.

    Cached by formula and shapes, not by mesh: each run records the names of its own call's
    ``mesh=`` (or the ambient mesh), see :meth:`run_on`.
    """

    __slots__ = ("plan", "recorder")

    def __init__(self, plan, recorder):
        self.plan, self.recorder = plan, recorder

    @property
    def run_traced(self):  # traced (torch.compile): nothing is recorded
        return self.plan.run_traced

    def run(self, tensors):
        return self.run_on(tensors, None)

    def run_on(self, tensors, mesh):
        if _SATISFIED:
            return self.plan.run(tensors)
        prepared = self.recorder.prepare(tensors, formula_names(mesh))
        duties = self.recorder.duties(tensors, prepared)
        out = self.plan.run(_local_duties(self.recorder.formula, tensors, duties, mesh))
        self.recorder.commit(tensors, prepared)
        return out


def _scalar_form(parsed, tensors) -> str | None:
    """For 0-d tensors named by one unsharded axis everywhere (``loss // dp -> loss``), the formula without it."""
    if parsed.output is None or not tensors or any(not isinstance(t, torch.Tensor) or t.dim() != 0 for t in tensors):
        return None
    names = set()
    for spec in parsed.tensors:
        if len(spec.items) != 1 or not isinstance(spec.items[0], Axis) or spec.items[0].mesh is not None:
            return None
        names.add(spec.items[0].name)
    if len(names) != 1:
        return None
    stripped = [str(TensorSpec((), s.partial)) for s in parsed.tensors]
    return ", ".join(stripped[:-1]) + " -> " + stripped[-1]


# -- under torch.compile ------------------------------------------------------------------------


def _traced(formula, tensors, call):
    """``einshard`` while a graph is made: plan at trace time, trace only the replay (gradient duties are not
    planned here: see the parameters guide).

    :func:`_plan_for_trace` runs as ordinary Python while dynamo traces and
    returns the name of the plan's replay function (a constant of the graph), so parsing, checks and planning cost
    nothing at run time; the plan's replay (reshapes, the einsum, functional
    collectives) is what dynamo traces.
    """
    mesh, shapes, sizes, families, optimize, policy = call
    for i, t in enumerate(tensors):  # traced by dynamo
        if not isinstance(t, torch.Tensor):
            _trace.refuse(f"{formula!r}: operand {i} must be a torch.Tensor, got {type(t).__name__}")
    ambient = _context.current()
    _refuse_attached_duties(formula, tensors)
    name = _plan_for_trace(
        formula,
        tuple(_trace.static_shape(t) for t in tensors),
        tuple(t.dtype for t in tensors),
        mesh if mesh is not None else ambient.mesh,
        _trace.static_value(shapes),
        _trace.static_value(sizes),
        families,
        optimize,
        policy,
        ambient.mesh,
        ambient.shapes,
        checks.ENABLED,  # read in traced code: turning checks on or off traces again (they agree at trace time)
    )
    return _trace.lookup(name)(tensors)


@_trace.constant_result
def _plan_for_trace(formula, shapes, dtypes, mesh, split_shapes, sizes, families, optimize, policy, amb_mesh,
                    amb_shapes, checks_on):
    with _context.at_trace_time(amb_mesh, amb_shapes) as ambient:
        return _plan_at_trace_time(formula, shapes, dtypes, mesh, split_shapes, sizes, families, optimize, policy,
                                   ambient)


def _plan_at_trace_time(formula, shapes, dtypes, mesh, split_shapes, sizes, families, optimize, policy, ambient):
    if optimize is not None and policy is not None:
        raise EinshardError("einshard: pass either optimize or policy, not both")
    key = (formula, freeze_sizes(sizes), freeze_families(families), *[torch.Size(s) for s in shapes])
    plan = _LOCAL_PLANS.get(key)
    if plan is None and (formula, key[2]) not in _DISTRIBUTED:
        resolve_policy(optimize, policy)
        parsed = expand(formula, key[2])
        scalar = _scalar_form(parsed, [torch.empty(s, device="meta") for s in shapes])
        if scalar is not None:  # 'loss // dp -> loss' on 0-d tensors: '// dp -> '
            return _plan_at_trace_time(scalar, shapes, dtypes, mesh, split_shapes, None, None, optimize, policy,
                                       ambient)
        if parsed.is_local:
            plan = _LOCAL_PLANS.put(key, build_local_plan(parsed, list(shapes), key[1], key[2]))
        else:
            _known_distributed((formula, key[2]), recorder_for(formula, parsed))
    if plan is not None:
        return _trace.register(plan.run_traced)
    recorder = _DISTRIBUTED.get((formula, key[2]))
    if recorder is not None:
        _refuse_annotated_duties(recorder, mesh)
    return _trace.register(traced_run(key, dtypes, mesh, split_shapes, optimize, policy, ambient))


_DUTY_UNDER_COMPILE = (
    "{formula!r}: operand {k} carries a gradient duty over {duty}; under torch.compile distributed formulas "
    "reduce every gradient themselves, so the duty's reduction would sum it twice. Compile without the duty "
    "(no grad= annotation or registered native/ddp duty), or run this formula in eager mode"
)


def _refuse_attached_duties(formula, tensors) -> None:
    """ValueError for an operand whose registered state has a gradient duty (traced: before any collective)."""
    for k, duty in enumerate(state_duties(tensors)):
        if duty is not None:
            raise EinshardError(_DUTY_UNDER_COMPILE.format(formula=formula, k=k, duty=_duty_text(duty)))


def _refuse_annotated_duties(recorder, mesh) -> None:
    """ValueError for a ``[param, grad=...]`` operand of a distributed formula traced by torch.compile."""
    names = formula_names(mesh)
    for k in recorder.indices:
        spec = recorder.parsed.inputs[k]
        duty = duty_of(ParameterState.from_spec(spec, mesh_dim_names=names, source="formula"))
        if duty is not None:
            raise EinshardError(_DUTY_UNDER_COMPILE.format(formula=recorder.formula, k=k, duty=_duty_text(duty)))


def _duty_text(duty) -> str:
    return "groups the planner would infer" if duty == ANY else repr(tuple(duty))


# a graph is made whenever a compile is in progress: also in AOTAutograd's trace of a backward, where the plans
# run their functional collectives
_EINSHARD = dispatch(_tracked, _traced, _eager, compile_in_progress)
