"""Variance tracking for ``shard_map`` bodies (``check_vma=True``).

Inside a ``shard_map`` body every tensor either holds the same value on every
rank of a mesh dimension (it is *invariant* over it) or may hold a different
value per rank (it *varies* over it). The set of mesh dimensions a tensor
varies over is its **vma** (JAX's name: "varying manual axes").

Why it matters: a value that is invariant over ``d`` but feeds rank-specific
computation is really used ``size(d)`` times, so its gradient must be summed
over ``d``. JAX's ``pvary`` marks that (identity forward, ``psum`` of the
gradient backward). With ``check_vma=True`` this module inserts it
automatically:

- body inputs get their vma from their specs (the mesh dimensions the body
  layout shards or is partial over);
- plain torch operations (seen through a ``TorchFunctionMode``): the output
  varies over the union of the inputs' vmas, and every input that requires
  grad and lacks some of those dimensions is ``pvary``-ed over the missing
  ones first; an in-place op makes the tensor it writes (and the tensor that
  is a view of) vary like the union, pvary-ing its old value in place;
- library operations (``es.einshard``, the named collectives, and later
  ``einfft``/``einhalo``) run with tracking suspended and set their outputs'
  vma from their semantics (:func:`formula_op`, :func:`library_call`);
- ``torch.autograd.grad`` returns gradients with the vma of their inputs (a
  cotangent has the type of its primal).

Representation: a tensor's vma is a bit mask over the mesh dimensions,
stored as one integer attribute (``_es_vma``) that also carries the serial
number of the ``shard_map`` call that set it, so tags left on tensors by an
earlier call are ignored (and a tag is a plain ``int``: harmless in a
``state_dict`` or pickle). Tensors without a current tag are invariant.

Library ops pay nothing outside tracked bodies: they check the module global
:data:`ACTIVE` (tracking bodies running) first, ``if _vma.ACTIVE and
_vma.current() is not None: return _vma.formula_op(my_op, formula, tensors, ...)``
(``es.einshard``, the hottest, reads the context once: :func:`tracking_ambient`,
then :func:`formula_op_in`).

Eager costs: the tracker is pushed as the ``TorchFunctionMode`` itself, and a
plain torch op costs one Python call; what the mode machinery costs per op is
the floor. What repeats from call to call is replayed: a formula op's decision
(output variance, operands to pvary) is kept per mesh under the formula and its
operands' variance, and a ``shard_map`` keeps the pvary-ed aliases of the
parameters its body uses (:mod:`einshard.runtime.vma_aliases`).
Nothing is added to backward: over mesh dimensions of size 1 no
pvary (no autograd node, no alias) is inserted, so the graph is the untracked
one there.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..comm._traced_collectives import all_reduce
from ..comm.grad_sums import leaf_sum
from ..comm.mappings import allreduce_forward_identity_backward, identity_forward_allreduce_backward
from ..core import _context, _torch_compat, _trace
from ..core._cache import BoundedCache
from ..core._torch_compat import in_traced_code
from ..errors import EinshardError
from ..notation import expand_specs, freeze_families
from .vma_aliases import LeafAliases

__all__ = [
    "ACTIVE",
    "Tracker",
    "current",
    "get_vma",
    "formula_op",
    "formula_op_in",
    "library_call",
    "pvary_tensor",
    "run_tracked",
    "run_replayed",
    "tracking_ambient",
    "TracedTracker",
    "UNKNOWN",
]

#: number of ``shard_map(check_vma=True)`` bodies running in this process (any thread)
ACTIVE = 0

ATTR = "_es_vma"
MASK = (1 << 32) - 1  # the mask bits of a tag (above them: the serial of the shard_map call)
_SERIALS = itertools.count(2)  # eager calls; 1 is every traced call's (TRACED_SERIAL)
_Tensor = torch.Tensor
_SEQ = (list, tuple)
_DisableTorchFunction = _torch_compat.DisableTorchFunction
_grad_enabled = torch.is_grad_enabled


# -- per-mesh static data ------------------------------------------------------------


class _MeshInfo:
    """Bit masks of a mesh's dimensions, groups per mask, formula rules (cached per mesh)."""

    __slots__ = ("mesh", "names", "bit", "groups", "formulas", "decisions", "trivial", "__weakref__")

    def __init__(self, mesh):
        self.mesh = mesh
        self.names = tuple(mesh.names)
        self.bit = {n: 1 << i for i, n in enumerate(self.names)}
        # the dimensions of size 1: pvary over them is the identity, forward and backward
        self.trivial = 0
        for i, n in enumerate(self.names):
            if mesh.size(n) == 1:
                self.trivial |= 1 << i
        self.groups: dict[int, object] = {}
        self.formulas = BoundedCache(4096)
        self.decisions = BoundedCache(4096)  # (formula, operand masks) -> what formula_op_in does (_formula_decision)

    def mask(self, name_or_names) -> int:
        """The mask of a (compound) dimension name or an iterable of names."""
        if isinstance(name_or_names, str):
            names = self.mesh.dims(name_or_names)
        else:
            names = []
            for n in name_or_names:
                names.extend(self.mesh.dims(n))
        m = 0
        for n in names:
            m |= self.bit[n]
        return m

    def dims(self, mask: int) -> tuple[str, ...]:
        return tuple(n for n in self.names if mask & self.bit[n])

    def group(self, mask: int):
        g = self.groups.get(mask)
        if g is None:
            g = self.mesh.group(self.dims(mask))
            self.groups[mask] = g
        return g


_INFOS = BoundedCache(64, name="einshard.runtime.vma.infos")


def same_mesh(info: _MeshInfo, mesh) -> bool:
    """Whether ``mesh`` (a Mesh, a DeviceMesh, or ``None``: the tracker's own) is the tracked body's mesh."""
    mine = info.mesh
    if mesh is None or mesh is mine:
        return True
    if hasattr(mesh, "names"):  # a Mesh (es.wrap_mesh)
        names, shape, dm = tuple(mesh.names), tuple(mesh.shape), mesh.device_mesh
    else:  # a DeviceMesh
        names, shape, dm = tuple(getattr(mesh, "mesh_dim_names", None) or ()), tuple(mesh.mesh.shape), mesh
    if names != info.names or shape != tuple(mine.shape):
        return False
    if dm is mine.device_mesh:
        return True
    if dm is None or mine.device_mesh is None:
        return False
    with _DisableTorchFunction():
        return torch.equal(dm.mesh, mine.device_mesh.mesh)


