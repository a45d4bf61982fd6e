"""Meshes in any rank order: block order follows mesh coordinates, on every path.

``torch.distributed.new_group`` numbers a group's ranks in ascending global
rank order, whatever order a mesh lists them in, so on a mesh built from a
permuted rank tensor (``DeviceMesh("cpu", [[0, 2], [1, 3]])``), on a
sub-mesh in another dimension order (``mesh["tp", "dp"]``) or for a compound
group (``b/tp-dp``) the group rank of a member is not its block index. Every
case here cuts whole tensors into blocks by mesh coordinates
(``local_block``) and compares values and gradients with the same
computation on whole tensors in one process: transitions and contractions of
every planner kind, named collectives in ``shard_map``, the grid ops,
``es.params.to_dtensor`` (whose DTensors live on the mesh's twin where DTensor's own
gathers would permute the blocks), a DCP checkpoint, parameters stored sharded
(``store=``, ZeRO: the hooks and ``shard_map`` bodies) and a compiled formula.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

import einshard as es
from dist_reference import check_many
from einshard.comm import collectives
from einshard.spmd import named
from einshard.core._split import compute_split_shapes
from einshard.spmd.dtensor import chunk_splits
from einshard.spmd.shard_map import shard_map
from einshard.testing import local_block, make_mesh
from einshard.runtime.vma import get_vma
from test_conv import nc_ref, run_conv_cases
from test_fft_distributed import check_many as check_fft_many
from test_halo import max_err, run_halo_cases
from test_roll import run_roll_cases
from test_window import run_window_cases

DT = torch.float64

# global rank tensors, by kind; "sub" is mesh["tp", "dp"] of a plain (2, 2) dp x tp mesh
RANKS = {
    "1d2": ([1, 0], ("tp",)),
    "1d": ([3, 1, 0, 2], ("tp",)),
    "cols": ([[0, 2], [1, 3]], ("dp", "tp")),
    "rev": ([[3, 1], [2, 0]], ("dp", "tp")),  # no dimension's groups ascend
    "2x4": ([[5, 2, 7, 0], [3, 6, 1, 4]], ("dp", "tp")),
    "2x2x2": ([[[6, 1], [4, 3]], [[0, 7], [2, 5]]], ("dp", "sp", "tp")),
}
_BUILT: dict = {}


def permuted_mesh(kind: str):
    """The wrapped mesh of ``kind``, built once per process (inside the ranks, on every rank)."""
    world = dist.group.WORLD
    hit = _BUILT.get(kind)
    if hit is not None and hit[0] is world:
        return hit[1]
    if kind == "sub":
        mesh = es.wrap_mesh(make_mesh((2, 2), ("dp", "tp")))["tp", "dp"]
    else:
        ranks, names = RANKS[kind]
        mesh = es.wrap_mesh(DeviceMesh("cpu", torch.tensor(ranks), mesh_dim_names=names))
    _BUILT[kind] = (world, mesh)
    return mesh


def _on_mesh(cases, names):
    """The cases (``check_many`` dicts) whose mesh dimensions (``dp``, ``sp``, ``tp``) the mesh has."""
    out = []
    for formula, shapes in cases:
        used = {d for d in ("dp", "sp", "tp") if d in formula.replace("-", " ").replace("/", " ").replace(",", " ")
                .replace("(", " ").replace(")", " ").split()}
        if used <= set(names):
            out.append(dict(formula=formula, global_shapes=shapes))
    return out


# -- the bug as reported ------------------------------------------------------------------------


@pytest.mark.ranks(4)
def test_group_ranks_are_not_block_order_and_mesh_says_so():
    mesh = permuted_mesh("cols")
    # new_group sorts: the compound group's ranks ascend, its mesh order is 0, 2, 1, 3
    assert dist.get_process_group_ranks(mesh.group("dp-tp")) == [0, 1, 2, 3]
    assert mesh.order("dp-tp") == (0, 2, 1, 3)
    assert mesh.order("dp") is None and mesh.order("tp") is None  # the common case: identity
    sub = permuted_mesh("sub")
    assert sub.order("tp-dp") == (0, 2, 1, 3) and sub.order("tp") is None
    one = permuted_mesh("1d")
    assert one.order("tp") == (3, 1, 0, 2)  # block k lives on global (= group) rank order[k]
    rows = torch.arange(8.0).reshape(8, 1)
    for m in (mesh, sub):
        got = es.einshard("b/tp-dp c -> b c", local_block(rows, "b/tp-dp c", m), mesh=m)
        assert got.flatten().tolist() == list(range(8)), got.flatten().tolist()


@pytest.mark.ranks(4)
def test_plain_collectives_take_an_order():
    order, sizes = (2, 0, 3, 1), [3, 1, 0, 2]  # block k on group rank order[k]; uneven, one empty
    group, me = dist.group.WORLD, order.index(dist.get_rank())
    offsets = [sum(sizes[:k]) for k in range(4)]
    whole = torch.arange(6.0 * 5).reshape(6, 5)
    mine = whole[offsets[me] : offsets[me] + sizes[me]]
    assert torch.equal(collectives.split(whole, group, 0, sizes, order), mine)
    assert torch.equal(es.comm.helpers.all_gather(mine, group, 0, sizes, order=order), whole)
    assert torch.equal(collectives.reduce_scatter(whole, group, 0, sizes, order), 4 * mine)
    even = torch.arange(8.0 * 4).reshape(8, 4)
    assert torch.equal(collectives.all_gather(even[2 * me : 2 * me + 2], group, 0, order=order), even)
    assert torch.equal(collectives.reduce_scatter(even, group, 0, order=order), 4 * even[2 * me : 2 * me + 2])
    cols = [2, 0, 2, 1]  # all_to_all: rows by block -> columns by block
    square = torch.arange(6.0 * 5).reshape(6, 5)
    got = collectives.all_to_all(square[offsets[me] : offsets[me] + sizes[me]], group, 0, 1, sizes, cols, order)
    start = sum(cols[:me])
    assert torch.equal(got, square[:, start : start + cols[me]])
    with pytest.raises(ValueError, match="not a permutation"):
        collectives.all_gather(mine, group, 0, sizes, (0, 1, 2, 2))


def test_virtual_meshes_have_no_order():
    mesh = es.Mesh.virtual((2, 2), ("dp", "tp"))
    assert mesh.order("dp-tp") is None and mesh["tp", "dp"].order("tp-dp") is None


# -- transitions and contractions: every planner kind ------------------------------------------

CASES = [
    ("b/tp-dp c -> b c", [(8, 1)]),  # compound all-gather (the reported example)
    ("b/tp-dp c -> b c", [(9, 2)]),
    ("a/tp b -> a b", [(10, 6)]),  # all-gather, uneven and even
    ("a/tp b -> a b", [(8, 6)]),
    ("a b -> a/tp-dp b", [(9, 2)]),  # slice
    ("a b // tp -> a/tp b", [(10, 6)]),  # reduce-scatter
    ("a b // tp -> a/tp b", [(8, 3)]),
    ("a b // (dp, tp) -> a/tp-dp b", [(10, 9)]),
    ("a b // (dp, tp) -> a/dp-tp b", [(8, 3)]),
    ("a b // (dp, tp) -> a b", [(5, 3)]),  # all-reduce
    ("a/tp b -> a b/tp", [(10, 7)]),  # all-to-all
    ("a/tp b -> a b/tp", [(8, 4)]),
    ("a/dp-tp b -> a b/dp-tp", [(10, 9)]),
    ("a/dp b -> a/tp b", [(10, 7)]),  # exchange: a mesh-dimension move
    ("a/dp b -> a/tp b", [(8, 6)]),
    ("a/dp b/tp -> a/tp b/dp", [(10, 7)]),
    ("a/tp-dp b -> a/dp b", [(10, 9)]),
    ("a b/tp -> a", [(10, 7)]),
    ("a/tp b -> a // tp", [(10, 3)]),  # embedded as zero-padded contributions
    ("a b -> // tp", [(4, 3)]),  # contributions kept on block 0 (backward: broadcast from it)
    ("a b/dp -> a // (dp, tp)", [(5, 3)]),
    ("b n c/tp, h c/tp -> b n h", [(3, 5, 10), (4, 10)]),  # contractions
    ("l f/tp, f/tp e -> l/tp e", [(10, 9), (9, 5)]),
    ("a k/dp m/tp, k/tp m/dp b -> a b", [(3, 6, 7), (6, 7, 5)]),
    ("a/tp-dp k, k b/dp -> a b/tp", [(9, 4), (4, 7)]),
]

CASES_3D = [
    ("b/tp-sp-dp c -> b c", [(9, 2)]),
    ("a b // (dp, sp, tp) -> a/sp-tp-dp b", [(11, 2)]),
    ("a/dp b/tp -> a/tp b/sp", [(10, 7)]),
    ("a/sp-tp b -> a b/dp-sp", [(9, 5)]),
    ("a/dp-sp-tp b -> a b/tp", [(10, 4)]),
    ("l f/tp-sp, f/tp-sp e -> l/dp e", [(10, 9), (9, 5)]),
]


@pytest.mark.ranks(4, timeout=600)
@pytest.mark.parametrize("kind", ["1d", "cols", "sub"])
def test_transitions_and_contractions(kind):
    mesh = permuted_mesh(kind)
    check_many(mesh, _on_mesh(CASES, mesh.names))


@pytest.mark.ranks(4)
def test_plain_device_mesh_1d():
    dm = DeviceMesh("cpu", torch.tensor(RANKS["1d"][0]), mesh_dim_names=("tp",))  # not wrapped
    x = torch.arange(16.0).reshape(8, 2)  # even: no shapes= needed
    got = es.einshard("a/tp b -> a b", local_block(x, "a/tp b", dm), mesh=dm)
    assert torch.equal(got, x)
    check_many(dm, _on_mesh(CASES[:12], ("tp",)))


@pytest.mark.ranks(2)
def test_two_ranks_swapped():
    mesh = permuted_mesh("1d2")
    check_many(mesh, _on_mesh(CASES, mesh.names))
    _check_named(mesh, ("tp",), True, 7)
    assert mesh.order("tp") == (1, 0)


# -- named collectives in shard_map ---------------------------------------------------------

K, C = 8, 2  # every rank's block: (1, K, C)


def _flat(coord, shape) -> int:
    index = 0
    for c, n in zip(coord, shape):
        index = index * n + c
    return index


def _unflat(r, shape):
    coord = []
    for n in reversed(shape):
        coord.append(r % n)
        r //= n
    return tuple(reversed(coord))


def _group(mesh, r, dims):
    """The blocks (flat mesh indices) of rank-block ``r``'s group over ``dims``, in block order (mesh order)."""
    positions = [mesh.names.index(d) for d in dims]
    base = list(_unflat(r, mesh.shape))
    out = []
    for values in itertools.product(*(range(mesh.shape[p]) for p in positions)):
        c = list(base)
        for p, v in zip(positions, values):
            c[p] = v
        out.append(_flat(c, mesh.shape))
    return out


