"""The collective entries (einshard/comm/entries/): one definition per collective.

- Every entry's eager transport (in place on a process group) and traced
  transport (functional collectives) give the same results, on the same
  checked arguments, on gloo ranks: groups of 1, 2, 4 and 8 ranks, even,
  uneven and empty blocks, block orders that are not the group's rank order,
  complex and integer tensors; and both agree with the whole-tensor result.
- The raw, traced, autograd and named forms, the planner's step kind and the
  variance rule all come from the entry: a new collective is one new module in
  ``einshard/comm/entries/`` (plus its test and its doc), shown by adding one
  to a copy of the package.
"""

from __future__ import annotations

import ast
import inspect
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import einshard as es
from einshard.comm import _traced_collectives as TC
from einshard.comm import collectives as C
from einshard.comm import mappings as M
from einshard.comm.collective import Collective
from einshard.comm.entries import COLLECTIVES
from einshard.comm.primitives import PRIMITIVES
from einshard.core._split import compute_split_shapes
from einshard.spmd import named
from dist_reference import mesh_groups

ROOT = Path(__file__).resolve().parents[2]
ENTRIES = ROOT / "einshard" / "comm" / "entries"


def _randn(shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        return torch.complex(torch.randn(shape, generator=g, dtype=torch.float64),
                             torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    return (x * 10).to(dtype) if dtype == torch.int64 else x.to(dtype)


def _block_cases(P: int):
    """(label, per-block sizes, order): even, uneven and empty blocks, in rank order and reversed."""
    cases = [("even", [2] * P), ("uneven", compute_split_shapes(3 * P - 1, P))]
    if P > 1:
        cases.append(("empty-last", [3] * (P - 1) + [0]))
    orders = [None] + ([list(range(P))[::-1]] if P > 1 else [])
    return [(f"{label} order={order}", shapes, order) for label, shapes in cases for order in orders]


def _mine(r, order):
    return r if order is None else order.index(r)


# Per entry: (group, P, r) -> [(label, raw arguments, whole-tensor result or None)]. A new entry adds its
# cases here (test_every_entry_is_paired fails until it does).


def _all_reduce(group, P, r):
    out = []
    for dtype in (torch.float64, torch.complex128, torch.int64):
        xs = [_randn((3, 4), 10 + q, dtype) for q in range(P)]
        out.append((f"sum {dtype}", (xs[r], group, "sum"), sum(xs)))
    xs = [_randn((5,), 20 + q) for q in range(P)]
    out.append(("max", (xs[r], group, "max"), torch.stack(xs).amax(0)))
    out.append(("min", (xs[r], group, "min"), torch.stack(xs).amin(0)))
    return out


def _broadcast(group, P, r):
    xs = [_randn((2, 3), 30 + q, torch.complex128) for q in range(P)]
    return [(f"src={src}", (xs[r], group, src), xs[src]) for src in {0, P - 1}]


def _split(group, P, r):
    out = []
    for label, shapes, order in _block_cases(P):
        full = _randn((3, sum(shapes)), 40)
        me = _mine(r, order)
        out.append((label, (full, group, 1, shapes, order), full[:, sum(shapes[:me]) : sum(shapes[: me + 1])]))
    return out


def _all_gather(group, P, r):
    out = []
    for label, shapes, order in _block_cases(P):
        for dtype in (torch.float64, torch.complex128):
            full = _randn((sum(shapes), 2, 3), 50, dtype)
            me = _mine(r, order)
            block = full[sum(shapes[:me]) : sum(shapes[: me + 1])]
            out.append((f"{label} {dtype}", (block, group, 0, shapes, order), full))
    return out


def _reduce_scatter(group, P, r):
    out = []
    for label, shapes, order in _block_cases(P):
        xs = [_randn((2, sum(shapes)), 60 + q) for q in range(P)]
        me = _mine(r, order)
        whole = sum(xs)[:, sum(shapes[:me]) : sum(shapes[: me + 1])]
        out.append((label, (xs[r], group, 1, shapes, order), whole))
    return out


def _all_to_all(group, P, r):
    out = []
    for label, shapes, order in _block_cases(P):
        dst = compute_split_shapes(2 * P + 1, P)
        full = _randn((2, sum(shapes), 2 * P + 1), 70, torch.complex128)
        me = _mine(r, order)
        mine = full[:, sum(shapes[:me]) : sum(shapes[: me + 1])]
        want = full[..., sum(dst[:me]) : sum(dst[: me + 1])]
        out.append((label, (mine, group, 1, 2, shapes, dst, order), want))
    return out


def _all_to_all_v(group, P, r):
    chunks = [_randn((r + j,), 80 + 10 * r + j) for j in range(P)]  # rank r sends r + j elements to j
    want = [_randn((q + r,), 80 + 10 * q + r) for q in range(P)]
    return [("sizes r + j", (chunks, [q + r for q in range(P)], group), want)]


def _ppermute(group, P, r):
    x = _randn((2, 3), 90 + r)
    ring = [(i, (i + 1) % P) for i in range(P)]
    some = [(0, P - 1)] if P > 1 else [(0, 0)]  # one pair: every other rank receives zeros
    got_ring = _randn((2, 3), 90 + (r - 1) % P)
    got_some = _randn((2, 3), 90) if r == some[0][1] else torch.zeros(2, 3, dtype=torch.float64)
    return [("ring", (x, group, ring), got_ring), ("one pair", (x, group, some), got_some)]


def _pvary(group, P, r):
    x = _randn((4,), 100 + r)
    return [("identity", (x, group), x)]


CASES = {
    "all_reduce": _all_reduce,
    "broadcast": _broadcast,
    "split": _split,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
    "all_to_all_v": _all_to_all_v,
    "ppermute": _ppermute,
    "pvary": _pvary,
}


def test_every_entry_is_paired():
    """Every entry with transports of its own has pairing cases; one that runs on another's transport shares it."""
    own = {name for name, e in COLLECTIVES.items() if not e.transport}
    assert own == set(CASES)
    for name, entry in COLLECTIVES.items():
        if entry.transport:
            carrier = COLLECTIVES[entry.transport]
            assert (entry.check, entry.eager, entry.traced) == (carrier.check, carrier.eager, carrier.traced), name


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.ranks(8)
def test_eager_and_traced_transports_agree(mesh_8, mesh_2x4, mesh_2x2x2):
    failures = []
    for gname, group in mesh_groups(mesh_8, mesh_2x4, mesh_2x2x2):
        P, r = C.group_size(group), C.group_rank(group)
        for name, cases in CASES.items():
            entry = COLLECTIVES[name]
            for label, args, whole in cases(group, P, r):
                what = f"[{gname}] {name} {label}"
                targs = entry.check(*args)
                eager = entry.eager(*targs)
                traced = entry.traced(*targs)
                if isinstance(traced, list):
                    traced = [torch.as_tensor(t).clone() for t in traced]
                else:
                    traced = traced.clone()  # waits for a functional collective
                if not _same(eager, traced):
                    failures.append(f"{what}: eager and traced transports differ")
                if whole is not None and not _same(eager, whole):
                    failures.append(f"{what}: the eager transport differs from the whole-tensor result")
                by_name = inspect.signature(entry.check).bind(*args).arguments
                if not _same(entry.raw(**by_name), eager):  # (the raw form: check, then the eager transport)
                    failures.append(f"{what}: the raw form differs from its eager transport")
    assert not failures, f"rank {dist.get_rank()}:\n" + "\n".join(failures)


def test_forms_come_from_the_entries():
    for name, entry in COLLECTIVES.items():
        assert isinstance(entry, Collective) and PRIMITIVES[name] is entry
        if not entry.transport:
            assert getattr(C, name) is entry.raw and name in C.__all__
            assert getattr(TC, name) is entry.traced
        if entry.named:
            assert getattr(named, entry.named).__wrapped__.__name__ == entry.named
            assert entry.named in named.__all__
        if entry.adjoint:
            assert COLLECTIVES[entry.adjoint].adjoint, f"{name}'s adjoint {entry.adjoint} has no autograd form"
    # the adjoints pair up as each other's transposes
    pairs = {(n, e.adjoint) for n, e in COLLECTIVES.items() if e.adjoint}
    assert pairs == {("all_reduce", "pvary"), ("pvary", "all_reduce"), ("broadcast", "all_reduce"),
                     ("all_gather", "split"), ("split", "all_gather"), ("reduce_scatter", "all_gather_varying"),
                     ("all_gather_varying", "reduce_scatter"), ("all_to_all", "all_to_all"), ("ppermute", "ppermute")}
    # the public names stay: torch-einshard 1.0's mappings and helpers, the named forms
    for public in ("allreduce_forward_identity_backward", "identity_forward_allreduce_backward",
                   "broadcast_forward_allreduce_backward", "allgather_forward_split_backward",
                   "split_forward_allgather_backward", "reducescatter_forward_allgather_backward",
                   "allgather_forward_reducescatter_backward", "alltoall_repartition", "ppermute"):
        assert callable(getattr(M, public)) and public in M.__all__
    for public in ("all_gather", "psum_scatter", "all_to_all", "ppermute"):
        assert getattr(es.spmd, public) is getattr(named, public)
    assert es.comm.helpers.ppermute is C.ppermute is COLLECTIVES["ppermute"].raw


def _named_in(path: Path) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments)."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return out


# Still written by hand outside the entries: the named reductions over pytrees (psum, pmean, pmax, pmin:
# all_reduce's named forms; pmax/pmin with their own non-linear backward) and the named pvary (which defers a
# parameter's gradient sum and pvary-s tracked values in place). This list may only shrink.
_NOT_YET_ENTRIES = {"spmd/named.py": {"psum", "pmean", "pmax", "pmin", "pvary"}}
_JAX_NAMES = {"psum", "pmean", "pmax", "pmin", "psum_scatter"}


def test_the_views_define_no_collective():
    """The raw, traced, autograd and named modules define no collective by name: they are views on the entries
    (the autograd module keeps torch-einshard 1.0's function names, which name pairs, not collectives)."""
    views = ["comm/collectives.py", "comm/_traced_collectives.py", "comm/mappings.py", "comm/primitives.py",
             "comm/helpers.py", "spmd/named.py"]
    names = set(COLLECTIVES) | {e.named for e in COLLECTIVES.values() if e.named} | _JAX_NAMES
    for view in views:
        defined = _named_in(ROOT / "einshard" / view) & names
        if view == "comm/mappings.py":
            defined -= {"ppermute"}  # 1.0's es.comm.mappings.ppermute(x, group, perm, *, recv_shape, order)
        if view == "spmd/named.py":
            assert defined >= _NOT_YET_ENTRIES[view], "an entry now defines one of them: shrink the list"
            defined -= _NOT_YET_ENTRIES[view]
        assert not defined, f"einshard/{view} defines {sorted(defined)}; define them in einshard/comm/entries/"


_NEW_ENTRY = '''
"""``preverse``: group rank ``r``'s value on group rank ``P - 1 - r``; its own adjoint (a probe)."""

from __future__ import annotations

from ..arguments import group_size
from ..collective import Collective, register
from ..primitives import varying
from .ppermute import PPERMUTE


def preverse(x, group=None):
    """Group rank ``r``'s ``x`` on group rank ``P - 1 - r``."""
    n = group_size(group)
    return x.detach(), group, [(i, n - 1 - i) for i in range(n)], tuple(x.shape)


def _named(x, axes):
    """Reverse the ranks of ``dim_name``."""
    return PREVERSE.autograd, (x, axes.group)


PREVERSE = register(Collective(
    name="preverse",
    vary=varying,
    check=preverse,
    eager=PPERMUTE.eager,
    traced=PPERMUTE.traced,
    forward=lambda x, group: PREVERSE.raw(x, group),
    adjoint="preverse",
    named="preverse",
    bind=_named,
))
'''

_PROBE = '''
import inspect, os, torch, torch.distributed as dist
import einshard as es
from einshard.comm import _traced_collectives as TC, collectives as C
from einshard.comm.primitives import PRIMITIVES
from einshard.spmd import named
assert es.__file__.startswith(os.environ["COPY"]), es.__file__
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
x = torch.arange(3.0, requires_grad=True)
assert torch.equal(C.preverse(x, dist.group.WORLD), x.detach())  # raw form
assert torch.equal(TC.preverse(x.detach(), dist.group.WORLD, [(0, 0)], (3,)), x.detach())  # traced form
y = PRIMITIVES["preverse"].autograd(x, dist.group.WORLD)  # autograd form
y.backward(torch.ones(3))
assert torch.equal(x.grad, torch.ones(3))
assert "preverse" in named.__all__ and str(inspect.signature(named.preverse)) == "(x, dim_name, *, mesh=None)"
assert PRIMITIVES["preverse"].vary(0b01, 0b10) == 0b11
print("ok")
'''


def test_a_new_collective_is_one_module(tmp_path):
    """Adding ``preverse`` to a copy of the package is one new file in ``comm/entries/``: its raw, traced,
    autograd and named forms and its variance rule follow."""
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "einshard", copy / "einshard", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "einshard" / "comm" / "entries" / "preverse.py").write_text(textwrap.dedent(_NEW_ENTRY))
    env = dict(os.environ, PYTHONPATH=str(copy), COPY=str(copy))
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=copy, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    # and the one file is all that differs from the package
    added = {p.relative_to(copy / "einshard") for p in (copy / "einshard").rglob("*.py")}
    assert added - {p.relative_to(ROOT / "einshard") for p in (ROOT / "einshard").rglob("*.py")} == {
        Path("comm/entries/preverse.py")}
