"""Formulas whose sharded axes do not move: they run on local blocks without a mesh.

``a/sp b, b c -> a/sp c`` needs no communication: every rank multiplies its
own block of ``a`` by the whole ``b c``. Such a formula runs as the same
formula without its ``/dim`` annotations on the local blocks, so it needs
neither ``mesh=`` nor an ambient mesh. A formula is *stationary* when every
axis carries the same mesh dimension wherever it appears, every sharded axis
reaches the output, nothing is partial (``//``), and ``sizes=`` names no
sharded axis (its sizes would be whole-tensor sizes).
"""

from __future__ import annotations

from ..notation import Axis, Formula, Group, TensorSpec
from .local import build_local_plan

__all__ = ["is_stationary", "local_formula", "stationary_plan"]

_PLANS: dict = {}


def is_stationary(parsed: Formula, sizes: tuple = ()) -> bool:
    """Whether ``parsed`` moves no sharded axis (see the module docstring).

    >>> from einshard.notation import expand
    >>> is_stationary(expand("a/sp b, b c -> a/sp c")), is_stationary(expand("a/sp b -> a b"))
    (True, False)
    """
    if parsed.output is None or any(t.partial for t in parsed.tensors):
        return False
    mesh_of: dict[str, str | None] = {}
    for tensor in parsed.tensors:
        for axis in tensor.axes:
            if mesh_of.setdefault(axis.name, axis.mesh) != axis.mesh:
                return False
    out = {a.name for a in parsed.output.axes}
    sharded = {name for name, mesh in mesh_of.items() if mesh is not None}
    named = {key for key, _ in sizes}
    return sharded <= out and not (sharded & named)


def _strip(spec: TensorSpec) -> TensorSpec:
    def axis(a: Axis) -> Axis:
        return Axis(a.name, None, a.pos)

    items = tuple(
        axis(i) if isinstance(i, Axis) else Group(tuple(map(axis, i.axes)), i.pos) if isinstance(i, Group) else i
        for i in spec.items
    )
    return TensorSpec(items, (), spec.annotations, spec.pos)


def local_formula(parsed: Formula) -> Formula:
    """``parsed`` without its mesh annotations (same text, for error messages)."""
    return Formula(parsed.text, tuple(map(_strip, parsed.inputs)), _strip(parsed.output))


def stationary_plan(key: tuple, parsed: Formula, shapes):
    """The cached local plan running stationary ``parsed`` on local blocks."""
    plan = _PLANS.get(key)
    if plan is None:
        plan = build_local_plan(local_formula(parsed), shapes, key[1], key[2])
        if len(_PLANS) > 4096:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan
