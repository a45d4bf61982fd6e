"""Shard metadata: local slices/shapes of a parameter under its layout, against einshard's own split."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import einshard as es
from einshard.core._split import compute_split_shapes_for_factors
from einshard.params import ParameterState, ParamShardMetadata
from einshard.testing import local_block

NAMES = ("dp", "sp", "tp")


def _state(layout, names=NAMES):
    return ParameterState.from_layout(layout, mesh_dim_names=names)


def test_shard_dims():
    p = es.params.register_parameter_layout(torch.nn.Parameter(torch.zeros(2, 3)), "a/tp b/dp-sp")
    assert es.params.param_shard_dims(p) == ("tp", "dp-sp") == es.params.param_shard_dims(es.params.get_parameter_state(p))
    with pytest.raises(ValueError, match="ParameterState"):
        es.params.param_shard_dims(torch.nn.Parameter(torch.zeros(1)))


@pytest.mark.parametrize("shape", [(8, 6), (7, 5), (3, 2)])
def test_slices_tile_the_tensor_on_every_coordinate(shape):
    """Over all coordinates of a (2, 2, 2) mesh the blocks are einshard's split, compound index in mesh order."""
    for layout in ("a/tp b", "a/sp-dp b/tp", "a/dp-sp b"):
        seen = torch.zeros(shape, dtype=torch.int64)
        for coord in itertools.product(range(2), repeat=3):
            mesh = es.Mesh.virtual((2, 2, 2), NAMES, coordinate=coord)
            s = _state(layout)
            slices = es.params.param_local_slices(s, shape, mesh)
            shape_local = es.params.param_local_shape(s, shape, mesh)
            assert all(isinstance(n, int) for n in shape_local)
            block = seen[slices]
            assert tuple(block.shape) == shape_local
            block += 1
            # row-major over the components in mesh order: dp-sp and sp-dp agree
            g = s.layout_shard_dims[0]
            n = mesh.size(g)
            splits = compute_split_shapes_for_factors(shape[0], n, 1)
            r = mesh.index(g)
            assert slices[0] == slice(sum(splits[:r]), sum(splits[:r]) + splits[r])
        replicas = 8 // (mesh.size(s.layout_shard_dims[0]) * (mesh.size("tp") if "b/tp" in layout else 1))
        assert torch.equal(seen, torch.full(shape, replicas))


def test_factors_and_metadata():
    mesh = es.Mesh.virtual((1, 1, 4), NAMES, coordinate=(0, 0, 3))
    s = _state("a/tp b")
    assert es.params.param_local_slices(s, (721, 2), mesh, factors={"a": 4}) == (slice(540, 721), slice(None))
    m = es.params.param_shard_metadata(s, (10, 2), mesh)
    assert m == ParamShardMetadata((10, 2), (slice(9, 10), slice(None)), (1, 2), ("tp",))
    with pytest.raises(Exception):
        m.local_shape = (1,)


def test_errors():
    mesh = es.Mesh.virtual((2, 2, 2), NAMES)
    with pytest.raises(ValueError, match="layout-free"):
        es.params.param_local_slices(ParameterState(None), (2,), mesh)
    with pytest.raises(ValueError, match="rank"):
        es.params.param_local_slices(_state("a b"), (2,), mesh)
    with pytest.raises(ValueError, match=r"\.\.\."):
        es.params.param_local_slices(ParameterState.from_spec("... a"), (2, 2), mesh)
    with pytest.raises(ValueError, match="'xx'"):
        es.params.param_local_slices(_state("a/xx", ()), (2,), mesh)
    with pytest.raises(NotImplementedError, match="factored-axis"):
        es.params.param_local_slices(ParameterState.from_spec("(a/tp b) c"), (4, 2), mesh)
    assert es.params.param_local_slices(ParameterState.from_spec("(a b) c"), (4, 2), mesh) == (slice(None), slice(None))
    with pytest.raises(TypeError, match="mesh"):
        es.params.param_local_slices(_state("a/tp"), (4,), object())


@pytest.mark.ranks(8)
def test_local_slices_match_tree_shard_on_device_meshes(mesh):
    """On real meshes the slices cut exactly the block einshard's own sharding gives (uneven sizes too)."""
    names = tuple(mesh.mesh_dim_names)
    wrapped = es.wrap_mesh(mesh)
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(7, 5, generator=g)
    layouts = ["a/tp b", "a b/tp"]
    if len(names) > 1:
        layouts += [f"a/{names[0]} b/tp", f"a/{'-'.join(reversed(names))} b"]
    for layout in layouts:
        s = ParameterState.from_layout(layout, mesh_dim_names=names)
        compound = any("-" in d for d in s.layout_shard_dims)
        for m in ([wrapped] if compound else [wrapped, mesh]):
            block = whole[es.params.param_local_slices(s, whole.shape, m)]
            assert torch.equal(block, local_block(whole, layout, wrapped)), (layout, m)
            assert tuple(block.shape) == es.params.param_local_shape(s, whole.shape, m)
        if compound:
            with pytest.raises(ValueError, match="wrap_mesh"):
                es.params.param_local_slices(s, whole.shape, mesh)
    # a raw DeviceMesh without a process group: unsharded layouts work, sharded ones say why not
    real = dist.is_initialized
    dist.is_initialized = lambda: False
    try:
        s = ParameterState.from_layout("a b", mesh_dim_names=names)
        assert es.params.param_local_slices(s, (4, 2), mesh) == (slice(None), slice(None))
        with pytest.raises(RuntimeError, match="initialized process group"):
            es.params.param_local_slices(ParameterState.from_layout("a/tp b", mesh_dim_names=names), (4, 2), mesh)
    finally:
        dist.is_initialized = real
    dist.barrier()
