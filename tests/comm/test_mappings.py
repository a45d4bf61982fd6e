"""Adjoint, value, double-backward and torch.func tests of einshard.comm.mappings.

Adjoint test: ``<A x, y> == <x, Aᵀ y>`` where ``Aᵀ y`` is what autograd computes
(``torch.autograd.grad(A(x), x, y)``), with each layout's inner product:

- replicated: one copy (the data are the same on every rank; we check it);
- per-rank and sharded: the sum over the group's ranks of the local products;
- "src": the copy held by rank ``src`` only (broadcast's domain).

The local products of every case are summed over each group with a single
all-reduce at the end, so a group costs a few collectives beyond the ones
under test.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from einshard.comm import collectives as C
from einshard.comm import mappings as M
from einshard.core._split import compute_split_shapes
from einshard.comm.mesh import wrap_mesh
from dist_reference import mesh_groups

REPL, RANK, SHARD, SRC = "replicated", "per-rank", "sharded", "src"


def _shape_cases(P: int):
    """(name, shapes or None, dim) cases."""
    cases = [("even", [2] * P, 1), ("uneven", compute_split_shapes(3 * P - 1, P) if P > 1 else [3], 0)]
    if P > 1:
        cases.append(("empty", [3] * (P - 1) + [0], -1))
    cases.append(("default", None, 1))
    return cases


def _randn(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64)


def _dot(a, b) -> torch.Tensor:
    return (a.detach() * b.detach()).sum()


class _Adjoint:
    """Collects the local inner-product terms of every case of one group."""

    def __init__(self, gname, group):
        self.gname, self.group = gname, group
        self.P, self.r = C.group_size(group), C.group_rank(group)
        self.names: list[str] = []
        self.lhs: list[torch.Tensor] = []
        self.rhs: list[torch.Tensor] = []
        self.repl: list[tuple[str, torch.Tensor]] = []  # must be equal on every rank
        self.failures: list[str] = []

    def _term(self, a, b, kind, src, what):
        d = _dot(a, b)
        if kind == REPL:
            self.repl.append((what, d))
            return d if self.r == 0 else torch.zeros((), dtype=d.dtype)
        if kind == SRC:
            return d if self.r == src else torch.zeros((), dtype=d.dtype)
        return d

    def check(self, name, fn, x, y, x_kind, y_kind, want=None, src=0):
        """``fn`` maps ``x`` (layout ``x_kind``) to a value of layout ``y_kind``; ``y`` is a cotangent."""
        case = f"[{self.gname}] {name}"
        x = x.detach().clone().requires_grad_(True)
        out = fn(x)
        if out.shape != y.shape:
            self.failures.append(f"{case}: output shape {tuple(out.shape)}, want {tuple(y.shape)}")
            return
        if want is not None and not torch.allclose(out, want, atol=1e-12, rtol=1e-10):
            self.failures.append(f"{case}: forward value differs from the whole-tensor reference")
        (gx,) = torch.autograd.grad(out, x, y)
        if gx.shape != x.shape:
            self.failures.append(f"{case}: gradient shape {tuple(gx.shape)}, want {tuple(x.shape)}")
            return
        self.names.append(case)
        self.lhs.append(self._term(out, y, y_kind, src, f"{case} <Ax, y>"))
        self.rhs.append(self._term(x, gx, x_kind, src, f"{case} <x, A^T y>"))

    def finish(self) -> list[str]:
        if self.names:
            terms = torch.stack(self.lhs + self.rhs)
            total = C.all_reduce(terms, self.group)
            n = len(self.names)
            for i, case in enumerate(self.names):
                a, b = total[i], total[n + i]
                if not torch.allclose(a, b, atol=1e-10, rtol=1e-10):
                    self.failures.append(f"{case}: <Ax, y> = {a.item():.12g} but <x, A^T y> = {b.item():.12g}")
        if self.repl:
            vals = torch.stack([d for _, d in self.repl])
            hi = C.all_reduce(vals, self.group, op="max")
            lo = C.all_reduce(vals, self.group, op="min")
            for (what, _), h, l in zip(self.repl, hi, lo):
                if not torch.allclose(h, l, atol=1e-10, rtol=1e-10):
                    self.failures.append(f"{what}: a replicated value differs across the ranks of the group")
        return self.failures


def _adjoint_cases(adj: _Adjoint):
    P, r, group = adj.P, adj.r, adj.group
    base = 1000

    def per_rank(shape, q, salt=0):  # rank q's per-rank data
        return _randn(shape, base + 17 * salt + q + 1)

    def replicated(shape, salt=0):
        return _randn(shape, base + 17 * salt)

    # all-reduce / identity / broadcast
    shape = (3, 4)
    xs = [per_rank(shape, q) for q in range(P)]
    adj.check("allreduce_forward_identity_backward", lambda x: M.allreduce_forward_identity_backward(x, group),
              xs[r], replicated(shape, 1), RANK, REPL, want=sum(xs))
    adj.check("identity_forward_allreduce_backward", lambda x: M.identity_forward_allreduce_backward(x, group),
              replicated(shape, 2), per_rank(shape, r, 3), REPL, RANK, want=replicated(shape, 2))
    for src in sorted({0, P - 1}):
        adj.check(f"broadcast_forward_allreduce_backward src={src}",
                  lambda x: M.broadcast_forward_allreduce_backward(x, group, src),
                  xs[r], per_rank(shape, r, 4), SRC, RANK, want=xs[src], src=src)

    # gather / split / reduce-scatter, with split shapes along various dims
    for cname, shapes, dim in _shape_cases(P):
        sizes = shapes if shapes is not None else compute_split_shapes(2 * P + 1, P)
        T = sum(sizes)
        if shapes is None:  # default shapes: even for the gathers
            even = [2] * P
        full_shape = [2, 3, 2]
        full_shape[dim] = T
        off = sum(sizes[:r])
        block = lambda t: t.narrow(dim, off, sizes[r])  # noqa: E731
        tag = f"{cname} shapes={shapes} dim={dim}"

        full = replicated(full_shape, 5)
        adj.check(f"split_forward_allgather_backward {tag}",
                  lambda x: M.split_forward_allgather_backward(x, group, dim, shapes),
                  full, block(per_rank(full_shape, r, 6)), REPL, SHARD, want=block(full))
        xs_full = [per_rank(full_shape, q, 7) for q in range(P)]
        adj.check(f"reducescatter_forward_allgather_backward {tag}",
                  lambda x: M.reducescatter_forward_allgather_backward(x, group, dim, shapes),
                  xs_full[r], block(per_rank(full_shape, r, 8)), RANK, SHARD, want=block(sum(xs_full)))

        gshapes = shapes if shapes is not None else even
        gfull_shape = list(full_shape)
        gfull_shape[dim] = sum(gshapes)
        gfull = replicated(gfull_shape, 9)
        goff = sum(gshapes[:r])
        gblock = gfull.narrow(dim, goff, gshapes[r])
        adj.check(f"allgather_forward_split_backward {tag}",
                  lambda x: M.allgather_forward_split_backward(x, group, dim, shapes),
                  gblock, replicated(gfull_shape, 10), SHARD, REPL, want=gfull)
        adj.check(f"allgather_forward_reducescatter_backward {tag}",
                  lambda x: M.allgather_forward_reducescatter_backward(x, group, dim, shapes),
                  gblock, per_rank(gfull_shape, r, 11), SHARD, RANK, want=gfull)

    # all-to-all: (src_dim, dst_dim, src_shapes, dst_shapes)
    cases = _shape_cases(P)
    plans = [(0, 1, cases[0][1], cases[1][1]), (2, 0, cases[-2][1], None), (1, -1, None, cases[-2][1])]
    for src_dim, dst_dim, src_shapes, dst_shapes in plans:
        shape = [3, 2, 4]
        ss = src_shapes if src_shapes is not None else [2] * P
        ds = dst_shapes if dst_shapes is not None else compute_split_shapes(2 * P + 1, P)
        shape[src_dim] = sum(ss)
        shape[dst_dim] = sum(ds)
        full = replicated(shape, 12)
        x = full.narrow(src_dim, sum(ss[:r]), ss[r])
        want = full.narrow(dst_dim, sum(ds[:r]), ds[r])
        y = per_rank(want.shape, r, 13)
        adj.check(f"alltoall_repartition {src_dim}->{dst_dim} src_shapes={src_shapes} dst_shapes={dst_shapes}",
                  lambda x: M.alltoall_repartition(x, group, src_dim, dst_dim, src_shapes, dst_shapes),
                  x, y, SHARD, SHARD, want=want)

    # ppermute: a ring, and a single pair (everyone else receives zeros)
    xs = [per_rank((2, 3), q, 14) for q in range(P)]
    ring = [(i, (i + 1) % P) for i in range(P)]
    adj.check("ppermute ring", lambda x: M.ppermute(x, group, ring), xs[r], per_rank((2, 3), r, 15), RANK, RANK,
              want=xs[(r - 1) % P])
    single = [(P - 1, 0)]
    adj.check(f"ppermute {single}", lambda x: M.ppermute(x, group, single), xs[r], per_rank((2, 3), r, 16),
              RANK, RANK, want=xs[P - 1] if r == 0 else torch.zeros(2, 3, dtype=torch.float64))


@pytest.mark.ranks(8)
def test_adjoint_every_mapping(mesh_8, mesh_2x4, mesh_2x2x2):
    failures = []
    for gname, group in mesh_groups(mesh_8, mesh_2x4, mesh_2x2x2):
        adj = _Adjoint(gname, group)
        _adjoint_cases(adj)
        failures += adj.finish()
    assert not failures, f"rank {dist.get_rank()}:\n" + "\n".join(failures)


@pytest.mark.ranks(8)
def test_double_backward(mesh_2x4, mesh_2x2x2):
    """Backward of the backward: for linear A, d/dy <Aᵀ y, z> = A z."""
    failures = []
    for gname, group in [("2x4:tp", wrap_mesh(mesh_2x4).group("tp")),
                         ("2x2x2:dp-sp", wrap_mesh(mesh_2x2x2).group("dp-sp"))]:
        P, r = C.group_size(group), C.group_rank(group)
        shapes = [3] * (P - 1) + [0]
        T = sum(shapes)
        cases = [
            ("allgather_forward_split_backward", lambda t: M.allgather_forward_split_backward(t, group, 1, shapes),
             (2, shapes[r]), (2, T)),
            ("split_forward_allgather_backward", lambda t: M.split_forward_allgather_backward(t, group, 1, shapes),
             (2, T), (2, shapes[r])),
            ("reducescatter_forward_allgather_backward",
             lambda t: M.reducescatter_forward_allgather_backward(t, group, 1, shapes), (2, T), (2, shapes[r])),
            ("allgather_forward_reducescatter_backward",
             lambda t: M.allgather_forward_reducescatter_backward(t, group, 1, shapes), (2, shapes[r]), (2, T)),
            ("identity_forward_allreduce_backward", lambda t: M.identity_forward_allreduce_backward(t, group),
             (2, 3), (2, 3)),
            ("allreduce_forward_identity_backward", lambda t: M.allreduce_forward_identity_backward(t, group),
             (2, 3), (2, 3)),
            ("alltoall_repartition", lambda t: M.alltoall_repartition(t, group, 0, 1, shapes, None),
             (shapes[r], 2 * P), (T, 2)),
            ("ppermute", lambda t: M.ppermute(t, group, [(i, (i + 1) % P) for i in range(P)]), (2, 3), (2, 3)),
        ]
        for name, A, in_shape, out_shape in cases:
            x = _randn(in_shape, 1 + r).requires_grad_(True)
            y = _randn(out_shape, 2 + r).requires_grad_(True)
            z = _randn(in_shape, 3 + r)
            (gx,) = torch.autograd.grad(A(x), x, y, create_graph=True)
            (gy,) = torch.autograd.grad((gx * z).sum(), y)
            want = A(z)
            if not torch.allclose(gy, want, atol=1e-12):
                failures.append(f"[{gname}] {name}: double backward differs from A z")
    assert not failures, f"rank {dist.get_rank()}:\n" + "\n".join(failures)


@pytest.mark.ranks(8)
def test_torch_func_grad_and_vjp(mesh_2x4):
    group = wrap_mesh(mesh_2x4).group("tp")
    P, r = C.group_size(group), C.group_rank(group)
    shapes = [3, 3, 3, 1]

    def loss(w, x):
        # replicated w → per-rank (pvary) → this rank's rows; x sharded rows → gathered
        h = M.split_forward_allgather_backward(M.identity_forward_allreduce_backward(w, group), group, 0, shapes)
        full = M.allgather_forward_reducescatter_backward(x, group, 0, shapes)
        return (h.sum(0) * full.sum(0)).sum() + (h**2).sum()

    w = _randn((10, 3), 7)  # replicated
    x = _randn((shapes[r], 3), 8 + r)  # sharded
    gw, gx = torch.func.grad(loss, argnums=(0, 1))(w, x)
    wr, xr = w.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ew, ex = torch.autograd.grad(loss(wr, xr), (wr, xr))
    assert torch.allclose(gw, ew) and torch.allclose(gx, ex), "torch.func.grad differs from torch.autograd.grad"

    def f(x):
        y = M.allgather_forward_split_backward(x, group, 0, shapes)
        z = M.reducescatter_forward_allgather_backward(y * y, group, 0, shapes).sum(0)  # (3,) on every rank
        return M.ppermute(z, group, [(i, (i + 1) % P) for i in range(P)])

    out, vjp_fn = torch.func.vjp(f, x)
    cot = _randn(out.shape, 20 + r)
    (gx,) = vjp_fn(cot)
    xr = x.clone().requires_grad_(True)
    out_ref = f(xr)
    (ex,) = torch.autograd.grad(out_ref, xr, cot)
    assert torch.allclose(out, out_ref.detach()) and torch.allclose(gx, ex), "torch.func.vjp differs from autograd"

    # alltoall_repartition under torch.func.grad
    xa = _randn((2, 10), 30 + r)
    ga = torch.func.grad(lambda t: (M.alltoall_repartition(t, group, 0, 1, None, shapes) ** 2).sum())(xa)
    assert torch.allclose(ga, 2 * xa), "grad of sum of squares through an all-to-all"
