"""Stored parameters (``store=``) in a ``shard_map(check_vma=False)`` body: exact, or refused.

Without variance tracking a stored parameter's gradient in the body is taken as each rank's share, and
its gather's backward sums the shares (a reduce-scatter). That is exact where every rank's cotangent is
its share of the output's: outputs sharded or partial over the storage group. An output replicated over
it hands every rank the whole cotangent, and einshard cannot tell a use of the parameter that does not
vary over the group (whole on every rank: the sum would count it once per rank) from a per-rank use
summed in the body (a share): the call is refused, on every rank, when the body returns. Everything is
compared with the same computation on whole tensors in one process (float64), even and uneven.
"""

from __future__ import annotations

import pytest
import torch

import einshard as es
from einshard.testing import local_block, make_mesh

DT = torch.float64
SIZES = [(4, 3, 6), (5, 3, 6)]  # (C, F, B): an even and an uneven stored slice over dp = 2


def _setup(C, F_, B, shape=(2,), names=("dp",), grad="dp"):
    mesh = es.wrap_mesh(make_mesh(shape, names))
    g = torch.Generator().manual_seed(21)
    w, x = torch.randn(F_, C, generator=g, dtype=DT), torch.randn(B, C, generator=g, dtype=DT)
    p = torch.nn.Parameter(w.clone())
    es.params.register_parameter_layout(p, "f c", mesh=mesh, grad=grad, store="dp", sizes={"c": C, "f": F_})
    return mesh, w, x, p


def _stored_grad(mesh, p, whole_grad):
    return local_block(whole_grad, es.params.get_parameter_state(p).layout, mesh)


def _run(mesh, p, x, out_spec, check_vma, fn):
    spec = es.params.get_parameter_state(p).layout
    body = es.shard_map((spec, "b/dp c"), out_spec, mesh=mesh, check_vma=check_vma)(fn)
    return body(p, local_block(x, "b/dp c", mesh))


def _reference(w, fn):
    ww = w.clone().requires_grad_()
    out = fn(ww)
    out.backward()
    return out.detach(), ww.grad


@pytest.mark.ranks(2)
@pytest.mark.parametrize("sizes", SIZES, ids=["even", "uneven"])
def test_check_vma_false_stored_invariant_use_gradient(sizes):
    mesh, w, x, p = _setup(*sizes)

    def invariant(wb, xb):  # the use does not vary over dp: every rank's gradient is the whole one
        return (wb**2).sum()

    # replicated over dp: whole on every rank or a share, einshard cannot tell: refused (it was 2x)
    with pytest.raises(es.EinshardError, match=r"check_vma=False.*'dp'.*args\[0\]") as err:
        _run(mesh, p, x, "", False, invariant)
    assert "check_vma=True" in str(err.value) and "// dp ->" in str(err.value)
    assert p.grad is None
    want, grad = _reference(w, lambda ww: (ww**2).sum())
    # check_vma=True knows the use is invariant: its gradient is sliced, not summed
    out = _run(mesh, p, x, "", True, invariant)
    out.backward()
    torch.testing.assert_close(out.detach(), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(p.grad, _stored_grad(mesh, p, grad), rtol=1e-12, atol=1e-12)
    # summed on exit ('// dp -> '): the output is the sum of the ranks' values, 2 (w**2).sum(), and exact
    p.grad = None
    out = _run(mesh, p, x, "// dp -> ", False, invariant)
    out.backward()
    want, grad = _reference(w, lambda ww: 2 * (ww**2).sum())
    torch.testing.assert_close(out.detach(), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(p.grad, _stored_grad(mesh, p, grad), rtol=1e-12, atol=1e-12)


@pytest.mark.ranks(2)
@pytest.mark.parametrize("sizes", SIZES, ids=["even", "uneven"])
def test_check_vma_false_stored_per_rank_use_is_exact(sizes):
    mesh, w, x, p = _setup(*sizes)

    def per_rank(wb, xb):  # this rank's rows: a share of the loss
        return (torch.tanh(xb @ wb.T) ** 2).sum()

    want, grad = _reference(w, lambda ww: (torch.tanh(x @ ww.T) ** 2).sum())
    for out_spec in ("// dp -> ", "// dp"):
        p.grad = None
        out = _run(mesh, p, x, out_spec, False, per_rank)
        (out if out_spec == "// dp -> " else out).backward()
        if out_spec == "// dp -> ":
            torch.testing.assert_close(out.detach(), want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(p.grad, _stored_grad(mesh, p, grad), rtol=1e-12, atol=1e-12)
    # a replicated output that needs no gradient (a metric), or a frozen stored parameter: not refused
    p.grad = None
    rows, metric = _run(mesh, p, x, ("b/dp f", ""), False,
                        lambda wb, xb: (torch.tanh(xb @ wb.T), (wb**2).sum().detach()))
    (rows**2).sum().backward()
    torch.testing.assert_close(p.grad, _stored_grad(mesh, p, grad), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(metric, (w**2).sum(), rtol=1e-12, atol=1e-12)
    p.requires_grad_(False)
    torch.testing.assert_close(_run(mesh, p, x, "", False, lambda wb, xb: (wb**2).sum()), (w**2).sum(),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.ranks(2)
def test_check_vma_false_stored_replicated_over_a_one_rank_dimension_is_exact():
    """Replicated over ``tp`` of size 1 (the duty sums over it too): one rank's whole cotangent is its share."""
    mesh, w, x, p = _setup(4, 3, 6, (2, 1), ("dp", "tp"), grad="dp-tp")
    out = _run(mesh, p, x, "b/dp f", False, lambda wb, xb: torch.tanh(xb @ wb.T))
    (out**2).sum().backward()
    want, grad = _reference(w, lambda ww: (torch.tanh(x @ ww.T) ** 2).sum())
    torch.testing.assert_close(p.grad, _stored_grad(mesh, p, grad), rtol=1e-12, atol=1e-12)
