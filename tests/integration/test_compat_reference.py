"""Drop-in behaviour for code written against torch-einshard 1.0 (the reference library).

One section per behaviour: what ``parse_sharding`` returns, how a layout prints, where layout
rejections happen, the words of messages and the exception types, duck-typed meshes, the
registration helpers' arguments, ``einshard_like`` under ``torch.compile``, the inference of a
pending gradient duty, the mesh names a cached plan records, ``einfft(axes=<names>)``, and
every rank raising together on a ``shapes=`` one rank's block contradicts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import einshard as es
from einshard.notation import expand
from einshard.params import ParameterGradComm, get_parameter_state as state_of
from einshard.testing import MeshSpec, local_block

MESH_TP = es.Mesh.virtual((4,), ("tp",))
MESH_2D = es.Mesh.virtual((2, 2), ("dp", "sp"))


def _p(*shape):
    return torch.nn.Parameter(torch.zeros(shape))


class _Names:
    """A mesh object with only ``mesh_dim_names`` (no rank tensor, no groups)."""

    def __init__(self, *names):
        self.mesh_dim_names = names


class _Duck:
    """A mesh object with only ``mesh`` (the rank tensor) and ``mesh_dim_names``."""

    def __init__(self, grid, names):
        self.mesh = grid
        self.mesh_dim_names = names


# -- A. parse_sharding is a 3-sequence ----------------------------------------------------------


def test_parse_sharding_unpacks_into_input0_input1_output():
    x, w, out = es.parse_sharding("b c, h c [param] -> b h")
    assert (str(x), str(w), str(out)) == ("b c", "h c [param]", "b h")
    spec, none, output = es.parse_sharding("w // dp [param] -> w")
    assert none is None and str(spec) == "w // dp [param]" and str(output) == "w"
    f = es.parse_sharding("a, b, c -> a b c")  # n operands: (*inputs, output)
    assert len(f) == 4 and str(f[3]) == "a b c" and f[-1] is f.output
    assert f.inputs == tuple(f[:3])  # .inputs and .output stay


def test_parse_sharding_elements_feed_the_parameter_api():
    x, w, out = es.parse_sharding("b/dp c, c d [param, grad=async] -> b/dp d")
    p = _p(3, 4)
    state = es.params.parameter_operand_state(p, (x, w), out, 1, mesh_dim_names=("dp",))
    assert state.grad_comm == ParameterGradComm("inferred", ("dp",), "native", "async")
    assert es.params.ParameterState.from_spec(w, mesh_dim_names=("dp",)).grad_comm.pending_inference
    es.params.register_parameter_operand(p, (x, w), out, 1, mesh_dim_names=("dp",))
    assert state_of(p).reduce == ("dp",)


def test_parse_sharding_syntax_errors_are_value_errors():
    with pytest.raises(ValueError, match="Invalid einshard expression"):
        es.parse_sharding("b (c -> b")


# -- B. the printed form of a layout ----------------------------------------------------------


@pytest.mark.parametrize(
    "register, text",
    [
        (lambda: es.params.register_linear_parameters_(torch.nn.Linear(3, 4), weight_layout="out/tp in").weight,
         "out / tp × in"),
        (lambda: es.params.register_linear_parameters_(torch.nn.Linear(3, 4), weight_layout="out in/tp").weight,
         "out × in / tp"),
        (lambda: es.params.register_linear_parameters_(torch.nn.Linear(3, 4), weight_layout="out/tp in").bias, "out / tp"),
        (lambda: es.params.register_conv_parameters_(torch.nn.Conv2d(2, 4, 3)).weight, "out × in × kh × kw"),
        (lambda: es.params.register_norm_parameters_(torch.nn.LayerNorm(4)).weight, "c"),
        (lambda: es.params.register_parameter_layout(_p(1, 1, 1, 1, 1), "b t h/sp1 w/sp2 c"), "b × t × h / sp1 × w / sp2 × c"),
        (lambda: es.params.register_parameter_layout(_p(2, 2), "a b/dp-sp"), "a × b / dp-sp"),
    ],
)
def test_repr_of_the_layout_axes(register, text):
    p = register()
    state = state_of(p)
    assert repr(state.spec.axes) == text
    assert all(isinstance(a, es.notation.Axis) for a in state.spec.axes)  # the contents are unchanged
    assert state.layout == text.replace(" / ", "/").replace(" × ", " ")


def test_repr_of_groups_and_ellipsis_and_of_a_formula_state():
    assert repr(es.parse_sharding("(a/dp b) ... c").inputs[0].axes) == "(a / dp b) × ... × c"
    w = _p(4, 3)
    es.einshard("b c, h/tp c [param] -> b h/tp", torch.ones(2, 3), w)
    assert repr(state_of(w).spec.axes) == "h / tp × c" and str(state_of(w).spec.axes[0]) == "h/tp"


# -- C. where by-design layout rejections happen ------------------------------------------------


def test_parse_sharding_accepts_layouts_that_the_states_reject():
    f = es.parse_sharding("b c, out/tp c/tp [param] -> b out")
    with pytest.raises(ValueError, match="same mesh dimension"):
        es.params.ParameterState.from_spec(f[1])
    g = es.parse_sharding("b c, out/dp-sp c/sp-dp [param] -> b out")
    with pytest.raises(ValueError, match="same mesh dimension"):
        es.params.ParameterState.from_spec(g[1], mesh_dim_names=("dp", "sp"))
    es.parse_sharding("out/dp-dp in")
    with pytest.raises(ValueError, match="repeated mesh"):
        es.params.ParameterState.from_layout("out/dp-dp in")
    with pytest.raises(ValueError, match="rejected by design"):  # es.einshard still rejects them by design
        es.einshard("b c, out/tp c/tp -> b out", torch.ones(2, 3), torch.ones(2, 3), mesh=MESH_TP)


@pytest.mark.parametrize(
    "formula, mesh",
    [
        ("b/tp c, out/tp c [param, grad=async] -> b/tp out/tp", MESH_TP),
        ("b/tp c, out/tp c [param, grad=ddp] -> b/tp out/tp", MESH_TP),
        ("b/sp c, out/dp-sp c [param, grad=async] -> b/sp out/dp-sp", MESH_2D),
    ],
)
@pytest.mark.parametrize("op", [es.einshard, es.params.einshard_like], ids=["einshard", "einshard_like"])
def test_param_states_are_validated_before_the_formula_is_rejected(formula, mesh, op):
    w = _p(2, 3)
    with pytest.raises(ValueError, match="grad.*overlaps"):
        op(formula, torch.ones(2, 3), w, mesh=mesh)
    assert state_of(w) is None


# -- D. the words of messages, and exception types ------------------------------------------------


def test_parameter_argument_messages():
    with pytest.raises(TypeError, match="string"):
        es.params.ParameterState.from_layout("out in", grad=1)
    m = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="mapping"):
        es.params.register_module_parameter_layouts_(m, [])
    with pytest.raises(ValueError, match="must not be empty"):
        es.params.register_module_parameter_layouts_(m, {})


def test_validation_names_the_parameter_and_the_inferred_init_sync():
    lin = es.params.register_linear_parameters_(torch.nn.Linear(2, 2), weight_layout="out in/tp",
                                         mesh_dim_names=("dp", "sp", "tp"))
    state = state_of(lin.weight)
    assert state.init_sync.mesh_dims == ("dp", "sp")
    lin.weight.einshard_state = replace(state, init_sync=es.params.ParameterInitSync("inferred", ("dp",)))
    with pytest.raises(ValueError, match="'weight'.*inferred init_sync"):
        es.params.validate_module_parameter_states_(lin)


@pytest.mark.parametrize(
    "formula, operands, kw, words",
    [
        ("b c, c [param] -> b d", (None, "w1"), {}, "Output dimension"),
        ("b, c [param] -> b/dp d", (None, "w1"), {"mesh": MESH_2D}, "Output dimension"),
        ("b [param] -> b b", ("w1",), {}, "appears more than once"),
        ("b [param] -> b/dp b/sp", ("w1",), {"mesh": MESH_2D}, "appears more than once"),
        ("b/dp c, c [param] -> c", (None, "w1"), {}, "output partial"),
    ],
)
def test_einshard_like_formula_messages(formula, operands, kw, words):
    w = _p(3)
    operands = tuple(w if o == "w1" else o for o in operands)
    with pytest.raises(ValueError, match=words):
        es.params.einshard_like(formula, *operands, **kw)
    assert state_of(w) is None


def test_the_missing_mesh_message_suggests_the_output_partial():
    with pytest.raises(ValueError, match=r"require mesh=.*output partial: 'b/dp c, c -> c // dp'.*es.use_mesh"):
        es.einshard("b/dp c, c -> c", torch.ones(2, 3), torch.ones(3))


def test_split_shape_and_factor_messages():
    with pytest.raises(ValueError, match="axis 'b'") as info:
        es.comm.helpers.resolve_split_shapes({"dp": {"a": [2, 3]}}, "dp", "b")
    assert "mesh dimension 'dp'" in str(info.value)
    with pytest.raises(ValueError, match="Cannot infer multiple factor sizes"):
        es.einshard("b (h p) c -> b h p c", torch.ones(2, 6, 3))


def test_einfft_string_axes_is_a_type_error():
    with pytest.raises(TypeError, match="not a string"):
        es.einfft("b time -> b freq", torch.ones(2, 4), axes="time")


@pytest.mark.parametrize("names", [0, (1,), torch.tensor([]), torch.zeros(2).numpy()])
def test_wrap_mesh_names_of_the_wrong_type(names):
    with pytest.raises(TypeError, match="mesh_dim_names"):
        es.wrap_mesh(_Duck(torch.arange(2), names))


@pytest.mark.parametrize(
    "shape, names",
    [((2, 2), ("tp",)), ((2,), ""), ((2, 2), ("tp", "tp")), ((2,), ("dp-dp",)), ((2,), ("dp-",)),
     ((2,), ("dp--sp",)), ((2, 2), ("dp", "dp-sp"))],
)
def test_wrap_mesh_bad_names_say_mesh_dim_names(shape, names):
    with pytest.raises(ValueError, match="mesh_dim_names"):
        es.wrap_mesh(_Duck(torch.arange(4)[: torch.Size(shape).numel()].reshape(shape), names))


# -- E. duck-typed meshes and mesh names ----------------------------------------------------------


def test_wrap_mesh_of_an_object_with_only_mesh_and_names():
    duck = _Duck(torch.arange(4).reshape(2, 2), ("dp", "sp"))
    mesh = es.wrap_mesh(duck)  # no get_coordinate, no process group: nothing is needed yet
    assert mesh.mesh_dim_names == ("dp", "sp") and mesh.shape == (2, 2) and es.wrap_mesh(duck) is mesh
    assert es.wrap_mesh(_Duck(torch.arange(2), "tp")).mesh_dim_names == ("tp",)  # a str is one name
    for key, word in (("dp-dp", "repeat"), ("dp-", "empty"), ("-dp", "empty"), ("dp--sp", "empty")):
        with pytest.raises(ValueError, match=word):
            mesh[key]


def test_a_rank_tensor_without_names_has_zero_names():
    with pytest.raises(ValueError, match="mesh_dim_names"):
        es.params.ParameterState.from_layout("out in", mesh=_Duck(torch.zeros(1, 1), None))
    state = es.params.ParameterState.from_layout("out in", mesh=_Duck(torch.zeros(1), ("tp",)))
    assert state.mesh_dim_names == ("tp",)


@pytest.mark.parametrize("mesh", [_Names("dp"), es.Mesh.virtual((2,), ("dp",))])
@pytest.mark.parametrize(
    "formula, operands",
    [
        ("b/foo, c [param, grad=none] -> b/foo c", (None, "w")),
        ("b/dp c, c [param] -> c // foo", (None, "w")),
        ("b/dp-foo c, c [param] -> b/dp-foo c", (None, "w")),
    ],
)
def test_einshard_like_checks_mesh_names_symbolically(mesh, formula, operands):
    w = _p(3)
    with pytest.raises(ValueError, match="unknown mesh dimensions"):
        es.params.einshard_like(formula, *(w if o == "w" else o for o in operands), mesh=mesh)
    assert state_of(w) is None


def test_einshard_like_on_a_names_only_mesh_records_like_a_real_one():
    names = _Names("dp", "sp")
    w, v = _p(3), _p(3)
    es.params.einshard_like("b/dp c, c [param] -> b/dp c", None, w, mesh=names)
    es.params.einshard_like("b/dp c, c [param] -> b/dp c", None, v, mesh=MESH_2D)
    assert state_of(w) == state_of(v) and state_of(w).reduce == ("dp",)


# -- F. registration helpers: see tests/params/test_register.py (shared grad=/init_sync= are defaults,
#    an explicit layout=None, the norm bias layout) -----------------------------------------------

# -- G. einshard_like under torch.compile -----------------------------------------------------------


def test_einshard_like_carries_the_compile_disable_mark_and_runs_eagerly_under_compile():
    assert getattr(es.params.einshard_like, "_torchdynamo_disable", False) is True
    w = _p(3, 4)

    def f(x):
        es.params.einshard_like("b c, c d [param, grad=dp] -> b d", None, w, mesh=es.Mesh.virtual((2,), ("dp",)))
        return x * 2

    assert torch.equal(torch.compile(f, backend="eager")(torch.ones(2)), torch.full((2,), 2.0))
    assert state_of(w).reduce == ("dp",)


# -- H1. parameter_operand_state infers from any formula (see also tests/params/test_operand.py) --------


def test_parameter_operand_state_gathers_shards_then_output_partials():
    f = expand("b/dp c, c [param, grad=async] -> b/dp c // sp")
    state = es.params.parameter_operand_state(_p(3), f.inputs, f.output, 1, mesh_dim_names=("dp", "sp"))
    assert state.grad_comm == ParameterGradComm("inferred", ("dp", "sp"), "native", "async")
    g = expand("b/dp-sp c, c [param, grad=async] -> b/sp-dp c")
    with pytest.raises(ValueError, match="grad.*overlap"):
        es.params.parameter_operand_state(_p(3), g.inputs, g.output, 1, mesh_dim_names=("dp", "sp"))


# -- I. the names a cached local plan records --------------------------------------------------------


def test_each_call_records_the_names_of_its_own_mesh():
    """The local plan is cached by formula and shapes; the names come from each call's mesh= (none: ())."""
    formula = "b c, c [param, grad=async] -> b c"  # a local formula: one cached plan for all three calls
    x = torch.ones(2, 3)
    w1, w2, w3 = _p(3), _p(3), _p(3)
    es.einshard(formula, x, w1, mesh=es.Mesh.virtual((2,), ("tp",)))
    es.einshard(formula, x, w2)
    es.einshard(formula, x, w3, mesh=es.Mesh.virtual((2,), ("dp",)))
    assert [state_of(w).mesh_dim_names for w in (w1, w2, w3)] == [("tp",), (), ("dp",)]
    es.einshard(formula, x, w2)  # the same parameter again without a mesh: merges with () names
    with pytest.raises(TypeError, match="mesh_dim_names"):  # each call checks its own mesh's names
        es.einshard(formula, x, _p(3), mesh=_Names(1))