def mesh_info(mesh) -> _MeshInfo:
    info = _INFOS.get(mesh)
    if info is None or info.mesh is not mesh:
        info = _INFOS.put(mesh, _MeshInfo(mesh))
    return info


# -- pvary ---------------------------------------------------------------------------


def pvary_tensor(x: torch.Tensor, group) -> torch.Tensor:
    """JAX's ``pvary``: identity forward; the gradient is summed over ``group`` in backward."""
    return identity_forward_allreduce_backward(x, group)


def psum_tensor(x: torch.Tensor, group) -> torch.Tensor:
    """JAX's ``psum`` (the adjoint of ``pvary``): all-reduce forward, identity backward.

    The backward is ``pvary`` (an identity whose own backward all-reduces), so
    double backward through ``psum`` is right too.
    """
    return allreduce_forward_identity_backward(x, group)


class _PVaryInPlace(torch.autograd.Function):
    """``pvary`` applied in place (``t`` keeps its identity): identity forward, gradient summed backward
    (``traced``: with a functional all-reduce, for code that ``torch.compile`` traces)."""

    @staticmethod
    def forward(ctx, x, group, traced=False):
        ctx.group, ctx.traced = group, traced
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return (all_reduce(grad, ctx.group) if ctx.traced else psum_tensor(grad, ctx.group)), None, None


# -- the tracker -----------------------------------------------------------------------


def _tensor_args(args, kwargs) -> list:
    """The tensors among a torch function's arguments, also inside lists (``torch.cat(tensors=[...])``)."""
    out = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, _Tensor):
            out.append(a)
        elif type(a) in _SEQ:
            out.extend(b for b in a if isinstance(b, _Tensor))
    return out


class _Rules:
    """What the eager and the traced trackers share: widening an op's operands."""

    __slots__ = ()
    # what each tracker class defines
    info: _MeshInfo
    is_inplace: Callable[[Any], bool]
    mask_of: Callable[[Any], int]
    pvary: Callable[[torch.Tensor, int, int], torch.Tensor]
    pvary_inplace: Callable[[torch.Tensor, int], None]

    def pvary_operand(self, t: torch.Tensor, mask: int, missing: int) -> torch.Tensor:
        """:meth:`pvary` for an operand that only feeds an op (whose output is tagged anyway):
        over dimensions of size 1 it is ``t`` itself (no alias, no autograd node)."""
        return self.pvary(t, mask, missing) if missing & ~self.info.trivial else t

    def _widen_args(self, func, args, kwargs, union):
        inplace = self.is_inplace(func)

        def fix(a):
            if isinstance(a, _Tensor):
                m = self.mask_of(a)
                if m != union and a.requires_grad:
                    return self.pvary_operand(a, m, union & ~m)
                return a
            if type(a) in _SEQ:
                return type(a)(fix(b) for b in a)
            return a

        new_args = list(args)
        for i, a in enumerate(args):
            if i == 0 and inplace:
                # the tensor written in place keeps its identity; when it is invariant and carries a
                # gradient, its old value is pvary-ed in place (all of it when it is a view: the whole
                # base varies afterwards, as with JAX's x.at[i].set(v))
                if isinstance(a, _Tensor) and a.requires_grad:
                    base = a._base
                    t = a if base is None else base
                    missing = union & ~self.mask_of(t)
                    if missing:
                        self.pvary_inplace(t, missing)
                continue
            new_args[i] = fix(a)
        if kwargs:
            kwargs = {k: (v if k == "out" else fix(v)) for k, v in kwargs.items()}
        return tuple(new_args), kwargs


