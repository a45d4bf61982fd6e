"""``all_local`` and ``local_operation``: torch-einshard 1.0's tests of whether a formula needs communication.

>>> from torch_einshard import local_operation
>>> local_operation("a/sp b, b c -> a/sp c"), local_operation("a b/sp, b/sp c -> a c")
(True, False)
"""

from __future__ import annotations

from einshard.errors import EinshardError

from .sharding import as_formula

__all__ = ["all_local", "local_operation"]


def all_local(shard):
    """Whether no tensor of ``shard`` is sharded or partial."""
    return all(spec.is_local for spec in as_formula(shard) if spec is not None)


def local_operation(shard):
    """Whether every rank can compute its block of the output from its own blocks (1.0's rule).

    No tensor is partial; a unary formula keeps every sharded axis as it is; in a binary one
    no output axis changes placement against the inputs, and the axes both inputs share are
    unsharded.
    """
    formula = as_formula(shard)
    if len(formula.inputs) > 2:
        raise EinshardError(f"local_operation: 1.0's rule covers one or two inputs, {str(formula)!r} has "
                            f"{len(formula.inputs)}")
    if any(spec.partial for spec in formula.tensors):
        return False
    if formula.output is None:
        raise EinshardError(f"local_operation: {str(formula)!r} names no output ('->')")
    out = set(formula.output.axes)
    if len(formula.inputs) == 1:
        return all(axis.mesh is None for axis in set(formula.inputs[0].axes) ^ out)
    first, second = (set(spec.axes) for spec in formula.inputs)
    names = {axis.name for axis in first | second}
    if any(axis not in first | second and axis.name in names for axis in out):
        return False
    by_name = [{axis.name: axis for axis in axes} for axes in (first, second)]
    for name in by_name[0].keys() & by_name[1].keys():
        a, b = by_name[0][name], by_name[1][name]
        if a.mesh is not None or b.mesh is not None:
            return False
    return True
