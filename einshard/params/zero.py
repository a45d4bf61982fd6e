"""Parameters stored sharded over data parallelism (ZeRO-3): gathered before use, gradients reduce-scattered.

A parameter registered with ``store="dp"`` holds a ``1/|dp|`` slice of its
compute block (its state's ``layout`` is the storage layout ``f/tp c/dp``,
``compute_layout`` the layout its computations see, ``f/tp c``). One formula
moves it, in both training styles::

    f/tp c/dp -> f/tp c // dp      # forward: all-gather over dp; backward: reduce-scatter over dp

The gathered block carries the compute layout and the duty over ``dp``, so the
formulas that use it leave its gradient partial over ``dp`` (and the torch
ops on per-rank rows do by themselves); the gather's backward reduce-scatters
it into the shard's ``.grad``, once. With a duty over more groups
(``grad="dp-sp"``, a norm weight replicated over ``sp`` too) the gather is
partial over all of them and its backward sums over each.

:func:`register_native_grad_reduction_hooks_` installs the gathers on a
module: each module that owns stored parameters gathers them when its
forward starts (the module's forward sees whole compute blocks under the
parameters' names) and puts the shards back when it ends. By default the
gathered blocks are not kept for backward (``reshard_after_forward=True``):
what autograd saves of them is a reference to the shard, gathered again when
backward needs it.

>>> gather_formula(ParameterState.from_layout("f/tp c", mesh_dim_names=("dp", "tp"), store="dp"))
'f/tp c/dp -> f/tp c // dp'
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import cast

import torch

from ..comm import collectives as C
from ..comm.backwards import PerBackward
from ..comm.grad_sums import DeferredSums, accumulates
from ..comm.mesh import Mesh
from ..core import _torch_compat
from ..core._split import compute_split_shapes_for_factors
from ..errors import EinshardError
from ..ops.einshard import einshard
from .buckets import DEFAULT_BUCKET_BYTES
from .names import components, runtime_mesh
from .reduce import install_sum_hooks
from .state import ParameterGradComm, ParameterState, gather_formula
from .storage import StorageView, StoredParameter, guarded_alias, substituted
from .store import PARAM_STATE_ATTR, get_parameter_state

__all__ = ["gather_formula", "scatter_formula", "GatheredParameter", "ZeroUnits", "gather_parameter", "units_of",
           "shard_map_entry", "stored_source", "BodyGathers",
           "register_native_grad_reduction_hooks_"]


def scatter_formula(state: ParameterState) -> str:
    """The gather's adjoint: the compute block's partial gradient summed and scattered to the shard."""
    source, target = gather_formula(state).split(" -> ")
    return f"{target} -> {source}"


_INSTALLED = "_einshard_zero_units"  # the attribute naming a stored parameter's installed ZeroUnits


def _per_name(value, name: str, what: str):
    """A dtype for every parameter, or a Mapping from parameter names to dtypes (absent: ``None``)."""
    if isinstance(value, Mapping):
        value = value.get(name)
    if value is not None and not isinstance(value, torch.dtype):
        raise TypeError(f"{what}= must be a torch.dtype or a Mapping from parameter names to dtypes, got {value!r}")
    return value


def _check_units(module, units) -> set:
    """The ids of the modules given as ``units=`` (each a submodule of ``module``, or ``module`` itself)."""
    if units is None:
        return set()
    if isinstance(units, torch.nn.Module):
        units = [units]
    members = {id(m) for m in module.modules()}
    out = set()
    for u in units:
        if not isinstance(u, torch.nn.Module) or id(u) not in members:
            raise EinshardError(f"units= must list the module or its submodules, got {type(u).__name__}")
        out.add(id(u))
    return out


def units_of(p) -> ZeroUnits | None:
    """The installed gathers of stored parameter ``p`` (``None`` when none are installed)."""
    return getattr(p, _INSTALLED, None)


class GatheredParameter(torch.Tensor):
    """A gathered compute block: a plain tensor for torch ops, carrying the compute layout and the duty
    (attribute ``einshard_state``) for the formulas.

    In a ``shard_map(check_vma=True)`` body, the variance tracking's ``pvary`` of the block over ``dims``
    calls :meth:`einshard_pvary` (when the block has a side accumulator): the contribution then reaches the
    gather's backward partial, which reduce-scatters it, instead of being all-reduced where it is used."""

    __torch_function__ = _torch_compat.disabled_torch_function_impl  # type: ignore[assignment]  # torch's own value
    _einshard_source: tuple  # (the stored parameter, its _Plan): a block gathered on a shard_map body's entry

    def einshard_pvary(self, dims):
        side = getattr(self, "_einshard_side", None)
        if side is None:
            return None
        return _PartialUse.apply(self, side, tuple(dims))


