"""Local (single-rank) lowering of a formula: reshapes around one torch call.

A formula on local tensors becomes: split factored groups (``reshape``), run
the cheapest torch call for the core (nothing, ``permute``, ``sum``, a
matrix product or ``einsum``), and merge output groups (``reshape``).
Everything is decided once, in :func:`build_local_plan`; the returned plan
only replays.
"""

from __future__ import annotations

import math
import string
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from ..core import _torch_compat
from ..errors import EinshardError, SizeMismatchError, naming
from ..notation import Axis, EllipsisItem, Formula, Group, TensorSpec

_einsum = _torch_compat.einsum_entry  # skips torch.einsum's Python-level argument handling

_LETTERS = string.ascii_letters


def einsum(equation: str, operands: Sequence[torch.Tensor], path=None) -> torch.Tensor:
    """``torch.einsum`` with a precomputed contraction path."""
    return _einsum(equation, list(operands), path=path)


def letters_for(names: Sequence[str]) -> dict[str, str]:
    """Assign einsum letters to axis names (52 at most)."""
    table: dict[str, str] = {}
    for name in names:
        if name not in table:
            if len(table) == len(_LETTERS):
                raise EinshardError("a formula may use at most 52 distinct axis names")
            table[name] = _LETTERS[len(table)]
    return table


class Contraction:
    """The core of a formula on atomic axes: ``operand axes -> output axes``.

    ``inputs`` and ``output`` are tuples of axis names; ``None`` stands for
    the ellipsis. ``sizes`` (per operand, axis name to size) lets a matrix
    product be chosen: it needs to know no axis broadcasts. The callable picks
    the cheapest torch call once.
    """

    __slots__ = ("run", "run_traced", "equation", "path", "kind", "fresh")

    def __init__(self, inputs: Sequence[tuple], output: tuple, ellipsis_ndims: Sequence[int] = (),
                 sizes: Sequence[Mapping[str, int] | None] | None = None):
        names = [n for axes in list(inputs) + [output] for n in axes if n is not None]
        table = letters_for(names)

        def term(axes):
            return "".join("..." if n is None else table[n] for n in axes)

        self.equation = ",".join(term(a) for a in inputs) + "->" + term(output)
        self.path = None
        self.kind, self.run = self._lower(list(inputs), tuple(output), list(ellipsis_ndims), sizes)
        # a product of two or more operands: a new tensor that its backward does not keep (it keeps the operands)
        self.fresh = len(inputs) > 1 and self.kind in ("einsum", "linear", "matmul")
        self.run_traced = self.run
        if self.kind == "einsum":  # dynamo traces torch.einsum, not its C++ entry point
            equation = self.equation
            self.run_traced = lambda tensors: torch.einsum(equation, *tensors)

    def _lower(self, inputs, output, ellipsis_ndims, sizes):
        if len(inputs) == 1:
            (axes,) = inputs
            if len(set(axes)) == len(axes) and None not in axes:
                kept = [n for n in axes if n in output]
                dropped = tuple(i for i, n in enumerate(axes) if n not in output)
                if set(kept) == set(output):
                    order = tuple(kept.index(n) for n in output)
                    identity = order == tuple(range(len(order)))
                    if not dropped and identity:
                        return "identity", _identity
                    if not dropped:
                        return "permute", _permute(order)
                    if identity:
                        return "sum", _sum(dropped)
                    return "sum+permute", _sum_permute(dropped, order)
        if len(inputs) == 2 and sizes is not None:
            product = _matrix_product(inputs[0], inputs[1], output, sizes)
            if product is not None:
                return product
        if len(inputs) > 2:
            self.path = _greedy_path(inputs, output)
        equation, path = self.equation, self.path
        return "einsum", lambda tensors: einsum(equation, tensors, path)

    def __call__(self, tensors):
        return self.run(tensors)


def _identity(tensors):
    return tensors[0]


def _permute(order):
    return lambda tensors: tensors[0].permute(order)


def _sum(dims):
    return lambda tensors: tensors[0].sum(dims)


def _sum_permute(dims, order):
    return lambda tensors: tensors[0].sum(dims).permute(order)


def _matrix_product(a: tuple, b: tuple, output: tuple, sizes):
    """``(kind, run)`` when ``a, b -> output`` is one matrix product on the operands as laid out.

    The shape is ``x[..., k] * w[n, k] -> y[..., n]`` (``F.linear``, the
    layout of ``nn.Linear`` weights) or ``x[..., k] * w[k(, n)] -> y[...(, n)]``
    (``torch.matmul``), with either operand first. These run one ``mm`` with no
    copies, forward and backward, where ``einsum`` goes through ``bmm`` and
    views. Anything else, or a contracted axis that broadcasts (size 1
    against another size), returns ``None`` (``einsum``).
    """
    if None in a or None in b or len(set(a)) != len(a) or len(set(b)) != len(b) or None in sizes:
        return None
    for x, w in ((a, b), (b, a)):
        if not x or x[-1] not in w or x[-1] in output or len(w) > 2:
            continue
        if sizes[0][x[-1]] != sizes[1][x[-1]]:
            return None
        k, rows = x[-1], x[:-1]
        if any(n in w for n in rows):
            continue
        if w == (k,) and output == rows:
            return "matmul", _matmul(x is b)
        if len(w) == 2 and k in w:
            n = w[0] if w[1] == k else w[1]
            if n not in rows and output == rows + (n,):
                if w[1] == k:
                    return "linear", _linear(x is b)
                return "matmul", _matmul(x is b)
    return None


