"""Checkpoints with torch.distributed.checkpoint: save on a 2x4 mesh, load on 4x2, 8x1 and unsharded, exactly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import einshard as es
from einshard.testing import local_block, make_mesh

DT = torch.float64
LAYOUTS = {"up": "f/tp c", "up_b": "f/tp", "down": "c f/tp", "emb": "v/dp-tp c", "norm": "c"}
SHAPES = {"up": (10, 6), "up_b": (10,), "down": (6, 10), "emb": (13, 6), "norm": (6,)}  # uneven over 4, 8


def _whole(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=g, dtype=DT) for k, s in SHAPES.items()}


def _model(mesh, values):
    model = torch.nn.Module()
    for k, layout in LAYOUTS.items():
        model.register_parameter(k, torch.nn.Parameter(local_block(values[k], layout, mesh).clone()))
        es.params.register_parameter_layout(getattr(model, k), layout, mesh=mesh)
    return model


@pytest.mark.ranks(8)
def test_save_on_2x4_load_on_other_meshes(mesh_2x4, tmp_path):
    whole = _whole()
    path = str(tmp_path / "ckpt")
    src = es.wrap_mesh(mesh_2x4)
    dcp.save(es.params.to_dtensor(_model(src, whole), mesh=src), checkpoint_id=path)
    zeros = {k: torch.zeros_like(v) for k, v in whole.items()}
    for shape in ((4, 2), (8, 1)):
        mesh = es.wrap_mesh(make_mesh(shape, ("dp", "tp")))
        model = _model(mesh, zeros)
        state = es.params.to_dtensor(model, mesh=mesh)
        dcp.load(state, checkpoint_id=path)
        es.params.load_from_dtensor_(model, state, mesh=mesh)
        for k, layout in LAYOUTS.items():
            assert torch.equal(getattr(model, k).detach(), local_block(whole[k], layout, mesh)), (shape, k)
    plain = {k: torch.zeros_like(v) for k, v in whole.items()}  # an unsharded model: whole tensors
    dcp.load(plain, checkpoint_id=path)
    for k in whole:
        assert torch.equal(plain[k], whole[k]), k
    dist.barrier()
