"""Training-loop events around the gradient mechanisms, each compared with one process on whole tensors.

The model: ``h = x * g`` (``g`` replicated), ``y = h @ w.T`` (``w`` split over ``tp`` along ``f``), loss
``sum(y ** 2)``, the batch ``x`` split over ``dp``; float64, uneven blocks (``B = F = 5``) and even ones
(``B = F = 4``), on ``dp`` over 2 ranks and on a 2x2 ``dp`` x ``tp`` mesh. Every gradient mechanism: formulas with no duty (the replicated
operands' sums deferred to the end of backward), duties summed by the native hooks (``dp``: in the hook,
``dp:async``: bucketed), a ``check_vma`` ``shard_map`` body (deferred sums), ZeRO storage (``store="dp"``)
with the hooks and in a ``shard_map`` body. The events:

- an exception in the middle of backward: it leaves nothing behind; after ``zero_grad`` the next step
  is exact (it used to be exactly twice the gradient: the failed backward's sums were added again);
- ``torch.autograd.grad`` inside ``no_sync()`` and after a ``no_sync`` micro-batch: it returns the
  gradient of its own call, summed, and ``.grad`` keeps the held micro-batch for the next ``backward()``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import einshard as es
from probes import OnBackward
from einshard.comm.grad_sums import DEFERRED
from einshard.comm.helpers import compute_split_shapes
from einshard.testing import MeshSpec, local_block

DT = torch.float64
B, C, F = 5, 3, 5
SIZES = {"b": B, "c": C, "f": F}
EVEN_AND_UNEVEN = pytest.mark.parametrize("size", ["uneven", "even"])
MESHES = pytest.mark.parametrize("mesh", [
    pytest.param(MeshSpec((2,), ("dp",)), marks=pytest.mark.ranks(2), id="2"),
    pytest.param(MeshSpec((2, 2), ("dp", "tp")), marks=pytest.mark.ranks(4), id="2x2"),
])
NAMES = ("g", "w")


def _use(size: str) -> None:
    """Set the whole sizes for the test running on this rank: uneven (5 over 2 ranks) or even (4)."""
    global B, F, SIZES
    B, F = (5, 5) if size == "uneven" else (4, 4)
    SIZES = {"b": B, "c": C, "f": F}


def _whole():
    gen = torch.Generator().manual_seed(7)
    t = {k: torch.randn(B, C, generator=gen, dtype=DT) for k in ("x", "x2", "x3")}
    t["g"] = torch.randn(C, generator=gen, dtype=DT) + 1
    t["w"] = torch.randn(F, C, generator=gen, dtype=DT)
    return t


def _reference(*batches):
    """One process, whole tensors: the gradients of the losses of ``batches`` summed."""
    whole = _whole()
    p = {k: whole[k].clone().requires_grad_() for k in NAMES}
    grads = None
    for x in batches:
        got = torch.autograd.grad((((whole[x] * p["g"]) @ p["w"].T) ** 2).sum(), [p[k] for k in NAMES])
        grads = got if grads is None else [a + b for a, b in zip(grads, got)]
    return dict(zip(NAMES, grads))


def _f(m) -> str:
    return "f/tp" if "tp" in m.names else "f"


class Net(torch.nn.Module):
    """This rank's blocks of ``g`` and ``w``; ``grad``/``store`` registered when given (else plain formulas)."""

    def __init__(self, m, grad=None, store=False):
        super().__init__()
        whole = _whole()
        self.layouts = {"g": "c", "w": f"{_f(m)} c"}
        self.f = _f(m)
        for k in NAMES:
            setattr(self, k, torch.nn.Parameter(local_block(whole[k], self.layouts[k], m, sizes=SIZES).clone()))
        if grad is not None:
            es.params.register_module_parameter_layouts_(self, self.layouts, mesh=m, grad=grad, sizes={"c": C, "f": F},
                                                  store={k: "dp" for k in NAMES} if store else None)

    def forward(self, xb):
        h = es.einshard("b/dp c, c -> b/dp c", xb, self.g, sizes={"b": B})
        return es.einshard(f"b/dp c, {self.f} c -> b/dp {self.f}", h, self.w, sizes={"b": B, "f": F})


