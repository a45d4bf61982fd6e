"""Gradient duties, hooks and ``shard_map`` in every training loop; whole tensors where blocks are expected.

Every multi-rank case runs on 4 gloo ranks in float64 and is compared with the
same computation on whole tensors in one process (values, gradients, an AdamW
step), on a 1-D mesh (``dp`` over 4 ranks) and a 2-D one (``dp`` x ``tp``), with
uneven blocks (``B = F = 5``). The model is ``y = (x * g) @ w.T + b``, loss
``sum(y ** 2)``: ``g`` replicated, ``w`` and ``b`` split over ``tp`` along ``f``
(replicated on the 1-D mesh), each with the gradient duty ``dp`` (or ``dp:async``).
"""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

import einshard as es
from einshard.params.buckets import hooked_by
from einshard.comm.helpers import compute_split_shapes
from einshard.testing import MeshSpec, local_block

DT = torch.float64
B, C, F = 5, 3, 5  # uneven over 2 and 4 ranks (the default); _use("even") sets even sizes for one test
SIZES = {"b": B, "f": F}
MESHES = pytest.mark.parametrize("mesh", [MeshSpec((4,), ("dp",)), MeshSpec((2, 2), ("dp", "tp"))], ids=["4", "2x2"])
DUTIES = pytest.mark.parametrize("grad", ["dp", "dp:async"])
EVEN_AND_UNEVEN = pytest.mark.parametrize("size", ["uneven", "even"])


def _use(size: str) -> None:
    """Set the whole sizes for the test running on this rank: uneven (5 over 2 and 4 ranks) or even (4)."""
    global B, F, SIZES
    B, F = (5, 5) if size == "uneven" else (4, 4)
    SIZES = {"b": B, "f": F}


def _whole(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {"x": torch.randn(B, C, generator=g, dtype=DT), "g": torch.randn(C, generator=g, dtype=DT) + 1,
         "w": torch.randn(F, C, generator=g, dtype=DT), "b": torch.randn(F, generator=g, dtype=DT)}
    t["x2"] = torch.randn(B, C, generator=g, dtype=DT)  # a second micro-batch
    for k in ("s", "t", "z"):  # scales: frozen after the hooks (s), frozen before (t); z is never used
        t[k] = torch.rand(C, generator=g, dtype=DT) + 0.5
    return t


def _f(mesh) -> str:
    return "f/tp" if "tp" in mesh.names else "f"


def _layouts(mesh, names=("g", "w", "b")):
    return {k: {"w": f"{_f(mesh)} c", "b": _f(mesh)}.get(k, "c") for k in names}


def _loss_whole(t, x, names):
    scale = t["g"]
    for k in names:
        if k in ("s", "t"):
            scale = scale * t[k]
    return (((x * scale) @ t["w"].T + t["b"]) ** 2).sum()


def _reference(batches=("x",), names=("g", "w", "b"), frozen=()):
    """One process, whole tensors: the parameters and their gradients summed over ``batches``."""
    whole = _whole()
    t = {k: whole[k].clone().requires_grad_(k not in frozen) for k in names}
    for x in batches:
        _loss_whole(t, whole[x], names).backward()
    return t


class Model(torch.nn.Module):
    """This rank's blocks of the whole parameters ``names``, their layouts registered with ``grad``."""

    def __init__(self, mesh, grad=None, names=("g", "w", "b")):
        super().__init__()
        whole = _whole()
        self.names = names
        layouts = _layouts(mesh, names)
        for k in names:
            setattr(self, k, torch.nn.Parameter(local_block(whole[k], layouts[k], mesh, sizes=SIZES).clone()))
        es.params.register_module_parameter_layouts_(self, layouts, mesh=mesh, grad=grad)

    def scale(self):
        out = self.g
        for k in ("s", "t"):
            if k in self.names:
                out = out * getattr(self, k)
        return out


def _formula_loss(model, mesh, x="x"):
    """Outside shard_map: formulas on this rank's rows; the duties leave the gradients partial over dp."""
    xb = local_block(_whole()[x], "b/dp c", mesh, sizes=SIZES)
    f = _f(mesh)
    with es.use_mesh(mesh):
        y = es.einshard(f"b/dp c, {f} c -> b/dp {f}", xb * model.scale(), model.w, sizes=SIZES) + model.b
        return es.einshard(f"b/dp {f} -> ", y * y, sizes=SIZES)


def _shard_map_loss(model, mesh, check_vma=True):
    """Inside shard_map: the batch arrives whole ('b c -> b/dp c'), the parameters as their blocks."""
    f = _f(mesh)
    shapes = {"tp": {"f": compute_split_shapes(F, 2)}} if "tp" in mesh.names else None

    @es.shard_map((es.params.param_specs(model), "b c -> b/dp c"), "", mesh=mesh, check_vma=check_vma, shapes=shapes)
    def body(params, x):
        y = es.einshard(f"b/dp c, {f} c -> b/dp {f}", x * params["g"], params["w"]) + params["b"]
        return es.einshard(f"b/dp {f} -> ", y * y)

    return lambda x="x": body(dict(model.named_parameters()), _whole()[x])


def _check_grads(model, mesh, ref, names=None):
    for k in names or model.names:
        want = None if ref[k].grad is None else local_block(ref[k].grad, _layouts(mesh, (k,))[k], mesh, sizes=SIZES)
        got = getattr(model, k).grad
        if want is None:
            assert got is None, f"{k}: a parameter that got no gradient has .grad {got}"
        else:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=k)


