"""The steady state of distributed formulas: after the first call a formula replays its plan, found from a key
that is cheap to build (``einshard.ops.einshard._replayed``). Every fact that changes the plan or how it runs
is in that key (dtype, device, local shapes, mesh, ambient mesh and split shapes, policy, requires_grad, grad
mode, attached parameter states); checks, ``torch.func`` transforms and compiled code take their own paths. The
replays give the values and gradients of whole tensors in one process, moving data or not."""

import importlib

import pytest
import torch
from dist_reference import check_formula

import einshard as es
from einshard.core import _context
from einshard.testing import MeshSpec, run_on_ranks

_ops = importlib.import_module("einshard.ops.einshard")

FORMULA = "b c, f/one c -> b f/one"  # over a mesh dimension of size 1: nothing moves, no process group needed


@pytest.fixture
def replays():
    """The replay cache, emptied before and after the test."""
    _ops._REPLAYS.clear()
    yield _ops._REPLAYS
    _ops._REPLAYS.clear()


def _meshes():
    return es.Mesh.virtual((1, 2), ("one", "tp")), es.Mesh.virtual((1, 4), ("one", "tp"))


def _new_entries(replays, call):
    """How many replays the first call keeps; a second call must keep none and give the same result, which
    is the local formula's."""
    before = len(replays)
    first = call()
    kept = len(replays) - before
    second = call()
    assert len(replays) == before + kept
    assert first.shape == second.shape and first.device == second.device
    assert first.device.type == "meta" or torch.equal(first, second)
    return kept, second


def test_each_fact_of_the_call_is_in_the_replay_key(replays):
    m1, m2 = _meshes()
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    xg = x.clone().requires_grad_()
    param = torch.nn.Parameter(w.clone())
    stated = torch.nn.Parameter(w.clone())
    es.params.set_parameter_state(stated, es.params.ParameterState.from_layout("f/one c"))

    def run(*ts, mesh=m1):
        return es.einshard(FORMULA, *ts, mesh=mesh)

    def ambient(mesh, shapes=None):
        token = _context.push(mesh=mesh, shapes=shapes)
        try:
            return es.einshard(FORMULA, x, w)
        finally:
            _context.pop(token)

    def without_grad():
        with torch.no_grad():
            return run(xg, w)

    def with_policy():
        with es.optimize("memory"):
            return run(x, w)

    calls = {
        "base": lambda: run(x, w),
        "dtype": lambda: run(x.double(), w.double()),
        "device": lambda: run(x.to("meta"), w.to("meta")),
        "shape": lambda: run(x[:2], w),
        "mesh": lambda: run(x, w, mesh=m2),
        "requires_grad": lambda: run(xg, w),
        "grad mode": without_grad,
        "ambient mesh": lambda: ambient(m1),
        "another ambient mesh": lambda: ambient(m2),
        "ambient split shapes": lambda: ambient(m1, {(("tp",), "c"): (2, 2)}),
        "policy": with_policy,
        "parameter": lambda: run(x, param),
        "parameter with a state": lambda: run(x, stated),
    }
    for name, call in calls.items():
        kept, out = _new_entries(replays, call)
        assert kept == 1, name  # a key of its own
        if out.device.type != "meta":
            want = es.einshard("b c, f c -> b f", x[: out.shape[0]].to(out.dtype), w.to(out.dtype))
            assert torch.allclose(out, want), name
    assert not calls["grad mode"]().requires_grad and calls["requires_grad"]().requires_grad
    # a state attached later is a new key, and so is its replacement
    es.params.set_parameter_state(param, es.params.ParameterState.from_layout("f/one c"))
    assert _new_entries(replays, calls["parameter"])[0] == 1
    es.params.set_parameter_state(param, es.params.ParameterState.from_layout("f/one c", grad="tp"))
    assert _new_entries(replays, calls["parameter"])[0] == 1


def test_explicit_arguments_take_the_checked_path(replays):
    m1, _ = _meshes()
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    want = es.einshard("b c, f c -> b f", x, w)
    assert torch.allclose(es.einshard(FORMULA, x, w, mesh=m1, shapes={}), want)
    assert torch.allclose(es.einshard(FORMULA, x, w, mesh=m1, optimize="memory"), want)
    assert not replays  # (checks on: test_replays_give_the_values_and_gradients_of_whole_tensors)
    es.einshard(FORMULA, x, w, mesh=m1)
    assert len(replays) == 1  # checks off, no argument: kept


