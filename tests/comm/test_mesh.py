"""Tests of einshard.comm.mesh: compound groups, rank order, errors, the ambient mesh."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from einshard.comm import comm_stats
from einshard.comm.mesh import Mesh, as_mesh, current_mesh, resolve_mesh, use_mesh, wrap_mesh

# -- without ranks ------------------------------------------------------------------


def test_virtual_sizes_and_indices():
    m = Mesh.virtual((2, 2, 2), ("dp", "sp", "tp"), coordinate=(1, 0, 1))
    assert m.dims("tp-dp") == ("dp", "tp")
    assert m.dims("dp-tp") == ("dp", "tp")
    assert m.size("dp-sp-tp") == 8 and m.size("sp") == 2
    # mesh-order flattening, whatever order the name uses
    assert m.index("dp-tp") == m.index("tp-dp") == 1 * 2 + 1
    assert m.index("dp-sp-tp") == 1 * 4 + 0 * 2 + 1
    assert m.label(("tp", "dp")) == "dp-tp"


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("dp-", "empty component"),
        ("-tp", "empty component"),
        ("dp--tp", "empty component"),
        ("dp-dp", "repeats a component"),
        ("tp-sp-tp", "repeats a component"),
        ("xx", "'xx'"),
        ("dp-xx", "'xx'"),
    ],
)
def test_bad_dimension_names(name, fragment):
    m = Mesh.virtual((2, 2, 2), ("dp", "sp", "tp"))
    with pytest.raises(ValueError) as info:
        m.dims(name)
    message = str(info.value)
    assert fragment in message
    # every error lists the mesh's dimensions
    assert "['dp', 'sp', 'tp']" in message


def test_virtual_mesh_has_no_groups():
    m = Mesh.virtual((2, 4), ("dp", "tp"))
    with pytest.raises(ValueError, match="virtual"):
        m.group("tp")


def test_resolve_without_mesh():
    assert current_mesh() is None
    with pytest.raises(ValueError, match=r"Distributed einshard operations require mesh=\.\.\."):
        resolve_mesh(None)


def test_non_mesh_argument():
    with pytest.raises(ValueError, match="DeviceMesh"):
        resolve_mesh(object())
    with pytest.raises(ValueError, match="DeviceMesh"):
        wrap_mesh(object())
    with pytest.raises(ValueError, match="wrap_mesh needs a DeviceMesh"):
        wrap_mesh(None)


# -- on ranks ---------------------------------------------------------------------------


def _ranks_of(group) -> list[int]:
    return dist.get_process_group_ranks(group)


@pytest.mark.ranks(8)
def test_compound_groups(mesh_2x4, mesh_2x2x2):
    rank = dist.get_rank()
    m = wrap_mesh(mesh_2x2x2)
    assert wrap_mesh(mesh_2x2x2) is m, "wrap_mesh must be cached per DeviceMesh"
    assert wrap_mesh(m) is m
    dp, sp, tp = m.coordinate
    assert (dp, sp, tp) == (rank // 4, rank // 2 % 2, rank % 2)

    # the same group object whatever the order of the components
    assert m.group("dp-sp") is m.group("sp-dp")
    assert m.group("tp-dp") is m.group("dp-tp")
    assert m.group("tp-sp-dp") is m.group("dp-sp-tp")
    assert m.group(("tp", "dp")) is m.group("dp-tp")  # a sequence of names works alike
    # created once and cached
    assert m.group("sp-tp") is m.group("sp-tp")

    # rank order follows the mesh's dimension order (dp, sp, tp): row-major
    expected = {
        "dp-sp": [d * 4 + s * 2 + tp for d in range(2) for s in range(2)],
        "dp-tp": [d * 4 + sp * 2 + t for d in range(2) for t in range(2)],
        "sp-tp": [dp * 4 + s * 2 + t for s in range(2) for t in range(2)],
        "dp-sp-tp": list(range(8)),
    }
    for name, ranks in expected.items():
        group = m.group(name)
        assert _ranks_of(group) == ranks, (name, _ranks_of(group), ranks)
        assert dist.get_rank(group) == ranks.index(rank) == m.index(name), name
        assert m.size(name) == len(ranks)
        if group is not dist.group.WORLD:  # WORLD may carry another mesh's label
            assert comm_stats.group_label(group) == name
    assert m.group("dp-sp-tp") is dist.group.WORLD

    # atomic dimensions are the DeviceMesh's own groups
    for i, name in enumerate(m.names):
        assert _ranks_of(m.group(name)) == _ranks_of(mesh_2x2x2.get_group(name))
        assert m.size(name) == 2 and m.index(name) == m.coordinate[i]

    # the group collectively works and has the right membership
    import torch

    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=m.group("tp-dp"))
    assert t.item() == sum(expected["dp-tp"])

    m2 = wrap_mesh(mesh_2x4)
    assert _ranks_of(m2.group("tp-dp")) == list(range(8))
    assert m2.rank_of((1, 2)) == 6


@pytest.mark.ranks(8)
def test_errors_on_ranks(mesh_2x2x2):
    m = wrap_mesh(mesh_2x2x2)
    for name in ("dp-", "sp-sp", "dp-pp", "pp"):
        with pytest.raises(ValueError) as info:
            m.group(name)
        assert "['dp', 'sp', 'tp']" in str(info.value), (name, str(info.value))

    # a plain DeviceMesh cannot resolve compound names
    plain = resolve_mesh(mesh_2x2x2)
    assert plain.allow_compound is False
    with pytest.raises(ValueError, match="wrap_mesh"):
        plain.group("dp-sp")
    with pytest.raises(ValueError, match="wrap_mesh"):
        plain.dims("sp-tp")
    # ...but atomic ones are fine, and wrapping fixes compound ones
    assert _ranks_of(plain.group("sp")) == _ranks_of(mesh_2x2x2.get_group("sp"))
    assert wrap_mesh(plain) is m
    assert plain.size("tp") == 2


@pytest.mark.ranks(8)
def test_use_mesh(mesh_2x4):
    assert current_mesh() is None
    with use_mesh(mesh_2x4) as m:
        assert isinstance(m, Mesh)
        assert current_mesh() is m
        assert m.device_mesh is mesh_2x4
        assert resolve_mesh(None) is m
        inner = wrap_mesh(mesh_2x4)
        with use_mesh(inner) as m2:
            assert m2 is inner and current_mesh() is inner
            assert resolve_mesh(None).group("tp-dp") is dist.group.WORLD
        assert current_mesh() is m
    assert current_mesh() is None
    with pytest.raises(ValueError, match="require mesh="):
        resolve_mesh(None)
    # an explicit mesh wins over the ambient one
    with use_mesh(mesh_2x4):
        assert resolve_mesh(wrap_mesh(mesh_2x4)).allow_compound


@pytest.mark.ranks(2)
def test_wrappers_belong_to_their_device_mesh_objects():
    # DeviceMesh compares by value: two of them over the same ranks with their own process groups are equal,
    # and each wrapper must keep its own (a cache by value once handed one mesh's wrapper for the other)
    a = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("tp",))
    b = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("tp",))
    assert a == b and a is not b
    for wrap in (wrap_mesh, as_mesh):
        wa, wb = wrap(a), wrap(b)
        assert wa.device_mesh is a and wb.device_mesh is b
        assert wrap(a) is wa and wrap(b) is wb  # still cached, per object
