"""Gradient reduction: reduce helpers, native hooks (synchronous and bucketed async), the DDP comm hook.

Every multi-rank gradient is compared with the same loss computed on whole
tensors in one process (float64): each rank holds a batch block (split over the
mesh dimensions other than ``tp``) and a ``tp`` block of the weights, so the
replicated parameters' gradients are partial over exactly the groups their
duties name.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

import einshard as es
from einshard.params import ParameterGradComm, ParameterState
from einshard.params.buckets import hooked_by
from probes import OnBackward
from einshard.testing import local_block

DT = torch.float64
B, C, F = 6, 5, 7  # F over tp is uneven on every mesh


def _whole():
    g = torch.Generator().manual_seed(1)
    return {
        "x": torch.randn(B, C, generator=g, dtype=DT),
        "g": torch.randn(C, generator=g, dtype=DT),
        "w": torch.randn(C, F, generator=g, dtype=DT),
        "b": torch.randn(F, generator=g, dtype=DT),
    }


def _reference():
    t = {k: v.clone().requires_grad_(k != "x") for k, v in _whole().items()}
    (((t["x"] * t["g"]) @ t["w"] + t["b"]) ** 2).sum().backward()
    return {k: t[k].grad for k in ("g", "w", "b")}


class Block(torch.nn.Module):
    """``y = (x * g) @ w + b`` on this rank's blocks: g replicated, w and b split over tp along f."""

    def __init__(self, mesh, schedule=""):
        super().__init__()
        whole = _whole()
        rest = [n for n in mesh.names if n != "tp"]
        self.batch = "-".join(rest)
        self.g = torch.nn.Parameter(whole["g"].clone())
        self.w = torch.nn.Parameter(local_block(whole["w"], "c f/tp", mesh).clone())
        self.b = torch.nn.Parameter(local_block(whole["b"], "f/tp", mesh).clone())
        self.x = local_block(whole["x"], f"b/{self.batch} c" if rest else "b c", mesh)
        self.duty_g = "-".join(mesh.names)  # the whole mesh, as one compound group (or "tp")
        self.duty_wb = self.batch or None

    def register(self, mesh, schedule=""):
        suffix = f":{schedule}" if schedule else ""
        es.params.register_parameter_layout(self.g, "c", mesh=mesh, grad=self.duty_g + suffix)
        for p, layout in ((self.w, "c f/tp"), (self.b, "f/tp")):
            es.params.register_parameter_layout(p, layout, mesh=mesh, grad=None if self.duty_wb is None else self.duty_wb + suffix)
        return self

    def forward(self, x=None):
        x = self.x if x is None else x
        return (x * self.g) @ self.w + self.b

    def loss(self, x=None):
        return (self(x) ** 2).sum()


def _expected(mesh, scale=1.0):
    ref = _reference()
    return {"g": ref["g"] * scale, "w": local_block(ref["w"], "c f/tp", mesh) * scale,
            "b": local_block(ref["b"], "f/tp", mesh) * scale}


def _check(block, mesh, scale=1.0, exact=False):
    for k, want in _expected(mesh, scale).items():
        got = getattr(block, k).grad
        if exact:
            assert torch.equal(got, want), k
        else:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=k)