class _Side(dict):
    """The partial contributions of a gathered block's uses in a ``check_vma`` body, by ``pvary`` dims, and
    where their reduce-scatters can go at once (``plan``, the shard ``param``, its AccumulateGrad ``node``;
    ``None`` where no gradient is recorded: a frozen shard, or a forward under ``no_grad``/``inference_mode``,
    which just computes the values)."""

    __slots__ = ("plan", "param", "node")

    def __init__(self, plan, param):
        super().__init__()
        self.plan, self.param = plan, param
        recorded = param.requires_grad and torch.is_grad_enabled()
        self.node = torch.autograd.graph.get_gradient_edge(param).node if recorded else None


_BODY_SUMS = DeferredSums(1)  # the reduce-scatters of shard_map bodies' stored gradients: each starts at once


class _PartialUse(torch.autograd.Function):
    """Identity forward; backward reduce-scatters the (partial over ``dims``) gradient into the shard at once
    (asynchronously; added into ``.grad`` when backward ends), or keeps it for the gather's backward where
    that cannot wait (``torch.autograd.grad``, ``create_graph``, hooks on the shard)."""

    @staticmethod
    def forward(ctx, block, side, dims):
        ctx.side, ctx.dims = side, dims
        return block.view_as(block)

    @staticmethod
    def backward(ctx, grad):
        side, plan = ctx.side, ctx.side.plan
        if side.node is not None and set(plan._dims()) <= set(ctx.dims) and plan.deferrable(side.node, side.param):
            plan.defer(side.param, grad, ctx.dims, _BODY_SUMS)
            return None, None, None
        held = side.get(ctx.dims)
        side[ctx.dims] = grad if held is None else held + grad
        return None, None, None


