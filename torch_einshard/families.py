"""``torch_einshard.families``: torch-einshard 1.0's expansion of axis families in a formula's text.

>>> cached_expand_axis_families("b *s -> b *s", {"s": (4, 5)}, {"s": ("x", "y")})
('b x y -> b x y', {'x': 4, 'y': 5})
"""

from __future__ import annotations

from functools import lru_cache

from einshard.errors import EinshardError
from einshard.notation import expand_unchecked, freeze_families
from einshard.plan.local import freeze_sizes

__all__ = ["cached_expand_axis_families", "expand_family_sizes"]


def expand_family_sizes(sizes, families):
    """``sizes=`` with each family key replaced by its members: one value per member, or one value for all."""
    table = dict(families)
    out: dict = {}
    for key, value in sizes:
        members = table.get(key)
        if members is None:
            out[key] = value
            continue
        values = value if isinstance(value, tuple) else (value,) * len(members)
        if len(values) != len(members):
            raise EinshardError(
                f"sizes[{key!r}] has {len(values)} values for the {len(members)} axes of family {key!r}")
        for member, v in zip(members, values):
            name = member.split("/")[0].strip()
            if out.get(name, v) != v:
                raise EinshardError(f"sizes give axis {name!r} two sizes ({out[name]} and {v}) through family {key!r}")
            out[name] = v
    return out


@lru_cache(maxsize=1024)
def _expanded(expression: str, sizes: tuple, families: tuple):
    return str(expand_unchecked(expression, families)), expand_family_sizes(sizes, families)


def cached_expand_axis_families(expression, sizes=None, families=None):
    """``(expression, sizes)`` with the families ``*f`` and zips ``[*a *b]`` of ``families=`` expanded.

    Without families both come back unchanged. The sizes of a family (one per member, or one
    for all) become sizes of its member axes. Results are cached; the sizes are a new dict.
    """
    if not families:
        return expression, sizes
    text, expanded = _expanded(expression, freeze_sizes(sizes), freeze_families(families))
    return text, (dict(expanded) if sizes is not None else None)
