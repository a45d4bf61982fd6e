"""Parameters stored sharded over data parallelism (``store=``, ZeRO-3): values, gradients and optimizer steps.

Every rank holds its rows of the batch (``b/dp``, and ``n/sp`` on the 3-d mesh) and a ``tp`` block of the
weights; the stored parameters hold a ``1/|dp|`` slice of that block. The losses, the sharded gradients and
the parameters after Adam steps are compared with the same model trained in one process on whole tensors
(float64), on (2, 2), (4,) and (2, 2, 2) meshes, with even and uneven blocks.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

import einshard as es
from probes import OnBackward
from einshard.testing import MeshSpec, local_block, make_mesh

DT = torch.float64
MESHES = [MeshSpec((2, 2), ("dp", "tp")), MeshSpec((4,), ("dp",))]
SIZES = [(4, 6, 8), (5, 7, 8)]  # (C, F, B): even parameter blocks, and uneven ones on every mesh (C=5, F=7)


def _names(mesh):
    t = "/tp" if "tp" in mesh.names else ""
    rows = "b/dp n/sp c" if "sp" in mesh.names else "b/dp n c"
    hidden = rows.replace(" c", f" f{t}")
    return t, rows, hidden


def _whole(C, F_, B):
    g = torch.Generator().manual_seed(3)
    return {
        "ln.weight": 1 + 0.1 * torch.randn(C, generator=g, dtype=DT),
        "ln.bias": 0.1 * torch.randn(C, generator=g, dtype=DT),
        "mlp.w1": torch.randn(F_, C, generator=g, dtype=DT) / C,
        "mlp.b1": 0.1 * torch.randn(F_, generator=g, dtype=DT),
        "mlp.w2": torch.randn(C, F_, generator=g, dtype=DT) / F_,
    }


def _batches(C, B, steps=2):
    g = torch.Generator().manual_seed(4)
    return [torch.randn(B, 2, C, generator=g, dtype=DT) for _ in range(steps)]


def _layouts(mesh):
    t, _, _ = _names(mesh)
    return {"ln.weight": "c", "ln.bias": "c", "mlp.w1": f"f{t} c", "mlp.b1": f"f{t}", "mlp.w2": f"c f{t}"}


class MLP(torch.nn.Module):
    def __init__(self, mesh, blocks):
        super().__init__()
        _, self.rows, self.hidden = _names(mesh)
        self.t = "/tp" if "tp" in mesh.names else ""
        self.w1 = torch.nn.Parameter(blocks["mlp.w1"])
        self.b1 = torch.nn.Parameter(blocks["mlp.b1"])
        self.w2 = torch.nn.Parameter(blocks["mlp.w2"])

    def forward(self, x):
        h = es.einshard(f"{self.rows}, f{self.t} c -> {self.hidden}", x, self.w1) + self.b1
        return es.einshard(f"{self.hidden}, c f{self.t} -> {self.rows}", torch.tanh(h), self.w2)


class Net(torch.nn.Module):
    """A norm (torch ops on stored parameters) and an MLP (formulas on stored parameters)."""

    def __init__(self, mesh, whole):
        super().__init__()
        layouts = _layouts(mesh)
        blocks = {k: local_block(v, layouts[k], mesh).clone() for k, v in whole.items()}
        self.ln = torch.nn.LayerNorm(whole["ln.weight"].shape[0], dtype=whole["ln.weight"].dtype)
        with torch.no_grad():
            self.ln.weight.copy_(blocks["ln.weight"])
            self.ln.bias.copy_(blocks["ln.bias"])
        self.mlp = MLP(mesh, blocks)

    def forward(self, x):
        return self.mlp(self.ln(x))


def _reference(whole, batches, steps):
    """Whole-tensor training in one process: the losses and the parameters after ``steps`` Adam steps."""
    p = {k: v.clone().requires_grad_() for k, v in whole.items()}
    opt = torch.optim.Adam(p.values(), lr=0.05)
    losses, grads = [], None
    for x in batches[:steps]:
        h = F.layer_norm(x, x.shape[-1:], p["ln.weight"], p["ln.bias"])
        y = torch.tanh(h @ p["mlp.w1"].T + p["mlp.b1"]) @ p["mlp.w2"].T
        loss = (y**2).sum()
        loss.backward()
        losses.append(loss.item())
        if grads is None:
            grads = {k: v.grad.clone() for k, v in p.items()}
        opt.step()
        opt.zero_grad()
    return losses, grads, {k: v.detach() for k, v in p.items()}


def _setup(mesh, sizes, dtype=DT, **hooks):
    C, F_, B = sizes
    m = es.wrap_mesh(mesh)
    whole = {k: v.to(dtype) for k, v in _whole(C, F_, B).items()}
    net = Net(m, whole)
    layouts = _layouts(m)
    rows = "dp-sp" if "sp" in m.names else "dp"
    stored = [k for k in layouts if not (k == "mlp.b1" and "tp" in m.names)]  # f/tp: no axis left for dp
    es.params.register_module_parameter_layouts_(
        net, layouts, mesh=m, grad={k: rows if k in stored else f"{rows}:async" for k in layouts},
        store={k: "dp" for k in stored}, sizes={"c": C, "f": F_},
    )
    handle = es.params.register_native_grad_reduction_hooks_(net, m, **hooks)
    return m, whole, net, handle, stored


def _local_loss(net, m, x):
    _, rows, _ = _names(m)
    y = net(es.tree_shard(x, rows, mesh=m))
    return (y**2).sum()


def _total(loss, m):
    t = loss.detach().clone()
    torch.distributed.all_reduce(t)
    return t.item() / (m.size("tp") if "tp" in m.names else 1)


@pytest.mark.ranks(4)
@pytest.mark.parametrize("mesh", MESHES, ids=["2x2", "4"])
@pytest.mark.parametrize("sizes", SIZES, ids=["even", "uneven"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_stored_parameters_train_like_one_process(mesh, sizes, reshard):
    _train_and_compare(mesh, sizes, reshard_after_forward=reshard)


@pytest.mark.ranks(8)
@pytest.mark.parametrize("sizes", SIZES, ids=["even", "uneven"])
def test_stored_parameters_train_like_one_process_3d(mesh_2x2x2, sizes):
    _train_and_compare(mesh_2x2x2, sizes)


def _train_and_compare(mesh, sizes, **hooks):
    m, whole, net, handle, stored = _setup(mesh, sizes, **hooks)
    layouts = _layouts(m)
    specs = es.params.param_specs(net)
    for k in layouts:  # the parameters hold their storage blocks; the specs say so
        want = layouts[k] if k not in stored else es.params.get_parameter_state(net.get_parameter(k)).layout
        assert specs[k] == want
        assert net.get_parameter(k).shape == local_block(whole[k], specs[k], m).shape
    batches = _batches(sizes[0], sizes[2])
    losses, grads, final = _reference(whole, batches, 2)
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    with es.use_mesh(m):
        for step, x in enumerate(batches):
            loss = _local_loss(net, m, x)
            loss.backward()
            handle.wait()
            assert abs(_total(loss, m) - losses[step]) < 1e-9 * max(1.0, abs(losses[step]))
            if step == 0:
                for k in layouts:
                    got = net.get_parameter(k).grad
                    torch.testing.assert_close(got, local_block(grads[k], specs[k], m), rtol=1e-10, atol=1e-12)
            opt.step()
            opt.zero_grad()
    for k in layouts:  # Adam stepped on the shards: the same parameters as whole-tensor training
        torch.testing.assert_close(net.get_parameter(k).detach(), local_block(final[k], specs[k], m),
                                   rtol=1e-9, atol=1e-11)
    handle.remove()


def _alive(refs):
    gc.collect()
    return [r for r in refs if r() is not None]


@pytest.mark.ranks(4)
@pytest.mark.parametrize("mesh", MESHES[:1], ids=["2x2"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_no_gathered_parameter_outlives_its_use(mesh, reshard):
    """Weak references to every gathered block: after forward none is alive (they are gathered again in
    backward) unless kept; after backward none is, either way."""
    m, whole, net, handle, stored = _setup(mesh, SIZES[1], reshard_after_forward=reshard)
    seen, storages = [], []

    def capture(module, args):  # runs after the gather: the module's parameters are the gathered blocks
        for name, p in module.named_parameters(recurse=False):
            if isinstance(p, es.params.GatheredParameter):  # the block, and its memory (views of it keep that alive)
                seen.append((name, weakref.ref(p)))
                storages.append(weakref.ref(p.untyped_storage()))

    for mod in (net.ln, net.mlp):
        mod.register_forward_pre_hook(capture)
    units = es.params.zero.units_of(net.mlp.w1)
    x = _batches(SIZES[1][0], SIZES[1][2])[0]
    with es.use_mesh(m):
        loss = _local_loss(net, m, x)
        assert sorted(n for n, _ in seen) == sorted(k.split(".")[1] for k in stored)
        assert all(isinstance(net.get_parameter(k), torch.nn.Parameter) for k in stored)  # shards back in place
        alive = _alive([r for _, r in seen])
        if reshard:
            assert alive == [] and _alive(storages) == []  # what autograd saved of them refers to the shard
        else:
            assert alive  # kept for backward (what autograd saved: the weights, not the bias)
        loss.backward()
        handle.wait()
    assert _alive([r for _, r in seen]) == [] and _alive(units.live) == [] and _alive(storages) == []
    for k in stored:  # each freed block was gathered again for backward: the gradients are still exact
        assert net.get_parameter(k).grad.shape == net.get_parameter(k).shape
    handle.remove()
    assert es.params.zero.units_of(net.mlp.w1) is None


@pytest.mark.ranks(4)
@pytest.mark.parametrize("mesh", MESHES[:1], ids=["2x2"])
@pytest.mark.parametrize("bucket_bytes", [1, 2**20], ids=["one-each", "one-bucket"])
def test_gathers_and_reduce_scatters_are_counted(mesh, bucket_bytes):
    """count_communication: one all-gather over dp per stored parameter forward, again in backward (freed
    after forward); the reduce-scatters are bucketed (one per bucket) and start during backward, before the
    input's gradient is computed; es.explain of the gather formula shows both moves."""
    m, whole, net, handle, stored = _setup(mesh, SIZES[0], bucket_bytes=bucket_bytes)
    x = _batches(SIZES[0][0], SIZES[0][2])[0]
    units = es.params.zero.units_of(net.mlp.w1)
    box = {"handle": units}
    _, rows, _ = _names(m)
    with es.use_mesh(m):
        with es.count_communication() as stats:
            xs = es.tree_shard(x, rows, mesh=m).requires_grad_()
            # the last step of backward records the scatters still in flight
            marked = OnBackward.apply(xs, lambda: box.update(pending=box["handle"].pending))
            loss = (net(marked) ** 2).sum()
            loss.backward()
            assert units.pending == 0  # every scatter is written into .grad when backward returns
            handle.wait()
    data = stats.data
    fwd, bwd = data.forward.filter(label="dp"), data.backward.filter(label="dp")
    assert fwd.filter(kind="all_gather").calls == len(stored)
    assert bwd.filter(kind="all_gather").calls == len(stored)  # gathered again
    # a module's bucket starts once all its gradients are in: one reduce-scatter per module (or per parameter)
    assert bwd.filter(kind="reduce_scatter").calls == (len(stored) if bucket_bytes == 1 else len(units.modules))
    assert bwd.filter(kind="all_reduce").calls == 1  # the one unstored parameter (b1, f/tp), bucketed
    # started during backward: one bucket per parameter is in flight before the input's gradient exists
    assert box["pending"] >= (len(stored) - 1 if bucket_bytes == 1 else 0)
    state = es.params.get_parameter_state(net.mlp.w1)
    assert es.params.gather_formula(state) == "f/tp c/dp -> f/tp c // dp"
    text = str(es.explain(es.params.gather_formula(state), net.mlp.w1, mesh=m, sizes={"f": SIZES[0][1], "c": SIZES[0][0]}))
    assert "all-gather" in text and "reduce-scatter" in text
    # a formula that uses it: explained as its module runs it, the gather first (rows "operand 1: gather")
    used = es.explain("b/dp n c, f/tp c -> b/dp n f/tp", (4, 2, SIZES[0][0]), net.mlp.w1, mesh=m,
                      sizes={"f": SIZES[0][1]})
    gather = [r for r in used.rows if r.tensor.startswith("operand 1: gather")]
    assert {(r.phase, r.move.split()[0], r.mesh_dims) for r in gather} == {("forward", "all-gather", "dp"),
                                                                            ("backward", "reduce-scatter", "dp")}
    assert "operand 1: gradient left partial over dp" in str(used)
    handle.remove()