@pytest.mark.ranks(8)
def test_reduce_helpers_and_hooks_match_single_process(mesh):
    m = es.wrap_mesh(mesh)
    # reduce_grad_ per parameter and reduce_module_grads_
    block = Block(m).register(m)
    block.loss().backward()
    for p in (block.g, block.w, block.b):
        es.params.reduce_grad_(p, es.params.get_parameter_state(p), m)
    _check(block, m)
    block = Block(m).register(m)
    block.loss().backward()
    es.params.reduce_module_grads_(block, m)
    _check(block, m)
    # synchronous hooks: each contribution summed before accumulation, so repeated backward is exact
    block = Block(m).register(m)
    handle = es.params.register_native_grad_reduction_hooks_(block, m)
    block.loss().backward()
    assert handle.pending == 0
    _check(block, m)
    block.loss().backward()
    _check(block, m, scale=2.0)
    assert handle.remove() is handle and handle.remove() is handle
    block.zero_grad(set_to_none=True)
    block.loss().backward()  # hooks removed: partial gradients again, which sum to the whole one
    total = block.g.grad.clone()
    dist.all_reduce(total, group=m.group(block.duty_g))
    torch.testing.assert_close(total, _expected(m)["g"], rtol=1e-12, atol=1e-12)
    # a raw DeviceMesh resolves atomic groups; a compound one is refused before any collective or hook
    block = Block(m).register(m)
    block.loss().backward()
    if "-" in block.duty_g:
        with pytest.raises(ValueError, match="wrap_mesh"):
            es.params.reduce_module_grads_(block, mesh)
        with pytest.raises(ValueError, match="wrap_mesh"):
            es.params.register_native_grad_reduction_hooks_(block, mesh)
        assert not block.g._backward_hooks and not block.w._backward_hooks
    if block.duty_wb is not None and "-" not in block.duty_wb:
        es.params.reduce_grad_(block.w, es.params.get_parameter_state(block.w), mesh)
        torch.testing.assert_close(block.w.grad, _expected(m)["w"], rtol=1e-12, atol=1e-12)
    dist.barrier()


@pytest.mark.ranks(8)
def test_async_hooks_are_bucketed_overlap_backward_and_equal_synchronous(mesh):
    m = es.wrap_mesh(mesh)
    sync_block = Block(m).register(m)
    sync_block.loss().backward()
    es.params.reduce_module_grads_(sync_block, m)
    block = Block(m).register(m, schedule="async")
    assert es.params.get_parameter_state(block.g).grad_comm.schedule == "async"
    handle = es.params.register_native_grad_reduction_hooks_(block, m, bucket_bytes=1)  # one bucket per parameter
    box = {"handle": handle}
    x = OnBackward.apply(block.x.clone().requires_grad_(True), lambda: box.update(pending_at_end=box["handle"].pending))
    block.loss(x).backward()
    assert box["pending_at_end"] >= 1  # an all-reduce was in flight before backward ended
    assert handle.wait() is handle and handle.pending == 0
    for k in ("g", "w", "b"):
        assert torch.equal(getattr(block, k).grad, getattr(sync_block, k).grad), k  # exactly the synchronous sums
    block.loss().backward()  # repeated backward accumulates exactly
    handle.wait()
    _check(block, m, scale=2.0)
    handle.remove()
    dist.barrier()


