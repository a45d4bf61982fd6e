"""Named collectives: values and gradients against whole-tensor references.

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
from einshard.spmd import named
from einshard.spmd.shard_map import shard_map
from einshard.runtime.vma import get_vma

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


# -- any mesh: tuple and compound dimensions, double backward -----------------------------------


def _coords_on(shape, r):
    out = []
    for n in reversed(shape):
        out.append(r % n)
        r //= n
    return tuple(reversed(out))


class _Grid:
    """Rank arithmetic of a mesh (row-major ranks), for references computed in one process."""

    def __init__(self, shape, names):
        self.shape, self.names = tuple(shape), tuple(names)
        self.n = 1
        for s in shape:
            self.n *= s

    def coords(self, r):
        return dict(zip(self.names, _coords_on(self.shape, r)))

    def group(self, r, dims):
        """The ranks of ``r``'s group over ``dims``, in mesh order (= rank order)."""
        c = self.coords(r)
        return [q for q in range(self.n) if all(self.coords(q)[d] == c[d] for d in self.names if d not in dims)]

    def index(self, r, dims):
        return self.group(r, dims).index(r)


def _ties(x):
    """``x`` rounded (many ties between ranks), with the gradient of ``x`` (straight through)."""
    return x + (x.detach().round() - x.detach())


def _cases_2x2x2():
    g = _Grid((2, 2, 2), ("dp", "sp", "tp"))
    dt_ = ("dp", "tp")

    def grp(r, dims=dt_):
        return g.group(r, dims)

    return g, [
        ("psum (tp, dp)", lambda x: named.psum(x, ("tp", "dp")),
         lambda X: [sum(X[q] for q in grp(r)) for r in range(8)], ("sp",)),
        ("pmean dp-tp", lambda x: named.pmean(x, "dp-tp"),
         lambda X: [sum(X[q] for q in grp(r)) / 4 for r in range(8)], ("sp",)),
        ("pmin (sp, tp)", lambda x: named.pmin(x, ("sp", "tp")),
         lambda X: [torch.stack([X[q] for q in grp(r, ("sp", "tp"))]).amin(0) for r in range(8)], ("dp",)),
        ("pmax ties dp-sp-tp", lambda x: named.pmax(_ties(x), "dp-sp-tp"),  # split among ties, like amax
         lambda X: [torch.stack([_ties(X[q]) for q in range(8)]).amax(0) for r in range(8)], ()),
        ("all_gather (tp, dp)", lambda x: named.all_gather(x, ("tp", "dp"), axis=1),
         lambda X: [torch.cat([X[q] for q in grp(r)], 1) for r in range(8)], ("sp",)),
        ("all_gather dp-sp untiled", lambda x: named.all_gather(x, "dp-sp", axis=0, tiled=False),
         lambda X: [torch.stack([X[q] for q in grp(r, ("dp", "sp"))], 0) for r in range(8)], ("tp",)),
        ("psum_scatter (tp, dp)", lambda x: named.psum_scatter(x, ("tp", "dp"), axis=1),
         lambda X: [sum(X[q] for q in grp(r))[:, 2 * g.index(r, dt_) : 2 * g.index(r, dt_) + 2] for r in range(8)],
         ("dp", "sp", "tp")),
        ("all_to_all (tp, dp)", lambda x: named.all_to_all(x, ("tp", "dp"), split_axis=1, concat_axis=2),
         lambda X: [torch.cat([X[q][:, 2 * g.index(r, dt_) : 2 * g.index(r, dt_) + 2] for q in grp(r)], 2)
                    for r in range(8)], ("dp", "sp", "tp")),
        ("ppermute sp-tp", lambda x: named.ppermute(x, "sp-tp", [(i, (i + 1) % 4) for i in range(4)]),
         lambda X: [X[grp(r, ("sp", "tp"))[(g.index(r, ("sp", "tp")) - 1) % 4]] for r in range(8)], ("dp", "sp", "tp")),
        ("axis_index (tp, dp)", lambda x: x * named.axis_index(("tp", "dp")).to(x.dtype),
         lambda X: [X[r] * g.index(r, dt_) for r in range(8)], ("dp", "sp", "tp")),
    ]


