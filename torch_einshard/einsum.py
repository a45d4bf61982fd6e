"""``torch_einshard.einsum``: torch-einshard 1.0's local einsum of a parsed formula.

``einsum(shard, *xs)`` contracts the tensors as they are, on this rank: the formula's
mesh dimensions are only names here (no communication). It runs through einshard's local
path (``torch.einsum`` with the notation's groups, ``...`` and ``sizes=``).

>>> import torch, torch_einshard as te
>>> te.einsum(te.parse_sharding("i j, j k -> i k"), torch.ones(2, 3), torch.ones(3, 4)).shape
torch.Size([2, 4])
"""

from __future__ import annotations

from einshard.errors import EinshardError
from einshard.ops.einshard import einshard

from .sharding import as_formula, formula_text

__all__ = ["einsum"]


def einsum(shard, *xs, name_only=False, sizes=None):
    """The local einsum of ``shard`` (text, a parsed formula or ``(input 0, input 1 or None, output)``).

    Axes match by name and placement: ``a/sp`` in two operands is one axis. An axis whose
    placement differs between operands (``a/sp`` and ``a``) is refused, because 1.0 treated
    the two as different axes; ``name_only=True`` matches axes by name alone. Partial inputs
    are refused unless ``name_only``; output partials are ignored.
    """
    formula = as_formula(shard)
    if not name_only:
        for k, spec in enumerate(formula.inputs):
            if spec.partial:
                raise EinshardError(
                    f"einsum: operand {k} '{spec}' is partial over {', '.join(spec.partial)}; "
                    "a local einsum does not take partial inputs"
                )
        placements: dict[str, set] = {}
        for spec in formula.tensors:
            for axis in spec.axes:
                placements.setdefault(axis.name, set()).add(axis.mesh)
        for name, meshes in placements.items():
            if len(meshes) > 1:
                shown = ", ".join(sorted(f"{name}/{m}" if m else name for m in meshes))
                raise EinshardError(
                    f"einsum: axis {name!r} has different placements ({shown}) in {str(formula)!r}; "
                    "torch-einshard 1.0 treated them as different axes, einshard refuses: "
                    "pass name_only=True to match axes by name"
                )
    return einshard(formula_text(formula, annotations=False, partials=False, meshes=False), *xs, sizes=sizes)