def _named_cases(mesh, given):
    """(name, body(x), reference(X, r) for block r, dims the output varies over).

    ``given``: the collectives' dimensions, in any order; their group's blocks are in mesh order.
    """
    dims = tuple(sorted(given, key=mesh.names.index))
    n = math.prod(mesh.shape[mesh.names.index(d)] for d in dims)
    others = tuple(d for d in mesh.names if d not in dims)
    every = tuple(mesh.names)
    blk = compute_split_shapes(K, n)
    off = [sum(blk[:j]) for j in range(n)]
    odd = compute_split_shapes(7, n)
    odd_off = [sum(odd[:j]) for j in range(n)]
    sizes = [j % 3 + 1 for j in range(n)]

    def members(r):
        return _group(mesh, r, dims)

    def pos(r):
        return members(r).index(r)

    def total(X, r):
        return sum(X[q] for q in members(r))

    def gather_uneven(x):
        return named.all_gather(x[:, : sizes[mesh.index(dims)]], given, axis=1, shapes=sizes)

    return [
        ("psum", lambda x: named.psum(x, given), total, others),
        ("pmean", lambda x: named.pmean(x, given), lambda X, r: total(X, r) / n, others),
        ("pmax", lambda x: named.pmax(x, given), lambda X, r: torch.stack([X[q] for q in members(r)]).amax(0), others),
        ("all_gather", lambda x: named.all_gather(x, given, axis=1),
         lambda X, r: torch.cat([X[q] for q in members(r)], 1), others),
        ("all_gather untiled", lambda x: named.all_gather(x, given, axis=0, tiled=False),
         lambda X, r: torch.stack([X[q] for q in members(r)], 0), others),
        ("all_gather uneven", gather_uneven,
         lambda X, r: torch.cat([X[q][:, : sizes[j]] for j, q in enumerate(members(r))], 1), others),
        ("psum_scatter", lambda x: named.psum_scatter(x, given, axis=1),
         lambda X, r: total(X, r)[:, off[pos(r)] : off[pos(r)] + blk[pos(r)]], every),
        ("psum_scatter uneven", lambda x: named.psum_scatter(x[:, :7], given, axis=1),
         lambda X, r: total(X, r)[:, odd_off[pos(r)] : odd_off[pos(r)] + odd[pos(r)]], every),
        ("psum_scatter untiled", lambda x: named.psum_scatter(x[:, :n], given, axis=1, tiled=False),
         lambda X, r: total(X, r)[:, pos(r)], every),
        ("all_to_all", lambda x: named.all_to_all(x, given, split_axis=1, concat_axis=2),
         lambda X, r: torch.cat([X[q][:, off[pos(r)] : off[pos(r)] + blk[pos(r)]] for q in members(r)], 2), every),
        ("all_to_all untiled", lambda x: named.all_to_all(x[:, :n], given, split_axis=1, concat_axis=0, tiled=False),
         lambda X, r: torch.stack([X[q][:, pos(r)] for q in members(r)], 0), every),
        ("ppermute ring", lambda x: named.ppermute(x, given, [(i, (i + 1) % n) for i in range(n)]),
         lambda X, r: X[members(r)[(pos(r) - 1) % n]], every),
        ("ppermute open chain", lambda x: named.ppermute(x, given, [(i + 1, i) for i in range(n - 1)]),
         lambda X, r: X[members(r)[pos(r) + 1]] if pos(r) < n - 1 else torch.zeros_like(X[r]), every),
        ("axis_index", lambda x: x * (1 + named.axis_index(given)),
         lambda X, r: X[r] * (1 + pos(r)), every),
    ]