def _reduces(stats) -> int:
    return sum(r.calls for (kind, _l, _d), r in stats.records.items() if kind == "all_reduce")


# -- gradient duties inside shard_map ------------------------------------------------------------------------


@pytest.mark.ranks(4)
@MESHES
@DUTIES
@EVEN_AND_UNEVEN
def test_a_duty_inside_shard_map_is_summed_once_by_the_body(mesh, grad, size):
    """grad=dp(:async) parameters trained inside shard_map(check_vma=True) get the one-process gradient."""
    _use(size)
    m = es.wrap_mesh(mesh)
    ref = _reference()
    model = Model(m, grad)
    loss = _shard_map_loss(model, m)()
    torch.testing.assert_close(loss, _loss_whole(ref, _whole()["x"], model.names).detach(), rtol=1e-12, atol=1e-12)
    loss.backward()
    _check_grads(model, m, ref)
    # a second step (micro-batch) accumulates exactly
    _shard_map_loss(model, m)("x2").backward()
    _check_grads(model, m, _reference(("x", "x2")))
    # torch.autograd.grad through the body returns whole gradients too, and writes no .grad
    model.zero_grad(set_to_none=True)
    grads = torch.autograd.grad(_shard_map_loss(model, m)(), [model.g, model.w, model.b])
    for k, got in zip(("g", "w", "b"), grads):
        torch.testing.assert_close(got, local_block(ref[k].grad, _layouts(m, (k,))[k], m, sizes=SIZES),
                                   rtol=1e-12, atol=1e-12, msg=k)
    assert model.w.grad is None
    dist.barrier()


@pytest.mark.ranks(4)
@MESHES
@DUTIES
def test_shard_map_micro_batches_with_unused_and_frozen_parameters(mesh, grad):
    """Rows 2 and 4 in the shard_map style: z unused, s frozen; two micro-batches; an AdamW step."""
    _use("uneven")
    m = es.wrap_mesh(mesh)
    names = ("g", "w", "b", "s", "z")
    model = Model(m, grad, names)
    model.s.requires_grad_(False)
    f = _f(m)
    shapes = {"tp": {"f": compute_split_shapes(F, 2)}} if "tp" in m.names else None

    @es.shard_map((es.params.param_specs(model), "b c -> b/dp c"), "", mesh=m, shapes=shapes)
    def body(params, x):
        y = es.einshard(f"b/dp c, {f} c -> b/dp {f}", x * params["g"] * params["s"], params["w"]) + params["b"]
        return es.einshard(f"b/dp {f} -> ", y * y)

    for x in ("x", "x2"):
        body(dict(model.named_parameters()), _whole()[x]).backward()
    ref = _reference(("x", "x2"), names, frozen=("s", "z"))
    _check_grads(model, m, ref)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    ref_opt = torch.optim.AdamW(ref.values(), lr=0.1, weight_decay=0.5)
    opt.step()
    ref_opt.step()
    for k in names:
        want = local_block(ref[k].detach(), _layouts(m, (k,))[k], m, sizes=SIZES)
        torch.testing.assert_close(getattr(model, k).detach(), want, rtol=1e-12, atol=1e-12, msg=k)
    dist.barrier()


