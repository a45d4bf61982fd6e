"""``es.shard_map``: per-shard programs over a device mesh.

``shard_map(f, in_specs, out_specs)`` runs ``f`` on every rank with the local
blocks of its arguments, like ``jax.shard_map``:

1. **match** ``in_specs`` (a pytree prefix of the positional arguments) to
   the arguments, and check each tensor's local shape against its spec;
2. **convert** where a spec says so (``"b n c -> b/dp n c"``) or where an
   argument is a ``DTensor`` (from its own placements);
3. **push the ambient context**: the mesh and every split shape known from
   the specs, so ``es.einshard`` in the body needs neither ``mesh=`` nor
   ``shapes=``;
4. **run the body**, with variance tracking (:mod:`einshard.runtime.vma`) when
   ``check_vma=True``;
5. **check and convert the outputs** against ``out_specs`` (an output that
   varies over a dimension its spec says it is replicated over is a
   ``ValueError``), wrapping them as ``DTensor`` s when an input was one.

Steps 1-2 and 5 are planned once per argument structure and local shapes and
replayed afterwards; ``benchmarks/bench_shard_map.py`` measures what a call
costs on top of the body.
"""

from __future__ import annotations

import functools
import importlib
import operator
import sys

import optree
import torch

from ..comm import checks
from ..comm.grad_sums import DEFERRED
from ..comm.mesh import resolve_mesh, wrap_mesh
from ..core import _context, _torch_compat, _trace
from ..core._cache import BoundedCache
from ..core._split import compute_split_shapes
from ..core._torch_compat import in_traced_code
from ..core.layout import MeshShape
from ..errors import EinshardError
from ..notation import expand
from ..ops.einshard import duties_satisfied, einshard
from ..params.metadata import named_sizes, recorded_global_shape
from ..params.store import PARAM_STATE_ATTR
from ..params.summed import body_duty_error, native_duty, watch_body
from ..params.zero import BodyGathers, shard_map_entry, stored_source
from ..runtime import vma as _vma
from ..runtime.vma_aliases import LeafAliases
from ._specs import (
    explicit_entries,
    layout_entries,
    leaf_path,
    match,
    maybe_dtensor,
    parse_spec,
    resolve_spec,
    shapes_subset,
    sizes_subset,
    spec_tree,
    strip_spec,
)
from .dtensor import apply_from_dtensor, plan_from_dtensor, to_dtensor

__all__ = ["shard_map", "ShardMap"]


_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_UNSET = object()


class _Body:
    """What the ambient context's ``shard_map`` field holds while a body runs."""

    __slots__ = ("tracker", "shard_map", "group")

    def __init__(self, tracker, shard_map, group=None):
        self.tracker = tracker
        self.shard_map = shard_map
        self.group = group  # checks on: the mesh's whole group, where every agreement in the body runs

    def with_tracker(self, tracker) -> _Body:
        """The same body with another tracker (``None``: untracked), for a recompute (einshard.runtime.recompute)."""
        return _Body(tracker, self.shard_map, self.group)


class _InPlan:
    __slots__ = ("actions", "masks", "shapes", "dtensor", "mesh", "source", "info")

    def __init__(self, actions, masks, shapes, dtensor, info=None):
        self.mesh = self.source = None  # planned at trace time: the mesh, the plan in optree's leaf order
        self.info = info  # the mesh's variance data (einshard.runtime.vma), for the eager tracker
        self.actions = actions  # ((leaf index, fn), ...)
        self.masks = masks  # ((leaf index, vma mask), ...) for tracked tensors that vary
        self.shapes = shapes  # ambient split shapes {(dims, axis): splits}
        self.dtensor = dtensor  # an argument was a DTensor: outputs become DTensors


class _OutPlan:
    __slots__ = ("checks", "actions", "converted")

    def __init__(self, checks, actions):
        self.checks = checks  # ((leaf index, declared mask, Spec), ...)
        self.actions = actions  # ((leaf index, fn), ...)
        self.converted = frozenset(i for i, _ in actions)


def _leaf_key(x):
    if type(x) is _Tensor:  # (the common case, before the DTensor check)
        return x.shape
    if isinstance(x, _Tensor):
        if maybe_dtensor(x):
            return ("DTensor", tuple(x.placements), x.shape, x._local_tensor.shape)  # type: ignore[attr-defined]
        state = getattr(x, PARAM_STATE_ATTR, None)  # a Parameter's recorded global shape is checked when planning
        return x.shape if state is None or state.global_shape is None else (x.shape, state.global_shape)
    return None


def _merge(table: dict, entries: dict, ambiguous: set) -> None:
    for key, splits in entries.items():
        if key in ambiguous:
            continue
        old = table.get(key)
        if old is None:
            table[key] = splits
        elif old != splits:  # two specs split the same axis name differently: the body must pass shapes=
            del table[key]
            ambiguous.add(key)


