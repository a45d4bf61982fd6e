"""A body's kept pvary-ed parameters (einshard.runtime.vma_aliases) train exactly like fresh ones.

Every step is compared with the same step on whole tensors in one process (float64), and with the same body
whose aliases are made afresh on every call (bitwise). The guards: an alias is handed out again only after its
node's backward ran, only while it still aliases its parameter (same tensor, storage, shape, strides, dtype),
per process group (mesh), only in grad mode and eager code (a compiled call traces its own pvary).
"""

from __future__ import annotations

import pytest
import torch

import einshard as es
from einshard.runtime.vma_aliases import LeafAliases
from einshard.spmd.shard_map import shard_map
from einshard.testing import MeshSpec, local_block, run_on_ranks

DT = torch.float64
SPECS = {"w1": "f/tp c", "b1": "f/tp", "w2": "c f/tp", "b2": "c"}
LR = 0.01


def _gen(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _err(a, b) -> float:
    return (a.detach() - b.detach()).abs().max().item() if a.numel() else 0.0


def _mlp(p, x):
    """Mixed operands: b1 and b2 are pvary-ed over dp by plain torch ops, w1 and w2 by the formulas."""
    h = torch.tanh(es.einshard("b/dp n c, f/tp c -> b/dp n f/tp", x, p["w1"]) + p["b1"])
    return es.einshard("b/dp n f/tp, c f/tp -> b/dp n c", h, p["w2"]) * p["b2"] + p["b2"]


def _mlp_ref(p, x):
    h = torch.tanh(torch.einsum("bnc,fc->bnf", x, p["w1"]) + p["b1"])
    return torch.einsum("bnf,cf->bnc", h, p["w2"]) * p["b2"] + p["b2"]


def _alias_ids(sm) -> set:
    return {id(kept.alias) for kept in sm._aliases.entries.values()}


def _training_case(mesh, uneven: bool) -> dict:
    """Three SGD steps of the MLP (parameters as arguments), kept aliases against fresh ones and whole tensors."""
    mesh = es.wrap_mesh(mesh)
    dp, tp = mesh.size("dp"), mesh.size("tp")
    f_splits = [2] * (tp - 1) + [1] if uneven else [2] * tp
    shapes = {"tp": {"f": f_splits}}
    F, B, n, c = sum(f_splits), 2 * dp, 3, 5
    whole = {"w1": _gen(F, c, seed=1), "b1": _gen(F, seed=2), "w2": _gen(c, F, seed=3), "b2": _gen(c, seed=4)}
    ref = {k: v.clone().requires_grad_() for k, v in whole.items()}
    runs = {}
    for kept in (True, False):
        params = {k: torch.nn.Parameter(local_block(v, SPECS[k], mesh, shapes=shapes).clone())  # (own storage)
                  for k, v in whole.items()}

        @shard_map((SPECS, "b/dp n c"), "// dp", mesh=mesh, shapes=shapes)
        def loss_fn(p, xb):
            return es.einshard("b/dp n c -> // dp", _mlp(p, xb).square())

        if not kept:
            loss_fn._aliases = None  # every call makes fresh aliases: full tracking
        runs[kept] = (params, loss_fn)
    out = {"reused": [], "grads": [], "bitwise": True}
    for step in range(3):
        x = _gen(B, n, c, seed=10 + step)
        xl = local_block(x, "b/dp n c", mesh)
        ref_loss = _mlp_ref(ref, x).square().sum()
        for p in ref.values():
            p.grad = None
        ref_loss.backward()
        grads = {}
        for kept, (params, loss_fn) in runs.items():
            before = _alias_ids(loss_fn) if kept else set()
            for p in params.values():
                p.grad = None
            loss = loss_fn(params, xl)
            loss.backward()
            grads[kept] = {k: p.grad.clone() for k, p in params.items()}
            if kept:
                out["reused"].append(before == _alias_ids(loss_fn) and len(before) == 2)
                out["grads"].append(max(_err(params[k].grad, local_block(ref[k].grad, SPECS[k], mesh, shapes=shapes))
                                        for k in whole))
            with torch.no_grad():
                for p in params.values():
                    p -= LR * p.grad  # in place: the kept aliases see the new values
        out["bitwise"] &= all(torch.equal(grads[True][k], grads[False][k]) for k in whole)
        with torch.no_grad():
            for p in ref.values():
                p -= LR * p.grad
    return out


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_kept_aliases_train_like_fresh_ones(uneven):
    results = run_on_ranks(4, _training_case, MeshSpec((2, 2), ("dp", "tp")), uneven, timeout=240)
    for rank, r in enumerate(results):
        assert max(r["grads"]) < 1e-10, (rank, r)
        assert r["bitwise"], rank
        # the first step makes the aliases of b1 and b2 (pvary-ed over dp by plain ops; the formulas sum the gradients
        # of w1 and w2 themselves), the others reuse them
        assert r["reused"] == [False, True, True], (rank, r["reused"])


def _leaf_sum_nodes(t) -> set:
    seen, todo, found = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if type(fn).__name__ == "_LeafSumBackward":
            found.add(fn)
        todo.extend(f for f, _ in fn.next_functions)
    return found


def _guards_case(mesh) -> dict:
    """One parameter ``w`` pvary-ed over dp by a plain op, through every guard; each gradient against whole tensors."""
    mesh = es.wrap_mesh(mesh)
    w0 = _gen(3, 2, seed=1)
    x = _gen(4, 3, seed=2)
    xl = local_block(x, "b/dp c", mesh)
    w = torch.nn.Parameter(w0.clone())

    def body(xb):
        return (xb.to(w.dtype) @ w).sin()  # w invariant, xb varies over dp: w is pvary-ed (its gradient summed over dp)

    sm = shard_map(body, in_specs=("b/dp c",), out_specs="b/dp k")  # the ambient mesh
    facts: dict = {}
    errs: dict = {}

    def ref_grad(wv):
        wr = wv.detach().clone().to(DT).requires_grad_()
        (x @ wr).sin().sum().backward()
        return wr.grad

    def step(name, mesh_=mesh, times=1):
        w.grad = None
        before = _alias_ids(sm)
        xb = xl if mesh_ is mesh else local_block(x, "b/dp c", mesh_)
        with es.use_mesh(mesh_):
            outs = [sm(xb) for _ in range(times)]
        sum(o.sum() for o in outs).backward()
        errs[name] = _err(w.grad.to(DT), times * ref_grad(w))
        return before, _alias_ids(sm), outs

    _, first, _ = step("first")
    before, after, _ = step("again")
    facts["reused"] = before == after == first
    # two forwards before one backward: two nodes, as fresh aliases would be
    _, after, outs = step("two forwards", times=2)
    nodes = [_leaf_sum_nodes(o) for o in outs]
    facts["two_nodes"] = len(nodes[0]) == len(nodes[1]) == 1 and nodes[0] != nodes[1]
    _, kept_after_two, _ = step("after two")
    facts["reused_after_two"] = kept_after_two == after
    # grad mode off: no pvary, and the kept alias stays free for the next call
    with torch.no_grad(), es.use_mesh(mesh):
        sm(xl)
    before, after, _ = step("after no_grad")
    facts["reused_after_no_grad"] = before == after
    # in place (an optimizer step): reused, and it sees the new values
    with torch.no_grad():
        w.mul_(0.5)
    before, after, _ = step("after in-place")
    facts["reused_after_inplace"] = before == after
    # requires_grad off for a call: not pvary-ed; on again: reused
    w.requires_grad_(False)
    with es.use_mesh(mesh):
        y = sm(xl)
    facts["no_grad_param"] = not y.requires_grad
    w.requires_grad_(True)
    before, after, _ = step("requires_grad again")
    facts["reused_after_requires_grad"] = before == after
    # new storage, dtype, shape: a fresh alias each time
    for name, data in (("storage", w.detach().clone()), ("dtype", w.detach().float()),
                       ("strides", w.detach().t().contiguous().t()), ("shape", torch.cat([w.detach()] * 2, 1))):
        w.data = data
        before, after, _ = step(name)
        facts[f"fresh_{name}"] = not (before & after)
    w.data = w.detach()[:, :2].to(DT).clone()
    step("back to float64")
    # another mesh whose dp is another process group: another alias (the first mesh's stays kept)
    other = es.wrap_mesh(torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    before, after, _ = step("other mesh", mesh_=other)
    facts["fresh_other_mesh"] = len(after) == len(before) + 1
    # a backward inside a body (torch.autograd.grad there) frees no alias: that call's graph still holds it
    def inner(xb):
        y = (xb.to(w.dtype) @ w).sin()
        torch.autograd.grad(y.sum(), [w], retain_graph=True)
        return y

    sm2 = shard_map(inner, in_specs=("b/dp c",), out_specs="b/dp k")
    w.grad = None
    with es.use_mesh(mesh):
        y1 = sm2(xl)
        taken = _alias_ids(sm2)
        y2 = sm2(xl)
    (y1.sum() + y2.sum()).backward()
    facts["fresh_after_inner_grad"] = len(taken) == 1 and not (taken & _alias_ids(sm2))
    errs["inner grad"] = _err(w.grad, 2 * ref_grad(w))
    # a compiled call traces its own pvary: no kept alias is taken, the gradient is the same
    torch._dynamo.reset()  # (a pooled rank may have compiled ShardMap.__call__ up to dynamo's recompile limit)
    compiled = torch.compile(sm, backend="eager", fullgraph=True)
    w.grad = None
    with es.use_mesh(mesh):
        compiled(xl).sum().backward()
    errs["compiled"] = _err(w.grad, ref_grad(w))
    before, after, _ = step("after compiled")
    facts["reused_after_compiled"] = before == after
    return {"facts": facts, "errs": errs}


def test_alias_guards():
    results = run_on_ranks(4, _guards_case, MeshSpec((2, 2), ("tp", "dp")), timeout=240)
    for rank, r in enumerate(results):
        assert max(r["errs"].values()) < 1e-6, (rank, r["errs"])
        assert all(r["facts"].values()), (rank, r["facts"])


def test_alias_is_fresh_while_its_node_has_not_run():
    """Without a backward in between, every call makes a fresh alias (and keeps the newest)."""
    aliases = LeafAliases()
    w = torch.nn.Parameter(torch.ones(3))
    a = aliases.pvary(w, None)
    b = aliases.pvary(w, None)
    # (aliases share the parameter's storage without being views of it: an optimizer's in-place step leaves them
    # usable)
    assert a is not b and a.data_ptr() == b.data_ptr() == w.data_ptr() and a._base is None and len(aliases) == 1
    assert aliases.pvary(torch.nn.Parameter(torch.ones(3)), None) is not b and len(aliases) == 2
