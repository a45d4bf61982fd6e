"""Deferred gradient sums of ``shard_map`` bodies (``einshard.comm.grad_sums``): bucketed, in flight during
backward, and the one-process gradient in every training loop.

A replicated parameter that meets per-rank data is pvary-ed; the backward of a
pvary on a leaf hands its gradient to :data:`einshard.comm.grad_sums.DEFERRED`,
which sums it asynchronously with others and adds the sum into ``.grad`` at
the end of the backward. Where the sum cannot wait (``torch.autograd.grad``,
``create_graph=True``) it is summed on the spot. Every case is compared with
the same computation on whole tensors in one process (float64, 4 ranks).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as cp

import einshard as es
from einshard.core._split import compute_split_shapes
from einshard.comm.grad_sums import DEFERRED
from einshard.testing import MeshSpec, local_block

DT = torch.float64
MESH = MeshSpec((4,), ("dp",))


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _whole(n_batch):
    x = _randn(n_batch, 6, seed=1)
    ws = [(_randn(6, 6, seed=10 + k) / 3).requires_grad_() for k in range(3)]
    return x, ws


def _reference(x, ws, checkpoint=None):
    h = x
    for w in ws:
        h = torch.tanh(h @ w)
    return h.square().sum()


def _body(x, w0, w1, w2, checkpoint=None, probe=None):
    h = x
    for k, w in enumerate((w0, w1, w2)):
        if checkpoint is not None and k == 1:
            h = cp.checkpoint(lambda a, b: torch.tanh(a @ b), h, w, use_reentrant=checkpoint)
        else:
            h = torch.tanh(h @ w)
        if k == 0 and probe is not None:
            h.register_hook(probe)  # its gradient comes last: the later layers' sums have started by then
    return es.einshard("b/dp c -> // dp", h.square())


def _shapes(n_batch):
    return {"dp": {"b": compute_split_shapes(n_batch, 4)}}


def _step(mesh, n_batch, **kw):
    return es.shard_map(lambda x, *ws: _body(x, *ws, **kw), in_specs=("b/dp c", "c d", "c d", "c d"),
                        out_specs="// dp -> ", mesh=mesh, shapes=_shapes(n_batch))


def _cut(x, mesh):
    return local_block(x, "b/dp c", mesh, shapes=_shapes(x.shape[0]))


def _params(ws):
    return [torch.nn.Parameter(w.detach().clone()) for w in ws]


@pytest.mark.ranks(4, timeout=300)
@pytest.mark.parametrize("n_batch", [8, 9], ids=["even", "uneven"])
def test_sums_are_in_flight_while_backward_runs(n_batch):
    mesh = es.wrap_mesh(MESH.build())
    x, ws = _whole(n_batch)
    _reference(x, ws).backward()
    xl = _cut(x, mesh)
    ps = _params(ws)
    seen = []
    old = DEFERRED.bucket_bytes
    DEFERRED.bucket_bytes = 1  # every parameter its own bucket: each starts as soon as its gradient arrives
    try:
        loss = _step(mesh, n_batch, probe=lambda g: seen.append(DEFERRED.pending))(xl, *ps)
        loss.backward()
    finally:
        DEFERRED.bucket_bytes = old
    assert seen and seen[0] >= 2  # the sums of w2 and w1 were in flight while backward computed w0's inputs
    assert DEFERRED.pending == 0
    for p, w in zip(ps, ws):
        torch.testing.assert_close(p.grad, w.grad)


@pytest.mark.ranks(4, timeout=300)
def test_autograd_grad_is_summed_at_once():
    mesh = es.wrap_mesh(MESH.build())
    x, ws = _whole(9)
    want = torch.autograd.grad(_reference(x, ws), ws)
    ps = _params(ws)
    got = torch.autograd.grad(_step(mesh, x.shape[0])(_cut(x, mesh), *ps), ps)
    assert DEFERRED.pending == 0 and all(p.grad is None for p in ps)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.ranks(4, timeout=300)
def test_micro_batches_accumulate_with_an_unused_parameter():
    mesh = es.wrap_mesh(MESH.build())
    x, ws = _whole(8)
    x2 = _randn(8, 6, seed=2)
    _reference(x, ws).backward()
    (torch.tanh(x2 @ ws[0]).square().sum()).backward()  # the second micro-batch uses w0 only
    ps = _params(ws)
    _step(mesh, x.shape[0])(_cut(x, mesh), *ps).backward()
    one = es.shard_map(lambda a, w: es.einshard("b/dp c -> // dp", torch.tanh(a @ w).square()),
                       in_specs=("b/dp c", "c d"), out_specs="// dp -> ", mesh=mesh)
    one(local_block(x2, "b/dp c", mesh), ps[0]).backward()
    for p, w in zip(ps, ws):
        torch.testing.assert_close(p.grad, w.grad)
    # zero_grad(set_to_none=False): the next sum is added to zeros
    for p in ps:
        p.grad.zero_()
    _step(mesh, x.shape[0])(_cut(x, mesh), *ps).backward()
    want = torch.autograd.grad(_reference(x, ws), ws)
    for p, w in zip(ps, want):
        torch.testing.assert_close(p.grad, w)


@pytest.mark.ranks(4, timeout=300)
def test_invariant_and_varying_uses_of_one_parameter():
    """``g_inv + psum(g_var)``: only the part through the pvary is summed."""
    mesh = es.wrap_mesh(MESH.build())
    x, ws = _whole(9)
    w = ws[0]
    ((torch.tanh(x @ w).square().sum()) + 3.0 * w.square().sum()).backward()

    def body(a, p):
        per_rank = es.einshard("b/dp c -> // dp", torch.tanh(a @ p).square())
        return per_rank, 3.0 * p.square().sum()  # the second is invariant: its gradient is not summed

    step = es.shard_map(body, in_specs=("b/dp c", "c d"), out_specs=("// dp -> ", ""), mesh=mesh, shapes=_shapes(9))
    p = _params([w])[0]
    a, b = step(_cut(x, mesh), p)
    (a + b).backward()
    torch.testing.assert_close(p.grad, w.grad)


@pytest.mark.ranks(4, timeout=300)
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant):
    mesh = es.wrap_mesh(MESH.build())
    x, ws = _whole(9)
    _reference(x, ws).backward()
    ps = _params(ws)
    _step(mesh, x.shape[0], checkpoint=reentrant)(_cut(x, mesh), *ps).backward()
    assert DEFERRED.pending == 0
    for p, w in zip(ps, ws):
        torch.testing.assert_close(p.grad, w.grad)


@pytest.mark.ranks(4, timeout=300)
def test_double_backward_sums_on_the_spot():
    """A gradient penalty (``create_graph=True``): the first backward builds a graph, so it is not deferred."""
    mesh = es.wrap_mesh(MESH.build())
    x, ws = _whole(8)
    g = torch.autograd.grad(_reference(x, ws), ws, create_graph=True)
    sum(gi.square().sum() for gi in g).backward()
    ps = _params(ws)
    loss = _step(mesh, x.shape[0])(_cut(x, mesh), *ps)
    gp = torch.autograd.grad(loss, ps, create_graph=True)
    sum(gi.square().sum() for gi in gp).backward()
    for p, w in zip(ps, ws):
        torch.testing.assert_close(p.grad, w.grad)
    dist.barrier()


def _formulas(mesh, x, ps, probe=None):
    h = x
    for k, w in enumerate(ps):
        h = torch.tanh(es.einshard("b/dp c, c d -> b/dp d", h, w, mesh=mesh, shapes=_shapes(9)))
        if k == 0 and probe is not None:
            h.register_hook(probe)
    return es.einshard("b/dp c -> // dp", h.square(), mesh=mesh, shapes=_shapes(9))


@pytest.mark.ranks(4, timeout=300)
def test_formula_operand_sums_are_deferred():
    """A replicated parameter operand of a formula (its gradient arrives partial over dp) is summed like a pvary."""
    mesh = es.wrap_mesh(MESH.build())
    x, ws = _whole(9)
    _reference(x, ws).backward()
    ps = _params(ws)
    seen = []
    old = DEFERRED.bucket_bytes
    DEFERRED.bucket_bytes = 1
    try:
        es.einshard("-> ", _formulas(mesh, _cut(x, mesh), ps, probe=lambda g: seen.append(DEFERRED.pending)),
                    mesh=mesh).backward()
    finally:
        DEFERRED.bucket_bytes = old
    assert seen and seen[0] >= 2 and DEFERRED.pending == 0
    for p, w in zip(ps, ws):
        torch.testing.assert_close(p.grad, w.grad)


@pytest.mark.ranks(4, timeout=300)
def test_a_hook_that_reads_the_gradient_sees_it_summed():
    """A tensor hook or a post-accumulate hook (an optimizer step in backward) reads the summed gradient:
    with one, the sum is not deferred."""
    mesh = es.wrap_mesh(MESH.build())
    x, ws = _whole(9)
    _reference(x, ws).backward()
    ps = _params(ws)
    seen = {}
    ps[0].register_post_accumulate_grad_hook(lambda p: seen.__setitem__("post", p.grad.clone()))
    ps[1].register_hook(lambda g: seen.__setitem__("pre", g.clone()))
    _step(mesh, 9)(_cut(x, mesh), *ps).backward()
    torch.testing.assert_close(seen["post"], ws[0].grad)
    torch.testing.assert_close(seen["pre"], ws[1].grad)
    for p, w in zip(ps, ws):
        torch.testing.assert_close(p.grad, w.grad)
