"""``torch_einshard``: torch-einshard 1.0's namespace on einshard, name by name.

Every flat name of 1.0 and every function of its ``helpers`` / ``mappings`` modules is
there with 1.0's parameter names; the 1.0 module paths resolve; the module is built from
einshard's modules, not from the ``einshard`` facade's names. Each shim is checked against
the same computation on whole tensors (float64), on gloo ranks for the collectives, with
even and uneven blocks, values and gradients.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

import einshard as es
import torch_einshard as te
from einshard.comm import collectives as C
from einshard.comm.mesh import Mesh, wrap_mesh
from einshard.errors import EinshardError
from einshard.notation import EllipsisItem, Group
from einshard.notation import TensorSpec as EsTensorSpec
from einshard.params import get_parameter_state
from einshard.testing import MeshSpec
from torch_einshard import helpers as TH
from torch_einshard import mappings as TM
from torch_einshard.sharding import Axis
from torch_einshard.symbolic import last_plan

# -- torch-einshard 1.0's names and signatures (read from its source): (positional, *args, keyword-only) --

FLAT_1_0 = {
    "einsum": (("shard",), "xs", ("name_only", "sizes")),
    "einconv": (("shard", "x", "weight", "windows"), None, ("bias", "padding", "stride", "dilation", "groups",
                "boundary", "fill", "mesh", "shapes", "families", "checkpoint", "use_reentrant")),
    "einfft": (("shard", "x", "axes"), None, ("inverse", "norm", "mesh", "shapes", "families", "real",
               "signal_sizes", "explain")),
    "parse_sharding": (("expression",), None, ()),
    "Axes": None,
    "distributed_1d": (("shard",), "xs", ("mesh", "shapes", "policy")),
    "cached_expand_axis_families": (("expression", "sizes", "families"), None, ()),
    "einhalo": (("shard", "x", "halos"), None, ("boundary", "fill", "mesh", "shapes", "families")),
    "einwindow": (("shard", "x", "windows", "radius"), None, ("boundary", "fill", "mesh", "shapes", "families")),
    "CompoundDeviceMesh": (("device_mesh",), None, ()),
    "wrap_mesh": (("device_mesh",), None, ()),
    "ParamShardMetadata": None,
    "NativeGradReductionHandle": None,
    "ParameterGradComm": None,
    "ParameterInitSync": None,
    "ParameterState": None,
    "finalize_module_parameter_grad_comm_": (("module", "grad"), None, ("mesh", "mesh_dim_names")),
    "finalize_parameter_grad_comm_": (("param", "grad"), None, ("mesh", "mesh_dim_names")),
    "get_parameter_state": (("param",), None, ()),
    "init_param_": (("param", "mesh"), None, ("sync", "sharded", "mesh_dim_names", "source")),
    "init_params_": (("module", "mesh"), None, ("sync", "sharded", "mesh_dim_names", "source")),
    "iter_parameter_states": (("module",), None, ()),
    "param_local_shape": (("param_or_state", "global_shape", "mesh", "factors"), None, ()),
    "param_local_slices": (("param_or_state", "global_shape", "mesh", "factors"), None, ()),
    "param_shard_dims": (("param_or_state",), None, ()),
    "param_shard_metadata": (("param_or_state", "global_shape", "mesh", "factors"), None, ()),
    "reduce_grad_": (("param", "state", "mesh"), None, ()),
    "reduce_module_grads_": (("module", "mesh"), None, ()),
    "register_conv_parameters_": (("module",), None, ("weight_layout", "bias_layout", "mesh", "mesh_dim_names",
                                  "grad", "weight_grad", "bias_grad", "init_sync", "weight_init_sync",
                                  "bias_init_sync", "source")),
    "register_grad_reduction_hook_": (("ddp_model", "mesh", "ddp_group", "combined_reduce_group",
                                      "combined_reduce"), None, ()),
    "register_linear_parameters_": (("module",), None, ("weight_layout", "bias_layout", "mesh", "mesh_dim_names",
                                    "weight_grad", "bias_grad", "init_sync", "weight_init_sync", "bias_init_sync",
                                    "source")),
    "register_module_parameter_layouts_": (("module", "layouts"), None, ("mesh", "mesh_dim_names", "grad",
                                           "init_sync", "source")),
    "register_native_grad_reduction_hooks_": (("module", "mesh"), None, ()),
    "register_norm_parameters_": (("module",), None, ("layout", "weight_layout", "bias_layout", "mesh",
                                  "mesh_dim_names", "grad", "weight_grad", "bias_grad", "init_sync",
                                  "weight_init_sync", "bias_init_sync", "source")),
    "register_parameter_layout": (("param", "layout"), None, ("mesh", "mesh_dim_names", "grad", "init_sync",
                                  "source")),
    "register_parameter_operand": (("param", "input_specs", "output_spec", "operand_index"), None,
                                   ("mesh_dim_names", "source", "infer_grad")),
    "register_parameter_state": (("param", "state"), None, ()),
    "parameter_operand_state": (("param", "input_specs", "output_spec", "operand_index"), None,
                                ("mesh_dim_names", "source", "infer_grad")),
    "set_parameter_state": (("param", "state"), None, ()),
    "sync_module_params_": (("module", "mesh"), None, ()),
    "sync_param_": (("param", "state", "mesh"), None, ()),
    "validate_module_parameter_states_": (("module", "mesh"), None, ("allow_pending",)),
    "einroll": (("shard", "x", "shifts"), None, ("mesh", "shapes", "families")),
    "AxisGroup": (("axes",), None, ()),
    "EllipsisAxis": ((), None, ()),
    "TensorSpec": (("axes", "partials", "annotation"), None, ()),
    "ExecutionPlan": ((), None, ()),
    "PlanPolicy": None,
    "TensorState": (("axes", "placements", "partials", "replicated_dims"), None, ()),
    "build_binary_transition_plan": (("input0_spec", "input1_spec", "output_spec"), None, ()),
    "build_unary_transition_plan": (("input_spec", "output_spec"), None, ()),
    "get_default_policy": ((), None, ()),
    "get_optimization_policy": ((), None, ()),
    "optimize": (("policy",), None, ()),
    "resolve_plan_policy": (("optimize", "policy"), None, ()),
    "set_default_policy": (("policy",), None, ()),
    "set_last_plan": (("plan",), None, ()),
    "all_local": (("shard",), None, ()),
    "local_operation": (("shard",), None, ()),
    "einshard": (("shard",), "xs", ("mesh", "shapes", "sizes", "families", "optimize", "policy")),
    "einshard_like": (("shard",), "xs", ("mesh", "sizes", "families")),
}

HELPERS_1_0 = {
    "init_process_group": (("backend", "use_cuda"), None, ()),
    "all_reduce": (("input", "group"), None, ("async_op",)),
    "broadcast": (("input", "group", "src"), None, ()),
    "split": (("input", "group", "dim", "shapes"), None, ()),
    "all_gather": (("input", "group", "dim", "shapes"), None, ()),
    "reduce_scatter": (("input", "group", "dim", "shapes"), None, ()),
    "all_to_all_repartition": (("input", "group", "source_dim", "dest_dim", "source_shapes", "dest_shapes"),
                               None, ()),
    "owner_swap": (("input", "mesh", "source_shard_dims", "dest_shard_dims", "output_shape"), None, ()),
    "roll_shards": (("input", "group", "shard_shift"), None, ()),
    "roll_sharded": (("input", "group", "dim", "shift", "shapes"), None, ()),
    "resolve_split_shapes": (("shapes", "shard_dim", "axis_name", "group"), None, ()),
    "compute_split_shapes": (("size", "num_chunks"), None, ()),
    "compute_split_shapes_for_factors": (("size", "num_chunks", "factor"), None, ()),
}

MAPPINGS_1_0 = {
    "allreduce_forward_identity_backward": (("input", "comm"), None, ()),
    "identity_forward_allreduce_backward": (("input", "comm"), None, ()),
    "broadcast_forward_allreduce_backward": (("input", "comm", "src"), None, ()),
    "allgather_forward_split_backward": (("input", "comm", "dim", "shapes"), None, ()),
    "split_forward_allgather_backward": (("input", "comm", "dim", "shapes"), None, ()),
    "reducescatter_forward_allgather_backward": (("input", "comm", "dim", "shapes"), None, ()),
    "allgather_forward_reducescatter_backward": (("input", "comm", "dim", "shapes"), None, ()),
    "alltoall_repartition": (("input", "comm", "source_dim", "dest_dim", "source_shapes", "dest_shapes"), None, ()),
    "owner_swap_forward_backward": (("input", "mesh", "source_shard_dims", "dest_shard_dims", "output_shape"),
                                    None, ()),
    "roll_shards_forward_backward": (("input", "comm", "shard_shift"), None, ()),
    "roll_sharded_forward_backward": (("input", "comm", "dim", "shift", "shapes"), None, ()),
}


def _check_signature(where, obj, expected):
    """1.0's positional names lead ours, the same ``*args``, and 1.0's keyword-only names are accepted.

    einshard may add parameters (with defaults) after 1.0's.
    """
    positional, varargs, keywords = expected
    params = inspect.signature(obj).parameters.values()
    ours = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert tuple(ours[: len(positional)]) == positional, f"{where}: positional {ours} (1.0: {positional})"
    for extra in [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD][len(positional):]:
        assert extra.default is not inspect.Parameter.empty, f"{where}: extra parameter {extra.name} needs a default"
    ours_var = [p.name for p in params if p.kind == p.VAR_POSITIONAL]
    assert ours_var == ([varargs] if varargs else []), f"{where}: *args {ours_var} (1.0: {varargs})"
    nameable = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = set(keywords) - nameable
    assert not missing, f"{where}: keyword(s) {sorted(missing)} of 1.0 missing"


def test_every_flat_name_of_1_0_and_only_those():
    assert set(te.__all__) == set(FLAT_1_0)
    for name in FLAT_1_0:
        assert getattr(te, name) is not None


@pytest.mark.parametrize("name", sorted(n for n, s in FLAT_1_0.items() if s is not None))
def test_flat_name_has_1_0s_parameter_names(name):
    _check_signature(name, getattr(te, name), FLAT_1_0[name])


@pytest.mark.parametrize("module, table", [(TH, HELPERS_1_0), (TM, MAPPINGS_1_0)], ids=["helpers", "mappings"])
def test_helpers_and_mappings_have_1_0s_functions_and_parameter_names(module, table):
    assert set(module.__all__) == set(table)
    for name, expected in table.items():
        _check_signature(f"{module.__name__}.{name}", getattr(module, name), expected)


def test_renamed_parameters_are_accepted_as_keywords():
    w = torch.nn.Parameter(torch.zeros(4, 3))
    te.register_parameter_layout(param=w, layout="out in")
    assert te.get_parameter_state(param=w) is get_parameter_state(w)
    assert te.param_shard_dims(param_or_state=w) == es.params.param_shard_dims(w)
    assert str(te.parse_sharding(expression="a b -> b a")) == "a b -> b a"
    assert te.einshard_like("b i, out i [param] -> b out", None, torch.nn.Parameter(torch.zeros(4, 3))) is None
    assert getattr(te.einshard_like, "_torchdynamo_disable", False) is True  # 1.0's compile mark is kept


def test_the_module_is_its_own_and_uses_no_facade_name():
    """``torch_einshard`` works with every public name removed from the ``einshard`` facade."""
    assert te is not es
    code = """
