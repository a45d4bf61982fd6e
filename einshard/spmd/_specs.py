"""Pytree specs for ``shard_map``, ``tree_shard`` and ``tree_gather``.

A spec tree is a pytree *prefix* (optree rules, as in ``jax.shard_map``) of
the value tree: a spec at a node applies to every leaf below it; ``None``
passes a subtree through. Spec leaves are strings: one tensor spec
(``"b/dp n c"``) or a conversion (``"b n c -> b/dp n c"``).

This module parses specs, matches them to values (reporting mismatches with
the paths in both trees), and resolves a spec's layout for a local tensor.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import optree

from ..core._split import MISSING, lookup_dim
from ..errors import EinshardError
from ..notation import EllipsisItem, Group, expand, freeze_families
from ..plan.local import expand_sizes, freeze_sizes
from ..plan.resolve import ELLIPSIS_PREFIX, resolve
from ..runtime.vma import spec_mask

__all__ = ["Spec", "parse_spec", "spec_tree", "match", "leaf_path", "resolve_spec", "layout_entries"]


class Spec:
    """One parsed spec leaf.

    ``inner`` is the layout the body sees, ``outer`` the layout outside
    (arriving for an input, returned for an output); they differ only for a
    conversion, whose ``text`` is the formula to run (outer -> inner on entry,
    inner -> outer on exit).
    """

    __slots__ = ("text", "inner", "outer", "conversion", "inner_spec", "outer_spec", "_masks")

    def __init__(self, text, inner, outer, conversion, inner_spec, outer_spec):
        self.text, self.inner, self.outer, self.conversion = text, inner, outer, conversion
        self.inner_spec, self.outer_spec = inner_spec, outer_spec
        self._masks: dict = {}

    def inner_mask(self, info) -> int:
        """Bit mask (over ``info``'s mesh) of the dims the inner layout shards or is partial over."""
        m = self._masks.get(info)
        if m is None:
            m = spec_mask(info, self.inner_spec)
            self._masks[info] = m
        return m

    def __repr__(self) -> str:
        return f"Spec({self.text!r})"


def parse_spec(text, families, where: str, side: str) -> Spec:
    """Parse one spec leaf; ``side`` is ``"in"`` or ``"out"`` (which end of a conversion the body sees)."""
    if not isinstance(text, str):
        raise EinshardError(f"{where}: a spec must be a string or None, got {type(text).__name__} {text!r}")
    try:
        parsed = expand(text, families)
    except ValueError as err:
        raise EinshardError(f"{where}: {err}") from None
    if len(parsed.inputs) != 1:
        raise EinshardError(f"{where}: {text!r} must describe one tensor (a spec or 'layout -> layout'), not a formula")
    for t in parsed.tensors:
        if t.annotations:
            raise EinshardError(f"{where}: {text!r}: annotations are not allowed in specs")
    first = parsed.inputs[0]
    if parsed.output is None:
        return Spec(text, text, text, False, first, first)
    second = parsed.output
    if side == "in":
        outer, inner = first, second
    else:
        inner, outer = first, second
    return Spec(text, str(inner), str(outer), True, inner, outer)


def _is_spec_leaf(x) -> bool:
    return x is None or isinstance(x, str)


def spec_tree(specs, families, name: str, side: str):
    """``(parsed spec leaves (None for pass-through), spec treedef)``; parses every leaf once."""
    leaves, treedef = optree.tree_flatten(specs, is_leaf=_is_spec_leaf, none_is_leaf=True)
    paths = treedef.paths()
    parsed = []
    for leaf, path in zip(leaves, paths):
        where = f"{name}{format_path(path)}"
        parsed.append(None if leaf is None else parse_spec(leaf, families, where, side))
    return parsed, treedef


def format_path(path) -> str:
    return "".join(f"[{e!r}]" for e in path)


def leaf_path(tree, index: int) -> str:
    """The key path of leaf ``index`` of ``tree`` (for error messages): ``[0]['w']``, ``[1].first``."""
    try:
        accessors = optree.tree_accessors(tree, none_is_leaf=True)
        return accessors[index].codify("") if index < len(accessors) else f"[leaf {index}]"
    except Exception:  # an optree without accessors, or a node type it cannot describe
        paths = optree.tree_paths(tree, none_is_leaf=True)
        return format_path(paths[index]) if index < len(paths) else f"[leaf {index}]"


def match(spec_leaves, spec_def, tree, spec_name: str, tree_name: str, specs_obj):
    """Per leaf of ``tree`` (flattened, None is a leaf): its Spec or ``None``."""
    try:
        subtrees = spec_def.flatten_up_to(tree)
    except (ValueError, TypeError):
        raise EinshardError(mismatch_message(specs_obj, tree, spec_name, tree_name)) from None
    del subtrees  # the structure matches; pair leaves by path (a dict of specs and an OrderedDict
    # state_dict flatten their keys in different orders): each leaf takes the spec at the longest
    # prefix of its path
    at = {tuple(path): k for k, path in enumerate(optree.treespec_paths(spec_def))}
    out = []
    for path in optree.tree_paths(tree, none_is_leaf=True):
        for n in range(len(path), -1, -1):
            k = at.get(tuple(path[:n]))
            if k is not None:
                out.append(spec_leaves[k])
                break
    return out


# -- mismatch messages -------------------------------------------------------------------


def _describe(x) -> str:
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return f"namedtuple {type(x).__name__} with fields {list(x._fields)}"
    if isinstance(x, Mapping):
        return f"{type(x).__name__} with keys [{', '.join(sorted(map(repr, x)))}]"
    if isinstance(x, (list, tuple)):
        return f"{type(x).__name__} of length {len(x)}"
    if x is None:
        return "None"
    return f"{type(x).__name__} (a leaf)"


def _entry(node, entry) -> str:
    if isinstance(node, tuple) and hasattr(node, "_fields") and isinstance(entry, int):
        return f".{node._fields[entry]}"
    return f"[{entry!r}]"


def _find(spec, tree, spath: str, tpath: str):
    """The first place where ``spec`` is not a prefix of ``tree``: (spec path, tree path, detail, nodes)."""
    if _is_spec_leaf(spec):
        return None
    try:
        s = optree.tree_flatten_one_level(spec, is_leaf=_is_spec_leaf, none_is_leaf=True)
    except ValueError:
        detail = f"of type {type(spec).__name__}, which is neither a spec (a string or None) nor a container"
        return spath, tpath, detail, spec, tree
    try:
        t = optree.tree_flatten_one_level(tree, none_is_leaf=True)
    except ValueError:
        t = None
    if t is None or type(spec) is not type(tree):
        return spath, tpath, None, spec, tree
    if isinstance(spec, Mapping):
        if sorted(map(repr, spec)) != sorted(map(repr, tree)):
            return spath, tpath, None, spec, tree
    elif len(s.children) != len(t.children):
        return spath, tpath, None, spec, tree
    tmap = dict(zip(t.entries, t.children))
    for entry, child in zip(s.entries, s.children):
        if entry not in tmap:
            return spath, tpath, None, spec, tree
        found = _find(child, tmap[entry], spath + _entry(spec, entry), tpath + _entry(tree, entry))
        if found is not None:
            return found
    return None


def mismatch_message(specs, tree, spec_name: str, tree_name: str) -> str:
    """Why ``specs`` is not a pytree prefix of ``tree``, naming the paths in both trees."""
    found = _find(specs, tree, "", "")
    if found is None:
        errors = list(optree.prefix_errors(specs, tree, is_leaf=_is_spec_leaf, none_is_leaf=True))
        detail = str(errors[0](spec_name)) if errors else "the structures differ"
        return f"{spec_name} is not a pytree prefix of {tree_name}: {detail}"
    spath, tpath, detail, for_spec, for_tree = found
    if detail is not None:
        return f"{spec_name}{spath} is {detail}"
    msg = (
        f"{spec_name} is not a pytree prefix of {tree_name}: {spec_name}{spath} is a {_describe(for_spec)} "
        f"but {tree_name}{tpath} is a {_describe(for_tree)}"
    )
    if isinstance(for_spec, Mapping) and isinstance(for_tree, Mapping):
        a, b = set(map(repr, for_spec)), set(map(repr, for_tree))
        if a - b:
            msg += f"; keys only in {spec_name}: [{', '.join(sorted(a - b))}]"
        if b - a:
            msg += f"; keys only in {tree_name}: [{', '.join(sorted(b - a))}]"
    return msg


def strip_spec(spec) -> str:
    """The spec with every mesh annotation removed (the whole tensor)."""
    parts = []
    for item in spec.items:
        if isinstance(item, EllipsisItem):
            parts.append("...")
        elif isinstance(item, Group):
            parts.append("(" + " ".join(a.name for a in item.axes) + ")")
        else:
            parts.append(item.name)
    return " ".join(parts)


def maybe_dtensor(x) -> bool:
    """``isinstance(x, DTensor)`` without importing ``torch.distributed.tensor`` (slow) when unused."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(x, mod.DTensor)


# -- layouts ----------------------------------------------------------------------------------


def sizes_for(parsed, sizes, families):
    """The entries of ``sizes`` that concern ``parsed`` (family keys expanded)."""
    if not sizes:
        return {}
    names = {a.name for t in parsed.tensors for a in t.axes}
    fams = dict(freeze_families(families))
    picked = {}
    for k, v in sizes.items():
        if k in names:
            picked[k] = v
        elif k in fams and any(m.split("/")[0].strip() in names for m in fams[k]):
            picked[k] = v
    return expand_sizes(parsed, freeze_sizes(picked), freeze_families(families))


def sizes_subset(parsed, sizes, families):
    """``sizes=`` restricted to the axes of ``parsed`` (as a dict to pass to es.einshard)."""
    if not sizes:
        return None
    names = {a.name for t in parsed.tensors for a in t.axes}
    fams = dict(freeze_families(families))
    picked = {k: v for k, v in sizes.items() if k in names or (k in fams and any(
        m.split("/")[0].strip() in names for m in fams[k]))}
    return picked or None


def shapes_subset(parsed, shapes):
    """``shapes=`` without the per-axis entries for axes ``parsed`` does not name.

    ``shard_map`` and the tree helpers share one ``shapes=`` across many specs;
    each formula gets only its own entries (einshard rejects per-axis entries
    for axes its formula lacks, to catch typos).
    """
    if not isinstance(shapes, Mapping):
        return shapes
    names = {a.name for t in parsed.tensors for a in t.axes}
    out = {}
    for key, value in shapes.items():
        if isinstance(value, Mapping):
            value = {a: v for a, v in value.items() if a in names}
            if not value:
                continue
        out[key] = value
    return out or None


def resolve_spec(formula_text: str, local_shape, mesh, shapes, sizes, families, ambient=None):
    """``resolve`` a unary formula (``"S -> S"`` or a conversion) for one local shape."""
    parsed = expand(formula_text, families)
    return resolve(parsed, [tuple(local_shape)], mesh, shapes=shapes, sizes=sizes_for(parsed, sizes, families),
                   ambient=ambient, axes=None)


def layout_entries(layout):
    """``{(dims, axis): splits}`` for every sharded named axis of ``layout``."""
    out = {}
    for axis, dims, splits in zip(layout.axes, layout.shard, layout.splits):
        if dims and not axis.startswith(ELLIPSIS_PREFIX):
            out[(tuple(dims), axis)] = tuple(splits)
    return out


def explicit_entries(layout, shapes, mesh):
    """The entries of :func:`layout_entries` that ``shapes=`` gives explicitly (known on every rank)."""
    if shapes is None:
        return {}
    out = {}
    entries = layout_entries(layout)
    labels = {mesh.label(dims) for dims, _ in entries}
    for (dims, axis), splits in entries.items():
        if isinstance(shapes, Mapping):
            entry = lookup_dim(shapes, mesh.label(dims))
            if entry is MISSING:
                continue
            if isinstance(entry, Mapping) and axis not in entry:
                continue
        elif len(labels) != 1:
            continue
        out[(dims, axis)] = splits
    return out