def _check_named(mesh, dims, check_vma, seed):
    world = mesh.size()
    me = _flat(mesh.coordinate, mesh.shape)
    spec = f"r/{'-'.join(mesh.names)} k c"
    errs = {}
    for i, (name, body, ref, vary) in enumerate(_named_cases(mesh, dims)):
        X = torch.randn(world, 1, K, C, generator=torch.Generator().manual_seed(seed + i), dtype=DT)
        X.requires_grad_()
        Y = [ref(X, r) for r in range(world)]

        def cot_for(r):
            key = tuple(_unflat(r, mesh.shape)[mesh.names.index(d)] for d in vary)
            return torch.randn(Y[r].shape, generator=torch.Generator().manual_seed(hash((i, key)) % 2**31), dtype=DT)

        # the logical loss: one term per distinct output (the blocks at 0 on the dimensions it is invariant over)
        reps = [r for r in range(world)
                if all(_unflat(r, mesh.shape)[k] == 0 for k, d in enumerate(mesh.names) if d not in vary)]
        sum((Y[r] * cot_for(r)).sum() for r in reps).backward()
        x = X[me].detach().clone().requires_grad_()
        cot = cot_for(me)
        partial = "// (" + ", ".join(vary) + ")" if vary else ""
        got = {}

        @shard_map(spec, (None, partial), mesh=mesh, check_vma=check_vma)
        def step(xb):
            y = body(xb)
            got["vma"] = get_vma(y)
            return y.detach(), (y * cot).sum()

        y, loss = step(x)
        loss.backward()
        errs[f"{dims} {name} value"] = max_err(y, Y[me].detach())
        errs[f"{dims} {name} grad"] = max_err(x.grad, X.grad[me])
        if check_vma:
            errs[f"{dims} {name} vma"] = 0.0 if got["vma"] == frozenset(vary) else 1.0
    keys = sorted(errs)
    worst = torch.tensor([errs[k] for k in keys], dtype=DT)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    bad = {k: v for k, v in zip(keys, worst.tolist()) if not v <= 1e-10}
    assert not bad, bad