def _linear(swap):
    if swap:
        return lambda tensors: F.linear(tensors[1], tensors[0])
    return lambda tensors: F.linear(tensors[0], tensors[1])


def _matmul(swap):
    if swap:
        return lambda tensors: torch.matmul(tensors[1], tensors[0])
    return lambda tensors: torch.matmul(tensors[0], tensors[1])


def _greedy_path(inputs, output):
    """A contraction path for 3+ operands: repeatedly join the pair sharing most axes.

    Returned in ``torch.einsum``'s ``path`` format (list of index pairs into
    the current operand list, results appended at the end).
    """
    live = [set(a) - {None} for a in inputs]
    out = set(output) - {None}
    path = []
    while len(live) > 1:
        best = None
        for i in range(len(live)):
            for j in range(i + 1, len(live)):
                others = out.union(*(live[k] for k in range(len(live)) if k not in (i, j)))
                joined = (live[i] | live[j]) & others
                score = (len(joined), -len(live[i] & live[j]))
                if best is None or score < best[0]:
                    best = (score, i, j, joined)
        assert best is not None  # two operands or more
        _, i, j, joined = best
        path.extend([i, j])
        live = [s for k, s in enumerate(live) if k not in (i, j)] + [joined]
    return path


def operand_name(index: int) -> str:
    return f"operand {index}"


def dims_of(spec: TensorSpec, ndim: int, index: int):
    """Match a tensor spec's items to ``ndim`` tensor dimensions.

    Returns a list with one entry per tensor dimension: an ``Axis``, a
    ``Group`` or ``EllipsisItem`` (one per ellipsis dimension).
    """
    extra = spec.ellipsis_ndim(ndim, operand_name(index))
    dims: list = []
    for item in spec.items:
        if isinstance(item, EllipsisItem):
            dims.extend([item] * extra)
        else:
            dims.append(item)
    return dims


def freeze_sizes(sizes: Mapping | None) -> tuple:
    """A hashable form of ``sizes=`` (values unchanged: :func:`expand_sizes` checks them)."""
    if not sizes:
        return ()
    return tuple(sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in sizes.items()))


