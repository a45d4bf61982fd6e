"""Activation checkpointing: recomputes run in their forward's context (einshard.runtime.recompute).

Every distributed case compares values and gradients with the same computation on whole tensors in
one process, for both ``use_reentrant`` modes, even and uneven shards, on a 1-D and a 2-D mesh. Every
rank all-reduces its errors before asserting, so a failure never leaves a rank waiting.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint

import einshard as es
from einshard.core import policy
from einshard.runtime import recompute
from einshard.comm.helpers import compute_split_shapes
from einshard.testing import MeshSpec, local_block

DT = torch.float64
MESHES = [MeshSpec((8,), ("dp",)), MeshSpec((2, 4), ("dp", "tp"))]
MESH_IDS = ["8", "2x4"]


def gen(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def err(a, b) -> float:
    return (a.detach() - b.detach()).abs().max().item() if a.numel() else 0.0


def agree_errors(errs: dict, tol: float = 1e-10) -> None:
    """The max of every error over the ranks; all within ``tol``."""
    names = sorted(errs)
    t = torch.tensor([float(errs[n]) for n in names], dtype=DT)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    bad = {n: v for n, v in zip(names, t.tolist()) if not v <= tol}
    assert not bad, f"errors above {tol}: {bad}"


def checkpoint(fn, *args, reentrant):
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=reentrant)


def _sizes(mesh, uneven):
    """(B, F): the batch split over dp, the hidden size over tp (tp absent: not split)."""
    ndp = mesh.size("dp")
    ntp = mesh.size("tp") if "tp" in mesh.names else 1
    return 2 * ndp + (1 if uneven else 0), 2 * ntp + (ntp - 1 if uneven else 0)


def _reference(x, w1, w2, b):
    """loss = sum((tanh(x w1^T) w2^T + b)^2) on whole tensors, with its gradients."""
    ts = [t.clone().requires_grad_() for t in (x, w1, w2, b)]
    h = torch.tanh(torch.einsum("bnc,fc->bnf", ts[0], ts[1]))
    y = torch.einsum("bnf,cf->bnc", h, ts[2]) + ts[3]
    loss = (y**2).sum()
    loss.backward()
    return loss.detach(), [t.grad for t in ts]


# -- es.use_mesh ------------------------------------------------------------------------------------


def _use_mesh_case(mesh, reentrant, uneven):
    B, F = _sizes(mesh, uneven)
    f = "f/tp" if "tp" in mesh.names else "f"
    x, w1, w2, b = gen(B, 3, 4, seed=1), gen(F, 4, seed=2), gen(4, F, seed=3), gen(4, seed=4)
    ref, grads = _reference(x, w1, w2, b)
    shapes = {d: compute_split_shapes(n, mesh.size(d)) for d, n in (("dp", B), ("tp", F)) if d in mesh.names}
    specs = ("b/dp n c", f"{f} c", f"c {f}", "c")
    leaves = [local_block(t, s, mesh, shapes).requires_grad_() for t, s in zip((x, w1, w2, b), specs)]

    def region(xb, a, w, bias):  # formulas without mesh=: the ambient mesh, also in the recompute
        h = torch.tanh(es.einshard(f"b/dp n c, {f} c -> b/dp n {f}", xb, a, shapes=shapes))
        y = es.einshard(f"b/dp n {f}, c {f} -> b/dp n c", h, w, shapes=shapes) + bias
        return es.einshard("b/dp n c -> // dp", y * y, shapes=shapes)

    with es.use_mesh(mesh):
        part = checkpoint(region, *leaves, reentrant=reentrant)
    part.backward()  # the recompute runs here, outside use_mesh
    total = part.detach().clone()
    dist.all_reduce(total, group=mesh.group("dp"))
    out = {"loss": abs(total.item() - ref.item())}
    for name, t, g, s in zip(("x", "w1", "w2", "b"), leaves, grads, specs):
        block = local_block(g, s, mesh, shapes)
        if name == "b":  # b is used per dp rank in plain torch (+): its gradient is partial over dp
            sums = t.grad.clone()
            dist.all_reduce(sums, group=mesh.group("dp"))
            out[name] = err(sums, block)
        else:
            out[name] = err(t.grad, block)
    return out


@pytest.mark.ranks(8)
@pytest.mark.parametrize("spec", MESHES, ids=MESH_IDS)
def test_checkpointed_formulas_under_use_mesh(spec):
    mesh = es.wrap_mesh(spec)
    errs = {}
    for reentrant in (True, False):
        for uneven in (False, True):
            for k, v in _use_mesh_case(mesh, reentrant, uneven).items():
                errs[f"reentrant={reentrant}/uneven={uneven}/{k}"] = v
    agree_errors(errs)


# -- shard_map bodies ---------------------------------------------------------------------------------


def _body_case(mesh, reentrant, check_vma, uneven):
    """Whole inputs converted on entry (their split shapes become ambient), parameters captured by the
    checkpointed block, the replicated bias (and, on 1-D, every weight) pvary-ed over dp inside it."""
    B, F = _sizes(mesh, uneven)
    f = "f/tp" if "tp" in mesh.names else "f"
    x, w1, w2, b = gen(B, 3, 4, seed=1), gen(F, 4, seed=2), gen(4, F, seed=3), gen(4, seed=4)
    ref, grads = _reference(x, w1, w2, b)
    whole = [t.clone().requires_grad_() for t in (x, w1, w2, b)]
    in_specs = ("b n c -> b/dp n c", f"f c -> {f} c", f"c f -> c {f}", "c")

    @es.shard_map(in_specs, "// dp", mesh=mesh, check_vma=check_vma)
    def step(xb, a, w, bias):
        def block(xs):  # a, w, bias captured: their vma must be the body's in the recompute too
            h = torch.tanh(es.einshard(f"b/dp n c, {f} c -> b/dp n {f}", xs, a))  # no mesh=, no shapes=
            y = es.einshard(f"b/dp n {f}, c {f} -> b/dp n c", h, w)
            return y + (bias if check_vma else es.spmd.pvary(bias, "dp"))  # the bias's gradient sum, in the block

        y = checkpoint(block, xb, reentrant=reentrant)
        return es.einshard("b/dp n c -> // dp", y * y)

    part = step(*whole)
    part.backward()  # after the shard_map call returned
    total = part.detach().clone()
    dist.all_reduce(total, group=mesh.group("dp"))
    out = {"loss": abs(total.item() - ref.item())}
    out.update({n: err(t.grad, g) for n, t, g in zip(("x", "w1", "w2", "b"), whole, grads)})
    out["tags"] = float(any("_es_vma" in t.__dict__ for t in whole))  # no tag left on the caller's tensors
    return out


@pytest.mark.ranks(8)
@pytest.mark.parametrize("spec", MESHES, ids=MESH_IDS)
def test_checkpointed_block_in_shard_map_body(spec):
    mesh = es.wrap_mesh(spec)
    errs = {}
    for reentrant in (True, False):
        for check_vma in (True, False):
            for uneven in (False, True):
                case = f"reentrant={reentrant}/check_vma={check_vma}/uneven={uneven}"
                for k, v in _body_case(mesh, reentrant, check_vma, uneven).items():
                    errs[f"{case}/{k}"] = v
    agree_errors(errs)


def _psum_case(mesh, reentrant, check_vma, uneven):
    """A replicated parameter meets per-rank data and a psum inside the block: its gradient is summed
    over dp exactly once (by the pvary the tracker inserts, or the explicit one)."""
    B = 2 * mesh.size("dp") + (1 if uneven else 0)
    x, v = gen(B, 3, seed=5), gen(3, seed=6)
    vr = v.clone().requires_grad_()
    ref = ((x * vr).sum() ** 2)
    ref.backward()
    vw, xw = v.clone().requires_grad_(), x.clone().requires_grad_()

    @es.shard_map(("b n -> b/dp n", "n"), "", mesh=mesh, check_vma=check_vma)
    def step(xb, p):
        def block(xs, q):
            q = q if check_vma else es.spmd.pvary(q, "dp")
            return es.spmd.psum((xs * q).sum(), "dp") ** 2

        return checkpoint(block, xb, p, reentrant=reentrant)

    loss = step(xw, vw)
    loss.backward()
    xref = x.clone().requires_grad_()
    ((xref * v).sum() ** 2).backward()
    return {"loss": abs(loss.item() - ref.item()), "v": err(vw.grad, vr.grad), "x": err(xw.grad, xref.grad)}


@pytest.mark.ranks(8)
@pytest.mark.parametrize("spec", MESHES, ids=MESH_IDS)
def test_replicated_gradient_sum_inside_checkpoint_is_summed_once(spec):
    mesh = es.wrap_mesh(spec)
    errs = {}
    for reentrant in (True, False):
        for check_vma in (True, False):
            for uneven in (False, True):
                case = f"reentrant={reentrant}/check_vma={check_vma}/uneven={uneven}"
                for k, v in _psum_case(mesh, reentrant, check_vma, uneven).items():
                    errs[f"{case}/{k}"] = v
    agree_errors(errs)


def _backward_in_body_case(mesh, reentrant, uneven):
    """The body runs backward itself: the recompute runs inside the body (torch functions disabled)."""
    B, F = 2 * mesh.size() + (1 if uneven else 0), 3
    x, w1, w2, b = gen(B, 3, 4, seed=1), gen(F, 4, seed=2), gen(4, F, seed=3), gen(4, seed=4)
    ref, grads = _reference(x, w1, w2, b)
    params = [torch.nn.Parameter(t.clone()) for t in (w1, w2, b)]
    dims = tuple(mesh.names)
    bspec = f"b/{'-'.join(dims)}"

    @es.shard_map((f"b n c -> {bspec} n c", "f c", "c f", "c"), f"// {'-'.join(dims)}", mesh=mesh)
    def step(xb, a, w, bias):
        def block(xs):
            h = torch.tanh(xs @ a.T)  # plain torch: the tracker pvary-s the invariant weights
            return h @ w.T + bias

        y = checkpoint(block, xb, reentrant=reentrant)
        loss = (y * y).sum()
        loss.backward()
        return loss.detach()

    part = step(x.clone().requires_grad_(), *params)
    total = part.clone()
    dist.all_reduce(total)
    out = {"loss": abs(total.item() - ref.item())}
    out.update({n: err(p.grad, g) for n, p, g in zip(("w1", "w2", "b"), params, grads[1:])})
    return out


@pytest.mark.ranks(8)
@pytest.mark.parametrize("spec", MESHES, ids=MESH_IDS)
def test_checkpoint_recomputed_by_a_backward_inside_the_body(spec):
    mesh = es.wrap_mesh(spec)
    errs = {}
    for reentrant in (True, False):
        for uneven in (False, True):
            for k, v in _backward_in_body_case(mesh, reentrant, uneven).items():
                errs[f"reentrant={reentrant}/uneven={uneven}/{k}"] = v
    agree_errors(errs)


# -- what the recompute does not do -----------------------------------------------------------------


def _rank_dependent(x, mesh):
    """Even ranks save their tensors before the psum, odd ranks after it."""
    odd = dist.get_rank() % 2
    h = x + 1 if odd else x * x
    s = es.spmd.psum(h, "dp", mesh=mesh)
    return s * s if odd else s + 1


@pytest.mark.ranks(8, timeout=60)
def test_recompute_runs_every_collective_on_every_rank():
    """Early stop would end the even ranks' recompute before the psum the odd ones wait in."""
    mesh = es.wrap_mesh(MESHES[0].build())
    x = gen(3, seed=7)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    checkpoint(_rank_dependent, xs[0], mesh, reentrant=False).sum().backward()
    _rank_dependent(xs[1], mesh).sum().backward()
    agree_errors({"x": err(xs[0].grad, xs[1].grad)})