class Tracker(_Rules, TorchFunctionMode):
    """Variance state of one ``shard_map`` call, and the ``TorchFunctionMode`` that tracks it.

    One object per call: it is pushed as the mode itself, so a plain torch op
    costs one Python call that reads the arguments' tags and returns at once
    when none is tracked.
    """

    traced = False

    @staticmethod
    def is_inplace(func) -> bool:
        return _is_inplace(func)

    def __init__(self, mesh, info: _MeshInfo | None = None, serial: int | None = None):
        self.info = mesh_info(mesh) if info is None else info  # shard_map passes the one its plan holds
        self.serial = next(_SERIALS) << 32 if serial is None else serial  # (given: a replica, see replica())
        self.suspended = 0
        self.memo: dict = {}  # (id(tensor), missing mask, grad mode) -> (tensor, version, pvaried)
        self.inplace = False  # an in-place op retagged a tensor (shard_map cleans its arguments' tags)
        self.params: dict = {}  # id -> the Parameters whose gradient the body sums (pvary-ed, formula operands)
        self.deferred = False  # a leaf's pvary sums its gradient at the end of backward (grad_sums.leaf_sum)
        # a region of this body is checkpointed (einshard.runtime.recompute): the tags shard_map removes on exit,
        # as (weak reference, tag), for the recompute to put back
        self.kept: list | None = None
        # the pvary-ed parameters kept from one call of the body to the next (set by shard_map; a replica has none)
        self.aliases: LeafAliases | None = None

    # recomputation ------------------------------------------------------
    def replica(self) -> Tracker:
        """A tracker for a recompute of part of this call: the same serial (so it reads this call's tags),
        its own memo and suspension count (and this call's kept tags)."""
        replica = Tracker(self.info.mesh, self.info, self.serial)
        replica.kept, replica.params, replica.deferred = self.kept, self.params, self.deferred
        return replica

    def keep(self, tensors) -> None:
        """Remember the tags of ``tensors`` that shard_map is about to remove (when a region is checkpointed)."""
        if self.kept is None:
            return
        serial = self.serial
        for t in tensors:
            if isinstance(t, _Tensor):
                tag = t.__dict__.get(ATTR)
                if tag is not None and (tag ^ serial) <= MASK:
                    self.kept.append((weakref.ref(t), tag))

    def masks(self, leaves) -> tuple:
        """The mask of every tensor among ``leaves`` (``None`` for other leaves)."""
        return tuple(self.mask_of(x) if isinstance(x, _Tensor) else None for x in leaves)

    # tags ---------------------------------------------------------------
    def mask_of(self, t) -> int:
        m = t.__dict__.get(ATTR, 0) ^ self.serial
        return 0 if m > MASK else m

    def tag(self, t, mask: int) -> None:
        t.__dict__[ATTR] = self.serial | mask

    def tag_tree(self, out, mask: int):
        tag = self.serial | mask
        if isinstance(out, _Tensor):
            out.__dict__[ATTR] = tag
        elif isinstance(out, _SEQ):
            for o in out:
                if isinstance(o, _Tensor):
                    o.__dict__[ATTR] = tag
        return out

    # pvary -----------------------------------------------------------------
    def pvary(self, t: torch.Tensor, mask: int, missing: int) -> torch.Tensor:
        """``t`` (with vma ``mask``) marked varying over ``missing`` too (memoised per call)."""
        key = (id(t), missing, _grad_enabled())
        with _DisableTorchFunction():
            version = -1 if t.is_inference() else t._version  # inference tensors have no version counter
            hit = self.memo.get(key)
            if hit is not None and hit[0] is t and hit[1] == version:  # not modified in place since
                return hit[2]
            if missing & ~self.info.trivial:
                group = self.info.group(missing)
                if t.is_leaf and t.requires_grad and _grad_enabled():  # its sum can wait for the end of backward
                    aliases = self.aliases  # the body's kept aliases (einshard.runtime.vma_aliases), if any
                    y = leaf_sum(t, group) if aliases is None else aliases.pvary(t, group)
                    self.deferred = True
                elif _grad_enabled() and (own_pvary := getattr(t, "einshard_pvary", None)) is not None:
                    y = own_pvary(self.info.dims(missing))  # its producer sums it (a ZeRO gather)
                else:
                    y = pvary_tensor(t, group)
                if isinstance(t, torch.nn.Parameter):
                    self.params[id(t)] = t
            else:  # over dimensions of size 1: an alias (the gradient sum is over one rank)
                y = t.view_as(t)
        y.__dict__[ATTR] = self.serial | mask | missing
        self.memo[key] = (t, version, y)
        return y

    def pvary_inplace(self, t: torch.Tensor, missing: int) -> None:
        """Mark ``t`` itself varying over ``missing`` in autograd: its old value's gradient is summed.

        For an in-place op that writes varying data into an invariant ``t``
        (``h[i] = x``, ``h += x``): ``t`` keeps its identity, and the gradient
        of the value it held before is summed over ``missing``, as for
        :meth:`pvary`.
        """
        with _DisableTorchFunction():
            _PVaryInPlace.apply(t, self.info.group(missing))

    # torch functions ---------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        special = _SPECIAL.get(func)
        if special is not None:
            return special(self, func, args, kwargs or {})
        serial = self.serial
        # the union of the current masks of the tensor operands (also inside lists: torch.cat(tensors=[...])),
        # and whether they differ; inlined, as this runs for every torch op of the body
        union = 0
        common = -1  # the intersection: equal to the union when every operand varies alike
        for a in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(a, _Tensor):
                m = a.__dict__.get(ATTR, 0) ^ serial
                if m > MASK:
                    m = 0
                union |= m
                common &= m
            elif type(a) in _SEQ:  # a list of tensors (torch.cat, torch.stack)
                for m in [self.mask_of(b) for b in a if isinstance(b, _Tensor)]:
                    union |= m
                    common &= m
        if not union:
            return func(*args, **kwargs) if kwargs else func(*args)
        if union == common:  # every operand varies alike: nothing to widen, nothing written varies anew
            out = func(*args, **kwargs) if kwargs else func(*args)
            if isinstance(out, _Tensor):  # (the common result, tagged here without a call)
                out.__dict__[ATTR] = serial | union
                return out
            return self.tag_tree(out, union)
        if union & ~self.info.trivial and _grad_enabled():  # (over size-1 dimensions: nothing to do)
            args, kwargs = self._widen_args(func, args, kwargs or {}, union)
        out = self.tag_tree(func(*args, **kwargs) if kwargs else func(*args), union)
        if _is_inplace(func):
            # the tensor written in place now holds data that varies like the union (x[i] = v returns None,
            # so tagging ``out`` is not enough), and so does the tensor it is a view of
            target = args[0] if args else None
            if isinstance(target, _Tensor):
                self.inplace = True
                target.__dict__[ATTR] = serial | union
                base = target._base
                if base is not None:
                    base.__dict__[ATTR] = serial | union | self.mask_of(base)
        return out


_INPLACE_DUNDER = frozenset(
    "__setitem__ __iadd__ __isub__ __imul__ __itruediv__ __ifloordiv__ __imod__ __ipow__ __iand__ __ior__ "
    "__ixor__ __ilshift__ __irshift__ __imatmul__".split()
)
_INPLACE_CACHE = BoundedCache(name="einshard.runtime.vma.inplace")  # torch function -> whether it writes in place


def _is_inplace(func) -> bool:
    found = _INPLACE_CACHE.get(func)
    if found is None:
        name = getattr(func, "__name__", "")
        found = name in _INPLACE_DUNDER or (name.endswith("_") and not name.endswith("__"))
        _INPLACE_CACHE.put(func, found)
    return found


def _autograd_grad(tracker, func, args, kwargs):
    """Gradients carry the vma of the tensors they are taken with respect to."""
    inputs = kwargs.get("inputs", args[1] if len(args) > 1 else None)
    with _DisableTorchFunction():
        out = func(*args, **kwargs)
    if isinstance(inputs, _Tensor):
        inputs = (inputs,)
    for g, x in zip(out, inputs):
        if isinstance(g, _Tensor):
            tracker.tag(g, tracker.mask_of(x))
    return out


def _untracked(tracker, func, args, kwargs):
    """Run without tracking (backward passes: the gradients land in ``.grad``)."""
    with _DisableTorchFunction():
        return func(*args, **kwargs)


def _iter(tracker, func, args, kwargs):
    """``for row in x``: the rows vary like ``x``."""
    mask = tracker.mask_of(args[0])
    rows = list(func(*args, **kwargs))
    if mask:
        tracker.tag_tree(rows, mask)
    return iter(rows)


_SPECIAL = {
    torch.Tensor.__iter__: _iter,
    torch.autograd.grad: _autograd_grad,
    torch.Tensor.backward: _untracked,
    torch.autograd.backward: _untracked,
}


class _Mode(TorchFunctionMode):
    def __init__(self, tracker):
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.tracker.dispatch(func, args, kwargs or {})


# -- activation --------------------------------------------------------------------------


def current() -> Tracker | None:
    """The tracker of the running ``shard_map`` body (``None``: not tracking, or inside a library op)."""
    ambient = tracking_ambient()
    return None if ambient is None else ambient.shard_map.tracker


