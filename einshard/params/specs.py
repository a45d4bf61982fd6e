"""One source of truth: the registered layouts as a spec pytree (``es.params.param_specs``).

The layouts registered on a module's parameters are what ``shard_map``,
``tree_shard``/``tree_gather``, the DTensor conversion and checkpoints read,
so no spec is written twice. Each layout is a :class:`ParamSpec`: a ``str``
that also carries the parameter's recorded global shape (``shard_map`` checks
the tensors given for it) and a weak reference to the parameter
(``es.tree_shard`` of whole values records their shape on it).
"""

from __future__ import annotations

import weakref

import optree
import torch

from ..errors import EinshardError
from .store import get_parameter_state

__all__ = ["ParamSpec", "param_specs", "as_param_tree", "specs_or_registered"]


class ParamSpec(str):
    """A registered layout (``"f/tp c"``, equal to that string) with the parameter's recorded global shape.

    ``global_shape``: the whole tensor's shape, or ``None`` (unknown); ``param``: the parameter, while it
    lives. Pickled or copied, it keeps the layout and the global shape (not the parameter).

    >>> s = ParamSpec("f/tp c", (6, 3))
    >>> s == "f/tp c", s.global_shape
    (True, (6, 3))
    """

    global_shape: tuple | None
    _param: weakref.ref | None

    def __new__(cls, layout: str, global_shape=None, param=None):
        self = super().__new__(cls, layout)
        self.global_shape = None if global_shape is None else tuple(global_shape)
        self._param = None if param is None else weakref.ref(param)
        return self

    @property
    def param(self):
        """The parameter whose layout this is (``None`` once it is gone, or when unknown)."""
        return None if self._param is None else self._param()

    def __reduce__(self):
        return (ParamSpec, (str(self), self.global_shape))


def _layout_of(x):
    state = get_parameter_state(x) if isinstance(x, torch.nn.Parameter) else None
    if state is None or state.layout is None:
        return None
    return ParamSpec(state.layout, state.global_shape, x)


def param_specs(module_or_tree):
    """The layout strings of a module's (or a pytree's) parameters: a spec pytree.

    For a module: ``{name: layout}`` over ``named_parameters()``, the spec pytree of
    ``dict(module.named_parameters())``. For a pytree (a state dict from
    ``state_dict(keep_vars=True)``, a dict of parameters): the same structure with
    each leaf's layout. A leaf without a registered layout (a buffer, a
    layout-free or unregistered parameter, a plain tensor) gets ``None``: passed
    through unchanged by ``shard_map``, ``tree_shard`` and ``tree_gather``.

    >>> import torch, einshard as es
    >>> lin = es.params.register_linear_parameters_(torch.nn.Linear(4, 6), weight_layout="out/tp in",
    ...                                      mesh_dim_names=("dp", "tp"))
    >>> es.params.param_specs(lin)
    {'weight': 'out/tp in', 'bias': 'out/tp'}
    """
    if isinstance(module_or_tree, torch.nn.Module):
        return {name: _layout_of(p) for name, p in module_or_tree.named_parameters()}
    return optree.tree_map(_layout_of, module_or_tree, none_is_leaf=True)


def as_param_tree(module_or_tree):
    """A module as its ``state_dict(keep_vars=True)`` (parameters keep their states); other trees unchanged."""
    if isinstance(module_or_tree, torch.nn.Module):
        return module_or_tree.state_dict(keep_vars=True)
    return module_or_tree


def specs_or_registered(tree, specs, where: str):
    """``specs`` if given, else the registered layouts of ``tree`` (ValueError when it has none)."""
    if specs is not None:
        return specs
    found = param_specs(tree)
    if all(s is None for s in optree.tree_leaves(found, none_is_leaf=True)):
        raise EinshardError(
            f"{where}: no specs given and no parameter in the tree has a registered layout; pass specs, or "
            f"a module (or state_dict(keep_vars=True)) whose parameters were registered"
        )
    return found
