"""``es.tree_shard`` / ``es.tree_gather``: whole model states ↔ sharded ones, exactly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import einshard as es
from einshard.comm.mesh import Mesh
from einshard.testing import local_block
from einshard.spmd.tree import tree_gather, tree_shard

DT = torch.float64


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(10, 6, generator=g, dtype=DT),  # f over tp: uneven
        "b1": torch.randn(10, generator=g, dtype=DT),
        "emb": torch.randn(7, 5, generator=g, dtype=DT),  # 7 rows over 8 ranks: one rank holds none
        "ln": torch.nn.Parameter(torch.randn(6, generator=g, dtype=DT)),
        "acc": torch.randn(4, generator=g, dtype=DT),  # partial over dp
        "step": 3,
        "meta": {"name": "block", "sizes": [1, 2]},
    }


SPECS = {
    "w1": "f/tp c",
    "b1": "f/tp",
    "emb": "v/dp-tp c",
    "ln": "c",
    "acc": "a // dp",
    "step": None,
    "meta": None,
}


@pytest.mark.ranks(8)
def test_tree_round_trips_exact(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    state = _state()
    for shapes in (None, {"tp": {"f": [1, 4, 0, 5]}}):
        local = tree_shard(state, SPECS, mesh=mesh, shapes=shapes)
        assert local["step"] == 3 and local["meta"] == state["meta"]
        assert type(local["ln"]) is torch.Tensor  # parameters come back as plain tensors
        for k in ("w1", "b1", "emb", "ln"):
            assert torch.equal(local[k], local_block(state[k], SPECS[k], mesh, shapes=shapes)), k
        # partial: the first dp rank holds the value, the others zeros
        assert torch.equal(local["acc"], state["acc"] if mesh.coordinate[0] == 0 else torch.zeros(4, dtype=DT))
        # the sizes are discovered: no shapes= needed to gather uneven blocks
        whole = tree_gather(local, SPECS, mesh=mesh)
        for k in ("w1", "b1", "emb", "ln", "acc"):
            assert torch.equal(whole[k], state[k].detach()), k
        assert whole["step"] == 3 and whole["meta"] == state["meta"]
    dist.barrier()


@pytest.mark.ranks(8)
def test_optimizer_state_round_trip(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    specs = {"w": "f/tp c", "b": "c"}
    whole = {"w": torch.randn(8, 3, dtype=DT, generator=torch.Generator().manual_seed(1)),
             "b": torch.randn(3, dtype=DT, generator=torch.Generator().manual_seed(2))}
    with es.use_mesh(mesh):  # the ambient mesh works too
        params = tree_shard(whole, specs)
    # an Adam state_dict (built by hand: a real optimizer step costs seconds of imports on 8 ranks)
    state = {
        "state": {
            i: {"step": torch.tensor(1.0), "exp_avg": 0.1 * p, "exp_avg_sq": 0.01 * p * p}
            for i, p in enumerate(params.values())
        },
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0, "params": [0, 1]}],
    }
    opt_specs = {"state": {0: {"step": None, "exp_avg": "f/tp c", "exp_avg_sq": "f/tp c"},
                           1: {"step": None, "exp_avg": "c", "exp_avg_sq": "c"}},
                 "param_groups": None}
    gathered = tree_gather(state, opt_specs, mesh=mesh)
    assert gathered["state"][0]["exp_avg"].shape == (8, 3)
    again = tree_shard(gathered, opt_specs, mesh=mesh)
    for i in (0, 1):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(again["state"][i][k], state["state"][i][k])
        assert torch.equal(again["state"][i]["step"], state["state"][i]["step"])
    assert again["param_groups"] == state["param_groups"]
    dist.barrier()


def test_tree_errors():
    mesh = Mesh.virtual((2, 4), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"specs are layouts, not conversions"):
        tree_shard({"w": torch.ones(2)}, {"w": "a -> a/dp"}, mesh=mesh)
    with pytest.raises(ValueError, match=r"specs\['w'\] is a dict with keys \['x'\] but tree\['w'\] is a Tensor"):
        tree_gather({"w": torch.ones(2)}, {"w": {"x": "a"}}, mesh=mesh)
    with pytest.raises(ValueError, match=r"keys only in tree: \['v'\]"):
        tree_shard({"w": torch.ones(2), "v": 1}, {"w": "a"}, mesh=mesh)
    # on a virtual mesh (no communication) sharding is plain slicing
    out = tree_shard({"w": torch.arange(8.0), "n": None}, {"w": "a/tp", "n": None}, mesh=mesh)
    assert torch.equal(out["w"], torch.arange(2.0)) and out["n"] is None


@pytest.mark.ranks(8, timeout=30)
def test_tree_gather_finds_uneven_blocks_after_ellipsis_and_in_groups(mesh_2x4):
    """Sharded axes after '...' and in factored groups: discovered too (before: an even split was assumed)."""
    mesh = es.wrap_mesh(mesh_2x4)
    g = torch.Generator().manual_seed(5)
    state = {
        "w": torch.randn(2, 3, 10, generator=g, dtype=DT),  # c = 10 over tp: [3, 3, 3, 1]
        "g": torch.randn(3, 20, generator=g, dtype=DT),  # (c p) with p = 2
        "h": torch.randn(10, 3, generator=g, dtype=DT),  # a one-factor group, partial over dp
        "f": torch.randn(7, 3, 2, generator=g, dtype=DT),  # 7 over 8 ranks, then '...'
    }
    specs = {"w": "... c/tp", "g": "a (c/tp p)", "h": "(c/tp) b // dp", "f": "(v/dp-tp) ..."}
    for shapes in (None, {"tp": {"c": [4, 0, 5, 1]}}):
        local = tree_shard(state, specs, mesh=mesh, shapes=shapes, sizes={"p": 2})
        whole = tree_gather(local, specs, mesh=mesh, sizes={"p": 2})  # no shapes=: discovered
        for k in state:
            assert torch.equal(whole[k], state[k]), k

