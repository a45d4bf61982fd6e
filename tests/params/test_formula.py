"""Who reduces a gradient: the formula (no duty) or the duty's executor (gradient left partial), exactly once."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import einshard as es
from einshard.params import ParameterState, get_parameter_state, register_parameter_state
from einshard.params.buckets import GradBucketer
from einshard.testing import local_block, run_on_ranks

DT = torch.float64
B, C, H = 5, 3, 7  # uneven over 2, 4 and 8 ranks


def _whole(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, C, generator=g, dtype=DT), torch.randn(C, H, generator=g, dtype=DT)


def _reference(formula_x, formula_w, formula_y, mesh):
    """Single-process gradient of sum(y^2), y = x @ w, as this rank's block of w."""
    x, w = _whole()
    w = w.clone().requires_grad_(True)
    (x @ w).pow(2).sum().backward()
    return local_block(w.grad, formula_w, mesh)


def _step(mesh, fx, fw, fy, grad=None, reducer=None):
    x, w_whole = _whole()
    w = torch.nn.Parameter(local_block(w_whole, fw, mesh).clone())
    if grad is not None:
        register_parameter_state(w, ParameterState.from_layout(fw, mesh=mesh, grad=grad))
    bucketer = None
    if reducer == "bucketer":
        state = get_parameter_state(w)
        bucketer = GradBucketer([(w, state.reduce)], mesh, bucket_bytes=1)
    y = es.einshard(f"{fx}, {fw} -> {fy}", local_block(x, fx, mesh), w, mesh=mesh, sizes={"b": B, "h": H})
    y.pow(2).sum().backward()
    if bucketer is not None:
        bucketer.remove()
    return w


CASES = {
    # mesh: (x layout, w layout, y layout, a duty over the dimensions w is replicated on)
    "8": ("b/tp c", "c h", "b/tp h", "tp"),
    "2x4": ("b/dp c", "c h/tp", "b/dp h/tp", "dp"),
    "2x2x2": ("b/dp-sp c", "c h/tp", "b/dp-sp h/tp", "dp-sp"),
}


@pytest.mark.ranks(8)
def test_each_gradient_is_reduced_exactly_once(mesh):
    mesh = es.wrap_mesh(mesh)
    key = {1: "8", 2: "2x4", 3: "2x2x2"}[len(mesh.names)]
    fx, fw, fy, group = CASES[key]
    ref = _reference(fx, fw, fy, mesh)
    # no duty: the formula's backward reduces
    w = _step(mesh, fx, fw, fy)
    torch.testing.assert_close(w.grad, ref, rtol=1e-12, atol=1e-12)
    # a duty: left partial by the formula, summed by the bucketed async hooks, once
    w = _step(mesh, fx, fw, fy, grad=f"{group}:async", reducer="bucketer")
    torch.testing.assert_close(w.grad, ref, rtol=1e-12, atol=1e-12)
    # an external duty: the formula leaves it partial; summing it by hand gives the gradient
    w = _step(mesh, fx, fw, fy, grad=f"{group}:external")
    partial = w.grad.clone()
    dist.all_reduce(w.grad, group=mesh.group(mesh.dims(group)))
    torch.testing.assert_close(w.grad, ref, rtol=1e-12, atol=1e-12)
    whole = torch.tensor([float(torch.allclose(partial, ref))])
    dist.all_reduce(whole, op=dist.ReduceOp.MIN)
    assert whole.item() == 0.0  # it really was partial: some rank lacked the whole gradient
    # a pending duty (attached): the plan resolves it to the dimensions it left partial
    w = _step(mesh, fx, fw, fy, grad="async")
    state = get_parameter_state(w)
    assert not state.grad_comm.pending_inference
    assert set(state.grad_comm.mesh_dims) == set(mesh.dims(group))
    dist.all_reduce(w.grad, group=mesh.group(mesh.dims(group)))
    torch.testing.assert_close(w.grad, ref, rtol=1e-12, atol=1e-12)
    dist.barrier()


@pytest.mark.ranks(8)
def test_duty_over_a_dimension_the_operand_does_not_vary_on(mesh_2x2x2):
    """w is replicated over sp and the data is not split over sp: its gradient is kept on sp rank 0 only."""
    mesh = es.wrap_mesh(mesh_2x2x2)
    fx, fw, fy = "b/dp c", "c h/tp", "b/dp h/tp"
    ref = _reference(fx, fw, fy, mesh)
    w = _step(mesh, fx, fw, fy, grad="dp-sp", reducer="bucketer")
    torch.testing.assert_close(w.grad, ref, rtol=1e-12, atol=1e-12)
    dist.barrier()