@dataclass
class _Plan:
    """How one parameter is prepared for its module's forward: a stored one gathered (and its gradient
    scattered), any one cast to ``param_dtype`` (``cast_only``: not stored, just cast; its hooks sum it)."""

    state: ParameterState  # the stored one
    compute: ParameterState  # what the gathered block carries
    mesh: Mesh
    sizes: dict
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    summed: bool = False  # the gradient arrives summed (a shard_map body with check_vma=True): sliced, not scattered
    sums: DeferredSums | None = None  # where the reduce-scatters are bucketed (None: one formula each, at once)
    cast_only: bool = False
    owner: ZeroUnits | None = None  # the installed gathers (their no_sync accumulation), or None
    name: str | None = None  # the parameter's name in the model (for messages), when known

    @classmethod
    def of(cls, p, mesh, param_dtype=None, reduce_dtype=None, summed=False, sums=None) -> _Plan:
        state = get_parameter_state(p)
        if state is None or state.store is None:  # a cast-only plan never reads its states
            return cls(cast(ParameterState, state), cast(ParameterState, state), mesh, {}, param_dtype, reduce_dtype,
                       cast_only=True)
        compute = ParameterState.from_layout(state.compute_layout, mesh_dim_names=state.mesh_dim_names)
        compute = replace(compute, grad_comm=ParameterGradComm("explicit", state.grad_comm.mesh_dims, "native"),
                          global_shape=state.global_shape)
        sizes = {}
        if state.global_shape is not None:
            assert state.spec is not None  # a stored parameter's layout is known
            sizes = {a.name: n for a, n in zip(state.spec.axes, state.global_shape) if a.mesh}
        return cls(state, compute, mesh, sizes, param_dtype, reduce_dtype, summed, sums)

    def _dims(self) -> tuple:
        assert self.state.store is not None
        return tuple(n for n in self.mesh.names if n in components(self.state.store))

    def _store_axis(self) -> int:
        """The axis the storage group splits (a plan that is not cast-only has one)."""
        dim = self.state.store_axis
        assert dim is not None
        return dim

    def _blocks(self, dims=None):
        """``(group, order, index)`` of the storage group (or ``dims``): its process group, the group rank
        holding each block (``None``: block ``k`` on group rank ``k``, see ``es.Mesh.order``) and this
        rank's block. Every gather and scatter of a stored parameter goes through them: blocks follow mesh
        coordinates, as the registration cut them (:func:`einshard.params.metadata.storage_slice`)."""
        dims = self._dims() if dims is None else dims
        return self.mesh.group(dims), self.mesh.order(dims), self.mesh.index(dims)

    def start(self, shard: torch.Tensor):
        """Start gathering ``shard``'s compute block in ``param_dtype`` (no autograd): a
        :class:`~einshard.comm.collectives.PendingGather` (the block itself for a cast-only plan). The forward of
        :func:`gather_formula` is an all-gather over the storage group alone (its partial groups are a
        ``pvary``, the identity), so it may be issued ahead of its use (prefetch)."""
        with torch.no_grad():
            x = shard.detach()
            if self.param_dtype is not None and x.dtype != self.param_dtype:
                x = x.to(self.param_dtype)
            if self.cast_only:
                return x
            dim, dims = self._store_axis(), self._dims()
            n = self.mesh.size(dims)
            whole = self.state.global_shape[dim] if self.state.global_shape is not None else x.shape[dim] * n
            splits = compute_split_shapes_for_factors(whole, n, 1)
            group, order, _ = self._blocks(dims)
            return C.all_gather_start(x, group, dim, splits, order)

    def gather(self, shard: torch.Tensor, pending=None) -> torch.Tensor:
        """The compute block of ``shard`` (no autograd), in ``param_dtype``; ``pending``: its prefetched gather."""
        pending = self.start(shard) if pending is None else pending
        return pending.wait() if isinstance(pending, C.PendingGather) else pending

    def scatter(self, grad: torch.Tensor, dtype) -> torch.Tensor:
        """The shard's gradient: ``grad`` (partial) summed in ``reduce_dtype`` and scattered, in ``dtype``."""
        with torch.no_grad():
            if self.cast_only:  # summed by the hooks, in the parameter's own dtype
                return grad.to(dtype)
            if self.reduce_dtype is not None and grad.dtype != self.reduce_dtype:
                grad = grad.to(self.reduce_dtype)
            formula = scatter_formula(self.state)
            if self.summed:  # summed already: this rank's slice
                formula = f"{self.state.compute_layout} -> {self.state.layout}"
            out = einshard(formula, grad, mesh=self.mesh, sizes=self.sizes)
            return out if out.dtype == dtype else out.to(dtype)

    def summed_grad(self, whole, side, dtype) -> torch.Tensor:
        """The shard's gradient in a ``check_vma`` body: ``whole`` (the block's gradient from invariant uses)
        sliced, plus each partial contribution ``side[dims]`` summed over ``dims``: all-reduced over the
        dims besides the storage group, reduce-scattered over the storage group when it is among them."""
        with torch.no_grad():
            dim, store = self._store_axis(), self._dims()
            out = None if whole is None else einshard(f"{self.state.compute_layout} -> {self.state.layout}", whole,
                                                      mesh=self.mesh, sizes=self.sizes)
            for dims, g in side.items():
                if self.reduce_dtype is not None and g.dtype != self.reduce_dtype:
                    g = g.to(self.reduce_dtype)
                extra = tuple(d for d in dims if d not in store)
                if extra and self.mesh.size(extra) > 1:
                    g = C.all_reduce(g, self.mesh.group(extra))
                n = self.mesh.size(store)
                splits = compute_split_shapes_for_factors(g.shape[dim], n, 1)
                group, order, index = self._blocks(store)
                if set(store) <= set(dims):
                    part = C.reduce_scatter(g, group, dim, splits, order)
                else:  # a use that does not vary over the storage group: this rank's slice
                    part = g.narrow(dim, sum(splits[:index]), splits[index])
                part = part.to(out.dtype if out is not None else dtype)
                out = part if out is None else out + part
            side.clear()
            assert out is not None  # a block's gradient: from its invariant uses or from its partial ones
            return out.to(dtype) if out.dtype != dtype else out

    def deferrable(self, node, p) -> bool:
        """Whether this backward's reduce-scatter can join a bucket (into a leaf the running backward
        accumulates into, with no hook reading its gradient first)."""
        if self.cast_only or (self.sums is None and not self.summed):
            return False
        if torch.is_grad_enabled() or not accumulates(node):
            return False
        return not p._backward_hooks and not getattr(p, "_post_accumulate_grad_hooks", None)

    def defer(self, p, grad, partial=None, sums=None) -> None:
        """Cut ``grad`` (the compute block's gradient, partial over the duty's groups, or over the dims
        ``partial``) into the group ranks' slices and bucket them (in ``sums``, default the plan's); the
        other groups (a norm weight's ``sp``, ``tp``) are all-reduced first."""
        if self.reduce_dtype is not None and grad.dtype != self.reduce_dtype:
            grad = grad.to(self.reduce_dtype)
        dim = self._store_axis()
        dims = self._dims()
        over = partial if partial is not None else {n for g in self.state.grad_comm.mesh_dims for n in components(g)}
        extra = tuple(n for n in self.mesh.names if n not in dims and n in over)
        if extra and self.mesh.size(extra) > 1:  # the duty's other groups (sp, tp): summed here, at once
            grad = C.all_reduce(grad.detach(), self.mesh.group(extra))
        splits = compute_split_shapes_for_factors(grad.shape[dim], self.mesh.size(dims), 1)
        group, order, _ = self._blocks(dims)
        sums = self.sums if sums is None else sums
        assert sums is not None  # deferrable() holds
        sums.add_scatter(p, torch.split(grad.detach(), splits, dim), group, order)


