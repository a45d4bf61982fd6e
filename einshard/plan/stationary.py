"""Formulas whose sharded axes do not move: they run on local blocks without a mesh.

``a/sp b, b c -> a/sp c`` needs no communication: every rank multiplies its
own block of ``a`` by the whole ``b c``. Such a formula runs as the same
formula without its ``/dim`` annotations on the local blocks, so it needs
neither ``mesh=`` nor an ambient mesh. A formula is *stationary* when every
axis carries the same mesh dimension wherever it appears, every sharded axis
reaches the output, nothing is partial (``//``), and ``sizes=`` names no
sharded axis (its sizes would be whole-tensor sizes).

Backward is another matter: an operand replicated over a dimension that
shards the output (``b c`` above, over ``sp``) gets its gradient summed over
that dimension, which needs the mesh. Without one, such an operand may not
require a gradient (:func:`needs_mesh_for_grad` names it).
"""

from __future__ import annotations

import torch

from ..core._cache import BoundedCache
from ..notation import Axis, Formula, Group, TensorSpec
from .local import build_local_plan

__all__ = ["is_stationary", "local_formula", "needs_mesh_for_grad", "stationary_plan", "why_mesh"]

_PLANS = BoundedCache(name="einshard.plan.stationary.plans")


def is_stationary(parsed: Formula, sizes: tuple = ()) -> bool:
    """Whether ``parsed`` moves no sharded axis (see the module docstring).

    >>> from einshard.notation import expand
    >>> is_stationary(expand("a/sp b, b c -> a/sp c")), is_stationary(expand("a/sp b -> a b"))
    (True, False)
    """
    if parsed.output is None or any(t.partial for t in parsed.tensors):
        return False
    mesh_of: dict[str, frozenset] = {}  # compound names in any order: 'sp-tp' is 'tp-sp'
    for tensor in parsed.tensors:
        for axis in tensor.axes:
            dims = frozenset(axis.mesh_components)
            if mesh_of.setdefault(axis.name, dims) != dims:
                return False
    out = {a.name for a in parsed.output.axes}
    sharded = {name for name, dims in mesh_of.items() if dims}
    named = {key for key, _ in sizes}
    return sharded <= out and not (sharded & named)


def why_mesh(parsed: Formula) -> str:
    """Why a formula that is not stationary needs the mesh, with the fix for an omitted sharded axis.

    >>> from einshard.notation import expand
    >>> why_mesh(expand("b/dp c, c -> c"))
    "the sum over 'b' (sharded over 'dp') adds the ranks' blocks; to keep it per rank, make it an output partial: 'b/dp c, c -> c // dp'"
    """  # noqa: E501 - a doctest's output line
    out = {a.name for a in parsed.output.axes} if parsed.output is not None else set()
    dropped: dict[str, str] = {}
    for t in parsed.inputs:
        for a in t.axes:
            if a.mesh and a.name not in out:
                dropped.setdefault(a.name, a.mesh)
    if dropped and parsed.output is not None:
        groups = list(dict.fromkeys(list(parsed.output.partial) + list(dropped.values())))
        kept = TensorSpec(parsed.output.items, tuple(groups), parsed.output.annotations)
        ins = ", ".join(map(str, parsed.inputs))
        axes = ", ".join(f"{name!r} (sharded over {g!r})" for name, g in dropped.items())
        return (f"the sum over {axes} adds the ranks' blocks; to keep it per rank, make it an output partial: "
                f"'{ins} -> {kept}'")
    if any(t.partial for t in parsed.tensors):
        return "a partial sum (// ...) is summed or kept across ranks"
    return "a sharded axis changes its mesh dimension, which moves data between ranks"


def needs_mesh_for_grad(parsed: Formula, tensors) -> str | None:
    """Why backward would need the mesh (an operand needing a gradient summed over ranks), or ``None``.

    >>> import torch
    >>> from einshard.notation import expand
    >>> w = torch.ones(3, 4, requires_grad=True)
    >>> needs_mesh_for_grad(expand("a/sp b, b c -> a/sp c"), [torch.ones(2, 3), w])
    "operand 1 needs a gradient, which backward sums over ['sp']"
    """
    if not torch.is_grad_enabled():
        return None
    assert parsed.output is not None  # a formula with an output
    sharded = {d for a in parsed.output.axes for d in a.mesh_components}
    for i, (spec, t) in enumerate(zip(parsed.inputs, tensors)):
        missing = sharded - {d for a in spec.axes for d in a.mesh_components}
        if missing and t.requires_grad:
            return f"operand {i} needs a gradient, which backward sums over {sorted(missing)}"
    return None


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
    assert parsed.output is not None  # a formula with an output
    return Formula(parsed.text, tuple(map(_strip, parsed.inputs)), _strip(parsed.output))


def stationary_plan(key: tuple, parsed: Formula, shapes):
    """The cached local plan running stationary ``parsed`` on local blocks."""
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.put(key, build_local_plan(local_formula(parsed), shapes, key[1], key[2]))
    return plan
