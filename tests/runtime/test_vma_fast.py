"""The eager fast paths of variance tracking give the same values and gradients as whole tensors in one process.

Covered: torch ops whose operands all vary alike (no widening), ops that mix
vmas (pvary where a dimension has more than one rank, nothing over size-1
dimensions), einshard's variance rules, even and uneven shards, on a 1-D mesh
and on 2-D meshes with and without size-1 dimensions.
"""

from __future__ import annotations

import pytest
import torch

import einshard as es
from einshard.spmd.shard_map import shard_map
from einshard.testing import MeshSpec, local_block, run_on_ranks
from einshard.runtime.vma import get_vma

DT = torch.float64
SPECS = {"w1": "f/tp c", "b1": "f/tp", "w2": "c f/tp", "b2": "c"}


def _gen(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _err(a, b) -> float:
    return (a.detach() - b.detach()).abs().max().item() if a.numel() else 0.0


def _splits(total: int, parts: int, uneven: bool) -> list[int]:
    if not uneven:
        return [total // parts] * parts
    return [2] * (parts - 1) + [total - 2 * (parts - 1)]  # the last rank holds less (or nothing)


def _graph_size(t) -> int:
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        todo.extend(f for f, _ in fn.next_functions)
    return len(seen)


def _mlp(p, x, seen):
    """einshard and plain torch: mixed operands (+ b1, + b2, the local formula) and operands that vary alike."""
    h = torch.tanh(es.einshard("b/dp n c, f/tp c -> b/dp n f/tp", x, p["w1"]) + p["b1"])
    h = h * h.sigmoid()
    y = es.einshard("b/dp n f/tp, c f/tp -> b/dp n c", h, p["w2"]) + p["b2"]
    # a local formula: dp passes through, so the invariant b2 is pvary-ed over it (the memoised pvary of `+ b2`)
    z = y.sin() * 2.0 + es.einshard("b n c, c -> b n c", y, p["b2"])
    if seen is not None:
        seen["vma"] = (get_vma(h), get_vma(z))
    return z


def _mlp_ref(p, x):
    h = torch.tanh(torch.einsum("bnc,fc->bnf", x, p["w1"]) + p["b1"])
    h = h * h.sigmoid()
    y = torch.einsum("bnf,cf->bnc", h, p["w2"]) + p["b2"]
    return y.sin() * 2.0 + y * p["b2"]


def _mlp_case(mesh, uneven: bool) -> dict:
    """The MLP on a (dp, tp) mesh against whole tensors: output, loss and every gradient, per rank."""
    mesh = es.wrap_mesh(mesh)
    dp, tp = mesh.size("dp"), mesh.size("tp")
    b_splits, f_splits = _splits(2 * dp, dp, uneven), _splits(2 * tp, tp, uneven)
    B, F, n, c = sum(b_splits), sum(f_splits), 3, 5
    shapes = {"dp": {"b": b_splits}, "tp": {"f": f_splits}}
    whole = {"w1": _gen(F, c, seed=1), "b1": _gen(F, seed=2), "w2": _gen(c, F, seed=3), "b2": _gen(c, seed=4)}
    x, cot = _gen(B, n, c, seed=5), _gen(B, n, c, seed=6)
    ref_p = {k: v.clone().requires_grad_() for k, v in whole.items()}
    ref_x = x.clone().requires_grad_()
    z_ref = _mlp_ref(ref_p, ref_x)
    (z_ref * cot).sum().backward()

    out = {}
    for check_vma in (True, False):
        params = {k: torch.nn.Parameter(local_block(v, SPECS[k], mesh, shapes=shapes)) for k, v in whole.items()}
        xl = local_block(x, "b/dp n c", mesh, shapes=shapes).requires_grad_()
        seen = {} if check_vma else None

        @shard_map((SPECS, "b/dp n c"), ("b/dp n c", "// dp"), mesh=mesh, shapes=shapes, check_vma=check_vma)
        def forward(p, xb):
            z = _mlp(p, xb, seen)
            return z, es.einshard("b/dp n c, b/dp n c -> // dp", z, local_block(cot, "b/dp n c", mesh, shapes=shapes))

        z, loss = forward(params, xl)
        out[check_vma] = _graph_size(loss)
        loss.backward()
        if not check_vma:
            continue
        out["z"] = _err(z, local_block(z_ref, "b/dp n c", mesh, shapes=shapes))
        out["x"] = _err(xl.grad, local_block(ref_x.grad, "b/dp n c", mesh, shapes=shapes))
        for k in whole:
            out[k] = _err(params[k].grad, local_block(ref_p[k].grad, SPECS[k], mesh, shapes=shapes))
        out["vma"] = seen["vma"]
    return out


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
@pytest.mark.parametrize("shape", [(2, 4), (1, 8), (8, 1)], ids=["2x4", "1x8", "8x1"])
def test_tracked_mlp_matches_whole_tensors(shape, uneven):
    results = run_on_ranks(8, _mlp_case, MeshSpec(shape, ("dp", "tp")), uneven, timeout=240)
    for rank, r in enumerate(results):
        errs = {k: v for k, v in r.items() if isinstance(k, str) and k != "vma"}
        assert max(errs.values()) < 1e-10, (rank, errs)
        assert r["vma"] == ({"dp", "tp"}, {"dp"}), (rank, r["vma"])
    if shape == (1, 8):
        # dp has one rank: the pvary-s of b1 and b2 over it are skipped, the graph is the untracked one
        assert all(r[True] == r[False] for r in results), [(r[True], r[False]) for r in results]
    else:
        # over dp (8 x 1, 2 x 4) b1 and b2 are pvary-ed: one autograd node each
        assert all(r[True] == r[False] + 2 for r in results), [(r[True], r[False]) for r in results]


def _plain_torch_case(mesh, uneven: bool) -> dict:
    """A 1-D mesh: plain torch ops on a varying batch, a replicated weight mixed in, an in-place update."""
    mesh = es.wrap_mesh(mesh)
    splits = _splits(2 * mesh.size("dp"), mesh.size("dp"), uneven)
    shapes = {"dp": {"b": splits}}
    x, w0 = _gen(sum(splits), 4, seed=7), _gen(4, seed=8)
    wr = w0.clone().requires_grad_()
    xr = x.clone().requires_grad_()

    def body(xb, w):
        a = torch.cos(xb).exp() * 0.5  # operands that vary alike
        a = a + w  # mixed: w is pvary-ed over dp
        a.mul_(torch.tanh(xb))  # in place, alike
        return torch.stack([a, xb], 0).sum(0) * w

    ref = body(xr, wr)
    ref.sum().backward()
    w = torch.nn.Parameter(w0.clone())
    xl = local_block(x, "b/dp c", mesh, shapes=shapes).requires_grad_()

    @shard_map(("b/dp c", "c"), ("b/dp c", "// dp"), mesh=mesh, shapes=shapes)
    def step(xb, wb):
        y = body(xb, wb)
        return y, y.sum()

    y, loss = step(xl, w)
    loss.backward()
    return {
        "y": _err(y, local_block(ref, "b/dp c", mesh, shapes=shapes)),
        "x": _err(xl.grad, local_block(xr.grad, "b/dp c", mesh, shapes=shapes)),
        "w": _err(w.grad, wr.grad),
    }


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_tracked_plain_torch_on_a_1d_mesh(uneven):
    results = run_on_ranks(8, _plain_torch_case, MeshSpec((8,), ("dp",)), uneven, timeout=240)
    for rank, errs in enumerate(results):
        assert max(errs.values()) < 1e-10, (rank, errs)


def test_tracking_state_is_restored_after_errors():
    """The mode is popped and the counters restored when the body or a formula op raises."""
    from einshard.runtime import vma
    from einshard.comm.mesh import Mesh

    mesh = Mesh.virtual((2, 4), ("dp", "tp"))
    depth = torch._C._len_torch_function_stack()

    @shard_map(("b/dp c", "c"), "b/dp c", mesh=mesh)
    def bad_formula(xb, w):
        # w is declared replicated over dp but is fed a dp-varying value: a ValueError before any collective
        return es.einshard("b/dp c, c -> b/dp c", xb, xb.sum(0) * w)

    with pytest.raises(ValueError, match="varies over mesh dimension 'dp'"):
        bad_formula(torch.ones(1, 3), torch.ones(3))
    assert vma.ACTIVE == 0 and vma.current() is None and torch._C._len_torch_function_stack() == depth
