"""Parameters stored sharded (``store=``, ZeRO-3) under the events of real training loops.

Each test is one event a loop produces between or around steps — an in-place change between forward and
backward, a weight reload after a partial forward, a stored parameter read outside its unit, a compiled
``shard_map`` body, ``torch.func.functional_call`` — and compares the sharded model with the same
computation on whole tensors in one process (float64): equal values and gradients, or a clear refusal
where one process refuses (or where einshard cannot be exact). 2 ranks (uneven slices), and a 2 x 2 mesh
where cheap.
"""

from __future__ import annotations

import pytest
import torch

import einshard as es
from einshard.testing import MeshSpec, local_block

DT = torch.float64
C, F = 5, 3  # uneven over dp=2: 3 + 2 and 2 + 1
MESHES = [MeshSpec((2,), ("dp",)), MeshSpec((2, 2), ("dp", "tp"))]


def _whole(seed):
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(F, C, generator=g, dtype=DT) / C,
            "b.weight": torch.randn(C, F, generator=g, dtype=DT) / F,
            "x": torch.randn(4, C, generator=g, dtype=DT)}


class Lin(torch.nn.Module):
    """torch ops on this rank's rows (the gather's duty over dp sums the weight's gradient)."""

    def __init__(self, w):
        super().__init__()
        self.weight = torch.nn.Parameter(w.clone())

    def forward(self, x):
        return torch.tanh(x @ self.weight.T)


class Two(torch.nn.Module):
    def __init__(self, whole):
        super().__init__()
        self.a, self.b = Lin(whole["a.weight"]), Lin(whole["b.weight"])

    def forward(self, x):
        return self.b(self.a(x))


def _reference(whole):
    """One process, whole tensors: the output and the weights' gradients of ``(y ** 2).sum()``."""
    w = {k: whole[k].clone().requires_grad_() for k in ("a.weight", "b.weight")}
    y = torch.tanh(torch.tanh(whole["x"] @ w["a.weight"].T) @ w["b.weight"].T)
    (y**2).sum().backward()
    return y.detach(), {k: v.grad for k, v in w.items()}


def _stored(mesh, whole, **hooks):
    m = es.wrap_mesh(mesh.build() if isinstance(mesh, MeshSpec) else mesh)
    model = Two(whole)
    es.params.register_module_parameter_layouts_(model, {"a.weight": "f c", "b.weight": "c f"}, mesh=m, grad="dp",
                                          store="dp", sizes={"c": C, "f": F})
    return m, model, es.params.register_native_grad_reduction_hooks_(model, m, **hooks)


def _shard_map_model(mesh, whole, vma):
    """The model stored over dp, without hooks, and a ``shard_map`` body that runs it on this rank's rows (the
    body gathers the stored parameters on entry)."""
    m, model, handle = _stored(mesh, whole)
    handle.remove()

    @es.shard_map((es.params.param_specs(model), "b/dp c"), "b/dp c", mesh=m, check_vma=vma)
    def body(params, x):
        return torch.func.functional_call(model, params, (x,))

    return m, model, body


def _layout(p):
    return es.params.get_parameter_state(p).layout


def _assert_step(m, y, grads, want_y, want_grads):
    """``y`` (this rank's rows) and ``grads`` (name -> this rank's storage-block gradient) are this rank's
    blocks of the one-process output and gradients."""
    torch.testing.assert_close(y, local_block(want_y, "b/dp c", m), rtol=1e-12, atol=1e-13)
    for k, (g, layout) in grads.items():
        torch.testing.assert_close(g, local_block(want_grads[k], layout, m), rtol=1e-12, atol=1e-13)


def _step(m, model, handle, x):
    y = model(x)
    (y**2).sum().backward()
    handle.wait()
    return y.detach()


# -- 4: a stored weight changed in place between forward and backward --------------------------------------


