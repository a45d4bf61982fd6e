"""Value tests of einshard.comm.collectives against whole-tensor references.

Every multi-rank test runs on one pool of 8 gloo ranks; groups of 1, 2, 4 and 8
ranks come from the 2x4, 2x2x2 and 8 meshes (and an 8x1 mesh for size 1).
Checks are collected into a list and asserted at the end, so a wrong value on
one rank does not desynchronise the collectives of the others.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from einshard.comm import checks
from einshard.comm import collectives as C
from einshard.comm import comm_stats
from einshard.core._split import compute_split_shapes
from einshard.comm.mesh import wrap_mesh
from dist_reference import mesh_groups


def _shape_cases(P: int) -> dict[str, list[int]]:
    cases = {"even": [2] * P, "uneven": compute_split_shapes(3 * P - 1, P) if P > 1 else [3]}
    if P > 1:
        cases["empty-last"] = [3] * (P - 1) + [0]  # e.g. [3, 3, 3, 0]
        cases["empty-first"] = [0] + [1] * (P - 2) + [4]
    return cases


def _randn(shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        return torch.complex(torch.randn(shape, generator=g, dtype=torch.float64),
                             torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _noncontig(shape, seed, dtype=torch.float64):
    """A non-contiguous tensor of ``shape`` (a transposed view)."""
    t = _randn(tuple(reversed(shape)), seed, dtype)
    return t.permute(*reversed(range(len(shape))))


def _tol(dtype):
    if dtype in (torch.float32, torch.complex64):
        return {"atol": 1e-5, "rtol": 1e-5}
    return {"atol": 1e-12, "rtol": 1e-10}


class _Checker:
    def __init__(self):
        self.failures: list[str] = []

    def equal(self, got, want, what):
        if got.shape != want.shape or got.dtype != want.dtype:
            self.failures.append(f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}")
        elif not torch.allclose(got, want, **_tol(got.dtype)):
            self.failures.append(f"{what}: values differ (max err {(got - want).abs().max().item():.3g})")

    def true(self, cond, what):
        if not cond:
            self.failures.append(what)

    def done(self):
        assert not self.failures, f"rank {dist.get_rank()}:\n" + "\n".join(self.failures)


@pytest.mark.ranks(8)
def test_gather_scatter_split(mesh_8, mesh_2x4, mesh_2x2x2):
    ck = _Checker()
    for gname, group in mesh_groups(mesh_8, mesh_2x4, mesh_2x2x2):
        P, r = C.group_size(group), C.group_rank(group)
        for cname, shapes in _shape_cases(P).items():
            T = sum(shapes)
            for dim in (1, -1, 0):
                case = f"[{gname}] {cname} shapes={shapes} dim={dim}"
                shape = [4, 3, 2]
                shape[dim] = T
                full = _noncontig(tuple(shape), seed=1)  # same on every rank
                off = sum(shapes[:r])
                block = full.narrow(dim, off, shapes[r])  # non-contiguous
                # split: a view of this rank's block
                ck.equal(C.split(full, group, dim, shapes), block, f"split {case}")
                # all_gather
                got = C.all_gather(block, group, dim, shapes)
                ck.equal(got, full, f"all_gather {case}")
                ck.true(got.is_contiguous(), f"all_gather {case}: result not contiguous")
                # reduce_scatter: rank q contributes (q + 1) * full
                got = C.reduce_scatter(full * (r + 1), group, dim, shapes)
                ck.equal(got, block * (P * (P + 1) / 2), f"reduce_scatter {case}")
                ck.true(got.is_contiguous(), f"reduce_scatter {case}: result not contiguous")

        # defaults: all_gather even; split / reduce_scatter compute_split_shapes
        full = _randn((2, 2 * P + 1), seed=2)
        default = compute_split_shapes(2 * P + 1, P)
        off = sum(default[:r])
        ck.equal(C.split(full, group, 1), full[:, off : off + default[r]], f"[{gname}] split default shapes")
        ck.equal(C.reduce_scatter(full, group, -1), P * full[:, off : off + default[r]], f"[{gname}] reduce_scatter default")
        mine = _randn((3, 2), seed=3)[:, :1] + r  # rank-dependent, non-contiguous
        want = torch.cat([_randn((3, 2), seed=3)[:, :1] + q for q in range(P)], dim=1)
        ck.equal(C.all_gather(mine, group, 1), want, f"[{gname}] all_gather default (even)")

        # other dtypes: complex, float32, int64 (uneven shapes)
        shapes = _shape_cases(P)["uneven"]
        T, off = sum(shapes), sum(shapes[:r])
        for dtype in (torch.complex64, torch.float32, torch.int64):
            full = _randn((T, 3), seed=4, dtype=torch.float64 if dtype == torch.int64 else dtype)
            if dtype == torch.int64:
                full = (full * 10).to(torch.int64)
            ck.equal(C.all_gather(full[off : off + shapes[r]], group, 0, shapes), full, f"[{gname}] all_gather {dtype}")
            got = C.reduce_scatter(full, group, 0, shapes)
            ck.equal(got, full[off : off + shapes[r]] * P, f"[{gname}] reduce_scatter {dtype}")
    ck.done()


@pytest.mark.ranks(8)
def test_all_to_all(mesh_8, mesh_2x4, mesh_2x2x2):
    ck = _Checker()
    for gname, group in mesh_groups(mesh_8, mesh_2x4, mesh_2x2x2):
        P, r = C.group_size(group), C.group_rank(group)
        cases = list(_shape_cases(P).items())
        # (src_dim, dst_dim, src case, dst case)
        k = len(cases)
        plan = [(1, 0, 0, 1), (0, 2, 1, 2 % k), (2, 1, 3 % k, 0), (-1, -3, 2 % k, 3 % k),
                (0, 1, 2 % k, 2 % k)]  # the last rank holds nothing before and after
        for src_dim, dst_dim, si, di in plan:
            (sname, src_shapes), (dname, dst_shapes) = cases[si], cases[di]
            case = f"[{gname}] src_dim={src_dim} {sname}{src_shapes} -> dst_dim={dst_dim} {dname}{dst_shapes}"
            shape = [5, 3, 4]
            shape[src_dim] = sum(src_shapes)
            shape[dst_dim] = sum(dst_shapes)
            full = _noncontig(tuple(shape), seed=5)
            soff, doff = sum(src_shapes[:r]), sum(dst_shapes[:r])
            x = full.narrow(src_dim, soff, src_shapes[r])
            want = full.narrow(dst_dim, doff, dst_shapes[r])
            got = C.all_to_all(x, group, src_dim, dst_dim, src_shapes, dst_shapes)
            ck.equal(got, want, f"all_to_all {case}")
            ck.true(got.is_contiguous(), f"all_to_all {case}: not contiguous")
            # and back again
            back = C.all_to_all(got, group, dst_dim, src_dim, dst_shapes, src_shapes)
            ck.equal(back, x.contiguous(), f"all_to_all inverse {case}")
        # defaults: src even, dst compute_split_shapes
        full = _randn((2 * P, 2 * P + 3), seed=6, dtype=torch.complex128)
        dst = compute_split_shapes(2 * P + 3, P)
        got = C.all_to_all(full[2 * r : 2 * r + 2], group, 0, 1)
        ck.equal(got, full[:, sum(dst[:r]) : sum(dst[:r]) + dst[r]], f"[{gname}] all_to_all defaults (complex)")
    ck.done()


@pytest.mark.ranks(8)
def test_reduce_broadcast_exchange(mesh_8, mesh_2x4, mesh_2x2x2):
    ck = _Checker()
    for gname, group in mesh_groups(mesh_8, mesh_2x4, mesh_2x2x2):
        P, r = C.group_size(group), C.group_rank(group)
        xs = [_randn((3, 2), seed=10 + q) for q in range(P)]
        x = xs[r].t()  # non-contiguous
        stack = torch.stack([t.t() for t in xs])
        for op, want in [("sum", stack.sum(0)), ("max", stack.amax(0)), ("min", stack.amin(0)),
                         ("avg", stack.mean(0)), ("mean", stack.mean(0))]:
            got = C.all_reduce(x, group, op=op)
            ck.equal(got, want, f"[{gname}] all_reduce op={op}")
        ck.true(torch.equal(x, xs[r].t()), f"[{gname}] all_reduce modified its input")
        got, work = C.all_reduce(x, group, async_op=True)
        work.wait()
        ck.equal(got, stack.sum(0), f"[{gname}] all_reduce async")
        cx = torch.complex(x, x + 1)
        ck.equal(C.all_reduce(cx, group), torch.complex(stack.sum(0), stack.sum(0) + P), f"[{gname}] all_reduce complex")
        ik = (x * 100).to(torch.int32)
        ck.equal(C.all_reduce(ik, group), (stack * 100).to(torch.int32).sum(0, dtype=torch.int32), f"[{gname}] all_reduce int32")

        for src in sorted({0, P - 1}):
            got = C.broadcast(x, group, src=src)
            ck.equal(got, xs[src].t(), f"[{gname}] broadcast src={src}")
            ck.true(got is not x, f"[{gname}] broadcast returned its input")

        # ppermute: a ring, a single pair (others get zeros), a swap with a different recv shape
        ring = [(i, (i + 1) % P) for i in range(P)]
        ck.equal(C.ppermute(x, group, ring), xs[(r - 1) % P].t(), f"[{gname}] ppermute ring")
        single = [(0, P - 1)]
        want = xs[0].t() if r == P - 1 else torch.zeros(2, 3, dtype=torch.float64)
        ck.equal(C.ppermute(x, group, single), want, f"[{gname}] ppermute {single}")
        if P > 1:
            # rank 0 sends a (2, 3) tensor, rank 1 sends a (1, 5) one
            mine = x if r == 0 else (_randn((1, 5), seed=20) if r == 1 else torch.zeros(0, dtype=torch.float64))
            recv = {0: (1, 5), 1: (2, 3)}.get(r, (0,))
            got = C.ppermute(mine, group, [(0, 1), (1, 0)], recv_shape=recv)
            want = {0: _randn((1, 5), seed=20), 1: xs[0].t()}.get(r, torch.zeros(0, dtype=torch.float64))
            ck.equal(got, want, f"[{gname}] ppermute swap with recv_shape")

        # all_to_all_v: rank q sends (q + 1) * j elements, all equal to 100 q + j, to rank j
        chunks = [torch.full(((r + 1) * j,), 100.0 * r + j).reshape(-1, 1) for j in range(P)]
        got = C.all_to_all_v(chunks, [(q + 1) * r for q in range(P)], group)
        ck.true(len(got) == P, f"[{gname}] all_to_all_v returned {len(got)} tensors")
        for q in range(P):
            ck.equal(got[q], torch.full(((q + 1) * r,), 100.0 * q + r), f"[{gname}] all_to_all_v from {q}")
        # rank 0 neither sends nor receives anything, the others exchange
        chunks = [torch.full((0 if 0 in (r, j) else 2,), float(r)) for j in range(P)]
        got = C.all_to_all_v(chunks, [0 if 0 in (r, q) else 2 for q in range(P)], group)
        for q in range(P):
            want = torch.full((0 if 0 in (r, q) else 2,), float(q))
            ck.equal(got[q], want, f"[{gname}] all_to_all_v with an idle rank, from {q}")
    ck.done()


@pytest.mark.ranks(8)
def test_argument_errors_raise_everywhere_before_communicating(mesh_2x4):
    """Errors every rank can see raise on every rank, before any collective."""
    group = wrap_mesh(mesh_2x4).group("tp")  # 4 ranks
    r = C.group_rank(group)
    x = torch.zeros(3, 2)
    bad = [
        ("all_gather length", lambda: C.all_gather(x, group, 0, [3, 3, 3]), "has 3 entries"),
        ("all_gather negative", lambda: C.all_gather(x, group, 0, [3, 3, 4, -1]), "negative"),
        ("reduce_scatter length", lambda: C.reduce_scatter(x, group, 0, [1, 1, 1, 0, 0]), "has 5 entries"),
        ("reduce_scatter negative", lambda: C.reduce_scatter(x, group, 0, [2, 2, -1, 0]), "negative"),
        ("split length", lambda: C.split(x, group, 0, [3]), "has 1 entries"),
        ("all_to_all src length", lambda: C.all_to_all(x, group, 0, 1, [3, 3], None), "has 2 entries"),
        ("all_to_all dst negative", lambda: C.all_to_all(x, group, 0, 1, None, [1, 1, 1, -1]), "negative"),
        ("all_to_all same dims", lambda: C.all_to_all(x, group, 1, -1), "must differ"),
        ("all_gather dim", lambda: C.all_gather(x, group, 2), "out of range"),
        ("reduce_scatter dim", lambda: C.reduce_scatter(x, group, -3), "out of range"),
        ("all_reduce op", lambda: C.all_reduce(x, group, op="prod"), "op must be"),
        ("all_reduce complex max", lambda: C.all_reduce(x.to(torch.complex64), group, op="max"), "complex"),
        ("broadcast src", lambda: C.broadcast(x, group, src=4), "src=4"),
        ("ppermute range", lambda: C.ppermute(x, group, [(0, 4)]), "outside the group"),
        ("ppermute two sends", lambda: C.ppermute(x, group, [(0, 1), (0, 2)]), "sends more than once"),
        ("ppermute two receives", lambda: C.ppermute(x, group, [(0, 1), (2, 1)]), "receives more than once"),
        ("all_to_all_v chunks", lambda: C.all_to_all_v([x], [0] * 4, group), "1 chunks"),
    ]
    before = checks.checks_enabled()
    try:
        for flag in (False, True):
            checks.set_checks(flag)
            with comm_stats.count_communication() as stats:
                for name, fn, fragment in bad:
                    with pytest.raises(ValueError, match=fragment):
                        fn()
            if flag:  # rank-local ones (a dim, a dtype) are agreed on: only the small check collective
                assert set(stats.by_kind()) <= {"check"}, f"communicated before raising:\n{stats}"
            else:
                assert stats.calls == 0, f"communicated before raising:\n{stats}"
    finally:
        checks.set_checks(before)
    # the ranks are still in step: a collective afterwards works
    assert C.all_reduce(torch.ones(1), group).item() == 4


@pytest.mark.ranks(8, checks=False)
def test_rank_local_mismatch_without_checks_raises_locally(mesh_2x4):
    """With checks off a rank-local error raises on that rank only; here every rank is wrong in its
    own way (so nobody is left waiting), and each sees its own message."""
    from einshard.comm import checks

    assert not checks.checks_enabled()
    group = wrap_mesh(mesh_2x4).group("tp")
    r = C.group_rank(group)
    with pytest.raises(ValueError, match=rf"group rank {r}\) holds {r + 5} elements"):
        C.all_gather(torch.zeros(r + 5, 2), group, 0, [1, 1, 1, 1])
    with pytest.raises(ValueError, match="sum to 4"):
        C.reduce_scatter(torch.zeros(r + 5), group, 0, [1, 1, 1, 1])
    assert C.all_reduce(torch.ones(1), group).item() == 4


def test_argument_validation_helpers():
    """Pure validation helpers (no process group needed)."""
    assert C._sizes([1, 2], "s", 2) == [1, 2]
    with pytest.raises(ValueError, match="has 1 entries"):
        C._sizes([1], "s", 2)
    with pytest.raises(ValueError, match="negative"):
        C._sizes([1, -2], "s", 2)
    with pytest.raises(ValueError, match="integers"):
        C._sizes([1, 2.5], "s", 2)
    assert C.check_perm([(0, 1), (1, 0)], 2) == [(0, 1), (1, 0)]
    with pytest.raises(ValueError, match="pairs"):
        C.check_perm([0, 1], 2)
