"""The pvary-ed aliases of a ``shard_map`` body's parameters, kept from one call to the next: :class:`LeafAliases`.

Variance tracking pvary-s a leaf tensor that requires grad (a parameter) where it meets per-rank data: an
identity whose gradient is summed over the mesh dimensions it lacks
(:func:`einshard.comm.grad_sums.leaf_sum`, an autograd node, made on every call of the body). What that node
does depends only on the parameter and the process group, so a body whose calls pvary the same parameters
makes the same node again and again. :class:`LeafAliases` keeps the alias (and its node) of each parameter and
group of one ``shard_map`` and hands it to the next call, which pays a lookup instead of an autograd
``Function`` call.

The autograd graph of every backward is the one fresh aliases give, node for node:

- an alias is handed out once per backward: after a call took it, the next call gets it only once the
  node's backward ran outside any body (a pre-hook of the node frees it; a backward inside a body, as
  ``torch.autograd.grad`` there, does not: the forward graph of that call may still hold the node); until
  then (several forwards before one backward, as in a pipeline schedule, or a forward whose result is never
  differentiated) every call makes a fresh alias, which replaces the kept one;
- it is handed out only while it still aliases the parameter: the same tensor object, the same storage
  (``p.data = ...`` makes a fresh one), the same shape, strides and dtype; and never inside a functorch
  transform (``vmap``, ``grad``), whose tensors are wrapped per call.

So each backward runs one node per (call, parameter, group), in the order fresh aliases would, and every
rank sums the same gradients in the same buckets whether its calls reused aliases or not. The node keeps no
tensor for backward (only the process group), so running it again is exact.

A kept alias shares its parameter's storage (no memory of its own) but keeps the parameter alive while its
``shard_map`` lives; at most :data:`LIMIT` are kept per ``shard_map`` (then all are dropped and made again).
"""

from __future__ import annotations

import functools
import weakref

import torch

from ..comm.grad_sums import leaf_sum
from ..core._cache import BoundedCache
from ..core._torch_compat import functorch_transforms_active

__all__ = ["LeafAliases", "LIMIT"]

#: the most aliases one ``shard_map`` keeps
LIMIT = 1024


class _Alias:
    """One kept alias: the parameter, its alias and whether the alias's node ran since it was handed out."""

    __slots__ = ("leaf", "alias", "free", "__weakref__")

    def __init__(self, leaf: torch.Tensor, alias: torch.Tensor):
        self.leaf, self.alias, self.free = leaf, alias, False

    def aliases(self, leaf: torch.Tensor) -> bool:
        """Whether the alias is still a view of all of ``leaf`` as it is now."""
        a = self.alias
        return (self.leaf is leaf and a.data_ptr() == leaf.data_ptr() and a.shape == leaf.shape
                and a.stride() == leaf.stride() and a.dtype == leaf.dtype)


class LeafAliases:
    """The pvary-ed aliases of the parameters one ``shard_map``'s body uses (see the module docstring).

    >>> aliases = LeafAliases()
    >>> len(aliases)
    0
    """

    __slots__ = ("entries", "busy")

    def __init__(self, limit: int = LIMIT, busy=None):
        self.entries = BoundedCache(limit)  # (id(leaf), group) -> _Alias
        # whether a body is running: a backward inside one (torch.autograd.grad in a body) frees no alias, as
        # the graph of that call's forward may still hold it
        self.busy = _never if busy is None else busy

    def __len__(self) -> int:
        return len(self.entries)

    def pvary(self, leaf: torch.Tensor, group) -> torch.Tensor:
        """``leaf_sum(leaf, group)``: the kept alias when it is free and still aliases ``leaf``, else a fresh one
        (kept for the next call). ``leaf`` is a leaf that requires grad, and grad mode is on; called with the
        torch-function protocol off."""
        key = (id(leaf), group)
        kept = self.entries.get(key)
        if kept is not None and kept.free and kept.aliases(leaf) and not functorch_transforms_active():
            kept.free = False
            return kept.alias
        alias = leaf_sum(leaf, group, detached=True)  # (not a view: usable after an in-place update of leaf)
        node = alias.grad_fn
        if node is None or functorch_transforms_active():  # no node to reuse, or a wrapped tensor: not kept
            return alias
        kept = _Alias(leaf, alias)
        # (a weak reference: the node must not keep its own alias alive, through the hook, once it is dropped)
        node.register_prehook(functools.partial(_release, weakref.ref(kept), self.busy))
        self.entries.put(key, kept)
        return alias


def _release(ref, busy, grad_outputs) -> None:
    """The pre-hook of a kept alias's node: its backward runs, so the next call may take the alias (not when the
    backward runs inside a body)."""
    kept = ref()
    if kept is not None and not busy():
        kept.free = True


def _never() -> bool:
    return False
