"""The einshard notation: parsing, family expansion and validation.

``parse_sharding(text)`` returns an immutable, cached :class:`Formula`;
``expand(text, families)`` also replaces families ``*f`` and zips
``[*a *b]`` by the axes ``families=`` gives, then validates the result.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..core._cache import cached
from ..errors import EinshardError
from .grammar import invalid, parse_axis, parse_text
from .objects import Annotation, Axis, EllipsisItem, Family, Formula, Group, Item, TensorSpec, Zip

__all__ = [
    "Annotation",
    "Axis",
    "EllipsisItem",
    "Family",
    "Formula",
    "Group",
    "Item",
    "TensorSpec",
    "Zip",
    "parse_sharding",
    "expand",
    "expand_specs",
    "expand_unchecked",
    "expand_tensor",
    "check_semantics",
    "family_member",
    "freeze_families",
    "invalid",
]

_MAX_AXES = 52  # torch.einsum's letters
_ANNOTATION_KEYS = {"param": False, "grad": True, "init_sync": True}


@cached(4096)
def _parse(formula: str) -> Formula:
    """Syntax and the checks that do not depend on families."""
    inputs, output = parse_text(formula)
    parsed = Formula(formula, inputs, output)
    _check_structure(parsed)
    return parsed


@cached(4096)
def parse_sharding(formula: str) -> Formula:
    """Parse a formula (or a bare tensor spec) into immutable objects; syntax only.

    The result is cached: parsing the same text twice returns the same
    object, which callers must not (and cannot) mutate. It is also the
    sequence ``(input 0, input 1 or None, output)``. The meaning is checked
    where the specs are used (``es.einshard``, :func:`expand`,
    ``ParameterState.from_spec``): ``"a/sp b/sp -> a b"`` parses, and
    ``es.einshard`` rejects it.

    >>> f = parse_sharding("a/sp b, b c -> a/sp c")
    >>> [str(t) for t in f.inputs], str(f.output)
    (['a/sp b', 'b c'], 'a/sp c')
    >>> x, w, out = f
    """
    return _parse(formula)


def freeze_families(families: Mapping | tuple | None) -> tuple:
    """A hashable form of ``families=`` (used as a cache key; a frozen one is returned as it is)."""
    if not families:
        return ()
    if isinstance(families, tuple):
        return families
    frozen = []
    for name, members in families.items():
        if isinstance(members, str):
            members = (members,)
        frozen.append((name, tuple(members)))
    return tuple(sorted(frozen))


def expand(formula: str, families: Mapping | tuple | None = None) -> Formula:
    """Parse ``formula`` and expand its families; the result has no ``*f`` or zips.

    Validated as an einsum: every output axis must come from an input.
    """
    return _expand_cached(formula, freeze_families(families), True)


def expand_specs(formula: str, families: Mapping | tuple | None = None) -> Formula:
    """Like :func:`expand`, but the output may introduce new axes.

    For operations whose output names axes of their own (``einfft``'s
    frequency axes, ``einwindow``'s window axes); each tensor spec is still
    checked on its own.
    """
    return _expand_cached(formula, freeze_families(families), False)


@cached(4096)
def _expand_cached(formula: str, frozen: tuple, einsum: bool) -> Formula:
    parsed = expand_unchecked(formula, frozen)
    check_semantics(parsed, einsum)
    return parsed


def expand_unchecked(formula: str, families: Mapping | tuple | None = None) -> Formula:
    """``formula`` parsed and its families expanded, its meaning not checked (see :func:`check_semantics`)."""
    parsed = _parse(formula)
    if _has_families(parsed):
        table = {name: tuple(family_member(formula, name, m) for m in members)
                 for name, members in freeze_families(families)}
        parsed = Formula(
            formula,
            tuple(expand_tensor(formula, t, table) for t in parsed.inputs),
            None if parsed.output is None else expand_tensor(formula, parsed.output, table),
        )
    return parsed


def family_member(formula: str, family: str, member) -> Axis:
    """One member of ``families[family]`` (``'h'`` or ``'h/sp'``) as an :class:`Axis`, validated."""
    if isinstance(member, Axis):
        return member
    if not isinstance(member, str):
        raise EinshardError.named(
            f"families[{family!r}] must hold axis names like 'h' or 'h/sp', got {member!r} (in {formula!r})", formula
        )
    parsed = parse_axis(member)
    if parsed is None or str(parsed) != "".join(member.split()):
        raise EinshardError.named(
            f"Invalid einshard expression: families[{family!r}] entry {member!r} is not an axis "
            f"like 'h' or 'h/sp' (in {formula!r})", formula
        )
    return parsed


def _has_families(formula: Formula) -> bool:
    return any(
        isinstance(i, (Family, Zip)) or (isinstance(i, Group) and any(isinstance(a, Family) for a in i.axes))
        for t in formula.tensors
        for i in t.items
    )


def _family(formula: str, fam: Family, table) -> tuple[Axis, ...]:
    if fam.name not in table:
        known = ", ".join(sorted(table)) or "none given"
        raise invalid(formula, fam.pos, f"unknown family {fam.name!r} (families: {known})")
    return tuple(Axis(a.name, a.mesh, fam.pos) for a in table[fam.name])


def expand_tensor(formula: str, tensor: TensorSpec, table) -> TensorSpec:
    """``tensor`` with its families (``table``: ``{name: (Axis, ...)}``) expanded and zips grouped."""
    items: list[Item] = []
    for item in tensor.items:
        if isinstance(item, Family):
            items.extend(_family(formula, item, table))
        elif isinstance(item, Zip):
            members = [_family(formula, f, table) for f in item.families]
            lengths = {len(m) for m in members}
            if len(lengths) != 1:
                sizes = ", ".join(f"*{f.name} has {len(m)}" for f, m in zip(item.families, members))
                raise invalid(formula, item.pos, f"zipped families must have equal lengths ({sizes})")
            items.extend(Group(tuple(column), item.pos) for column in zip(*members))
        elif isinstance(item, Group) and any(isinstance(a, Family) for a in item.axes):
            axes = [x for a in item.axes for x in (_family(formula, a, table) if isinstance(a, Family) else (a,))]
            if not axes:
                raise invalid(formula, item.pos, "a group needs at least one axis: its families are empty")
            items.append(Group(tuple(axes), item.pos))
        else:
            items.append(item)
    return TensorSpec(tuple(items), tensor.partial, tensor.annotations, tensor.pos)


def _check_structure(formula: Formula) -> None:
    """Checks that do not depend on family expansion."""
    text = formula.text
    for tensor in formula.tensors:
        ellipses = [i for i in tensor.items if isinstance(i, EllipsisItem)]
        if len(ellipses) > 1:
            raise invalid(text, ellipses[1].pos, "at most one '...' per tensor")
    if formula.output is not None and formula.output.annotations:
        raise invalid(text, formula.output.pos, "annotations like [param] are allowed on inputs only")
    for tensor in formula.inputs:
        for ann in tensor.annotations:
            needs_value = _ANNOTATION_KEYS.get(ann.key)
            if needs_value is None:
                raise invalid(
                    text, tensor.pos, f"unknown annotation {ann.key!r} (known: param, grad=V, init_sync=V)"
                )
            if needs_value and ann.value is None:
                raise invalid(text, tensor.pos, f"annotation {ann.key!r} needs a value, e.g. {ann.key}=dp")
            if not needs_value and ann.value is not None:
                raise invalid(text, tensor.pos, f"annotation {ann.key!r} takes no value")


def check_semantics(formula: Formula, einsum: bool = True) -> None:
    """Checks on the expanded formula: names, mesh dimensions, and (``einsum``) output axes."""
    text = formula.text
    for index, tensor in enumerate(formula.tensors):
        where = _operand_name(formula, index)
        seen: dict[str, Axis] = {}
        used: dict[str, str] = {}
        for axis in tensor.axes:
            if axis.name in seen:
                if formula.output is not None and tensor is formula.output:
                    raise invalid(text, axis.pos, f"axis {axis.name!r} appears more than once in the output")
                if axis.mesh or seen[axis.name].mesh:
                    raise invalid(
                        text, axis.pos, f"axis {axis.name!r} appears twice in {where}; a diagonal cannot be sharded"
                    )
            seen.setdefault(axis.name, axis)
            for dim in axis.mesh_components:
                if dim in used:
                    raise invalid(
                        text,
                        axis.pos,
                        f"mesh dimension {dim!r} shards both {used[dim]!r} and {axis.name!r} in {where}; "
                        f"this is rejected by design: a mesh dimension splits at most one axis of a tensor "
                        f"(rank i would hold block (i, i) and no rank the blocks off the diagonal); shard the "
                        f"other axis over another mesh dimension",
                    )
                used[dim] = axis.name
        partial_dims: list[str] = []
        for p in tensor.partial:
            for dim in p.split("-"):
                if dim in partial_dims:
                    raise invalid(text, tensor.pos, f"{where} is partial over {dim!r} twice")
                if dim in used:
                    raise invalid(
                        text,
                        tensor.pos,
                        f"mesh dimension {dim!r} both shards {used[dim]!r} and is partial in {where}; "
                        f"this is rejected by design: a dimension's ranks either hold different blocks (shard) "
                        f"or addends of one value (partial), not both; reduce first ('// {dim} -> ') or "
                        f"shard another axis",
                    )
                partial_dims.append(dim)
    if formula.output is not None and einsum:
        names: dict[str, Axis] = {}
        for axis in (a for t in formula.tensors for a in t.axes):
            names.setdefault(axis.name, axis)
            if len(names) > _MAX_AXES:
                raise invalid(
                    text, axis.pos, f"a formula may use at most {_MAX_AXES} distinct axis names (torch.einsum's limit)"
                )
        known = {a.name for t in formula.inputs for a in t.axes}
        for axis in formula.output.axes:
            if axis.name not in known:
                raise invalid(text, axis.pos, f"Output dimension {axis.name!r} does not appear in any input")
        if formula.output.has_ellipsis and not any(t.has_ellipsis for t in formula.inputs):
            raise invalid(text, formula.output.pos, "the output has '...' but no input has")


def _operand_name(formula: Formula, index: int) -> str:
    if formula.output is not None and index == len(formula.inputs):
        return "the output"
    return f"operand {index}"