def _ddp_case(mesh):
    """DDP averages over dp; g also sums over the rest of the mesh, and on (2, 2, 2) w and b over sp."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    m = es.wrap_mesh(mesh)
    rest = [n for n in m.names if n != "dp"]
    g_extra = "-".join(rest)  # "tp" or "sp-tp": an extra native group, compound on (2, 2, 2)
    wb_extra = "-".join(n for n in rest if n != "tp") or None
    for combined in (False, True):
        block = Block(m)
        es.params.register_parameter_layout(block.g, "c", mesh=m, grad=g_extra)
        es.params.register_parameter_layout(block.w, "c f/tp", mesh=m, grad=wb_extra and f"{wb_extra}:ddp")
        kw = {"combined_reduce_group": "-".join(reversed(m.names)), "combined_reduce": (g_extra,)} if combined else {}
        if combined:  # every parameter of the only bucket reduces over g_extra alone: the fast path
            block.w.requires_grad_(False)
            block.b.requires_grad_(False)
        ddp = DDP(block, process_group=m.group("dp"))
        assert es.params.register_grad_reduction_hook_(ddp, m, ddp_group="dp", **kw) is ddp
        (ddp(block.x) ** 2).sum().backward()
        want = _expected(m, scale=0.5)  # DDP averages over dp (size 2)
        torch.testing.assert_close(block.g.grad, want["g"], rtol=1e-12, atol=1e-12)
        if not combined:
            torch.testing.assert_close(block.w.grad, want["w"], rtol=1e-12, atol=1e-12)
            if wb_extra is None:  # b has no state: it gets only the average
                torch.testing.assert_close(block.b.grad, want["b"], rtol=1e-12, atol=1e-12)
    dist.barrier()


@pytest.mark.ranks(8)
def test_ddp_comm_hook_2x4(mesh_2x4):
    _ddp_case(mesh_2x4)


@pytest.mark.ranks(8)
def test_ddp_comm_hook_2x2x2(mesh_2x2x2):
    _ddp_case(mesh_2x2x2)


def _ring(size, nbytes):
    return 2 * (size - 1) * nbytes // size


def _reduces(stats):
    """(calls, sent bytes) of the all-reduces recorded (agreement checks, if on, left out)."""
    rows = [r for (kind, _label, _direction), r in stats.records.items() if kind == "all_reduce"]
    return sum(r.calls for r in rows), sum(r.sent_bytes for r in rows)


@pytest.mark.ranks(8)
def test_gradient_reductions_are_counted(mesh_2x4):
    m = es.wrap_mesh(mesh_2x4)  # g sums over dp-tp (8 ranks), w and b over dp (2 ranks)
    nbytes = {k: getattr(Block(m), k).numel() * 8 for k in ("g", "w", "b")}
    each = (3, _ring(8, nbytes["g"]) + _ring(2, nbytes["w"]) + _ring(2, nbytes["b"]))
    block = Block(m).register(m)
    block.loss().backward()
    with es.count_communication() as stats:
        for p in (block.g, block.w, block.b):
            es.params.reduce_grad_(p, es.params.get_parameter_state(p), m)
    assert _reduces(stats) == each
    block.zero_grad(set_to_none=True)
    block.loss().backward()
    with es.count_communication() as stats:
        es.params.reduce_module_grads_(block, m)
    assert _reduces(stats) == each
    _check(block, m)
    for schedule, bucket_bytes, want in (
        ("", 1, each),  # synchronous hooks: one all-reduce per gradient
        ("async", 1, each),  # one bucket per parameter
        ("async", 2**20, (2, _ring(8, nbytes["g"]) + _ring(2, nbytes["w"] + nbytes["b"]))),  # a bucket per group
    ):
        block = Block(m).register(m, schedule=schedule)
        with es.count_communication() as stats:
            handle = es.params.register_native_grad_reduction_hooks_(block, m, bucket_bytes=bucket_bytes)
            block.loss().backward()
            handle.wait().remove()
        assert _reduces(stats) == want, (schedule, bucket_bytes)
        assert {d for (k, _l, d) in stats.records if k == "all_reduce"} == {"backward"}
        _check(block, m)
    # the DDP comm hook: the dp average of the whole bucket, then g's extra SUM over tp
    from torch.nn.parallel import DistributedDataParallel as DDP

    block = Block(m)
    es.params.register_parameter_layout(block.g, "c", mesh=m, grad="tp")
    ddp = DDP(block, process_group=m.group("dp"))
    es.params.register_grad_reduction_hook_(ddp, m, ddp_group="dp")
    with es.count_communication() as stats:
        (ddp(block.x) ** 2).sum().backward()
    assert _reduces(stats) == (2, _ring(2, sum(nbytes.values())) + _ring(4, nbytes["g"]))
    torch.testing.assert_close(block.g.grad, _expected(m, scale=0.5)["g"], rtol=1e-12, atol=1e-12)
    dist.barrier()


# -- single process: errors before any collective ------------------------------------------------
VMESH = es.Mesh.virtual((2, 4), ("dp", "tp"))


def test_reduce_grad_rules():
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError):
        es.params.reduce_grad_(p, "c", VMESH)
    assert es.params.reduce_grad_(p, ParameterState.from_spec("c [param]"), VMESH) is p  # no grad: returns at once
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="pending inference"):
        es.params.reduce_grad_(p, ParameterState.from_spec("c [param]"), VMESH)
    with pytest.raises(ValueError, match="pending inference"):
        es.params.reduce_grad_(p, ParameterState.from_spec("c [param, grad=ddp]"), VMESH)
    for grad in ("dp:ddp", "dp:external", "none", None, "external"):
        es.params.reduce_grad_(p, ParameterState.from_layout("c", grad=grad), VMESH)  # nothing to do: no groups needed
    vma = replace(ParameterState.from_layout("c"), grad_comm=ParameterGradComm("inferred", ("dp",), "vma"))
    es.params.reduce_grad_(p, vma, VMESH)
    assert torch.equal(p.grad, torch.ones(2))


def _hooks_of(p):
    return bool(p._backward_hooks) or bool(getattr(p, "_post_accumulate_grad_hooks", None))


def test_module_checks_come_first():
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.ones(2))
    m.b = torch.nn.Parameter(torch.ones(2))
    es.params.register_parameter_layout(m.a, "c", grad="dp")
    es.params.register_parameter_state(m.b, ParameterState.from_spec("c [param]"))
    m.a.grad = torch.ones(2)
    m.b.grad = torch.ones(2)
    with pytest.raises(ValueError, match="pending inference"):
        es.params.reduce_module_grads_(m, VMESH)  # the virtual mesh would fail at the first collective
    with pytest.raises(ValueError, match="pending inference"):
        es.params.register_native_grad_reduction_hooks_(m, VMESH)
    assert not _hooks_of(m.a) and not _hooks_of(m.b)


def test_hook_registration_errors_add_nothing():
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.ones(2))
    m.b = torch.nn.Parameter(torch.ones(2), requires_grad=False)  # frozen: accepted, hooked when unfrozen
    es.params.register_parameter_layout(m.a, "c", grad="dp")
    es.params.register_parameter_layout(m.b, "c", grad="dp")
    with pytest.raises(ValueError, match="virtual mesh has no process groups"):
        es.params.register_native_grad_reduction_hooks_(m, VMESH)
    assert not _hooks_of(m.a) and hooked_by(m.a) is None and hooked_by(m.b) is None
    n = torch.nn.Module()
    n.a = torch.nn.Parameter(torch.ones(2))
    es.params.register_parameter_layout(n.a, "c", grad="sp")
    with pytest.raises(ValueError, match="'sp'"):
        es.params.register_native_grad_reduction_hooks_(n, VMESH)
    # only native duties count; external/ddp ones need no hooks and no groups
    k = torch.nn.Module()
    k.a = torch.nn.Parameter(torch.ones(2))
    es.params.register_parameter_layout(k.a, "c", grad="sp:external")
    handle = es.params.register_native_grad_reduction_hooks_(k, VMESH)
    assert handle.pending == 0 and not _hooks_of(k.a)


class _FakeDDP:
    def __init__(self, module):
        self.module = module
        self.hooks = []

    def register_comm_hook(self, state, hook):
        self.hooks.append((state, hook))


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"combined_reduce_group": "dp-tp"}, "combined_reduce is missing"),
        ({"combined_reduce": ("tp",)}, "combined_reduce_group is missing"),
        ({"ddp_group": None, "combined_reduce_group": "dp-tp", "combined_reduce": ("tp",)}, "ddp_group"),
        ({"combined_reduce_group": "dp-tp", "combined_reduce": ("dp",)}, "combined_reduce .* overlap"),
        ({"combined_reduce_group": "dp", "combined_reduce": ("tp",)}, "exactly"),
        ({"combined_reduce_group": "dp-tp", "combined_reduce": ("tp-tp",)}, "repeated"),
        ({"ddp_group": "xx"}, "'xx'"),
    ],
)
def test_ddp_hook_argument_errors(kw, words):
    ddp = _FakeDDP(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=words):
        es.params.register_grad_reduction_hook_(ddp, VMESH, **kw)
    assert not ddp.hooks


@pytest.mark.parametrize("grad, words", [("dp", "touches ddp_group"), ("dp-tp:ddp", "touches"), ("sp", "'sp'"),
                                         (None, "pending inference")])
def test_ddp_hook_state_errors(grad, words):
    lin = torch.nn.Linear(2, 2)
    if grad is None:
        es.params.register_parameter_state(lin.weight, ParameterState.from_spec("o i [param, grad=ddp]"))
    else:
        es.params.register_parameter_layout(lin.weight, "o i", grad=grad)
    ddp = _FakeDDP(lin)
    with pytest.raises(ValueError, match=words):
        es.params.register_grad_reduction_hook_(ddp, VMESH, ddp_group="dp")
    assert not ddp.hooks