class ShardMap:
    """A function mapped over the shards of a mesh; build it with :func:`shard_map`."""

    def __init__(self, f, in_specs, out_specs, *, mesh=None, shapes=None, check_vma=True, sizes=None,
                 families=None):
        if not callable(f):
            raise TypeError(f"shard_map needs a function, got {type(f).__name__}")
        if isinstance(in_specs, list):
            in_specs = tuple(in_specs)  # the positional arguments are a tuple
        self.f = f
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.mesh = None if mesh is None else wrap_mesh(resolve_mesh(mesh))
        self.shapes = shapes
        self.check_vma = bool(check_vma)
        self.sizes = dict(sizes) if sizes else None
        self.families = families
        self._in_leaves, self._in_def = spec_tree(in_specs, families, "in_specs", "in")
        self._out_leaves, self._out_def = spec_tree(out_specs, families, "out_specs", "out")
        self._in_plans = BoundedCache(256)
        self._out_plans = BoundedCache(256)
        self._aliases = LeafAliases(busy=_tracking)  # the body's pvary-ed parameters, from one call to the next
        functools.update_wrapper(self, f)

    def __reduce__(self):
        # pickled by reference, like the function it wraps (e.g. to run it with einshard.testing)
        return (_by_name, (self.__module__, self.__qualname__))  # type: ignore[attr-defined]  # update_wrapper's

    def __repr__(self) -> str:
        name = getattr(self.f, "__qualname__", repr(self.f))
        return f"shard_map({name}, in_specs={self.in_specs!r}, out_specs={self.out_specs!r})"

    # -- the call -----------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if in_traced_code():
            return self._call_traced(args, kwargs)
        if "torch._dynamo" in sys.modules:  # maybe run eagerly inside a compiled region: see _untraced
            return _untraced()(self, args, kwargs)
        return self._call_eager(args, kwargs)

    def _call_eager(self, args, kwargs):
        outer = _context.current().shard_map
        if outer is not None and outer.tracker is not None and not outer.tracker.suspended:
            raise EinshardError(
                f"shard_map: {self!r} is called inside the body of {outer.shard_map!r}, which tracks variance; "
                "nested shard_map calls are not supported (call the inner function directly)"
            )
        mesh = self.mesh
        if mesh is None:
            mesh = wrap_mesh(resolve_mesh(None, what=repr(self)))
        leaves, treedef = optree.tree_flatten(args, none_is_leaf=True)
        duty_errors, params = _body_parameters(args, leaves) if self.check_vma else ((), ())
        key = (treedef, mesh, *[_leaf_key(x) for x in leaves])
        plan = self._in_plans.get(key)
        if plan is None:
            plan = self._plan_inputs(key, args, leaves, mesh, duty_errors)
        elif checks.ENABLED or duty_errors:  # ranks may miss the cache on different calls: agree on every call
            _raise_agreed(mesh, duty_errors)
        group = mesh.group(tuple(mesh.names)) if checks.ENABLED and mesh.device_mesh is not None else None
        body_args = args
        body_leaves = leaves
        token = None
        satisfied = None
        gathers = None
        try:
            if self.check_vma:  # the body sums every gradient: formulas (entry and exit conversions too) plan no duty
                satisfied = duties_satisfied().__enter__()
            body_args, body_leaves = _convert_inputs(plan.actions, args, leaves, treedef)
            gathers = BodyGathers.of(body_leaves) if plan.actions else None  # stored parameters: freed after use
            if gathers is not None:
                gathers.__enter__()
            tracker = None
            if self.check_vma:
                tracker = _vma.Tracker(mesh, plan.info)
                tracker.aliases = self._aliases
            # pushed inside the try: a compiler that splits this frame (a torch.compile graph break in the
            # push) must not resume after the push outside the block that pops it
            token = _context.push(mesh=mesh, shapes=plan.shapes, shard_map=_Body(tracker, self, group))
            if tracker is None:
                out = self.f(*body_args, **kwargs)
                stored = _stored_with_grads(args, body_leaves) if gathers is not None else ()
                return self._finish(out, mesh, plan, None, stored)
            attr, serial = _vma.ATTR, tracker.serial
            for i, mask in plan.masks:
                body_leaves[i].__dict__[attr] = serial | mask
            try:
                out = _vma.run_tracked(tracker, self.f, body_args, kwargs)
                result = self._finish(out, mesh, plan, tracker)  # after the mode: exit conversions are untracked
            finally:
                if tracker.kept is not None:  # a region was checkpointed: its recompute puts the tags back
                    tracker.keep(body_leaves)
                for i, _mask in plan.masks:
                    body_leaves[i].__dict__.pop(attr, None)
                if tracker.inplace:  # an in-place op may have tagged any argument the body received
                    for x in body_leaves:
                        if isinstance(x, _Tensor):
                            x.__dict__.pop(_vma.ATTR, None)
                tracker.memo.clear()
            watched = _watched(params, tracker.params) if params or tracker.params else ()
            if tracker.deferred and (watched or gathers is not None):
                # before the gradient checks below (and a ZeRO pass's end): their end-of-backward callbacks come
                # after the deferred sums' (else the first deferred sum queues that callback itself)
                _arm_deferred_sums(result)
            if watched:
                watch_body(optree.tree_leaves(result, none_is_leaf=True), watched)
            return result
        except BaseException as exc:
            if group is not None:  # raised here only: the peers raise at their next agreement
                checks.report_failure(group, exc)
            raise
        finally:
            if gathers is not None:
                gathers.__exit__(None, None, None)
            if satisfied is not None:
                satisfied.__exit__(None, None, None)
            if token is not None:
                _context.pop(token)

    def _finish(self, out, mesh, plan, tracker, stored=()):
        leaves, treedef = optree.tree_flatten(out, none_is_leaf=True)
        key = (treedef, plan, *[_leaf_key(x) for x in leaves])
        oplan = self._out_plans.get(key)
        if oplan is None:
            oplan = self._plan_outputs(key, out, leaves, mesh, plan)
        elif checks.ENABLED:
            _raise_agreed(mesh, ())
        if stored:
            _refuse_whole_cotangents(out, leaves, oplan, stored, mesh)
        if not oplan.actions and tracker is None:
            return out  # nothing checked, nothing converted
        if not oplan.actions and _vary_as_declared(tracker, leaves, oplan.checks):
            new = leaves  # the common case: nothing to pvary or report
        else:
            new = _exit_leaves(out, leaves, oplan, tracker, eager=True)
        if tracker is not None:
            if tracker.kept is not None:
                tracker.keep(new)
            for x in new:
                if isinstance(x, _Tensor):
                    x.__dict__.pop(_vma.ATTR, None)
        if not any(map(operator.is_not, new, leaves)):
            return out
        return treedef.unflatten(new)

    # -- under torch.compile ------------------------------------------------------------
    def _call_traced(self, args, kwargs):
        """The call while dynamo traces: plans are made at trace time, the body and pvary-s are traced.

        Variance is tracked by a :class:`~einshard.runtime.vma.TracedTracker` while the
        body is traced, so the compiled step pays nothing for ``check_vma``.
        Pytrees are flattened with ``torch.utils._pytree`` (which dynamo
        traces); the plans, made in optree's leaf order, are translated.
        """
        outer = _context.current().shard_map
        if outer is not None and outer.tracker is not None and not outer.tracker.suspended:
            _trace.refuse(f"shard_map: {self!r} is called inside the body of another shard_map")
        mesh = self.mesh if self.mesh is not None else _context.current().mesh
        stored = _stored_argument(args)
        if stored is not None:
            return _stored_under_compile(self, args, kwargs, stored)
        leaves, spec = _torch_compat.pytree.tree_flatten(args)
        if self.check_vma:
            _refuse_traced_duties(leaves)
        struct = spec.unflatten(list(range(len(leaves))))  # the structure, as constants
        plan = _trace.lookup(_in_plan_for_trace(self, struct, _trace_leaves(leaves), mesh))
        mesh = plan.mesh
        body_args, body_leaves = _convert_inputs(plan.actions, args, leaves, spec)
        tracker = _vma.TracedTracker(mesh) if self.check_vma else None
        token = None
        try:  # pushed inside the try, as in eager mode
            token = _context.push(mesh=mesh, shapes=plan.shapes, shard_map=_Body(tracker, self))
            if tracker is None:
                out = self.f(*body_args, **kwargs)
            else:
                # every tensor argument is tagged (invariant ones too): a graph break in the body must not
                # leave one untagged, as untagged tensors after a break are decided from the tensor alone
                masks = dict(plan.masks)
                tensors = [i for i, x in enumerate(body_leaves) if isinstance(x, _Tensor)]
                for i in tensors:
                    tracker.tag(body_leaves[i], masks.get(i, 0))
                with _vma.tracking(tracker):
                    out = self.f(*body_args, **kwargs)
                tracker.check_graph()
                for i in tensors:
                    tracker.untag(body_leaves[i])
            out_leaves, out_spec = _torch_compat.pytree.tree_flatten(out)
            struct = out_spec.unflatten(list(range(len(out_leaves))))
            oplan = _trace.lookup(_out_plan_for_trace(self, struct, _trace_leaves(out_leaves), mesh, plan))
            return out_spec.unflatten(_exit_leaves(out, out_leaves, oplan, tracker, eager=False))
        finally:
            if token is not None:
                _context.pop(token)

    # -- planning (once per argument structure and local shapes) ---------------------
    def _opts(self, parsed_formula, sizes=_UNSET):
        sizes = self.sizes if sizes is _UNSET else sizes
        return {"shapes": shapes_subset(parsed_formula, self.shapes),
                "sizes": sizes_subset(parsed_formula, sizes, self.families), "families": self.families}

    def _plan_inputs(self, key, args, leaves, mesh, duty_errors=()) -> _InPlan:
        per_leaf = _matched(mesh, self._in_leaves, self._in_def, args, "in_specs", "args", self.in_specs)
        info = _vma.mesh_info(mesh)
        actions, masks = [], []
        table: dict = {}
        ambiguous: set = set()
        dtensor = False
        errors = list(duty_errors)
        for i, (x, spec) in enumerate(zip(leaves, per_leaf)):
            if spec is None or not isinstance(x, _Tensor):
                continue
            where = f"shard_map: argument args{leaf_path(args, i)} (spec {spec.text!r})"
            zero = None
            state = getattr(x, PARAM_STATE_ATTR, None) if isinstance(x, _Parameter) else None
            if state is not None and state.store is not None and not spec.conversion and spec.inner == state.layout:
                # stored sharded (ZeRO-3): the body sees the compute block, gathered on entry
                spec = parse_spec(f"{state.layout} -> {state.compute_layout}", None, where, "in")
                zero = functools.partial(_zero_entry, mesh, self.check_vma)
            if maybe_dtensor(x):
                dtensor = True
                try:
                    fn, entries = self._dtensor_input(x, spec, mesh, where)
                except ValueError as err:
                    errors.append(str(err))
                    continue
                actions.append((i, fn))
                _merge(table, entries, ambiguous)
            else:
                formula = spec.text if spec.conversion else f"{spec.inner} -> {spec.inner}"
                try:
                    sizes, whole = _recorded_sizes(spec, x, self.sizes)
                    if whole is not None:
                        why = _block_error(spec, tuple(x.shape), whole, mesh)
                        if why is not None:  # seen by some ranks only, maybe (uneven blocks): agreed below
                            errors.append(f"{where}: {why}")
                            continue
                    resolved = resolve_spec(formula, x.shape, mesh, self.shapes, sizes, self.families)
                except ValueError as err:  # may be seen by some ranks only (local sizes): agreed below
                    errors.append(f"{where}: {err}")
                    continue
                if resolved.local_error is not None:
                    errors.append(f"{where}: {resolved.local_error}")
                if zero is not None:
                    actions.append((i, zero))
                    _merge(table, layout_entries(resolved.output), ambiguous)
                elif spec.conversion:
                    opts = self._opts(expand(spec.text, self.families), sizes)
                    actions.append((i, functools.partial(_convert, einshard, spec.text, mesh, opts)))
                    _merge(table, layout_entries(resolved.output), ambiguous)
                elif whole is not None:  # the recorded global shape fixes the split of every sharded axis
                    _merge(table, layout_entries(resolved.output), ambiguous)
                else:
                    _merge(table, explicit_entries(resolved.output, self.shapes, mesh), ambiguous)
            mask = spec.inner_mask(info)
            if mask:
                masks.append((i, mask))
        _raise_agreed(mesh, errors)
        plan = _InPlan(tuple(actions), tuple(masks), table, dtensor, info)
        return self._in_plans.put(key, plan)

    def _dtensor_input(self, x, spec, mesh, where):
        try:
            src, layout = plan_from_dtensor(x, spec.outer, mesh, shapes=self.shapes, sizes=self.sizes,
                                            families=self.families, where=where)
        except ValueError as err:
            raise EinshardError(f"{where}: {err}") from None
        entries = layout_entries(layout)
        first = functools.partial(_from_dtensor, apply_from_dtensor, src, layout, mesh)
        if not spec.conversion:
            return first, entries
        local_shape = layout.local_shape(mesh.coordinate, MeshShape.of(mesh))
        resolved = resolve_spec(spec.text, local_shape, mesh, self.shapes, self.sizes, self.families,
                                ambient=entries)
        opts = self._opts(expand(spec.text, self.families))
        fn = functools.partial(_dtensor_convert, first, einshard, spec.text, mesh, opts, entries)
        return fn, layout_entries(resolved.output)

    def _plan_outputs(self, key, out, leaves, mesh, plan) -> _OutPlan:
        per_leaf = _matched(mesh, self._out_leaves, self._out_def, out, "out_specs", "out", self.out_specs)
        info = _vma.mesh_info(mesh)
        checks_, actions, errors = [], [], []
        for i, (x, spec) in enumerate(zip(leaves, per_leaf)):
            if spec is None or not isinstance(x, _Tensor):
                continue
            where = f"shard_map: output out{leaf_path(out, i)} (out_spec {spec.text!r})"
            checks_.append((i, spec.inner_mask(info), spec))
            formula = spec.text if spec.conversion else f"{spec.inner} -> {spec.inner}"
            try:
                resolved = resolve_spec(formula, x.shape, mesh, self.shapes, self.sizes, self.families,
                                        ambient=plan.shapes)
            except ValueError as err:
                errors.append(f"{where}: {err}")
                continue
            if resolved.local_error is not None:
                errors.append(f"{where}: {resolved.local_error}")
                continue
            steps = []
            if spec.conversion:
                opts = self._opts(expand(spec.text, self.families))
                steps.append(functools.partial(_convert, einshard, spec.text, mesh, opts))
            if plan.dtensor:
                layout = resolved.output
                steps.append(functools.partial(_to_dtensor, to_dtensor, layout, mesh, where))
            if steps:
                actions.append((i, steps[0] if len(steps) == 1 else functools.partial(_chain, tuple(steps))))
        _raise_agreed(mesh, errors)
        oplan = _OutPlan(tuple(checks_), tuple(actions))
        return self._out_plans.put(key, oplan)