# -- J. a size mismatch is also a RuntimeError ------------------------------------------------------


def test_size_mismatch_is_an_einshard_error_and_a_runtime_error():
    w = _p(3)
    with pytest.raises(RuntimeError) as info:
        es.einshard("b c, c [param] -> b c", torch.ones(2, 4), w)
    assert isinstance(info.value, es.EinshardError) and isinstance(info.value, ValueError)
    assert isinstance(info.value, es.SizeMismatchError) and "axis 'c' has size 3" in str(info.value)
    assert state_of(w) is None
    with pytest.raises(RuntimeError):
        es.einshard("(a b) -> a b", torch.ones(6), sizes={"a": 2, "b": 2})


# -- O. einfft(axes=<names>) transforms in place ----------------------------------------------------


def test_einfft_axes_as_an_iterable_of_names():
    x = torch.randn(2, 4, 6)
    y = es.einfft("b *spatial -> b *spatial", x, axes=["spatial"], families={"spatial": ("x", "y")})
    torch.testing.assert_close(y, torch.fft.fftn(x, dim=(1, 2)))
    torch.testing.assert_close(es.einfft("b x y -> b x y", x, axes=("y",)), torch.fft.fftn(x, dim=(2,)))
    torch.testing.assert_close(es.einfft("b x y -> y b x", x, axes=iter(["x", "y"])),
                               torch.fft.fftn(x, dim=(1, 2)).permute(2, 0, 1))
    with pytest.raises(ValueError, match="iterable of input axis names"):
        es.einfft("b x y -> b x y", x, axes=[("x", "kx")])