def test_explain_shows_the_partial_gradient():
    mesh = es.Mesh.virtual((2, 4), ("dp", "tp"))
    plain = es.explain("b/dp c, c h/tp -> b/dp h/tp", (3, 3), (3, 2), mesh=mesh)
    assert [(r.tensor, r.mesh_dims) for r in plain.rows if r.phase == "backward"] == [("operand 0", "tp"), ("operand 1", "dp")]
    w = torch.nn.Parameter(torch.zeros(3, 2))
    register_parameter_state(w, ParameterState.from_layout("c h/tp", mesh=mesh, grad="dp"))
    duty = es.explain("b/dp c, c h/tp -> b/dp h/tp", (3, 3), w, mesh=mesh)
    assert [(r.tensor, r.mesh_dims) for r in duty.rows if r.phase == "backward"] == [("operand 0", "tp")]
    assert duty.grad_partials == ((1, "dp"),)
    assert "operand 1: gradient left partial over dp" in str(duty)
    assert duty.backward_bytes < plain.backward_bytes  # priced that way
    local = es.explain("c, c h -> h", (3,), w)  # every rank computes the same value: kept on dp rank 0
    assert local.grad_partials == ((1, "dp"),)
    assert "operand 1: gradient kept on group rank 0 of dp, zeros elsewhere" in str(local)


