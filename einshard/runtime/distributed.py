"""Distributed ``einshard``: resolve layouts, plan once, replay.

One call: resolve this rank's layouts (:mod:`einshard.plan.resolve`), agree on
errors when checks are on, pick the cheapest candidate
(:mod:`einshard.plan.contraction`), then run it: operand transitions, the
local einsum, the result transition. Plans are cached per (formula, local
shapes, split shapes, sizes, mesh, dtype, policy, ambient split shapes).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from itertools import pairwise

from ..comm import checks
from ..comm.mesh import Mesh, mesh_required, resolve_mesh
from ..core import _context
from ..core._cache import BoundedCache
from ..core.layout import MeshShape
from ..core.policy import resolve_policy
from ..errors import EinshardError, naming
from ..notation import expand
from ..plan.contraction import Problem, duty_dims, plan_schedule
from ..plan.local import Contraction, expand_sizes
from ..plan.resolve import freeze_shapes, resolve
from ..plan.stationary import is_stationary, needs_mesh_for_grad, stationary_plan, why_mesh
from .execute import Embedding, transition
from .pipeline import agree, check_dtypes, check_tensors

__all__ = ["run_distributed", "DistributedPlan", "plan_distributed"]

_PLANS = BoundedCache(16384, name="einshard.runtime.distributed.plans")


class DistributedPlan:
    """A chosen schedule bound to this rank: call ``run`` with the local tensors."""

    __slots__ = ("problem", "schedules", "chosen", "resolved", "mesh", "run", "local_error", "fingerprint",
                 "_compiled", "_traced_run", "_partials", "_replays")

    def grad_partials(self) -> tuple:
        """Per operand: the mesh dimensions its gradient comes back partial over (a gradient duty's groups)."""
        if getattr(self, "_partials", None) is None:
            self._partials = self._grad_partials()
        return self._partials

    def _grad_partials(self) -> tuple:
        n = len(self.problem.operands)
        out: list[frozenset] = [frozenset()] * n
        origin: list[int | None] = list(range(n))  # the original operand at each position of the running operand list
        for indices, _axes, cand in self.chosen.steps:
            for k, i in enumerate(indices):
                grad = cand.grad_of(k)
                if grad is not None and origin[i] is not None:
                    out[origin[i]] = grad.partial - self.problem.operands[origin[i]].partial
            origin = [o for j, o in enumerate(origin) if j not in indices] + [None]
        return tuple(out)

    def __init__(self, problem, schedules, resolved, mesh):
        self.problem = problem
        self.schedules = schedules
        self.chosen = schedules[0]
        self.resolved = resolved
        self.mesh = mesh
        self.local_error = resolved.local_error
        self.run = None
        self._compiled: tuple | None = None  # (stages, final transition), built by compile
        self._traced_run = None
        self._replays: dict = {}  # per operand, whether it needs a gradient -> the replay (see replay)
        # equal on every rank when they agree on global sizes and split shapes (checked with checks on)
        self.fingerprint = zlib.crc32(repr((problem.operands, problem.output)).encode())

    def describe(self) -> str:
        """The global sizes and split shapes this rank derived (for cross-rank error messages)."""
        seen: dict = {}
        for layout in (*self.problem.operands, self.problem.output):
            for axis, size, dims, splits in zip(layout.axes, layout.sizes, layout.shard, layout.splits):
                if axis not in seen:
                    seen[axis] = f"{axis}={size}" + (f" split {list(splits)} over {'-'.join(dims)}" if dims else "")
        return "global sizes " + ", ".join(seen.values())

    def compile(self) -> DistributedPlan:
        mesh = self.mesh
        layouts = list(self.problem.operands)
        compiled = []
        for indices, _axes, cand in self.chosen.steps:
            chains = []
            for k, i in enumerate(indices):
                steps = cand.chains[k]
                assert steps[0] == layouts[i]
                grad = cand.grad_of(k)
                chain = [transition(a, b, mesh, grad if n == 0 else None) for n, (a, b) in enumerate(pairwise(steps))]
                chains.append(tuple(t for t in chain if not t.trivial))
            contraction = Contraction([t.axes for t in cand.targets], cand.result.axes,
                                      sizes=[dict(zip(t.axes, t.sizes)) for t in cand.targets])
            embedding = None
            if cand.embedded is not None and cand.embedded != cand.result:
                root = tuple(d for d, r in zip(mesh.names, cand.roles) if r == ("E", None))
                embedding = Embedding(cand.result, cand.embedded, root, mesh)
            compiled.append((tuple(indices), tuple(chains), contraction, embedding))
            layouts = [op for j, op in enumerate(layouts) if j not in indices] + [cand.embedded or cand.result]
        finish = transition(layouts[-1], self.problem.output, mesh)
        self._compiled = (tuple(compiled), None if finish.trivial else finish)
        self.run = self._runner(traced=False)
        return self

    def _runner(self, traced: bool):
        """The replay: eager (autograd mappings on raw collectives) or traced (functional collectives)."""
        assert self._compiled is not None  # compile ran
        compiled, finish = self._compiled
        stages = []
        for indices, chains, contraction, embedding in compiled:
            if traced:
                chains = tuple(tuple(t.prepare_traced().traced for t in chain) for chain in chains)
                core = contraction.run_traced
            else:
                core = contraction.run
            if embedding is not None:
                core = _then(core, embedding.traced if traced else embedding)
            stages.append((indices, chains, core))
        _, _, last_contraction, last_embedding = compiled[-1]
        if finish is not None and traced:
            finish = finish.prepare_traced().traced
        elif finish is not None and last_contraction.fresh and last_embedding is None:
            finish = finish.owning()  # the product is this plan's own tensor: a sum over ranks goes into it
        in_shapes = self.resolved.in_shapes
        out_shape = self.resolved.out_shape
        single = len(stages) == 1

        def run(tensors):
            xs = [x if shape is None else x.reshape(shape) for x, shape in zip(tensors, in_shapes)]
            for indices, chains, core in stages:
                args = []
                for i, chain in zip(indices, chains):
                    x = xs[i]
                    for t in chain:
                        x = t(x)
                    args.append(x)
                y = core(args)
                xs = [y] if single else [x for j, x in enumerate(xs) if j not in indices] + [y]
            y = xs[-1]
            if finish is not None:
                y = finish(y)
            return y if out_shape is None else y.reshape(out_shape)

        return run

    def replay(self, grads: tuple) -> Callable:
        """The eager replay for a caller that has checked, once for the whole call, that checks are off, no
        ``torch.func`` transform is active and dynamo does not trace it, and knows which operands need a
        gradient (``grads``, per operand: grad mode is on and it requires grad): the same reshapes, steps,
        autograd nodes and torch calls as :attr:`run`, each transition called as it is for such an operand
        (:meth:`~einshard.runtime.execute.Transition.eager`), with nothing tested per transition."""
        found = self._replays.get(grads)
        if found is None:
            found = self._replays[grads] = self._replay(grads)
        return found

    def _replay(self, grads: tuple) -> Callable:
        assert self._compiled is not None  # compile ran
        compiled, finish = self._compiled
        needs = list(grads)  # per operand of the running list: whether it needs a gradient
        stages = []
        for indices, chains, contraction, embedding in compiled:
            operands = []  # per operand of the stage: its transitions as one callable (None: none)
            for i, chain in zip(indices, chains):
                calls = [t.eager(needs[i]) for t in chain]
                operands.append(None if not calls else calls[0] if len(calls) == 1 else _chained(calls))
            core = contraction.run if embedding is None else _then(contraction.run, embedding)
            stages.append((indices, tuple(operands), core))
            needs = [n for j, n in enumerate(needs) if j not in indices] + [any(needs[i] for i in indices)]
        _, _, last_contraction, last_embedding = compiled[-1]
        if finish is not None and last_contraction.fresh and last_embedding is None:
            finish = finish.owning()  # as in run: a sum over ranks goes into the product itself
        end = None if finish is None else finish.eager(needs[-1])
        in_shapes, out_shape = self.resolved.in_shapes, self.resolved.out_shape
        reshaped = any(s is not None for s in in_shapes)
        if len(stages) == 1 and not reshaped:
            indices, preps, core = stages[0]
            if indices == tuple(range(len(in_shapes))):  # one product of the operands as they come
                body = core if not any(preps) else _prepared(preps, core)
                return _finished(body, end, out_shape)

        def run(tensors):
            xs = [x if shape is None else x.reshape(shape) for x, shape in zip(tensors, in_shapes)] if reshaped \
                else list(tensors)
            for indices, preps, core in stages:
                y = core([xs[i] if f is None else f(xs[i]) for i, f in zip(indices, preps)])
                xs = [x for j, x in enumerate(xs) if j not in indices] + [y]
            return xs[-1]

        return _finished(run, end, out_shape)

    def traced_run(self):
        """The replay for code that dynamo traces (built once, at trace time)."""
        if self._traced_run is None:
            self._traced_run = self._runner(traced=True)
        return self._traced_run


def _then(core, embedding):
    return lambda tensors: embedding(core(tensors))


def _chained(calls):
    """One operand's transitions, in order."""
    def chain(x):
        for call in calls:
            x = call(x)
        return x

    return chain


def _prepared(preps, core):
    """``core`` on the operands, each through its transitions (``None``: none)."""
    if len(preps) == 2:  # (most formulas: no loop)
        first, second = preps
        if second is None:
            return lambda tensors: core((first(tensors[0]), tensors[1]))
        if first is None:
            return lambda tensors: core((tensors[0], second(tensors[1])))
    return lambda tensors: core([x if f is None else f(x) for x, f in zip(tensors, preps)])


def _finished(body, end, out_shape):
    """``body``, then the result's transition ``end`` (``None``: none) and its reshape to ``out_shape``."""
    if end is None:
        return body if out_shape is None else lambda tensors: body(tensors).reshape(out_shape)
    if out_shape is None:
        return lambda tensors: end(body(tensors))
    return lambda tensors: end(body(tensors)).reshape(out_shape)


@naming()
def plan_distributed(parsed, local_shapes, itemsize, mesh, shapes, sizes, policy, families=(), duties=()):
    """Resolve and plan (no communication); returns a :class:`DistributedPlan` (not yet compiled).

    ``duties``: per operand, the mesh dimensions its gradient may stay partial over
    (``None``: none, ``plan.contraction.ANY``: wherever it varies), see :mod:`einshard.params`.
    """
    ambient = _context.shapes_for(mesh)
    sizes = expand_sizes(parsed, sizes, families)
    resolved = resolve(parsed, local_shapes, mesh, shapes=shapes, sizes=sizes, ambient=ambient)
    if duties:
        duties = duty_dims(duties, mesh.names)
        for k, (duty, layout) in enumerate(zip(duties, resolved.operands)):
            if duty is not None and layout.partial:
                raise EinshardError(f"operand {k} carries a gradient duty, so it must not be partial (// ...)")
    problem = Problem(
        resolved.operands,
        resolved.output,
        MeshShape.of(mesh),
        itemsize,
        resolved.summed,
        resolved.fixed,
        grad_duties=tuple(duties) if any(d is not None for d in duties) else (),
    )
    return DistributedPlan(problem, plan_schedule(problem, policy), resolved, mesh)


def _frozen_shapes(key, shapes):
    try:
        return None if shapes is None else freeze_shapes(shapes)
    except EinshardError as err:
        raise err.within(key[0])  # noqa: B904 - the caught error itself, named


def _agree_on_plan(plan, mesh, key, facts, always=False) -> None:
    """Raise this rank's layout error; with checks on (or ``always``), every rank raises when any rank has one."""
    agree(
        mesh,
        None if plan.local_error is None else EinshardError.named(plan.local_error, key[0]),
        fingerprint=plan.fingerprint,
        what=f"the operands of {key[0]!r}",
        describe=plan.describe,
        facts=facts,
        point="einshard",
        always=always,
    )


def run_distributed(key, tensors, mesh, shapes, optimize, policy, duties=(), plan_out=None, ambient=None):
    """Run a distributed formula (called by :func:`einshard.einshard`).

    ``key`` is einshard's ``(formula, sizes key, families key, *local shapes)``;
    ``duties`` the operands' gradient duties (see :func:`plan_distributed`);
    ``plan_out``: a list the plan run is appended to; ``ambient``: the context the caller read already.
    """
    if ambient is None:
        ambient = _context.current()
    if mesh is None:
        mesh = ambient.mesh
        if mesh is None:
            return _stationary(key, tensors).run(tensors)
    elif type(mesh) is not Mesh and not isinstance(mesh, Mesh):
        mesh = resolve_mesh(mesh)
    if shapes is None and optimize is None and policy is None and not checks.ENABLED:
        # the steady state: no argument to validate, no agreement; the plan found from the cheap key runs
        plan = _PLANS.get((key, mesh, None, resolve_policy(), ambient.shapes_key, duties,
                           *[getattr(t, "dtype", None) for t in tensors]))
        if plan is not None and plan.local_error is None:
            if plan_out is not None:
                plan_out.append(plan)
            return plan.run(tensors)
    # an explicit shapes= that one rank's block contradicts: every rank raises together, checks on or off
    # (one agreement per call; see docs/reliability.md)
    always = shapes is not None and mesh.has_process_groups()
    try:
        pol = resolve_policy(optimize, policy)
        frozen_shapes = _frozen_shapes(key, shapes)
    except ValueError as err:  # the arguments may be wrong on one rank only: agreed when checks are on
        if checks.ENABLED or always:
            agree(mesh, err, point="einshard", always=always)
        raise
    # a non-tensor operand has no dtype: no plan is cached for it (the operand check below reports it, agreed)
    full_key = (key, mesh, frozen_shapes, pol, ambient.shapes_key, duties,
                *[getattr(t, "dtype", None) for t in tensors])
    plan = _PLANS.get(full_key)
    if plan is None:
        try:
            check_tensors(expand(key[0], key[2]), tensors)
        except ValueError as err:
            if checks.ENABLED or always:
                agree(mesh, err, point="einshard", always=always)
            raise
        plan = _new_plan(full_key, key, [tuple(t.shape) for t in tensors], [t.dtype for t in tensors], mesh, shapes,
                         pol, duties)
    if plan_out is not None:
        plan_out.append(plan)
    if plan.local_error is not None or checks.ENABLED or always:
        _agree_on_plan(plan, mesh, key, (("dtypes", tuple(t.dtype for t in tensors)),
                                         ("devices", tuple(t.device for t in tensors))), always)
    return plan.run(tensors)


def _stationary(key, tensors=None):
    """No mesh anywhere: the plan of a formula whose sharded axes do not move, on the local blocks.

    ``tensors``: the eager operands (checked, and none may need a gradient summed over ranks); ``None`` when traced.
    """
    parsed = expand(key[0], key[2])
    if tensors is not None:
        check_tensors(parsed, tensors)
    if not is_stationary(parsed, key[1]):
        raise mesh_required(repr(key[0]), why_mesh(parsed))
    why = None if tensors is None else needs_mesh_for_grad(parsed, tensors)
    if why is not None:
        raise mesh_required(repr(key[0]), why)
    return stationary_plan(key, parsed, [tuple(s) for s in key[3:]])


def _new_plan(full_key, key, local_shapes, dtypes, mesh, shapes, pol, duties=()):
    formula, sizes, families = key[0], key[1], key[2]
    parsed = expand(formula, families)
    try:
        check_dtypes(formula, dtypes)
        itemsize = max(d.itemsize for d in dtypes)
        plan = plan_distributed(parsed, local_shapes, itemsize, mesh, shapes, sizes, pol, families, duties).compile()
    except ValueError as err:
        always = shapes is not None and mesh.has_process_groups()
        if checks.ENABLED or always:
            agree(mesh, err, point="einshard", always=always)
        raise
    return _PLANS.put(full_key, plan)


def traced_run(key, dtypes, mesh, shapes, optimize, policy, ambient):
    """The traced replay of a distributed formula (called at trace time, see ``einshard._traced``).

    ``key`` is einshard's ``(formula, sizes key, families key, *local shapes)``.
    Errors are raised here, while tracing; with checks on, the ranks agree on
    them as in eager mode (every rank traces the same program).
    """
    if mesh is None:  # no mesh anywhere: only a stationary formula runs (on the local blocks)
        return _stationary(key).run_traced
    if not isinstance(mesh, Mesh):
        mesh = resolve_mesh(mesh)
    pol = resolve_policy(optimize, policy)
    frozen_shapes = _frozen_shapes(key, shapes)
    full_key = (key, mesh, frozen_shapes, pol, ambient.shapes_key, *dtypes)
    plan = _PLANS.get(full_key)
    if plan is None:
        plan = _new_plan(full_key, key, [tuple(s) for s in key[3:]], list(dtypes), mesh, shapes, pol)
    always = shapes is not None and mesh.has_process_groups()
    if plan.local_error is not None or checks.ENABLED or always:  # (at trace time: once per graph)
        _agree_on_plan(plan, mesh, key, (("dtypes", tuple(dtypes)),), always)
    return plan.traced_run()
