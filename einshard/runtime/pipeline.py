"""The front end every operation shares, each step written once.

``einshard``, ``einfft`` and the stencil ops parse and check their specs, freeze their arguments into cache
keys, build a plan once (the ranks agree on a build error) and agree on a rank-local error before communicating.
Under ``torch.compile`` they plan at trace time (:func:`traced_plan`) and dynamo traces only the plan's replay.
Which of these paths a call takes is :mod:`einshard.runtime.dispatch`'s choice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..comm import checks
from ..comm.mesh import resolve_mesh
from ..core import _context, _trace
from ..core._cache import BoundedCache
from ..core._split import is_size
from ..core.layout import Layout
from ..errors import EinshardError, naming
from ..notation import Axis, Formula, Group, TensorSpec, expand, family_member, freeze_families
from ..plan.halo import BOUNDARIES
from ..plan.resolve import resolve

__all__ = ["freeze", "family_table", "check_spec", "check_kept_sharding", "parse_spec", "per_axis",
           "width_pair", "check_boundary", "check_tensors", "check_dtypes", "pick_mesh", "ambient_key", "spec_layout",
           "agree", "agree_before_communicating", "agrees_always", "build_plan", "traced_plan"]


# -- arguments ---------------------------------------------------------------------------------


def freeze(value):
    """A hashable form of nested dicts / lists of plain values, for cache keys (``dict(freeze(d)) == d``
    for a flat dict). A sequence argument is tagged, so a list of pairs never shares a cache entry with
    the dict it resembles (only the dict is valid); ``True`` is kept apart from ``1`` (a valid width).

    >>> freeze({"h": [1, 2], "w": True})
    (('h', (1, 2)), ('w', (<class 'bool'>, True)))
    >>> freeze([("h", 1)])
    (<class 'list'>, (('h', 1),))
    """
    return (list, _frozen(value)) if isinstance(value, (list, tuple)) else _frozen(value)


def _frozen(value):
    if isinstance(value, Mapping):
        return tuple((k, _frozen(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, bool):
        return (bool, value)
    return value


def family_table(families, text: str = "") -> dict[str, tuple[str, ...]]:
    """``{family: (member axis names)}`` of ``families=`` (a mapping or its frozen form), validated."""
    frozen = freeze_families(families)
    return {name: tuple(family_member(text, name, m).name for m in members) for name, members in frozen}


def check_spec(spec: TensorSpec, op: str, where: str = "the spec", unique: bool = True) -> None:
    """A plain spec: no annotations, ``...``, factored axes, partial sums or (``unique``) repeated names."""
    if spec.annotations:
        raise EinshardError(f"{op} takes no annotations like [{spec.annotations[0]}] on {where}")
    for item in spec.items:
        if isinstance(item, Group):
            names = " ".join(a.name for a in item.axes)
            raise EinshardError(
                f"factored axis '({names})' (axis {item.axes[0].name!r}) in {where} is not supported; "
                f"split the group first (es.einshard) and name the axes separately"
            )
    if spec.has_ellipsis:
        raise EinshardError(f"'...' is not supported in {where}; name every axis")
    if spec.partial:
        raise EinshardError(f"{where} '{spec}' is partial over {', '.join(spec.partial)!r}; sum it first (es.einshard)")
    seen = set()
    for a in spec.axes if unique else ():
        if a.name in seen:
            raise EinshardError(f"axis {a.name!r} appears twice in {where}")
        seen.add(a.name)


def check_kept_sharding(a: Axis, b: Axis) -> None:
    """Input axis ``a`` reaches the output as ``b`` sharded the same way (compound names in any order)."""
    if frozenset(a.mesh_components) != frozenset(b.mesh_components):
        raise EinshardError(
            f"the output changes the sharding of axis {a.name!r} ('{a}' -> '{b}'); it must stay as in the input"
        )


def parse_spec(text: str, families, op: str) -> TensorSpec:
    """The one tensor spec of ``text`` (families expanded), checked by :func:`check_spec`."""
    if not isinstance(text, str):
        raise EinshardError(f"the spec must be a string like 'b h/sp w c', got {type(text).__name__}")
    parsed = expand(text, families)
    if parsed.output is not None or len(parsed.inputs) != 1:
        raise EinshardError("expects one tensor spec like 'b h/sp w c' (no '->', no ',')")
    check_spec(parsed.inputs[0], op)
    return parsed.inputs[0]


def per_axis(mapping, names: Sequence[str], families, arg: str) -> dict:
    """``{axis: value}`` from a mapping keyed by axes or families (a family key takes a tuple)."""
    if mapping is None:
        return {}
    if not isinstance(mapping, Mapping):
        raise EinshardError(f"{arg} must be a dict keyed by axis (or family) names, got {mapping!r}")
    table = family_table(families)
    out: dict = {}
    for key, value in mapping.items():
        targets: tuple
        values: tuple
        if key in names:
            targets, values = (key,), (value,)
        elif key in table:
            members = table[key]
            if isinstance(value, str) and value in table:
                value = table[value]
            if not isinstance(value, (tuple, list)) or len(value) != len(members):
                raise EinshardError(
                    f"{arg}[{key!r}] names family {key!r} with {len(members)} members "
                    f"{list(members)}; give a tuple of {len(members)} values, got {value!r}"
                )
            targets, values = members, tuple(value)
        else:
            raise EinshardError(f"{arg} names axis {key!r}, which is not an input axis (input axes: {list(names)})")
        for t, v in zip(targets, values):
            if t not in names:
                raise EinshardError(f"{arg} names axis {t!r} (family {key!r}), which is not an input axis")
            if t in out:
                raise EinshardError(f"{arg} gives axis {t!r} twice")
            out[t] = v
    return out


def width_pair(value, axis: str, arg: str) -> tuple[int, int]:
    """``w`` or ``(left, right)`` as ``(left, right)`` of non-negative ints."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2 or not all(is_size(v) for v in value):
            raise EinshardError(f"{arg} of axis {axis!r} must be an int or (left, right) of ints >= 0, got {value!r}")
        return int(value[0]), int(value[1])
    if not is_size(value):
        raise EinshardError(f"{arg} of axis {axis!r} must be an int >= 0 or (left, right), got {value!r}")
    return int(value), int(value)