@pytest.mark.ranks(4)
@pytest.mark.parametrize("mesh", MESHES[:1], ids=["2x2"])
def test_bad_storage_raises_before_any_collective(mesh):
    m = es.wrap_mesh(mesh)
    C, F_, B = SIZES[1]
    w = lambda *shape: torch.nn.Parameter(torch.zeros(*shape, dtype=DT))  # noqa: E731
    with es.count_communication() as stats:
        with pytest.raises(ValueError, match="splits over \\['tp'\\] already"):  # a dimension the layout uses
            es.params.register_parameter_layout(w(3, 5), "f/tp c", mesh=m, store="tp")
        with pytest.raises(ValueError, match="every axis .* is split already"):
            es.params.register_parameter_layout(w(3), "f/tp", mesh=m, store="dp")
        with pytest.raises(ValueError, match="'f' is not an unsplit axis"):
            es.params.register_parameter_layout(w(3, 5), "f/tp c", mesh=m, store="f/dp")
        with pytest.raises(ValueError, match="ddp backend would sum it a second time"):  # reduce twice
            es.params.register_parameter_layout(w(3, 5), "f/tp c", mesh=m, store="dp", grad="dp:ddp")
        with pytest.raises(ValueError, match="external backend would sum it a second time"):
            es.params.register_parameter_layout(w(3, 5), "f/tp c", mesh=m, store="dp", grad="dp:external")
        with pytest.raises(ValueError, match="name those groups in grad="):
            es.params.register_parameter_layout(w(3, 5), "f/tp c", mesh=m, store="dp", grad="tp")
        with pytest.raises(ValueError, match="needs the mesh"):  # stored without a mesh
            es.params.register_parameter_layout(w(3, 5), "f/tp c", mesh_dim_names=("dp", "tp"), store="dp")
        with pytest.raises(ValueError, match="unevenly over 'dp'"):  # no global shape: blocks unknown
            es.params.register_parameter_layout(w(3, 5), "f/tp c", mesh=m, store="dp")
        q = es.params.register_parameter_layout(w(4, 5), "g c", mesh=m, store="dp")  # the first axis dp divides
        assert es.params.get_parameter_state(q).layout == "g/dp c" and q.shape == (2, 5)
        p = es.params.register_parameter_layout(w(3, 5), "f/tp c", mesh=m, store="dp", sizes={"f": 6})
        assert p.shape == ((3, 3) if m.coordinate[0] == 0 else (3, 2))
        with pytest.raises(ValueError, match="used without its gather"):  # no hooks: the shard itself
            es.einshard("b/dp c, f/tp c -> b/dp f/tp", torch.zeros(2, 5, dtype=DT), p, mesh=m)
        with pytest.raises(ValueError, match="used without its gather"):  # outside a mesh: a local formula
            es.einshard("f c -> c f", p)
        with pytest.raises(ValueError, match="reduce-scatters this gradient"):
            es.params.register_parameter_layout(p, "f/tp c", mesh=m, store="dp", grad="dp:ddp")
        es.params.register_parameter_layout(p, "f/tp c", mesh=m, grad="dp:async")  # the compute layout again: merged
        assert p.shape == ((3, 3) if m.coordinate[0] == 0 else (3, 2))  # not cut twice
        with pytest.raises(ValueError, match="DDP would all-reduce it a second time"):
            es.params.register_grad_reduction_hook_(_Holder(p), m)
    assert stats.data.calls == 0
    hooks = es.params.register_native_grad_reduction_hooks_(torch.nn.ModuleDict({"p": _Holder(p)}), m)
    with pytest.raises(ValueError, match="installed already"):
        es.params.register_native_grad_reduction_hooks_(torch.nn.ModuleDict({"p": _Holder(p)}), m)
    hooks.remove()


