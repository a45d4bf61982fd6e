"""``es.params.param_specs``: registered layouts as a spec pytree, read by shard_map, tree_shard and tree_gather."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import einshard as es
from einshard.testing import local_block

DT = torch.float64


class Block(torch.nn.Module):
    """Column-parallel up, row-parallel down, a replicated norm; sizes uneven over tp=4."""

    def __init__(self, c=6, f=10, dtype=DT):
        super().__init__()
        self.up = torch.nn.Linear(c, f, dtype=dtype)
        self.down = torch.nn.Linear(f, c, dtype=dtype)
        self.norm = torch.nn.LayerNorm(c, dtype=dtype)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.extra = torch.nn.Parameter(torch.ones(2, dtype=dtype))  # never registered

    def register(self, names=("dp", "tp")):
        es.params.register_linear_parameters_(self.up, weight_layout="f/tp c", mesh_dim_names=names)
        es.params.register_parameter_layout(self.down.weight, "c f/tp", mesh_dim_names=names)
        es.params.register_parameter_layout(self.down.bias, "c", mesh_dim_names=names)
        es.params.register_norm_parameters_(self.norm, mesh_dim_names=names)
        return self


SPECS = {
    "up.weight": "f/tp c", "up.bias": "f/tp", "down.weight": "c f/tp", "down.bias": "c",
    "norm.weight": "c", "norm.bias": "c", "extra": None,
}


def test_param_specs_of_modules_and_trees():
    block = Block().register()
    assert es.params.param_specs(block) == SPECS
    sd = block.state_dict(keep_vars=True)
    specs = es.params.param_specs(sd)
    assert specs == {**SPECS, "steps": None}
    nested = {"model": dict(block.named_parameters()), "step": 3}
    assert es.params.param_specs(nested) == {"model": SPECS, "step": None}
    assert es.params.param_specs(Block()) == {k: None for k in SPECS}
    with pytest.raises(ValueError, match="no parameter in the tree has a registered layout"):
        es.tree_gather(Block().state_dict(), mesh=es.Mesh.virtual((2, 4), ("dp", "tp")))


def _whole_state(seed=0):
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in Block().state_dict().items()}


@pytest.mark.ranks(8)
def test_tree_shard_and_gather_use_the_registered_layouts(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    whole = _whole_state()
    full = Block().register()  # whole-size parameters carrying the layouts
    full.load_state_dict(whole)
    local = es.tree_shard(full, mesh=mesh)
    for name, spec in SPECS.items():
        assert torch.equal(local[name], local_block(whole[name], spec, mesh) if spec else whole[name]), name
    # a model holding this rank's blocks: gathered back exactly, with no spec written anywhere
    model = Block().register()
    for name, p in model.named_parameters():
        p.data = local[name].clone()
    gathered = es.tree_gather(model, mesh=mesh)
    for name in SPECS:
        assert torch.equal(gathered[name], whole[name]), name
    # the same specs as a shard_map in-spec
    x = torch.randn(4, 6, dtype=DT, generator=torch.Generator().manual_seed(1))

    @es.shard_map((es.params.param_specs(model), "b/dp c"), "b/dp f/tp", mesh=mesh, sizes={"b": 4, "f": 10})
    def up(params, xb):
        return es.einshard("b/dp c, f/tp c -> b/dp f/tp", xb, params["up.weight"], sizes={"f": 10}) + params["up.bias"]

    y = up(dict(model.named_parameters()), local_block(x, "b/dp c", mesh))
    ref = x @ whole["up.weight"].T + whole["up.bias"]
    torch.testing.assert_close(y, local_block(ref, "b/dp f/tp", mesh), rtol=1e-12, atol=1e-12)
    dist.barrier()


@pytest.mark.ranks(8)
def test_dict_specs_for_an_ordered_state_dict(mesh_2x4):
    """A plain dict of specs flattens its keys sorted, a state_dict in insertion order: matched by key."""
    from collections import OrderedDict

    mesh = es.wrap_mesh(mesh_2x4)
    g = torch.Generator().manual_seed(3)
    tree = OrderedDict(w=torch.randn(8, 3, generator=g, dtype=DT), a=torch.randn(4, 2, generator=g, dtype=DT))
    local = es.tree_shard(tree, {"w": "f/tp c", "a": "x/dp y"}, mesh=mesh)
    assert torch.equal(local["w"], local_block(tree["w"], "f/tp c", mesh))
    assert torch.equal(local["a"], local_block(tree["a"], "x/dp y", mesh))
    dist.barrier()