def test_a_compiled_call_does_not_replay_the_eager_plan(replays):
    m1, _ = _meshes()
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    eager = es.einshard(FORMULA, x, w, mesh=m1)
    assert len(replays) == 1
    compiled = torch.compile(lambda a, b: es.einshard(FORMULA, a, b, mesh=m1), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x, w), eager)
    assert len(replays) == 1


def test_vmap_takes_the_checked_path(replays):
    m1, _ = _meshes()
    xs, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    got = torch.func.vmap(lambda a: es.einshard(FORMULA, a, w, mesh=m1))(xs)
    assert torch.allclose(got, torch.einsum("kbc,fc->kbf", xs, w))
    assert not replays


def _replayed_on_ranks(mesh):
    """Values and gradients of moving formulas against whole tensors, three calls each (plan, then replays), in
    float64 and float32, with and without gradients, with checks on between (the replay resumes after). Sharded
    operands are even: without ``shapes=`` a rank knows only its own block."""
    cases = [
        ("b n c, f/tp c -> b n f/tp", [(2, 3, 6), (10, 6)]),  # copy to the tp region (a pvary)
        ("b n f/tp, c f/tp -> b n c", [(2, 3, 10), (5, 10)]),  # reduce from it (owned all-reduce)
        ("a/tp b -> a b/tp", [(8, 9)]),  # all-to-all, uneven blocks out
        ("a k/tp, k/tp m, m -> a", [(3, 8), (8, 4), (4,)]),  # three operands, two stages
        ("(h/tp p) c -> h/tp p c", [(12, 3)]),  # reshapes
    ]
    for formula, shapes in cases:
        for dtype, atol in ((torch.float64, 1e-9), (torch.float32, 1e-4)):
            for grad in (True, False):
                for _ in range(3):
                    check_formula(mesh, formula, shapes, shapes=None, dtype=dtype, atol=atol, grad=grad,
                                  sizes={"p": 3} if "(h" in formula else None)
        kept = len(_ops._REPLAYS)
        es.set_checks(True)
        try:  # checks keep their cost: every call agrees, none replays or keeps a replay
            check_formula(mesh, formula, shapes, shapes=None, sizes={"p": 3} if "(h" in formula else None)
        finally:
            es.set_checks(False)
        assert len(_ops._REPLAYS) == kept
        check_formula(mesh, formula, shapes, shapes=None, sizes={"p": 3} if "(h" in formula else None)
    assert _ops._REPLAYS  # (the ranks run with checks off: the calls above replayed)
    h, w = torch.randn(2, 3, 5), torch.randn(4, 5)
    es.einshard("b n f/tp, c f/tp -> b n c", h, w, mesh=mesh)  # planned, its replay kept
    before = len(_ops._REPLAYS)
    with es.count_communication() as stats:  # a replay's collectives are counted
        es.einshard("b n f/tp, c f/tp -> b n c", h, w, mesh=mesh)
    assert len(_ops._REPLAYS) == before and stats.by_kind()["all_reduce"].calls == 1
    return True


@pytest.mark.ranks(2)
def test_replays_give_the_values_and_gradients_of_whole_tensors():
    assert all(run_on_ranks(2, _replayed_on_ranks, MeshSpec((2,), ("tp",)), timeout=240, checks=False))


def _replayed_on_2x2(mesh):
    """The same on a 2-D mesh, a permuted compound dimension, uneven blocks out, and a leaf operand (whose pvary
    sums at the end of backward). Sharded operands are even: without ``shapes=`` a rank knows only its block."""
    for formula, shapes in [("a/dp k, k m/tp -> a/dp m/tp", [(6, 6), (6, 8)]),
                            ("a k, k m -> a/dp m/tp", [(5, 6), (6, 7)]),
                            ("a k/tp-dp, k/tp-dp m -> a m", [(3, 8), (8, 4)]),
                            ("b c, f/tp c -> b f/tp", [(3, 4), (6, 4)])]:
        for _ in range(3):
            check_formula(mesh, formula, shapes, shapes=None)
    return True


@pytest.mark.ranks(4)
def test_replays_on_a_two_dimensional_mesh():
    assert all(run_on_ranks(4, _replayed_on_2x2, MeshSpec((2, 2), ("dp", "tp")), timeout=240,
                           checks=False))
