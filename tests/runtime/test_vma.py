"""Variance tracking (``check_vma=True``): what each tensor varies over, automatic pvary, its gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import einshard as es
from einshard.spmd import named
from einshard.runtime import vma
from einshard.comm.mesh import Mesh
from einshard.spmd.shard_map import shard_map
from einshard.testing import local_block
from einshard.runtime.vma import get_vma

DT = torch.float64


def _vmas(mesh):
    """The vma of many body values, on one rank (no assertion inside: compared by the caller)."""
    seen = {}
    specs = ("b/dp n c", "h/tp c", "h c", "c // tp", "(g e/tp) c")

    @shard_map(specs, None, mesh=mesh, sizes={"e": 4})
    def body(x, w_tp, w, part, grouped):
        seen["inputs"] = [get_vma(t) for t in (x, w_tp, w, part, grouped)]
        seen["x*w_tp"] = get_vma(x[..., :1] * w_tp[:, :1].T.unsqueeze(0))
        seen["w+1"] = get_vma(w + 1)
        seen["cat"] = get_vma(torch.cat([w, w_tp], 0))
        seen["zeros"] = get_vma(torch.zeros(3))
        y = es.einshard("b/dp n c, h/tp c -> b/dp n h/tp", x, w_tp)
        seen["einshard"] = get_vma(y)
        seen["gather"] = get_vma(es.einshard("b/dp n h/tp -> b/dp n h", y))
        seen["sum"] = get_vma(es.einshard("b/dp n h/tp -> ", y))
        seen["partial"] = get_vma(es.einshard("b/dp n h/tp -> // (dp, tp)", y))
        seen["local formula"] = get_vma(es.einshard("b n c -> c", x))
        seen["pass-through"] = get_vma(es.einshard("b n c, h/tp c -> b n h/tp", x, w_tp))  # dp passes through
        seen["psum"] = get_vma(named.psum(x, "dp"))
        seen["pvary"] = get_vma(named.pvary(w, ("tp", "dp")))
        seen["axis_index"] = get_vma(named.axis_index("dp-tp"))
        seen["scatter"] = get_vma(named.psum_scatter(w, "tp"))
        s = x.clone()
        s.add_(w_tp.sum())
        seen["in-place"] = get_vma(s)
        return None

    rank = dist.get_rank()
    x = torch.randn(2, 3, 4, dtype=DT)
    body(x, torch.randn(2, 4, dtype=DT), torch.randn(8, 4, dtype=DT), torch.randn(4, dtype=DT),
         torch.randn(4, 4, dtype=DT))
    del rank
    return seen


@pytest.mark.ranks(8)
def test_vma_of_body_values(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    seen = _vmas(mesh)
    f = frozenset
    assert seen["inputs"] == [f({"dp"}), f({"tp"}), f(), f({"tp"}), f({"tp"})]
    expected = {
        "x*w_tp": {"dp", "tp"},
        "w+1": set(),
        "cat": {"tp"},
        "zeros": set(),
        "einshard": {"dp", "tp"},
        "gather": {"dp"},
        "sum": set(),
        "partial": {"dp", "tp"},
        "local formula": {"dp"},
        "pass-through": {"dp", "tp"},
        "psum": set(),
        "pvary": {"dp", "tp"},
        "axis_index": {"dp", "tp"},
        "scatter": {"tp"},
        "in-place": {"dp", "tp"},
    }
    assert {k: set(seen[k]) for k in expected} == expected


def _grad_case(mesh, check_vma):
    """Invariant values meeting varying ones in plain torch: gradients summed, one all-reduce per value."""
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(1), dtype=DT)
    w0 = torch.randn(5, generator=torch.Generator().manual_seed(2), dtype=DT)
    wr = w0.clone().requires_grad_()
    ((torch.cos(x * wr) + x * wr * wr).sum() - wr.sum()).backward()  # w used several times
    w = torch.nn.Parameter(w0.clone())

    @shard_map(("b/dp-tp c", "c"), "// (dp, tp) -> ", mesh=mesh, check_vma=check_vma)
    def body(xb, wb):
        y = torch.cos(xb * wb) + xb * wb * wb  # wb meets varying xb three times: one pvary, memoised
        # minus an invariant term: pvary-ed too, so the sum over the 8 ranks subtracts w.sum() once
        return es.einshard("b/dp-tp c -> // (dp, tp)", y) - wb.sum() / named.axis_size(("dp", "tp"))

    with es.count_communication() as stats:
        loss = body(local_block(x, "b/dp-tp c", mesh), w)
        loss.backward()
    reduces = stats.backward.by_kind().get("all_reduce")
    return (w.grad - wr.grad).abs().max().item(), 0 if reduces is None else reduces.calls


@pytest.mark.ranks(8)
def test_auto_pvary_gradients(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    error, calls = _grad_case(mesh, True)
    t = torch.tensor([error], dtype=DT)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert t.item() < 1e-10
    assert calls == 2  # the memoised pvary of w over (dp, tp), and the invariant w.sum() term's pvary
    wrong, _ = _grad_case(mesh, False)  # the user's job without check_vma
    t = torch.tensor([wrong], dtype=DT)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    assert t.item() > 1e-6


@pytest.mark.ranks(8)
def test_psum_of_invariant_and_grads_inside_the_body(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    results = {}
    for check in (True, False):
        w = torch.nn.Parameter(torch.full((3,), 2.0, dtype=DT))

        @shard_map("c", "c", mesh=mesh, check_vma=check)
        def body(wb):
            return named.psum(wb, "tp")  # invariant input: JAX semantics, size * w

        y = body(w)
        y.sum().backward()
        results[check] = (y.tolist(), w.grad.tolist())
    assert results[True] == ([8.0] * 3, [4.0] * 3)  # d(4 w)/dw = 4: the implicit pvary sums the gradient
    assert results[False] == ([8.0] * 3, [1.0] * 3)  # untracked: all-reduce forward, identity backward

    # torch.autograd.grad in the body: a gradient has the vma of its primal
    w = torch.nn.Parameter(torch.randn(4, 3, dtype=DT))
    v = torch.nn.Parameter(torch.randn(4, 3, dtype=DT))
    x = torch.randn(6, 3, dtype=DT)
    seen = {}

    @shard_map(({"w": "h c", "v": "h/tp c"}, "b/dp c"), {"w": "h c", "v": "h/tp c"}, mesh=mesh)
    def grads(p, xb):
        y = es.einshard("b/dp c, h/tp c -> b/dp h/tp", xb, p["v"]) + xb @ p["w"][:1].T
        g = torch.autograd.grad(es.einshard("b/dp h/tp -> // (dp, tp)", y * y), [p["w"], p["v"]])
        seen["vma"] = [get_vma(t) for t in g]
        return {"w": g[0], "v": g[1]}

    out = grads({"w": w, "v": local_block(v.detach(), "h/tp c", mesh).requires_grad_()}, local_block(x, "b/dp c", mesh))
    assert seen["vma"] == [frozenset(), frozenset({"tp"})]
    wr, vr = w.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
    yr = x @ vr.T + x @ wr[:1].T
    gw, gv = torch.autograd.grad((yr * yr).sum(), [wr, vr])
    e = torch.tensor([(out["w"] - gw).abs().max().item(), (out["v"] - local_block(gv, "h/tp c", mesh)).abs().max().item()])
    dist.all_reduce(e, op=dist.ReduceOp.MAX)
    assert e.max().item() < 1e-10


@pytest.mark.ranks(8)
def test_partial_out_spec_on_invariant_value_and_tags_cleaned(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    w = torch.nn.Parameter(torch.ones(3, dtype=DT))

    @shard_map("c", "// dp", mesh=mesh)
    def body(wb):
        return (wb * 2).sum()  # invariant, declared partial: the logical value is the sum over dp ranks

    loss = body(w)
    loss *= 1.0  # the caller may modify an output in place (it is not a view made by the pvary Function)
    loss.backward()
    assert loss.item() == 6.0 and w.grad.tolist() == [4.0] * 3  # pvary-ed on exit: 2 ranks x 2
    assert "_es_vma" not in w.__dict__ and "_es_vma" not in loss.__dict__
    assert vma.ACTIVE == 0 and vma.current() is None


def test_tracking_is_scoped():
    mesh = Mesh.virtual((2, 4), ("dp", "tp"))

    @shard_map("b/dp", "b/dp", mesh=mesh)
    def f(x):
        assert vma.ACTIVE == 1 and get_vma(x) == {"dp"}
        assert [get_vma(r) for r in x] == [{"dp"}, {"dp"}]  # iteration keeps the vma
        assert get_vma(x.chunk(2)[1]) == {"dp"} and get_vma(torch.ones(1)) == frozenset()
        return x + 1

    f(torch.ones(2))
    assert vma.ACTIVE == 0 and get_vma(torch.ones(1)) is None

    @shard_map("b/dp", "b/dp", mesh=mesh)
    def bad(x):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        bad(torch.ones(2))
    assert vma.ACTIVE == 0 and vma.current() is None

    @shard_map(("b/dp", "b"), "b/dp", mesh=mesh)
    def write(x, buf):
        buf[:] = x  # varying data written into an invariant argument: it varies now
        assert get_vma(buf) == {"dp"}
        return buf

    buf = torch.zeros(2)
    assert write(torch.ones(2), buf) is buf and "_es_vma" not in buf.__dict__  # no tag left on the caller's tensor


# -- plain torch bodies: gradients of replicated and sharded inputs against one process ------------


def _buffer_setitem(x, w):
    buf = torch.zeros(x.shape, dtype=DT)
    buf[:] = x  # __setitem__ returns None: the buffer itself must become varying
    return buf * w


def _cat_keywords(x, w):
    z = torch.cat(tensors=[x, w.expand(x.shape[0], 5)], dim=1)  # tensors passed by keyword
    return z * torch.cat([x, x], 1)


def _inplace_into_invariant(x, w):
    h = w * torch.ones(x.shape, dtype=DT)
    h += x  # varying data written into an invariant tensor that carries w's gradient
    return h * h


def _inplace_through_views(x, w):
    h = w.unsqueeze(0).repeat(x.shape[0], 1)
    h[:, 3:] *= x[:, 3:]  # a view of the invariant h becomes varying: so does h
    h.narrow(1, 0, 1).add_(x[:, :1])
    return h.sin()


def _inplace_after_pvary(x, w):
    h = w * 3.0
    a = h + x  # h is pvary-ed here (memoised; `+` saves nothing for backward)
    h.add_(1.0)  # h changes in place: the memoised pvary must not be reused
    return a * (h + x)


def _mixed_ops(x, w):
    i = (x[:, 0] > 0).long()  # a varying index into an invariant table
    y = F.layer_norm(x, (5,), weight=w, bias=w * 0.5) + w[i].unsqueeze(1) + F.embedding(i, w.reshape(5, 1))
    y = y + torch.stack([x, w.expand_as(x)], -1).prod(-1) + torch.where(x > 0, x, w) + F.linear(x, w.reshape(1, 5))
    return y.mul(w).addcmul(x, w, value=0.5)


PLAIN_TORCH_CASES = {
    "buffer setitem": (_buffer_setitem, _buffer_setitem),
    "cat keywords": (_cat_keywords, _cat_keywords),
    "in-place into invariant": (_inplace_into_invariant, _inplace_into_invariant),
    "in-place through views": (_inplace_through_views, _inplace_through_views),
    "in-place after pvary": (_inplace_after_pvary, _inplace_after_pvary),
    "mixed ops": (_mixed_ops, _mixed_ops),
}


def _plain_torch_case(mesh, fn):
    """``fn`` on x (8 x 5, sharded over dp-tp) and w (5, replicated): loss, x.grad and w.grad vs one process."""
    x0 = torch.randn(8, 5, generator=torch.Generator().manual_seed(3), dtype=DT)
    w0 = torch.randn(5, generator=torch.Generator().manual_seed(4), dtype=DT)
    xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = fn(xr, wr).sum()
    ref.backward()
    w = torch.nn.Parameter(w0.clone())
    x = local_block(x0, "b/dp-tp c", mesh).requires_grad_()
    seen = {}

    @shard_map(("b/dp-tp c", "c"), "// (dp, tp) -> ", mesh=mesh)
    def body(xb, wb):
        y = fn(xb, wb)
        seen["vma"] = get_vma(y)
        return y.sum()

    loss = body(x, w)
    loss.backward()
    return {
        "loss": abs(loss.item() - ref.item()),
        "x": (x.grad - local_block(xr.grad, "b/dp-tp c", mesh)).abs().max().item(),
        "w": (w.grad - wr.grad).abs().max().item(),
        "vma": 0.0 if seen["vma"] == {"dp", "tp"} else 1.0,
    }


@pytest.mark.ranks(8)
def test_plain_torch_bodies_in_place_and_keyword_tensors(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    errs = {}
    for name, (fn, _) in PLAIN_TORCH_CASES.items():
        try:
            for k, v in _plain_torch_case(mesh, fn).items():
                errs[f"{name}/{k}"] = v
        except RuntimeError as e:  # record it, so every rank reaches the all-reduce below
            errs[f"{name}/raised {type(e).__name__}: {str(e)[:80]}"] = float("inf")
    names = sorted(errs)
    t = torch.tensor([errs[n] for n in names], dtype=DT)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    bad = {n: v for n, v in zip(names, t.tolist()) if not v <= 1e-10}
    assert not bad, bad