class _Gather(torch.autograd.Function):
    """Forward: the gathered compute block; backward: the reduce-scattered gradient of the shard."""

    @staticmethod
    def forward(ctx, shard, plan, pending=None, side=None):
        ctx.plan, ctx.dtype, ctx.shard, ctx.side = plan, shard.dtype, shard, side
        return plan.gather(shard, pending)

    @staticmethod
    def backward(ctx, grad):
        if ctx.side is not None:  # a check_vma body: whole contributions sliced, partial ones reduce-scattered
            return ctx.plan.summed_grad(grad, ctx.side, ctx.dtype), None, None, None
        owner = ctx.plan.owner
        leaf = ctx.next_functions[0][0]  # the shard's AccumulateGrad
        if owner is not None and not ctx.plan.cast_only and _accumulates_into(leaf):
            # (torch.autograd.grad returns the gradient of its call alone: no_sync's sums are not its own)
            grad = owner.accumulated(ctx.shard, grad)
            if grad is None:  # inside no_sync: kept unreduced until the first backward after it; a zero .grad
                return torch.zeros_like(ctx.shard), None, None, None  # marks it (zero_grad() drops it)
        if leaf is not None and hasattr(leaf, "variable") and ctx.plan.deferrable(leaf, leaf.variable):
            ctx.plan.defer(leaf.variable, grad)  # bucketed; written into .grad at the end of backward
            if owner is not None:
                owner.deferred(leaf.variable)
            return None, None, None, None
        return ctx.plan.scatter(grad, ctx.dtype), None, None, None


def _accumulates_into(leaf) -> bool:
    """Whether the running backward accumulates into the leaf of AccumulateGrad node ``leaf``."""
    return leaf is not None and hasattr(leaf, "variable") and accumulates(leaf)


def gather_parameter(p: torch.nn.Parameter, plan: _Plan, pending=None, side=None) -> GatheredParameter:
    """``p``'s compute block, gathered (its gradient reduce-scattered back into ``p.grad``); ``pending``:
    its prefetched gather (:meth:`_Plan.start`); ``side``: the accumulator of its partial uses in a
    ``check_vma`` body (see :class:`GatheredParameter`)."""
    out = _Gather.apply(p, plan, pending, side).as_subclass(GatheredParameter)
    if side is not None:
        out._einshard_side = side
    if plan.compute is not None:
        setattr(out, PARAM_STATE_ATTR, plan.compute)
    return out


def shard_map_entry(p: torch.nn.Parameter, mesh, summed: bool) -> GatheredParameter:
    """A stored parameter given to ``es.shard_map`` with its storage spec: its compute block for the body.

    ``summed``: a body that tracks variance (``check_vma=True``): where its ``pvary`` marks the block varying
    (it meets data that varies over ``dp``), the contribution is kept partial and reduce-scattered by the
    gather's backward; contributions the body summed itself are sliced. Else (a per-rank body) the body's
    formulas leave it partial and it is reduce-scattered, as with the hooks.
    """
    plan = _Plan.of(p, mesh, summed=summed)
    out = gather_parameter(p, plan, side=_Side(plan, p) if summed else None)
    out._einshard_source = (p, plan)
    return out


def stored_source(x) -> torch.nn.Parameter | None:
    """The stored parameter whose compute block ``x`` is (gathered on a ``shard_map`` body's entry), or ``None``."""
    source = getattr(x, "_einshard_source", None)
    return None if source is None else source[0]


class BodyGathers:
    """While a ``shard_map`` body runs: what autograd saves of the blocks gathered on entry is a reference to
    their shards, gathered again when backward needs them (once per parameter and backward), so no gathered
    block outlives the body's forward. A context manager; ``None`` from :meth:`of` when there is none."""

    def __init__(self, blocks):
        self._gathered = {_storage_key(b): (p, plan, b) for b, p, plan in blocks}
        self._cache: dict = {}
        self.live: list = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, ZeroUnits._unpack)

    @classmethod
    def of(cls, leaves) -> BodyGathers | None:
        blocks = [(x, *x._einshard_source) for x in leaves
                  if isinstance(x, GatheredParameter) and getattr(x, "_einshard_source", None) is not None]
        return cls(blocks) if blocks else None

    def __enter__(self) -> BodyGathers:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._gathered = {}  # no reference to a gathered block is kept

    def _pack(self, t):
        found = self._gathered.get(_storage_key(t)) if self._gathered and isinstance(t, torch.Tensor) else None
        return t if found is None else _Saved(found[0], found[1], self, t, found[2])

    def regather(self, saved: _Saved) -> torch.Tensor:
        ref = self._cache.get(id(saved.param))
        block = None if ref is None else ref()
        if block is None:
            block = saved.plan.gather(saved.param)
            self._cache[id(saved.param)] = weakref.ref(block)
            self.live.append(weakref.ref(block))
        return block.as_strided(saved.size, saved.stride, block.storage_offset() + saved.offset)


# -- freeing after forward: saved gathered blocks are gathered again in backward -------------------------


class _Saved:
    """What autograd keeps of a gathered block: the shard, the view of the block it saved, and the shard's
    version then (``kept``: the view itself, when blocks are kept until backward)."""

    __slots__ = ("param", "plan", "unit", "size", "stride", "offset", "version", "kept")

    def __init__(self, param, plan, unit, t, base, kept=False):
        self.param, self.plan, self.unit = param, plan, unit
        self.size, self.stride = tuple(t.size()), tuple(t.stride())
        self.offset = t.storage_offset() - base.storage_offset()
        self.version = param._version
        self.kept = t if kept else None

    def check(self) -> None:
        """Refuse a shard changed in place since its block was saved (as autograd refuses a saved tensor
        modified in place): gathering it again would give the gradient of another forward."""
        if self.param._version != self.version:
            raise EinshardError(
                f"{_describe(self.plan, self.param)} was modified by an inplace operation after the forward that "
                f"used it (its version is {self.param._version}, the forward saw {self.version}); backward would "
                "compute the gradients of other values. Change stored parameters after backward (the optimizer "
                "step), or run the forward again"
            )