class tracking:
    """Context manager: track variance with ``tracker`` (pushes it as the ``TorchFunctionMode``)."""

    __slots__ = ("tracker", "mode")

    def __init__(self, tracker):
        self.tracker = tracker
        # an eager Tracker is its own mode; a TracedTracker is wrapped (dynamo traces through the wrapper)
        self.mode = tracker if isinstance(tracker, TorchFunctionMode) else _Mode(tracker)

    def __enter__(self):
        global ACTIVE
        self.mode.__enter__()
        ACTIVE += 1
        return self.tracker

    def __exit__(self, *exc):
        global ACTIVE
        ACTIVE -= 1
        self.mode.__exit__(*exc)
        return False


_push_mode = _torch_compat.push_torch_function_mode
_pop_mode = _torch_compat.pop_torch_function_mode


def run_tracked(tracker: Tracker, f, args, kwargs):
    """``f(*args, **kwargs)`` tracked by the eager ``tracker``: ``with tracking(tracker)``, without the object."""
    global ACTIVE
    _push_mode(tracker)  # what TorchFunctionMode.__enter__ does
    ACTIVE += 1
    try:
        return f(*args, **kwargs)
    finally:
        ACTIVE -= 1
        _pop_mode()


_stack_len = _torch_compat.torch_function_stack_len
_EnableTorchFunction = _torch_compat.EnableTorchFunction
_UNTAGGED = object()


def run_replayed(tracker: Tracker, f, args, kwargs, leaves, masks):
    """``f(*args, **kwargs)`` recomputed as a region of ``tracker``'s body ran: tracked by ``tracker`` (a
    :meth:`Tracker.replica`), with the tags of that call put back for the duration.

    ``leaves``/``masks``: tensors (the recompute's arguments: for a reentrant checkpoint fresh detached
    copies) and the masks they had in the forward; the tags shard_map removed on exit (``kept``) come back
    too. The tracker runs alone on the mode stack, with torch functions enabled (a backward inside a body
    runs with them disabled). Every tag is restored afterwards.
    """
    global ACTIVE
    undo: list = []
    modes: list = []
    pushed = False
    try:
        for ref, tag in tracker.kept or ():
            _retag(undo, ref(), tag)
        for t, m in zip(leaves, masks):  # (after the kept tags: the arguments' masks are the forward's)
            if m is not None:
                _retag(undo, t, tracker.serial | m)
        modes = [_pop_mode() for _ in range(_stack_len())]
        _push_mode(tracker)
        pushed = True
        ACTIVE += 1
        with _EnableTorchFunction():
            return f(*args, **kwargs)
    finally:
        if pushed:
            ACTIVE -= 1
            _pop_mode()
        for mode in reversed(modes):
            _push_mode(mode)
        for t, tag in reversed(undo):
            if tag is _UNTAGGED:
                t.__dict__.pop(ATTR, None)
            else:
                t.__dict__[ATTR] = tag


def _retag(undo: list, t, tag: int) -> None:
    if isinstance(t, _Tensor) and t.__dict__.get(ATTR) != tag:
        undo.append((t, t.__dict__.get(ATTR, _UNTAGGED)))
        t.__dict__[ATTR] = tag


class suspended:
    """Run library internals untracked: no mode, and :func:`current` returns ``None``."""

    __slots__ = ("tracker", "_disable")

    def __init__(self, tracker: Tracker | TracedTracker):
        self.tracker = tracker

    def __enter__(self):
        self.tracker.suspended += 1
        if not self.tracker.traced:
            self._disable = _DisableTorchFunction()
            self._disable.__enter__()
        # else a TracedTracker: its mode passes calls through while suspended (dynamo traces no
        # DisableTorchFunction)

    def __exit__(self, *exc):
        try:
            if not self.tracker.traced:
                self._disable.__exit__(*exc)
        finally:
            self.tracker.suspended -= 1
        return False


def get_vma(x) -> frozenset | None:
    """The mesh dimensions ``x`` varies over in the running ``shard_map`` body.

    ``None`` when variance is not tracked here (outside ``shard_map``, or
    ``check_vma=False``). Like JAX's ``jax.typeof(x).vma``.

    >>> es.spmd.get_vma(x)   # doctest: +SKIP
    frozenset({'dp'})
    """
    t = current()
    if t is None or not isinstance(x, _Tensor):
        return None
    return frozenset(t.info.dims(t.mask_of(x)))


# -- library operations ------------------------------------------------------------------


def library_call(tracker: Tracker | TracedTracker, fn, args, kwargs, out_mask: int):
    """Run ``fn(*args, **kwargs)`` untracked and tag its tensor outputs with ``out_mask``.

    Traced, the graph nodes it makes are the op's internals (not checked as plain torch ops).
    """
    if isinstance(tracker, TracedTracker):
        tracker.check_graph()
    with suspended(tracker):
        out = fn(*args, **kwargs)
    if isinstance(tracker, TracedTracker):
        tracker.region()
    return tracker.tag_tree(out, out_mask)


class _FormulaRule:
    __slots__ = ("declared", "mentioned", "out", "texts", "forbidden", "declared_nontrivial")

    def __init__(self, declared, mentioned, out, texts, trivial=0):
        self.declared, self.mentioned, self.out, self.texts = declared, mentioned, out, texts
        # per operand: the dimensions it must not vary over (the formula names them, its spec replicates them),
        # and the declared ones where a pvary is more than the identity (their size is above 1)
        self.forbidden = tuple(mentioned & ~d for d in declared)
        self.declared_nontrivial = tuple(d & ~trivial for d in declared)


def spec_mask(info: _MeshInfo, spec) -> int:
    m = 0
    for a in spec.axes:
        if a.mesh:
            m |= info.mask(a.mesh)
    for p in spec.partial:
        m |= info.mask(p)
    return m


def _formula_rule(info: _MeshInfo, formula: str, families) -> _FormulaRule:
    frozen = None if families is None else families if isinstance(families, tuple) else freeze_families(families)
    key = formula if frozen is None else (formula, frozen)
    rule = info.formulas.get(key)
    if rule is None:
        parsed = expand_specs(formula, frozen)
        declared = tuple(spec_mask(info, s) for s in parsed.inputs)
        out_spec = parsed.output if parsed.output is not None else parsed.inputs[0]
        out = spec_mask(info, out_spec)
        mentioned = out
        for m in declared:
            mentioned |= m
        rule = _FormulaRule(declared, mentioned, out, tuple(str(s) for s in parsed.inputs), info.trivial)
        info.formulas.put(key, rule)
    return rule