# -- §5.2: the agreement fingerprint does not depend on PYTHONHASHSEED -------------------------------

_FINGERPRINT = """
import einshard as es
from einshard.runtime.distributed import plan_distributed
from einshard.notation import expand
from einshard.core.policy import resolve_policy
mesh = es.Mesh.virtual((2, 2), ("dp", "sp"))
plan = plan_distributed(expand("a/dp b/sp c, a/dp b/sp d -> c d // (dp, sp)"), [(2, 2, 3), (2, 2, 5)], 4, mesh,
                        None, (), resolve_policy(None, None))
print(plan.fingerprint)
"""


def test_plan_fingerprint_is_the_same_in_every_process():
    """Ranks started apart (torchrun) hash strings differently: a plan partial over two dimensions must
    fingerprint alike in all of them, or checks see a disagreement on a correct call."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    prints = set()
    for seed in range(6):
        env = dict(os.environ, PYTHONHASHSEED=str(seed), PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        out = subprocess.run([sys.executable, "-c", _FINGERPRINT], env=env, capture_output=True, text=True,
                             check=True, timeout=300)
        prints.add(out.stdout.strip())
    assert len(prints) == 1, prints


# -- P. a shapes= one rank's block contradicts: every rank raises together ---------------------------


def _contradicted_shapes(mesh):
    """Every rank raises on a shapes= that only rank 0's block contradicts, and the group stays usable."""
    mesh = es.wrap_mesh(mesh)
    rows, cols = [3, 2, 2, 1], [2, 2, 1, 1]  # the real (uneven) split of l = 8 and f = 6
    bad = [2, 2, 2, 1]  # differs from the real split at index 0 only: rank 0 alone sees it (its block has 3 rows)
    whole_x, whole_y = torch.randn(8, 5, generator=torch.Generator().manual_seed(0)), torch.randn(5, 6)
    x = local_block(whole_x, "l/tp e", mesh, shapes={"tp": rows}).requires_grad_()
    y = whole_y.clone().requires_grad_()
    good = {"tp": {"l": rows, "f": cols}}
    for _ in range(2):  # a cached plan (the second call) agrees as well
        with pytest.raises(ValueError, match="split shapes"):
            es.einshard("l/tp e, e f -> l f/tp", x, y, mesh=mesh, shapes={"tp": {"l": bad, "f": cols}})
        out = es.einshard("l/tp e, e f -> l f/tp", x, y, mesh=mesh, shapes=good)  # the group is intact
        torch.testing.assert_close(out, local_block(whole_x @ whole_y, "l f/tp", mesh, shapes=good))
        out.sum().backward()
    torch.testing.assert_close(y.grad, 2 * whole_x.sum(0)[:, None].expand(5, 6), rtol=1e-5, atol=1e-5)
    return True