def _size_value(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        if not (isinstance(value, float) and value.is_integer() and value >= 0):
            raise EinshardError(f"sizes[{key!r}] must be a non-negative integer, got {value!r}")
    return int(value)


@naming()
def expand_sizes(formula: Formula, sizes: tuple, families: tuple) -> dict[str, int]:
    """``sizes=`` with family keys expanded to their members."""
    table = dict(families)
    names = {a.name for t in formula.tensors for a in t.axes}
    out: dict[str, int] = {}
    for key, value in sizes:
        if isinstance(value, tuple):
            members = table.get(key)
            if members is None:
                raise EinshardError(f"sizes[{key!r}] is a tuple but {key!r} is not a family")
            if len(members) != len(value):
                raise EinshardError(
                    f"sizes[{key!r}] has {len(value)} entries but family {key!r} "
                    f"has {len(members)} members"
                )
            for member, v in zip(members, value):
                out[member.split("/")[0].strip()] = _size_value(key, v)
        elif key in table and key not in names:
            raise EinshardError(f"sizes[{key!r}] for a family needs one size per member")
        else:
            out[key] = _size_value(key, value)
    unknown = sorted(set(out) - names)
    if unknown:
        raise EinshardError(f"sizes names axis {unknown[0]!r}, which is not in the formula")
    return out


def infer_group_sizes(index: int, group: Group, dim_size: int, known: dict) -> None:
    """Fill ``known`` with the sizes of a group's factors (one unknown allowed)."""
    unknown = [a.name for a in group.axes if a.name not in known]
    product = math.prod(known[a.name] for a in group.axes if a.name in known)
    if len(unknown) > 1:
        raise EinshardError(
            f"Cannot infer multiple factor sizes: {', '.join(map(repr, unknown))} in group "
            f"'{group}' of {operand_name(index)} are all unknown; pass sizes= for all but one"
        )
    if unknown:
        if product == 0 or dim_size % product:
            factors = ", ".join(f"{a.name}={known[a.name]}" for a in group.axes if a.name in known)
            raise EinshardError(
                f"dimension of size {dim_size} in {operand_name(index)} cannot be "
                f"factored as group '{group}': the known factors ({factors}) have product {product}, which "
                f"does not divide {dim_size}, so the unknown factor {unknown[0]!r} has no size"
            )
        known[unknown[0]] = dim_size // product
    elif product != dim_size:
        sizes = " * ".join(f"{a.name}={known[a.name]}" for a in group.axes)
        raise SizeMismatchError(f"group '{group}' of {operand_name(index)} has "
                                f"size {dim_size}, but {sizes} = {product}")


def check_size(index: int, axis: str, size: int, known: dict) -> None:
    """Record ``axis``'s size from operand ``index`` (size 1 broadcasts against another size)."""
    old = known.get(axis)
    if old is None or old == size:
        known[axis] = size
    elif old == 1:
        known[axis] = size
    elif size != 1:
        raise SizeMismatchError(f"axis {axis!r} has size {size} in {operand_name(index)} but {old} elsewhere")


class LocalPlan:
    """Replays a local formula: input reshapes, the contraction, the output reshape."""

    __slots__ = ("in_shapes", "contraction", "out_shape", "run", "run_traced")

    def __init__(self, in_shapes, contraction, out_shape):
        self.in_shapes = in_shapes  # per input: None or the expanded shape
        self.contraction = contraction
        self.out_shape = out_shape  # None or the merged output shape
        self.run = self._compile(contraction.run)
        self.run_traced = self._compile(contraction.run_traced)

    def _compile(self, core):
        reshapes = self.in_shapes
        out_shape = self.out_shape
        if not any(s is not None for s in reshapes):
            if out_shape is None:
                return core
            return lambda tensors: core(tensors).reshape(out_shape)

        def run(tensors):
            tensors = [t if s is None else t.reshape(s) for t, s in zip(tensors, reshapes)]
            out = core(tensors)
            return out if out_shape is None else out.reshape(out_shape)

        return run

    def __call__(self, tensors):
        return self.run(tensors)


@naming()
def build_local_plan(formula: Formula, shapes: Sequence[tuple], sizes: tuple = (), families: tuple = ()) -> LocalPlan:
    """Plan a local formula for inputs of the given shapes."""
    if formula.output is None:
        raise EinshardError("einshard needs a formula 'inputs -> output'")
    if len(shapes) != len(formula.inputs):
        raise EinshardError(f"the formula has {len(formula.inputs)} operand(s) but {len(shapes)} tensor(s) were given")
    known = expand_sizes(formula, sizes, families)
    given = dict(known)
    per_input = [dims_of(spec, len(shape), i) for i, (spec, shape) in enumerate(zip(formula.inputs, shapes))]
    ellipsis_shapes = []
    # plain axes first, so groups can use their sizes
    for i, (dims, shape) in enumerate(zip(per_input, shapes)):
        ell = []
        for d, size in zip(dims, shape):
            if isinstance(d, Axis):
                if d.name in given and given[d.name] != size:
                    raise EinshardError(
                        f"axis {d.name!r} of {operand_name(i)} has size {size} "
                        f"but sizes= says {given[d.name]}"
                    )
                check_size(i, d.name, size, known)
            elif isinstance(d, EllipsisItem):
                ell.append(size)
        ellipsis_shapes.append(tuple(ell))
    for i, (dims, shape) in enumerate(zip(per_input, shapes)):
        for d, size in zip(dims, shape):
            if isinstance(d, Group):
                infer_group_sizes(i, d, size, known)
    in_shapes = []
    in_axes = []
    in_sizes: list = []
    for spec, shape in zip(formula.inputs, shapes):
        axes: list = []
        expanded: list[int] = []
        grouped = False
        n_ellipsis = len(shape) - sum(1 for i in spec.items if not isinstance(i, EllipsisItem))
        k = 0
        for item in spec.items:
            if isinstance(item, EllipsisItem):
                axes.append(None)
                expanded.extend(shape[k : k + n_ellipsis])
                k += n_ellipsis
                continue
            if isinstance(item, Group):
                grouped = True
                axes.extend(a.name for a in item.axes)
                expanded.extend(known[a.name] for a in item.axes)
            else:
                assert isinstance(item, Axis)  # an expanded spec: no families left
                axes.append(item.name)
                expanded.append(shape[k])
            k += 1
        in_axes.append(tuple(axes))
        in_shapes.append(tuple(expanded) if grouped else None)
        in_sizes.append(None if None in axes else dict(zip(axes, expanded)))
    out_axes: list = []
    out_shape: list[int] = []
    out_grouped = False
    ell_out = _broadcast_ellipsis(formula, ellipsis_shapes) if formula.output.has_ellipsis else ()
    for item in formula.output.items:
        if isinstance(item, Group):
            out_grouped = True
            out_axes.extend(a.name for a in item.axes)
            out_shape.append(math.prod(known[a.name] for a in item.axes))
        elif isinstance(item, Axis):
            out_axes.append(item.name)
            out_shape.append(known[item.name])
        else:
            out_axes.append(None)
            out_shape.extend(ell_out)
    contraction = Contraction(in_axes, tuple(out_axes), [len(e) for e in ellipsis_shapes], in_sizes)
    return LocalPlan(tuple(in_shapes), contraction, tuple(out_shape) if out_grouped else None)


def _broadcast_ellipsis(formula: Formula, shapes: list[tuple]) -> tuple:
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for s in shapes:
        for k, size in enumerate(s):
            j = ndim - len(s) + k
            if out[j] == 1:
                out[j] = size
            elif size not in (1, out[j]):
                raise EinshardError(f"the '...' dimensions {shapes} do not broadcast")
    return tuple(out)
