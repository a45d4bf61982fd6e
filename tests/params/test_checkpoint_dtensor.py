"""``es.params.to_dtensor`` / ``es.params.from_dtensor``: registered layouts as DTensor placements, uneven blocks included."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

import einshard as es
from einshard.testing import local_block

DT = torch.float64


def _model(mesh, layouts, shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    whole = {k: torch.randn(*s, generator=g, dtype=DT) for k, s in shapes.items()}
    model = torch.nn.Module()
    for k, layout in layouts.items():
        model.register_parameter(k, torch.nn.Parameter(local_block(whole[k], layout, mesh).clone()))
        es.params.register_parameter_layout(getattr(model, k), layout, mesh=mesh, grad="dp" if "dp" not in layout else None)
    return model, whole


LAYOUTS = {"w": "f/tp c", "v": "v/dp-tp c", "n": "c", "e": "a/dp b/tp"}
SHAPES = {"w": (10, 3), "v": (7, 3), "n": (3,), "e": (5, 9)}  # 10 over 4, 7 over 8, 5 over 2, 9 over 4: uneven


@pytest.mark.ranks(8)
def test_round_trip_and_placements(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    model, whole = _model(mesh, LAYOUTS, SHAPES)
    dts = es.params.to_dtensor(model, mesh=mesh)
    assert list(dts["w"].placements) == [Replicate(), Shard(0)]
    assert list(dts["v"].placements) == [Shard(0), Shard(0)]
    assert list(dts["n"].placements) == [Replicate(), Replicate()]
    assert list(dts["e"].placements) == [Shard(0), Shard(1)]
    for k in LAYOUTS:
        assert tuple(dts[k].shape) == SHAPES[k]
        assert torch.equal(dts[k].full_tensor(), whole[k]), k
    back = es.params.from_dtensor(dts, model, mesh=mesh)
    for k, p in model.named_parameters():
        assert torch.equal(back[k], p.detach()), k
    # load into a fresh model in place
    fresh, _ = _model(mesh, LAYOUTS, SHAPES, seed=1)
    es.params.load_from_dtensor_(fresh, dts, mesh=mesh)
    for k, p in fresh.named_parameters():
        assert torch.equal(p.detach(), getattr(model, k).detach()), k
    dist.barrier()


@pytest.mark.ranks(8)
def test_dtensor_errors(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    model, _ = _model(mesh, LAYOUTS, SHAPES)
    with pytest.raises(ValueError, match="virtual mesh"):
        es.params.to_dtensor(model, mesh=es.Mesh.virtual((2, 4), ("dp", "tp")))
    dts = es.params.to_dtensor(model, mesh=mesh)
    other, _ = _model(mesh, {"w": "f c/tp", "v": "v/dp-tp c", "n": "c", "e": "a/dp b/tp"}, SHAPES)
    other.w.data = torch.zeros(2, 2, dtype=DT)
    with pytest.raises(ValueError, match="'w' gives a block of shape"):
        es.params.from_dtensor(dts, other, mesh=mesh)
    dist.barrier()