@pytest.mark.ranks(4, checks=False, timeout=120)
def test_a_contradicted_shapes_raises_on_every_rank_with_checks_off():
    assert _contradicted_shapes(MeshSpec((4,), ("tp",)).build())


@pytest.mark.ranks(4, timeout=120)
def test_a_contradicted_shapes_raises_on_every_rank_with_checks_on():
    assert _contradicted_shapes(MeshSpec((4,), ("tp",)).build())


def _partial_over_two_dims(mesh):
    """With checks on, a formula partial over two dimensions agrees (uneven blocks, 2-D mesh)."""
    mesh = es.wrap_mesh(mesh)
    shapes = {"dp": {"a": [2, 1]}, "tp": {"b": [2, 1, 1, 1]}}
    g = torch.Generator().manual_seed(1)
    wa, wb = torch.randn(3, 5, 3, generator=g), torch.randn(3, 5, 2, generator=g)
    a = local_block(wa, "a/dp b/tp c", mesh, shapes=shapes)
    b = local_block(wb, "a/dp b/tp d", mesh, shapes=shapes)
    out = es.einshard("a/dp b/tp c, a/dp b/tp d -> c d // (dp, tp)", a, b, mesh=mesh, shapes=shapes)
    total = es.einshard("c d // (dp, tp) -> c d", out, mesh=mesh)
    torch.testing.assert_close(total, torch.einsum("abc,abd->cd", wa, wb))
    return True


