"""DTensor interop: shard_map converts DTensor arguments from their placements and returns DTensors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import einshard as es
from einshard.spmd.dtensor import chunk_splits, from_dtensor, to_dtensor
from einshard.spmd.shard_map import shard_map
from einshard.testing import local_block
from einshard.spmd.tree import tree_gather, tree_shard

DT = torch.float64


def test_chunk_splits():
    assert chunk_splits(9, [4]) == (3, 3, 3, 0)
    assert chunk_splits(10, [4]) == (3, 3, 3, 1)
    assert chunk_splits(9, [2, 4]) == (2, 2, 1, 0, 1, 1, 1, 1)
    assert chunk_splits(8, [2, 2]) == (2, 2, 2, 2)


def _make(mesh, whole, placements, seed):
    """A DTensor with these placements whose full value is ``whole`` (partial: random contributions)."""
    if any(isinstance(p, Partial) for p in placements):
        pdims = [d for d, p in zip(mesh.names, placements) if isinstance(p, Partial)]
        share = torch.randn(whole.shape, generator=torch.Generator().manual_seed(seed), dtype=DT)
        first = all(mesh.coordinate[mesh.names.index(d)] == 0 for d in pdims)
        mine = whole - share * (mesh.size(tuple(pdims)) - 1) if first else share
        block = mine  # this rank's chunk of its own contribution (distribute_tensor would broadcast it)
        for name, p in zip(mesh.names, placements):
            if isinstance(p, Shard):
                sizes = chunk_splits(block.shape[p.dim], [mesh.size((name,))])
                i = mesh.coordinate[mesh.names.index(name)]
                block = block.narrow(p.dim, sum(sizes[:i]), sizes[i])
        dt = DTensor.from_local(block, mesh.device_mesh, placements, run_check=False, shape=whole.shape,
                                stride=whole.stride())
    else:
        dt = distribute_tensor(whole, mesh.device_mesh, placements)
    return dt.detach().requires_grad_()


CASES = [
    # (placements, in spec, out spec, expected output placements)
    ([Shard(0), Replicate()], "a/dp b", "a/dp b", [Shard(0), Replicate()]),
    ([Replicate(), Shard(0)], "a/tp b", "a/tp b", [Replicate(), Shard(0)]),  # 9 over 4: chunk [3,3,3,0] vs [2,2,2,3]
    ([Shard(1), Shard(0)], "a b", "a b", [Replicate(), Replicate()]),
    ([Shard(0), Shard(0)], "a/dp-tp b", "a/dp-tp b", [Shard(0), Shard(0)]),  # nested uneven
    ([Partial(), Shard(1)], "a b/tp", "a b/tp // dp", [Partial(), Shard(1)]),
    ([Shard(1), Replicate()], "a b -> a/tp b", "a/tp b -> a b/dp", [Shard(1), Replicate()]),  # conversions
    ([Replicate(), Replicate()], "a b", "a b -> a/tp b/dp", [Shard(1), Shard(0)]),
]


@pytest.mark.ranks(8)
def test_dtensor_round_trips(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    errs = {}
    for k, (placements, in_spec, out_spec, out_placements) in enumerate(CASES):
        whole = torch.randn(9, 6, generator=torch.Generator().manual_seed(k), dtype=DT)
        cot = torch.randn(9, 6, generator=torch.Generator().manual_seed(50 + k), dtype=DT)
        dt = _make(mesh, whole, placements, seed=100 + k)
        inner = in_spec.split("->")[-1].strip()
        seen = {}

        @shard_map(in_spec, out_spec, mesh=mesh)
        def body(x):
            seen["local"] = x.detach().clone()
            # declared partial over dp, an invariant value is every dp rank's contribution: halve it
            return x if "//" in out_spec else 2 * x

        out = body(dt)
        assert isinstance(out, DTensor) and list(out.placements) == out_placements, (k, out.placements)
        assert tuple(out.shape) == (9, 6)
        want = 2 * whole
        errs[f"{k}/local"] = (seen["local"] - local_block(whole, inner, mesh)).abs().max().item() if "//" not in in_spec else 0.0
        full = out.full_tensor()
        errs[f"{k}/value"] = (full - want).abs().max().item()
        (full * cot).sum().backward()
        g = dt.grad.full_tensor() if isinstance(dt.grad, DTensor) else dt.grad
        errs[f"{k}/grad"] = (g - 2 * cot).abs().max().item()
    names = sorted(errs)
    t = torch.tensor([errs[n] for n in names], dtype=DT)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    bad = {n: v for n, v in zip(names, t.tolist()) if not v <= 1e-12}
    assert not bad, bad


@pytest.mark.ranks(8)
def test_dtensor_helpers_and_mixed_arguments(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    whole = torch.arange(30, dtype=DT).reshape(10, 3)
    dt = distribute_tensor(whole, mesh.device_mesh, [Replicate(), Shard(0)])  # 10 over 4: [3, 3, 3, 1]
    local, layout = from_dtensor(dt, "a/dp b", mesh)  # 10 over dp: [5, 5]
    assert torch.equal(local, local_block(whole, "a/dp b", mesh))
    back = to_dtensor(local, layout, mesh)
    assert list(back.placements) == [Shard(0), Replicate()] and torch.equal(back.full_tensor(), whole)

    # a DTensor and a plain tensor together: outputs come back as DTensors
    @shard_map(("a/tp b", "b"), ("a/tp b", "b"), mesh=mesh)
    def add(x, bias):
        return x + bias, bias * 1

    y, b = add(dt, torch.ones(3, dtype=DT))
    assert isinstance(y, DTensor) and isinstance(b, DTensor)
    assert torch.equal(y.full_tensor(), whole + 1) and list(b.placements) == [Replicate(), Replicate()]

    other = distribute_tensor(whole, mesh.device_mesh["tp"], [Shard(0)])
    with pytest.raises(ValueError, match="DTensor lives on mesh"):
        add(other, torch.ones(3, dtype=DT))

    # DTensor leaves under partial specs: the value on the first rank of dp, as for plain tensors (before:
    # a replicated DTensor was kept on every dp rank, and gathering doubled it)
    w = torch.arange(12, dtype=DT).reshape(4, 3)
    dts = {"r": distribute_tensor(w, mesh.device_mesh, [Replicate(), Replicate()]),
           "s": distribute_tensor(w, mesh.device_mesh, [Replicate(), Shard(0)])}
    specs = {"r": "a b // dp", "s": "a/tp b // dp"}
    local = tree_shard(dts, specs, mesh=mesh)
    whole = tree_gather(local, specs, mesh=mesh)
    assert torch.equal(local["r"], w if mesh.coordinate[0] == 0 else torch.zeros_like(w))
    assert torch.equal(whole["r"], w) and torch.equal(whole["s"], w)
    dist.barrier()
