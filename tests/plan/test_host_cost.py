"""What a call costs the host: identity transitions vanish at plan time (mesh dimensions of size 1)."""

import pytest
import torch

import einshard as es
from dist_reference import check_many
from einshard.core.layout import Layout, MeshShape
from einshard.plan.transition import plan_gradient, plan_transition
from einshard.testing import MeshSpec, run_on_ranks

MESH = MeshShape(("one", "tp"), (1, 2))


def _layout(shard, partial=()):
    """Axes ``f`` (8) and ``c`` (3); ``shard``: the dims splitting ``f`` (evenly)."""
    splits = (8 // MESH.size(shard),) * MESH.size(shard) if shard else None
    return Layout(("f", "c"), (8, 3), (tuple(shard), ()), (splits, None), frozenset(partial))


@pytest.mark.parametrize("src, dst", [
    (_layout(("one",)), _layout(())),                       # gather over one rank
    (_layout(()), _layout(("one",))),                       # slice over one rank
    (_layout((), ("one",)), _layout(())),                   # all-reduce over one rank
    (_layout(()), _layout((), ("one",))),                   # pvary over one rank
    (_layout(("one", "tp")), _layout(("tp",))),             # a compound group with a size-1 part
    (_layout(("tp",), ("one",)), _layout(("one", "tp"))),   # reduce-scatter over one rank
])
def test_size_one_transitions_plan_no_step(src, dst):
    assert plan_transition(src, dst, MESH) == ()
    assert plan_transition(dst, src, MESH) == ()
    assert plan_gradient(src, dst, MESH) == ()
    assert src.essential(MESH) == dst.essential(MESH)


def test_moves_over_real_groups_keep_their_steps():
    assert [s.kind for s in plan_transition(_layout(("one", "tp")), _layout(()), MESH)] == ["all_gather"]
    assert [s.kind for s in plan_transition(_layout((), ("one", "tp")), _layout(()), MESH)] == ["all_reduce"]
    assert _layout(("tp",)).essential(MESH) == _layout(("tp",))


CASES = [
    dict(formula="b n c, f/one c -> b n f/one", global_shapes=[(2, 3, 4), (5, 4)]),
    dict(formula="b n c/one, f c/one -> b n f", global_shapes=[(2, 3, 4), (5, 4)]),
    dict(formula="b n c/one, f c/one -> b n f // one", global_shapes=[(2, 3, 4), (5, 4)]),
    dict(formula="b n c, f/one-tp c -> b n f/tp", global_shapes=[(2, 3, 4), (5, 4)]),
    dict(formula="b n c/tp, f c/tp -> b/one n f", global_shapes=[(2, 3, 5), (7, 5)]),
    dict(formula="a/one b -> a b/one", global_shapes=[(5, 3)]),
]


def _size_one(mesh):
    from einshard.runtime.distributed import _PLANS

    out = check_many(mesh, CASES)
    mesh = es.wrap_mesh(mesh)
    x, w = torch.randn(2, 3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    _PLANS.clear()
    y = es.einshard("b n c, f/one c -> b n f/one", x, w, mesh=mesh)
    (plan,) = _PLANS.values()
    stages, finish = plan._compiled
    assert finish is None and all(chain == () for _, chains, _, _ in stages for chain in chains)
    assert y.grad_fn.name() != "Transition"
    y.sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(5, 1) * x.detach().sum((0, 1)))
    return out


@pytest.mark.ranks(2)
def test_size_one_dimension_runs_as_the_local_formula():
    run_on_ranks(2, _size_one, MeshSpec((1, 2), ("one", "tp")), timeout=120)


def _steady_keys(mesh):
    """The steady-state lookup keys what the full key does: each variation replans (or finds its own plan), twice."""
    from dist_reference import check_formula

    base = dict(formula="b n c, f/tp c -> b n f/tp", global_shapes=[(2, 3, 4), (6, 4)])
    variations = [
        {},
        dict(dtype=torch.float32, atol=1e-5),                       # dtype
        dict(global_shapes=[(2, 5, 4), (6, 4)]),                     # local shapes
        dict(global_shapes=[(2, 3, 4), (7, 4)]),                     # uneven split shapes (shapes=)
        dict(grad=False),                                             # requires_grad
        dict(optimize="inference"),                                  # policy
        dict(formula="b n c, f/tp c -> b n f"),                      # another output layout
        dict(formula="b n c/tp, f c/tp -> b n f"),                   # another formula (a sum over tp)
    ]
    for checks_on in (False, True, False):                          # checks on and off
        es.set_checks(checks_on)
        try:
            for variation in variations * 2:
                check_formula(mesh, **{**base, **variation})
        finally:
            es.set_checks(False)
    return True


@pytest.mark.ranks(2)
def test_steady_state_keys_differ_where_plans_differ():
    run_on_ranks(2, _steady_keys, MeshSpec((2,), ("tp",)), timeout=180)