@pytest.mark.ranks(8)
def test_partial_over_two_dims_agrees_with_checks_on(mesh_2x4):
    assert _partial_over_two_dims(mesh_2x4)


def _contradicted_shapes_in_stencils_and_ffts(mesh):
    """The same for einhalo, einroll and einfft: a shapes= only rank 0's block contradicts raises everywhere."""
    mesh = es.wrap_mesh(mesh)
    rows, bad, cols = [3, 2, 2, 1], [2, 2, 2, 1], [1, 1, 1, 1]
    whole = torch.randn(8, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x = local_block(whole, "h/tp w", mesh, shapes={"tp": rows})
    spectrum = torch.fft.fftn(whole)
    calls = [
        (lambda r: es.einhalo("h/tp w", x, {"w": 1}, boundary="periodic", mesh=mesh, shapes={"tp": r}),
         "h/tp w", torch.cat([whole[:, -1:], whole, whole[:, :1]], 1), {"tp": rows}),
        (lambda r: es.einroll("h/tp w", x, {"h": 1}, mesh=mesh, shapes={"tp": r}), "h/tp w",
         torch.roll(whole, 1, 0), {"tp": rows}),
        (lambda r: es.einfft("h/tp w -> kh kw/tp", x, {"h": "kh", "w": "kw"}, mesh=mesh,
                             shapes={"tp": {"h": r, "kw": cols}}), "kh kw/tp", spectrum, {"tp": cols}),
    ]
    for call, spec, want, out_shapes in calls:
        with pytest.raises(ValueError, match="split shapes"):
            call(bad)
        torch.testing.assert_close(call(rows), local_block(want, spec, mesh, shapes=out_shapes))  # the group is intact
    return True


@pytest.mark.ranks(4, checks=False, timeout=120)
def test_stencils_and_ffts_raise_on_every_rank_on_a_contradicted_shapes():
    assert _contradicted_shapes_in_stencils_and_ffts(MeshSpec((4,), ("tp",)).build())
