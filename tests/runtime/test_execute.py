"""Compiled transitions (einshard.runtime.execute): which are autograd nodes, and the eager forms a replay calls."""

import torch

import einshard as es
from einshard.core.layout import Layout
from einshard.runtime.execute import Transition


def _layouts():
    whole = Layout(axes=("f", "c"), sizes=(4, 3), shard=((), ()), splits=(None, None), partial=frozenset())
    return whole, whole.with_partial(frozenset({"dp"}))


def test_a_gradient_left_partial_for_its_duty_is_no_autograd_node():
    """``w -> w // dp`` whose gradient stays partial over dp (a duty over dp) moves nothing, forward or
    backward: no node. Without the duty, its backward sums over dp (a pvary): a node."""
    mesh = es.Mesh.virtual((2, 2), ("dp", "tp"))
    whole, varying = _layouts()
    with_duty = Transition(whole, varying, mesh, back=varying)
    assert with_duty.trivial and not with_duty.steps
    w = torch.randn(4, 3, requires_grad=True)
    assert with_duty(w) is w
    plain = Transition(whole, varying, mesh)
    assert not plain.trivial and plain.sum_dims == ("dp",)


def test_eager_forms_without_a_gradient_run_the_raw_steps():
    mesh = es.Mesh.virtual((2, 2), ("dp", "tp"))
    whole, varying = _layouts()
    pvary = Transition(whole, varying, mesh)
    x = torch.randn(4, 3)
    assert pvary.eager(False)(x) is x  # no step forward, no gradient: nothing runs
    y = torch.randn(4, 3, requires_grad=True) * 1
    out = pvary.eager(True)(y)  # the autograd node (its backward would sum over dp)
    assert out.grad_fn is not None and torch.equal(out, y)