@pytest.mark.ranks(2)
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_in_place_change_between_forward_and_backward_is_refused(reshard):
    """One process: autograd refuses a saved weight modified in place. Stored: the shard's version when its
    block was saved is checked before the block is gathered again (or used, when kept): the same refusal,
    naming the parameter, on every rank, instead of the gradients of other values."""
    whole = _whole(1)
    w = {k: whole[k].clone().requires_grad_() for k in ("a.weight", "b.weight")}
    loss = (torch.tanh(torch.tanh(whole["x"] @ w["a.weight"].T) @ w["b.weight"].T) ** 2).sum()
    with torch.no_grad():
        w["b.weight"].mul_(2)  # saved (for the gradient of the hidden rows)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()

    m, model, handle = _stored(MeshSpec((2,), ("dp",)), whole, reshard_after_forward=reshard)
    x = local_block(whole["x"], "b/dp c", m)
    loss = (model(x) ** 2).sum()
    with torch.no_grad():
        model.b.weight.mul_(2)
    with pytest.raises(es.EinshardError, match=r"stored parameter 'b.weight' was modified by an inplace operation"):
        loss.backward()
    handle.remove()


@pytest.mark.ranks(2)
def test_in_place_change_after_a_shard_map_forward_is_refused():
    """The same in a shard_map body, which gathers on entry and gathers again in backward."""
    whole = _whole(1)
    m, model, body = _shard_map_model(MESHES[0], whole, False)

    loss = (body(dict(model.named_parameters()), local_block(whole["x"], "b/dp c", m)) ** 2).sum()
    with torch.no_grad():
        model.b.weight.mul_(2)
    with pytest.raises(es.EinshardError, match=r"a stored parameter \(layout 'c/dp f', storage block of shape "
                                               r"\(\d, 3\)\) was modified by an inplace operation"):
        loss.backward()


# -- 5: a partial forward, a reload, a step: the prefetched gather of the old weights --------------------------


@pytest.mark.ranks(2)
@pytest.mark.parametrize("reload", ["load_state_dict", "data"])
def test_a_reload_after_a_partial_forward_drops_the_prefetched_gather(reload):
    """After the first step the forward of ``a`` prefetches ``b``'s gather. An evaluation of ``a`` alone
    (no_grad) leaves that gather issued; a reload of the weights (copy_ into the shards: new versions; or
    ``.data =``: new memory) then makes it stale, and the next step must gather the new values."""
    _reload_after_partial_forward(MESHES[0], reload)


@pytest.mark.ranks(4)
def test_a_reload_after_a_partial_forward_drops_the_prefetched_gather_2x2():
    _reload_after_partial_forward(MESHES[1], "load_state_dict")


def _reload_after_partial_forward(mesh, reload):
    old, new = _whole(1), _whole(2)
    m, model, handle = _stored(mesh, old)
    x = local_block(old["x"], "b/dp c", m)
    _step(m, model, handle, x)  # records the order: a's forward prefetches b's gathers from now on
    model.zero_grad()
    with torch.no_grad():
        model.a(x)  # a partial evaluation: b's gather is in flight
    assert es.params.zero.units_of(model.b.weight)._ahead  # issued, not used
    blocks = {k: local_block(new[k], _layout(p), m) for k, p in model.named_parameters()}
    if reload == "load_state_dict":
        model.load_state_dict(blocks)
    else:
        for k, p in model.named_parameters():
            p.data = blocks[k].clone()
    x = local_block(new["x"], "b/dp c", m)
    y = _step(m, model, handle, x)
    want_y, want_grads = _reference(new)
    _assert_step(m, y, {k: (p.grad, _layout(p)) for k, p in model.named_parameters()}, want_y, want_grads)
    handle.remove()


# -- 9: torch.func.functional_call with the hooks installed --------------------------------------------------


@pytest.mark.ranks(2)
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_functional_call_substitutes_the_passed_storage_blocks(reshard):
    _functional_call(MESHES[0], reshard_after_forward=reshard)


