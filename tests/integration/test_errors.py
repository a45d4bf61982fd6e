"""es.EinshardError: one error class, the expression named once at the entry; the bounded cache."""

import pytest
import torch

import einshard as es
from einshard.core._cache import BoundedCache
from einshard.errors import EinshardError, naming
from einshard.ops.halo import einhalo


@pytest.mark.parametrize(
    "call, expression, start",
    [
        (lambda: es.einshard("a b -> a", torch.ones(2, 3), torch.ones(3)), "a b -> a", "'a b -> a': the formula has"),
        (lambda: es.einshard("a b -> c", torch.ones(2, 3)), "a b -> c", "Invalid einshard expression"),
        (lambda: es.einshard("(a b) -> a b", torch.ones(6)), "(a b) -> a b", "'(a b) -> a b': Cannot infer"),
        (lambda: es.einfft("a b -> ka b", torch.ones(4, 3), {"q": "kq"}), "a b -> ka b", "'a b -> ka b': axes names"),
        (lambda: einhalo("b w", torch.ones(2, 5), {"q": 1}), "b w", "einhalo: 'b w': halos names axis 'q'"),
        (lambda: es.einroll("b w", torch.ones(2, 5), {"w": 1.5}), "b w", "einroll: 'b w': the shift of axis 'w'"),
        (lambda: es.einwindow("w -> w k", torch.ones(4), {"w": "k"}, {"w": 1}, boundary="x"), "w -> w k",
         "einwindow: 'w -> w k': boundary must be"),
    ],
)
def test_errors_name_their_expression_once(call, expression, start):
    with pytest.raises(es.EinshardError) as info:
        call()
    err = info.value
    assert isinstance(err, ValueError) and err.expression == expression
    assert str(err).startswith(start), str(err)
    assert str(err).count(repr(expression)) <= 1


def test_within_and_naming_add_the_prefix_once():
    @naming()
    def deep(text):
        raise EinshardError("no such axis")

    with pytest.raises(EinshardError) as info:
        deep("a b")
    assert str(info.value.within("other")) == "'a b': no such axis"
    named = EinshardError.named("Invalid einshard expression: ... 'x'", "x")
    assert str(named.within("y")) == "Invalid einshard expression: ... 'x'" and named.expression == "x"


def test_bounded_cache_empties_at_its_limit():
    cache = BoundedCache(3)
    for k in range(10):
        assert cache.put(k, str(k)) == str(k)
        assert 1 <= len(cache) <= 3 and cache.get(k) == str(k)


def test_a_cached_call_does_not_let_a_lookalike_argument_through():
    # a list of pairs looks like the dict it is not: rejected whether or not the dict form is cached
    x, y = torch.randn(6, 5), torch.randn(2, 8)
    for _ in range(2):
        assert es.einhalo("h w", x, {"h": 1}).shape == (8, 5)
        with pytest.raises(es.EinshardError, match="halos must be a dict"):
            es.einhalo("h w", x, [("h", 1)])
        assert es.einfft("b x -> b kx", y, {"x": "kx"}).shape == (2, 8)
        with pytest.raises(es.EinshardError, match="axes= must be a dict"):
            es.einfft("b x -> b kx", y, [("x", "kx")])


def test_plan_policy_metric_is_checked_and_either_metric_plans():
    with pytest.raises(es.EinshardError, match="metric must be 'sent' or 'max_received'"):
        es.PlanPolicy(metric="bogus")
    mesh = es.Mesh.virtual((4,), ("tp",))
    for metric in ("sent", "max_received"):
        plan = es.explain("a/tp b, b c -> a c", (8, 6), (6, 4), mesh=mesh, policy=es.PlanPolicy(metric=metric))
        assert "a/tp" in str(plan)