def _named_all(mesh):
    groups = [(mesh.names[0],), tuple(reversed(mesh.names))]  # any order: the group is in mesh order
    if mesh.ndim > 1:
        groups.append((mesh.names[-1],))
    for k, dims in enumerate(groups):
        _check_named(mesh, dims, True, 100 * k)
    _check_named(mesh, tuple(mesh.names), False, 1000)


@pytest.mark.ranks(4, timeout=600)
@pytest.mark.parametrize("kind", ["1d", "cols", "sub"])
def test_named_collectives_in_shard_map(kind):
    _named_all(permuted_mesh(kind))


# -- grid ops: einroll, einhalo, einwindow, einconv, einfft -------------------------------------


def _grid_1d(mesh):  # uneven blocks need their shapes= (the ops assume even blocks without)
    run_roll_cases(mesh, [dict(spec="b h/tp", gshape=(2, 10), shifts={"h": 3}, shapes=[3, 2, 2, 3]),
                          dict(spec="h/tp c", gshape=(8, 2), shifts={"h": -3, "c": 1})])
    run_halo_cases(mesh, [dict(spec="b h/tp", gshape=(2, 10), halos={"h": (1, 2)}, boundary="periodic",
                               shapes=[3, 2, 2, 3]),
                          dict(spec="h/tp c", gshape=(7, 2), halos={"h": 2}, shapes=[3, 0, 2, 2])])
    run_window_cases(mesh, [dict(formula="b h/tp c -> b h/tp kh c", gshape=(2, 9, 2), windows={"h": "kh"},
                                 radius={"h": 1}, boundary="periodic", shapes=[3, 2, 2, 2])])
    run_conv_cases(mesh, [dict(formula="b c h/tp, o c k -> b o h/tp", xshape=(2, 3, 10), wshape=(4, 3, 3),
                               windows={"h": "k"}, bias_shape=(4,), boundary="periodic", shapes=[3, 3, 2, 2],
                               ref=lambda x, w, b: nc_ref(x, w, b, [(1, 1)], "periodic"))])
    check_fft_many(mesh, [dict(formula="b x/tp y -> b kx ky/tp", shape=(2, 8, 6), axes={"x": "kx", "y": "ky"}),
                          dict(formula="x/tp y -> kx ky/tp", shape=(7, 6), axes={"x": "kx", "y": "ky"})])


