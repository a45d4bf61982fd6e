"""``[param]`` operands: states from formulas, rank-local inference, ``einshard_like``."""

from __future__ import annotations

import pytest
import torch

import einshard as es
from einshard.notation import expand
from einshard.params import ParameterGradComm, get_parameter_state as state_of
from einshard.params.operand import is_rank_local

NAMES = ("dp", "sp", "tp")
MESH = es.Mesh.virtual((2, 2, 2), NAMES)


def _p(*shape):
    return torch.nn.Parameter(torch.zeros(shape))


def _state(formula, index, p=None, names=NAMES, **kw):
    f = expand(formula)
    p = p if p is not None else _p(*([2] * len(f.inputs[index].items)))
    return es.params.parameter_operand_state(p, f.inputs, f.output, index, mesh_dim_names=names, **kw)


@pytest.mark.parametrize(
    "formula, local",
    [
        ("b/dp c, c d -> b/dp d", True),
        ("b/dp s/sp c, c d -> b/dp s/sp d", True),
        ("b c, c d/tp -> b d/tp", True),
        ("b/dp c, c d -> b d", False),  # a sharded axis missing from the output
        ("b/dp c, c d -> b/sp d", False),  # a different group in the output
        ("b c/tp, c/tp d -> b d // tp", False),  # partial
        ("b c // dp, c d -> b d", False),
        ("b/dp c, b/dp d -> b/dp c d", False),  # a sharded axis in two inputs
        ("b c, c d -> b d", True),
    ],
)
def test_rank_local(formula, local):
    f = expand(formula)
    assert is_rank_local(f.inputs, f.output) is local


def test_inference_on_rank_local_formulas():
    s = _state("b/dp s/sp c, c d [param] -> b/dp s/sp d", 1)
    assert s.grad_comm == ParameterGradComm("inferred", ("dp", "sp"), "native") and s.source == "formula"
    assert _state("b/dp-sp c, c d [param] -> b/dp-sp d", 1).grad_comm.mesh_dims == ("dp-sp",)  # kept whole
    # other inputs left to right, then the output
    s = _state("x/tp, b/dp c, c d [param] -> x/tp b/dp d", 2)
    assert s.grad_comm.mesh_dims == ("tp", "dp")
    s = _state("b c, c d/tp [param] -> b d/tp", 1)
    assert s.grad_comm == ParameterGradComm() and s.layout_shard_dims == ("tp",)  # no dims: plain none
    s = _state("b/dp c, c d [param, grad=async] -> b/dp d", 1)
    assert s.grad_comm == ParameterGradComm("inferred", ("dp",), "native", "async")
    assert _state("b/dp c, c d [param, grad=ddp] -> b/dp d", 1).grad_comm.backend == "ddp"


def test_inference_gathers_shard_groups_then_output_partials_on_any_formula():
    """Called directly, a pending duty takes the groups of any formula: the shard groups of the axes the
    parameter lacks (other inputs, then the output), then the output's partial groups, by exact text."""
    assert _state("b/dp c, c d [param] -> b d", 1).grad_comm.mesh_dims == ("dp",)
    assert _state("b/dp c, c d [param] -> d // dp", 1).grad_comm.mesh_dims == ("dp",)
    s = _state("b/dp c, c [param, grad=async] -> b/dp c // sp", 1)
    assert s.grad_comm == ParameterGradComm("inferred", ("dp", "sp"), "native", "async")
    assert _state("b/dp c, c d [param] -> b/dp d // tp", 1).grad_comm.mesh_dims == ("dp", "tp")
    assert _state("x/tp c, c d [param], x/tp -> x/tp d", 1).grad_comm.mesh_dims == ("tp",)  # deduplicated
    with pytest.raises(ValueError, match="grad.*overlap"):  # 'dp-sp' and 'sp-dp' are two groups by text
        _state("b/dp-sp c, c [param, grad=async] -> b/sp-dp c", 1)
    with pytest.raises(ValueError, match="grad.*overlap"):  # a partial over the parameter's own shard
        _state("b c/tp, c/tp [param] -> b // tp", 1)


def test_explicit_forms_stay_and_infer_grad_modes():
    assert _state("b/dp c, c d [param, grad=tp] -> b/dp d", 1).grad_comm.mesh_dims == ("tp",)
    assert _state("b/dp c, c d [param, grad=none] -> b/dp d", 1).explicit_grad_comm_none
    assert _state("b/dp c, c d [param] -> b/dp d", 1, infer_grad=False).grad_comm.pending_inference
    s = _state("b/dp c, c d [param] -> d // dp", 1, infer_grad="partials")
    assert s.grad_comm.mesh_dims == ("dp",)
    # 'partials' skips the shard groups: none left means no duty
    assert _state("b/dp c, c d [param] -> b/dp d", 1, infer_grad="partials").grad_comm == ParameterGradComm()
    with pytest.raises(ValueError, match="infer_grad"):
        _state("b c, c d [param] -> b d", 1, infer_grad="yes")