@pytest.mark.ranks(4)
def test_functional_call_substitutes_the_passed_storage_blocks_2x2():
    _functional_call(MESHES[1])


def _functional_call(mesh, **hooks):
    """The tensors passed to functional_call (this rank's storage blocks, as named_parameters() holds them)
    are gathered and used, their gradients reduce-scattered into them; the registered shards are untouched.
    A tensor of another shape (the whole weight, a compute block) is refused before any collective."""
    old, new = _whole(1), _whole(2)
    m, model, handle = _stored(mesh, old, **hooks)
    for _ in range(2):  # the second time, after the order is recorded: the prefetched gathers are not used
        passed = {k: local_block(new[k], _layout(p), m).requires_grad_() for k, p in model.named_parameters()}
        y = torch.func.functional_call(model, passed, (local_block(new["x"], "b/dp c", m),))
        (y**2).sum().backward()
        handle.wait()
        want_y, want_grads = _reference(new)
        _assert_step(m, y.detach(), {k: (t.grad, _layout(model.get_parameter(k))) for k, t in passed.items()},
                     want_y, want_grads)
        assert all(p.grad is None for p in model.parameters())
        assert all(type(p) is not torch.Tensor for p in model.parameters())  # the shards are back
        assert all(type(t) is torch.Tensor and not vars(t) for t in passed.values())  # left as they were
    y = _step(m, model, handle, local_block(old["x"], "b/dp c", m))  # the registered shards: still exact
    want_y, want_grads = _reference(old)
    _assert_step(m, y, {k: (p.grad, _layout(p)) for k, p in model.named_parameters()}, want_y, want_grads)
    with pytest.raises(es.EinshardError, match=r"stored parameter 'a.weight' holds a tensor of shape \(3, 5\)"):
        torch.func.functional_call(model, {"a.weight": old["a.weight"]}, (local_block(old["x"], "b/dp c", m),))
    assert model.a.weight.shape != old["a.weight"].shape  # the shard is back after the refusal
    handle.remove()


# -- 7: a compiled shard_map body with a stored parameter ---------------------------------------------------


def _chain(err):
    """The messages of an exception and of its causes (torch.compile wraps what the traced code raised)."""
    out = []
    while err is not None:
        out.append(str(err))
        err = err.__cause__ or err.__context__
    return "\n".join(out)


@pytest.mark.ranks(2)
@pytest.mark.parametrize("vma", [False, True], ids=["per-rank", "vma"])
def test_a_compiled_shard_map_with_a_stored_parameter_runs_it_eagerly(vma):
    """Eagerly the body gets the compute block, gathered on entry. Under torch.compile that gather (an eager
    collective in an autograd function) is not traced: a call with a stored parameter argument runs eagerly
    (a graph break), exact in values and gradients; with fullgraph=True it is refused, naming the argument —
    never a compiled body computing with the storage slice."""
    whole = _whole(1)
    m, model, body = _shard_map_model(MESHES[0], whole, vma)

    x = local_block(whole["x"], "b/dp c", m)
    want_y, want_grads = _reference(whole)
    torch._dynamo.reset()
    with pytest.raises(Exception) as err:
        torch.compile(body, backend="eager", fullgraph=True)(dict(model.named_parameters()), x)
    assert "es.shard_map: argument args[0]['a.weight'] is a parameter stored sharded over 'dp'" in _chain(err.value)
    torch._dynamo.reset()
    y = torch.compile(body, backend="eager")(dict(model.named_parameters()), x)
    (y**2).sum().backward()
    _assert_step(m, y.detach(), {k: (p.grad, _layout(p)) for k, p in model.named_parameters()}, want_y, want_grads)


# -- 6: a stored parameter read by plain torch ops outside its unit's forward -------------------------------


class TiedHead(Two):
    """An output head tied to ``a.weight``, read in the parent's forward (``a``'s forward has ended)."""

    def forward(self, x):
        return self.b(self.a(x)) @ self.a.weight.T


