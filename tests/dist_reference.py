"""Check distributed einshard against the same formula on whole tensors.

Runs inside the ranks of the test harness. Every operand is generated whole
(the same on every rank), cut into this rank's block with
``einshard.testing.local_block`` (an independent reading of the spec), and
the distributed result and gradients are compared with the local formula
(mesh annotations stripped) on the whole tensors.
"""

from __future__ import annotations

import itertools
import math
import re

import torch
import torch.distributed as dist

import einshard as es
from einshard.notation import expand
from einshard.testing.reference import local_block

_MESH_ANNOTATION = re.compile(r"//\s*(\([^)]*\)|[\w-]+)|/\s*[\w-]+")


def strip_mesh(formula: str) -> str:
    """The local formula: every ``/dim`` and ``// dims`` removed."""
    return _MESH_ANNOTATION.sub("", formula)


def strip_families(families):
    if not families:
        return families
    return {k: tuple(strip_mesh(m) for m in v) for k, v in families.items()}


def _generator(*key) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(hash(key) % (2**31))
    return g


def _partial_dims(mesh, spec) -> tuple[str, ...]:
    dims = set()
    for p in spec.partial:
        dims.update(mesh.dims(p))
    return mesh.sort(dims) if hasattr(mesh, "sort") else tuple(sorted(dims, key=mesh.names.index))


def _coords_of(mesh, dims):
    return tuple(mesh.coordinate[mesh.names.index(d)] for d in dims)


def default_shapes(mesh, parsed, global_shapes, sizes=None):
    """``{label: {axis: compute_split_shapes(size, n)}}`` for every sharded input axis."""
    from einshard.core._split import compute_split_shapes
    from einshard.notation import Group

    table: dict = {}
    sizes = dict(sizes or {})
    for spec, gshape in zip(parsed.inputs, global_shapes):
        named = [i for i in spec.items if type(i).__name__ != "EllipsisItem"]
        n_ell = len(gshape) - len(named)
        pos = 0
        for item in spec.items:
            if type(item).__name__ == "EllipsisItem":
                pos += n_ell
                continue
            members = item.axes if isinstance(item, Group) else (item,)
            known = [sizes.get(a.name) for a in members]
            if None in known:
                rest = math.prod(k for k in known if k is not None)
                known[known.index(None)] = gshape[pos] // rest
            for a, n in zip(members, known):
                if a.mesh:
                    dims = mesh.dims(a.mesh)
                    table.setdefault(mesh.label(dims), {})[a.name] = compute_split_shapes(n, mesh.size(dims))
            pos += 1
    return table or None