@pytest.mark.ranks(4)
@MESHES
@DUTIES
def test_reducing_a_gradient_a_shard_map_body_summed_raises(mesh, grad):
    _use("uneven")
    m = es.wrap_mesh(mesh)
    model = Model(m, grad)
    _shard_map_loss(model, m)().backward()
    before = {k: getattr(model, k).grad.clone() for k in model.names}
    with es.count_communication() as stats, pytest.raises(ValueError, match="summed by the es.shard_map body"):
        es.params.reduce_module_grads_(model, m)
    assert _reduces(stats) == 0  # refused before any collective
    for k in model.names:
        assert torch.equal(getattr(model, k).grad, before[k]), k
    with pytest.raises(ValueError, match="summed by the es.shard_map body"):
        es.params.reduce_grad_(model.b, es.params.get_parameter_state(model.b), m)
    _check_grads(model, m, _reference())
    # a new gradient (zero_grad sets .grad to None) computed outside shard_map is reduced as usual
    model.zero_grad(set_to_none=True)
    _formula_loss(model, m).backward()
    es.params.reduce_module_grads_(model, m)
    _check_grads(model, m, _reference())
    dist.barrier()


@pytest.mark.ranks(4)
@MESHES
@DUTIES
def test_shard_map_refuses_parameters_that_hooks_sum(mesh, grad):
    _use("uneven")
    m = es.wrap_mesh(mesh)
    model = Model(m, grad)
    handle = es.params.register_native_grad_reduction_hooks_(model, m)
    with es.count_communication() as stats, pytest.raises(ValueError, match="live gradient hooks") as err:
        _shard_map_loss(model, m)()
    assert "args[0]['b']" in str(err.value) and "handle.remove()" in str(err.value)  # the first leaf
    assert _reduces(stats) == 0 and all(getattr(model, k).grad is None for k in model.names)
    # check_vma=False: the body is per-rank code, the duties leave the gradients partial, the hooks sum them
    _shard_map_loss(model, m, check_vma=False)().backward()
    handle.wait()
    _check_grads(model, m, _reference())
    handle.remove()
    assert hooked_by(model.w) is None
    model.zero_grad(set_to_none=True)
    _shard_map_loss(model, m)().backward()  # without the hooks: the body sums
    _check_grads(model, m, _reference())
    # check_vma=False and reduce_module_grads_ after backward: also once
    model.zero_grad(set_to_none=True)
    _shard_map_loss(model, m, check_vma=False)().backward()
    es.params.reduce_module_grads_(model, m)
    _check_grads(model, m, _reference())
    dist.barrier()


@pytest.mark.ranks(4)
@pytest.mark.parametrize("grad, who", [("dp:ddp", "DistributedDataParallel"), ("dp:external", "an external system")])
def test_shard_map_refuses_ddp_and_external_duties(grad, who):
    _use("uneven")
    m = es.wrap_mesh(MeshSpec((4,), ("dp",)).build())
    model = Model(m)
    es.params.register_parameter_layout(model.b, "f", mesh=m, grad=grad)
    with pytest.raises(ValueError, match=f"args\\[0\\]\\['b'\\] has the gradient duty '{grad}' \\({who} sums it\\)"):
        _shard_map_loss(model, m)()
    dist.barrier()


@pytest.mark.ranks(4)
def test_a_captured_parameter_with_hooks_is_refused():
    """A parameter the body reaches without an argument (captured) is found where the body uses it."""
    _use("uneven")
    m = es.wrap_mesh(MeshSpec((4,), ("dp",)).build())
    model = Model(m, "dp")
    handle = es.params.register_native_grad_reduction_hooks_(model, m)

    @es.shard_map("b c -> b/dp c", "", mesh=m)
    def body(x):
        return es.einshard("b/dp f -> ", (es.einshard("b/dp c, f c -> b/dp f", x, model.w) + model.b) ** 2)

    with pytest.raises(ValueError, match="used in the body has the gradient duty 'dp'.*live gradient hooks"):
        body(_whole()["x"])
    handle.remove()
    ref = _reference()
    body(_whole()["x"] * ref["g"].detach()).backward()  # captured, without hooks: summed by the body, once
    _check_grads(model, m, ref, names=("w", "b"))
    with pytest.raises(ValueError, match="summed by the es.shard_map body"):
        es.params.reduce_module_grads_(model, m)
    dist.barrier()