def _describe(plan, p) -> str:
    """How messages name stored parameter ``p``: its name when known, else its layout and shape."""
    if plan.name is not None:
        return f"{'parameter' if plan.cast_only else 'stored parameter'} {plan.name!r}"
    return f"a stored parameter (layout {plan.state.layout!r}, storage block of shape {tuple(p.shape)})"


def _stamp(p) -> tuple:
    """What a gather issued ahead depends on: the shard's version (in-place changes) and memory (replaced)."""
    return p._version, p.data_ptr()


def _drop(pending) -> None:
    """Complete an issued gather whose result is not used (every rank issued it: every rank waits for it)."""
    if isinstance(pending, C.PendingGather):
        pending.wait()


def _source(owner, name, p, plan):
    """What a unit's forward gathers for stored parameter ``p`` (``owner.name``), and how: ``p`` itself, or
    the tensor ``torch.func.functional_call`` put in its place, which must be a storage block like ``p``'s
    (it is gathered, and its gradient reduce-scattered into it, each backward; the module's forward holds a
    guarded alias of it, see :meth:`ZeroUnits._guard_substitutes`)."""
    held = owner._parameters.get(name)
    passed = substituted(held)
    held = held if passed is None else passed
    if held is p:
        return p, plan
    if not isinstance(held, torch.Tensor) or isinstance(held, GatheredParameter) or held.shape != p.shape:
        what = type(held).__name__ if not isinstance(held, torch.Tensor) else f"a tensor of shape {tuple(held.shape)}"
        raise EinshardError(
            f"{_describe(plan, p)} holds {what} in place of its storage block (shape {tuple(p.shape)}, layout "
            f"{plan.state.layout!r}), put there by torch.func.functional_call or an assignment: the gathers "
            "installed by register_native_grad_reduction_hooks_ substitute tensors of the storage block's shape "
            "(as model.named_parameters() holds them) and gather them; pass this rank's storage block"
        )
    return held, replace(plan, owner=None)


def _storage_key(t):
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (a fake or functional tensor)
        return None