class _Holder(torch.nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p


def _shard_map_step(net, m, x, vma):
    _, rows, _ = _names(m)

    @es.shard_map((es.params.param_specs(net), f"{rows.replace('/dp', '').replace('/sp', '')} -> {rows}"), rows, mesh=m,
                  check_vma=vma)
    def forward(params, x):  # the model code runs unchanged on the compute blocks
        return torch.func.functional_call(net, params, (x,))

    return (forward(dict(net.named_parameters()), x) ** 2).sum()


@pytest.mark.ranks(4)
@pytest.mark.parametrize("mesh", MESHES, ids=["2x2", "4"])
@pytest.mark.parametrize("sizes", SIZES, ids=["even", "uneven"])
@pytest.mark.parametrize("vma", [True, False], ids=["vma", "per-rank"])
def test_stored_parameters_in_shard_map_train_like_one_process(mesh, sizes, vma):
    """es.params.param_specs gives the storage specs; shard_map gathers stored parameters on entry. With
    check_vma=True the body's pvary of a gathered block leaves its contribution partial for the gather,
    which reduce-scatters it; a per-rank body leaves them partial too; both reduce-scatter, as the hooks do."""
    _shard_map_train(mesh, sizes, vma)


@pytest.mark.ranks(8)
@pytest.mark.parametrize("sizes", SIZES, ids=["even", "uneven"])
def test_stored_parameters_in_shard_map_3d(mesh_2x2x2, sizes):
    _shard_map_train(mesh_2x2x2, sizes, True)


def _shard_map_train(mesh, sizes, vma):
    m, whole, net, handle, stored = _setup(mesh, sizes)
    handle.remove()  # the shard_map body gathers and sums: no hooks
    layouts, specs = _layouts(m), es.params.param_specs(net)
    batches = _batches(sizes[0], sizes[2])
    losses, grads, final = _reference(whole, batches, 2)
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    for step, x in enumerate(batches):
        with es.count_communication() as stats:
            loss = _shard_map_step(net, m, x, vma)
            loss.backward()
        back = stats.data.backward
        back = back.filter(label="dp") if len(m.names) > 1 else back  # (on (4,): the world, however labelled)
        if not vma:
            es.params.reduce_module_grads_(net, m)  # the unstored parameters' duties (stored ones: reduce-scattered)
            # uneven blocks: summed by an all-reduce, then cut
            assert back.filter(kind="reduce_scatter").calls + back.filter(kind="all_reduce").calls == len(stored)
        else:  # the body's pvary of a gathered block leaves it partial: reduce-scattered, never all-reduced
            assert back.filter(kind="reduce_scatter").calls >= len(stored)
            if "tp" not in m.names:
                assert back.filter(kind="all_reduce").calls == 0
        assert abs(_total(loss, m) - losses[step]) < 1e-9 * max(1.0, abs(losses[step]))
        if step == 0:
            for k in layouts:
                torch.testing.assert_close(net.get_parameter(k).grad, local_block(grads[k], specs[k], m),
                                           rtol=1e-10, atol=1e-12)
        opt.step()
        opt.zero_grad()
    for k in layouts:
        torch.testing.assert_close(net.get_parameter(k).detach(), local_block(final[k], specs[k], m),
                                   rtol=1e-9, atol=1e-11)


def _mixed_reference(whole, x):
    """The same mixed-precision recipe in one process: fp32 masters, bf16 compute, fp32 gradients."""
    p = {k: v.clone().requires_grad_() for k, v in whole.items()}
    q = {k: v.to(torch.bfloat16) for k, v in p.items()}
    h = F.layer_norm(x, x.shape[-1:], q["ln.weight"], q["ln.bias"])
    y = torch.tanh(h @ q["mlp.w1"].T + q["mlp.b1"]) @ q["mlp.w2"].T
    loss = (y.float() ** 2).sum()
    loss.backward()
    return loss.item(), {k: v.grad for k, v in p.items()}


@pytest.mark.ranks(4)
@pytest.mark.parametrize("mesh", MESHES, ids=["2x2", "4"])
def test_mixed_precision_matches_the_same_recipe_in_one_process(mesh):
    """param_dtype=bf16: the modules compute with bf16 blocks (stored ones gathered in bf16, the others
    cast); reduce_dtype=fp32: the stored gradients are reduce-scattered in fp32 (twice the bytes of bf16);
    masters, .grad and Adam states stay fp32. Equal to the one-process recipe to bf16 rounding
    (rtol 2e-2: a few bf16 ulps, the sums run in another order)."""
    sizes = SIZES[1]
    bytes_ = {}
    for reduce_dtype in (torch.float32, None):
        m, whole, net, handle, stored = _setup(mesh, sizes, dtype=torch.float32, param_dtype=torch.bfloat16,
                                               reduce_dtype=reduce_dtype)
        seen = []
        net.mlp.register_forward_pre_hook(lambda mod, args: seen.append(mod.w1.dtype))
        x = _batches(sizes[0], sizes[2])[0].to(torch.bfloat16)
        _, rows, _ = _names(m)
        with es.use_mesh(m), es.count_communication() as stats:
            y = net(es.tree_shard(x, rows, mesh=m))
            loss = (y.float() ** 2).sum()
            loss.backward()
            handle.wait()
        assert seen == [torch.bfloat16] and y.dtype == torch.bfloat16
        bytes_[reduce_dtype] = stats.data.backward.filter(kind="reduce_scatter").sent_bytes
        gathered = stats.data.forward.filter(kind="all_gather")
        assert gathered.calls + stats.data.forward.filter(kind="all_to_all_v").calls >= 1
        want_loss, want = _mixed_reference(whole, x)
        assert abs(_total(loss, m) - want_loss) < 2e-2 * abs(want_loss)
        specs = es.params.param_specs(net)
        for k in want:
            got = net.get_parameter(k).grad
            assert got.dtype == torch.float32
            scale = want[k].abs().max().item()
            torch.testing.assert_close(got, local_block(want[k], specs[k], m), rtol=2e-2, atol=2e-2 * scale)
        opt = torch.optim.Adam(net.parameters(), lr=0.05)
        opt.step()
        assert all(v.dtype == torch.float32 for st in opt.state.values() for v in st.values() if v.dim())
        handle.remove()
    assert bytes_[torch.float32] == 2 * bytes_[None]  # the reduce-scatters ran in fp32, not in bf16


@pytest.mark.ranks(4)
@pytest.mark.parametrize("mesh", MESHES, ids=["2x2", "4"])
def test_gathers_are_prefetched_in_the_recorded_order(mesh):
    """The first step records the modules' order; from the second on, the norm's forward has the MLP's
    gathers in flight before it computes, and backward (following the order the first backward gathered the
    freed blocks again in) has the norm's first saved parameter in flight before the norm's backward runs.
    The values stay those of one process."""
    m, whole, net, handle, stored = _setup(mesh, SIZES[1], bucket_bytes=1)
    units = es.params.zero.units_of(net.mlp.w1)
    box = {"units": units}
    mlp_stored = {id(net.get_parameter(k)) for k in stored if k.startswith("mlp.")}
    net.ln.register_forward_pre_hook(lambda mod, args: box.__setitem__("forward", list(units.in_flight)))
    batches = _batches(SIZES[1][0], SIZES[1][2])
    losses, _, final = _reference(whole, batches, 2)
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    _, rows, _ = _names(m)
    with es.use_mesh(m):
        for step, x in enumerate(batches):
            # between the norm and the MLP: backward reaches it after the MLP's, and records the gathers
            # then in flight (the norm's, issued while the MLP's backward computed)
            h = OnBackward.apply(net.ln(es.tree_shard(x, rows, mesh=m)),
                                 lambda: box.update(backward=list(box["units"].in_flight)))
            y = net.mlp(h)
            loss = (y**2).sum()
            if step == 0:  # recording: nothing issued ahead
                assert box["forward"] == [] and units.order == [units.modules.index(net.ln),
                                                                 units.modules.index(net.mlp)]
            else:  # the MLP's gathers fly while the norm computes
                assert {id(p) for p in box["forward"]} == mlp_stored
            loss.backward()
            if step == 0:
                assert box["backward"] == []
            else:  # the norm's first saved parameter gathered ahead of the norm's backward
                got = {id(p) for p in box["backward"]}
                assert len(got) == 1 and got <= {id(net.ln.weight), id(net.ln.bias)}
            handle.wait()
            assert units.in_flight == []
            assert abs(_total(loss, m) - losses[step]) < 1e-9 * max(1.0, abs(losses[step]))
            opt.step()
            opt.zero_grad()
    specs = es.params.param_specs(net)
    for k in final:
        torch.testing.assert_close(net.get_parameter(k).detach(), local_block(final[k], specs[k], m),
                                   rtol=1e-9, atol=1e-11)
    handle.remove()


@pytest.mark.ranks(4)
@pytest.mark.parametrize("mesh", MESHES, ids=["2x2", "4"])
@pytest.mark.parametrize("mode", ["every", "no_sync"])
def test_micro_batches_accumulate_in_both_modes(mesh, mode):
    """Three micro-batches: reduce-scattered every backward into the sharded .grad (default), or kept
    unreduced under handle.no_sync() and reduce-scattered once by the last backward. Both give the
    gradient of the summed loss."""
    m, whole, net, handle, stored = _setup(mesh, SIZES[1], bucket_bytes=1)
    batches = _batches(SIZES[1][0], SIZES[1][2], steps=3)
    p = {k: v.clone().requires_grad_() for k, v in whole.items()}
    for x in batches:
        h = F.layer_norm(x, x.shape[-1:], p["ln.weight"], p["ln.bias"])
        (torch.tanh(h @ p["mlp.w1"].T + p["mlp.b1"]) @ p["mlp.w2"].T).pow(2).sum().backward()
    with es.use_mesh(m), es.count_communication() as stats:
        for i, x in enumerate(batches):
            last = i == len(batches) - 1
            with handle.no_sync() if mode == "no_sync" and not last else contextlib.nullcontext():
                _local_loss(net, m, x).backward()
        handle.wait()
    scatters = stats.data.backward.filter(kind="reduce_scatter").calls
    assert scatters == len(stored) * (len(batches) if mode == "every" else 1)
    specs = es.params.param_specs(net)
    for k in whole:
        torch.testing.assert_close(net.get_parameter(k).grad, local_block(p[k].grad, specs[k], m),
                                   rtol=1e-10, atol=1e-12)
    handle.remove()


@pytest.mark.ranks(8)
def test_checkpoint_saved_stored_loads_unstored_and_whole(tmp_path):
    """Saved with ZeRO on dp 4 x tp 2 (parameters and Adam states sharded over dp), loaded without ZeRO on
    dp 2 x tp 2 (an extra dimension x replicates it) and whole in one process: exactly the same tensors."""
    src = es.wrap_mesh(make_mesh((4, 2), ("dp", "tp")))
    m, whole, net, handle, stored = _setup(src, SIZES[1])
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    with es.use_mesh(m):
        _local_loss(net, m, _batches(SIZES[1][0], SIZES[1][2])[0]).backward()
    handle.wait()
    opt.step()
    specs = es.params.param_specs(net)
    moments = {k: {s: opt.state[p][s] for s in ("exp_avg", "exp_avg_sq")} for k, p in net.named_parameters()}
    saved = es.tree_gather(net, mesh=m)
    saved_moments = es.tree_gather(moments, {k: {s: specs[k] for s in ("exp_avg", "exp_avg_sq")} for k in specs},
                                   mesh=m)
    path = str(tmp_path / "zero")
    dcp.save({"model": es.params.to_dtensor(net, mesh=m), "adam": es.params.to_dtensor(moments, specs, mesh=m)}, checkpoint_id=path)
    handle.remove()
    other = es.wrap_mesh(make_mesh((2, 2, 2), ("x", "dp", "tp")))  # dp 2 x tp 2, replicated over x
    plain = Net(other, {k: torch.zeros_like(v) for k, v in whole.items()})
    es.params.register_module_parameter_layouts_(plain, _layouts(other), mesh=other)
    pspecs = es.params.param_specs(plain)
    zeros = {k: {s: torch.zeros_like(p) for s in ("exp_avg", "exp_avg_sq")} for k, p in plain.named_parameters()}
    state = {"model": es.params.to_dtensor(plain, mesh=other), "adam": es.params.to_dtensor(zeros, pspecs, mesh=other)}
    dcp.load(state, checkpoint_id=path)
    es.params.load_from_dtensor_(plain, state["model"], mesh=other)
    loaded = es.params.from_dtensor(state["adam"], pspecs, mesh=other)
    for k, layout in _layouts(other).items():
        assert torch.equal(plain.get_parameter(k).detach(), local_block(saved[k], layout, other)), k
        for s in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded[k][s], local_block(saved_moments[k][s], layout, other)), (k, s)
    one = {"model": {k: torch.zeros_like(v) for k, v in whole.items()},
           "adam": {k: {s: torch.zeros_like(v) for s in ("exp_avg", "exp_avg_sq")} for k, v in whole.items()}}
    dcp.load(one, checkpoint_id=path)  # one process's whole tensors
    for k in whole:
        assert torch.equal(one["model"][k], saved[k])
        assert torch.equal(one["adam"][k]["exp_avg"], saved_moments[k]["exp_avg"])
    torch.distributed.barrier()