# -- hooks in every loop ----------------------------------------------------------------------------------------


@pytest.mark.ranks(4)
@MESHES
@DUTIES
@EVEN_AND_UNEVEN
def test_hooks_micro_batches_with_unused_and_frozen_parameters(mesh, grad, size):
    """Two micro-batches, one wait(): a parameter unused (z) or frozen after the hooks (s) keeps .grad None."""
    _use(size)
    m = es.wrap_mesh(mesh)
    names = ("g", "w", "b", "s", "z")
    model = Model(m, grad, names)
    handle = es.params.register_native_grad_reduction_hooks_(model, m, bucket_bytes=2**20)  # one bucket for all
    model.s.requires_grad_(False)
    _formula_loss(model, m).backward()
    _formula_loss(model, m, "x2").backward()
    handle.wait()
    ref = _reference(("x", "x2"), names, frozen=("s", "z"))
    _check_grads(model, m, ref)
    # AdamW with weight decay: the parameters without gradients do not move, the others as in one process
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    ref_opt = torch.optim.AdamW(ref.values(), lr=0.1, weight_decay=0.5)
    opt.step()
    ref_opt.step()
    for k in names:
        want = local_block(ref[k].detach(), _layouts(m, (k,))[k], m, sizes=SIZES)
        torch.testing.assert_close(getattr(model, k).detach(), want, rtol=1e-12, atol=1e-12, msg=k)
    assert torch.equal(model.s.detach(), local_block(_whole()["s"], "c", m))
    handle.remove()
    dist.barrier()


@pytest.mark.ranks(4)
@MESHES
@DUTIES
@EVEN_AND_UNEVEN
def test_hooks_sum_what_torch_autograd_grad_returns(mesh, grad, size):
    _use(size)
    m = es.wrap_mesh(mesh)
    model = Model(m, grad)
    handle = es.params.register_native_grad_reduction_hooks_(model, m)
    ref = _reference()
    params = [model.g, model.w, model.b]
    for zeroed in (False, True):
        if zeroed:  # .grad holds zeros: autograd.grad must not see them (nor write into them)
            _formula_loss(model, m).backward()
            handle.wait()
            model.zero_grad(set_to_none=False)
        grads = torch.autograd.grad(_formula_loss(model, m), params)
        handle.wait()
        for k, got in zip(("g", "w", "b"), grads):
            want = local_block(ref[k].grad, _layouts(m, (k,))[k], m, sizes=SIZES)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=k)
        for p in params:
            assert p.grad is None if not zeroed else torch.equal(p.grad, torch.zeros_like(p))
    handle.remove()
    dist.barrier()


@pytest.mark.ranks(4)
@MESHES
@DUTIES
def test_hooks_take_parameters_frozen_at_registration_once_unfrozen(mesh, grad):
    _use("uneven")
    m = es.wrap_mesh(mesh)
    names = ("g", "w", "b", "t")
    model = Model(m, grad, names)
    model.t.requires_grad_(False)
    handle = es.params.register_native_grad_reduction_hooks_(model, m)
    _formula_loss(model, m).backward()
    handle.wait()
    _check_grads(model, m, _reference(names=names, frozen=("t",)))
    model.zero_grad(set_to_none=True)
    model.t.requires_grad_(True)  # unfrozen: summed from now on
    for step in range(2):
        _formula_loss(model, m).backward()
        handle.wait()
        _check_grads(model, m, _reference(names=names))
        model.zero_grad(set_to_none=True)
    handle.remove()
    dist.barrier()