def _check_on(dm, grid, cases, check_vma=True, order=1):
    """Values, gradients (``order=2``: also Hessian-vector products) and vma against ``cases``' references.

    ``order=1`` runs in ``shard_map``; ``order=2`` outside (ambient mesh), with
    ``torch.autograd.grad(create_graph=True)``.
    """
    mesh = es.wrap_mesh(dm)
    rank = mesh.index(grid.names)
    errs = {}
    for i, (name, body, ref, dims) in enumerate(cases):
        X = torch.randn(grid.n, 1, K, C, generator=torch.Generator().manual_seed(300 + i), dtype=DT).requires_grad_()
        V = torch.randn(grid.n, 1, K, C, generator=torch.Generator().manual_seed(400 + i), dtype=DT)
        Y = ref(X)

        def cot_for(r):
            key = tuple(grid.coords(r)[d] for d in dims)
            return torch.randn(Y[r].shape, generator=torch.Generator().manual_seed(hash((i, key)) % 2**31), dtype=DT)

        reps = [r for r in range(grid.n) if all(grid.coords(r)[d] == 0 for d in grid.names if d not in dims)]
        L = sum((Y[r] ** order * cot_for(r)).sum() for r in reps)
        (G,) = torch.autograd.grad(L, X, create_graph=order > 1)
        x = X[rank].detach().clone().requires_grad_()
        cot = cot_for(rank)
        if order == 1:
            partial = " // (" + ", ".join(dims) + ")" if dims else ""
            got = {}

            @shard_map("r/" + "-".join(grid.names) + " k c", (None, partial.strip()), mesh=mesh, check_vma=check_vma)
            def step(xb):
                y = body(xb)
                got["vma"] = get_vma(y)
                return y.detach(), (y * cot).sum()

            y, loss = step(x)
            loss.backward()
            errs[f"{name}/value"] = (y - Y[rank].detach()).abs().max().item()
            errs[f"{name}/grad"] = (x.grad - G[rank]).abs().max().item()
            if check_vma:
                errs[f"{name}/vma"] = 0.0 if got["vma"] == frozenset(dims) else 1.0
        else:
            # (G is constant where the body rounds: then the Hessian is zero)
            H = torch.autograd.grad((G * V).sum(), X)[0] if G.requires_grad else torch.zeros_like(X)
            with es.use_mesh(mesh):
                y = body(x)
                (g,) = torch.autograd.grad((y**order * cot).sum(), x, create_graph=True)
                h = torch.autograd.grad((g * V[rank]).sum(), x)[0] if g.requires_grad else torch.zeros_like(x)
            errs[f"{name}/grad"] = (g - G[rank]).abs().max().item()
            errs[f"{name}/hvp"] = (h - H[rank]).abs().max().item()
    names = sorted(errs)
    worst = torch.tensor([errs[n] for n in names], dtype=DT)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {n: v for n, v in zip(names, worst.tolist()) if not v <= 1e-10}


@pytest.mark.ranks(8)
def test_tuple_and_compound_dims_and_double_backward(mesh_2x2x2, mesh_2x4):
    grid, cases = _cases_2x2x2()
    bad = {}
    for check_vma in (True, False):
        found = _check_on(mesh_2x2x2, grid, cases, check_vma)
        bad.update({f"2x2x2/check_vma={check_vma}/{k}": v for k, v in found.items()})
    bad.update({f"2x2x2/order 2/{k}": v for k, v in _check_on(mesh_2x2x2, grid, cases, order=2).items()})
    # the 2 x 4 cases of the module, twice differentiated (psum's backward must be pvary, not a bare identity)
    grid_2x4 = _Grid((2, 4), ("dp", "tp"))
    bad.update({f"2x4/order 2/{k}": v for k, v in _check_on(mesh_2x4, grid_2x4, _cases(), order=2).items()})
    assert not bad, bad


@pytest.mark.ranks(8)
def test_nested_use_mesh_in_body(mesh_2x4, mesh_8):
    """A body on 2 x 4 that enters ``es.use_mesh`` of another mesh: collectives there use that mesh."""
    mesh, other = es.wrap_mesh(mesh_2x4), es.wrap_mesh(mesh_8)
    seen = {}

    @shard_map("a", "a", mesh=mesh)
    def body(x):
        with es.use_mesh(other):  # 'tp' has 8 ranks here
            seen["psum"] = named.psum(x, "tp").item()
            seen["size"] = named.axis_size("tp")
            seen["index"] = named.axis_index("tp").item()
            seen["gather"] = es.einshard("a/tp -> a", x).tolist()
        seen["psum body"] = named.psum(x, "tp").item()  # back on the body's mesh: 4 ranks
        seen["vma"] = get_vma(named.psum(x, "dp"))
        return x

    body(torch.full((1,), float(dist.get_rank())))
    rank = dist.get_rank()
    assert seen["psum"] == 28.0 and seen["size"] == 8 and seen["index"] == rank
    assert seen["gather"] == [float(r) for r in range(8)]
    assert seen["psum body"] == sum(r for r in range(8) if r // 4 == rank // 4)
    assert seen["vma"] == frozenset()
