"""Explicit registration (layouts, modules, linear/conv/norm), finalisation and validation: single process."""

from __future__ import annotations

import pytest
import torch

import einshard as es
from einshard.params import ParameterGradComm, ParameterState, get_parameter_state as state_of

NAMES = ("dp", "tp")
MESH = es.Mesh.virtual((2, 4), NAMES)


def _nothing_attached(module):
    return all(state_of(p) is None for p in module.parameters())


# -- register_parameter_layout ---------------------------------------------------------------
def test_parameter_layout():
    p = torch.nn.Parameter(torch.zeros(4, 3))
    assert es.params.register_parameter_layout(p, "out/tp in", mesh=MESH, grad="dp:async", init_sync="dp") is p
    s = state_of(p)
    assert s.layout == "out/tp in" and s.source == "layout" and s.mesh_dim_names == NAMES
    assert s.grad_comm == ParameterGradComm("explicit", ("dp",), "native", "async")
    assert s.init_sync.mode == "explicit"
    with pytest.raises(ValueError, match="rank"):
        es.params.register_parameter_layout(torch.nn.Parameter(torch.zeros(4)), "out in")
    with pytest.raises(TypeError):
        es.params.register_parameter_layout(torch.zeros(4), "c")
    with pytest.raises(TypeError):
        es.params.register_parameter_layout(torch.nn.Parameter(torch.zeros(4)), None)


# -- modules -----------------------------------------------------------------------------------
def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def test_module_layouts_with_per_name_values():
    m = _mlp()
    es.params.register_module_parameter_layouts_(
        m,
        {"0.weight": "f/tp c", "0.bias": "f/tp", "2.weight": "c f/tp", "2.bias": "c"},
        mesh=MESH,
        grad={"0.weight": "dp", "2.bias": "dp:async"},
        init_sync="dp",
    )
    assert state_of(m[0].weight).reduce == ("dp",) and state_of(m[0].bias).grad_comm.mode == "none"
    assert state_of(m[2].bias).grad_comm.schedule == "async"
    assert all(state_of(p).init_sync.mesh_dims == ("dp",) for p in m.parameters())
    assert {state_of(p).source for p in m.parameters()} == {"module"}


@pytest.mark.parametrize(
    "layouts, kw, exc, words",
    [
        (["0.weight"], {}, TypeError, "mapping"),
        ({}, {}, ValueError, "must not be empty"),
        ({1: "a b"}, {}, TypeError, "str"),
        ({"0.weight": None}, {}, TypeError, "str"),
        ({"": "a"}, {}, ValueError, "empty"),
        ({"9.weight": "a b"}, {}, ValueError, "unknown parameter names"),
        ({"0.weight": "a b"}, {"grad": {"0.bias": "dp"}}, ValueError, "unknown parameter names"),
        ({"0.weight": "a b", "0.bias": "a b"}, {}, ValueError, "rank"),
        ({"0.weight": "a/tp b", "0.bias": "a/xx"}, {"mesh": MESH}, ValueError, "unknown mesh dimensions"),
        ({"0.weight": "a/tp b"}, {"grad": "tp", "mesh": MESH}, ValueError, "overlaps"),
    ],
)
def test_module_layout_errors_attach_nothing(layouts, kw, exc, words):
    m = _mlp()
    with pytest.raises(exc, match=words):
        es.params.register_module_parameter_layouts_(m, layouts, **kw)
    assert _nothing_attached(m)


def test_module_layouts_merge_conflict_attaches_nothing():
    m = _mlp()
    es.params.register_parameter_layout(m[2].bias, "c", grad="dp")
    with pytest.raises(ValueError, match="incompatible metadata"):
        es.params.register_module_parameter_layouts_(m, {"0.weight": "f c", "2.bias": "c"}, grad="tp")
    assert state_of(m[0].weight) is None


def test_alias_merges_within_one_call():
    lin = torch.nn.Linear(2, 2)
    m = torch.nn.Module()
    m.a, m.b = lin, lin
    # the same Parameter twice in one call: uses merge in order
    es.params.register_module_parameter_layouts_(m, {"a.weight": "o i", "b.weight": "o i"}, grad={"b.weight": "dp"})
    assert state_of(lin.weight).reduce == ("dp",)
    with pytest.raises(ValueError, match="different layout"):
        es.params.register_module_parameter_layouts_(torch.nn.ModuleDict({"a": lin, "b": lin}),
                                              {"a.bias": "o", "b.bias": "p"})