@pytest.mark.ranks(4)
@MESHES
@DUTIES
def test_no_sync_accumulates_without_communicating(mesh, grad):
    _use("uneven")
    m = es.wrap_mesh(mesh)
    model = Model(m, grad)
    handle = es.params.register_native_grad_reduction_hooks_(model, m, bucket_bytes=2**20)

    def sums(stats):  # all-reduces in backward: the formulas' own (over tp) and the gradient sums
        return sum(r.calls for r in stats.filter(kind="all_reduce", direction="backward").records.values())

    with es.count_communication() as plain:
        _formula_loss(Model(m), m).backward()  # no duty, no hooks: the formulas' own only
    with es.count_communication() as inside:
        with handle.no_sync():
            _formula_loss(model, m).backward()
    assert sums(inside) == sums(plain) - 1 and handle.pending == 0  # no sum, and the formula leaves w's too
    with es.count_communication() as after:
        _formula_loss(model, m, "x2").backward()  # the first backward after no_sync sums both micro-batches
        handle.wait()
    assert sums(after) == sums(inside) + (1 if grad == "dp:async" else 3)  # one bucket / one sum per parameter
    _check_grads(model, m, _reference(("x", "x2")))
    # wait() inside no_sync completes the sums too
    model.zero_grad(set_to_none=True)
    with handle.no_sync():
        _formula_loss(model, m).backward()
        handle.wait()
    _check_grads(model, m, _reference())
    handle.remove()
    dist.barrier()


@pytest.mark.ranks(4)
def test_hooks_and_reduce_helpers_do_not_both_sum():
    _use("uneven")
    m = es.wrap_mesh(MeshSpec((4,), ("dp",)).build())
    model = Model(m, "dp:async")
    handle = es.params.register_native_grad_reduction_hooks_(model, m)
    with pytest.raises(ValueError, match="already has gradient hooks"):
        es.params.register_native_grad_reduction_hooks_(model, m)
    _formula_loss(model, m).backward()
    with pytest.raises(ValueError, match="summed by live gradient hooks"):
        es.params.reduce_module_grads_(model, m)
    handle.wait()
    _check_grads(model, m, _reference())
    handle.remove()
    dist.barrier()


# -- whole tensors where blocks are expected ---------------------------------------------------------------------


def _whole_model(mesh):
    """A model built with the whole parameters on every rank, its layouts registered as blocks."""
    whole = _whole()
    model = torch.nn.Module()
    model.names = ("g", "w", "b")
    for k in model.names:
        setattr(model, k, torch.nn.Parameter(whole[k].clone()))
    return es.params.register_module_parameter_layouts_(model, _layouts(mesh), mesh=mesh)


@pytest.mark.ranks(4)
@MESHES
@EVEN_AND_UNEVEN
def test_tree_shard_records_global_shapes_and_a_whole_tensor_raises(mesh, size):
    _use(size)
    m = es.wrap_mesh(mesh)
    f = _f(m)
    model = _whole_model(m)
    blocks = es.tree_shard(model, mesh=m)  # whole values: their shapes are recorded on the parameters

    @es.shard_map((es.params.param_specs(model), "b c -> b/dp c"), "", mesh=m)
    def loss_fn(params, x):
        y = es.einshard(f"b/dp c, {f} c -> b/dp {f}", x * params["g"], params["w"]) + params["b"]
        return es.einshard(f"b/dp {f} -> ", y * y)

    x = _whole()["x"]
    if "tp" in m.names:  # the blocks were never loaded: the whole weight where this rank's block is expected
        with es.count_communication() as stats, pytest.raises(ValueError, match=r"It is the whole tensor"):
            loss_fn(dict(model.named_parameters()), x)
        assert _reduces(stats) == 0
        with pytest.raises(ValueError, match=f"operand 1 holds {F} elements of axis 'f'"):
            es.einshard(f"b/dp c, {f} c -> b/dp {f}", local_block(x, "b/dp c", m, sizes=SIZES), model.w,
                        mesh=m, sizes={"b": B})
    assert es.params.get_parameter_state(model.w).global_shape == (F, C)
    with torch.no_grad():
        for k in model.names:
            getattr(model, k).data = blocks[k]
    # the blocks loaded: the recorded shape gives the uneven split shapes (no shapes= anywhere)
    ref = _reference()
    loss = loss_fn(dict(model.named_parameters()), x)
    torch.testing.assert_close(loss, _loss_whole(ref, x, model.names).detach(), rtol=1e-12, atol=1e-12)
    loss.backward()
    _check_grads(model, m, ref)
    # a whole tensor given for a spec es.params.param_specs made is caught too (the spec carries the shape)
    if "tp" in m.names:
        with pytest.raises(ValueError, match=r"It is the whole tensor: pass this rank's block, or convert on entry"):
            loss_fn({**dict(model.named_parameters()), "w": _whole()["w"]}, x)
        with pytest.raises(ValueError, match="recorded global shape"):
            es.tree_shard({"w": _whole()["w"][:F - 1]}, {"w": es.params.param_specs(model)["w"]}, mesh=m)
    dist.barrier()