def _grid_2d(mesh):
    uneven = {"dp": [3, 2], "tp": [4, 3]}
    run_roll_cases(mesh, [dict(spec="h/dp w/tp", gshape=(6, 8), shifts={"h": 1, "w": 3}),
                          dict(spec="h/tp-dp w", gshape=(11, 2), shifts={"h": 6, "w": 1}, shapes=[3, 3, 3, 2])])
    run_halo_cases(mesh, [dict(spec="n h/dp w/tp", gshape=(1, 5, 7), halos={"h": (1, 2), "w": 1},
                               boundary="periodic", shapes=uneven),
                          dict(spec="h/tp-dp c", gshape=(9, 2), halos={"h": 1}, shapes=[3, 2, 2, 2])])
    run_window_cases(mesh, [dict(formula="b h/dp w/tp c -> b h/dp w/tp kh kw c", gshape=(1, 6, 8, 2),
                                 windows={"h": "kh", "w": "kw"}, radius={"h": 1, "w": 1}, boundary="periodic")])
    run_conv_cases(mesh, [dict(formula="b h/dp w/tp c, o c kh kw -> b h/dp w/tp o", xshape=(2, 5, 7, 2),
                               wshape=(3, 2, 3, 3), windows={"h": "kh", "w": "kw"}, bias_shape=(3,),
                               boundary="periodic", shapes=uneven,
                               ref=lambda x, w, b: nc_ref(x.permute(0, 3, 1, 2), w, b, [(1, 1), (1, 1)],
                                                          "periodic").permute(0, 2, 3, 1))])
    check_fft_many(mesh, [dict(formula="b x/dp y/tp -> b kx ky/dp", shape=(2, 8, 6), axes={"x": "kx", "y": "ky"}),
                          dict(formula="x/tp-dp y -> kx ky/tp-dp", shape=(8, 8), axes={"x": "kx", "y": "ky"})])


@pytest.mark.ranks(4, timeout=600)
@pytest.mark.parametrize("kind", ["1d", "cols", "sub"])
def test_grid_ops(kind):
    mesh = permuted_mesh(kind)
    (_grid_1d if mesh.ndim == 1 else _grid_2d)(mesh)


# -- DTensors and checkpoints ---------------------------------------------------------------------

LAYOUTS = {"emb": "t/dp-tp c", "up": "f/tp c", "down": "c f/tp-dp", "norm": "c"}
SHAPES = {"emb": (13, 3), "up": (10, 3), "down": (3, 9), "norm": (3,)}  # uneven over 2 and 4


def _layouts(names):
    if names == ("tp",):
        return {k: v.replace("dp-tp", "tp").replace("tp-dp", "tp") for k, v in LAYOUTS.items()}
    return LAYOUTS


def _whole(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=g, dtype=DT) for k, s in SHAPES.items()}


def _model(mesh, values):
    model = torch.nn.Module()
    for k, layout in _layouts(mesh.names).items():
        model.register_parameter(k, torch.nn.Parameter(local_block(values[k], layout, mesh).clone()))
        es.params.register_parameter_layout(getattr(model, k), layout, mesh=mesh)
    return model


def _chunk_block(whole, layout, mesh):
    """This rank's block of ``whole`` with torch.chunk's split (a DTensor's), by mesh coordinates."""
    shapes = {}
    for item in layout.split():
        if "/" in item:
            axis, m = item.split("/")
            dims = mesh.dims(m)
            n = whole.shape[layout.split().index(item)]
            shapes.setdefault(mesh.label(dims), {})[axis] = list(chunk_splits(n, [mesh.size((d,)) for d in dims]))
    return local_block(whole, layout, mesh, shapes=shapes)