def _rows(m, x, probe=None):
    """This rank's rows of batch ``x``; ``probe`` runs when backward reaches them (its last step)."""
    xb = local_block(_whole()[x], "b/dp c", m, sizes=SIZES)
    return xb if probe is None else OnBackward.apply(xb.requires_grad_(), probe)


def _eager_loss(net, m, x, probe=None):
    with es.use_mesh(m):
        y = net(_rows(m, x, probe))
        return es.einshard(f"b/dp {net.f} -> ", y * y, sizes={"b": B, "f": F})


def _body_loss(net, m, x, probe=None):
    """The model in a ``check_vma`` ``shard_map`` body: the batch enters whole, the parameters as their specs."""
    whole = _whole()[x].clone()
    if probe is not None:
        whole = OnBackward.apply(whole.requires_grad_(), probe)
    shapes = {"tp": {"f": compute_split_shapes(F, 2)}} if "tp" in m.names else None

    @es.shard_map((es.params.param_specs(net), "b c -> b/dp c"), "", mesh=m, check_vma=True, shapes=shapes)
    def body(params, xb):
        y = torch.func.functional_call(net, params, (xb,))
        return es.einshard(f"b/dp {net.f} -> ", y * y)

    return body(dict(net.named_parameters()), whole)


# mechanism -> (Net keywords, hook keywords or None (no hooks), the loss)
MECHANISMS = {
    "eager": ({}, None, _eager_loss),
    "hooks_sync": ({"grad": "dp"}, {}, _eager_loss),
    "hooks_async": ({"grad": "dp:async"}, {"bucket_bytes": 1}, _eager_loss),
    "shard_map": ({"grad": "dp"}, None, _body_loss),
    "zero_hooks": ({"grad": "dp", "store": True}, {"bucket_bytes": 1}, _eager_loss),
    "zero_shard_map": ({"grad": "dp", "store": True}, None, _body_loss),
}


def _setup(mesh, mechanism):
    m = es.wrap_mesh(mesh)
    net_kw, hooks, loss = MECHANISMS[mechanism]
    net = Net(m, **net_kw)
    handle = None if hooks is None else es.params.register_native_grad_reduction_hooks_(net, m, **hooks)
    return m, net, handle, loss


def _check(got: dict, m, net, ref: dict) -> None:
    specs = es.params.param_specs(net) if any(es.params.get_parameter_state(getattr(net, k)) for k in NAMES) else net.layouts
    for k in NAMES:
        want = local_block(ref[k], specs[k], m, sizes=SIZES)
        torch.testing.assert_close(got[k], want, rtol=1e-12, atol=1e-12, msg=k)


class _Boom(RuntimeError):
    pass


def _boom():
    raise _Boom("a check in backward failed")


@MESHES
@EVEN_AND_UNEVEN
@pytest.mark.parametrize("mechanism", list(MECHANISMS))
def test_exception_mid_backward_leaves_nothing_behind(mesh, size, mechanism):
    """Backward raises (on every rank) after the gradient sums were queued, some started: after zero_grad
    the next step's gradient is the one-process gradient (it was twice that: the failed backward's sums
    were added at the end of the next one), with ``handle.wait()`` after the exception or not, zeroing
    ``.grad`` or setting it to ``None``, and also when the exception comes inside ``no_sync``."""
    _use(size)
    m, net, handle, loss = _setup(mesh, mechanism)
    for wait_after, in_no_sync, to_none in ((False, False, True), (True, False, True), (False, False, False),
                                            (False, True, True)):
        if in_no_sync and handle is None:
            continue
        with handle.no_sync() if in_no_sync else contextlib.nullcontext():
            with pytest.raises(_Boom):
                loss(net, m, "x", _boom).backward()
        if wait_after:  # an observation after the exception: the failed backward's sums are dropped
            assert (handle.wait() if handle is not None else DEFERRED).pending == 0
        net.zero_grad(set_to_none=to_none)
        loss(net, m, "x2").backward()
        if handle is not None:
            handle.wait()
            assert handle.pending == 0
        _check({k: getattr(net, k).grad for k in NAMES}, m, net, _reference("x2"))
        net.zero_grad(set_to_none=True)
    if handle is not None:
        handle.remove()
    dist.barrier()