@pytest.mark.ranks(2)
def test_a_stored_parameter_read_outside_its_unit_is_refused_or_gathered_by_units():
    """Without units= the head reads ``a.weight`` as its storage block (a slice of its rows): the matmul
    refuses, naming the op and the layouts, on every rank, instead of computing with the slice. With
    units=[model] the model's forward gathers it: exact values and gradients. Ops on the storage block
    itself (an optimizer step, a reload, its gradient) stay plain."""
    whole = _whole(1)
    w = {k: whole[k].clone().requires_grad_() for k in ("a.weight", "b.weight")}
    y = torch.tanh(torch.tanh(whole["x"] @ w["a.weight"].T) @ w["b.weight"].T) @ w["a.weight"].T
    (y**2).sum().backward()
    m = es.wrap_mesh(MESHES[0].build())
    x = local_block(whole["x"], "b/dp c", m)
    for units in (None, "model"):
        model = TiedHead(whole)
        es.params.register_module_parameter_layouts_(model, {"a.weight": "f c", "b.weight": "c f"}, mesh=m, grad="dp",
                                              store="dp", sizes={"c": C, "f": F})
        handle = es.params.register_native_grad_reduction_hooks_(model, m, units=None if units is None else [model])
        if units is None:
            with pytest.raises(es.EinshardError, match=r"torch op 'matmul' combines a parameter stored sharded "
                                                       r"over 'dp' \(store=, layout 'f/dp c', storage block of shape"):
                model(x)
            assert type(model.a.weight) is es.params.StoredParameter  # the shards are back
        else:
            got = model(x)
            (got**2).sum().backward()
            handle.wait()
            torch.testing.assert_close(got.detach(), local_block(y.detach(), "b/dp f", m), rtol=1e-12, atol=1e-13)
            for k, p in model.named_parameters():
                torch.testing.assert_close(p.grad, local_block(w[k].grad, _layout(p), m), rtol=1e-12, atol=1e-13)
            opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
            opt.step()  # in place on the shards, with their gradients and states: plain
            model.load_state_dict({k: p.detach() * 2 for k, p in model.named_parameters()})
        handle.remove()


class ScaledParent(torch.nn.Module):
    """Reads its child's scale vector in its own forward (the child's forward never runs)."""

    def __init__(self, scale):
        super().__init__()
        self.child = torch.nn.Module()
        self.child.scale = torch.nn.Parameter(scale.clone())

    def forward(self, x):
        return x * self.child.scale


@pytest.mark.ranks(2)
def test_a_parent_reading_a_childs_stored_scale_is_refused_or_gathered_by_units():
    """A scale of 2 entries stored over dp=2 holds 1 entry per rank, which broadcasts against any rows: the
    product refuses instead of scaling every column by this rank's entry. With units=[model]: exact."""
    g = torch.Generator().manual_seed(7)
    scale, X = torch.randn(2, generator=g, dtype=DT), torch.randn(4, 2, generator=g, dtype=DT)
    s = scale.clone().requires_grad_()
    y = X * s
    (y**2).sum().backward()
    m = es.wrap_mesh(MESHES[0].build())
    x = local_block(X, "b/dp c", m)
    for units in (None, "model"):
        model = ScaledParent(scale)
        es.params.register_parameter_layout(model.child.scale, "c", mesh=m, grad="dp", store="dp")
        handle = es.params.register_native_grad_reduction_hooks_(model, m, units=None if units is None else [model])
        if units is None:
            with pytest.raises(es.EinshardError, match=r"torch op 'mul' combines a parameter stored sharded over "
                                                       r"'dp' \(store=, layout 'c/dp', storage block of shape \(1,\)\) "
                                                       r"with a tensor of shape \(2, 2\)"):
                model(x)
        else:
            got = model(x)
            (got**2).sum().backward()
            handle.wait()
            torch.testing.assert_close(got.detach(), local_block(y.detach(), "b/dp c", m), rtol=1e-12, atol=1e-13)
            torch.testing.assert_close(model.child.scale.grad, local_block(s.grad, "c/dp", m), rtol=1e-12,
                                       atol=1e-13)
        handle.remove()