# -- linear ----------------------------------------------------------------------------------
def test_linear_defaults_and_values():
    lin = es.params.register_linear_parameters_(torch.nn.Linear(3, 4))
    assert state_of(lin.weight).layout == "out in" and state_of(lin.bias).layout == "out"
    assert state_of(lin.weight).source == "linear"
    lin = es.params.register_linear_parameters_(
        torch.nn.Linear(3, 4), weight_layout="out/tp in", mesh=MESH, weight_grad="dp", bias_grad="dp:async",
        init_sync="dp", bias_init_sync="none",
    )
    assert state_of(lin.bias).layout == "out/tp" and state_of(lin.bias).grad_comm.schedule == "async"
    assert state_of(lin.weight).init_sync.mesh_dims == ("dp",) and state_of(lin.bias).explicit_init_sync_none
    row = es.params.register_linear_parameters_(torch.nn.Linear(8, 3), weight_layout="out in/tp", bias_layout="out")
    assert state_of(row.bias).layout == "out"
    nob = es.params.register_linear_parameters_(torch.nn.Linear(3, 4, bias=False), weight_layout="o/tp i")
    assert state_of(nob.weight).layout == "o/tp i"


class _Odd(torch.nn.Module):
    def __init__(self, weight, bias):
        super().__init__()
        self.weight, self.bias = weight, bias


@pytest.mark.parametrize(
    "module, kw, exc, words",
    [
        (torch.nn.Linear(3, 4), {"weight_layout": "out/tp in", "bias_layout": "out"}, ValueError, "bias layout"),
        (torch.nn.Linear(3, 4, bias=False), {"bias_grad": "dp"}, ValueError, "bias"),
        (torch.nn.Linear(3, 4, bias=False), {"bias_layout": "out"}, ValueError, "bias"),
        (torch.nn.Linear(3, 4), {"weight_layout": None}, TypeError, "str"),
        (torch.nn.ReLU(), {}, ValueError, "no weight"),
        (_Odd(torch.zeros(4, 3), None), {}, TypeError, "Parameter"),
        (_Odd(torch.nn.Parameter(torch.zeros(4, 3)), torch.zeros(4)), {}, TypeError, "Parameter"),
        (_Odd(torch.nn.Parameter(torch.zeros(4, 3, 1)), None), {}, ValueError, "rank 2"),
        (_Odd(torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(4, 1))), {}, ValueError, "rank 1"),
        (_Odd(torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(5))), {}, ValueError, "bias shape"),
        (torch.nn.Linear(3, 4), {"weight_layout": "out/tp in", "weight_grad": "tp"}, ValueError, "overlaps"),
    ],
)
def test_linear_errors_attach_nothing(module, kw, exc, words):
    with pytest.raises(exc, match=words):
        es.params.register_linear_parameters_(module, **kw)
    assert _nothing_attached(module)


# -- conv ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls, layout", [(torch.nn.Conv1d, "out in k"), (torch.nn.Conv2d, "out in kh kw"),
                                         (torch.nn.Conv3d, "out in kd kh kw")])
def test_conv_defaults(cls, layout):
    conv = es.params.register_conv_parameters_(cls(2, 4, 3), grad="dp", bias_grad="dp:async")
    assert state_of(conv.weight).layout == layout and state_of(conv.bias).layout == "out"
    assert state_of(conv.weight).reduce == ("dp",) and state_of(conv.bias).grad_comm.schedule == "async"
    assert state_of(conv.weight).source == "conv"


def test_conv_errors():
    with pytest.raises(NotImplementedError, match="ConvTranspose"):
        es.params.register_conv_parameters_(torch.nn.ConvTranspose2d(2, 4, 3))
    with pytest.raises(NotImplementedError, match="groups"):
        es.params.register_conv_parameters_(torch.nn.Conv2d(2, 4, 3, groups=2))
    conv = torch.nn.Conv2d(2, 4, 3)
    with pytest.raises(ValueError, match="bias layout"):
        es.params.register_conv_parameters_(conv, weight_layout="out/tp in kh kw", bias_layout="out")
    with pytest.raises(ValueError, match="rank"):
        es.params.register_conv_parameters_(conv, weight_layout="out in k")
    assert _nothing_attached(conv)