@MESHES
@EVEN_AND_UNEVEN
@pytest.mark.parametrize("mechanism", [k for k, v in MECHANISMS.items() if v[1] is not None])
def test_autograd_grad_in_no_sync(mesh, size, mechanism):
    """``torch.autograd.grad`` inside ``no_sync()`` and after a ``no_sync`` micro-batch returns the summed
    gradient of its own call and leaves ``.grad`` alone; the held micro-batch reaches ``.grad`` with the
    next syncing backward."""
    _use(size)
    m, net, handle, loss = _setup(mesh, mechanism)
    params = [getattr(net, k) for k in NAMES]
    with handle.no_sync():
        loss(net, m, "x").backward()  # held
        inside = torch.autograd.grad(loss(net, m, "x2"), params)
    _check(dict(zip(NAMES, inside)), m, net, _reference("x2"))
    after = torch.autograd.grad(loss(net, m, "x2"), params)
    _check(dict(zip(NAMES, after)), m, net, _reference("x2"))
    loss(net, m, "x3").backward()
    handle.wait()
    _check({k: getattr(net, k).grad for k in NAMES}, m, net, _reference("x", "x3"))
    handle.remove()
    dist.barrier()


@MESHES
@pytest.mark.parametrize("mechanism", ["eager", "shard_map", "zero_shard_map"])
def test_autograd_grad_between_backwards(mesh, mechanism):
    """Deferred sums (no ``no_sync`` there): ``torch.autograd.grad`` between two backwards returns its own
    summed gradient, and ``.grad`` holds the two backwards' sum."""
    _use("uneven")
    m, net, handle, loss = _setup(mesh, mechanism)
    params = [getattr(net, k) for k in NAMES]
    loss(net, m, "x").backward()
    got = torch.autograd.grad(loss(net, m, "x2"), params)
    _check(dict(zip(NAMES, got)), m, net, _reference("x2"))
    loss(net, m, "x3").backward()
    _check({k: getattr(net, k).grad for k in NAMES}, m, net, _reference("x", "x3"))
    dist.barrier()


@MESHES
@pytest.mark.parametrize("mechanism", ["eager", "hooks_async", "zero_hooks"])
def test_a_backward_inside_a_backward_keeps_the_outer_ones_sums(mesh, mechanism):
    """A reentrant checkpoint runs a backward inside the running one: the inner backward's end neither
    drops nor writes the outer one's deferred sums (it is still running, not failed)."""
    _use("uneven")
    m, net, handle, _ = _setup(mesh, mechanism)
    with es.use_mesh(m):
        xb = _rows(m, "x")
        h = torch.utils.checkpoint.checkpoint(net, xb.requires_grad_(), use_reentrant=True)
        y = net(_rows(m, "x2")) + h  # the outer backward's own uses too
        loss = es.einshard(f"b/dp {net.f} -> ", y * y, sizes={"b": B, "f": F})
    loss.backward()
    if handle is not None:
        handle.wait()
    whole = _whole()
    p = {k: whole[k].clone().requires_grad_() for k in NAMES}
    y = (whole["x"] * p["g"]) @ p["w"].T + (whole["x2"] * p["g"]) @ p["w"].T
    ref = dict(zip(NAMES, torch.autograd.grad((y**2).sum(), [p[k] for k in NAMES])))
    _check({k: getattr(net, k).grad for k in NAMES}, m, net, ref)
    if handle is not None:
        handle.remove()
    dist.barrier()


@MESHES
@pytest.mark.parametrize("mechanism", ["hooks_sync", "hooks_async", "zero_hooks"])
def test_zero_grad_drops_held_no_sync_micro_batches(mesh, mechanism):
    """A ``no_sync`` micro-batch, then ``zero_grad()`` (the step abandoned, as after an exception in a
    later micro-batch): as in one process its contributions are gone; the next step's gradient is its own."""
    _use("uneven")
    m, net, handle, loss = _setup(mesh, mechanism)
    with handle.no_sync():
        loss(net, m, "x").backward()
        with pytest.raises(_Boom):
            loss(net, m, "x2", _boom).backward()
    net.zero_grad(set_to_none=True)
    loss(net, m, "x3").backward()
    handle.wait()
    _check({k: getattr(net, k).grad for k in NAMES}, m, net, _reference("x3"))
    handle.remove()
    dist.barrier()