@pytest.mark.ranks(2)
def test_the_tensors_passed_to_functional_call_are_guarded_as_the_stored_parameters():
    """torch.func.functional_call puts this rank's storage blocks in the stored parameters' places: for the
    call they refuse plain torch use outside their unit's forward as the stored parameters do (a parent's
    read of its child's scale, a tied head's read of a transposed weight), on every rank; the passed tensors
    are left as they were, and the registered shards are back."""
    g = torch.Generator().manual_seed(7)
    scale, X = torch.randn(2, generator=g, dtype=DT), torch.randn(4, 2, generator=g, dtype=DT)
    m = es.wrap_mesh(MESHES[0].build())
    model = ScaledParent(scale)
    es.params.register_parameter_layout(model.child.scale, "c", mesh=m, grad="dp", store="dp")
    handle = es.params.register_native_grad_reduction_hooks_(model, m)
    passed = local_block(scale, "c/dp", m).requires_grad_()
    with pytest.raises(es.EinshardError, match=r"torch op 'mul' combines a parameter stored sharded over 'dp' "
                                               r"\(store=, layout 'c/dp', storage block of shape \(1,\)\)"):
        torch.func.functional_call(model, {"child.scale": passed}, (local_block(X, "b/dp c", m),))
    assert type(passed) is torch.Tensor and passed.is_leaf and passed.grad is None and not vars(passed)
    assert type(model.child.scale) is es.params.StoredParameter
    handle.remove()
    whole = _whole(1)
    model = TiedHead(whole)
    es.params.register_module_parameter_layouts_(model, {"a.weight": "f c", "b.weight": "c f"}, mesh=m, grad="dp",
                                          store="dp", sizes={"c": C, "f": F})
    handle = es.params.register_native_grad_reduction_hooks_(model, m)
    passed = {k: local_block(whole[k], _layout(p), m).requires_grad_() for k, p in model.named_parameters()}
    with pytest.raises(es.EinshardError, match=r"torch op 'matmul' combines a parameter stored sharded over 'dp' "
                                               r"\(store=, layout 'f/dp c'"):
        torch.func.functional_call(model, passed, (local_block(whole["x"], "b/dp c", m),))
    assert all(type(t) is torch.Tensor and not vars(t) for t in passed.values())
    assert all(type(p) is es.params.StoredParameter for p in model.parameters())
    handle.remove()


# -- a shard_map body with stored parameters under no_grad (an evaluation forward) --------------------------


@pytest.mark.ranks(4)
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("vma", [True, False], ids=["vma", "per-rank"])
def test_a_no_grad_forward_through_a_shard_map_body_computes_the_values(grad_mode, vma):
    """One process: a forward under ``torch.no_grad()`` (or ``torch.inference_mode()``) just computes the
    values. A ``shard_map`` body gathers its stored parameters on entry; with no gradient to take it must not
    prepare their reduce-scatters (no autograd node to read). The evaluation gives the one-process output and
    leaves nothing behind: the training step after it is exact, on the 2 x 2 (dp, tp) mesh."""
    whole = _whole(1)
    m, model, body = _shard_map_model(MESHES[1], whole, vma)

    x = local_block(whole["x"], "b/dp c", m)
    want_y, want_grads = _reference(whole)
    for _ in range(2):
        with getattr(torch, grad_mode)():
            y = body(dict(model.named_parameters()), x)
        assert not y.requires_grad
        torch.testing.assert_close(y, local_block(want_y, "b/dp c", m), rtol=1e-12, atol=1e-13)
        assert all(p.grad is None for p in model.parameters())
    y = body(dict(model.named_parameters()), x)
    (y**2).sum().backward()
    _assert_step(m, y.detach(), {k: (p.grad, _layout(p)) for k, p in model.named_parameters()}, want_y, want_grads)