class _Holder(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = w


@pytest.mark.ranks(8)
def test_annotations_record_after_success_and_hooks_reduce_once(mesh):
    mesh = es.wrap_mesh(mesh)
    key = {1: "8", 2: "2x4", 3: "2x2x2"}[len(mesh.names)]
    fx, fw, fy, group = CASES[key]
    ref = _reference(fx, fw, fy, mesh)
    x, w_whole = _whole()
    xl = local_block(x, fx, mesh)
    for grad in (f"{group}:async", group, "async"):
        w = torch.nn.Parameter(local_block(w_whole, fw, mesh).clone())
        formula = f"{fx}, {fw} [param, grad={grad}] -> {fy}"
        y = es.einshard(formula, xl, w, mesh=mesh, sizes={"b": B, "h": H})
        state = get_parameter_state(w)
        assert state.source == "formula" and state.layout == fw
        assert set(state.reduce) == {group} or set(state.reduce) == set(mesh.dims(group))
        assert state.grad_comm.schedule == ("async" if "async" in grad else "backend_default")
        handle = es.params.register_native_grad_reduction_hooks_(_Holder(w), mesh)
        y.pow(2).sum().backward()
        handle.wait().remove()
        torch.testing.assert_close(w.grad, ref, rtol=1e-12, atol=1e-12)
        # steady state: the same call again records nothing new
        es.einshard(formula, xl, w, mesh=mesh, sizes={"b": B, "h": H})
        assert get_parameter_state(w) is state
    dist.barrier()


@pytest.mark.ranks(8)
def test_pending_duty_resolved_by_the_planner(mesh_2x4):
    """c is sharded and shared by two inputs: not rank-local, so the planner decides (w varies over dp)."""
    mesh = es.wrap_mesh(mesh_2x4)
    fx, fw, fy = "b/dp c/tp", "c/tp h", "b/dp h"
    ref = _reference(fx, fw, fy, mesh)
    x, w_whole = _whole()
    w = torch.nn.Parameter(local_block(w_whole, fw, mesh).clone())
    plain = es.explain(f"{fx}, {fw} -> {fy}", local_block(x, fx, mesh), w, mesh=mesh)
    y = es.einshard(f"{fx}, {fw} [param] -> {fy}", local_block(x, fx, mesh), w, mesh=mesh, sizes={"b": B, "c": C})
    state = get_parameter_state(w)
    assert state.grad_comm.mesh_dims == ("dp",) and state.grad_comm.backend == "native"
    y.pow(2).sum().backward()
    es.params.reduce_grad_(w, state, mesh)
    torch.testing.assert_close(w.grad, ref, rtol=1e-12, atol=1e-12)
    duty = es.explain(f"{fx}, {fw} -> {fy}", local_block(x, fx, mesh), w, mesh=mesh)
    assert duty.grad_partials == ((1, "dp"),) and duty.collectives < plain.collectives
    dist.barrier()


@pytest.mark.ranks(8)
def test_a_failed_call_attaches_nothing_and_communicates_nothing(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    x = torch.ones(2, 3, dtype=DT)
    w = torch.nn.Parameter(torch.ones(3, 2, dtype=DT))
    bad = [
        ("b/dp c, c h/tp [param] -> b/dp h/tp", (x, torch.ones(3, 2, dtype=DT)), TypeError, "torch.nn.Parameter"),
        ("b/dp c, c h/tp [param, grad=tp] -> b/dp h/tp", (x, w), ValueError, "overlaps"),
        ("b/dp c, c h/tp [param, grad=xx] -> b/dp h/tp", (x, w), ValueError, "unknown mesh dimensions"),
        ("b/dp c, c h/tp d [param] -> b/dp h/tp", (x, w), ValueError, "rank"),
        ("b/dp c, c h/tp [param] -> b/dp h/tp", (x.float(), w), ValueError, "dtypes"),  # fails after the metadata
    ]
    for formula, operands, kind, words in bad:
        with es.count_communication() as stats:
            with pytest.raises(kind, match=words):
                es.einshard(formula, *operands, mesh=mesh)
        assert get_parameter_state(w) is None, formula
        if words != "dtypes":  # metadata errors; a formula error may be agreed among the ranks when checks are on
            assert stats.calls == 0, formula
    dist.barrier()


@pytest.mark.ranks(8)
def test_inside_shard_map_the_duty_is_satisfied_by_vma(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    fx, fw, fy = "b/dp c", "c h", "b/dp h"
    ref = _reference(fx, fw, fy, mesh)
    x, w_whole = _whole()
    w = torch.nn.Parameter(w_whole.clone())

    @es.shard_map((fx, fw), fy, mesh=mesh, check_vma=True, sizes={"b": B})
    def body(xb, wb):
        return es.einshard(f"{fx}, {fw} [param, grad=dp] -> {fy}", xb, wb, sizes={"b": B})

    body(local_block(x, fx, mesh), w).pow(2).sum().backward()
    state = get_parameter_state(w)
    assert state.grad_comm.backend == "vma" and state.reduce == ("dp",)
    es.params.reduce_module_grads_(_Holder(w), mesh)  # skipped: already reduced in the body
    torch.testing.assert_close(w.grad, ref, rtol=1e-12, atol=1e-12)
    dist.barrier()


def test_grad_values_with_a_suffix_parse_in_formulas():
    parsed = es.parse_sharding("x, w [param, grad=dp-sp:async] -> x")
    assert [str(a) for a in parsed.inputs[1].annotations] == ["param", "grad=dp-sp:async"]
    assert ParameterState.from_spec(parsed.inputs[1]).grad_comm.schedule == "async"
    with pytest.raises(ValueError, match="Invalid einshard expression"):
        es.parse_sharding("x, w [param, grad=dp:] -> x")


def test_local_formulas_record_by_rank_local_inference():
    w = torch.nn.Parameter(torch.ones(3, 2))
    x = torch.ones(4, 3)
    with es.use_mesh(es.Mesh.virtual((2,), ("dp",))):
        es.einshard("b c, c h [param, grad=dp:async] -> b h", x, w)
        assert get_parameter_state(w).grad_comm.mesh_dims == ("dp",)
        v = torch.nn.Parameter(torch.ones(3, 2))
        es.einshard("b c, c h [param, grad=dp:async] -> b h", x, v)  # the cached local plan records too
        assert get_parameter_state(v).grad_comm.schedule == "async"
        u = torch.nn.Parameter(torch.ones(3, 2))
        es.einshard("b c, c h [param] -> b h", x, u)  # nothing shards: no duty
        assert get_parameter_state(u).grad_comm.mode == "none"


# -- a local formula: every rank computes the same value, so a duty's sum must count it once -----------------

LOCAL_USE_MESHES = {  # kind -> (rank tensor, names, the duty's group and the rows' split)
    "2": ([0, 1], ("dp",), "dp"),
    "2-perm": ([1, 0], ("dp",), "dp"),
    "2x2": ([[0, 1], [2, 3]], ("dp", "tp"), "dp"),
    "cols-compound": ([[0, 2], [1, 3]], ("dp", "tp"), "dp-tp"),
}


def _local_use_reference():
    x, _ = _whole(3)
    g = (1 + 0.1 * torch.arange(C, dtype=DT)).requires_grad_(True)
    k = torch.linspace(-1, 1, C, dtype=DT)
    (((x * g) ** 2).sum() + 0.5 * (g @ g) + g @ k).backward()
    return x, g.detach(), k, g.grad


def local_use_case(kind, schedule, annotated):
    """The loss ``sum((x * g) ** 2)`` over rows split by the duty's group (a torch op: each rank's share),
    plus ``0.5 * g . g`` and ``g . k`` as local formulas on the replicated ``g`` (every rank computes them
    alike), summed by the hooks (registered duty) or ``reduce_module_grads_`` (a ``[param, grad=G]``
    annotation): ``g``'s gradient equals the one-process one on every rank."""
    ranks, names, group = LOCAL_USE_MESHES[kind]
    mesh = es.wrap_mesh(DeviceMesh("cpu", torch.tensor(ranks), mesh_dim_names=names))
    x, g_whole, k, want = _local_use_reference()
    holder = torch.nn.Module()
    holder.g = g = torch.nn.Parameter(g_whole.clone())
    duty = group + (f":{schedule}" if schedule else "")
    handle = None
    if not annotated:
        es.params.register_parameter_layout(g, "c", mesh=mesh, grad=duty)
        handle = es.params.register_native_grad_reduction_hooks_(holder, mesh)
    xb = local_block(x, f"b/{group} c", mesh)
    spec = f"c [param, grad={duty}]" if annotated else "c"
    with es.use_mesh(mesh):
        for step in range(2):  # the second call replays the cached plan
            data = es.einshard(f"b/{group} c -> ", (xb * g) ** 2, sizes={"b": B})
            loss = data + 0.5 * es.einshard(f"{spec}, c -> ", g, g) + es.einshard(f"{spec}, c -> ", g, k)
            loss.backward()
            if handle is not None:
                handle.wait()
            else:
                es.params.reduce_module_grads_(holder, mesh)
            torch.testing.assert_close(g.grad, want, rtol=1e-12, atol=1e-12, msg=f"step {step}")
            g.grad = None
    if handle is not None:
        handle.remove()
    dist.barrier()


@pytest.mark.parametrize("kind", list(LOCAL_USE_MESHES))
@pytest.mark.parametrize("schedule, annotated", [("", False), ("async", False), ("", True)],
                         ids=["hooks-sync", "hooks-async", "annotated"])
def test_a_local_formula_on_a_replicated_parameter_counts_its_gradient_once(kind, schedule, annotated):
    """A duty over groups where a local formula's operand does not vary: kept on group rank 0 (the
    parameters guide), not summed once per rank."""
    run_on_ranks(len(torch.tensor(LOCAL_USE_MESHES[kind][0]).flatten()), local_use_case, kind, schedule, annotated)


def test_a_local_formula_needs_a_mesh_for_a_duty_that_needs_a_gradient():
    g = torch.nn.Parameter(torch.ones(3, dtype=DT))
    es.params.register_parameter_layout(g, "c", grad="dp")
    with torch.no_grad():  # no gradient: nothing to keep
        assert es.einshard("c, c ->", g, g).item() == 3
    with pytest.raises(es.EinshardError, match=r"operand 0 has a gradient duty over \['dp'\].*use_mesh"):
        es.einshard("c, c ->", g, g)
    with es.use_mesh(es.Mesh.virtual((2,), ("tp",))):
        with pytest.raises(es.EinshardError, match="'c, c ->': operand 0 has a gradient duty over 'dp'"):
            es.einshard("c, c ->", g, g)


def annotated_once_case(perm):
    mesh = es.wrap_mesh(DeviceMesh("cpu", torch.tensor([1, 0] if perm else [0, 1]), mesh_dim_names=("dp",)))
    x, g_whole, _, _ = _local_use_reference()
    gw = g_whole.clone().requires_grad_(True)
    (((x * gw * gw).sum(1)) ** 2).sum().backward()
    holder = torch.nn.Module()
    holder.g = g = torch.nn.Parameter(g_whole.clone())
    y = es.einshard("b/dp c, c [param, grad=dp], c -> b/dp", local_block(x, "b/dp c", mesh), g, g, mesh=mesh,
                    sizes={"b": B})
    (y**2).sum().backward()
    es.params.reduce_module_grads_(holder, mesh)
    torch.testing.assert_close(g.grad, gw.grad, rtol=1e-12, atol=1e-12)
    dist.barrier()


@pytest.mark.parametrize("perm", [False, True], ids=["2", "2-perm"])
def test_a_parameter_annotated_in_one_operand_has_its_duty_in_every_operand(perm):
    """``c [param, grad=dp], c`` given one Parameter twice: on the first call (nothing attached yet) both
    operands leave its gradient partial for the duty, so it is summed once."""
    run_on_ranks(2, annotated_once_case, perm)