def _by_name(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _matched(mesh, *args):
    """``match(*args)``; a structure that differs on some ranks only is agreed on like any spec error."""
    try:
        return match(*args)
    except ValueError as err:
        _raise_agreed(mesh, [str(err)])
        raise


def _raise_agreed(mesh, errors) -> None:
    """Raise the first error; with ``es.set_checks(True)`` every rank raises when any rank has one.

    Errors about local shapes can be seen by some ranks only; without checks
    those ranks raise while the others go on (``es.set_checks(True)`` makes them agree).
    With checks on this is one collective, so it runs on every call (planned
    or not): a rank's plan cache can miss where another's hits (its local
    shapes changed).
    """
    error = EinshardError(errors[0]) if errors else None
    if checks.checks_enabled() and mesh.device_mesh is not None:
        checks.agree(mesh.group(tuple(mesh.names)), error, point="shard_map")
    elif error is not None:
        raise error


def _body_parameters(args, leaves):
    """``(errors, parameters)``: why a tracked body may not take a Parameter argument (another mechanism
    sums its gradient), and the arguments with a native gradient duty, whose gradients the body sums."""
    errors, params = [], []
    for i, x in enumerate(leaves):
        state = getattr(x, PARAM_STATE_ATTR, None)
        if state is not None and state.grad_comm.mode != "none" and isinstance(x, _Parameter):
            why = body_duty_error(x)
            if why is not None:
                errors.append(f"shard_map: argument args{leaf_path(args, i)} {why}")
            elif native_duty(x):
                params.append(x)
    return errors, params


def _arm_deferred_sums(result) -> None:
    """When backward reaches the body's outputs, it queues the end-of-backward wait of the gradient sums the
    body deferred (:data:`einshard.comm.grad_sums.DEFERRED`) before any later callback (the gradient checks of
    :func:`einshard.params.summed.watch_body` and a ZeRO pass read the sums). Without those the first deferred
    sum queues it (a prehook per output and call saved)."""
    for o in optree.tree_leaves(result, none_is_leaf=True):
        if isinstance(o, _Tensor) and o.grad_fn is not None:
            o.grad_fn.register_prehook(_arm)


def _tracking() -> bool:
    """Whether a ``shard_map(check_vma=True)`` body runs (in any thread)."""
    return _vma.ACTIVE > 0


def _arm(grad_outputs) -> None:
    DEFERRED.arm()


def _watched(params, used) -> list:
    """After a tracked body: the parameters it used that another mechanism would sum are refused (those it
    took as arguments were checked on entry); returns those with a native duty, whose gradients get tagged when
    backward brings the body's contributions (:func:`einshard.params.summed.watch_body`)."""
    watched = {id(p): p for p in params}
    for key, p in used.items():
        if key in watched:
            continue
        why = body_duty_error(p)
        if why is not None:  # every rank uses the same parameters: all raise here
            raise EinshardError(f"shard_map: a parameter of shape {tuple(p.shape)} used in the body {why}")
        if native_duty(p):
            watched[key] = p
    return list(watched.values())


def _recorded_sizes(spec, x, sizes):
    """``(sizes= for this leaf, the global shape recorded for it or None)``: a recorded global shape (the
    spec's, from ``es.params.param_specs``, else the Parameter's own) names the sizes of the layout it arrives in."""
    whole = getattr(spec.text, "global_shape", None)
    own = recorded_global_shape(x)
    if whole is None:
        whole = own
    elif own is not None and own != whole:
        raise EinshardError(f"the parameter's recorded global shape {own} differs from its spec's {whole}")
    if whole is None:
        return sizes, None
    named = named_sizes(spec.outer_spec, whole)
    if named is None:  # a layout with '( )' or '...': its global shape does not name the axes
        return sizes, None
    merged = dict(sizes or {})
    for axis, n in named.items():
        if merged.setdefault(axis, n) != n:
            raise EinshardError(f"sizes= gives axis {axis!r} the size {merged[axis]}, but the recorded global "
                                f"shape {whole} gives {n}")
    return merged, whole


def _block_error(spec, shape, whole, mesh) -> str | None:
    """Why a tensor of local ``shape`` is not this rank's block of a ``whole``-shaped tensor laid out as the
    spec's outer layout (``None`` when it is)."""
    want = []
    for axis, n in zip(spec.outer_spec.items, whole):
        if axis.mesh:
            dims = mesh.dims(axis.mesh)
            n = compute_split_shapes(n, mesh.size(dims))[mesh.index(dims)]
        want.append(n)
    if tuple(want) == shape:
        return None
    hint = ""
    if shape == tuple(whole):
        arrow = f"{strip_spec(spec.outer_spec)} -> {spec.outer}"
        hint = f" It is the whole tensor: pass this rank's block, or convert on entry with '{arrow}'."
    return (f"the recorded global shape is {tuple(whole)}, so this rank's block of '{spec.outer}' has shape "
            f"{tuple(want)}, but the argument has shape {shape}.{hint}")


def _stored_argument(x, path=""):
    """The path (``[0]['w']``) of the first parameter stored sharded (``store=``) among the arguments ``x``, and
    its state; ``None`` when there is none. (A walk of dicts, lists and tuples, which dynamo traces.)"""
    if isinstance(x, dict):
        x = {repr(k): v for k, v in x.items()}
    elif isinstance(x, (list, tuple)):
        x = {str(k): v for k, v in enumerate(x)}
    else:
        state = getattr(x, PARAM_STATE_ATTR, None) if isinstance(x, _Parameter) else None
        return None if state is None or state.store is None else (path, state)
    for k, v in x.items():
        found = _stored_argument(v, f"{path}[{k}]")
        if found is not None:
            return found
    return None


def _call_eagerly(sm, args, kwargs):
    return sm._call_eager(args, kwargs)


_UNTRACED: list = []  # _call_eagerly under torch.compiler.disable, made once dynamo is loaded


def _untraced():
    """The eager call, never traced by dynamo (nor what it calls: the body runs eagerly too).

    A compiled function runs a ``shard_map`` call eagerly where dynamo gives up tracing it: an exception
    raised while tracing it (an einshard refusal, a tensor hook that raises when dynamo inlines it), or
    :func:`_stored_under_compile`. Dynamo would then compile each frame the eager call runs as a frame of
    its own, with the eager variance tracker's mode active and tensors' attributes read as plain Python:
    it cannot, and fails with an internal error. Left alone, the call gives eager's values and gradients
    (and raises eager's errors). A function dynamo traces never reaches this (``in_traced_code()`` is true
    there), so ``fullgraph=True`` sees the traced call only; an explicitly compiled function called in the
    body still compiles."""
    if not _UNTRACED:
        _UNTRACED.append(torch.compiler.disable(_call_eagerly, reason="es.shard_map runs this call eagerly"))
    return _UNTRACED[0]


def _stored_under_compile(sm, args, kwargs, found):
    """Under torch.compile, a call with a parameter stored sharded (``store=``) as argument runs eagerly (a
    graph break; ``fullgraph=True`` refuses, with this reason): its gather on entry is an eager collective in
    an autograd function, which dynamo does not trace — traced, the body would get the storage slice."""
    path, state = found
    reason = (f"es.shard_map: argument args{path} is a parameter stored sharded over {state.store!r} (store=, "
              f"layout {state.layout!r}); its gather on entry is eager, so under torch.compile this call runs "
              "eagerly (a graph break; refused with fullgraph=True). Call it outside the compiled region, or "
              "register the parameter without store=")
    _torch_compat.graph_break(reason)  # fullgraph=True: refused here, with the reason
    return torch.compiler.disable(_call_eagerly, reason=reason)(sm, args, kwargs)  # (a skipped call: eager)


def _refuse_traced_duties(leaves) -> None:
    """Under torch.compile: a Parameter argument with a gradient duty is refused (the compiled body sums its
    gradient, and cannot tag it for the duty's executors, which would sum it again)."""
    for i, x in enumerate(leaves):
        if isinstance(x, _Parameter) and (native_duty(x) or body_duty_error(x) is not None):
            _trace.refuse(
                f"shard_map under torch.compile: argument leaf {i} (shape {tuple(x.shape)}) carries a gradient "
                "duty; the compiled body (check_vma=True) sums its gradient itself, and reduce_grad_ or the hooks "
                "would sum it again. Register it without a duty (grad='none'), or call the shard_map eagerly"
            )


def _convert_inputs(actions, args, leaves, treedef):
    """The body's arguments and leaves after the planned entry conversions (unchanged when there are none)."""
    if not actions:
        return args, leaves
    converted = list(leaves)
    for i, fn in actions:
        converted[i] = fn(leaves[i])
    return treedef.unflatten(converted), converted


def _exit_leaves(out, leaves, oplan, tracker, eager):
    """The output leaves after the variance checks (pvary-ing what lacks a declared dimension) and the
    exit conversions."""
    leaves = list(leaves)
    if tracker is not None:
        for i, declared, spec in oplan.checks:
            x = leaves[i]
            m, missing = _output_vma(tracker, out, i, x, declared, spec)
            if missing and x.requires_grad and torch.is_grad_enabled():
                y = tracker.pvary(x, m, missing)
                # eager, returned as is: not a view made by an autograd Function, so the caller may modify it
                # in place
                leaves[i] = y.clone() if eager and i not in oplan.converted else y
            if not eager:
                tracker.untag(x)
        tracker.suspended += 1  # the body is over: exit conversions are not tracked
    for i, fn in oplan.actions:
        leaves[i] = fn(leaves[i])
    return leaves


def _stored_with_grads(args, body_leaves) -> tuple:
    """``(argument path, state)`` of the stored parameters gathered on a body's entry whose gradients this
    call computes."""
    if not torch.is_grad_enabled():
        return ()
    found = []
    for i, x in enumerate(body_leaves):
        p = stored_source(x) if isinstance(x, _Tensor) else None
        if p is not None and p.requires_grad:
            found.append((f"args{leaf_path(args, i)}", getattr(p, PARAM_STATE_ATTR)))
    return tuple(found)


def _refuse_whole_cotangents(out, leaves, oplan, stored, mesh) -> None:
    """A ``check_vma=False`` body: a stored parameter's gradient is taken as this rank's share and summed over
    its duty's groups (the storage group among them), which is exact where each rank's cotangent is its share
    of the output's (outputs sharded or partial over those groups). An output replicated over one of their
    dimensions hands every rank the whole cotangent: a use that does not vary over it would be counted once
    per rank, a per-rank use summed in the body would not, and nothing tells them apart. Refused (every rank
    decides alike: from the specs)."""
    info = _vma.mesh_info(mesh)
    for i, declared, spec in oplan.checks:
        if not (leaves[i].requires_grad and torch.is_grad_enabled()):
            continue
        for where, state in stored:
            whole = info.mask(state.grad_comm.mesh_dims) & ~declared & ~info.trivial  # (one rank: its share)
            if whole:
                dim = info.dims(whole)[0]
                raise EinshardError(
                    f"shard_map(check_vma=False): output out{leaf_path(out, i)} (out_spec {spec.text!r}) is "
                    f"replicated over {dim!r}, over which the gather of the stored parameter {where} (store="
                    f"{state.store!r}) sums its gradient: its gradient from this output is whole on every rank "
                    f"where its use does not vary over {dim!r} and a share where it does, and without variance "
                    f"tracking einshard cannot "
                    f"tell them apart. Use check_vma=True, or return the per-rank value partial over {dim!r} "
                    f"(out_spec '// {dim}', or '// {dim} -> ...' to sum it on exit), or sharded over {dim!r}"
                )


def _vary_as_declared(tracker, leaves, checks_) -> bool:
    """Whether every checked output leaf varies over exactly the mesh dimensions its out spec declares."""
    serial = tracker.serial
    attr = _vma.ATTR
    for i, declared, _spec in checks_:
        m = leaves[i].__dict__.get(attr, 0) ^ serial
        if (0 if m > _vma.MASK else m) != declared:
            return False
    return True


def _output_vma(tracker, out, i, x, declared, spec):
    """``(vma mask, declared dims it lacks)`` of output leaf ``i``; ``ValueError`` when it varies undeclared."""
    m = tracker.mask_of(x)
    if m & _vma.UNKNOWN:
        _trace.refuse(
            f"shard_map under torch.compile: einshard cannot decide over which mesh dimensions output "
            f"out{leaf_path(out, i)} varies: it depends on a tensor that crossed a graph break inside the body "
            "without einshard's tag; avoid the graph break (fullgraph=True shows where it is)"
        )
    bad = m & ~declared
    if bad:
        dim = tracker.info.dims(bad)[0]
        _trace.refuse(
            f"shard_map: output out{leaf_path(out, i)} varies over mesh dimension {dim!r}, but its "
            f"out_spec {spec.text!r} says it is replicated over {dim!r}. Reduce it first "
            f"(es.spmd.psum(x, {dim!r}), or es.einshard with '... // {dim} -> ...'), or declare it "
            f"sharded or partial over {dim!r} in out_specs"
        )
    return m, declared & ~m


# -- plans made at trace time (see einshard.core._trace) ---------------------------------------------


def _trace_leaves(leaves) -> tuple:
    """What planning needs of each leaf, as constants: ``(shape, dtype)`` for a tensor, else ``None``."""
    out: list[tuple | None] = []
    for x in leaves:
        if isinstance(x, _Tensor):
            if maybe_dtensor(x):
                _trace.refuse("shard_map under torch.compile: DTensor arguments are not supported; "
                              "pass local tensors (x.to_local())")
            out.append((_trace.static_shape(x), x.dtype))
        else:
            out.append(None)
    return tuple(out)


def _stand_ins(leaves) -> list:
    return [None if d is None else torch.empty(d[0], dtype=d[1], device="meta") for d in leaves]


def _optree_view(struct, leaves):
    """``struct`` (torch pytree leaf indices as leaves) in optree's order: (treedef, stand-ins, torch indices)."""
    order, treedef = optree.tree_flatten(struct, none_is_leaf=True)
    fake = _stand_ins([None if i is None else leaves[i] for i in order])
    return treedef, fake, order


@_trace.constant_result
def _in_plan_for_trace(sm, struct, leaves, mesh) -> str:
    treedef, fake, order = _optree_view(struct, leaves)
    mesh = wrap_mesh(resolve_mesh(mesh))
    key = (treedef, mesh, *[_leaf_key(x) for x in fake])
    plan = sm._in_plans.get(key)
    if plan is None:
        plan = sm._plan_inputs(key, treedef.unflatten(fake), fake, mesh)
    traced = _InPlan(tuple((order[i], fn) for i, fn in plan.actions), tuple((order[i], m) for i, m in plan.masks),
                     plan.shapes, plan.dtensor)
    traced.mesh = mesh
    traced.source = plan
    return _trace.register(traced)


@_trace.constant_result
def _out_plan_for_trace(sm, struct, leaves, mesh, plan) -> str:
    treedef, fake, order = _optree_view(struct, leaves)
    key = (treedef, plan.source, *[_leaf_key(x) for x in fake])
    oplan = sm._out_plans.get(key)
    if oplan is None:
        oplan = sm._plan_outputs(key, treedef.unflatten(fake), fake, plan.mesh, plan.source)
    traced = _OutPlan(tuple((order[i], d, spec) for i, d, spec in oplan.checks),
                      tuple((order[i], fn) for i, fn in oplan.actions))
    return _trace.register(traced)


# -- per-leaf actions (module level so plans hold no closures over the ShardMap) ---------------


def _convert(einshard, formula, mesh, opts, x):
    return einshard(formula, x, mesh=mesh, **opts)


def _zero_entry(mesh, summed, x):
    return shard_map_entry(x, mesh, summed)


def _from_dtensor(apply_from_dtensor, src, target, mesh, x):
    return apply_from_dtensor(x, src, target, mesh)


def _dtensor_convert(first, einshard, formula, mesh, opts, entries, x):
    local = first(x)
    token = None
    try:
        token = _context.push(shapes={**_context.current().shapes, **entries})
        return einshard(formula, local, mesh=mesh, **opts)
    finally:
        if token is not None:
            _context.pop(token)


def _to_dtensor(to_dtensor, layout, mesh, where, x):
    return to_dtensor(x, layout, mesh, where)


def _chain(steps, x):
    for s in steps:
        x = s(x)
    return x


# -- the public function -----------------------------------------------------------------------


def shard_map(f=_UNSET, in_specs=_UNSET, out_specs=_UNSET, *, mesh=None, shapes=None, check_vma=True, sizes=None,
              families=None):
    """Map ``f`` over the shards of a mesh: ``f`` runs on every rank with its local blocks.

    Two forms::

        @es.shard_map(in_specs, out_specs, mesh=mesh)
        def step(params, batch): ...

        step = es.shard_map(f, in_specs=..., out_specs=..., mesh=mesh)

    - ``in_specs``: a pytree prefix of the positional arguments (a tuple
      with one entry per argument, or one spec for all). A spec string at a
      node applies to every tensor below it; ``None`` passes a subtree
      through; non-tensor leaves pass through. ``"b/dp n c"``: the argument is
      already this rank's block of that layout (its local shape is checked)
      and the body sees it unchanged (``nn.Parameter`` s keep their identity,
      so ``.grad`` lands on them). ``"b n c -> b/dp n c"``: the argument
      arrives in the left layout and is converted on entry. Keyword
      arguments pass through unmapped.
    - ``out_specs``: a pytree prefix of the result. ``"b/dp n c"``: the body
      returns this rank's block of that layout; ``"// dp -> "``: converted
      on exit (here: summed over ``dp``).
    - ``mesh``: a ``DeviceMesh`` or ``es.wrap_mesh(...)``; default: the
      ambient mesh (``es.use_mesh``) at call time. Compound dimensions
      (``dp-tp``) are always allowed.
    - ``shapes``: split shapes for uneven shards, as for ``es.einshard``;
      ``sizes``/``families``: for factored axes and families in the specs.
    - ``check_vma``: track which mesh dimensions each tensor in the body
      varies over, pvary invariant values where they meet varying ones (so
      their gradients are summed), and check outputs against ``out_specs``.
      ``False`` runs the body at plain speed; mixing invariant and varying
      values in plain torch ops is then the caller's job (``es.spmd.pvary``).

    In the body the mesh and every split shape known from the specs are
    ambient: ``es.einshard`` needs no ``mesh=`` and no ``shapes=``. When an
    argument is a ``DTensor`` it is converted from its placements, and the
    outputs are returned as ``DTensor`` s with the out-specs' placements.

    >>> @es.shard_map(({"w": "h c"}, "b/dp n c"), "// dp", mesh=mesh)   # doctest: +SKIP
    ... def loss_fn(params, x):
    ...     y = es.einshard("b/dp n c, h c -> b/dp n h", x, params["w"])
    ...     return es.einshard("b/dp n h -> // dp", y * y)
    """
    if f is not _UNSET and (isinstance(f, ShardMap) or (callable(f) and not isinstance(f, (str, type(None))))):
        if in_specs is _UNSET or out_specs is _UNSET:
            raise TypeError("shard_map(f, in_specs=..., out_specs=...) needs both in_specs and out_specs")
        return ShardMap(f, in_specs, out_specs, mesh=mesh, shapes=shapes, check_vma=check_vma, sizes=sizes,
                        families=families)
    # decorator form: shard_map(in_specs, out_specs, ...) or shard_map(in_specs=..., out_specs=...)
    if f is not _UNSET:
        if out_specs is not _UNSET and in_specs is not _UNSET:
            raise TypeError("shard_map: the first argument must be the function, or pass in_specs, out_specs")
        if in_specs is not _UNSET:  # shard_map(in_specs, out_specs) positionally
            in_specs, out_specs = f, in_specs
        else:
            in_specs = f
    if in_specs is _UNSET or out_specs is _UNSET:
        raise TypeError("shard_map needs in_specs and out_specs")

    def decorate(fn):
        return ShardMap(fn, in_specs, out_specs, mesh=mesh, shapes=shapes, check_vma=check_vma, sizes=sizes,
                        families=families)

    # validate the specs now, so a typo is reported at decoration time
    spec_tree(in_specs if not isinstance(in_specs, list) else tuple(in_specs), families, "in_specs", "in")
    spec_tree(out_specs, families, "out_specs", "out")
    return decorate