class ZeroUnits:
    """The gathers installed on a module (see the module docstring); a part of the hooks' handle.

    ``live``: the gathered blocks alive now, as weak references (for tests and memory checks);
    ``order``: the modules (indices into ``modules``) in the order their forwards first ran, recorded up to
    the first :meth:`wait` (the first step); ``in_flight``: the parameters whose prefetched gathers are
    issued and not yet used. With ``prefetch``, once the order is known each module's forward issues the
    next module's gathers before it computes, and backward, gathering a freed block again, issues the
    next one in the order the first step's backward gathered them.
    """

    def __init__(self, module, mesh, *, reshard_after_forward=True, param_dtype=None, reduce_dtype=None,
                 bucket_bytes=DEFAULT_BUCKET_BYTES, prefetch=True, units=None):
        self.mesh = runtime_mesh(mesh)
        self.sums = DeferredSums(bucket_bytes)  # the reduce-scatters, bucketed and started during backward
        self.reshard_after_forward = bool(reshard_after_forward)
        self._units = []  # (module, [(name, p, plan)])
        self._handles = []
        self._gathered: dict = {}  # storage key -> (p, plan, block) while a unit's forward runs
        self._cache: dict = {}  # id(p) -> weakref of the block gathered again in backward
        self._contexts: list = []  # per running unit forward: ([(owner, name, what it held)], saved-tensor hooks)
        self._substitutes: list = []  # per running root forward: [(owner, name, passed tensor, its guarded alias)]
        self.live: list = []
        self.order: list = []
        self.prefetch = bool(prefetch)
        self._recording = True
        self._ahead: dict = {}  # id(p) -> (p, pending gather) issued ahead of its use (forward or backward)
        self._unit_of: dict = {}  # id(p) -> the index of the module that gathers it
        self._back_order: list = []  # the parameters in the order backward first gathered them again
        self._no_sync = 0
        self._unreduced: dict = {}  # id(p) -> (p, plan, the compute block's gradient summed locally in no_sync)
        # per backward: what it kept in no_sync (joins _unreduced when it ends; dropped if it raised) and its
        # units' parameters whose gradients are not yet bucketed
        self._backwards = PerBackward(_ZeroPass, self._end_of_backward, _ZeroPass.clear)
        given = _check_units(module, units)
        unit_of: dict = {}  # module name -> the unit (module) whose forward gathers its parameters
        grouped: dict = {}  # id(unit) -> (unit, [((owner, name), p, plan)])
        for prefix, m in module.named_modules():
            parent = unit_of.get(prefix.rpartition(".")[0]) if prefix else None
            unit = m if id(m) in given or parent is None else parent
            unit_of[prefix] = unit if id(m) in given or parent is not None else None  # inherited below a unit
            for name, p in m.named_parameters(recurse=False):
                full = f"{prefix}.{name}" if prefix else name
                state = get_parameter_state(p)
                dtype = _per_name(param_dtype, full, "param_dtype")
                cast = dtype is not None and p.is_floating_point() and p.dtype != dtype
                if (state is not None and state.store is not None) or cast:
                    plan = _Plan.of(p, self.mesh, dtype, _per_name(reduce_dtype, full, "reduce_dtype"), sums=self.sums)
                    plan.owner, plan.name = self, full
                    grouped.setdefault(id(unit), (unit, []))[1].append(((m, name), p, plan))
        self._units = list(grouped.values())
        for p in self.parameters:
            setattr(p, _INSTALLED, self)
        for i, (m, stored) in enumerate(self._units):
            for _, p, _ in stored:
                self._unit_of[id(p)] = i
            self._handles.append(m.register_forward_pre_hook(self._pre(i, stored)))
            self._handles.append(m.register_forward_hook(self._post(stored), always_call=True))
        if self.parameters:  # first of the root's pre-hooks, last of its hooks (after its own unit's)
            self._handles.append(module.register_forward_pre_hook(self._guard_substitutes, prepend=True))
            self._handles.append(module.register_forward_hook(self._unguard_substitutes, always_call=True))

    def _guard_substitutes(self, module, args) -> None:
        """For the root module's forward: each tensor of a storage block's shape put in a stored parameter's
        place (``torch.func.functional_call``) is replaced by a guarded alias of it, so plain torch use outside
        the forward of the module that gathers it refuses, as the stored parameter's does (its unit gathers the
        passed tensor itself); :meth:`_unguard_substitutes` puts the passed tensors back."""
        swapped: list = []
        self._substitutes.append(swapped)
        for _, stored in self._units:
            for (owner, name), p, plan in stored:
                held = owner._parameters.get(name)
                if (plan.cast_only or held is p or not isinstance(held, torch.Tensor) or held.shape != p.shape
                        or isinstance(held, (GatheredParameter, StoredParameter, StorageView))):
                    continue  # the registered shard, or what the unit refuses (another shape), or guarded already
                alias = guarded_alias(held, p)
                owner._parameters[name] = alias
                swapped.append((owner, name, held, alias))

    def _unguard_substitutes(self, module, args, out) -> None:
        swapped = self._substitutes.pop() if self._substitutes else []
        for owner, name, held, alias in reversed(swapped):
            if owner._parameters.get(name) is alias:
                owner._parameters[name] = held

    @property
    def modules(self) -> list:
        """The modules whose forwards gather (or cast) parameters."""
        return [m for m, _ in self._units]

    @property
    def in_flight(self) -> list:
        """The parameters whose gathers were issued ahead of their use and not used yet."""
        return [p for p, pending, _ in self._ahead.values() if getattr(pending, "in_flight", False)]

    def _issue(self, unit: int | None) -> None:
        """Start the gathers of module ``unit`` (by index) ahead of its use, unless started already."""
        if unit is None or not self.prefetch:
            return
        for _, p, plan in self._units[unit][1]:
            if not plan.cast_only:
                self._issue_one(p, plan)

    def _issue_one(self, p, plan) -> None:
        """Start gathering ``p`` ahead of its use, unless a gather of its current values is in flight (one of
        values it no longer holds, changed in place or replaced since, is dropped)."""
        found = self._ahead.get(id(p))
        if found is not None and found[0] is p and found[2] == _stamp(p):
            return
        if found is not None:
            _drop(found[1])
        self._ahead[id(p)] = (p, plan.start(p), _stamp(p))

    def _issue_next_in_backward(self, p) -> None:
        """Record (first step) or follow the order backward gathers freed blocks again in: the next one's
        gather is issued before this one's block is used."""
        if id(p) not in self._unit_of:  # a tensor functional_call substituted: not in the recorded order
            return
        if self._recording:
            if all(q is not p for q in self._back_order):
                self._back_order.append(p)
            return
        if not self.prefetch:
            return
        k = next((i for i, q in enumerate(self._back_order) if q is p), None)
        if k is None or k + 1 >= len(self._back_order):
            return
        q = self._back_order[k + 1]
        self._issue_one(q, self._plan_of(q))

    def deferred(self, p) -> None:
        """``p``'s gradient joined a bucket: once every stored parameter of its module has, the module's
        buckets start (as FSDP2 reduce-scatters per module), so no whole gradient waits for others."""
        unit = self._unit_of.get(id(p))
        if unit is None:
            return
        pending_in_unit = self._backwards.current().pending_in_unit
        left = pending_in_unit.get(unit)
        if left is None:
            left = {id(q) for _, q, plan in self._units[unit][1] if not plan.cast_only}
            pending_in_unit[unit] = left
        left.discard(id(p))
        if not left:
            del pending_in_unit[unit]
            self.sums.start_filling()

    def _neighbour(self, unit: int, step: int) -> int | None:
        """The module after (``step=1``) or before (``-1``) ``unit`` in the recorded order."""
        if self._recording or unit not in self.order:
            return None
        k = self.order.index(unit) + step
        return self.order[k] if 0 <= k < len(self.order) else None

    def _take(self, p):
        """``p``'s gather issued ahead, if it gathers the values ``p`` holds now (else it is dropped: ``None``)."""
        found = self._ahead.pop(id(p), None)
        if found is None:
            return None
        if found[0] is p and found[2] == _stamp(p):
            return found[1]
        _drop(found[1])
        return None

    @property
    def parameters(self) -> list:
        """The stored parameters whose gathers are installed."""
        return [p for _, stored in self._units for _, p, plan in stored if not plan.cast_only]

    def _pre(self, unit, stored):
        def hook(m, args):
            swapped: list = []
            self._contexts.append((swapped, None))  # popped by the forward hook, which runs even if this raises
            sources = [_source(owner, name, p, plan) for (owner, name), p, plan in stored]  # refusals first
            if self._recording and unit not in self.order:
                self.order.append(unit)
            self._issue(unit)
            self._issue(self._neighbour(unit, 1))  # the next module's gathers fly while this one computes
            for ((owner, name), p, _), (src, plan) in zip(stored, sources):
                pending = self._take(p)
                if src is not p:  # substituted (torch.func.functional_call): the passed tensor is gathered
                    _drop(pending)
                    pending = None
                block = gather_parameter(src, plan, pending)
                swapped.append((owner, name, owner._parameters[name]))
                owner._parameters[name] = block
                self.live.append(weakref.ref(block))
                self._gathered[_storage_key(block)] = (src, plan, block)
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            ctx.__enter__()
            self._contexts[-1] = (swapped, ctx)

        return hook

    def _post(self, stored):
        def hook(m, args, out):
            swapped, ctx = self._contexts.pop()
            for owner, name, held in reversed(swapped):  # what the module held: the shard, or a substitute
                block = owner._parameters[name]
                owner._parameters[name] = held
                self._gathered.pop(_storage_key(block), None)
            if ctx is not None:
                ctx.__exit__(None, None, None)
            self.live = [r for r in self.live if r() is not None]

        return hook

    def _pack(self, t):
        if not self._gathered or not isinstance(t, torch.Tensor):
            return t
        found = self._gathered.get(_storage_key(t))
        if found is None:
            return t
        p, plan, block = found
        return _Saved(p, plan, self, t, block, kept=not self.reshard_after_forward)

    @staticmethod
    def _unpack(x):
        if type(x) is not _Saved:
            return x
        x.check()
        return x.kept if x.kept is not None else x.unit.regather(x)

    def regather(self, saved: _Saved) -> torch.Tensor:
        """The saved view of a freed block, from the block gathered again (once per backward and parameter)."""
        ref = self._cache.get(id(saved.param))
        block = None if ref is None else ref()
        if block is None:
            pending = self._take(saved.param)
            self._issue_next_in_backward(saved.param)
            block = saved.plan.gather(saved.param, pending)
            self._cache[id(saved.param)] = weakref.ref(block)
            self.live.append(weakref.ref(block))
        return block.as_strided(saved.size, saved.stride, block.storage_offset() + saved.offset)

    # the handle's part interface (einshard.params.reduce.NativeGradReductionHandle)
    @property
    def pending(self) -> int:
        """Reduce-scatters started and not yet written (they all are when backward returns)."""
        return self.sums.pending

    def wait(self) -> ZeroUnits:
        """End of a step: the order is recorded (after the first), unused prefetches are waited for and dropped."""
        self._recording = False
        self._backwards.purge()
        self._flush_unreduced()
        for _, pending, _ in self._ahead.values():
            _drop(pending)
        self._ahead.clear()
        self._cache.clear()
        self.live = [r for r in self.live if r() is not None]
        return self

    def accumulated(self, p, grad):
        """``grad`` (a stored parameter's partial compute-block gradient) plus what ``no_sync`` kept of it;
        ``None`` inside ``no_sync`` (it is kept, unreduced, by the running backward until it ends). What
        ``no_sync`` kept is dropped when ``p.grad`` is ``None`` (``zero_grad()`` since; it leaves a ``.grad``)."""
        if p.grad is None:
            self._unreduced.pop(id(p), None)
        if self._no_sync:
            kept = self._backwards.current().unreduced
            held = kept.get(id(p))
            kept[id(p)] = (p, self._plan_of(p), grad.clone() if held is None else _add_into(held[2], grad))
            return None
        held = self._unreduced.pop(id(p), None)
        return grad if held is None else _add_into(held[2], grad)

    def _end_of_backward(self, now: _ZeroPass) -> None:
        """What the backward ``now`` kept in ``no_sync`` joins what earlier ones kept."""
        for key, (p, plan, grad) in now.unreduced.items():
            held = self._unreduced.get(key)
            self._unreduced[key] = (p, plan, grad if held is None else _add_into(held[2], grad))

    def _plan_of(self, p):
        return next(plan for _, stored in self._units for _, q, plan in stored if q is p)

    def _flush_unreduced(self) -> None:
        """Reduce-scatter what ``no_sync`` kept into the shards' ``.grad`` (no backward came after it)."""
        held, self._unreduced = self._unreduced, {}
        for p, plan, grad in held.values():
            if p.grad is None:  # zero_grad() since: dropped, as in one process
                continue
            with torch.no_grad():
                part = plan.scatter(grad, p.dtype)
                p.grad = part if p.grad is None else p.grad.add_(part)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate the stored parameters' gradients unreduced (a compute block each, in the gradient's
        dtype); the first backward after the block (or :meth:`wait`) reduce-scatters the sum, once.
        ``torch.autograd.grad`` (inside the block or after it) returns its own call's gradient alone, and
        what a backward that raised kept is dropped."""
        self._no_sync += 1
        try:
            yield self
        finally:
            self._no_sync -= 1

    def remove(self) -> ZeroUnits:
        for h in self._handles:
            h.remove()
        self._handles = []
        for p in self.parameters:
            if getattr(p, _INSTALLED, None) is self:
                delattr(p, _INSTALLED)
        return self


class _ZeroPass:
    """One backward's part of :class:`ZeroUnits`: ``unreduced`` (what it kept in ``no_sync``, by ``id(p)``),
    ``pending_in_unit`` (unit index -> its parameters whose gradients are not yet bucketed)."""

    __slots__ = ("unreduced", "pending_in_unit")

    def __init__(self):
        self.unreduced: dict = {}
        self.pending_in_unit: dict = {}

    def clear(self) -> None:
        """A backward that raised: what it kept is dropped."""
        self.unreduced.clear()
        self.pending_in_unit.clear()


def _add_into(held: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``held += grad`` (in ``held``'s dtype)."""
    return held.add_(grad) if held.dtype == grad.dtype else held + grad.to(held.dtype)