def formula_op(fn, formula: str, tensors, **kwargs):
    """Run a formula-based library op (``einshard``, ``einfft``, ``einhalo``, ...) with variance rules.

    ``fn(formula, *tensors, **kwargs)`` runs untracked. The rules (JAX's
    typing of collectives, on einshard layouts), with ``F`` every mesh
    dimension the formula names and ``D_k`` those operand ``k``'s spec shards
    or is partial over:

    - an operand that varies over a dimension in ``F`` that its spec says it
      is replicated over is a ``ValueError`` (the plan may read it as the same
      value on every rank);
    - an operand that is invariant over a dimension of ``D_k`` is pvary-ed
      over it (it is used as per-rank data there);
    - dimensions outside ``F`` pass through: the op is per-rank over them, so
      every operand is pvary-ed to their union and the output varies over it;
    - the output varies over the dimensions its spec shards or is partial over
      (for a bare spec without ``->``: the input's), plus the pass-through ones.
    """
    ambient = tracking_ambient()
    if ambient is None:
        return fn(formula, *tensors, **kwargs)
    return formula_op_in(ambient, fn, formula, tensors, kwargs)


def tracking_ambient():
    """The ambient context where a ``shard_map`` body tracks variance (``None``: untracked, or in a library op).

    For the ops' hooks: ``if _vma.ACTIVE: ambient = _vma.tracking_ambient()``, then
    :func:`formula_op_in` with it (one read of the context per op).
    """
    ambient = _context.current()
    body = ambient.shard_map
    if body is None:
        return None
    t = body.tracker
    if t is None or t.suspended:
        return None
    return ambient


def formula_op_in(ambient, fn, formula: str, tensors, kwargs: dict):
    """:func:`formula_op` where ``ambient`` (from :func:`tracking_ambient`) is known to track variance."""
    tracker = ambient.shard_map.tracker
    if tracker.traced:
        return _traced_formula_op(tracker, ambient, fn, formula, tensors, kwargs)
    info = tracker.info
    mesh = kwargs.get("mesh")
    if mesh is None:
        mesh = ambient.mesh  # a nested es.use_mesh(other) in the body
    if mesh is not info.mesh and not same_mesh(info, mesh):  # another mesh: its dimensions are not the body's
        return library_call(tracker, fn, (formula, *tensors), kwargs, _union_mask(tracker, tensors))
    serial = tracker.serial
    masks = tuple([_operand_mask(t, serial) for t in tensors])
    # the decision of an earlier call with the same formula and operand variance (the rules read nothing else)
    key = (formula, masks) if kwargs.get("families") is None else None
    decision = None if key is None else info.decisions.get(key)
    if decision is None:
        try:
            rule = _formula_rule(info, formula, kwargs.get("families"))
        except (ValueError, KeyError):  # the op reports a bad formula itself; else: union of the inputs
            return library_call(tracker, fn, (formula, *tensors), kwargs, _union_mask(tracker, tensors))
        if len(rule.declared) != len(tensors):
            return library_call(tracker, fn, (formula, *tensors), kwargs, _union_mask(tracker, tensors))
        decision = _formula_decision(info, formula, rule, masks)  # (a ValueError for an operand that varies undeclared)
        if key is not None:
            info.decisions.put(key, decision)
    out_mask, widened = decision
    tracker.suspended += 1
    try:
        with _DisableTorchFunction():  # tensor attributes (requires_grad) would go through the mode otherwise
            xs = tensors
            if widened and _grad_enabled():
                xs = _pvary_operands(tracker, tensors, widened)
            out = fn(formula, *xs, **kwargs)
    finally:
        tracker.suspended -= 1
    if isinstance(out, _Tensor):
        out.__dict__[ATTR] = serial | out_mask
        return out
    return tracker.tag_tree(out, out_mask)


def _operand_mask(t, serial: int) -> int:
    """The mask of a formula op's operand in the call of ``serial`` (0: invariant, a tag of an earlier call, or
    not a tensor)."""
    if not isinstance(t, _Tensor):
        return 0
    m = t.__dict__.get(ATTR, 0) ^ serial
    return 0 if m > MASK else m


def _formula_decision(info, formula, rule, masks) -> tuple:
    """What a formula op does with operands of vma ``masks``: ``(output mask, ((operand, its mask, dimensions to
    pvary it over), ...))``, the pvary-s over dimensions of size 1 left out (identities)."""
    if masks == rule.declared:  # the common case: every operand varies exactly as its spec says
        return rule.out, ()
    masks, passthrough, widen = _operand_masks(info, formula, rule, masks)
    widened = []
    if widen:
        for k, (m, d) in enumerate(zip(masks, rule.declared)):
            missing = (d | passthrough) & ~m
            if missing & ~info.trivial:
                widened.append((k, m, missing))
    return rule.out | passthrough, tuple(widened)


def _operand_masks(info, formula, rule, tags):
    """``(masks, pass-through dimensions, whether an operand may need a pvary)`` of a formula op's operands
    (``tags``: their tags xor the call's serial); ``ValueError`` for an operand that varies where its spec
    replicates."""
    masks: list[int] = []
    varies = lack = 0
    for m, forbidden, needed in zip(tags, rule.forbidden, rule.declared_nontrivial):
        if m > MASK:  # a tag left by an earlier call: invariant
            m = 0
        if m & forbidden:
            raise _replicated_operand_error(info, formula, rule.texts, len(masks), m & forbidden)
        varies |= m
        lack |= needed & ~m
        masks.append(m)
    passthrough = varies & ~rule.mentioned  # dimensions the formula does not name: the op is per-rank over them
    # over dimensions of size 1 a pvary is the identity: then every operand is used as it is
    return masks, passthrough, bool(lack or passthrough & ~info.trivial)


def _pvary_operands(tracker, tensors, widened):
    """The operands of a formula op, those of ``widened`` pvary-ed (when they require grad)."""
    xs = tensors
    for k, m, missing in widened:
        t = tensors[k]
        if isinstance(t, _Tensor) and t.requires_grad:
            if xs is tensors:
                xs = list(tensors)
            xs[k] = tracker.pvary(t, m, missing)
    return xs


def _replicated_operand_error(info, formula, texts, k, bad) -> EinshardError:
    dim = info.dims(bad)[0]
    return EinshardError(
        f"{formula!r}: operand {k} ('{texts[k]}') varies over mesh dimension {dim!r}, but its "
        f"spec says it is replicated over {dim!r}. Declare it sharded or partial over {dim!r} "
        f"(e.g. '{texts[k]} // {dim}'), or make it invariant first (es.spmd.psum / es.spmd.all_gather)"
    )