class _Parent(torch.nn.Module):
    """Uses its child's weight in its own forward (the child's forward never runs)."""

    def __init__(self, w):
        super().__init__()
        self.up = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=DT)
        with torch.no_grad():
            self.up.weight.copy_(w)

    def forward(self, x):
        return es.einshard("b/dp c, f/tp c -> b/dp f/tp", x, self.up.weight)


@pytest.mark.ranks(4)
@pytest.mark.parametrize("mesh", MESHES[:1], ids=["2x2"])
def test_units_gather_a_subtree(mesh):
    """units=[model]: the model's forward gathers the stored parameters of its whole subtree (as fully_shard's
    module does); without it the child's weight is used as its slice and the formula refuses it."""
    m = es.wrap_mesh(mesh)
    g = torch.Generator().manual_seed(5)
    W, X = torch.randn(7, 5, generator=g, dtype=DT), torch.randn(4, 5, generator=g, dtype=DT)
    for units in (None, "model"):
        model = _Parent(local_block(W, "f/tp c", m))
        es.params.register_parameter_layout(model.up.weight, "f/tp c", mesh=m, store="dp", sizes={"f": 7})
        handle = es.params.register_native_grad_reduction_hooks_(model, m, units=None if units is None else [model])
        x = local_block(X, "b/dp c", m)
        with es.use_mesh(m):
            if units is None:
                with pytest.raises(ValueError, match="used without its gather"):
                    model(x)
            else:
                (model(x) ** 2).sum().backward()
                handle.wait()
                w = W.clone().requires_grad_()
                ((X @ w.T) ** 2).sum().backward()
                torch.testing.assert_close(model.up.weight.grad, local_block(w.grad, "f/tp c/dp", m))
        handle.remove()


