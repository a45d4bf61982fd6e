"""What a parameter carries: its layout and its two duties (initial sync, gradient reduction).

Three frozen dataclasses (``dataclasses.replace`` and ``==`` work):

- :class:`ParameterInitSync`: which groups broadcast the initial values;
- :class:`ParameterGradComm`: which groups SUM the gradient, by which backend and schedule;
- :class:`ParameterState`: the layout (a parsed operand spec, or ``None`` for a
  layout-free state), its shard groups, the managed mesh names and both duties.

Objects are not checked when built; :func:`check_state` (used by registration
and validation) checks well-formedness and the layout/duty invariants.

>>> s = ParameterState.from_layout("out/tp in", mesh_dim_names=("dp", "tp"), grad="dp")
>>> s.layout, s.layout_shard_dims, s.shared, s.reduce
('out/tp in', ('tp',), ('dp',), ('dp',))
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import EinshardError
from ..notation import Axis, EllipsisItem, Family, TensorSpec, Zip, parse_sharding
from .names import check_group_syntax, components, mesh_names, normalize_mesh_dim_names, overlapping, unknown_groups

__all__ = [
    "TensorState",
    "ParameterInitSync",
    "ParameterGradComm",
    "ParameterState",
    "check_state",
    "check_rank",
    "derive_tensor_state",
    "derive_init_sync",
    "storage_spec",
    "gather_formula",
]

INIT_MODES = ("none", "external", "explicit", "inferred")
GRAD_MODES = ("none", "inferred", "explicit")
# "vma": satisfied inside shard_map(check_vma=True) by the body's own pvary; skipped by every reducer
GRAD_BACKENDS = ("none", "native", "ddp", "external", "vma")
SCHEDULES = ("backend_default", "synchronous", "async")
_GROUP = r"[A-Za-z_][A-Za-z0-9_]*(?:-[A-Za-z_][A-Za-z0-9_]*)*"
_VALUE = re.compile(rf"({_GROUP})(?::([A-Za-z_][A-Za-z0-9_]*))?")
# keyword (pending) or suffix (concrete) -> (backend, schedule)
_GRAD_KEYWORDS = {
    "async": ("native", "async"),
    "ddp": ("ddp", "backend_default"),
    "external": ("external", "backend_default"),
}


@dataclass(frozen=True)
class TensorState:
    """Per-axis placement of a layout and the mesh names it is replicated over (in mesh order)."""

    placements: tuple[tuple[str, str | None], ...]
    replicated_dims: tuple[str, ...] = ()

    def placement_dict(self) -> dict[str, str | None]:
        """``{axis: group or None}``."""
        return dict(self.placements)


def _shard_components(shard_dims: Sequence[str]) -> set[str]:
    return {c for g in shard_dims for c in components(g)}


def derive_tensor_state(spec: TensorSpec | None, mesh_dim_names: Sequence[str]) -> TensorState | None:
    """The tensor state of ``spec``: ``None`` for no spec, a ``...`` or a repeated axis."""
    if spec is None or spec.has_ellipsis:
        return None
    axes = spec.axes
    if len({a.name for a in axes}) != len(axes):
        return None
    shard = _shard_components([a.mesh for a in axes if a.mesh])
    replicated = tuple(n for n in mesh_dim_names if not set(components(n)) & shard)
    return TensorState(tuple((a.name, a.mesh) for a in axes), replicated)


def _spec_shard_dims(spec: TensorSpec) -> tuple[str, ...]:
    return tuple(a.mesh for a in spec.axes if a.mesh)


def _parse_value(value, key: str) -> tuple[str, str | None]:
    if not isinstance(value, str):
        raise TypeError(f"{key}= must be a string annotation value like 'dp', got {type(value).__name__}")
    match = _VALUE.fullmatch(value)
    if match is None:
        raise EinshardError(f"Invalid {key}= value {value!r}: expected GROUP "
                            "or GROUP:SUFFIX with names like 'dp' or 'dp-sp'")
    return match.group(1), match.group(2)


@dataclass(frozen=True)
class ParameterInitSync:
    """How initial values are made equal where the parameter is replicated.

    Modes: ``none``; ``external`` (a loader or framework owns the values);
    ``explicit`` (≥1 group, one broadcast each); ``inferred`` (every mesh name
    sharing no component with a shard, in mesh order).

    >>> ParameterInitSync.from_annotation(None, ("tp",), ("dp", "tp"))
    ParameterInitSync(mode='inferred', mesh_dims=('dp',))
    >>> ParameterInitSync.from_annotation("external", (), ("dp",)).mode
    'external'
    """

    mode: str = "none"
    mesh_dims: tuple[str, ...] = ()

    @classmethod
    def from_annotation(cls, ann, layout_shard_dims=(), mesh_dim_names=()) -> ParameterInitSync:
        """From ``init_sync=`` text (``None`` = absent: inferred): ``G``, ``none`` or ``external``."""
        if ann is None:
            return derive_init_sync(layout_shard_dims, mesh_dim_names)
        group, suffix = _parse_value(ann, "init_sync")
        if suffix is not None:
            raise EinshardError(f"Invalid init_sync= value {ann!r}: init_sync "
                                "takes no ':' suffix (values: G, none, external)")
        if group in ("none", "external"):
            return cls(group)
        return cls("explicit", (group,))


def derive_init_sync(layout_shard_dims: Sequence[str], mesh_dim_names: Sequence[str]) -> ParameterInitSync:
    """The inferred init sync: the names sharing no component with a shard; ``none`` without names."""
    if not mesh_dim_names:
        return ParameterInitSync()
    shard = _shard_components(layout_shard_dims)
    return ParameterInitSync("inferred", tuple(n for n in mesh_dim_names if not set(components(n)) & shard))


@dataclass(frozen=True)
class ParameterGradComm:
    """Who SUMs the gradient over which groups.

    ``mode`` none/inferred/explicit; ``backend`` none/native/ddp/external (and
    ``vma``: already reduced inside ``shard_map``); ``schedule``
    backend_default/synchronous/async. *Pending inference*: mode inferred with no dims.

    >>> ParameterGradComm.from_annotation("dp:async")
    ParameterGradComm(mode='explicit', mesh_dims=('dp',), backend='native', schedule='async')
    >>> ParameterGradComm.from_annotation(None, is_param=True).pending_inference
    True
    """

    mode: str = "none"
    mesh_dims: tuple[str, ...] = ()
    backend: str = "none"
    schedule: str = "backend_default"

    @property
    def pending_inference(self) -> bool:
        return self.mode == "inferred" and not self.mesh_dims

    @classmethod
    def from_annotation(cls, ann, *, is_param: bool = False) -> ParameterGradComm:
        """From ``grad=`` text (``None`` = absent: pending native on a ``[param]``, else none)."""
        if ann is None:
            return cls("inferred", (), "native") if is_param else cls()
        group, suffix = _parse_value(ann, "grad")
        if group in _GRAD_KEYWORDS or group == "none":
            if suffix is not None:
                raise EinshardError(f"Invalid grad= value {ann!r}: the keyword {group!r} takes no ':' suffix")
            if group == "none":
                return cls()
            backend, schedule = _GRAD_KEYWORDS[group]
            return cls("inferred", (), backend, schedule)
        if suffix is None:
            return cls("explicit", (group,), "native")
        if suffix not in _GRAD_KEYWORDS:
            raise EinshardError(
                f"Invalid grad= value {ann!r}: unknown suffix {suffix!r} (known: :async, :ddp, :external)"
            )
        backend, schedule = _GRAD_KEYWORDS[suffix]
        return cls("explicit", (group,), backend, schedule)


@dataclass(frozen=True)
class ParameterState:
    """The metadata attached to an ``nn.Parameter`` (attribute ``einshard_state``).

    >>> s = ParameterState.from_layout("c", mesh_dim_names=("dp",))
    >>> s.init_sync, s.grad_comm.mode
    (ParameterInitSync(mode='inferred', mesh_dims=('dp',)), 'none')
    """

    spec: TensorSpec | None
    tensor_state: TensorState | None = None
    layout_shard_dims: tuple[str, ...] = ()
    mesh_dim_names: tuple[str, ...] = ()
    init_sync: ParameterInitSync = field(default_factory=ParameterInitSync)
    grad_comm: ParameterGradComm = field(default_factory=ParameterGradComm)
    source: str = "inferred"
    explicit_init_sync_none: bool = False
    explicit_grad_comm_none: bool = False
    global_shape: tuple[int, ...] | None = None  # the whole tensor's shape, when known (None: unknown)
    store: str | None = None  # the group the storage layout adds on top of the compute layout (ZeRO), or None

    @property
    def axes(self) -> tuple:
        """The top-level items of the layout."""
        if self.spec is None:
            raise EinshardError("this ParameterState is layout-free (spec is None): it has no axes")
        return self.spec.items

    @property
    def shared(self) -> tuple[str, ...]:
        """The init-sync groups (none for modes none/external)."""
        return () if self.init_sync.mode in ("none", "external") else self.init_sync.mesh_dims

    @property
    def reduce(self) -> tuple[str, ...]:
        """The gradient groups (none for mode none or an external backend)."""
        if self.grad_comm.mode == "none" or self.grad_comm.backend == "external":
            return ()
        return self.grad_comm.mesh_dims

    @property
    def layout(self) -> str | None:
        """The canonical layout text (``"out/tp in"``), or ``None`` when layout-free: what the parameter holds
        (its storage layout when it is stored sharded, ``store=``)."""
        return None if self.spec is None else " ".join(map(str, self.spec.items))

    @property
    def compute_layout(self) -> str | None:
        """The layout its computations see: :attr:`layout` without the storage group (``store=``).

        >>> ParameterState.from_layout("f/tp c", mesh_dim_names=("dp", "tp"), store="dp").compute_layout
        'f/tp c'
        """
        if self.spec is None or self.store is None:
            return self.layout
        return " ".join(i.name if isinstance(i, Axis) and i.mesh == self.store else str(i) for i in self.spec.items)

    @property
    def store_axis(self) -> int | None:
        """The index of the axis the storage group splits (``None`` without ``store=``)."""
        if self.spec is None or self.store is None:
            return None
        return next(k for k, i in enumerate(self.spec.items) if isinstance(i, Axis) and i.mesh == self.store)

    @classmethod
    def from_spec(cls, spec, *, mesh_dim_names=(), source: str = "inferred") -> ParameterState:
        """One operand spec and its ``param``/``grad=``/``init_sync=`` annotations; never infers dims.

        >>> from einshard import parse_sharding
        >>> w = parse_sharding("x, w/tp [param, grad=dp] -> x").inputs[1]
        >>> ParameterState.from_spec(w, mesh_dim_names=("dp", "tp")).grad_comm.mesh_dims
        ('dp',)
        """
        if isinstance(spec, str):
            spec = _bare_spec(spec, "from_spec")
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"from_spec needs a parsed TensorSpec, got {type(spec).__name__}")
        if spec.partial:
            raise EinshardError(f"a parameter has an axis layout; {str(spec)!r} is partial (// ...)")
        if any(isinstance(i, (Family, Zip)) for i in spec.items):
            raise EinshardError(f"expand families before reading a parameter layout: {str(spec)!r}")
        names = normalize_mesh_dim_names(mesh_dim_names)
        values: dict[str, str | None] = {}
        for ann in spec.annotations:
            if ann.key in values:
                raise EinshardError(f"annotation {ann.key!r} appears twice in {str(spec)!r}")
            values[ann.key] = ann.value
        return cls._build(spec, names, values.get("grad"), values.get("init_sync"), source, "param" in values)

    @classmethod
    def from_layout(
        cls, layout, *, mesh=None, mesh_dim_names=(), grad=None, init_sync=None, source: str = "layout", store=None
    ) -> ParameterState:
        """A layout (axes only): no gradient duty unless ``grad=``; init sync inferred unless ``init_sync=``.

        ``store="dp"``: stored sharded over ``dp`` on top of the compute ``layout`` (ZeRO-3, see
        :func:`storage_spec`; ``store="c/dp"`` names the axis); the gradient duty then includes ``dp``
        (``grad=`` defaults to it).

        >>> ParameterState.from_layout("out/tp in", mesh_dim_names=("dp", "tp")).init_sync.mesh_dims
        ('dp',)
        >>> ParameterState.from_layout("out/tp in", mesh_dim_names=("dp", "tp"), store="dp").layout
        'out/tp in/dp'
        """
        if not isinstance(layout, str):
            raise TypeError(f"layout must be a str like 'out/tp in', got {type(layout).__name__}")
        for key, value in (("grad", grad), ("init_sync", init_sync), ("store", store)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{key}= must be a string annotation value like 'dp', got {type(value).__name__}")
        spec = _bare_spec(layout, "layout")
        if spec.annotations:
            raise EinshardError(f"layout {layout!r} takes axes only; pass grad=/init_sync= as arguments")
        if spec.partial:
            raise EinshardError(f"a parameter has an axis layout; {layout!r} is partial (// ...)")
        if spec.has_groups:
            raise EinshardError(f"layout {layout!r} has factored axes '( )', which a parameter layout cannot have")
        axes = [a.name for a in spec.axes]
        if spec.has_ellipsis or len(set(axes)) != len(axes):
            raise EinshardError(
                f"layout {layout!r} has '...' or a repeated axis, so it has no TensorState (one axis per dimension)"
            )
        if any(isinstance(i, (Family, Zip)) for i in spec.items):
            raise EinshardError(f"layout {layout!r} cannot use families")
        if store is not None:
            axis, _, group = store.rpartition("/")
            store = group
            spec = storage_spec(spec, store, axis or None)
            grad = _store_duty(grad, store, layout)
        return cls._build(spec, mesh_names(mesh, mesh_dim_names), grad, init_sync, source, False, store)

    @classmethod
    def _build(cls, spec, names, grad, init_sync, source, is_param, store=None) -> ParameterState:
        shard_dims = _spec_shard_dims(spec)
        state = cls(
            spec=spec,
            tensor_state=derive_tensor_state(spec, names),
            layout_shard_dims=shard_dims,
            mesh_dim_names=names,
            init_sync=ParameterInitSync.from_annotation(init_sync, shard_dims, names),
            grad_comm=ParameterGradComm.from_annotation(grad, is_param=is_param),
            source=source,
            explicit_init_sync_none=init_sync == "none",
            explicit_grad_comm_none=grad == "none",
            store=store,
        )
        check_state(state)
        _check_diagonal(spec)
        return state


def storage_spec(spec: TensorSpec, store: str, axis: str | None = None) -> TensorSpec:
    """The storage layout of a parameter computed as ``spec`` and stored over ``store`` (ZeRO-3).

    ``store`` is a mesh group (``"dp"``, ``"dp-sp"``) that ``spec`` does not use: it splits the first axis the
    compute layout leaves unsplit (``f/tp c`` stored over ``dp`` is ``f/tp c/dp``), so every rank holds a
    ``1/|dp|`` slice of its compute block and an all-gather over ``dp`` alone rebuilds the block. ``axis``
    names another unsplit axis instead (``store="c/dp"`` at registration).

    >>> str(storage_spec(parse_sharding("f/tp c").inputs[0], "dp"))
    'f/tp c/dp'
    """
    check_group_syntax(store, "store")
    if store in ("none", "async", "ddp", "external"):
        raise EinshardError(f"store={store!r}: expected a mesh group like 'dp' or 'dp-sp'")
    axes = [i for i in spec.items if isinstance(i, Axis)]
    text = " ".join(map(str, spec.items))
    used = sorted(_shard_components([a.mesh for a in axes if a.mesh]) & set(components(store)))
    if used:
        raise EinshardError(
            f"store={store!r}: the compute layout {text!r} splits over {used} already; a parameter is stored over "
            "mesh dimensions its compute layout does not use (the data-parallel ones)"
        )
    free = [k for k, i in enumerate(spec.items) if isinstance(i, Axis) and i.mesh is None]
    if axis is not None:
        named = [k for k, i in enumerate(spec.items) if isinstance(i, Axis) and i.name == axis]
        if not named or named[0] not in free:
            raise EinshardError(f"store={axis}/{store}: {axis!r} is not an unsplit axis of the compute layout {text!r}")
        free = named
    if not free:
        raise EinshardError(
            f"store={store!r}: every axis of the compute layout {text!r} is split already, so no axis is left for "
            f"{store!r}; register this parameter without store= (its hooks sum its gradient)"
        )
    items = list(map(str, spec.items))
    items[free[0]] = f"{items[free[0]]}/{store}"
    return _bare_spec(" ".join(items), "layout")


def _store_duty(grad, store: str, layout: str):
    """The gradient duty of a stored parameter: ``grad=`` (native, covering ``store``), or ``store`` itself."""
    if grad is None or grad == "async":
        return store if grad is None else f"{store}:async"
    comm = ParameterGradComm.from_annotation(grad)
    if comm.mode == "none":
        raise EinshardError(
            f"store={store!r} with grad='none' ({layout!r}): a stored parameter's gradient is always summed over "
            f"{store!r} (reduce-scattered into its shard)"
        )
    if comm.backend != "native":
        raise EinshardError(
            f"store={store!r} with grad={grad!r} ({layout!r}): the gather's backward reduce-scatters this gradient "
            f"over {store!r}, and the {comm.backend} backend would sum it a second time; a stored parameter's duty "
            f"is native (grad={store!r} or a group containing it)"
        )
    if comm.pending_inference or not set(components(store)) <= {c for g in comm.mesh_dims for c in components(g)}:
        raise EinshardError(
            f"store={store!r} with grad={grad!r} ({layout!r}): the gradient of a parameter stored over {store!r} "
            f"is summed over {store!r} (a reduce-scatter); name those groups in grad= (e.g. grad={store!r})"
        )
    return grad


def gather_formula(state: ParameterState) -> str:
    """The formula that gathers a stored parameter: storage layout to compute layout, partial over its duty.

    >>> gather_formula(ParameterState.from_layout("f/tp c", mesh_dim_names=("dp", "tp"), store="dp"))
    'f/tp c/dp -> f/tp c // dp'
    """
    groups = state.grad_comm.mesh_dims
    partial = groups[0] if len(groups) == 1 else "(" + ", ".join(groups) + ")"
    return f"{state.layout} -> {state.compute_layout} // {partial}"


def _check_diagonal(spec: TensorSpec) -> None:
    """A repeated axis (a diagonal) cannot be sharded: rejected by design, as ``es.einshard`` rejects it."""
    seen: dict[str, bool] = {}
    for a in spec.axes:
        if a.name in seen and (a.mesh or seen[a.name]):
            raise EinshardError(f"axis {a.name!r} appears twice in {str(spec)!r}; a diagonal cannot be sharded")
        seen[a.name] = seen.get(a.name, False) or a.mesh is not None


def _bare_spec(text: str, what: str) -> TensorSpec:
    parsed = parse_sharding(text)
    if parsed.output is not None or len(parsed.inputs) != 1:
        raise EinshardError(f"{what} {text!r} must be one tensor spec like 'out/tp in', not a formula")
    return parsed.inputs[0]


# -- checks ----------------------------------------------------------------------------------
def _check_dims(value, owner: str) -> tuple[str, ...]:
    if not isinstance(value, tuple):
        raise TypeError(f"{owner} must be a tuple of str, got {type(value).__name__}")
    for d in value:
        if not isinstance(d, str):
            raise TypeError(f"{owner} entries must be str, got {d!r}")
    return value


def _check_init_sync(s) -> None:
    if not isinstance(s, ParameterInitSync):
        raise EinshardError(f"ParameterState.init_sync must be a ParameterInitSync, got {type(s).__name__}")
    if s.mode not in INIT_MODES:
        raise EinshardError(f"ParameterInitSync.mode must be one of {INIT_MODES}, got {s.mode!r}")
    _check_dims(s.mesh_dims, "ParameterInitSync.mesh_dims")
    if s.mode in ("none", "external") and s.mesh_dims:
        raise EinshardError(f"ParameterInitSync mode {s.mode!r} has no mesh_dims, got {s.mesh_dims!r}")
    if s.mode == "explicit" and not s.mesh_dims:
        raise EinshardError("ParameterInitSync: explicit mode requires mesh_dims")
    for g in s.mesh_dims:
        check_group_syntax(g, "init_sync")


def _check_grad_comm(g) -> None:
    if not isinstance(g, ParameterGradComm):
        raise EinshardError(f"ParameterState.grad_comm must be a ParameterGradComm, got {type(g).__name__}")
    for name, value, allowed in (
        ("mode", g.mode, GRAD_MODES),
        ("backend", g.backend, GRAD_BACKENDS),
        ("schedule", g.schedule, SCHEDULES),
    ):
        if value not in allowed:
            raise EinshardError(f"ParameterGradComm.{name} must be one of {allowed}, got {value!r}")
    _check_dims(g.mesh_dims, "ParameterGradComm.mesh_dims")
    if (g.mode == "none") != (g.backend == "none" and not g.mesh_dims):
        raise EinshardError(f"ParameterGradComm: mode 'none' goes with backend 'none' and no mesh_dims, got {g!r}")
    if g.mode == "explicit" and not g.mesh_dims:
        raise EinshardError("ParameterGradComm: explicit mode requires mesh_dims")
    if g.schedule != "backend_default" and g.backend != "native":
        raise EinshardError(f"ParameterGradComm: schedule {g.schedule!r} needs the native backend, got {g.backend!r}")
    for d in g.mesh_dims:
        check_group_syntax(d, "grad")


def _check_fields(state) -> None:
    if not isinstance(state, ParameterState):
        raise TypeError(f"expected a ParameterState, got {type(state).__name__}")
    if state.spec is not None and not isinstance(state.spec, TensorSpec):
        raise EinshardError(f"ParameterState.spec must be a TensorSpec or None, got {type(state.spec).__name__}")
    if state.spec is not None and state.spec.partial:
        raise EinshardError(f"ParameterState.spec must be an axis layout, got partial {str(state.spec)!r}")
    _check_dims(state.layout_shard_dims, "ParameterState.layout_shard_dims")
    _check_dims(state.mesh_dim_names, "ParameterState.mesh_dim_names")
    normalize_mesh_dim_names(state.mesh_dim_names)
    if not isinstance(state.source, str):
        raise EinshardError(f"ParameterState.source must be a str, got {state.source!r}")
    for flag in ("explicit_init_sync_none", "explicit_grad_comm_none"):
        if not isinstance(getattr(state, flag), bool):
            raise EinshardError(f"ParameterState.{flag} must be a bool, got {getattr(state, flag)!r}")
    _check_init_sync(state.init_sync)
    _check_grad_comm(state.grad_comm)
    if state.tensor_state is not None and not isinstance(state.tensor_state, TensorState):
        raise EinshardError(f"ParameterState.tensor_state must be a TensorState or None, got {state.tensor_state!r}")
    if state.spec is None:
        if state.tensor_state is not None:
            raise EinshardError("a layout-free ParameterState has no tensor_state")
        if state.grad_comm.mode != "none":
            raise EinshardError("a layout-free ParameterState has no gradient duty")
    else:
        if state.layout_shard_dims != _spec_shard_dims(state.spec):
            raise EinshardError(
                f"ParameterState.layout_shard_dims {state.layout_shard_dims!r} is stale: the spec "
                f"{str(state.spec)!r} shards over {_spec_shard_dims(state.spec)!r}"
            )
        derived, given = derive_tensor_state(state.spec, ()), state.tensor_state
        if (derived is None) != (given is None) or (
            derived is not None and given is not None and derived.placements != given.placements
        ):
            raise EinshardError(f"ParameterState.tensor_state does not match the spec {str(state.spec)!r}")
    _check_global_shape(state)
    _check_store(state)
    if state.explicit_init_sync_none and state.init_sync.mode != "none":
        raise EinshardError("ParameterState.explicit_init_sync_none is set but init_sync is not none")
    if state.explicit_grad_comm_none and state.grad_comm.mode != "none":
        raise EinshardError("ParameterState.explicit_grad_comm_none is set but grad_comm is not none")


def _check_store(state) -> None:
    store = state.store
    if store is None:
        return
    if not isinstance(store, str):
        raise EinshardError(f"ParameterState.store must be a mesh group (str) or None, got {store!r}")
    if state.spec is None or state.tensor_state is None:
        raise EinshardError("a stored parameter (store=) needs a layout of plain axes")
    if sum(1 for a in state.spec.axes if a.mesh == store) != 1:
        raise EinshardError(f"ParameterState.store {store!r}: exactly one "
                            f"axis of {state.layout!r} must be split over it")
    others = _shard_components([a.mesh for a in state.spec.axes if a.mesh and a.mesh != store])
    if others & set(components(store)):
        raise EinshardError(f"store={store!r}: the compute layout {state.compute_layout!r} splits over it already")
    g = state.grad_comm
    if g.backend != "native" or g.pending_inference or not set(components(store)) <= {
        c for d in g.mesh_dims for c in components(d)
    }:
        raise EinshardError(
            f"store={store!r}: a stored parameter's gradient duty must be native and cover {store!r}, got {g!r}"
        )


def _check_global_shape(state) -> None:
    shape = state.global_shape
    if shape is None:
        return
    if not isinstance(shape, tuple) or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape):
        raise EinshardError(f"ParameterState.global_shape must be a tuple of non-negative ints or None, got {shape!r}")
    if state.spec is None:
        raise EinshardError("a layout-free ParameterState has no global shape")
    check_rank(state, len(shape), "global shape")


def check_state(state) -> None:
    """Well-formedness and the invariants: group syntax, overlaps, known names, the inferred init sync."""
    _check_fields(state)
    shards = state.layout_shard_dims
    for g in shards:
        check_group_syntax(g, "layout")
    pair = overlapping(shards)
    if pair:
        raise EinshardError(f"layout groups {pair[0]!r} and {pair[1]!r} share the same mesh dimension")
    shard_parts = _shard_components(shards)
    init = state.shared
    for g in init:
        if set(components(g)) & shard_parts:
            raise EinshardError(f"init_sync group {g!r} overlaps the shard groups {shards!r}")
    pair = overlapping(init)
    if pair:
        raise EinshardError(f"init_sync groups overlap: {pair[0]!r} and {pair[1]!r}")
    grad = state.grad_comm
    if grad.backend in ("native", "ddp") and not grad.pending_inference:
        computed = _shard_components([g for g in shards if g != state.store])  # stored: summed, then scattered
        for g in grad.mesh_dims:
            if set(components(g)) & computed:
                raise EinshardError(f"grad group {g!r} overlaps the shard groups {shards!r}")
        pair = overlapping(grad.mesh_dims)
        if pair:
            raise EinshardError(f"grad groups overlap: {pair[0]!r} and {pair[1]!r}")
    names = state.mesh_dim_names
    checked = list(shards) + list(state.init_sync.mesh_dims)
    if grad.backend != "external":
        checked += list(grad.mesh_dims)
    unknown = unknown_groups(checked, names)
    if unknown:
        raise EinshardError(f"unknown mesh dimensions {unknown!r}: the mesh has {names!r}")
    if state.init_sync.mode == "inferred" and state.init_sync != derive_init_sync(shards, names):
        raise EinshardError(
            f"ParameterState inferred init_sync mesh_dims {state.init_sync.mesh_dims!r} do not match the "
            f"layout-derived mesh dims {derive_init_sync(shards, names).mesh_dims!r}"
        )


def check_rank(state: ParameterState, ndim: int, where: str = "parameter") -> None:
    """ValueError "rank" when the layout's top-level items do not fit a tensor of rank ``ndim``."""
    if state.spec is None:
        return
    items = state.spec.items
    n = len(items)
    if any(isinstance(i, EllipsisItem) for i in items):
        if ndim < n - 1:
            raise EinshardError(f"layout {state.layout!r} needs rank >= {n - 1}, but the {where} has rank {ndim}")
    elif ndim != n:
        raise EinshardError(f"layout {state.layout!r} has rank {n}, but the {where} has rank {ndim}")