def _traced_formula_op(tracker, ambient, fn, formula, tensors, kwargs):
    """:func:`formula_op` while dynamo traces: no ValueError fallbacks, the rule is a trace-time constant."""
    info = tracker.info
    mesh = kwargs.get("mesh")
    if mesh is None:
        mesh = ambient.mesh
    if mesh is not info.mesh:
        return library_call(tracker, fn, (formula, *tensors), kwargs, _union_mask(tracker, tensors))
    declared, mentioned, out_mask, texts = _traced_rule(info, formula, kwargs.get("families"))
    if len(declared) != len(tensors):
        return library_call(tracker, fn, (formula, *tensors), kwargs, _union_mask(tracker, tensors))
    masks = [tracker.mask_of(t) if isinstance(t, _Tensor) else 0 for t in tensors]
    with suspended(tracker):
        passthrough = 0
        for k, m in enumerate(masks):
            if m & UNKNOWN:
                _refuse_unknown(fn, [tensors[k]], [m])
            bad = m & mentioned & ~declared[k]
            if bad:
                _trace.refuse(str(_replicated_operand_error(info, formula, texts, k, bad)))
            passthrough |= m & ~mentioned
        xs = tensors
        if _grad_enabled():
            for k, t in enumerate(tensors):
                missing = (declared[k] | passthrough) & ~masks[k]
                if missing and isinstance(t, _Tensor) and t.requires_grad:
                    if xs is tensors:
                        xs = list(tensors)
                    xs[k] = tracker.pvary_operand(t, masks[k], missing)
    return library_call(tracker, fn, (formula, *xs), kwargs, out_mask | passthrough)


def _union_mask(tracker, tensors) -> int:
    m = 0
    for t in tensors:
        if isinstance(t, _Tensor):
            m |= tracker.mask_of(t)
    return m


# -- under torch.compile -------------------------------------------------------------------------
#
# Dynamo records some operations without calling torch function modes: tensor properties (``.T``,
# ``.mT``, ``.H``, ``.real``), iteration and unpacking (``for row in w``, ``a, b = x``) and builtins
# (``abs(x)``). A mode alone would see their results untagged and count them invariant, and the
# gradient sums they need would be lost. So under torch.compile the graph dynamo builds is the
# record: every operation is a node there. The traced tracker annotates the nodes it tags, and the
# variance of any other tensor is decided on the graph (at trace time, ``einshard.core._trace.at_trace_time``):
# a node the tracker did not see varies like the union of its tensor arguments (the rule of every
# plain torch op), a node made before the body (a captured tensor) is invariant. Each such node is
# checked on the way: one that mixes variance without the pvary its gradient needs, or writes
# varying data in place into a tensor that varies less, raises an ``EinshardError`` naming it.
#
# A graph break inside the body (``torch.autograd.grad`` always breaks) ends one graph; tensors
# crossing it keep their tags (tags are tensor attributes, which dynamo restores at the break). An
# untagged tensor that crosses one is decided from the real tensor (a view varies like its base, a
# leaf that requires grad is a parameter made outside the body); otherwise its variance is unknown,
# and an operation whose result would depend on it raises.

UNKNOWN = 1 << 31  # a mask bit: variance that cannot be decided (see above); never a mesh dimension's bit
# The serial of every traced call's tags: a constant, as a per-call number would be a new guard (a recompile)
# on every call, and dynamo makes an int that changes between calls dynamic. Every body re-tags its arguments,
# and an earlier body's intermediate tensors keep the variance they had there.
TRACED_SERIAL = 1 << 32
_NODE_VMA = "einshard_vma"  # node.meta key: {body serial: mask}
_NODE_PRE = "einshard_pre"  # node.meta key: serials of the bodies that began after this node was made