def check_formula(mesh, formula, global_shapes, shapes="auto", sizes=None, families=None, seed=0,
                  dtype=torch.float64, optimize=None, atol=1e-9, grad=True):
    """Run ``formula`` distributed and compare values and gradients; returns a report dict.

    ``shapes="auto"`` passes explicit split shapes for every sharded input axis.
    """
    mesh = es.wrap_mesh(mesh)
    parsed = expand(formula, families)
    if shapes == "auto":
        shapes = default_shapes(mesh, parsed, global_shapes, sizes)
    local_formula = strip_mesh(formula)
    local_families = strip_families(families)
    inputs_whole, inputs_local = [], []
    for k, (spec, gshape) in enumerate(zip(parsed.inputs, global_shapes)):
        spec_text = str(spec)
        pdims = _partial_dims(mesh, spec)
        if pdims:
            groups = list(itertools.product(*(range(mesh.shape[mesh.names.index(d)]) for d in pdims)))
            contributions = {c: torch.randn(gshape, generator=_generator(seed, k, c), dtype=dtype) for c in groups}
            whole = sum(contributions.values())
            mine = contributions[_coords_of(mesh, pdims)]
        else:
            whole = torch.randn(gshape, generator=_generator(seed, k), dtype=dtype)
            mine = whole
        inputs_whole.append(whole.requires_grad_(grad))
        local = local_block(mine, spec_text, mesh, shapes=shapes, sizes=sizes, families=families)
        inputs_local.append(local.detach().clone().requires_grad_(grad))
    expected = es.einshard(local_formula, *inputs_whole, sizes=sizes, families=local_families)
    got = es.einshard(formula, *inputs_local, mesh=mesh, shapes=shapes, sizes=sizes, families=families,
                      optimize=optimize)
    out = parsed.output
    out_text = str(out)
    pdims = _partial_dims(mesh, out)
    in_axes = {a.name for t in parsed.inputs for a in t.axes}
    # documented rule: `// d` on the output carries contributions when the formula sums over an
    # axis or an input is partial over d; otherwise it marks the full value varying (pvary)
    sums = bool(in_axes - {a.name for a in out.axes}) or (
        any(t.has_ellipsis for t in parsed.inputs) and not out.has_ellipsis  # '...' summed away
    )
    summed = [d for d in pdims if sums or any(d in _partial_dims(mesh, t) for t in parsed.inputs)]
    varying = [d for d in pdims if d not in summed]
    value = got.detach().clone(memory_format=torch.contiguous_format)
    if summed:
        dist.all_reduce(value, group=mesh.group(tuple(summed)))
    want = local_block(expected.detach(), out_text, mesh, shapes=shapes, sizes=sizes, families=families)
    report = {"formula": formula, "rank": dist.get_rank()}
    assert value.shape == want.shape, f"{formula}: local shape {tuple(value.shape)} != expected {tuple(want.shape)}"
    report["value_err"] = (value - want).abs().max().item() if value.numel() else 0.0
    if grad:
        cot_whole = torch.randn(expected.shape, generator=_generator(seed, "cot"), dtype=dtype)
        cot_local = local_block(cot_whole, out_text, mesh, shapes=shapes, sizes=sizes, families=families)
        got.backward(cot_local)
        expected.backward(cot_whole)
        scale = math.prod(mesh.size(d) for d in varying) if varying else 1
        errs = []
        for k, (spec, whole, local) in enumerate(zip(parsed.inputs, inputs_whole, inputs_local)):
            g_want = local_block(whole.grad * scale, str(spec), mesh, shapes=shapes, sizes=sizes, families=families)
            g_got = local.grad if local.grad is not None else torch.zeros_like(local)
            assert g_got.shape == g_want.shape, f"{formula}: grad {k} shape {tuple(g_got.shape)} != {tuple(g_want.shape)}"
            errs.append((g_got - g_want).abs().max().item() if g_got.numel() else 0.0)
        report["grad_err"] = max(errs) if errs else 0.0
    # every rank learns whether any rank failed, so no rank is left waiting in the next case
    worst = torch.tensor([report["value_err"], report.get("grad_err", 0.0)], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    report["worst_value_err"], report["worst_grad_err"] = worst.tolist()
    bad = report["worst_value_err"] > atol or report["worst_grad_err"] > atol
    assert not bad, f"{formula} (shapes={shapes}, global {global_shapes}): {report}"
    return report


def check_many(mesh, cases):
    """Run ``check_formula`` for each case dict; returns the reports (raises on the first failure)."""
    return [check_formula(mesh, **case) for case in cases]


# -- random layouts (drawn in the pytest process, run on the ranks) ---------------

MESHES = {
    "8": ((8,), ("tp",)),
    "2x4": ((2, 4), ("dp", "tp")),
    "2x2x2": ((2, 2, 2), ("dp", "sp", "tp")),
}


def render(axes, choice, names):
    """A tensor spec from per-mesh-dimension choices: ("S", axis), ("P",) or ("R",)."""
    parts = []
    for a in axes:
        dims = [d for d, c in zip(names, choice) if c == ("S", a)]
        parts.append(f"{a}/{'-'.join(dims)}" if dims else a)
    partial = [d for d, c in zip(names, choice) if c == ("P",)]
    text = " ".join(parts)
    if partial:
        text += " // " + (partial[0] if len(partial) == 1 else "(" + ", ".join(partial) + ")")
    return text


def composition(draw_int, total, parts):
    """A random split of ``total`` into ``parts`` non-negative sizes."""
    cuts = sorted(draw_int(0, total) for _ in range(parts - 1))
    bounds = [0] + cuts + [total]
    return [bounds[k + 1] - bounds[k] for k in range(parts)]


def mesh_groups(mesh_8, mesh_2x4, mesh_2x2x2):
    """(name, process group) pairs of sizes 1, 2, 4 and 8, atomic and compound (inside the ranks)."""
    from einshard.testing import make_mesh

    one = es.wrap_mesh(make_mesh((8, 1), ("dp", "one")))
    m24, m222 = es.wrap_mesh(mesh_2x4), es.wrap_mesh(mesh_2x2x2)
    return [
        ("8x1:one (size 1)", one.group("one")),
        ("2x4:dp (size 2)", m24.group("dp")),
        ("2x4:tp (size 4)", m24.group("tp")),
        ("8:tp (size 8)", es.wrap_mesh(mesh_8).group("tp")),
        ("2x4:dp-tp (size 8)", m24.group("dp-tp")),
        ("2x2x2:tp-dp (size 4)", m222.group("tp-dp")),
        ("2x2x2:sp-tp (size 4)", m222.group("sp-tp")),
    ]