@pytest.mark.ranks(4, timeout=300)
@pytest.mark.parametrize("kind", ["1d", "cols", "sub"])
def test_to_dtensor_uneven_params(kind):
    mesh = permuted_mesh(kind)
    whole = _whole()
    model = _model(mesh, whole)
    state = es.params.to_dtensor(model, mesh=mesh)  # hung in the exchange before
    for k, layout in _layouts(mesh.names).items():
        # the block at this rank's coordinate in the DeviceMesh the DTensor is on (a twin on "1d")
        assert torch.equal(state[k].to_local(), _chunk_block(whole[k], layout, es.wrap_mesh(state[k].device_mesh))), k
        assert torch.equal(state[k].full_tensor(), whole[k]), k
    back = es.params.from_dtensor(state, model, mesh=mesh)
    for k, layout in _layouts(mesh.names).items():
        assert torch.equal(back[k], local_block(whole[k], layout, mesh)), k


@pytest.mark.ranks(4, timeout=300)
def test_to_dtensor_full_tensor_on_permuted_2d_mesh(tmp_path):
    """DTensor gathers in group-rank order: on a mesh whose groups do not ascend the DTensors handed out live
    on its twin (ranks ascending), holding the block at their twin coordinate; everything DTensor does with
    them agrees with the whole tensor, and they are read back through the twin."""
    mesh = permuted_mesh("rev")
    whole = _whole(2)
    model = _model(mesh, whole)
    state = es.params.to_dtensor(model, mesh=mesh)
    for k, layout in LAYOUTS.items():
        d = state[k]
        assert d.device_mesh.mesh.tolist() == [[0, 1], [2, 3]] and d.device_mesh.mesh_dim_names == ("dp", "tp")
        assert torch.equal(d.to_local(), _chunk_block(whole[k], layout, es.wrap_mesh(d.device_mesh))), k
        assert torch.equal(d.full_tensor(), whole[k]), k
        assert torch.equal(d.redistribute(placements=[Replicate(), Replicate()]).to_local(), whole[k]), k
        moved = d.redistribute(placements=[Replicate(), Shard(0)])  # another sharding, read back through the twin
        assert torch.equal(es.params.from_dtensor({k: moved}, {k: layout}, mesh=mesh)[k], local_block(whole[k], layout,
                                                                                                  mesh)), k
    back = es.params.from_dtensor(state, model, mesh=mesh)
    for k, layout in LAYOUTS.items():
        assert torch.equal(back[k], local_block(whole[k], layout, mesh)), k
    # autograd: a DTensor on the twin into shard_map and out again (a DTensor on the twin), gradients back
    x = state["down"].detach().requires_grad_()
    y = es.shard_map(LAYOUTS["down"], LAYOUTS["down"], mesh=mesh)(lambda b: b * b)(x)
    assert y.device_mesh is x.device_mesh and torch.equal(y.full_tensor(), whole["down"] ** 2)
    cot = torch.randn(whole["down"].shape, generator=torch.Generator().manual_seed(3), dtype=DT)
    (y.full_tensor() * cot).sum().backward()
    assert torch.allclose(x.grad.full_tensor(), 2 * whole["down"] * cot, rtol=1e-12, atol=1e-12)
    # DCP: saved from the twin, loaded whole and back onto the permuted mesh
    dcp.save(state, checkpoint_id=str(tmp_path / "rev"))
    loaded = {k: torch.zeros_like(v) for k, v in whole.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "rev"))
    fresh = _model(mesh, {k: torch.zeros_like(v) for k, v in whole.items()})
    target = es.params.to_dtensor(fresh, mesh=mesh)
    dcp.load(target, checkpoint_id=str(tmp_path / "rev"))
    es.params.load_from_dtensor_(fresh, target, mesh=mesh)
    for k, layout in LAYOUTS.items():
        assert torch.equal(loaded[k], whole[k]), k
        assert torch.equal(getattr(fresh, k).detach(), local_block(whole[k], layout, mesh)), k
    dist.barrier()


@pytest.mark.ranks(4, timeout=300)
def test_checkpoint_across_permuted_meshes(tmp_path):
    whole = _whole(1)
    plain = es.wrap_mesh(make_mesh((2, 2), ("dp", "tp")))
    first = str(tmp_path / "plain")
    dcp.save(es.params.to_dtensor(_model(plain, whole), mesh=plain), checkpoint_id=first)
    zeros = {k: torch.zeros_like(v) for k, v in whole.items()}
    for kind in ("cols", "sub", "1d"):
        mesh = permuted_mesh(kind)
        model = _model(mesh, zeros)
        state = es.params.to_dtensor(model, mesh=mesh)
        dcp.load(state, checkpoint_id=first)
        es.params.load_from_dtensor_(model, state, mesh=mesh)
        for k, layout in _layouts(mesh.names).items():
            assert torch.equal(getattr(model, k).detach(), local_block(whole[k], layout, mesh)), (kind, k)
    # saved on a permuted mesh, loaded unsharded and on the plain mesh
    mesh = permuted_mesh("cols")
    second = str(tmp_path / "cols")
    dcp.save(es.params.to_dtensor(_model(mesh, whole), mesh=mesh), checkpoint_id=second)
    loaded = {k: torch.zeros_like(v) for k, v in whole.items()}
    dcp.load(loaded, checkpoint_id=second)
    for k in whole:
        assert torch.equal(loaded[k], whole[k]), k
    model = _model(plain, zeros)
    state = es.params.to_dtensor(model, mesh=plain)
    dcp.load(state, checkpoint_id=second)
    es.params.load_from_dtensor_(model, state, mesh=plain)
    for k, layout in LAYOUTS.items():
        assert torch.equal(getattr(model, k).detach(), local_block(whole[k], layout, plain)), k
    dist.barrier()