class TracedTracker(_Rules):
    """The tracker of a ``shard_map`` body that dynamo traces: variance decided at trace time.

    Same rules and tags as :class:`Tracker` (the tag carries this call's
    serial, a trace-time constant); tensors without a tag are decided on the
    graph (see the comments above this class). The pvary insertions become
    graph nodes; the compiled step runs no tracking code at all.
    """

    __slots__ = ("info", "serial", "suspended", "inplace", "memo")
    traced = True

    @staticmethod
    def is_inplace(func) -> bool:
        return _traced_is_inplace(func) if in_traced_code() else _is_inplace(func)

    def __init__(self, mesh):
        self.info = _trace.lookup(_traced_info(mesh))
        self.serial = TRACED_SERIAL
        self.suspended = 0
        self.inplace = False
        self.memo: list = []  # (tensor, missing mask, grad mode, pvaried): no id(), which dynamo guards on
        if in_traced_code():
            serial, trivial = self.serial, self.info.trivial  # noqa: F841 - _open_body reads them from this frame
            _trace.at_trace_time(_open_body)

    def mask_of(self, t) -> int:
        m = getattr(t, ATTR, 0) ^ self.serial
        if m <= MASK:
            return m
        if not in_traced_code():  # the eager call at a graph break
            return _real_mask(self.serial, t)
        serial, trivial, name = self.serial, self.info.trivial, _trace.fresh_name()  # noqa: F841 - _node_lookup reads them from this frame
        _trace.at_trace_time(_node_lookup)
        return _trace.lookup(name)

    def tag(self, t, mask: int) -> None:
        setattr(t, ATTR, self.serial | mask)
        if in_traced_code():
            serial, trivial = self.serial, self.info.trivial  # noqa: F841 - _node_tag reads them from this frame
            _trace.at_trace_time(_node_tag)

    def untag(self, t) -> None:
        setattr(t, ATTR, 0)

    def tag_tree(self, out, mask: int):
        """``out`` tagged; the pieces of a multi-output op (``unbind``, ``split``, ``chunk``) come back as
        fresh aliases, as dynamo refuses attributes on tensors it made outside this frame."""
        if isinstance(out, _Tensor):
            self.tag(out, mask)
        elif type(out) in _SEQ:
            out = type(out)([self._tagged_alias(o, mask) if isinstance(o, _Tensor) else o for o in out])
        return out

    def _tagged_alias(self, t, mask: int):
        y = t.view_as(t)
        self.tag(y, mask)
        return y

    def pvary(self, t: torch.Tensor, mask: int, missing: int) -> torch.Tensor:
        """As :meth:`Tracker.pvary`: memoised per call, so that every rank sums a tensor's gradient once,
        however often its body uses it (a loop over a per-rank number of rows, say)."""
        grad = _grad_enabled()
        for hit in self.memo:
            if hit[0] is t and hit[1] == missing and hit[2] == grad:
                return hit[3]
        if missing & ~self.info.trivial:
            y = _TracedPVary.apply(t, self.group(missing))
        else:
            y = t.view_as(t)
        self.tag(y, mask | missing)
        self.memo.append((t, missing, grad, y))
        return y

    def pvary_inplace(self, t: torch.Tensor, missing: int) -> None:
        if _torch_compat.DYNAMO_MARKS_DIRTY:
            _PVaryInPlace.apply(t, self.group(missing), True)
            return
        # (a dynamo that drops mark_dirty: the out-of-place pvary, written back; both tagged at once, so that no
        # check of the graph takes the copy for varying data written into an invariant tensor)
        mask = self.mask_of(t) | missing
        y = _TracedPVary.apply(t, self.group(missing))
        self.tag(y, mask)
        t.copy_(y)
        self.tag(t, mask)

    def group(self, mask: int):
        """The process group of the dimensions of ``mask``, looked up at trace time (dynamo would trace the
        mesh's group cache, and its first use creates the group)."""
        return _trace.lookup(_traced_group(self.info, mask))

    def forget(self, t) -> None:
        """Drop the memoised pvary-s of ``t`` (it is written in place: its old value's alias is stale)."""
        self.memo = [hit for hit in self.memo if hit[0] is not t]

    def region(self) -> None:
        """The graph nodes made since the last check belong to a library op (its internals): not checked."""
        if in_traced_code():
            serial, trivial = self.serial, self.info.trivial  # noqa: F841 - _skip_region reads them from this frame
            _trace.at_trace_time(_skip_region)

    def check_graph(self) -> None:
        """Decide and check the variance of every graph node made since the last check (at the body's end)."""
        if in_traced_code():
            serial, trivial = self.serial, self.info.trivial  # noqa: F841 - _sweep_here reads them from this frame
            _trace.at_trace_time(_sweep_here)

    def dispatch(self, func, args, kwargs):
        if self.suspended or (not in_traced_code() and (_fake(args) or _torch_compat.dynamo_compiling_frame())):
            # (outside traced code, fake tensors or dynamo compiling a frame of the body: its own work, untracked;
            # a tag it put on a real tensor, w.T built for a guard, would be guarded on and missing on the next w.T)
            return func(*args, **kwargs)
        special = _SPECIAL.get(func)
        if special is not None:
            return special(self, func, args, kwargs)
        tensors = _tensor_args(args, kwargs)
        masks = [self.mask_of(a) for a in tensors]
        union = 0
        for m in masks:
            union |= m
        if union & UNKNOWN:
            _refuse_unknown(func, tensors, masks)
        mixed = any(m != union for m in masks)
        if mixed and _grad_enabled():
            args, kwargs = self._widen_args(func, args, kwargs, union)
        out = self.tag_tree(_call_traced(func, args, kwargs), union)
        if self.memo and self.is_inplace(func) and args and isinstance(args[0], _Tensor):
            self.forget(args[0])
        if mixed and self.is_inplace(func) and args and isinstance(args[0], _Tensor):
            target = args[0]
            self.tag(target, union)
            base = target._base
            if base is not None:
                self.tag(base, union | self.mask_of(base))
        return out


def _call_traced(func, args, kwargs):
    """``func(*args, **kwargs)`` in traced code. A Tensor method written in Python (``Tensor.unflatten``,
    ``Tensor.split``) is called as a method, which dynamo handles itself: tracing its Python body, it fails
    at the ``super()`` call inside."""
    if in_traced_code() and args and isinstance(args[0], _Tensor):
        name = _python_tensor_method(func)
        if name is not None:
            return getattr(args[0], name)(*args[1:], **kwargs)
    return func(*args, **kwargs)


@_trace.constant_result
def _python_tensor_method(func) -> str | None:
    name = getattr(func, "__name__", None)
    if isinstance(name, str) and getattr(torch.Tensor, name, None) is func and hasattr(func, "__code__"):
        return name
    return None


def _fake(args) -> bool:
    return any(isinstance(a, _torch_compat.FakeTensor) for a in args)


def _refuse_unknown(func, tensors, masks) -> None:
    """An op meets a tensor of unknown variance: fine only when no gradient can depend on it."""
    if not _grad_enabled() or not any(t.requires_grad for t in tensors):
        return
    name = getattr(func, "__name__", str(func))
    _trace.refuse(
        f"shard_map under torch.compile: {name!r} uses a tensor whose variance einshard cannot decide: it "
        "crossed a graph break inside the body without einshard's tag (a tensor made before the body and "
        "captured, or the result of an operation dynamo recorded before the break). Pass it to the body "
        "as an argument with a spec, or avoid the graph break (fullgraph=True shows where it is)"
    )