import einshard
for name in list(einshard.__all__):
    if not __import__("inspect").ismodule(getattr(einshard, name)):
        delattr(einshard, name)
import torch, torch_einshard as te
x, w = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
assert torch.allclose(te.einshard("a b, b c -> a c", x, w), x @ w)
assert torch.allclose(te.einsum("a b, b c -> a c", x, w), x @ w)
assert te.build_binary_transition_plan("a b/tp", "b/tp c", "a c").names() == ["all-reduce"]
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_1_0_module_paths_resolve_in_a_fresh_interpreter():
    code = """
import sys
import torch_einshard
import torch_einshard.params, torch_einshard.conv, torch_einshard.fft, torch_einshard.halo, torch_einshard.roll
import torch_einshard.helpers, torch_einshard.mappings, torch_einshard.sharding, torch_einshard.symbolic
import torch_einshard.einsum, torch_einshard.families, torch_einshard.mesh, torch_einshard.distributed
from torch_einshard.params import ParameterState
from torch_einshard.conv import einconv
import einshard.params, einshard.ops.conv
assert torch_einshard.params is einshard.params and ParameterState is einshard.params.ParameterState
assert einconv is einshard.ops.conv.einconv
assert einshard.params.__spec__.name == "einshard.params"  # executed once, under its own name
assert sys.modules["torch_einshard.params"] is einshard.params
assert callable(torch_einshard.einsum)  # the function, not the module of the same name
assert torch_einshard.helpers.__name__ == "torch_einshard.helpers"  # a module of its own
try:
    import torch_einshard.no_such_module
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("torch_einshard.no_such_module imported")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# -- the notation class names -----------------------------------------------------------------------


def test_notation_names_are_einshards_objects():
    x, y, out = te.parse_sharding("a/sp (b c), ... d -> a/sp b c ...")
    assert y is not None and isinstance(x, te.TensorSpec) and isinstance(out, te.TensorSpec)
    assert isinstance(x.items[1], te.AxisGroup) and isinstance(y.items[0], te.EllipsisAxis)
    assert isinstance(x.axes, te.Axes) and repr(x.axes) == "a / sp × (b c)"
    assert issubclass(EsTensorSpec, te.TensorSpec) and not isinstance("a b", te.TensorSpec)

    spec = te.TensorSpec(te.Axes([Axis("a", "sp"), te.AxisGroup([Axis("b"), Axis("c")]), te.EllipsisAxis()]), ["dp"])
    assert type(spec) is EsTensorSpec and str(spec) == "a/sp (b c) ... // dp"
    assert isinstance(te.AxisGroup([Axis("h")]), Group) and isinstance(te.EllipsisAxis(), EllipsisItem)
    assert [a.name for a in spec.axes] == ["a", "b", "c"] and spec.axes[0].mesh == "sp"
    assert te.TensorSpec(x.axes) == te.TensorSpec(x.items)  # an Axes keeps the items it came from
    with pytest.raises(EinshardError, match="at most one ellipsis"):
        te.TensorSpec([te.EllipsisAxis(), te.EllipsisAxis()])
    with pytest.raises(EinshardError, match="parse the text instead"):
        te.TensorSpec([Axis("w")], None, "param")


def test_compound_device_mesh_is_an_einshard_mesh():
    class Duck:
        mesh = torch.arange(4).reshape(2, 2)
        mesh_dim_names = ("dp", "sp")

    m = te.CompoundDeviceMesh(Duck())
    assert isinstance(m, Mesh) and isinstance(m, te.CompoundDeviceMesh)
    assert isinstance(te.wrap_mesh(device_mesh=Duck()), te.CompoundDeviceMesh)
    assert m.mesh_dim_names == ("dp", "sp") and tuple(m.mesh.shape) == (2, 2)
    assert not isinstance(Duck(), te.CompoundDeviceMesh)


# -- einsum, locality, families ---------------------------------------------------------------------


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_einsum_values_and_gradients_against_torch_einsum():
    x, w = _rand(4, 6, seed=1).requires_grad_(), _rand(6, 5, seed=2).requires_grad_()
    g = _rand(4, 5, seed=3)
    for shard in ("a b, b c -> a c", te.parse_sharding("a b, b c -> a c"),
                  tuple(te.parse_sharding("a b, b c -> a c"))):
        out = te.einsum(shard, x, w)
        gx, gw = torch.autograd.grad(out, (x, w), g)
        ref = torch.einsum("ab,bc->ac", x, w)
        rx, rw = torch.autograd.grad(ref, (x, w), g)
        assert torch.allclose(out, ref) and torch.allclose(gx, rx) and torch.allclose(gw, rw)
    # sharded axes are names here: a rank's blocks contract as they are
    assert torch.allclose(te.einsum("a/sp b, b c -> a/sp c", x, w), x @ w)
    # groups with sizes=, an ellipsis
    y = _rand(2, 12, 3, seed=4)
    assert torch.allclose(te.einsum("n (h p) d -> n h p d", y, sizes={"h": 4}), y.reshape(2, 4, 3, 3))
    assert torch.allclose(te.einsum("... d, d e -> ... e", y, _rand(3, 2, seed=5)), y @ _rand(3, 2, seed=5))
    # annotations and output partials are ignored
    assert torch.allclose(te.einsum("a b, b c [param] -> a c // tp", x, w), x @ w)


def test_einsum_refuses_what_it_cannot_honour_and_name_only_matches_by_name():
    x, w = _rand(4, 6), _rand(6, 5)
    with pytest.raises(EinshardError, match="partial over tp"):
        te.einsum("a b // tp, b c -> a c", x, w)
    with pytest.raises(EinshardError, match="different placements .*name_only=True"):
        te.einsum("a b/sp, b c -> a c", x, w)
    assert torch.allclose(te.einsum("a b/sp, b c -> a c", x, w, name_only=True), x @ w)
    assert torch.allclose(te.einsum("a b // tp, b c -> a c", x, w, name_only=True), x @ w)


@pytest.mark.parametrize(
    "shard, local, everything_local",
    [
        ("a b -> b a", True, True),
        ("a/sp b -> b a/sp", True, False),
        ("a/sp b -> a b", False, False),
        ("a b -> a b // dp", False, False),
        ("a/sp b, b c -> a/sp c", True, False),
        ("a b/sp, b/sp c -> a c", False, False),  # shared axes must be unsharded
        ("a b, b c -> a/sp c", False, False),  # an output axis changes placement
        ("a/dp b, b c/tp -> a/dp c/tp", True, False),
        ("a b // dp, b c -> a c", False, False),
    ],
)
def test_all_local_and_local_operation(shard, local, everything_local):
    assert te.local_operation(shard) is local
    assert te.local_operation(te.parse_sharding(shard)) is local
    assert te.all_local(shard) is everything_local


def test_cached_expand_axis_families():
    families = {"s": ("x", "y"), "w": ("wx", "wy")}
    assert te.cached_expand_axis_families("b *s -> b *s", {"s": (4, 5)}, families) == (
        "b x y -> b x y", {"x": 4, "y": 5})
    assert te.cached_expand_axis_families("b [*s *w] -> b *s *w", {"w": 3}, families) == (
        "b (x wx) (y wy) -> b x y wx wy", {"wx": 3, "wy": 3})
    text, sizes = te.cached_expand_axis_families("a b -> b a", {"a": 2})
    assert (text, sizes) == ("a b -> b a", {"a": 2})
    first = te.cached_expand_axis_families("b *s -> b", {"s": (1, 2)}, families)[1]
    first["x"] = 99  # a copy: the cache is not changed
    assert te.cached_expand_axis_families("b *s -> b", {"s": (1, 2)}, families)[1] == {"x": 1, "y": 2}
    x = _rand(2, 4, 5)
    expanded, sizes = te.cached_expand_axis_families("b *s -> b *s", None, families)
    assert sizes is None and torch.equal(te.einsum(expanded, x), x)
    with pytest.raises(EinshardError, match="2 values for the 3 axes"):
        te.cached_expand_axis_families("b *s -> b", {"s": (1, 2)}, {"s": ("x", "y", "z")})


# -- symbolic: tensor states, plans, policies -------------------------------------------------------


def test_tensor_state_from_spec():
    st = te.TensorState.from_spec(te.parse_sharding("a/dp b c/sp-tp // pp")[0], ("dp", "sp", "tp", "pp", "ep"))
    assert st.placements == (("a", "dp"), ("b", None), ("c", "sp-tp"))
    assert st.partials == ("pp",) and st.replicated_dims == ("ep",)
    assert st.placement("c") == "sp-tp" and st.axis("a").mesh == "dp" and st.placement_dict()["b"] is None
    with pytest.raises(KeyError):
        st.placement("z")
    with pytest.raises(EinshardError, match="expanded"):
        te.TensorState.from_spec("a ...")
    with pytest.raises(EinshardError, match="unique axis names"):
        te.TensorState.from_spec("a a")


def test_execution_plan_and_set_last_plan():
    plan = te.ExecutionPlan()
    plan.add("rank_local_einsum")
    assert plan.execute("double", lambda v: 2 * v, 21, step_args=("tp",)) == 42
    plan.consider("owner_swap", "dp", status="rejected", reason="sizes differ")
    assert plan.names() == ["rank_local_einsum", "double"] and plan.snapshot()[1].args == ("tp",)
    te.set_last_plan(plan)
    assert [s.name for s in last_plan()] == ["rank_local_einsum", "double"]
    te.set_last_plan(())
    assert last_plan() == ()


@pytest.mark.parametrize(
    "specs, steps",
    [
        (("a/dp b", "a b/dp"), [("all-to-all a -> b", ("dp",))]),
        (("a/dp b", "a b"), [("all-gather along a", ("dp",))]),
        (("a b // dp", "a b"), [("all-reduce", ("dp",))]),
        (("a b", "a b"), []),
    ],
)
def test_unary_transition_plans_are_the_planners(specs, steps):
    plan = te.build_unary_transition_plan(*(te.parse_sharding(s)[0] for s in specs))
    assert [(s.name, s.args) for s in plan.steps] == steps and plan.names() == [n for n, _ in steps]


def test_binary_transition_plans_are_the_planners():
    plan = te.build_binary_transition_plan("a b/tp", "b/tp c", "a c")
    assert plan.output_steps and plan.names() == ["all-reduce"] and plan.steps() == plan.output_steps
    assert te.build_binary_transition_plan("a b", "b c", "a c").names() == []
    with pytest.raises(EinshardError, match="expanded"):
        te.build_binary_transition_plan("a ...", "b", "a")


def test_policy_getters_follow_einshards_precedence():
    try:
        assert te.get_default_policy().name == "training" == te.get_optimization_policy().name
        te.set_default_policy(policy="memory")
        with te.optimize(policy="latency"):
            assert te.get_optimization_policy().name == "latency" and te.get_default_policy().name == "memory"
            assert te.resolve_plan_policy().name == "latency"
            assert te.resolve_plan_policy(optimize="inference").name == "inference"
            assert te.resolve_plan_policy(policy="communication").name == "communication"
            custom = te.PlanPolicy("custom", collective_weight=1.0)
            assert te.resolve_plan_policy(policy=custom) is custom
        assert te.get_optimization_policy().name == "memory"
        with pytest.raises(ValueError, match="either optimize or policy"):
            te.resolve_plan_policy(optimize="memory", policy="latency")
    finally:
        te.set_default_policy(None)


# -- the collectives on gloo ranks ----------------------------------------------------------------------

MESH_4 = MeshSpec((4,), ("tp",))
MESH_2X2 = MeshSpec((2, 2), ("dp", "sp"))


def _blocks(t, dim, shapes):
    return list(torch.split(t, list(shapes), dim))


def _failures_on_every_rank(failures):
    assert not failures, f"rank {torch.distributed.get_rank()}:\n" + "\n".join(failures)


@pytest.mark.ranks(4)
def test_helpers_against_whole_tensors():
    group = wrap_mesh(MESH_4.build()).group("tp")
    r, P = C.group_rank(group), 4
    fails = []
    for shapes in ([2, 2, 2, 2], [3, 3, 3, 1], [0, 4, 1, 2]):
        T = sum(shapes)
        whole = _rand(5, T, seed=11)  # the same on every rank
        per_rank = [_rand(5, T, seed=20 + q) for q in range(P)]
        mine = _blocks(whole, 1, shapes)[r]
        if not torch.equal(TH.split(whole, group, 1, shapes), mine):
            fails.append(f"split {shapes}")
        if not torch.equal(TH.all_gather(mine, group, 1, shapes), whole):
            fails.append(f"all_gather {shapes}")
        if not torch.allclose(TH.reduce_scatter(per_rank[r], group, 1, shapes), _blocks(sum(per_rank), 1, shapes)[r]):
            fails.append(f"reduce_scatter {shapes}")
        # sharded along 1 and whole along 0 -> whole along 1, sharded along 0
        rows = [1, 2, 0, 3] if shapes[0] == 0 else shapes
        src = _rand(sum(rows), T, seed=30)
        got = TH.all_to_all_repartition(_blocks(src, 1, shapes)[r], group, 1, 0, shapes, rows)
        if not torch.equal(got, _blocks(src, 0, rows)[r]):
            fails.append(f"all_to_all_repartition {shapes}")
        for shift in (1, -3, T + 2, 0):
            rolled = TH.roll_sharded(mine, group, 1, shift, shapes)
            if not torch.equal(rolled, _blocks(torch.roll(whole, shift, 1), 1, shapes)[r]):
                fails.append(f"roll_sharded {shapes} by {shift}")
    if not torch.allclose(TH.all_reduce(per_rank[r], group), sum(per_rank)):
        fails.append("all_reduce")
    out, work = TH.all_reduce(per_rank[r], group, async_op=True)
    work.wait()
    if not torch.allclose(out, sum(per_rank)):
        fails.append("all_reduce async")
    if not torch.equal(TH.broadcast(per_rank[r], group, src=2), per_rank[2]):
        fails.append("broadcast")
    blocks = [_rand(3, 2, seed=40 + q) for q in range(P)]
    if not torch.equal(TH.roll_shards(blocks[r], group, 1), blocks[(r - 1) % P]):
        fails.append("roll_shards")
    if not torch.equal(TH.roll_shards(blocks[r], group, -2), blocks[(r + 2) % P]):
        fails.append("roll_shards by -2")
    # 1.0's "not possible with these arguments": None on every rank
    if TH.all_to_all_repartition(blocks[r], group, 0, 1, None, [1, 1, 0, 0]) is not None:
        fails.append("all_to_all_repartition without shapes")
    if TH.roll_sharded(blocks[r], group, 0, 1, None) is not None or TH.roll_sharded(blocks[r], group, 0, 1, [3]) is not None:
        fails.append("roll_sharded without shapes")
    if TH.resolve_split_shapes({"tp": {"a": [1, 2, 3, 4]}}, "tp", "a", group) != [1, 2, 3, 4]:
        fails.append("resolve_split_shapes")
    if TH.compute_split_shapes(10, 4) != [3, 3, 3, 1] or TH.compute_split_shapes_for_factors(10, 2, 2) != [6, 4]:
        fails.append("compute_split_shapes")
    _failures_on_every_rank(fails)


@pytest.mark.ranks(4)
def test_roll_sharded_with_a_contradicted_shapes_raises_on_every_rank():
    group = wrap_mesh(MESH_4.build()).group("tp")
    r = C.group_rank(group)
    with pytest.raises(EinshardError, match="roll_sharded"):
        TH.roll_sharded(torch.zeros(3 if r == 0 else 2), group, 0, 1, [2, 2, 2, 2])


def _grad_check(fails, what, fn, x, out_grad, want_out, want_grad):
    x = x.clone().requires_grad_(True)
    out = fn(x)
    if out.shape != want_out.shape or not torch.allclose(out, want_out):
        fails.append(f"{what}: value")
        return
    (g,) = torch.autograd.grad(out, x, out_grad)
    if not torch.allclose(g, want_grad):
        fails.append(f"{what}: gradient")


@pytest.mark.ranks(4)
def test_mappings_values_and_exact_adjoints_against_whole_tensors():
    group = wrap_mesh(MESH_4.build()).group("tp")
    r, P = C.group_rank(group), 4
    fails = []
    for shapes in ([2, 2, 2, 2], [3, 3, 3, 1], [0, 4, 1, 2]):
        T = sum(shapes)
        X, G = _rand(3, T, seed=50), _rand(3, T, seed=51)  # whole input and whole upstream gradient
        xb, gb = _blocks(X, 1, shapes)[r], _blocks(G, 1, shapes)[r]
        Gs = [_rand(3, T, seed=60 + q) for q in range(P)]  # per-rank upstream gradients of per-rank outputs
        _grad_check(fails, f"allgather_forward_split_backward {shapes}",
                    lambda t: TM.allgather_forward_split_backward(t, group, 1, shapes), xb, G, X, gb)
        _grad_check(fails, f"split_forward_allgather_backward {shapes}",
                    lambda t: TM.split_forward_allgather_backward(t, group, 1, shapes), X, gb, xb, G)
        Xs = [_rand(3, T, seed=70 + q) for q in range(P)]
        _grad_check(fails, f"reducescatter_forward_allgather_backward {shapes}",
                    lambda t: TM.reducescatter_forward_allgather_backward(t, group, 1, shapes), Xs[r], gb,
                    _blocks(sum(Xs), 1, shapes)[r], G)
        _grad_check(fails, f"allgather_forward_reducescatter_backward {shapes}",
                    lambda t: TM.allgather_forward_reducescatter_backward(t, group, 1, shapes), xb, Gs[r], X,
                    _blocks(sum(Gs), 1, shapes)[r])
        rows = [1, 2, 0, 3] if shapes[0] == 0 else shapes
        S, GS = _rand(sum(rows), T, seed=80), _rand(sum(rows), T, seed=81)
        _grad_check(fails, f"alltoall_repartition {shapes}",
                    lambda t: TM.alltoall_repartition(t, group, 1, 0, shapes, rows), _blocks(S, 1, shapes)[r],
                    _blocks(GS, 0, rows)[r], _blocks(S, 0, rows)[r], _blocks(GS, 1, shapes)[r])
        for shift in (1, -5):
            _grad_check(fails, f"roll_sharded_forward_backward {shapes} by {shift}",
                        lambda t: TM.roll_sharded_forward_backward(t, group, 1, shift, shapes), xb, gb,
                        _blocks(torch.roll(X, shift, 1), 1, shapes)[r], _blocks(torch.roll(G, -shift, 1), 1, shapes)[r])
    xs, gs = [_rand(2, 3, seed=90 + q) for q in range(P)], [_rand(2, 3, seed=95 + q) for q in range(P)]
    _grad_check(fails, "allreduce_forward_identity_backward",
                lambda t: TM.allreduce_forward_identity_backward(t, group), xs[r], gs[0], sum(xs), gs[0])
    _grad_check(fails, "identity_forward_allreduce_backward",
                lambda t: TM.identity_forward_allreduce_backward(t, group), xs[0], gs[r], xs[0], sum(gs))
    # 1.0: each rank's input is its own value; src's is everyone's output, so only src gets the gradient
    _grad_check(fails, "broadcast_forward_allreduce_backward",
                lambda t: TM.broadcast_forward_allreduce_backward(t, group, 1), xs[r], gs[r], xs[1],
                sum(gs) if r == 1 else torch.zeros(2, 3, dtype=torch.float64))
    for shift in (1, 3, -2):
        _grad_check(fails, f"roll_shards_forward_backward by {shift}",
                    lambda t: TM.roll_shards_forward_backward(t, group, shift), xs[r], gs[r],
                    xs[(r - shift) % P], gs[(r + shift) % P])
    if TM.roll_sharded_forward_backward(xs[r], group, 0, 1, None) is not None:
        fails.append("roll_sharded_forward_backward without shapes")
    _failures_on_every_rank(fails)


@pytest.mark.ranks(4)
@pytest.mark.parametrize("grid", [None, [[0, 2], [1, 3]], [[3, 1], [2, 0]]], ids=["ascending", "cols", "rev"])
def test_owner_swap_against_whole_tensors(grid):
    """``a/dp b/sp -> a/sp b/dp`` (the dimensions permuted) and ``a/dp b -> a/sp b`` (one axis changes dimension),
    on an ascending and two permuted rank tensors."""
    if grid is None:
        mesh = wrap_mesh(MESH_2X2.build())
    else:
        mesh = wrap_mesh(DeviceMesh("cpu", torch.tensor(grid), mesh_dim_names=("dp", "sp")))
    i, j = mesh.coordinate
    fails = []
    for rows, cols in (([3, 3], [2, 2]), ([3, 1], [2, 3])):
        X, G = _rand(sum(rows), sum(cols), seed=100), _rand(sum(rows), sum(cols), seed=101)

        def block(t, a, b):  # rows block a, columns block b
            return _blocks(_blocks(t, 0, rows)[a], 1, cols)[b]

        # permuted: this rank (dp=i, sp=j) holds (a_i, b_j) and gets (a_j, b_i)
        _grad_check(fails, f"owner_swap permuted {rows} {cols}",
                    lambda t: TM.owner_swap_forward_backward(t, mesh, ("dp", "sp"), ("sp", "dp"),
                                                             block(X, j, i).shape),
                    block(X, i, j), block(G, j, i), block(X, j, i), block(G, i, j))
        if not torch.equal(TH.owner_swap(block(X, i, j), mesh, ("dp", "sp"), ("sp", "dp"), block(X, j, i).shape),
                           block(X, j, i)):
            fails.append("owner_swap permuted (helpers)")
        # one axis: a/dp b (ranks of one dp row hold a_i) -> a/sp b (rank (i, j) holds a_j)
        A, GA = _blocks(X, 0, rows), _blocks(G, 0, rows)
        _grad_check(fails, f"owner_swap one axis {rows}",
                    lambda t: TM.owner_swap_forward_backward(t, mesh.device_mesh, ["dp"], ["sp"], A[j].shape),
                    A[i], GA[j], A[j], GA[i])
    with pytest.raises(EinshardError, match="not one of the mesh"):
        TH.owner_swap(X, mesh, ("dp",), ("tp",), X.shape)
    _failures_on_every_rank(fails)


@pytest.mark.ranks(4)
def test_distributed_1d_and_compound_mesh_against_whole_tensors():
    device_mesh = MESH_2X2.build()
    mesh = te.CompoundDeviceMesh(device_mesh)
    i, j = mesh.coordinate
    fails = []
    if not isinstance(mesh, te.CompoundDeviceMesh) or mesh.device_mesh is not device_mesh:
        fails.append("CompoundDeviceMesh wraps the DeviceMesh")
    if C.group_size(mesh["dp-sp"].get_group()) != 4:
        fails.append("compound group")
    for bs in ([3, 3], [4, 1]):
        X, W, G = _rand(5, sum(bs), seed=110), _rand(sum(bs), 3, seed=111), _rand(5, 3, seed=112)
        x = _blocks(X, 1, bs)[j].clone().requires_grad_(True)
        w = _blocks(W, 0, bs)[j].clone().requires_grad_(True)
        shard = te.parse_sharding("a b/sp, b/sp c [param] -> a c")
        out = te.distributed_1d(shard, x, w, mesh=mesh, shapes={"sp": bs}, policy="communication")
        gx, gw = torch.autograd.grad(out, (x, w), G)
        ref_x, ref_w = X.clone().requires_grad_(True), W.clone().requires_grad_(True)
        rx, rw = torch.autograd.grad(ref_x @ ref_w, (ref_x, ref_w), G)
        if not torch.allclose(out, X @ W):
            fails.append(f"distributed_1d value {bs}")
        if not (torch.allclose(gx, _blocks(rx, 1, bs)[j]) and torch.allclose(gw, _blocks(rw, 0, bs)[j])):
            fails.append(f"distributed_1d gradient {bs}")
        if get_parameter_state(w) is not None:
            fails.append("distributed_1d attached parameter metadata (1.0's does not)")
    del i
    _failures_on_every_rank(fails)


@pytest.mark.ranks(4)
def test_new_mappings_double_backward():
    """Backward of the backward: for a linear A, d/dy <Aᵀ y, z> = A z."""
    group = wrap_mesh(MESH_4.build()).group("tp")
    r = C.group_rank(group)
    shapes = [3, 3, 3, 1]
    cases = [
        ("broadcast_forward_allreduce_backward", lambda t: TM.broadcast_forward_allreduce_backward(t, group, 2),
         (2, 3), (2, 3)),
        ("roll_sharded_forward_backward", lambda t: TM.roll_sharded_forward_backward(t, group, 1, 4, shapes),
         (2, shapes[r]), (2, shapes[r])),
        ("roll_shards_forward_backward", lambda t: TM.roll_shards_forward_backward(t, group, 1), (2, 3), (2, 3)),
        ("alltoall_repartition", lambda t: TM.alltoall_repartition(t, group, 0, 1, shapes, [2, 2, 2, 2]),
         (shapes[r], 8), (10, 2)),
    ]
    fails = []
    for name, A, in_shape, out_shape in cases:
        x = _rand(*in_shape, seed=1 + r).requires_grad_(True)
        y = _rand(*out_shape, seed=2 + r).requires_grad_(True)
        z = _rand(*in_shape, seed=3 + r)
        (gx,) = torch.autograd.grad(A(x), x, y, create_graph=True)
        (gy,) = torch.autograd.grad((gx * z).sum(), y)
        if not torch.allclose(gy, A(z)):
            fails.append(f"{name}: double backward differs from A z")
    _failures_on_every_rank(fails)
