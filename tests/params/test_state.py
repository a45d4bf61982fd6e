"""Parameter states: the three dataclasses, reading annotations and layouts, validation, merging, storage."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import einshard as es
from einshard.notation import Annotation, TensorSpec, parse_sharding
from einshard.params import (
    PARAM_STATE_ATTR,
    ParameterGradComm,
    ParameterInitSync,
    ParameterState,
    get_parameter_state,
    iter_parameter_states,
    register_parameter_state,
    set_parameter_state,
)

NAMES = ("dp", "tp")


def _spec(text: str) -> TensorSpec:
    return parse_sharding(text).inputs[0]


def _with(text: str, **annotations) -> TensorSpec:
    """A spec with annotations built directly (values the grammar may not spell yet, like 'dp:async')."""
    spec = _spec(text)
    anns = tuple(Annotation(k, None if v is True else v) for k, v in annotations.items())
    return TensorSpec(spec.items, spec.partial, anns)


def _param(*shape):
    return torch.nn.Parameter(torch.zeros(shape))


# -- dataclasses ---------------------------------------------------------------------------
def test_defaults_and_frozen():
    s = ParameterState(None)
    assert s.tensor_state is None and s.layout_shard_dims == () and s.mesh_dim_names == ()
    assert s.init_sync == ParameterInitSync("none", ()) and s.grad_comm == ParameterGradComm("none", (), "none")
    assert s.grad_comm.schedule == "backend_default" and s.source == "inferred"
    assert not s.explicit_init_sync_none and not s.explicit_grad_comm_none
    with pytest.raises(Exception):
        s.source = "x"
    assert replace(s, source="init").source == "init"
    assert s == ParameterState(None) and s.layout is None
    with pytest.raises(ValueError, match="layout-free"):
        s.axes


@pytest.mark.parametrize(
    "text, expected",
    [
        (None, ("inferred", (), "native", "backend_default")),
        ("async", ("inferred", (), "native", "async")),
        ("ddp", ("inferred", (), "ddp", "backend_default")),
        ("external", ("inferred", (), "external", "backend_default")),
        ("none", ("none", (), "none", "backend_default")),
        ("dp", ("explicit", ("dp",), "native", "backend_default")),
        ("dp-sp:async", ("explicit", ("dp-sp",), "native", "async")),
        ("dp:ddp", ("explicit", ("dp",), "ddp", "backend_default")),
        ("dp:external", ("explicit", ("dp",), "external", "backend_default")),
    ],
)
def test_grad_comm_table(text, expected):
    g = ParameterGradComm.from_annotation(text, is_param=True)
    assert (g.mode, g.mesh_dims, g.backend, g.schedule) == expected
    assert g.pending_inference == (expected[0] == "inferred")


def test_grad_comm_errors_and_absent_without_param():
    assert ParameterGradComm.from_annotation(None) == ParameterGradComm()
    for bad, words in (("async:ddp", "suffix"), ("dp:none", "unknown suffix"), ("dp:sync", "unknown suffix"),
                       ("dp::x", "Invalid grad"), ("1dp", "Invalid grad"), ("dp-", "Invalid grad")):
        with pytest.raises(ValueError, match=words):
            ParameterGradComm.from_annotation(bad)
    with pytest.raises(TypeError):
        ParameterGradComm.from_annotation(3)


def test_init_sync_from_annotation():
    assert ParameterInitSync.from_annotation(None, ("tp",), NAMES) == ParameterInitSync("inferred", ("dp",))
    assert ParameterInitSync.from_annotation(None, ("tp",), ()) == ParameterInitSync()
    assert ParameterInitSync.from_annotation(None, ("dp-tp",), NAMES) == ParameterInitSync("inferred", ())
    assert ParameterInitSync.from_annotation("dp", (), NAMES) == ParameterInitSync("explicit", ("dp",))
    assert ParameterInitSync.from_annotation("none").mode == "none"
    assert ParameterInitSync.from_annotation("external").mode == "external"
    with pytest.raises(ValueError, match="suffix"):
        ParameterInitSync.from_annotation("dp:async")
    with pytest.raises(ValueError, match="Invalid init_sync"):
        ParameterInitSync.from_annotation("d p")
    with pytest.raises(TypeError):
        ParameterInitSync.from_annotation(["dp"])


# -- from_spec / from_layout ---------------------------------------------------------------------
def test_from_spec_reads_annotations():
    s = ParameterState.from_spec(_spec("a/tp (b/sp c) [param, grad=dp]"), mesh_dim_names=("dp", "sp", "tp"))
    assert s.layout_shard_dims == ("tp", "sp") and s.layout == "a/tp (b/sp c)"
    assert s.grad_comm == ParameterGradComm("explicit", ("dp",), "native")
    assert s.init_sync == ParameterInitSync("inferred", ("dp",)) and s.shared == ("dp",) and s.reduce == ("dp",)
    assert s.tensor_state.placement_dict() == {"a": "tp", "b": "sp", "c": None}
    assert s.tensor_state.replicated_dims == ("dp",)
    assert s.source == "inferred"
    pending = ParameterState.from_spec(_spec("a b [param]"), source="formula")
    assert pending.grad_comm.pending_inference and pending.source == "formula"
    # without param an absent grad means none; '...' and repeated axes have no tensor state
    plain = ParameterState.from_spec(_spec("... c"))
    assert plain.grad_comm.mode == "none" and plain.tensor_state is None
    opt_out = ParameterState.from_spec(_with("c", param=True, grad="none", init_sync="none"))
    assert opt_out.explicit_grad_comm_none and opt_out.explicit_init_sync_none and opt_out.reduce == ()
    asyn = ParameterState.from_spec(_with("c", param=True, grad="dp:async"), mesh_dim_names=NAMES)
    assert asyn.grad_comm.schedule == "async"
    with pytest.raises(ValueError, match="axis layout"):
        ParameterState.from_spec(_spec("a // dp"))
    with pytest.raises(ValueError, match="twice"):
        ParameterState.from_spec(TensorSpec(_spec("c").items, (), (Annotation("grad", "dp"), Annotation("grad", "dp"))))


def test_from_layout():
    s = ParameterState.from_layout("out/tp in", mesh=es.Mesh.virtual((2, 4), NAMES))
    assert s.mesh_dim_names == NAMES and s.grad_comm == ParameterGradComm() and s.source == "layout"
    assert s.init_sync == ParameterInitSync("inferred", ("dp",))
    with es.use_mesh(es.Mesh.virtual((2, 4), NAMES)):
        assert ParameterState.from_layout("c").mesh_dim_names == NAMES  # the ambient mesh counts
    assert ParameterState.from_layout("c", grad="none").explicit_grad_comm_none
    assert ParameterState.from_layout("c", grad="async").grad_comm.pending_inference
    for bad, exc, words in (
        (None, TypeError, "layout"),
        ("a // dp", ValueError, "partial"),
        ("(a b)", ValueError, "factored axes"),
        ("... a", ValueError, "TensorState"),
        ("a a", ValueError, "TensorState"),
        ("a [param]", ValueError, "axes only"),
        ("a, b -> a", ValueError, "one tensor spec"),
    ):
        with pytest.raises(exc, match=words):
            ParameterState.from_layout(bad)
    with pytest.raises(TypeError):
        ParameterState.from_layout("c", grad=1)
    with pytest.raises(TypeError):
        ParameterState.from_layout("c", init_sync=("dp",))


# -- mesh names ---------------------------------------------------------------------------------
def test_mesh_names_rules():
    assert ParameterState.from_layout("c", mesh_dim_names="dp").mesh_dim_names == ("dp",)
    with pytest.raises(TypeError, match="mesh_dim_names"):
        ParameterState.from_layout("c", mesh_dim_names=torch.zeros(2))
    with pytest.raises(TypeError, match="mesh_dim_names"):
        ParameterState.from_layout("c", mesh_dim_names=3)
    with pytest.raises(TypeError, match="mesh_dim_names"):
        ParameterState.from_layout("c", mesh_dim_names=("dp", 1))
    for bad in (("",), ("dp", "dp"), ("dp-",), ("dp-dp",), ("dp", "dp-sp")):
        with pytest.raises(ValueError):
            ParameterState.from_layout("c", mesh_dim_names=bad)
    with pytest.raises(ValueError, match="differs"):
        ParameterState.from_layout("c", mesh=es.Mesh.virtual((2,), ("dp",)), mesh_dim_names=("tp",))


class _Named:
    mesh_dim_names = ("x", "y")
    mesh = torch.zeros(2, 2, 2)


def test_mesh_names_from_any_object_and_rank_tensor():
    with pytest.raises(ValueError, match="dimensions"):
        ParameterState.from_layout("c", mesh=_Named())


# -- invariants (§5) -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "layout, kw, words",
    [
        ("a/tp", {"init_sync": "tp"}, "init_sync .* overlaps"),
        ("a/tp", {"grad": "dp-tp"}, "grad .* overlaps"),
        ("a/xx", {}, "unknown mesh dimensions"),
        ("a", {"grad": "xx"}, "unknown mesh dimensions"),
        ("a", {"init_sync": "dp-xx"}, "unknown mesh dimensions"),
    ],
)
def test_invariants(layout, kw, words):
    with pytest.raises(ValueError, match=words):
        ParameterState.from_layout(layout, mesh_dim_names=NAMES, **kw)


@pytest.mark.parametrize("dims, words", [(("dp-dp",), "repeated mesh dimensions"), (("dp", "tp-"), "repeated"),
                                         (("dp", "dp-tp"), "same mesh dimension"), (("xx",), "unknown mesh")])
def test_layout_group_invariants(dims, words):
    with pytest.raises(ValueError, match=words):
        register_parameter_state(_param(2), ParameterState(None, layout_shard_dims=dims, mesh_dim_names=NAMES))
    with pytest.raises(ValueError):  # the notation rejects the same layouts already
        ParameterState.from_layout(" ".join(f"a{i}/{d}" for i, d in enumerate(dims)), mesh_dim_names=NAMES)


def test_external_groups_only_syntax_checked():
    s = ParameterState.from_layout("a/tp", mesh_dim_names=NAMES, grad="tp-xx:external")
    assert s.reduce == ()
    with pytest.raises(ValueError, match="repeated mesh dimensions"):
        ParameterState.from_layout("a", grad="dp-dp:external")


def test_overlapping_groups_among_themselves():
    base = ParameterState.from_layout("a", mesh_dim_names=("dp", "sp", "tp"))
    with pytest.raises(ValueError, match="grad groups overlap"):
        register_parameter_state(_param(2), replace(base, grad_comm=ParameterGradComm("explicit", ("dp-sp", "sp-dp"), "native")))
    with pytest.raises(ValueError, match="init_sync groups overlap"):
        register_parameter_state(_param(2), replace(base, init_sync=ParameterInitSync("explicit", ("dp", "dp-sp"))))
    # pending duties are exempt until concrete
    register_parameter_state(_param(2), replace(base, grad_comm=ParameterGradComm("inferred", (), "native")))


@pytest.mark.parametrize(
    "change, exc, words",
    [
        ({"layout_shard_dims": ["tp"]}, TypeError, "layout_shard_dims"),
        ({"layout_shard_dims": ("dp",)}, ValueError, "stale"),
        ({"mesh_dim_names": ["dp"]}, TypeError, "mesh_dim_names"),
        ({"init_sync": ParameterInitSync("bad")}, ValueError, "ParameterInitSync.mode"),
        ({"init_sync": ParameterInitSync("explicit")}, ValueError, "explicit mode requires mesh_dims"),
        ({"init_sync": ParameterInitSync("none", ("dp",))}, ValueError, "ParameterInitSync"),
        ({"init_sync": ParameterInitSync("inferred", ())}, ValueError, "inferred init_sync"),
        ({"grad_comm": ParameterGradComm("none", (), "native")}, ValueError, "ParameterGradComm"),
        ({"grad_comm": ParameterGradComm("explicit", (), "native")}, ValueError, "explicit mode"),
        ({"grad_comm": ParameterGradComm("explicit", ("dp",), "ddp", "async")}, ValueError, "native"),
        ({"grad_comm": ParameterGradComm("explicit", ["dp"], "native")}, TypeError, "mesh_dims"),
        ({"grad_comm": "dp"}, ValueError, "grad_comm"),
        ({"source": 3}, ValueError, "source"),
        ({"explicit_grad_comm_none": 1}, ValueError, "explicit_grad_comm_none"),
        ({"spec": "a/tp"}, ValueError, "spec"),
        ({"tensor_state": None}, ValueError, "tensor_state"),
    ],
)
def test_malformed_states_are_rejected_and_nothing_attached(change, exc, words):
    good = ParameterState.from_layout("a/tp", mesh_dim_names=NAMES)
    p = _param(3)
    with pytest.raises(exc, match=words):
        register_parameter_state(p, replace(good, **change))
    assert get_parameter_state(p) is None


def test_layout_free_has_no_tensor_state_or_grad_duty():
    with pytest.raises(ValueError, match="layout-free"):
        register_parameter_state(_param(2), ParameterState(None, grad_comm=ParameterGradComm("explicit", ("dp",), "native")))
    good = ParameterState.from_layout("a", mesh_dim_names=NAMES)
    with pytest.raises(ValueError, match="layout-free"):
        register_parameter_state(_param(2), ParameterState(None, tensor_state=good.tensor_state))


# -- storage ---------------------------------------------------------------------------------
def test_storage_and_aliases():
    lin = torch.nn.Linear(3, 4)
    assert PARAM_STATE_ATTR == "einshard_state"
    s = ParameterState.from_layout("out in")
    assert register_parameter_state(lin.weight, s) is lin.weight
    assert getattr(lin.weight, "einshard_state") is s and get_parameter_state(lin.weight) is s
    model = torch.nn.ModuleDict({"a": lin, "b": lin})  # an alias: deduplicated
    assert [(n, st) for n, _, st in iter_parameter_states(model)] == [("a.weight", s)]
    assert set_parameter_state(lin.weight, None) is lin.weight and get_parameter_state(lin.weight) is None
    with pytest.raises(TypeError):
        register_parameter_state(torch.zeros(2), s)
    with pytest.raises(TypeError):
        register_parameter_state(lin.weight, "out in")


def test_register_checks_rank():
    p = _param(4, 3)
    with pytest.raises(ValueError, match="rank"):
        register_parameter_state(p, ParameterState.from_layout("a"))
    register_parameter_state(p, ParameterState.from_spec(_spec("... c")))
    with pytest.raises(ValueError, match="rank"):
        register_parameter_state(_param(4), ParameterState.from_spec(_spec("a ... c")))


# -- merge (§1.6) ----------------------------------------------------------------------------
def _reg(p, layout=None, spec=None, **kw):
    state = ParameterState.from_spec(spec, **kw) if spec is not None else ParameterState.from_layout(layout, **kw)
    return register_parameter_state(p, state)


def test_merge_layouts():
    p = _param(4, 3)
    _reg(p, "out/tp in")
    with pytest.raises(ValueError, match="incompatible metadata: different layout"):
        _reg(p, "out in/tp")
    with pytest.raises(ValueError, match="different layout"):
        _reg(p, "o/tp in")  # axis names count
    free = ParameterState(None, layout_shard_dims=("dp-tp",))
    with pytest.raises(ValueError, match="different sharded mesh footprint"):
        register_parameter_state(p, free)
    register_parameter_state(p, ParameterState(None, layout_shard_dims=("tp",)))
    assert get_parameter_state(p).layout == "out/tp in"
    # a layout-free state first keeps its footprint, then a spec joins it
    q = _param(4, 3)
    register_parameter_state(q, ParameterState(None, layout_shard_dims=("tp",), source="init"))
    _reg(q, "out/tp in")
    assert get_parameter_state(q).layout == "out/tp in" and get_parameter_state(q).source == "init"
    with pytest.raises(ValueError, match="footprint"):  # dp-sp is not dp + sp
        register_parameter_state(
            register_parameter_state(_param(4, 3), ParameterState(None, layout_shard_dims=("dp", "tp"))),
            ParameterState(None, layout_shard_dims=("dp-tp",)),
        )


def test_merge_init_sync():
    p = _param(3)
    _reg(p, "c", mesh_dim_names=NAMES, init_sync="none")
    with pytest.raises(ValueError, match="init_sync was set to 'none'"):
        _reg(p, "c", init_sync="dp")
    _reg(p, "c")  # no names, none: keeps
    q = _param(3)
    _reg(q, "c", mesh_dim_names=NAMES, init_sync="dp")
    _reg(q, "c", mesh_dim_names=NAMES)  # inferred keeps the explicit one
    assert get_parameter_state(q).init_sync == ParameterInitSync("explicit", ("dp",))
    with pytest.raises(ValueError, match="init_sync='none'"):
        _reg(q, "c", init_sync="none")
    with pytest.raises(ValueError, match="different init_sync"):
        _reg(q, "c", init_sync="external")
    with pytest.raises(ValueError, match="different init_sync"):
        _reg(q, "c", init_sync="tp")
    r = _param(3)
    _reg(r, "c")  # no names: none
    _reg(r, "c", mesh_dim_names=NAMES)  # E none takes the inferred one
    assert get_parameter_state(r).init_sync == ParameterInitSync("inferred", NAMES)
    # an explicit one with the same dims as the attached inferred one: equal dims, E kept
    t = _param(3)
    _reg(t, "c", mesh_dim_names=("dp",))
    before = get_parameter_state(t)
    _reg(t, "c", init_sync="dp")
    assert get_parameter_state(t) is before


def test_merge_grad_comm():
    p = _param(3)
    _reg(p, spec=_spec("c [param]"), mesh_dim_names=NAMES)
    state = get_parameter_state(p)
    _reg(p, spec=_spec("c [param]"))  # both pending: E, the same object
    assert get_parameter_state(p) is state
    _reg(p, spec=_with("c", param=True, grad="async"))  # schedule: the non-default wins
    assert get_parameter_state(p).grad_comm == ParameterGradComm("inferred", (), "native", "async")
    _reg(p, spec=_with("c", param=True, grad="dp"))  # one pending, the other explicit: explicit wins
    assert get_parameter_state(p).grad_comm == ParameterGradComm("explicit", ("dp",), "native", "async")
    with pytest.raises(ValueError, match="different grad groups"):
        _reg(p, "c", grad="tp")
    with pytest.raises(ValueError, match="backends"):
        _reg(p, "c", grad="dp:ddp")
    with pytest.raises(ValueError, match="grad='none'"):
        _reg(p, "c", grad="none")
    # an inferred concrete duty (from rank-local inference) merged with a pending one stays pending
    q = _param(3)
    inferred = replace(ParameterState.from_layout("c", mesh_dim_names=NAMES),
                       grad_comm=ParameterGradComm("inferred", ("dp",), "native"))
    register_parameter_state(q, inferred)
    _reg(q, spec=_spec("c [param]"))
    assert get_parameter_state(q).grad_comm.pending_inference
    # explicit none: needs E none, and then blocks later duties
    r = _param(3)
    _reg(r, "c", grad="none")
    with pytest.raises(ValueError, match="grad was set to 'none'"):
        _reg(r, "c", grad="dp")
    s = _param(3)
    _reg(s, "c", grad="dp:async")
    with pytest.raises(ValueError, match="schedules"):
        register_parameter_state(s, replace(ParameterState.from_layout("c"),
                                            grad_comm=ParameterGradComm("explicit", ("dp",), "native", "synchronous")))


def test_merge_names_and_unchanged_identity():
    p = _param(3)
    _reg(p, "c", mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match="different mesh_dim_names"):
        _reg(p, "c", mesh_dim_names=("tp",))
    before = get_parameter_state(p)
    _reg(p, "c")
    assert get_parameter_state(p) is before
    assert get_parameter_state(p).mesh_dim_names == ("dp",)


def test_failed_merge_leaves_attached_object():
    p = _param(4, 3)
    _reg(p, "out/tp in", mesh_dim_names=NAMES, grad="dp")
    before = get_parameter_state(p)
    for kw in ({"grad": "dp:ddp"}, {"init_sync": "tp"}, {"mesh_dim_names": ("x", "y")}):
        with pytest.raises(ValueError):
            _reg(p, "out/tp in", **kw)
        assert get_parameter_state(p) is before


# -- the docstring examples of the package run as written ---------------------------------------
@pytest.mark.parametrize(
    "module", ["state", "names", "merge", "store", "register", "validate", "sync", "reduce", "metadata", "operand"]
)
def test_docstring_examples(module):
    import doctest
    import importlib

    mod = importlib.import_module(f"einshard.params.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0, result
