"""``es.wrap_mesh`` as a drop-in ``DeviceMesh``: attributes, indexing, validation, async all_reduce."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import einshard as es
from einshard.comm.mesh import Mesh


# -- validation (no ranks: names are checked before any group exists) -----------------------


class _FakeMesh:
    """Anything with ``mesh`` and ``mesh_dim_names`` gets the name checks."""

    def __init__(self, shape, names):
        self.mesh = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
        self.mesh_dim_names = names

    def get_coordinate(self):  # pragma: no cover - must not be reached
        raise AssertionError("names must be validated before the mesh is used")


@pytest.mark.parametrize(
    "names, error, fragment",
    [
        (("dp", ""), ValueError, "mesh_dim_names entries must be non-empty strings"),
        (("dp", "dp"), ValueError, "mesh_dim_names cannot repeat a name"),
        (("dp", 3), TypeError, "must be strings"),
        (("dp",), ValueError, "2 dimension(s) but 1 name(s)"),
        (("dp", "tp", "sp"), ValueError, "2 dimension(s) but 3 name(s)"),
        (("dp-x", "tp"), ValueError, "contains '-'"),
        (None, ValueError, "mesh_dim_names"),
    ],
)
def test_bad_names_are_rejected_first(names, error, fragment):
    with pytest.raises(error) as info:
        es.wrap_mesh(_FakeMesh((2, 4), names))
    assert fragment in str(info.value)
    if names is not None:  # the same checks for an explicit mesh_dim_names= on an unnamed mesh
        with pytest.raises(error):
            es.wrap_mesh(_FakeMesh((2, 4), None), mesh_dim_names=names)


def test_explicit_names_must_agree_with_the_mesh():
    with pytest.raises(ValueError, match="contradicts"):
        es.wrap_mesh(_FakeMesh((2, 4), ("dp", "tp")), mesh_dim_names=("tp", "dp"))
    virtual = Mesh.virtual((2, 4), ("dp", "tp"))
    with pytest.raises(ValueError, match="contradicts"):
        es.wrap_mesh(virtual, mesh_dim_names=("a", "b"))
    assert es.wrap_mesh(virtual) is virtual
    assert es.wrap_mesh(virtual, mesh_dim_names=("dp", "tp")) is virtual


@pytest.mark.parametrize(
    "key, error, fragment",
    [
        ("dp-", ValueError, "empty component"),
        ("-tp", ValueError, "empty component"),
        ("dp--sp", ValueError, "empty component"),
        ("dp-dp", ValueError, "repeats a component"),
        (("dp", "dp-sp"), ValueError, "names a mesh dimension twice"),
        ("xx", ValueError, "is not in the mesh"),
        (3, TypeError, "dimension names"),
        (("dp", 1), TypeError, "dimension names"),
    ],
)
def test_bad_lookups(key, error, fragment):
    mesh = Mesh.virtual((2, 2, 2), ("dp", "sp", "tp"))
    with pytest.raises(error, match=fragment):
        mesh[key]


def test_virtual_mesh_interface():
    mesh = Mesh.virtual((2, 2, 2), ("dp", "sp", "tp"), coordinate=(1, 0, 1))
    assert mesh.mesh_dim_names == ("dp", "sp", "tp") and mesh.ndim == 3 and mesh.shape == (2, 2, 2)
    assert mesh.size() == 8 and mesh.size(0) == 2 and mesh.size("dp-tp") == 4
    # DeviceMesh's keyword names
    assert mesh.size(mesh_dim=1) == 2 and mesh.get_local_rank(mesh_dim="tp") == 1
    assert mesh.get_coordinate() == [1, 0, 1] and mesh.get_rank() == 5
    assert mesh.get_local_rank("tp") == 1 and mesh.get_local_rank(0) == 1 and mesh.get_local_rank("tp-dp") == 3
    sub = mesh["sp-dp"]
    assert sub is mesh["dp-sp"] and sub.mesh_dim_names == ("dp-sp",) and sub.shape == (4,)
    assert sub.mesh.tolist() == [1, 3, 5, 7] and sub.get_local_rank() == 2
    two = mesh["tp", "dp"]
    assert two.shape == (2, 2) and two.mesh.tolist() == [[0, 4], [1, 5]] and two.get_coordinate() == [1, 1]
    assert mesh["dp", "sp", "tp"] is mesh
    with pytest.raises(ValueError, match="name one"):
        mesh.get_local_rank()


# -- on ranks: against the DeviceMesh it wraps ------------------------------------------------


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def _expected_ranks(dm, dims) -> list[int]:
    """The global ranks sharing this rank's coordinate outside ``dims`` (mesh-order flattening)."""
    names = dm.mesh_dim_names
    coord = dm.get_coordinate()
    index = tuple(slice(None) if n in dims else c for n, c in zip(names, coord))
    return dm.mesh[index].reshape(-1).tolist()