def check_boundary(boundary: str) -> str:
    if boundary not in BOUNDARIES:
        raise EinshardError(f"boundary must be one of {list(BOUNDARIES)}, got {boundary!r}")
    return boundary


@naming()
def check_tensors(formula, tensors, dtypes: bool = True) -> None:
    """The operands are tensors (of one dtype: :func:`check_dtypes`); the error names the operand."""
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise EinshardError(f"operand {i} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes:
        check_dtypes(formula, [t.dtype for t in tensors])


@naming()
def check_dtypes(formula, dtypes) -> None:
    """One dtype for all operands: ``torch.einsum`` would fail (after the operands' collectives, when distributed)."""
    names = sorted({str(d) for d in dtypes})
    if len(names) > 1:
        raise EinshardError(f"the operands have different dtypes ({', '.join(names)}); convert them first")


# -- mesh, layouts, agreement, plans ------------------------------------------------------------


def pick_mesh(spec: TensorSpec, mesh):
    """The mesh a spec needs: ``None`` for a local spec, else ``mesh=`` or the ambient one."""
    if not any(a.mesh for a in spec.axes):
        return None
    return resolve_mesh(mesh)


def ambient_key():
    """The ambient split shapes (``shard_map``) as part of a cache key."""
    amb = _context.current().shapes
    return tuple(sorted(amb.items(), key=repr)) if amb else None


def spec_layout(spec: TensorSpec, text: str, shape: tuple, mesh, shapes):
    """``(Layout, local_error)`` of a tensor of local shape ``shape`` laid out as ``spec``."""
    names = [a.name for a in spec.axes]
    if len(shape) != len(names):
        raise EinshardError(f"the spec names {len(names)} dimensions but the tensor has {len(shape)}")
    if mesh is None:
        n = len(names)
        return Layout(tuple(names), tuple(int(s) for s in shape), ((),) * n, (None,) * n), None
    res = resolve(Formula(text, (spec,), spec), [tuple(shape)], mesh, shapes=shapes, ambient=_context.shapes_for(mesh))
    return res.operands[0], res.local_error


def agree(mesh, error, **kwargs) -> None:
    """:func:`einshard.comm.checks.agree` over every rank of ``mesh`` (raises ``error`` alone when checks are off)."""
    checks.agree(mesh.group(tuple(mesh.names)), error, **kwargs)


def agree_before_communicating(mesh, local_error, x: torch.Tensor, always: bool = False) -> None:
    """Raise a rank-local error on every rank (checks on, or ``always``: an explicit ``shapes=``) or here.

    When they agree, the ranks also agree on ``x``'s dtype and device (the exchange would abort on a mismatch).
    """
    if local_error is not None or (mesh is not None and (always or checks.ENABLED)):
        error = None if local_error is None else EinshardError(local_error)
        if mesh is None:
            assert error is not None  # the condition above
            raise error
        agree(mesh, error, facts=(("dtype", x.dtype), ("device", x.device)), point="exchange", always=always)


def agrees_always(mesh, shapes) -> bool:
    """Whether an operation agrees on every call, checks on or off: it was given ``shapes=``, which one rank's
    block may contradict, and its mesh has process groups."""
    return shapes is not None and mesh is not None and mesh.has_process_groups()


def build_plan(cache: BoundedCache, key, mesh, build, context=None, **agreement):
    """``cache[key]``, or ``build()`` stored there; with checks on, the ranks of ``mesh`` agree on a build error.

    ``context``: ``(expression, op)`` that a build error names (:meth:`EinshardError.within`) before the agreement.
    """
    plan = cache.get(key)
    if plan is not None:
        return plan
    try:
        plan = build()
    except ValueError as err:
        if context is not None and isinstance(err, EinshardError):
            err.within(*context)
        if mesh is not None and checks.checks_enabled():
            agree(mesh, err, **agreement)
        raise
    return cache.put(key, plan)


def traced_plan(build, *args):
    """In code that dynamo traces: what ``build(*args)`` returns, built as plain Python at trace time.

    ``build`` is a module-level function of constants (shapes, dtypes, devices, specs, meshes; no tensors),
    run under the traced ambient context; its errors (agreed with checks on) are raised while tracing. The graph
    holds only what traced code then does with the result (an op's replay).
    """
    ambient = _context.current()
    # checks.ENABLED read here, in traced code: the graph is traced again when checks are turned on or off
    return _trace.lookup(_built_at_trace_time(build, ambient.mesh, ambient.shapes, checks.ENABLED,
                                              *_trace.static_value(args)))


@_trace.constant_result
def _built_at_trace_time(build, mesh, shapes, checks_on, *args) -> str:  # (one argument each: a mesh may be one)
    with _context.at_trace_time(mesh, shapes):
        return _trace.register(build(*args))