def register_native_grad_reduction_hooks_(module, mesh, *, bucket_bytes=DEFAULT_BUCKET_BYTES,
                                          reshard_after_forward=True, param_dtype=None, reduce_dtype=None,
                                          prefetch=True, units=None):
    """Hooks that SUM each native-duty gradient over its groups during backward, and gather the
    parameters stored sharded (``store=``) before use; returns a handle.

    ``async`` duties are bucketed (about ``bucket_bytes`` per all-reduce) and
    start during backward; call ``handle.wait()`` before the optimizer step
    (with every schedule). Every rank must run backward over the same
    parameters in the same order. A parameter that gets no gradient keeps
    ``.grad is None``; one frozen now is hooked once it requires gradients;
    ``torch.autograd.grad`` returns summed gradients. A parameter whose
    gradient hooks sum already is refused.

    Stored parameters are gathered when the forward of the module that owns
    them starts (``units=``: the modules whose forwards gather every stored
    parameter of their subtree, like ``fully_shard``'s modules; the others
    still gather their own), and their gradients reduce-scattered into their shards'
    ``.grad`` (see :doc:`params`). ``reshard_after_forward``: free the gathered
    blocks after forward and gather them again in backward (default), or keep
    them until backward. Mixed precision (a dtype for every parameter, or a
    Mapping from parameter names to dtypes): ``param_dtype`` is what each
    module's forward sees (parameters are cast there, stored ones gathered in
    it), ``reduce_dtype`` what stored parameters' gradients are summed in
    (by default the compute dtype); the master parameters, their ``.grad`` and
    the optimizer states keep the parameters' own dtype, and the hooks sum the
    other parameters' gradients in it.

    >>> handle = es.params.register_native_grad_reduction_hooks_(model, mesh)   # doctest: +SKIP
    >>> loss.backward(); handle.wait(); opt.step()                       # doctest: +SKIP
    """
    for name, p in module.named_parameters():
        state = get_parameter_state(p)
        if state is not None and state.store is not None and getattr(p, _INSTALLED, None) is not None:
            raise EinshardError(
                f"native gradient hooks ({name!r}): the parameter's gathers are installed already (an earlier "
                "register_native_grad_reduction_hooks_); remove them first (handle.remove())"
            )
    handle = install_sum_hooks(module, mesh, bucket_bytes=bucket_bytes)
    try:
        units = ZeroUnits(module, mesh, reshard_after_forward=reshard_after_forward, param_dtype=param_dtype,
                          reduce_dtype=reduce_dtype, bucket_bytes=bucket_bytes, prefetch=prefetch, units=units)
    except BaseException:
        handle.remove()
        raise
    handle.adopt(units)
    return handle