class _Failing(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(w)

    def forward(self, x):
        assert isinstance(self.w, es.params.GatheredParameter)
        if x.dim() == 2:  # a [param] annotation on the gathered block: refused, naming why
            return es.einshard("b c, f c [param] -> b f", x, self.w)
        raise RuntimeError("the forward fails")


@pytest.mark.ranks(4)
@pytest.mark.parametrize("mesh", MESHES[:1], ids=["2x2"])
def test_a_failing_forward_leaves_the_shards_in_place(mesh):
    """A module's forward that raises: its stored parameters are the shards again, nothing gathered is kept,
    and no saved-tensor hook stays installed; the next forward works."""
    m = es.wrap_mesh(mesh)
    model = _Failing(torch.ones(4, 6, dtype=DT))
    es.params.register_parameter_layout(model.w, "f c", mesh=m, store="dp")
    handle = es.params.register_native_grad_reduction_hooks_(model, m)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="the forward fails"):
            model(torch.ones(1))
        assert type(model.w) is es.params.StoredParameter and model.w.shape == (2, 6)
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        assert _alive(es.params.zero.units_of(model.w).live) == []
    with pytest.raises(ValueError, match="drop the annotation"):
        model(torch.ones(1, 6, dtype=DT))
    assert type(model.w) is es.params.StoredParameter
    handle.remove()