@pytest.mark.parametrize("formula", ["b c, c [param, grad=async] -> b c // sp", "b c/sp, c/sp [param, grad=async] -> b // sp",
                                     "c [param, grad=async] -> c // dp", "b/dp c/sp, c [param, grad=async] -> b/dp c"])
def test_einshard_like_keeps_pending_duties_of_formulas_that_are_not_rank_local(formula):
    """es.einshard infers only on rank-local formulas; the others stay pending (the planner resolves them)."""
    w = _p(2)
    es.params.einshard_like(formula, *([None] * (len(expand(formula).inputs) - 1) + [w]), mesh=MESH)
    state = state_of(w)
    assert state.grad_comm.pending_inference and state.grad_comm.schedule == "async"


def test_operand_errors():
    with pytest.raises(TypeError, match="torch.nn.Parameter"):
        _state("b c, c d [param] -> b d", 1, p=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="unknown mesh dimensions"):
        _state("b/xx c, c d [param] -> b/xx d", 1)
    with pytest.raises(ValueError, match="grad .* overlaps"):
        _state("b c, c d/tp [param, grad=tp] -> b d/tp", 1)


def test_register_parameter_operand_checks_rank_and_merges():
    f = expand("b/dp c, c d [param] -> b/dp d")
    w = _p(3, 4)
    assert es.params.register_parameter_operand(w, f.inputs, f.output, 1, mesh_dim_names=NAMES) is w
    assert state_of(w).reduce == ("dp",)
    with pytest.raises(ValueError, match="rank"):
        es.params.register_parameter_operand(_p(3), f.inputs, f.output, 1)
    g = expand("b/sp c, c d [param] -> b/sp d")
    with pytest.raises(ValueError, match="different grad groups"):
        es.params.register_parameter_operand(w, g.inputs, g.output, 1, mesh_dim_names=NAMES)
    assert state_of(w).reduce == ("dp",)


# -- einshard_like ----------------------------------------------------------------------------------
def test_einshard_like_records_without_values():
    w, b = _p(3, 4), _p(4)
    assert es.params.einshard_like("x/dp c, c d [param], d [param, grad=dp:async] -> x/dp d", None, w, b, mesh=MESH) is None
    assert state_of(w).reduce == ("dp",) and state_of(w).mesh_dim_names == NAMES
    assert state_of(b).grad_comm.schedule == "async" and state_of(b).source == "formula"
    # families expand; the same parameter twice in one call merges in order
    v = _p(3, 3)
    es.params.einshard_like("*s c, c e [param], e e2 -> *s e2", None, v, None, mesh=MESH, families={"s": ["b/dp"]})
    assert state_of(v).reduce == ("dp",)
    u = _p(2, 2)
    es.params.einshard_like("a b [param], a b [param] -> a b", u, u)
    assert state_of(u).grad_comm == ParameterGradComm()
    with es.use_mesh(MESH):  # the ambient mesh counts for the names
        z = _p(2)
        es.params.einshard_like("b/dp c, c [param] -> b/dp", None, z)
        assert state_of(z).mesh_dim_names == NAMES


@pytest.mark.parametrize(
    "formula, operands, kw, exc, words",
    [
        ("b c, c d [param] -> b d", (None,), {}, ValueError, "no tensor was given"),
        ("b c, c d [param] -> b d", (None, torch.zeros(3, 4)), {}, TypeError, "torch.nn.Parameter"),
        ("b c, c d [param] -> b d", (None, "w"), {}, TypeError, "torch.nn.Parameter"),
        ("b c, c [param] -> b", (None, "p1"), {}, ValueError, "rank"),
        ("b/dp c, c d [param] -> b/dp d", (None, "p2"), {}, ValueError, "mesh="),
        ("b/xx c, c d [param] -> b/xx d", (None, "p2"), {"mesh": MESH}, ValueError, "xx"),
        ("b c, c d [param] -> b d e", (None, "p2"), {}, ValueError, "'e'"),
        ("b c, c d [param] -> b d d", (None, "p2"), {}, ValueError, "appears more than once"),
        ("b/dp c, c d [param] -> b/dp d", (None, "p2"), {"mesh": es.Mesh.virtual((2,), ("tp",))}, ValueError, "dp"),
    ],
)
def test_einshard_like_errors_attach_nothing(formula, operands, kw, exc, words):
    params = {"p1": _p(2, 2), "p2": _p(2, 2)}
    operands = tuple(params.get(o, o) if isinstance(o, str) and o in params else o for o in operands)
    with pytest.raises(exc, match=words):
        es.params.einshard_like(formula, *operands, **kw)
    assert all(state_of(p) is None for p in params.values())


def test_einshard_like_ignores_mesh_names_without_param():
    class Bad:
        mesh_dim_names = ("a", "a")

    es.params.einshard_like("b c, c d -> b d", None, None, mesh=Bad())  # a local formula, no [param]: nothing read