@pytest.mark.ranks(8)
def test_changed_region_arguments_raise():
    mesh = es.wrap_mesh(MESHES[0].build())
    args = []

    @es.shard_map("b -> b/dp", "// dp", mesh=mesh)
    def step(xb):
        args.append(xb)
        y = torch_checkpoint.checkpoint(lambda xs: sum(t * t for t in xs).sum(), args, use_reentrant=False)
        args.append(xb)  # the region's argument changes before its recompute
        return y

    loss = step(gen(16, seed=8).requires_grad_())
    with pytest.raises(es.EinshardError, match="changed structure"):
        loss.backward()


# -- one process ----------------------------------------------------------------------------------------


def test_checkpoint_is_hooked():
    assert recompute.installed()
    assert recompute.install()  # idempotent


@pytest.mark.parametrize("reentrant", [True, False])
def test_recompute_restores_the_policy_scope(reentrant):
    seen = []

    def region(x):
        seen.append(policy.scope())
        return x * x

    x = torch.ones(3, requires_grad=True)
    with es.optimize("memory"):
        y = checkpoint(region, x, reentrant=reentrant)
    y.sum().backward()
    assert [p.name for p in seen] == ["memory", "memory"]
    assert policy.scope() is None and recompute.capture() is None


class _PsumInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return es.spmd.psum(grad, "dp")  # no mesh= and no ambient mesh in backward


def test_missing_mesh_in_backward_says_so():
    y = _PsumInBackward.apply(torch.ones(2, requires_grad=True))
    with pytest.raises(es.EinshardError, match="runs during backward"):
        y.sum().backward()
    with pytest.raises(es.EinshardError) as info:
        es.spmd.psum(torch.ones(2), "dp")
    assert "backward" not in str(info.value)