@pytest.mark.ranks(4)
@pytest.mark.parametrize("mesh", MESHES[:1], ids=["2x2"])
@pytest.mark.parametrize("vma", [True, False], ids=["vma", "per-rank"])
def test_shard_map_frees_the_blocks_it_gathered(mesh, vma):
    """The blocks a shard_map body gathered on entry are dead once the call returns (autograd keeps
    references to the shards) and gathered again in backward; the gradients stay exact."""
    m, whole, net, handle, stored = _setup(mesh, SIZES[1])
    handle.remove()
    seen = []

    def capture(module, args):  # functional_call has put the gathered blocks in: the blocks and their memory
        for p in module.parameters(recurse=False):
            if isinstance(p, es.params.GatheredParameter):
                seen.extend((weakref.ref(p), weakref.ref(p.untyped_storage())))

    net.mlp.register_forward_pre_hook(capture)
    net.ln.register_forward_pre_hook(capture)
    x = _batches(SIZES[1][0], SIZES[1][2])[0]
    loss = _shard_map_step(net, m, x, vma)
    assert len(seen) == 2 * len(stored) and _alive(seen) == []
    loss.backward()
    assert _alive(seen) == []
    if not vma:
        es.params.reduce_module_grads_(net, m)
    _, grads, _ = _reference(whole, [x], 1)
    specs = es.params.param_specs(net)
    for k in whole:
        torch.testing.assert_close(net.get_parameter(k).grad, local_block(grads[k], specs[k], m), rtol=1e-10,
                                   atol=1e-12)


@pytest.mark.ranks(4)
@pytest.mark.parametrize("mesh", MESHES[:1], ids=["2x2"])
def test_shard_map_autograd_grad_returns_the_shards_gradients(mesh):
    """torch.autograd.grad through a check_vma body: the stored parameters' gradients come back as their
    shards' (reduce-scattered at once, not deferred), equal to what backward writes into .grad."""
    m, whole, net, handle, stored = _setup(mesh, SIZES[1])
    handle.remove()
    x = _batches(SIZES[1][0], SIZES[1][2])[0]
    params = [net.get_parameter(k) for k in stored]
    got = torch.autograd.grad(_shard_map_step(net, m, x, True), params)
    assert all(p.grad is None for p in params)
    _shard_map_step(net, m, x, True).backward()
    for p, g in zip(params, got):
        torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-14)
