"""A parameter stored sharded (``store=``) holds its storage block: plain torch use with other tensors refuses.

Outside the forward of the module that gathers it, a stored parameter is a ``1/|dp|`` slice of its compute
block. Where a torch op would combine that slice with a tensor of another shape (a tied output head's
``h @ emb.weight.T``, a parent module's ``x * self.child.scale``) it would compute with the slice silently,
wherever the shapes happen to fit; :class:`StoredParameter` refuses such ops instead, naming the op, the
shapes and the parameter's layouts. What acts on the storage block itself stays a plain tensor operation:
in-place updates of the shard (optimizers, ``copy_``, ``load_state_dict``, initialisers), ``_foreach_``
ops, element-wise ops with tensors of its shape (its gradient, optimizer states), and ops on it alone
(``detach``, ``zeros_like``, a norm of the storage block).

A tensor put in a stored parameter's place for one call (``torch.func.functional_call`` passing storage
blocks) is guarded the same way during that call, through an alias (:func:`guarded_alias`): the passed
tensor itself is left as it was.

>>> p = torch.nn.Parameter(torch.ones(2, 3))
>>> p.__class__ = StoredParameter
>>> (p * torch.ones(2, 3)).shape, type(p.detach()).__name__
(torch.Size([2, 3]), 'Tensor')
"""

from __future__ import annotations

import torch

from ..core import _torch_compat
from ..errors import EinshardError
from .store import get_parameter_state

__all__ = ["StoredParameter", "StorageView", "guarded_alias", "substituted"]

_DISABLED = _torch_compat.DisableTorchFunctionSubclass
_AUTOGRAD = (torch.autograd.grad, torch.autograd.backward)  # they differentiate, not compute with, the blocks
_STANDS_FOR = "_einshard_stands_for"  # on a guarded alias and its views: (the stored parameter, the passed tensor)


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _guarded(t) -> bool:
    return isinstance(t, (StoredParameter, StorageView))


def _root(t):
    """The tensor whose memory ``t`` views (``t`` itself when it is not a view)."""
    return t._base if t._is_view() else t


def _stored_of(t):
    """The stored parameter whose layouts describe guarded tensor ``t`` (a block, a view of one, an alias)."""
    if isinstance(t, StoredParameter):
        return t
    found = getattr(t, _STANDS_FOR, None)
    return t._base if found is None else found[0]


def _mismatch(func, name, args, kwargs):
    """The shape of a tensor an op would combine a storage block (or a view of one) with, where that shape
    differs from the blocks' (``None``: the op acts on storage blocks, tensors of their shapes, or writes into
    one)."""
    if name.startswith("_foreach_") or name == "__set__" or func in _AUTOGRAD:
        return None
    if (name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))) and args and _guarded(args[0]):
        return None  # in place on the shard
    shapes = {t.shape for t in _tensors(args, kwargs) if _guarded(t)}
    if not shapes:  # reached deeper inside an argument: not checked
        return None
    for t in _tensors(args, kwargs):
        if t.dim() != 0 and t.shape not in shapes:
            return tuple(t.shape)
    return None


def _guard(cls, func, types, args=(), kwargs=None):
    """The ``__torch_function__`` of storage blocks and their views: refuse an op mixing them with tensors
    of another shape; run the others as plain tensor ops, keeping the guard on views of a block."""
    kwargs = kwargs if kwargs is not None else {}
    name = getattr(func, "__name__", "")
    if len(args) > 1 or kwargs:
        other = _mismatch(func, name, args, kwargs)
        if other is not None:
            _refuse(name, args, kwargs, other)
    with _DISABLED():
        out = func(*args, **kwargs)
        if type(out) is torch.Tensor and name != "detach" and out._is_view():
            of = next((t for t in _tensors(args, kwargs) if _guarded(t) and out._base is _root(t)), None)
            if of is not None:  # .T, view, reshape, indexing: still the slice
                out = out.as_subclass(StorageView)
                if hasattr(of, _STANDS_FOR):
                    setattr(out, _STANDS_FOR, getattr(of, _STANDS_FOR))
    return out


class StoredParameter(torch.nn.Parameter):
    """The class of a parameter stored sharded (``store=``) once it holds its storage block: an
    ``nn.Parameter`` whose torch ops refuse to combine the block (or a view of it, a :class:`StorageView`)
    with tensors of another shape (see the module docstring); other results are plain tensors."""

    __torch_function__ = classmethod(_guard)


class StorageView(torch.Tensor):
    """A view of a stored parameter's storage block (``p.T``, ``p.view(...)``, ``p[0]``), or an alias of a
    tensor passed in its place (:func:`guarded_alias`): guarded like it."""

    __torch_function__ = classmethod(_guard)


def guarded_alias(t: torch.Tensor, p: StoredParameter) -> StorageView:
    """An alias of ``t`` (a storage block passed in stored parameter ``p``'s place) guarded as ``p`` is; it
    stays attached to autograd (its gradient reaches ``t``), and ``t`` itself is not changed."""
    out = t.as_subclass(StorageView)
    setattr(out, _STANDS_FOR, (p, t))
    return out


def substituted(t) -> torch.Tensor | None:
    """The passed tensor that ``t`` is the guarded alias of (``None`` when ``t`` is not one)."""
    found = getattr(t, _STANDS_FOR, None) if isinstance(t, StorageView) else None
    return None if found is None else found[1]


def _refuse(name, args, kwargs, other) -> None:
    t = next(t for t in _tensors(args, kwargs) if _guarded(t))
    p = _stored_of(t)
    state = get_parameter_state(p)
    if state is None or state.store is None:  # no longer stored (its state was detached)
        return
    raise EinshardError(
        f"torch op {name!r} combines a parameter stored sharded over {state.store!r} (store=, layout "
        f"{state.layout!r}, storage block of shape {tuple(p.shape)}) with a tensor of shape {other}: outside the "
        f"forward of the module that gathers it, the parameter holds a slice of its compute block "
        f"{state.compute_layout!r}. Use it inside that forward, or name a module whose forward uses it in "
        "units= (es.params.register_native_grad_reduction_hooks_(model, mesh, units=[model]) for a tied output head), "
        "or pass it to es.shard_map with its es.params.param_specs"
    )
