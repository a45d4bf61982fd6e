"""The one dispatch of the public operations: :func:`dispatch`.

Every operation (``einshard``, ``einfft``, ``einhalo``, ``einwindow``, ``einconv``, ``einroll``) is a call
``op(expression, tensors, call)`` of its :func:`dispatch`, which takes one of three branches, in this order:

1. **variance** — inside ``shard_map(check_vma=True)`` (not inside another library op): the variance rules of
   the formula the op's ``vma_rule`` names run around the untracked call
   (:func:`einshard.runtime.vma.formula_op_in`);
2. **traced** — while dynamo traces the call: the plan is made at trace time from the operands' shapes, dtypes
   and devices (:func:`einshard.runtime.pipeline.traced_plan`), made ready for a graph (``graph_plan``), and
   only its run is traced;
3. **eager** — the steady state: one lookup of the plan in the op's cache, keyed by the raw arguments, the
   ambient mesh and split shapes and the operands' shapes, dtypes and devices; on a miss the op's ``plan``
   parses, checks and builds it, its errors naming the expression.

An :class:`Operation` declares only ``plan``, ``run`` and, where they differ from the defaults, ``vma_rule``
and ``graph_plan``; its call is ``(args, mesh, shapes, families, run_args)``. ``einshard`` itself, whose [param]
operands record gradient duties and whose local plans replay in a few microseconds, gives :func:`dispatch` its
own three branches.
"""

from __future__ import annotations

from ..core import _context
from ..core._cache import BoundedCache
from ..core._torch_compat import in_traced_code
from ..core._trace import stand_in, static_shape
from ..errors import EinshardError
from . import vma as _vma
from .pipeline import freeze, traced_plan

__all__ = ["dispatch", "Operation"]


def dispatch(tracked, traced, eager, traced_when):
    """The one dispatch, as the function ``op(expr, tensors, call)`` of an operation's branches:
    ``tracked(ambient, expr, tensors, call)`` inside a ``shard_map`` body that tracks variance,
    ``traced(expr, tensors, call)`` when ``traced_when()`` says a graph is being made, else
    ``eager(expr, tensors, call)`` (see the module docstring). A closure: the steady state pays one call."""

    def op(expr, tensors, call):
        if _vma.ACTIVE:  # some shard_map(check_vma=True) body runs; ACTIVE first: no call when idle
            ambient = _vma.tracking_ambient()
            if ambient is not None:  # in it, not in a library op (the untracked call, where tracking is suspended)
                return tracked(ambient, expr, tensors, call)
        if traced_when():
            return traced(expr, tensors, call)
        return eager(expr, tensors, call)

    return op


_PLAIN = frozenset({str, int, float, type(None)})  # arguments that are their own key (a bool is tagged, as by freeze)


def _same_formula(expr, args, families):
    """The default variance rule: the op's expression, with its families."""
    return expr, families


def _prepared(plan):
    """The default plan for a graph: ``plan.prepare_traced()``."""
    return plan.prepare_traced()


class Operation:
    """A public operation declared by its parts; a call is ``op.dispatch(expr, tensors, (args, mesh, shapes,
    families, run_args))``.

    - ``name``: the op's name, which prefixes its errors (``einhalo: 'b h/sp w': ...``) when ``names_op``;
    - ``plan(expr, tensors, args, mesh, shapes, families)``: the plan of one call (``tensors`` may be stand-ins
      with the operands' shapes, dtypes and devices: the plan reads only those);
    - ``run(plan, tensors, run_args)``: the result (in eager and in traced code);
    - ``vma_rule(expr, args, families)``: ``(formula, families)`` whose variance rules apply;
    - ``graph_plan(plan)``: the plan ready for traced code, at trace time;
    - ``cache``: where plans are kept (a registered :class:`BoundedCache`).

    It plans for a graph only in code dynamo traces (:func:`in_traced_code`): the exchanges of these ops pick
    their transport by the same predicate.
    """

    __slots__ = ("name", "plan", "run", "vma_rule", "graph_plan", "cache", "names_op", "dispatch")

    def __init__(self, name: str, *, plan, run, cache: BoundedCache, vma_rule=_same_formula, graph_plan=_prepared,
                 names_op: bool = True):
        self.name, self.plan, self.run, self.cache = name, plan, run, cache
        self.vma_rule, self.graph_plan, self.names_op = vma_rule, graph_plan, names_op
        self.dispatch = dispatch(self.tracked, self.traced, self.eager, in_traced_code)

    def tracked(self, ambient, expr, tensors, call):
        """The variance rules of :attr:`vma_rule`'s formula around the untracked call."""
        args, mesh, _shapes, families, _run_args = call
        formula, rule_families = self.vma_rule(expr, args, families)

        def untracked(_formula, *ts, **_kwargs):
            return self.dispatch(expr, ts, call)  # (tracking is suspended there)

        return _vma.formula_op_in(ambient, untracked, formula, tensors, {"mesh": mesh, "families": rule_families})

    def traced(self, expr, tensors, call):
        """Planned at trace time; only the run is traced."""
        args, mesh, shapes, families, run_args = call
        metas = tuple(None if t is None else (static_shape(t), t.dtype, t.device) for t in tensors)
        plan = traced_plan(_graph_plan, self, expr, metas, mesh, shapes, families, *args)
        return self.run(plan, tensors, run_args)

    def eager(self, expr, tensors, call):
        """The steady state: the cached plan, run."""
        args, mesh, shapes, families, run_args = call
        return self.run(self.cached_plan(expr, tensors, args, mesh, shapes, families), tensors, run_args)

    def cached_plan(self, expr, tensors, args, mesh, shapes, families):
        """The plan of one call from :attr:`cache`, or built (:meth:`checked_plan`) and kept there; eager and
        at trace time (a plan is made once for both)."""
        try:
            ambient = _context.current()
            key = (expr, mesh, ambient.mesh, ambient.shapes_key,
                   *[a if type(a) in _PLAIN else (bool, a) if type(a) is bool else freeze(a) for a in args],
                   None if shapes is None else freeze(shapes), None if families is None else freeze(families),
                   *[None if t is None else (t.shape, t.dtype, t.device) for t in tensors])
            plan = self.cache.get(key)
        except TypeError:  # unhashable arguments: take the checked path (it reports them)
            key, plan = None, None
        if plan is None:
            plan = self.checked_plan(expr, tensors, args, mesh, shapes, families)
            if key is not None:
                self.cache.put(key, plan)
        return plan

    def checked_plan(self, expr, tensors, args, mesh, shapes, families):
        """:attr:`plan`, its errors naming the expression (and the op)."""
        try:
            return self.plan(expr, tensors, args, mesh, shapes, families)
        except EinshardError as err:
            raise err.within(expr, self.name if self.names_op else None)  # noqa: B904 - the caught error itself, named


def _graph_plan(op: Operation, expr, metas, mesh, shapes, families, *args):
    """At trace time: ``op``'s plan for operands with ``metas`` (stand-ins), ready for a graph."""
    tensors = tuple(None if m is None else stand_in(*m) for m in metas)
    return op.graph_plan(op.cached_plan(expr, tensors, args, mesh, shapes, families))
