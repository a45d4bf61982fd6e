"""``torch_einshard.sharding``: torch-einshard 1.0's notation classes, as names for einshard's objects.

``parse_sharding`` returns einshard's parsed objects (:mod:`einshard.notation`). The 1.0
names below answer ``isinstance`` for them, and calling one builds einshard's object from
1.0's constructor arguments:

====================================  ==============================================
1.0                                   einshard object
====================================  ==============================================
``TensorSpec(axes, partials, annotation)``  ``einshard.notation.TensorSpec``
``Axes(items)``                       ``einshard.notation.objects.Axes``
``AxisGroup(axes)``                   ``einshard.notation.Group``
``EllipsisAxis()``                    ``einshard.notation.EllipsisItem``
``Axis(name, shard_dim='')``          ``einshard.notation.Axis``
====================================  ==============================================

The attributes are einshard's (``docs/migrating.md`` lists them): ``axis.mesh`` (``None``
when unsharded) for 1.0's ``shard_dim``, ``spec.partial`` for ``partials``, ``spec.items``
for 1.0's ``spec.axes`` (``spec.axes`` is the named axes with groups flattened, 1.0's
``axes.flat()``).

>>> import torch_einshard as te
>>> from torch_einshard.sharding import Axis, EllipsisAxis
>>> x = te.parse_sharding("a/sp (b c) -> a/sp b c")[0]
>>> isinstance(x, te.TensorSpec), isinstance(x.items[1], te.AxisGroup)
(True, True)
>>> str(te.TensorSpec(te.Axes([Axis("a", "sp"), EllipsisAxis()]), ["dp"]))
'a/sp ... // dp'
"""

from __future__ import annotations

from collections.abc import Sequence

from einshard import notation
from einshard.errors import EinshardError
from einshard.notation import objects

__all__ = ["Axes", "Axis", "AxisGroup", "EllipsisAxis", "LegacyName", "TensorSpec", "as_formula", "formula_text"]


class LegacyName(type):
    """The metaclass of a 1.0 class name: ``isinstance`` and ``issubclass`` answer for ``cls.target``."""

    target: type

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls.target)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, cls.target)


def _items(axes) -> tuple:
    out = tuple(axes.items if isinstance(axes, (notation.TensorSpec, objects.Axes)) else axes)
    for item in out:
        if not isinstance(item, (notation.Axis, notation.Group, notation.EllipsisItem)):
            raise EinshardError(
                f"an axis must be an Axis, AxisGroup or EllipsisAxis (einshard's notation objects), got {item!r}"
            )
    return out


class Axis(metaclass=LegacyName):
    """1.0's ``Axis(name, shard_dim='')``: einshard's ``Axis(name, mesh)`` (``mesh`` is ``None`` when unsharded)."""

    target = notation.Axis

    def __new__(cls, name: str, shard_dim: str = ""):
        return notation.Axis(name, shard_dim or None)


class EllipsisAxis(metaclass=LegacyName):
    """1.0's ``EllipsisAxis()``: einshard's ``EllipsisItem``."""

    target = notation.EllipsisItem

    def __new__(cls):
        return notation.EllipsisItem()


class AxisGroup(metaclass=LegacyName):
    """1.0's ``AxisGroup(axes)``: einshard's ``Group`` of axes (a factored dimension ``(h p)``)."""

    target = notation.Group

    def __new__(cls, axes):
        axes = tuple(axes)
        if not axes or not all(isinstance(a, notation.Axis) for a in axes):
            raise EinshardError(f"AxisGroup needs one or more Axis objects, got {axes!r}")
        return notation.Group(axes)


class Axes(metaclass=LegacyName):
    """1.0's ``Axes(items)``: einshard's ``Axes``, the named axes (groups flattened) printing the items with
    ``' × '``."""

    target = objects.Axes

    def __new__(cls, items=()):
        items = _items(items)
        flat = [a for i in items for a in (i.axes if isinstance(i, notation.Group) else (i,))
                if isinstance(a, notation.Axis)]
        return objects.Axes(flat, items)


class TensorSpec(metaclass=LegacyName):
    """1.0's ``TensorSpec(axes, partials=None, annotation=None)``: einshard's ``TensorSpec``.

    ``axes``: the items (``Axes``, a list of axes, groups and an ellipsis, or a spec);
    ``partials``: mesh dimensions; ``annotation``: einshard's annotation tuple (as a parsed
    spec carries it) or ``None``.
    """

    target = notation.TensorSpec

    def __new__(cls, axes, partials=None, annotation=None):
        items = _items(axes)
        if sum(isinstance(i, notation.EllipsisItem) for i in items) > 1:
            raise EinshardError("a tensor spec may contain at most one ellipsis")
        partial = (partials,) if isinstance(partials, str) else tuple(partials or ())
        annotations = tuple(annotation or ())
        if not all(isinstance(a, objects.Annotation) for a in annotations):
            raise EinshardError(
                "TensorSpec(annotation=...) takes einshard's annotations (a parsed spec's .annotations); "
                f"got {annotation!r}; parse the text instead: parse_sharding('w [param] -> w')[0]"
            )
        return notation.TensorSpec(items, partial, annotations)


def as_formula(shard) -> notation.Formula:
    """A formula from 1.0's ``shard`` argument: text, a parsed formula, or ``(input 0, input 1 or None, output)``."""
    if isinstance(shard, str):
        return notation.parse_sharding(shard)
    if isinstance(shard, notation.Formula):
        return shard
    if isinstance(shard, Sequence) and len(shard) >= 2:
        *inputs, output = shard
        inputs = [t for t in inputs if t is not None]
        specs = inputs + [output]
        if inputs and all(isinstance(t, notation.TensorSpec) for t in specs):
            text = ", ".join(map(str, inputs)) + " -> " + str(output)
            return notation.Formula(text, tuple(inputs), output)
    raise EinshardError(
        "expected a formula: its text, parse_sharding's result or (input 0, input 1 or None, output) specs; "
        f"got {shard!r}"
    )


def formula_text(shard, *, annotations: bool = True, partials: bool = True, meshes: bool = True) -> str:
    """The text of ``shard`` (see :func:`as_formula`), without annotations, partials or meshes when asked."""
    formula = as_formula(shard)

    def spec(t: notation.TensorSpec) -> notation.TensorSpec:
        items = t.items
        if not meshes:
            items = tuple(_unsharded(i) for i in items)
        return notation.TensorSpec(items, t.partial if partials else (), t.annotations if annotations else ())

    inputs = ", ".join(str(spec(t)) for t in formula.inputs)
    return inputs if formula.output is None else f"{inputs} -> {spec(formula.output)}"


def _unsharded(item):
    if isinstance(item, notation.Axis):
        return notation.Axis(item.name)
    if isinstance(item, notation.Group):
        return notation.Group(tuple(notation.Axis(a.name) for a in item.axes))
    return item