# -- torch.compile ------------------------------------------------------------------------------


def _compiled_case(mesh, fn, formula_in, formula_out, wholes, ref):
    """``fn`` compiled (aot_eager) on this rank's blocks: value and gradients against ``ref`` on whole tensors."""
    xs = [local_block(w, s, mesh).clone().requires_grad_() for w, s in zip(wholes, formula_in)]
    ws = [w.clone().requires_grad_() for w in wholes]
    want = ref(*ws)
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(*xs)
    torch.testing.assert_close(got, local_block(want.detach(), formula_out, mesh))
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(5), dtype=DT)
    want.backward(cot)
    got.backward(local_block(cot, formula_out, mesh))
    for x, w, s in zip(xs, ws, formula_in):
        torch.testing.assert_close(x.grad, local_block(w.grad, s, mesh))


@pytest.mark.ranks(4, timeout=900)
def test_compiled_formulas_on_permuted_mesh():
    torch._dynamo.reset()
    mesh = permuted_mesh("cols")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 6, generator=g, dtype=DT), torch.randn(7, 6, generator=g, dtype=DT)
    f_tp, c_dp_tp = {"tp": {"f": compute_split_shapes(7, 2)}}, {"dp-tp": {"c": compute_split_shapes(6, 4)}}  # uneven

    def mlp(xb, wb):  # an all-gather over the compound group, a contraction, an exchange
        full = es.einshard("b/tp-dp c -> b c", xb, mesh=mesh)
        y = es.einshard("b c, f/tp c -> b/dp f/tp", full, wb, mesh=mesh, shapes=f_tp)
        return es.einshard("b/dp f/tp -> b/tp f/dp", y, mesh=mesh, shapes=f_tp)

    _compiled_case(mesh, mlp, ["b/tp-dp c", "f/tp c"], "b/tp f/dp", [x, w], lambda a, b: a @ b.T)

    def scatter(xb, wb):  # partial sums reduce-scattered over the compound group, then an all-to-all
        y = es.einshard("b c/tp-dp, f c/tp-dp -> b/dp-tp f", xb, wb, mesh=mesh, shapes=c_dp_tp)
        return es.einshard("b/dp-tp f -> b f/dp-tp", y, mesh=mesh)

    _compiled_case(mesh, scatter, ["b c/tp-dp", "f c/tp-dp"], "b f/dp-tp", [x, w], lambda a, b: a @ b.T)


# -- 8 ranks: a shuffled (2, 4) and a shuffled (2, 2, 2) mesh -----------------------------------


@pytest.mark.ranks(8, timeout=900)
def test_shuffled_8_rank_meshes():
    m24 = permuted_mesh("2x4")
    check_many(m24, _on_mesh(CASES, m24.names))
    _check_named(m24, ("dp", "tp"), True, 0)
    _check_named(m24, ("tp",), True, 50)
    m3 = permuted_mesh("2x2x2")
    check_many(m3, _on_mesh(CASES + CASES_3D, m3.names))
    _check_named(m3, ("tp", "dp"), True, 100)
    _check_named(m3, ("dp", "sp", "tp"), True, 200)
    run_roll_cases(m3, [dict(spec="h/dp w/sp-tp", gshape=(5, 9), shifts={"h": 1, "w": 4},
                              shapes={"dp": [3, 2], "sp-tp": [3, 2, 2, 2]})])


# -- ZeRO storage: gathers and reduce-scatters in block order ----------------------------------

# (mesh kind, the group the rows and the storage span): every group here is in another order than its ranks
ZERO_MESHES = {"1d2": "tp", "1d": "tp", "cols": "dp-tp", "sub": "tp-dp"}
ZERO_LAYOUTS = {"norm": "c", "w1": "f c", "w2": "c f"}


