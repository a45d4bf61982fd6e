"""The parsed objects of the notation. All immutable; parses are cached and shared."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import EinshardError


@dataclass(frozen=True, slots=True)
class Axis:
    """A named logical axis, optionally split over a (compound) mesh dimension.

    ``Axis("a", "sp")`` is ``a/sp``; ``Axis("a", "dp-sp")`` is ``a/dp-sp``.
    """

    name: str
    mesh: str | None = None
    pos: int = field(default=-1, compare=False, repr=False)

    @property
    def mesh_components(self) -> tuple[str, ...]:
        return tuple(self.mesh.split("-")) if self.mesh else ()

    def __str__(self) -> str:
        return f"{self.name}/{self.mesh}" if self.mesh else self.name


@dataclass(frozen=True, slots=True)
class Group:
    """A factored tensor dimension ``(h p)``: ``h`` outer, ``p`` inner (row-major).

    Before family expansion a member may be a :class:`Family` (``(b *spatial)``).
    """

    axes: tuple[Axis, ...]
    pos: int = field(default=-1, compare=False, repr=False)

    def __str__(self) -> str:
        return "(" + " ".join(map(str, self.axes)) + ")"


@dataclass(frozen=True, slots=True)
class EllipsisItem:
    """``...``: any number of unnamed, whole dimensions."""

    pos: int = field(default=-1, compare=False, repr=False)

    def __str__(self) -> str:
        return "..."


@dataclass(frozen=True, slots=True)
class Family:
    """``*spatial``: expands to the axes given in ``families=``."""

    name: str
    pos: int = field(default=-1, compare=False, repr=False)

    def __str__(self) -> str:
        return f"*{self.name}"


@dataclass(frozen=True, slots=True)
class Zip:
    """``[*spatial *window]``: zips families into groups ``(h wh) (w ww)``."""

    families: tuple[Family, ...]
    pos: int = field(default=-1, compare=False, repr=False)

    def __str__(self) -> str:
        return "[" + " ".join(map(str, self.families)) + "]"


Item = Axis | Group | EllipsisItem | Family | Zip


def _item_text(item) -> str:
    """An item as ``repr(spec.axes)`` shows it: ``out``, ``out / tp``, ``(a / dp b)``, ``...``."""
    if isinstance(item, Axis):
        return f"{item.name} / {item.mesh}" if item.mesh else item.name
    if isinstance(item, Group):
        return "(" + " ".join(_item_text(a) for a in item.axes) + ")"
    return str(item)


class Axes(tuple):
    """``TensorSpec.axes``: a tuple of :class:`Axis` whose ``repr`` is the layout, items joined by ``" × "``
    (``'out / tp × in'``; a group as ``(a / dp b)``, an ellipsis as ``...``)."""

    _items: tuple

    def __new__(cls, axes, items=None):
        self = super().__new__(cls, axes)
        self._items = tuple(self) if items is None else items
        return self

    @property
    def items(self) -> tuple:
        """The spec's items these axes come from (groups and ``...`` kept)."""
        return self._items

    def __repr__(self) -> str:
        return " × ".join(_item_text(i) for i in self._items) if self._items else "()"


@dataclass(frozen=True, slots=True)
class Annotation:
    """An operand annotation item: ``param``, ``grad=dp``, ``init_sync=V``."""

    key: str
    value: str | None = None

    def __str__(self) -> str:
        return self.key if self.value is None else f"{self.key}={self.value}"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor: its items, the mesh dimensions it is partial over, annotations."""

    items: tuple[Item, ...]
    partial: tuple[str, ...] = ()
    annotations: tuple[Annotation, ...] = ()
    pos: int = field(default=-1, compare=False, repr=False)

    @property
    def axes(self) -> Axes:
        """Every named axis, group members flattened, in order (no ellipsis).

        A tuple of :class:`Axis`; its ``repr`` shows the spec's items joined by ``" × "``:

        >>> from einshard import parse_sharding
        >>> parse_sharding("out/tp in").inputs[0].axes
        out / tp × in
        """
        out: list[Axis] = []
        for item in self.items:
            if isinstance(item, Axis):
                out.append(item)
            elif isinstance(item, Group):
                out.extend(a for a in item.axes if isinstance(a, Axis))
        return Axes(out, self.items)

    @property
    def has_ellipsis(self) -> bool:
        return any(isinstance(i, EllipsisItem) for i in self.items)

    @property
    def has_groups(self) -> bool:
        return any(isinstance(i, Group) for i in self.items)

    @property
    def is_local(self) -> bool:
        return not self.partial and all(a.mesh is None for a in self.axes)

    @property
    def mesh_components(self) -> frozenset[str]:
        """Every atomic mesh dimension this tensor names (shards or partials)."""
        dims = {c for a in self.axes for c in a.mesh_components}
        dims.update(c for p in self.partial for c in p.split("-"))
        return frozenset(dims)

    def ellipsis_ndim(self, ndim: int, where: str) -> int:
        """How many of a tensor's ``ndim`` dimensions ``...`` stands for (``where`` names the tensor in errors)."""
        named = sum(not isinstance(i, EllipsisItem) for i in self.items)
        if ndim < named or (ndim != named and not self.has_ellipsis):
            besides = " besides '...'" if self.has_ellipsis else ""
            raise EinshardError(f"{where} '{self}' names {named} dimensions{besides} but the tensor has {ndim}")
        return ndim - named

    def __str__(self) -> str:
        text = " ".join(map(str, self.items))
        if self.partial:
            inner = self.partial[0] if len(self.partial) == 1 else "(" + ", ".join(self.partial) + ")"
            text += f" // {inner}"
        if self.annotations:
            text += " [" + ", ".join(map(str, self.annotations)) + "]"
        return text


@dataclass(frozen=True, slots=True)
class Formula:
    """A parsed formula ``inputs -> output`` (``output`` is ``None`` for a bare spec).

    It is also the sequence ``(input 0, input 1, output)``: the middle one is ``None`` for a
    unary formula (and the output for a bare spec); a formula of three or more operands is
    ``(*inputs, output)``.

    >>> from einshard import parse_sharding
    >>> x, w, out = parse_sharding("b c, h c -> b h")
    >>> str(w), parse_sharding("w // dp -> w")[1]
    ('h c', None)
    """

    text: str
    inputs: tuple[TensorSpec, ...]
    output: TensorSpec | None

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        return self.inputs if self.output is None else self.inputs + (self.output,)

    @property
    def is_local(self) -> bool:
        return all(t.is_local for t in self.tensors)

    @property
    def mesh_components(self) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for t in self.tensors:
            out |= t.mesh_components
        return out

    def _operands(self) -> tuple:
        if len(self.inputs) >= 3:
            return self.inputs + (self.output,)
        return (self.inputs + (None,))[:2] + (self.output,)

    def __len__(self) -> int:
        return len(self._operands())

    def __iter__(self):
        return iter(self._operands())

    def __getitem__(self, index):
        return self._operands()[index]

    def __str__(self) -> str:
        ins = ", ".join(map(str, self.inputs))
        return ins if self.output is None else f"{ins} -> {self.output}"