@pytest.mark.ranks(4)
@MESHES
def test_registered_sizes_record_the_global_shape(mesh):
    _use("uneven")
    m = es.wrap_mesh(mesh)
    f = _f(m)
    model = _whole_model(m)  # whole parameters registered as blocks, with the whole sizes given
    es.params.register_module_parameter_layouts_(model, _layouts(m), mesh=m, sizes={"f": F})
    assert es.params.get_parameter_state(model.b).global_shape == (F,)
    x = local_block(_whole()["x"], "b/dp c", m, sizes=SIZES)
    if "tp" in m.names:
        with pytest.raises(ValueError, match="operand 1 holds 5 elements of axis 'f' on this rank"):
            es.einshard(f"b/dp c, {f} c -> b/dp {f}", x, model.w, mesh=m, sizes={"b": B})
    # this rank's blocks, registered with the sizes: the formulas need no sizes= for f
    block = Model(m, "dp:async")
    es.params.register_module_parameter_layouts_(block, _layouts(m), mesh=m, sizes={"f": F})
    handle = es.params.register_native_grad_reduction_hooks_(block, m)
    with es.use_mesh(m):
        y = es.einshard(f"b/dp c, {f} c -> b/dp {f}", x * block.g, block.w, sizes={"b": B}) + block.b
        loss = es.einshard(f"b/dp {f} -> ", y * y, sizes=SIZES)
    loss.backward()
    handle.wait().remove()
    ref = _reference()
    torch.testing.assert_close(loss, _loss_whole(ref, _whole()["x"], block.names).detach(), rtol=1e-12, atol=1e-12)
    _check_grads(block, m, ref)
    dist.barrier()


@pytest.mark.ranks(4)
def test_a_whole_batch_where_a_block_is_expected_raises_where_its_size_is_known():
    _use("uneven")
    m = es.wrap_mesh(MeshSpec((4,), ("dp",)).build())
    x, w = _whole()["x"], _whole()["w"]

    @es.shard_map(("b/dp c", "f c"), "", mesh=m, sizes={"b": B})
    def loss_fn(xb, wb):
        return es.einshard("b/dp c, f c -> ", xb, wb)

    with pytest.raises(ValueError, match=r"holds 5 elements of axis 'b'.*it holds the whole axis.*in-spec 'b \.\.\. -> b/dp \.\.\.'"):
        loss_fn(x, w)
    whole = es.shard_map(lambda xb, wb: es.einshard("b/dp c, f c -> ", xb, wb), ("b c -> b/dp c", "f c"), "", mesh=m)
    torch.testing.assert_close(whole(x, w), (x @ w.T).sum(), rtol=1e-12, atol=1e-12)  # the arrow form: whole in
    dist.barrier()


# -- under torch.compile --------------------------------------------------------------------------------------