def _zero_whole(C, F_):
    g = torch.Generator().manual_seed(11)
    return {"norm": 1 + 0.1 * torch.randn(C, generator=g, dtype=DT), "w1": torch.randn(F_, C, generator=g, dtype=DT),
            "w2": torch.randn(C, F_, generator=g, dtype=DT)}


class _ZeroNet(torch.nn.Module):
    """A scale (a torch op on a stored parameter) and two formulas on stored parameters; rows ``b/G``."""

    def __init__(self, mesh, group, whole):
        super().__init__()
        self.rows, self.mesh = f"b/{group}", mesh
        for k, v in whole.items():
            self.register_parameter(k, torch.nn.Parameter(local_block(v, ZERO_LAYOUTS[k], mesh).clone()))
        C, F_ = whole["w1"].shape[1], whole["w1"].shape[0]
        es.params.register_module_parameter_layouts_(self, ZERO_LAYOUTS, mesh=mesh, grad=group, store=group,
                                              sizes={"c": C, "f": F_})

    def forward(self, x):
        h = torch.tanh(es.einshard(f"{self.rows} c, f c -> {self.rows} f", x * self.norm, self.w1, mesh=self.mesh))
        return es.einshard(f"{self.rows} f, c f -> {self.rows} c", h, self.w2, mesh=self.mesh)


def _zero_reference(whole, x):
    p = {k: v.clone().requires_grad_() for k, v in whole.items()}
    y = torch.tanh((x * p["norm"]) @ p["w1"].T) @ p["w2"].T
    (y**2).sum().backward()
    return y.detach(), {k: v.grad for k, v in p.items()}


def _zero_step(kind, style, sizes):
    """One step of ``style`` (the hooks, or a shard_map body with or without check_vma) on a permuted mesh."""
    mesh, group = permuted_mesh(kind), ZERO_MESHES[kind]
    C, F_, B = sizes
    whole = _zero_whole(C, F_)
    x = torch.randn(B, C, generator=torch.Generator().manual_seed(12), dtype=DT)
    want, grads = _zero_reference(whole, x)
    net = _ZeroNet(mesh, group, whole)
    specs = es.params.param_specs(net)
    state = es.params.to_dtensor(net, mesh=mesh)  # the storage blocks as DTensors (a checkpoint's view)
    for k in ZERO_LAYOUTS:
        assert torch.equal(state[k].full_tensor(), whole[k]), k
    xb = local_block(x, f"b/{group} c", mesh)

    def check(got, names):
        for k, g in zip(names, got):
            torch.testing.assert_close(g, local_block(grads[k], specs[k], mesh), rtol=1e-10, atol=1e-12)

    if style == "hooks":
        handle = es.params.register_native_grad_reduction_hooks_(net, mesh)
        forward = net
    else:
        body = es.shard_map((specs, f"b/{group} c"), f"b/{group} c", mesh=mesh, check_vma=style == "vma")(
            lambda params, xs: torch.func.functional_call(net, params, (xs,)))

        def forward(xs):
            return body(dict(net.named_parameters()), xs)

    # autograd.grad: the gathers' backward reduce-scatters on the spot (no bucket)
    check(torch.autograd.grad((forward(xb) ** 2).sum(), [net.w1, net.norm]), ("w1", "norm"))
    for _ in range(2):  # backward(): bucketed; with the hooks the second step prefetches in the recorded order
        net.zero_grad(set_to_none=True)
        y = forward(xb)
        (y**2).sum().backward()
        if style == "hooks":
            handle.wait()
        torch.testing.assert_close(y.detach(), local_block(want, f"b/{group} c", mesh), rtol=1e-10, atol=1e-12)
        check([getattr(net, k).grad for k in ZERO_LAYOUTS], ZERO_LAYOUTS)
    if style == "hooks":
        handle.remove()


ZERO_SIZES = [(4, 8, 8), (5, 7, 8)]  # (C, F, B): even parameter blocks, and uneven ones


@pytest.mark.ranks(2)
@pytest.mark.parametrize("style", ["hooks", "vma", "per-rank"])
def test_zero_store_on_permuted_mesh_two_ranks(style):
    for sizes in ZERO_SIZES:
        _zero_step("1d2", style, sizes)


@pytest.mark.ranks(4, timeout=600)
def test_zero_store_on_permuted_mesh_hooks():
    for kind in ("1d", "cols", "sub"):
        for sizes in ZERO_SIZES:
            _zero_step(kind, "hooks", sizes)


@pytest.mark.ranks(4, timeout=600)
def test_zero_store_on_permuted_mesh_shard_map():
    for kind in ("1d", "cols", "sub"):
        for sizes in ZERO_SIZES:
            for style in ("vma", "per-rank"):
                _zero_step(kind, style, sizes)
