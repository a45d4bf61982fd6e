"""Notation the reference accepts: families in groups and zips, iterable family values, scalar losses,
formulas without a mesh, factored-axis errors, and the two layouts rejected by design."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import einshard as es
from einshard.testing import local_block

# -- families inside groups and zips -----------------------------------------------------------


def _window_partition_2d(x, wh, ww):
    b, t, h, w, c = x.shape
    y = x.reshape(b, t, h // wh, wh, w // ww, ww, c).permute(0, 2, 4, 1, 3, 5, 6)
    return y.reshape(b * (h // wh) * (w // ww), t, wh, ww, c)


def _window_partition_3d(x, wd, wh, ww):
    b, t, d, h, w, c = x.shape
    y = x.reshape(b, t, d // wd, wd, h // wh, wh, w // ww, ww, c).permute(0, 2, 4, 6, 1, 3, 5, 7, 8)
    return y.reshape(b * (d // wd) * (h // wh) * (w // ww), t, wd, wh, ww, c)


@pytest.mark.parametrize("container", [tuple, list])
def test_window_partition_2d_and_its_reverse(container):
    x = torch.randn(2, 3, 8, 6, 5)
    families = {"spatial": container(["h", "w"]), "window": container(["wh", "ww"])}
    y = es.einshard("b t [*spatial *window] c -> (b *spatial) t *window c", x, families=families,
                    sizes={"window": container([4, 3])})
    assert torch.equal(y, _window_partition_2d(x, 4, 3))
    back = es.einshard("(b *spatial) t *window c -> b t [*spatial *window] c", y, families=families,
                       sizes={"spatial": container([2, 2])})
    assert torch.equal(back, x)


def test_window_partition_3d_and_its_reverse():
    x = torch.randn(2, 3, 4, 6, 6, 2)
    families = {"spatial": ("d", "h", "w"), "window": ("wd", "wh", "ww")}
    y = es.einshard("b t [*spatial *window] c -> (b *spatial) t *window c", x, families=families,
                    sizes={"window": (2, 3, 2)})
    assert torch.equal(y, _window_partition_3d(x, 2, 3, 2))
    back = es.einshard("(b *spatial) t *window c -> b t [*spatial *window] c", y, families=families,
                       sizes={"spatial": [2, 2, 3]})
    assert torch.equal(back, x)


def test_window_partition_gradient():
    x = torch.randn(2, 3, 8, 6, 5, dtype=torch.float64, requires_grad=True)
    families = {"spatial": ("h", "w"), "window": ("wh", "ww")}
    torch.autograd.gradcheck(
        lambda t: es.einshard("b t [*spatial *window] c -> (b *spatial) t *window c", t, families=families,
                              sizes={"window": (4, 3)}),
        (x,),
    )


def test_family_in_a_group_parses_and_mismatched_zips_are_errors():
    assert str(es.parse_sharding("(b *s) t -> t")) == "(b *s) t -> t"
    with pytest.raises(ValueError, match="zipped families must have equal lengths"):
        es.einshard("[*s *w] -> *s *w", torch.ones(4, 4), families={"s": ["h", "x"], "w": ["k"]})
    with pytest.raises(ValueError, match="has 3 entries but family 'window' has 2 members"):
        es.einshard("b [*s *window] -> b *s *window", torch.ones(2, 8, 6),
                    families={"s": ("h", "w"), "window": ("wh", "ww")}, sizes={"window": (2, 2, 2)})


# -- family values as lists or tuples everywhere ---------------------------------------------


@pytest.mark.parametrize("container", [tuple, list])
def test_family_values_as_lists_or_tuples(container):
    x = torch.arange(12.0).reshape(3, 4)
    fam = {"s": container(["h", "w"])}
    assert torch.equal(es.einshard("*s -> (*s)", x, families=fam), x.reshape(12))
    spectrum = es.einfft("*s -> *k", x, {"s": container(["kh", "kw"])}, families={**fam, "k": container(["kh", "kw"])})
    assert torch.allclose(spectrum, torch.fft.fftn(x))
    halo = es.einhalo("*s", x, {"s": container([1, container([0, 1])])}, families=fam, boundary="periodic")
    assert halo.shape == (5, 5)
    assert torch.equal(es.einroll("*s", x, {"s": container([1, 2])}, families=fam), torch.roll(x, (1, 2), (0, 1)))
    win = es.einwindow("*s -> *s kh kw", x, {"s": container(["kh", "kw"])}, {"s": container([1, 1])}, families=fam)
    assert win.shape == (3, 4, 3, 3)
    mesh = es.Mesh.virtual((2,), ("sp",), coordinate=(1,))
    sharded = {"s": container(["h/sp", "w"])}
    block = es.tree_shard({"x": torch.arange(16.0).reshape(4, 4)}, {"x": "*s"}, mesh=mesh, families=sharded)["x"]
    assert torch.equal(block, torch.arange(8.0, 16.0).reshape(2, 4))


def test_einfft_rejects_a_string_axes_naming_the_form():
    with pytest.raises(TypeError, match=r"axes= must be a mapping or an iterable of axis names, not a string"):
        es.einfft("x y -> kx ky", torch.ones(4, 4), "xy")


# -- a 0-d loss named by one axis -----------------------------------------------------------


def _scalar_loss(mesh):
    mesh = es.wrap_mesh(mesh)
    names = mesh.mesh_dim_names
    rank = dist.get_rank()
    loss = torch.tensor(float(rank + 1), dtype=torch.float64, requires_grad=True)
    total = float(sum(range(1, 9)))
    forms = [f"loss // ({', '.join(names)}) -> loss", f"loss // {'-'.join(reversed(names))} -> loss"]
    for formula in forms:
        out = es.einshard(formula, loss, mesh=mesh)
        reference = es.einshard(formula.replace("loss", ""), loss, mesh=mesh)
        assert out.dim() == 0 and out.item() == total == reference.item(), (formula, out)
        (grad,) = torch.autograd.grad(out, loss)
        assert grad.item() == 1.0
    # local: a 0-d tensor named by one axis
    assert es.einshard("loss -> loss", loss.detach()).item() == rank + 1
    return True


@pytest.mark.ranks(8)
def test_scalar_loss_named_by_one_axis_sums_over_ranks(mesh):
    assert _scalar_loss(mesh)


# -- formulas whose sharded axes do not move need no mesh ------------------------------------


def test_stationary_formulas_run_without_a_mesh():
    a_block, b = torch.randn(3, 4), torch.randn(4, 5)
    out = es.einshard("a/sp b, b c -> a/sp c", a_block, b)
    assert torch.allclose(out, a_block @ b)
    x = torch.randn(2, 6)
    assert torch.equal(es.einshard("b (h/sp p) -> b h/sp p", x, sizes={"p": 3}), x.reshape(2, 2, 3))
    for _ in range(2):  # cached: same answer
        assert torch.allclose(es.einshard("a/sp b, b c -> a/sp c", a_block, b), out)
    for moving in ("a/sp b -> a b", "a b/sp, b/sp c -> a c", "a/sp b -> a b // sp", "a b -> a/sp b"):
        with pytest.raises(ValueError, match=r"Distributed einshard operations require mesh=\.\.\."):
            es.einshard(moving, *[torch.ones(2, 2)] * (moving.split("->")[0].count(",") + 1))
    with pytest.raises(ValueError, match=r"require mesh"):  # sizes= of a sharded axis is a whole size
        es.einshard("b (h/sp p) -> b h/sp p", x, sizes={"h": 4})


@pytest.mark.parametrize(
    "mesh_shape, names, formula, shapes, grad",
    [
        ((4,), ("sp",), "a/sp b, b c -> a/sp c", [(10, 3), (3, 5)], True),  # uneven over 4
        ((2, 2), ("sp", "tp"), "a/sp b, b c/tp -> a/sp c/tp", [(5, 3), (3, 7)], False),  # both need a sum
        ((2, 2), ("sp", "tp"), "a/sp-tp b, b c -> c a/tp-sp", [(9, 3), (3, 4)], True),
    ],
)
def test_stationary_formulas_match_the_whole_computation(mesh_shape, names, formula, shapes, grad):
    """Each rank's result without a mesh is its block of the whole result, and so is the gradient of an
    operand sharded like the output (``grad``: the first operand is)."""
    local_formula = formula.replace("/sp-tp", "").replace("/tp-sp", "").replace("/sp", "").replace("/tp", "")
    whole = [torch.randn(s, dtype=torch.float64) for s in shapes]
    want = es.einshard(local_formula, *whole)
    in_specs = [s.strip() for s in formula.split("->")[0].split(",")]
    out_spec = formula.split("->")[1].strip()
    split = {}
    for spec, s in zip(in_specs, shapes):
        for axis, size in zip(spec.split(), s):
            if "/" in axis:
                dim = axis.split("/")[1]
                split[dim] = es.comm.helpers.compute_split_shapes(size, 4 if "-" in dim else mesh_shape[names.index(dim)])
    for coordinate in [(i,) for i in range(4)] if len(mesh_shape) == 1 else [(i, j) for i in range(2) for j in range(2)]:
        mesh = es.Mesh.virtual(mesh_shape, names, coordinate=coordinate)
        blocks = [local_block(w, spec, mesh, shapes=split).clone() for w, spec in zip(whole, in_specs)]
        blocks[0].requires_grad_(grad)
        out = es.einshard(formula, *blocks)
        assert torch.allclose(out, local_block(want, out_spec, mesh, shapes=split))
        if not grad:
            continue
        out.sum().backward()
        whole_a = whole[0].clone().requires_grad_(True)
        es.einshard(local_formula, whole_a, *whole[1:]).sum().backward()
        assert torch.allclose(blocks[0].grad, local_block(whole_a.grad, in_specs[0], mesh, shapes=split))


def test_without_a_mesh_a_replicated_operand_may_not_need_a_gradient():
    """Its gradient is a sum over the ranks: that needs the mesh, so the call says so."""
    a, w = torch.randn(2, 3), torch.randn(3, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"require mesh=.*operand 1 needs a gradient.*\['sp'\]"):
        es.einshard("a/sp b, b c -> a/sp c", a, w)
    with torch.no_grad():
        assert es.einshard("a/sp b, b c -> a/sp c", a, w).shape == (2, 4)


# -- factored axes -----------------------------------------------------------------------------


def test_factored_axis_errors_name_the_group_and_the_unknown_factors():
    with pytest.raises(ValueError, match=r"'h', 'q' in group '\(h p q\)' of operand 0"):
        es.einshard("b (h p q) -> b h p q", torch.ones(2, 12), sizes={"p": 2})
    with pytest.raises(ValueError, match=r"group '\(h p\)'"):
        es.einshard("b (h p) -> b h p", torch.ones(2, 7), sizes={"p": 2})


@pytest.mark.parametrize("coordinate", range(4))
def test_local_reshape_of_a_sharded_factor(coordinate):
    """``(h/sp p)`` split locally, with uneven blocks of ``h``: no communication, so a virtual mesh runs it."""
    mesh = es.Mesh.virtual((4,), ("sp",), coordinate=(coordinate,))
    whole = torch.randn(2, 10, 3)  # b h p
    shapes = {"sp": es.comm.helpers.compute_split_shapes(10, 4)}
    block = local_block(whole, "b h/sp p", mesh, shapes=shapes).reshape(2, -1)  # (h/sp p) flattened
    out = es.einshard("b (h/sp p) -> b h/sp p", block, mesh=mesh, shapes=shapes, sizes={"p": 3})
    assert torch.equal(out, local_block(whole, "b h/sp p", mesh, shapes=shapes))
    merged = es.einshard("b h/sp p -> b (h/sp p)", out, mesh=mesh, shapes=shapes)
    assert torch.equal(merged, block)


# -- layouts rejected by design ---------------------------------------------------------------


@pytest.mark.parametrize(
    "formula, fragment",
    [
        ("a/sp c/sp -> a c", "splits at most one axis of a tensor"),
        ("l/tp e // tp -> l e", "either hold different blocks (shard) or addends of one value (partial)"),
    ],
)
def test_layouts_rejected_by_design_say_why(formula, fragment):
    with pytest.raises(ValueError, match="rejected by design") as info:
        es.einshard(formula, torch.ones(2, 2))
    assert fragment in str(info.value)
    es.parse_sharding(formula)  # the syntax is fine: parse_sharding checks syntax only
