"""Explicit registration: layouts for single parameters, whole modules, and linear/conv/norm layers.

Every helper is atomic: all states are built, validated and merged first, then
all are attached; any error leaves every parameter as it was.

>>> import torch
>>> lin = register_linear_parameters_(torch.nn.Linear(3, 4), weight_layout="out/tp in",
...                                   mesh_dim_names=("dp", "tp"), weight_grad="dp")
>>> get_parameter_state(lin.bias).layout, get_parameter_state(lin.weight).reduce
('out/tp', ('dp',))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from ..errors import EinshardError
from ..notation import TensorSpec
from .metadata import global_shape_from_sizes, group_size, storage_slice
from .names import mesh_names
from .state import ParameterState
from .storage import StoredParameter
from .store import Registration, get_parameter_state, per_name, set_parameter_state  # noqa: F401 - the examples use it

__all__ = [
    "register_parameter_layout",
    "register_module_parameter_layouts_",
    "register_linear_parameters_",
    "register_conv_parameters_",
    "register_norm_parameters_",
]

_UNSET = object()


def _store_axis(layout: str, group: str, shape, mesh) -> str:
    """``store=group`` as ``"axis/group"``: the first axis the layout leaves unsplit whose size the group
    divides (no padded slices), else the first unsplit one (``group`` itself when there is none, or when
    the layout is not plain: the state reports it)."""
    try:
        spec = _spec_of(layout)
        n = group_size(mesh, group)
    except ValueError:
        return group
    if len(spec.axes) != len(shape):
        return group
    free = [(a.name, size) for a, size in zip(spec.axes, shape) if a.mesh is None]
    if not free:
        return group
    even = [name for name, size in free if size % n == 0 and size >= n]
    return f"{(even or [free[0][0]])[0]}/{group}"


def _layout_state(layout, names, grad, init_sync, source, p=None, sizes=None, store=None, mesh=None) -> ParameterState:
    """The state of ``layout``; with ``sizes=`` (``{axis: whole size}``) it records ``p``'s global shape.

    ``store=``: stored sharded over that group (``"c/dp"``: along ``c``; a bare group picks the axis, see
    :func:`_store_axis`); ``p`` holds its compute block (``layout``) until attached."""
    if store is not None and mesh is not None and p is not None and isinstance(store, str) and "/" not in store:
        store = _store_axis(layout, store, tuple(p.shape), mesh)
    state = ParameterState.from_layout(layout, mesh_dim_names=names, grad=grad, init_sync=init_sync, source=source,
                                       store=store)
    if sizes and p is not None:
        compute = state if store is None else ParameterState.from_layout(state.compute_layout)
        shape = global_shape_from_sizes(compute, tuple(p.shape), sizes)
        if shape is not None:
            state = replace(state, global_shape=shape)
    return state


def _attach(reg: Registration, mesh) -> None:
    """Attach every state; parameters stored sharded for the first time (``store=``) are cut to their storage
    block first. Every cut is planned (and every error raised) before anything changes."""
    cuts = []
    for p, state in reg.newly_stored():
        where = f"store={state.store!r} ({state.compute_layout!r})"
        if mesh is None:
            raise EinshardError(f"{where}: a parameter stored sharded needs the mesh (pass mesh=, not mesh_dim_names=)")
        dim, piece, even = storage_slice(state, tuple(p.shape), mesh)
        if state.global_shape is None and all(a.mesh in (None, state.store) for a in state.spec.axes):
            state = replace(state, global_shape=tuple(p.shape))  # nothing else is split: the block is whole
        elif state.global_shape is None and not even:
            axis = state.spec.axes[dim].name
            raise EinshardError(
                f"{where}: axis {axis!r} ({p.shape[dim]}) splits unevenly over {state.store!r}; give the whole "
                f"sizes of the split axes (sizes=) so every rank knows every block"
            )
        cuts.append((p, state, dim, piece))
    reg.attach()
    with torch.no_grad():
        for p, state, dim, piece in cuts:
            p.data = p.data[(slice(None),) * dim + (piece,)].clone()
            set_parameter_state(p, state)
            if type(p) is torch.nn.Parameter:  # its torch ops refuse to mix the slice with other shapes
                p.__class__ = StoredParameter


def _check_sizes(sizes, layouts=None) -> dict | None:
    """``sizes=``: a Mapping from axis names to whole sizes; with ``layouts``, every axis must be one of theirs."""
    if sizes is None:
        return None
    if not isinstance(sizes, Mapping):
        raise TypeError(f"sizes= must be a Mapping from axis names to whole sizes, got {type(sizes).__name__}")
    for axis, size in sizes.items():
        if not isinstance(axis, str):
            raise TypeError(f"sizes= keys are axis names, got {axis!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise EinshardError(f"sizes[{axis!r}] must be a non-negative int, got {size!r}")
    if layouts is not None:
        known = {a.name for text in layouts for a in _spec_of(text).axes}
        unknown = sorted(set(sizes) - known)
        if unknown:
            raise EinshardError(f"sizes= names axes {unknown}, which no layout has (their axes: {sorted(known)})")
    return dict(sizes)


def register_parameter_layout(
    p, layout, *, mesh=None, mesh_dim_names=(), grad=None, init_sync=None, sizes=None, source="layout", store=None
) -> torch.nn.Parameter:
    """Register ``layout`` (axes only, e.g. ``"out/tp in"``) on ``p``; returns ``p``.

    ``sizes=``: the whole sizes of sharded axes (``{"out": 8}``): the parameter's global shape is
    recorded, and checked wherever its block is used. ``store="dp"`` (with ``mesh=``): ``p`` holds its
    ``layout`` block now and keeps a ``1/|dp|`` slice of it (ZeRO-3: gathered before use, see
    :doc:`params`).

    >>> p = register_parameter_layout(torch.nn.Parameter(torch.zeros(4, 3)), "out/tp in", grad="dp", sizes={"out": 8})
    >>> get_parameter_state(p).grad_comm.mesh_dims, get_parameter_state(p).global_shape
    (('dp',), (8, 3))
    """
    reg = Registration()
    if not isinstance(p, torch.nn.Parameter):
        raise TypeError(f"p must be a torch.nn.Parameter, got {type(p).__name__}")
    sizes = _check_sizes(sizes, [layout] if isinstance(layout, str) else None)
    reg.add(p, _layout_state(layout, mesh_names(mesh, mesh_dim_names), grad, init_sync, source, p, sizes, store, mesh))
    _attach(reg, mesh)
    return p


def register_module_parameter_layouts_(
    module, layouts, *, mesh=None, mesh_dim_names=(), grad=None, init_sync=None, sizes=None, source="module",
    store=None,
):
    """Register ``{parameter name: layout}`` (dotted names allowed) on ``module``; returns ``module``.

    ``grad``/``init_sync``/``store`` are one value for all, or mappings by name (absent names get the default).
    ``sizes=``: ``{axis: whole size}`` for sharded axes; the global shapes of the parameters whose sharded
    axes it names are recorded (and checked wherever their blocks are used).

    >>> m = torch.nn.Sequential(torch.nn.Linear(3, 4))
    >>> _ = register_module_parameter_layouts_(m, {"0.weight": "out/tp in", "0.bias": "out/tp"}, grad="dp")
    >>> get_parameter_state(m[0].bias).reduce
    ('dp',)
    """
    if not isinstance(layouts, Mapping):
        raise TypeError(f"layouts must be a mapping from parameter names to layouts, got {type(layouts).__name__}")
    if not layouts:
        raise EinshardError("layouts must not be empty: name at least one parameter")
    for name, layout in layouts.items():
        if not isinstance(name, str):
            raise TypeError(f"parameter names must be str, got {name!r}")
        if not isinstance(layout, str):
            raise TypeError(f"the layout of {name!r} must be a str, got {type(layout).__name__}")
        if not name:
            raise EinshardError("an empty parameter name in layouts")
    names = list(layouts)
    sizes = _check_sizes(sizes, list(layouts.values()))
    grads = per_name(grad, names, "grad")
    syncs = per_name(init_sync, names, "init_sync")
    stores = per_name(store, names, "store")
    mesh_dims = mesh_names(mesh, mesh_dim_names)
    reg = Registration()
    for name in names:
        try:
            p = module.get_parameter(name)
        except AttributeError:
            raise EinshardError(f"unknown parameter names: {name!r} is not a parameter of the module") from None
        try:
            reg.add(p, _layout_state(layouts[name], mesh_dims, grads[name], syncs[name], source, p, sizes,
                                     stores[name], mesh), name)
        except ValueError as err:
            raise EinshardError(f"parameter {name!r}: {err}") from None
    _attach(reg, mesh)
    return module


def _weight_and_bias(module, what: str):
    weight = getattr(module, "weight", None)
    if weight is None:
        raise EinshardError(f"{what}: the module has no weight")
    if not isinstance(weight, torch.nn.Parameter):
        raise TypeError(f"{what}: module.weight must be a torch.nn.Parameter, got {type(weight).__name__}")
    bias = getattr(module, "bias", None)
    if bias is not None and not isinstance(bias, torch.nn.Parameter):
        raise TypeError(f"{what}: module.bias must be a torch.nn.Parameter or None, got {type(bias).__name__}")
    return weight, bias


def _first_axis_layout(state: ParameterState) -> str:
    """The first weight axis with its shard: ``out/tp in`` → ``out/tp``."""
    assert state.spec is not None  # a registered layout
    return str(state.spec.items[0])


def _spec_of(layout: str) -> TensorSpec:
    """The spec of a parameter layout (``ValueError`` for one that is not)."""
    spec = ParameterState.from_layout(layout).spec
    assert spec is not None  # from_layout parses one
    return spec


def _register_pair(
    module, what, weight_layout, bias_layout, names, grads, syncs, source, *, bias_must_match_first_axis, check,
    sizes=None, bias_given=False, mesh=None, stores=(None, None),
):
    """Shared body of the linear/conv/norm helpers (``grads``/``syncs``: (weight, bias) values; the shared
    ``grad=``/``init_sync=`` are defaults for both). ``bias_given``: a ``bias_*`` argument was passed.
    ``bias_must_match_first_axis``: the bias is the weight's first axis (linear, conv), else the whole
    weight layout (norm)."""
    weight, bias = _weight_and_bias(module, what)
    if bias is None and bias_given:
        raise EinshardError(f"{what}: bias_layout/bias_grad/bias_init_sync given but the module has no bias")
    if not isinstance(weight_layout, str):
        raise TypeError(f"{what}: the weight layout must be a str, got {type(weight_layout).__name__}")
    if bias_layout is not None and not isinstance(bias_layout, str):
        raise TypeError(f"{what}: the bias layout must be a str, got {type(bias_layout).__name__}")
    check(weight, bias)
    sizes = _check_sizes(sizes, [weight_layout])
    reg = Registration()
    w_state = _layout_state(weight_layout, names, grads[0], syncs[0], source, weight, sizes, stores[0], mesh)
    reg.add(weight, w_state, "weight")
    if bias is not None:
        if bias_must_match_first_axis:
            default = _first_axis_layout(ParameterState.from_layout(w_state.compute_layout))
            if bias_layout is not None and _layout_state(bias_layout, names, None, None, source).layout != default:
                raise EinshardError(f"{what}: bias layout {bias_layout!r} must be the first weight axis {default!r}")
            bias_layout = default
        elif bias_layout is None:
            bias_layout = w_state.compute_layout
        elif _layout_state(bias_layout, names, None, None, source).layout != w_state.compute_layout:
            raise EinshardError(f"{what}: the bias layout {bias_layout!r} must match the weight layout "
                                f"{w_state.compute_layout!r} (the same axes, sharded the same way)")
        reg.add(bias, _layout_state(bias_layout, names, grads[1], syncs[1], source, bias, sizes, stores[1], mesh),
                "bias")
    _attach(reg, mesh)
    return module


def _stores(store, bias_store):
    """(weight, bias) storage groups: ``bias_store`` defaults to ``store``; ``"none"`` stores the bias whole."""
    bias = store if bias_store is None else bias_store
    return store, None if bias == "none" else bias


def _pick(specific, shared):
    return shared if specific is None else specific


def _bias_given(layout, grad, init_sync) -> bool:
    return layout is not None or grad is not None or init_sync is not None


def register_linear_parameters_(
    module,
    *,
    weight_layout="out in",
    bias_layout=None,
    mesh=None,
    mesh_dim_names=(),
    weight_grad=None,
    bias_grad=None,
    init_sync=None,
    weight_init_sync=None,
    bias_init_sync=None,
    sizes=None,
    store=None,
    bias_store=None,
    source="linear",
):
    """Register a linear layer's weight (rank 2) and bias (its first weight axis); returns ``module``.

    ``store=``/``bias_store=``: stored sharded over that group (ZeRO-3, with ``mesh=``; ``bias_store``
    defaults to ``store``, ``"none"`` keeps the bias whole), as for :func:`register_parameter_layout`.

    >>> lin = register_linear_parameters_(torch.nn.Linear(3, 4), weight_layout="out in/tp")
    >>> get_parameter_state(lin.bias).layout
    'out'
    """

    def check(weight, bias):
        if weight.dim() != 2:
            raise EinshardError(f"linear: the weight must have rank 2, got shape {tuple(weight.shape)}")
        if bias is not None and bias.dim() != 1:
            raise EinshardError(f"linear: the bias must have rank 1, got shape {tuple(bias.shape)}")
        if bias is not None and bias.shape[0] != weight.shape[0]:
            raise EinshardError(f"linear: bias shape {tuple(bias.shape)} does "
                                f"not match weight.shape[0]={weight.shape[0]}")

    return _register_pair(
        module, "linear", weight_layout, bias_layout, mesh_names(mesh, mesh_dim_names),
        (weight_grad, bias_grad), (_pick(weight_init_sync, init_sync), _pick(bias_init_sync, init_sync)),
        source, bias_must_match_first_axis=True, check=check, sizes=sizes,
        bias_given=_bias_given(bias_layout, bias_grad, bias_init_sync), mesh=mesh, stores=_stores(store, bias_store),
    )


_CONV_DEFAULTS = {3: "out in k", 4: "out in kh kw", 5: "out in kd kh kw"}


def register_conv_parameters_(
    module,
    *,
    weight_layout=None,
    bias_layout=None,
    mesh=None,
    mesh_dim_names=(),
    grad=None,
    weight_grad=None,
    bias_grad=None,
    init_sync=None,
    weight_init_sync=None,
    bias_init_sync=None,
    sizes=None,
    store=None,
    bias_store=None,
    source="conv",
):
    """Register a convolution's weight (rank 3/4/5, default ``out in kh kw``...) and bias; returns ``module``.

    ``grad=``/``init_sync=`` are the defaults of both parameters (of the weight alone on a module
    without bias); only ``bias_*`` arguments on a module without bias are an error.

    >>> conv = register_conv_parameters_(torch.nn.Conv2d(2, 4, 3), weight_layout="out/tp in kh kw")
    >>> get_parameter_state(conv.bias).layout
    'out/tp'
    """
    if isinstance(module, (torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)):
        raise NotImplementedError("conv: ConvTranspose layers are not supported (their weight is 'in out k...')")
    if getattr(module, "groups", 1) != 1:
        raise NotImplementedError(f"conv: groups={module.groups} is not supported (only groups=1)")
    weight = getattr(module, "weight", None)
    if weight_layout is None and isinstance(weight, torch.Tensor):
        if weight.dim() not in _CONV_DEFAULTS:
            raise EinshardError(f"conv: the weight must have rank 3, 4 or 5, got shape {tuple(weight.shape)}")
        weight_layout = _CONV_DEFAULTS[weight.dim()]

    def check(weight, bias):
        if weight.dim() not in _CONV_DEFAULTS:
            raise EinshardError(f"conv: the weight must have rank 3, 4 or 5, got shape {tuple(weight.shape)}")
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
            raise EinshardError(f"conv: bias shape {tuple(bias.shape)} must be ({weight.shape[0]},) (rank 1)")

    return _register_pair(
        module, "conv", weight_layout, bias_layout, mesh_names(mesh, mesh_dim_names),
        (_pick(weight_grad, grad), _pick(bias_grad, grad)),
        (_pick(weight_init_sync, init_sync), _pick(bias_init_sync, init_sync)),
        source, bias_must_match_first_axis=True, check=check, sizes=sizes,
        bias_given=_bias_given(bias_layout, bias_grad, bias_init_sync), mesh=mesh, stores=_stores(store, bias_store),
    )


def register_norm_parameters_(
    module,
    *,
    layout=_UNSET,
    weight_layout=None,
    bias_layout=None,
    mesh=None,
    mesh_dim_names=(),
    grad=None,
    weight_grad=None,
    bias_grad=None,
    init_sync=None,
    weight_init_sync=None,
    bias_init_sync=None,
    sizes=None,
    store=None,
    bias_store=None,
    source="norm",
):
    """Register a norm layer's affine weight (default layout ``c``) and bias (same shape and layout).

    ``grad=``/``init_sync=`` are the defaults of both parameters (of the weight alone on a module
    without bias); ``bias_layout=``, if given, must equal the weight's layout. Buffers (running
    statistics) are untouched. Returns ``module``.

    >>> ln = register_norm_parameters_(torch.nn.LayerNorm(4), grad="sp", mesh_dim_names=("dp", "sp"))
    >>> get_parameter_state(ln.bias).reduce, get_parameter_state(ln.weight).layout
    (('sp',), 'c')
    """
    if layout is not _UNSET and not isinstance(layout, str):  # an explicit layout=None is not an omitted one
        raise TypeError(f"norm: layout must be a str like 'c', got {type(layout).__name__}")
    if layout is not _UNSET and weight_layout is not None and layout != weight_layout:
        raise EinshardError(f"norm: layout={layout!r} and weight_layout={weight_layout!r} differ")
    if weight_layout is None:
        weight_layout = "c" if layout is _UNSET else layout

    def check(weight, bias):
        if bias is not None and bias.shape != weight.shape:
            raise EinshardError(f"norm: bias shape {tuple(bias.shape)} differs from the weight's {tuple(weight.shape)}")

    return _register_pair(
        module, "norm", weight_layout, bias_layout, mesh_names(mesh, mesh_dim_names),
        (_pick(weight_grad, grad), _pick(bias_grad, grad)),
        (_pick(weight_init_sync, init_sync), _pick(bias_init_sync, init_sync)),
        source, bias_must_match_first_axis=False, check=check, sizes=sizes,
        bias_given=_bias_given(bias_layout, bias_grad, bias_init_sync), mesh=mesh, stores=_stores(store, bias_store),
    )