# -- norm ------------------------------------------------------------------------------------------
def test_norm():
    ln = es.params.register_norm_parameters_(torch.nn.LayerNorm(4), mesh=MESH, grad="tp", weight_grad="dp")
    assert state_of(ln.weight).layout == "c" and state_of(ln.bias).layout == "c"
    assert state_of(ln.weight).reduce == ("dp",) and state_of(ln.bias).reduce == ("tp",)
    assert state_of(ln.weight).source == "norm"
    bn = torch.nn.BatchNorm1d(4)
    es.params.register_norm_parameters_(bn, layout="c/tp", mesh=MESH)
    assert state_of(bn.bias).layout == "c/tp" and not hasattr(bn.running_mean, "einshard_state")
    ln2 = es.params.register_norm_parameters_(torch.nn.LayerNorm(4), weight_layout="h", bias_layout="h")
    assert state_of(ln2.bias).layout == "h"
    with pytest.raises(ValueError, match="differ"):
        es.params.register_norm_parameters_(torch.nn.LayerNorm(4), layout="a", weight_layout="b")
    with pytest.raises(TypeError):
        es.params.register_norm_parameters_(torch.nn.LayerNorm(4), layout=None)
    with pytest.raises(ValueError, match="no weight"):
        es.params.register_norm_parameters_(torch.nn.LayerNorm(4, elementwise_affine=False))
    bad = _Odd(torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(ValueError, match="bias shape"):
        es.params.register_norm_parameters_(bad)
    assert _nothing_attached(bad)
    with pytest.raises(ValueError, match="rank"):
        es.params.register_norm_parameters_(torch.nn.LayerNorm((2, 4)))


def test_shared_grad_and_init_sync_are_defaults_that_a_biasless_module_takes_on_its_weight():
    conv = es.params.register_conv_parameters_(torch.nn.Conv2d(2, 4, 3, bias=False), grad="dp", init_sync="dp",
                                        mesh_dim_names=("dp",))
    assert state_of(conv.weight).reduce == ("dp",) and state_of(conv.weight).shared == ("dp",)
    ln = es.params.register_norm_parameters_(torch.nn.LayerNorm(4, bias=False), grad="dp", mesh_dim_names=("dp",))
    assert state_of(ln.weight).reduce == ("dp",)
    lin = es.params.register_linear_parameters_(torch.nn.Linear(3, 4, bias=False), init_sync="none")
    assert state_of(lin.weight).init_sync.mode == "none"
    for register, module in ((es.params.register_conv_parameters_, lambda: torch.nn.Conv2d(2, 4, 3, bias=False)),
                             (es.params.register_norm_parameters_, lambda: torch.nn.LayerNorm(4, bias=False)),
                             (es.params.register_linear_parameters_, lambda: torch.nn.Linear(3, 4, bias=False))):
        for kw in ({"bias_grad": "dp"}, {"bias_init_sync": "none"}, {"bias_layout": "out"}):
            m = module()
            with pytest.raises(ValueError, match="bias"):
                register(m, **kw)
            assert _nothing_attached(m)


def test_norm_layout_none_is_not_omitted_and_the_bias_layout_must_match():
    ln = torch.nn.LayerNorm(4)
    with pytest.raises(TypeError, match="layout"):
        es.params.register_norm_parameters_(ln, layout=None, weight_layout="hidden")
    with pytest.raises(ValueError, match="bias.*layout"):
        es.params.register_norm_parameters_(ln, layout="c", bias_layout="d")
    with pytest.raises(ValueError, match="bias.*layout"):
        es.params.register_norm_parameters_(ln, layout="c/tp", bias_layout="c", mesh_dim_names=("tp",))
    assert _nothing_attached(ln)
    es.params.register_norm_parameters_(ln, layout="c/tp", bias_layout="c/tp", mesh_dim_names=("tp",))
    assert state_of(ln.bias).layout == "c/tp"


# -- finalisation ------------------------------------------------------------------------------------
def _pending(shape=(3,), ann="c [param]", names=NAMES):
    p = torch.nn.Parameter(torch.zeros(shape))
    es.params.register_parameter_state(p, ParameterState.from_spec(ann, mesh_dim_names=names))
    return p


def test_finalize():
    p = _pending()
    assert es.params.finalize_parameter_grad_comm_(p, "dp", mesh=MESH) is p
    assert state_of(p).grad_comm == ParameterGradComm("explicit", ("dp",), "native")
    with pytest.raises(ValueError, match="not pending"):
        es.params.finalize_parameter_grad_comm_(p, "tp")
    q = _pending(ann="c [param, grad=async]")
    es.params.finalize_parameter_grad_comm_(q, "dp")
    assert state_of(q).grad_comm.schedule == "async"  # the pending schedule is kept
    r = _pending(ann="c [param, grad=ddp]")
    with pytest.raises(ValueError, match="backend"):
        es.params.finalize_parameter_grad_comm_(r, "dp")
    es.params.finalize_parameter_grad_comm_(r, "dp:ddp")
    assert state_of(r).grad_comm.backend == "ddp"


@pytest.mark.parametrize(
    "grad, kw, exc, words",
    [
        (3, {}, TypeError, "str"),
        ("async", {}, ValueError, "explicit mesh group"),
        ("none", {}, ValueError, "explicit mesh group"),
        ("xx", {}, ValueError, "unknown mesh dimensions"),
        ("tp", {}, ValueError, "overlaps"),
        ("dp", {"mesh_dim_names": ("a", "b")}, ValueError, "differ"),
        ("dp-sp", {"mesh": es.Mesh.virtual((2, 2), ("dp", "sp"))}, ValueError, "differ"),
    ],
)
def test_finalize_errors(grad, kw, exc, words):
    p = _pending(shape=(3,), ann="c/tp [param]")
    before = state_of(p)
    with pytest.raises(exc, match=words):
        es.params.finalize_parameter_grad_comm_(p, grad, **kw)
    assert state_of(p) is before


def test_finalize_resolves_on_mesh():
    p = _pending(names=(), ann="c [param]")
    with pytest.raises(ValueError, match="'sp'.* not in the mesh"):
        es.params.finalize_parameter_grad_comm_(p, "dp-sp", mesh=MESH)
    assert state_of(p).grad_comm.pending_inference
    es.params.finalize_parameter_grad_comm_(p, "dp-tp", mesh=MESH)
    assert state_of(p).mesh_dim_names == NAMES  # the given names are used
    with pytest.raises(ValueError, match="no ParameterState"):
        es.params.finalize_parameter_grad_comm_(torch.nn.Parameter(torch.zeros(1)), "dp")
    with pytest.raises(TypeError):
        es.params.finalize_parameter_grad_comm_(torch.zeros(1), "dp")


def test_finalize_module_all_or_nothing():
    m = torch.nn.Module()
    m.a = _pending()
    m.b = _pending(ann="c/tp [param]")
    with pytest.raises(ValueError, match="'b'"):
        es.params.finalize_module_parameter_grad_comm_(m, {"a": "dp", "b": "tp"})
    assert state_of(m.a).grad_comm.pending_inference
    es.params.finalize_module_parameter_grad_comm_(m, {"a": "dp", "b": "dp:async"})
    assert state_of(m.b).grad_comm.schedule == "async"
    with pytest.raises(TypeError):
        es.params.finalize_module_parameter_grad_comm_(m, "dp")
    with pytest.raises(ValueError, match="empty"):
        es.params.finalize_module_parameter_grad_comm_(m, {})
    with pytest.raises(ValueError, match="unknown parameter"):
        es.params.finalize_module_parameter_grad_comm_(m, {"zz": "dp"})


# -- validation ---------------------------------------------------------------------------------------
def test_validate():
    lin = es.params.register_linear_parameters_(torch.nn.Linear(3, 4), weight_layout="out/tp in", mesh=MESH, weight_grad="dp")
    assert es.params.validate_module_parameter_states_(lin, MESH) is lin
    m = torch.nn.Module()
    m.p = _pending()
    with pytest.raises(ValueError, match="Invalid parameter metadata for 'p': .*pending inference"):
        es.params.validate_module_parameter_states_(m)
    es.params.validate_module_parameter_states_(m, allow_pending=True)
    with pytest.raises(ValueError, match="Invalid parameter metadata for 'p'"):
        es.params.validate_module_parameter_states_(m, es.Mesh.virtual((2,), ("dp",)), allow_pending=True)
    q = torch.nn.Module()
    q.w = torch.nn.Parameter(torch.zeros(3))
    es.params.set_parameter_state(q.w, "c")
    with pytest.raises(ValueError, match="Invalid parameter metadata for 'w'"):
        es.params.validate_module_parameter_states_(q)
    es.params.set_parameter_state(q.w, ParameterState.from_layout("a b"))  # raw overwrite: wrong rank
    with pytest.raises(ValueError, match="Invalid parameter metadata for 'w': .*rank"):
        es.params.validate_module_parameter_states_(q)
    from dataclasses import replace

    stale = replace(ParameterState.from_layout("a/tp"), layout_shard_dims=())
    es.params.set_parameter_state(q.w, stale)
    with pytest.raises(ValueError, match="stale"):
        es.params.validate_module_parameter_states_(q)
    # resolution on the mesh: a group missing from the mesh is named
    es.params.set_parameter_state(q.w, ParameterState.from_layout("a/sp"))
    with pytest.raises(ValueError, match="'sp'"):
        es.params.validate_module_parameter_states_(q, MESH)