@pytest.mark.ranks(2)
def test_compiled_shard_map_refuses_parameters_with_duties():
    _use("uneven")
    m = es.wrap_mesh(MeshSpec((2,), ("dp",)).build())

    def step_of(model):
        @es.shard_map((es.params.param_specs(model), "b c -> b/dp c"), "", mesh=m)
        def step(params, x):
            return es.einshard("b/dp f -> ", (es.einshard("b/dp c, f c -> b/dp f", x * params["g"], params["w"])
                                               + params["b"]) ** 2)

        return step

    x = _whole()["x"]
    model = Model(m, "dp")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="shard_map under torch.compile: argument leaf .* carries a gradient duty"):
        torch.compile(step_of(model), fullgraph=True, backend="aot_eager")(dict(model.named_parameters()), x)
    # without duties the compiled step sums every gradient in the body (the recorded shapes give the splits)
    plain = Model(m)
    es.tree_shard({k: _whole()[k] for k in plain.names}, es.params.param_specs(plain), mesh=m)
    torch._dynamo.reset()
    torch.compile(step_of(plain), backend="aot_eager")(dict(plain.named_parameters()), x).backward()
    _check_grads(plain, m, _reference())
    torch._dynamo.reset()
    dist.barrier()


# -- one process: the metadata ---------------------------------------------------------------------------------


def test_global_shapes_merge_and_validate():
    p = torch.nn.Parameter(torch.zeros(3, 4))
    es.params.register_parameter_layout(p, "f/tp c", sizes={"f": 6})
    assert es.params.get_parameter_state(p).global_shape == (6, 4)
    es.params.register_parameter_layout(p, "f/tp c")  # no sizes: the recorded shape stays
    assert es.params.get_parameter_state(p).global_shape == (6, 4)
    with pytest.raises(ValueError, match="different global shape"):
        es.params.register_parameter_layout(p, "f/tp c", sizes={"f": 7})
    with pytest.raises(ValueError, match="does not shard it"):
        es.params.register_parameter_layout(torch.nn.Parameter(torch.zeros(3, 4)), "f/tp c", sizes={"f": 6, "c": 5})
    with pytest.raises(ValueError, match="which no layout has"):
        es.params.register_parameter_layout(torch.nn.Parameter(torch.zeros(3, 4)), "f/tp c", sizes={"q": 6})
    with pytest.raises(TypeError, match="Mapping"):
        es.params.register_parameter_layout(torch.nn.Parameter(torch.zeros(3, 4)), "f/tp c", sizes=[6])
    q = torch.nn.Parameter(torch.zeros(3, 4))
    es.params.register_parameter_layout(q, "f/tp c")  # the sharded axis without a size: nothing recorded
    assert es.params.get_parameter_state(q).global_shape is None
    with pytest.raises(ValueError, match="global_shape"):
        es.params.register_parameter_state(q, replace(es.params.get_parameter_state(q), global_shape=(6, -1)))
    with pytest.raises(ValueError, match="rank"):
        es.params.register_parameter_state(q, replace(es.params.get_parameter_state(q), global_shape=(6,)))


def test_param_specs_carry_the_global_shape():
    lin = torch.nn.Linear(4, 3)
    es.params.register_linear_parameters_(lin, weight_layout="out/tp in", mesh_dim_names=("tp",), sizes={"out": 6})
    specs = es.params.param_specs(lin)
    assert specs == {"weight": "out/tp in", "bias": "out/tp"}
    assert specs["weight"].global_shape == (6, 4) and specs["weight"].param is lin.weight
    again = pickle.loads(pickle.dumps(specs["bias"]))
    assert again == "out/tp" and again.global_shape == (6,) and again.param is None


@pytest.mark.ranks(2)
@pytest.mark.parametrize("body_first", [True, False])
def test_one_backward_from_a_body_and_from_outside_is_refused_by_the_reducer(body_first):
    """A grad=dp parameter that gets gradient from a shard_map body (which sums it) and from a formula
    outside (which leaves it partial) in one backward: summing it again would count the body's part twice."""
    m = es.wrap_mesh(MeshSpec((2,), ("dp",)).build())
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    es.params.register_parameter_layout(w, "c", mesh=m, grad="dp")
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(m.index("dp")))
    body = es.shard_map(lambda w, x: es.einshard("b/dp c, c -> ", x, w), in_specs=("c", "b/dp c"), out_specs="",
                        mesh=m)
    with es.use_mesh(m):
        parts = [lambda: body(w, x), lambda: es.einshard("b/dp c, c -> ", x, w)]
        loss = sum(f() for f in (parts if body_first else parts[::-1]))
    loss.backward()
    with pytest.raises(ValueError, match="shard_map"):
        es.params.reduce_module_grads_(torch.nn.ParameterList([w]), m)