def _check_drop_in(dm):
    mesh = es.wrap_mesh(dm)
    assert es.wrap_mesh(mesh) is mesh and es.wrap_mesh(dm) is mesh
    names = dm.mesh_dim_names
    assert mesh.mesh_dim_names == names and mesh.shape == tuple(dm.shape) and mesh.ndim == dm.ndim
    assert mesh.size() == dm.size() and [mesh.size(i) for i in range(dm.ndim)] == [dm.size(i) for i in range(dm.ndim)]
    assert mesh.device_type == dm.device_type == "cpu"
    assert mesh.get_coordinate() == list(dm.get_coordinate()) and mesh.get_rank() == dist.get_rank()
    assert torch.equal(mesh.mesh, dm.mesh)
    for i, name in enumerate(names):
        assert mesh.get_group(name) is dm.get_group(name) and mesh.get_group(i) is dm.get_group(i)
        assert mesh.get_local_rank(name) == dm.get_local_rank(name) == mesh.get_local_rank(i)
        sub = mesh[name]
        assert sub.get_group() is dm.get_group(name) and sub.get_local_rank() == dm.get_local_rank(name)
        assert sub.shape == (dm.size(i),)
    # compound names, in either order, and several names
    for k in range(2, len(names) + 1):
        for dims in itertools.combinations(names, k):
            sub = mesh["-".join(dims)]
            assert all(mesh["-".join(p)] is sub for p in itertools.permutations(dims))
            group = sub.get_group()
            assert group is mesh.get_group("-".join(reversed(dims)))  # created once, cached
            assert _ranks(group) == _expected_ranks(dm, dims)
            assert sub.get_local_rank() == _expected_ranks(dm, dims).index(dist.get_rank())
            several = mesh[dims[::-1]]
            assert several.mesh_dim_names == dims[::-1]
            assert [several.get_group(d) for d in dims[::-1]] == [dm.get_group(d) for d in dims[::-1]]
            # the sub-mesh works as mesh= (its dimensions name the parent's groups)
            label = "-".join(dims)
            n = sub.size()
            whole = torch.arange(2.0 * (n + 1)).reshape(n + 1, 2)
            shapes = {label: es.comm.helpers.compute_split_shapes(n + 1, n)}  # uneven
            block = es.testing.local_block(whole, f"a/{label} b", sub, shapes=shapes)
            assert torch.equal(es.einshard(f"a/{label} b -> a b", block, mesh=sub, shapes=shapes), whole)
            assert torch.equal(es.einshard(f"a/{label} b -> a b", block, mesh=mesh, shapes=shapes), whole)
            # named collectives in a body over the sub-mesh name its compound dimension, in either order
            rank = torch.full((1, 2), float(dist.get_rank()))
            for vma, name in ((True, label), (False, "-".join(reversed(dims)))):
                got = es.shard_map(lambda x, name=name: es.spmd.psum(x, name), f"a/{label} b", f"a/{label} b", mesh=sub,
                                   check_vma=vma)(rank)
                assert got.tolist() == [[float(sum(_expected_ranks(dm, dims)))] * 2], (vma, name, got)
            # a real DeviceMesh built from the parent's groups, on demand
            assert sub.device_mesh.get_group(0) is group
    # an unnamed mesh with names given, and names that contradict
    with pytest.raises(ValueError, match="contradicts"):
        es.wrap_mesh(dm, mesh_dim_names=tuple(f"x{i}" for i in range(dm.ndim)))
    from torch.distributed.device_mesh import init_device_mesh

    unnamed = es.wrap_mesh(init_device_mesh("cpu", tuple(dm.shape)), mesh_dim_names=names)
    assert unnamed.mesh_dim_names == names
    for name in names:
        assert _ranks(unnamed.get_group(name)) == _ranks(dm.get_group(name))
    return True


def _check_async_all_reduce(dm):
    mesh = es.wrap_mesh(dm)
    groups = [mesh.get_group(n) for n in mesh.mesh_dim_names] + [mesh["-".join(mesh.mesh_dim_names)].get_group()]
    one = es.wrap_mesh(es.testing.make_mesh((1, 8), ("one", "all")))
    groups.append(one.get_group("one"))  # a one-rank group
    for group in groups:
        for op in ("sum", "mean"):
            x = torch.full((3,), float(dist.get_rank() + 1))
            y, work = es.comm.helpers.all_reduce(x, group, op=op, async_op=True)
            assert work.wait() in (True, None)
            ranks = _ranks(group)
            total = float(sum(r + 1 for r in ranks))
            expect = total if op == "sum" else total / len(ranks)
            assert torch.allclose(y, torch.full((3,), expect)), (op, ranks, y)
    return True


@pytest.mark.ranks(8)
def test_wrapped_mesh_is_a_drop_in(mesh):
    dm = mesh if not isinstance(mesh, es.testing.MeshSpec) else mesh.build()
    assert _check_drop_in(dm)


@pytest.mark.ranks(8)
def test_async_all_reduce_returns_a_waitable_work(mesh):
    assert _check_async_all_reduce(mesh)
