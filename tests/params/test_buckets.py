"""``GradBucketer``: bucketed async gradient sums, started during backward, equal to synchronous ones."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import einshard as es
from einshard.params.buckets import GradBucketer

DT = torch.float64


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    # integer-valued weights and data: every sum is exact in any order
    return [torch.nn.Parameter(torch.randint(-3, 4, shape, generator=g).to(DT)) for shape in ((5, 4), (4, 3), (3,), (3, 2))]


def _loss(params, x):
    h = (x @ params[0]) @ params[1] + params[2]
    return (h @ params[3]).pow(2).sum()


def _data():
    g = torch.Generator().manual_seed(100 + dist.get_rank())  # different data on every rank
    return torch.randint(-2, 3, (2, 5), generator=g).to(DT)


def _sync_grads(params, groups, mesh, x, times=1):
    for _ in range(times):
        _loss(params, x).backward()
    for p, gs in zip(params, groups):
        dims = tuple(d for d in mesh.names if any(d in g.split("-") for g in gs))
        if dims and mesh.size(dims) > 1:
            dist.all_reduce(p.grad, group=mesh.group(dims))
    return [p.grad.clone() for p in params]


GROUPS = [("dp",), ("dp-sp",), ("tp",), ()]


@pytest.mark.ranks(8)
@pytest.mark.parametrize("bucket_bytes", [1, 64, 2**20])
def test_async_equals_sync_and_starts_during_backward(mesh_2x2x2, bucket_bytes):
    mesh = es.wrap_mesh(mesh_2x2x2)
    x = _data()
    ref = _sync_grads(_model(), GROUPS, mesh, x)
    params = _model()
    started_before_end = []
    bucketer = GradBucketer(list(zip(params, GROUPS)), mesh, bucket_bytes=bucket_bytes)
    # params[0] gets its gradient last: record how many all-reduces are in flight when it arrives
    params[0].register_hook(lambda g: started_before_end.append(bucketer.pending))
    _loss(params, x).backward()
    in_flight = bucketer.pending
    bucketer.wait()
    assert bucketer.pending == 0
    for p, r in zip(params, ref):
        assert torch.equal(p.grad, r)
    if bucket_bytes == 1:  # one bucket per parameter: the later ones started before backward ended
        assert started_before_end == [2] and in_flight == 3
    else:
        assert in_flight >= 1
    # repeated backward without zeroing accumulates exactly, twice
    _loss(params, x).backward()
    bucketer.wait()
    ref2 = _sync_grads(_model(), GROUPS, mesh, x, times=2)
    for p, r in zip(params, ref2):
        assert torch.equal(p.grad, r)
    bucketer.remove().remove()  # idempotent
    for p in params:
        p.grad = None
    _loss(params, x).backward()  # no hooks any more: local gradients only
    assert bucketer.pending == 0
    dist.barrier()


def test_bucketer_rejects_bad_input():
    mesh = es.Mesh.virtual((2, 4), ("dp", "tp"))
    w = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="bucket_bytes"):
        GradBucketer([(w, ("dp",))], mesh, bucket_bytes=0)
    with pytest.raises(ValueError, match="'sp'.*not in the mesh"):
        GradBucketer([(w, ("sp",))], mesh)
    with pytest.raises(TypeError, match="Parameter"):
        GradBucketer([(torch.ones(2), ("dp",))], mesh)
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    owner = GradBucketer([(frozen, ("dp",))], mesh)  # frozen: hooked once it requires gradients
    assert not frozen._backward_hooks
    with pytest.raises(ValueError, match="already has gradient hooks"):
        GradBucketer([(frozen, ("dp",))], mesh)  # its gradient would be summed twice
    owner.remove()
    GradBucketer([(frozen, ("dp",))], mesh).remove()
