"""Named collectives (SPEC §9): values and gradients against whole-tensor references.

Every rank ``r`` (mesh 2 x 4, ``dp`` x ``tp``; ``r = 4 * dp + tp``) holds block
``X[r]`` of a whole tensor ``X``. A collective's expected local output on each
rank is computed from ``X`` in one process. The body multiplies its output by
a cotangent that depends only on the coordinates the output varies over, sums
it, and returns that as partial over those dimensions; so the logical loss is
``sum over distinct outputs <Y, C>``, and ``X.grad`` from the reference is
every rank's expected gradient. Run with ``check_vma`` on and off.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import einshard as es
from einshard import named
from einshard.shard_map import shard_map
from einshard.vma import get_vma

DT = torch.float64
K, C = 8, 3  # local block (1, K, C)


def _coords(r):
    return r // 4, r % 4  # (dp, tp)


def _ranks(d=None, t=None):
    return [r for r in range(8) if (d is None or _coords(r)[0] == d) and (t is None or _coords(r)[1] == t)]


def _cat(blocks, axis):
    return torch.cat(blocks, dim=axis)


# each case: (name, body(x) -> y, reference(X) -> [y_r for r in 0..7], dims y varies over)
def _cases():
    def group_of(r, dim):
        d, t = _coords(r)
        return _ranks(d=d) if dim == "tp" else _ranks(t=t) if dim == "dp" else list(range(8))

    def ring(n):
        return [(i, (i + 1) % n) for i in range(n)]

    return [
        ("psum dp", lambda x: named.psum(x, "dp"),
         lambda X: [sum(X[q] for q in group_of(r, "dp")) for r in range(8)], ("tp",)),
        ("psum dp,tp", lambda x: named.psum(x, ("tp", "dp")),
         lambda X: [X.sum(0) for r in range(8)], ()),
        ("psum compound", lambda x: named.psum(x, "dp-tp"),
         lambda X: [X.sum(0) for r in range(8)], ()),
        ("pmean tp", lambda x: named.pmean(x, "tp"),
         lambda X: [sum(X[q] for q in group_of(r, "tp")) / 4 for r in range(8)], ("dp",)),
        ("pmax tp", lambda x: named.pmax(x, "tp"),
         lambda X: [torch.stack([X[q] for q in group_of(r, "tp")]).amax(0) for r in range(8)], ("dp",)),
        ("pmin dp", lambda x: named.pmin(x, "dp"),
         lambda X: [torch.stack([X[q] for q in group_of(r, "dp")]).amin(0) for r in range(8)], ("tp",)),
        ("all_gather tp", lambda x: named.all_gather(x, "tp", axis=1),
         lambda X: [_cat([X[q] for q in group_of(r, "tp")], 1) for r in range(8)], ("dp",)),
        ("all_gather tp untiled", lambda x: named.all_gather(x, "tp", axis=0, tiled=False),
         lambda X: [torch.stack([X[q] for q in group_of(r, "tp")], 0) for r in range(8)], ("dp",)),
        ("all_gather dp,tp", lambda x: named.all_gather(x, ("dp", "tp"), axis=-1),
         lambda X: [_cat([X[q] for q in range(8)], -1) for r in range(8)], ()),
        ("psum_scatter tp", lambda x: named.psum_scatter(x, "tp", axis=1),
         lambda X: [sum(X[q] for q in group_of(r, "tp"))[:, 2 * (r % 4) : 2 * (r % 4) + 2] for r in range(8)],
         ("dp", "tp")),
        ("psum_scatter dp uneven", lambda x: named.psum_scatter(x[:, :7], "dp", axis=1),  # 7 -> [4, 3]
         lambda X: [sum(X[q] for q in group_of(r, "dp"))[:, :7][:, (0, 4)[r // 4] : (4, 7)[r // 4]] for r in range(8)],
         ("dp", "tp")),
        ("psum_scatter untiled", lambda x: named.psum_scatter(x[:, :4], "tp", axis=1, tiled=False),
         lambda X: [sum(X[q] for q in group_of(r, "tp"))[:, r % 4] for r in range(8)], ("dp", "tp")),
        ("all_to_all tp", lambda x: named.all_to_all(x, "tp", split_axis=1, concat_axis=2),
         lambda X: [_cat([X[q][:, 2 * (r % 4) : 2 * (r % 4) + 2] for q in group_of(r, "tp")], 2) for r in range(8)],
         ("dp", "tp")),
        ("all_to_all tp untiled", lambda x: named.all_to_all(x[:, :4], "tp", split_axis=1, concat_axis=0, tiled=False),
         lambda X: [torch.stack([X[q][:, r % 4] for q in group_of(r, "tp")], 0) for r in range(8)], ("dp", "tp")),
        ("ppermute tp ring", lambda x: named.ppermute(x, "tp", ring(4)),
         lambda X: [X[group_of(r, "tp")[(r % 4 - 1) % 4]] for r in range(8)], ("dp", "tp")),
        ("ppermute dp-tp shift", lambda x: named.ppermute(x, ("dp", "tp"), [(i, (i + 3) % 8) for i in range(8)]),
         lambda X: [X[(r - 3) % 8] for r in range(8)], ("dp", "tp")),
        ("axis_index", lambda x: x * (1 + named.axis_index("tp")),
         lambda X: [X[r] * (1 + r % 4) for r in range(8)], ("dp", "tp")),
        ("axis_index compound", lambda x: x * named.axis_index(("tp", "dp")).to(x.dtype),
         lambda X: [X[r] * r for r in range(8)], ("dp", "tp")),
    ]


def _check_cases(dm, check_vma):
    mesh = es.wrap_mesh(dm)
    rank = mesh.index(("dp", "tp"))
    d, t = _coords(rank)
    errs = {}
    for i, (name, body, ref, dims) in enumerate(_cases()):
        X = torch.randn(8, 1, K, C, generator=torch.Generator().manual_seed(100 + i), dtype=DT).requires_grad_()
        Y = ref(X)
        coord = {"dp": d, "tp": t}

        def cot_for(r):
            key = tuple(_coords(r)[("dp", "tp").index(dim)] for dim in dims)
            return torch.randn(Y[r].shape, generator=torch.Generator().manual_seed(hash((i, key)) % 2**31), dtype=DT)

        # the logical loss: one term per distinct output (ranks that agree on the varying coordinates)
        reps = [r for r in range(8) if all(_coords(r)[k] == 0 for k, dim in enumerate(("dp", "tp")) if dim not in dims)]
        sum((Y[r] * cot_for(r)).sum() for r in reps).backward()
        x = X[rank].detach().clone().requires_grad_()
        cot = cot_for(rank)
        partial = " // (" + ", ".join(dims) + ")" if dims else ""
        got = {}

        @shard_map("r/dp-tp k c", (None, partial.strip()), mesh=mesh, check_vma=check_vma)
        def step(xb):
            y = body(xb.squeeze(0).unsqueeze(0))
            got["vma"] = get_vma(y)
            return y.detach(), (y * cot).sum()

        y, loss = step(x)
        loss.backward()
        errs[f"{name}/value"] = (y - Y[rank].detach()).abs().max().item()
        errs[f"{name}/grad"] = (x.grad - X.grad[rank]).abs().max().item()
        if check_vma:
            errs[f"{name}/vma"] = 0.0 if got["vma"] == frozenset(dims) else 1.0
        del coord
    names = sorted(errs)
    worst = torch.tensor([errs[n] for n in names], dtype=DT)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    bad = {n: v for n, v in zip(names, worst.tolist()) if not v <= 1e-10}
    assert not bad, bad


@pytest.mark.ranks(8)
def test_collectives_values_gradients_and_vma(mesh_2x4):
    _check_cases(mesh_2x4, True)
    _check_cases(mesh_2x4, False)


@pytest.mark.ranks(8)
def test_collectives_outside_shard_map_and_small_forms(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    rank = dist.get_rank()
    with es.use_mesh(mesh):
        assert named.axis_size("tp") == 4 and named.axis_size(("dp", "tp")) == 8 and named.axis_size("dp-tp") == 8
        assert named.psum(1, "dp") == 2 and named.pmean(3.0, "tp") == 3.0
        assert named.axis_index("dp").item() == mesh.coordinate[0]
        x = torch.full((2,), float(rank), requires_grad=True)
        y = named.psum({"a": x, "b": [x * 2]}, "tp")  # pytrees of tensors
        group_sum = sum(r for r in range(8) if r // 4 == rank // 4)
        assert y["a"].tolist() == [group_sum] * 2 and y["b"][0].tolist() == [2 * group_sum] * 2
        y["a"].sum().backward()  # psum's backward is the identity
        assert x.grad.tolist() == [1.0, 1.0]
        w = torch.ones(3, requires_grad=True)
        named.pvary(w, "dp").sum().backward()  # identity forward, gradient summed over dp
        assert w.grad.tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="is not in the mesh"):
        named.psum(x, "sp", mesh=mesh)
    with pytest.raises(ValueError, match="named twice"):
        named.psum(x, ("dp", "dp-tp"), mesh=mesh)
    with pytest.raises(ValueError, match="require mesh"):
        named.psum(x, "dp")
    with pytest.raises(ValueError, match="tiled=False needs"):
        named.psum_scatter(torch.ones(3), "tp", tiled=False, mesh=mesh)
    dist.barrier()