class _TracedPVary(torch.autograd.Function):
    """pvary in traced code: identity forward, all-reduce (a functional collective) backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


@_trace.constant_result
def _traced_info(mesh) -> str:
    return _trace.register(mesh_info(mesh))


@_trace.constant_result
def _traced_group(info: _MeshInfo, mask: int) -> str:
    return _trace.register(info.group(mask))


@_trace.constant_result
def _traced_is_inplace(func) -> bool:
    return _is_inplace(func)


@_trace.constant_result
def _traced_rule(info: _MeshInfo, formula: str, families):
    """The variance rule of a formula as constants: (declared masks, mentioned, out mask, spec texts)."""
    rule = _formula_rule(info, formula, families)
    return rule.declared, rule.mentioned, rule.out, rule.texts


# -- the graph's side (plain Python, run while dynamo traces) ---------------------------------------


class _GraphBody:
    """What the graph checks know of one traced body: its size-1 dimensions, the graph it began in (``None``
    when it began outside one: in eager code between two graphs), where each graph was checked."""

    __slots__ = ("serial", "trivial", "entry", "swept")

    def __init__(self, serial: int, trivial: int, graph=None):
        self.serial, self.trivial, self.entry = serial, trivial, graph
        self.swept: dict = {}  # graph -> the last node checked (None: none yet)


_GRAPH_BODIES = BoundedCache(256, name="einshard.runtime.vma.graph_bodies")


def _local(ctx, name: str):
    return ctx.get_local(name, stacklevel=1)


def _int(ctx, name: str) -> int:
    """The caller's local int ``name``; one that dynamo made dynamic (a frame of its own, called with other
    values before) is specialised."""
    var = _local(ctx, name)
    try:
        return var.as_python_constant()
    except Exception:  # noqa: BLE001  (dynamo's AsPythonConstantNotImplementedError: a SymInt)
        return int(var.as_fake())


def _body_of(ctx) -> _GraphBody:
    """The body of the caller's ``serial`` (and ``trivial``: its size-1 dimensions); made here when it began outside a
    graph (dynamo split the frame that created the tracker, and ran that part eagerly)."""
    serial, trivial = _int(ctx, "serial"), _int(ctx, "trivial")
    body = _GRAPH_BODIES.get(serial)
    if body is None:
        body = _GRAPH_BODIES.put(serial, _GraphBody(serial, trivial))
    return body


def _open_body(ctx) -> None:
    """The body starts: every node made so far is outside it (invariant, like a captured tensor)."""
    serial, trivial = _int(ctx, "serial"), _int(ctx, "trivial")
    graph = ctx.graph()
    last = None
    for node in graph.nodes:
        node.meta.setdefault(_NODE_PRE, set()).add(serial)
        last = node
    body = _GraphBody(serial, trivial, graph)
    body.swept[graph] = last
    _GRAPH_BODIES.put(serial, body)


def _node_tag(ctx) -> None:
    body = _body_of(ctx)
    node = _local(ctx, "t").as_proxy().node
    node.meta.setdefault(_NODE_VMA, {})[body.serial] = _int(ctx, "mask")


def _node_lookup(ctx) -> None:
    body, graph = _body_of(ctx), ctx.graph()
    _sweep(body, graph)
    node = _local(ctx, "t").as_proxy().node
    _trace.publish(_local(ctx, "name").as_python_constant(), _node_mask(body, graph, node))


def _sweep_here(ctx) -> None:
    _sweep(_body_of(ctx), ctx.graph())


def _skip_region(ctx) -> None:
    body, graph = _body_of(ctx), ctx.graph()
    body.swept[graph] = _last_node(graph)


def _last_node(graph):
    for node in reversed(graph.nodes):
        return node
    return None


def _sweep(body: _GraphBody, graph) -> None:
    """Decide (and check) the variance of the nodes made since the last sweep of ``graph``."""
    start = body.swept.get(graph, None)
    if graph not in body.swept:  # a graph after a break in the body: all of it is the body's
        nodes = iter(graph.nodes)
    elif start is None:
        nodes = iter(graph.nodes)
    else:
        nodes = _after(start)
    last = start
    for node in nodes:
        last = node
        if node.op.startswith("call") and body.serial not in node.meta.get(_NODE_VMA, ()):
            node.meta.setdefault(_NODE_VMA, {})[body.serial] = _decide(body, graph, node)
    body.swept[graph] = last


def _after(node):
    node = node.next
    while node.op != "root":
        yield node
        node = node.next


def _tensor_nodes(node) -> list:
    """The arguments of ``node`` that hold tensors: a tensor, or the tuple of a multi-output op (``unbind``), whose
    pieces ``operator.getitem`` nodes take (torch 2.11's dynamo records ``for row in w`` that way)."""
    return [a for a in node.all_input_nodes if _holds_tensor(a.meta.get("example_value"))]


def _holds_tensor(value) -> bool:
    return isinstance(value, _Tensor) or (
        isinstance(value, (list, tuple)) and any(isinstance(v, _Tensor) for v in value))


def _requires_grad(node) -> bool:
    value = node.meta.get("example_value")
    if isinstance(value, _Tensor):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, _Tensor) and v.requires_grad for v in value)
    return False


def _target_name(node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _decide(body: _GraphBody, graph, node) -> int:
    """The variance of a node the tracker did not tag: the union of its tensor arguments', after checking
    that it needs no pvary (a tracked op got one) and writes no varying data into a less varying tensor."""
    args = _tensor_nodes(node)
    masks = [_node_mask(body, graph, a) for a in args]
    union = 0
    for m in masks:
        union |= m
    wider = ~body.trivial & ~UNKNOWN
    if _requires_grad(node):
        for a, m in zip(args, masks):
            if union & ~m & wider and _requires_grad(a):
                raise _trace.trace_error(
                    f"shard_map under torch.compile: the operation {_target_name(node)!r} combines a tensor that "
                    "requires grad and varies over fewer mesh dimensions than another of its operands, and "
                    "einshard's variance tracking did not see it (dynamo recorded it without calling torch "
                    "function modes), so its gradient sum cannot be inserted; write it as a torch function or "
                    "method call (e.g. torch.abs(x) for abs(x)), or es.spmd.pvary the operand first"
                )
    if args and _inplace_name(_target_name(node)) and union & ~masks[0] & wider:
        raise _trace.trace_error(
            f"shard_map under torch.compile: the in-place operation {_target_name(node)!r} writes varying data "
            "into a tensor that varies over fewer mesh dimensions, and einshard's variance tracking did not "
            "see it; use an out-of-place operation"
        )
    return union


def _node_mask(body: _GraphBody, graph, node) -> int:
    tags = node.meta.get(_NODE_VMA)
    if tags is not None and body.serial in tags:
        return tags[body.serial]
    if node.op in ("placeholder", "get_attr"):
        if graph is body.entry:
            return 0  # a tensor from outside the body (captured), or a module's parameter
        grapharg = node.meta.get("grapharg")
        example = None if grapharg is None else grapharg.example
        return _real_mask(body.serial, example) if isinstance(example, _Tensor) else UNKNOWN
    if body.serial in node.meta.get(_NODE_PRE, ()):
        return 0  # made before the body began
    raise _trace.trace_error(f"einshard: no variance for graph node {node.name!r} ({_target_name(node)!r}); "
                             "this is a bug in einshard's variance tracking under torch.compile")


def _real_mask(serial: int, t) -> int:
    """The mask of a real tensor that has no tag of this call (one that crossed a graph break in the body)."""
    m = t.__dict__.get(ATTR, 0) ^ serial
    if m <= MASK:
        return m
    base = t._base
    if base is not None:
        m = base.__dict__.get(ATTR, 0) ^ serial
        if m <= MASK:
            return m
    if t.requires_grad and t.is_leaf:
        return 0  # a parameter: made outside any graph
    return UNKNOWN


def _inplace_name(name: str) -> bool:
    return (name in _INPLACE_DUNDER or f"__{name}__" in _INPLACE_DUNDER
            or (name.endswith("_") and not name.endswith("__")))
