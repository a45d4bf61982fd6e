"""``es.shard_map``: gradients against single-process references, pytree specs, conversions, errors.

Multi-rank tests run several checks per dispatch; every rank all-reduces its
errors before asserting, so a failure never leaves a rank waiting.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import einshard as es
from einshard.core import _context
from einshard.comm.mesh import Mesh
from einshard.spmd import named
from einshard.spmd.named import pvary
from einshard.spmd.shard_map import ShardMap, shard_map
from einshard.testing import local_block
from einshard.runtime.vma import get_vma

DT = torch.float64


def agree_errors(errs: dict, tol: float = 1e-10) -> dict:
    """Max of every error over the ranks; assert they are all within ``tol``."""
    names = sorted(errs)
    t = torch.tensor([float(errs[n]) for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    worst = dict(zip(names, t.tolist()))
    bad = {n: v for n, v in worst.items() if not v <= tol}
    assert not bad, f"errors above {tol}: {bad}"
    return worst


def err(a, b) -> float:
    return (a.detach() - b.detach()).abs().max().item() if a.numel() else 0.0


def gen(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


# -- data parallel ----------------------------------------------------------------------------


def _dp_case(mesh, check_vma, out_spec, body, batch_in):
    """Replicated parameters, a 'b/dp' batch, a '// dp' loss: every rank gets the full gradient."""
    B, n, c, h = 7, 3, 5, 4  # B=7: uneven over dp when the batch arrives whole ([4, 3])
    x = gen(B, n, c, seed=1)
    w0, b0 = gen(h, c, seed=2), gen(h, seed=3)
    wr, br = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    ref = (torch.tanh(torch.einsum("bnc,hc->bnh", x, wr) + br) ** 2).sum()
    ref.backward()
    params = {"w": torch.nn.Parameter(w0.clone()), "b": torch.nn.Parameter(b0.clone())}
    if batch_in == "whole":
        xb, x_spec = x, "b n c -> b/dp n c"
    else:
        xb, x_spec = local_block(x, "b/dp n c", mesh), "b/dp n c"

    @shard_map(({"w": "h c", "b": "h"}, x_spec), out_spec, mesh=mesh, check_vma=check_vma)
    def step(p, xl):
        assert p["w"] is params["w"]  # parameters keep their identity
        if body == "einshard":
            y = es.einshard("b/dp n c, h c -> b/dp n h", xl, p["w"])
            bias = p["b"] if check_vma else pvary(p["b"], "dp")  # plain `+`: the user's job without check_vma
            return es.einshard("b/dp n h -> // dp", torch.tanh(y + bias) ** 2)
        y = torch.tanh(xl @ p["w"].T + p["b"])  # plain torch only: check_vma pvary-s w and b
        return (y**2).sum()

    loss = step(params, xb)
    loss.backward()
    if out_spec == "// dp":
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh.group("dp"))
    else:
        total = loss.detach()
    return {
        "loss": abs(total.item() - ref.item()),
        "w": err(params["w"].grad, wr.grad),
        "b": err(params["b"].grad, br.grad),
    }


# checks off: the "block" cases pass uneven batch blocks (4 and 3 rows) without shapes=, which is
# fine here (nothing is communicated along b) but makes each dp group derive another global batch
# size, which checks reject (tests/integration/test_faults.py covers that error)
@pytest.mark.ranks(8, checks=False)
def test_data_parallel_step(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    errs = {}
    cases = [
        (True, "// dp", "einshard", "block"),
        (True, "// dp -> ", "einshard", "whole"),
        (False, "// dp", "einshard", "block"),
        (False, "// dp -> ", "einshard", "whole"),
        (True, "// dp", "torch", "block"),
        (True, "// dp -> ", "torch", "whole"),
    ]
    for case in cases:
        for k, v in _dp_case(mesh, *case).items():
            errs[f"{case}/{k}"] = v
    agree_errors(errs)


# -- tensor parallel ------------------------------------------------------------------------


MLP_SPECS = {"w1": "f/tp c", "b1": "f/tp", "w2": "c f/tp", "b2": "c"}


def _mlp(p, x, manual_pvary=False):
    b1, b2 = p["b1"], p["b2"]
    if manual_pvary:
        b1, b2 = pvary(b1, "dp"), pvary(b2, "dp")
    h = F.gelu(es.einshard("b/dp n c, f/tp c -> b/dp n f/tp", x, p["w1"]) + b1)
    return es.einshard("b/dp n f/tp, c f/tp -> b/dp n c", h, p["w2"]) + b2


def _mlp_ref(p, x):
    h = F.gelu(torch.einsum("bnc,fc->bnf", x, p["w1"]) + p["b1"])
    return torch.einsum("bnf,cf->bnc", h, p["w2"]) + p["b2"]


ATTN_SPECS = {"wq": "h/tp d c", "wk": "h/tp d c", "wv": "h/tp d c", "wo": "c h/tp d", "ln": "c"}


def _attn(p, x, manual_pvary=False):
    ln = pvary(p["ln"], "dp") if manual_pvary else p["ln"]
    a = x * ln
    q = es.einshard("b/dp n c, h/tp d c -> b/dp h/tp n d", a, p["wq"])
    k = es.einshard("b/dp n c, h/tp d c -> b/dp h/tp n d", a, p["wk"])
    v = es.einshard("b/dp n c, h/tp d c -> b/dp h/tp n d", a, p["wv"])
    s = es.einshard("b/dp h/tp q d, b/dp h/tp k d -> b/dp h/tp q k", q, k).softmax(-1)
    o = es.einshard("b/dp h/tp q k, b/dp h/tp k d -> b/dp h/tp q d", s, v)
    return es.einshard("b/dp h/tp n d, c h/tp d -> b/dp n c", o, p["wo"])


def _attn_ref(p, x):
    a = x * p["ln"]
    q = torch.einsum("bnc,hdc->bhnd", a, p["wq"])
    k = torch.einsum("bnc,hdc->bhnd", a, p["wk"])
    v = torch.einsum("bnc,hdc->bhnd", a, p["wv"])
    s = torch.einsum("bhqd,bhkd->bhqk", q, k).softmax(-1)
    return torch.einsum("bhnd,chd->bnc", torch.einsum("bhqk,bhkd->bhqd", s, v), p["wo"])


def _tp_case(mesh, model, check_vma, manual_pvary):
    B, n, c = 4, 3, 6
    if model == "mlp":
        specs, fn, ref_fn = MLP_SPECS, _mlp, _mlp_ref
        shapes = {"w1": (8, c), "b1": (8,), "w2": (c, 8), "b2": (c,)}
    else:
        specs, fn, ref_fn = ATTN_SPECS, _attn, _attn_ref
        shapes = {"wq": (4, 2, c), "wk": (4, 2, c), "wv": (4, 2, c), "wo": (c, 4, 2), "ln": (c,)}
    whole = {k: gen(*s, seed=10 + i) for i, (k, s) in enumerate(sorted(shapes.items()))}
    x = gen(B, n, c, seed=5)
    cot = gen(B, n, c, seed=6)
    ref_p = {k: v.clone().requires_grad_() for k, v in whole.items()}
    ref_x = x.clone().requires_grad_()
    y_ref = ref_fn(ref_p, ref_x)
    (y_ref * cot).sum().backward()

    params = {k: torch.nn.Parameter(local_block(v, specs[k], mesh)) for k, v in whole.items()}
    xl = local_block(x, "b/dp n c", mesh).requires_grad_()

    @shard_map((specs, "b/dp n c"), ("b/dp n c", "// dp"), mesh=mesh, check_vma=check_vma)
    def forward(p, xb):
        y = fn(p, xb, manual_pvary)
        c_local = local_block(cot, "b/dp n c", mesh)
        return y, es.einshard("b/dp n c, b/dp n c -> // dp", y, c_local)

    y, loss = forward(params, xl)
    loss.backward()
    errs = {"y": err(y, local_block(y_ref, "b/dp n c", mesh)), "x": err(xl.grad, local_block(ref_x.grad, "b/dp n c", mesh))}
    for k in whole:
        errs[k] = err(params[k].grad, local_block(ref_p[k].grad, specs[k], mesh))
    return errs


@pytest.mark.ranks(8)
def test_tensor_parallel_mlp_and_attention(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    errs = {}
    for model in ("mlp", "attention"):
        for check_vma, manual in ((True, False), (False, True)):
            for k, v in _tp_case(mesh, model, check_vma, manual).items():
                errs[f"{model}/check_vma={check_vma}/{k}"] = v
    agree_errors(errs)
    # without check_vma and without the manual pvary, the replicated biases get only this rank's share
    wrong = _tp_case(mesh, "mlp", False, False)
    worst = torch.tensor([wrong["b2"]], dtype=DT)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    assert worst.item() > 1e-3


# -- a replicated tensor mixed with a sharded one in plain torch ----------------------------------


def _mixed_case(mesh, mode):
    B, n, c = 4, 3, 8
    x, w0, s0 = gen(B, n, c, seed=20), gen(c, seed=21), gen((), seed=22)
    wr, sr = w0.clone().requires_grad_(), s0.clone().requires_grad_()
    ref = (torch.sin(x * wr) * sr).sum()
    ref.backward()
    w, s = torch.nn.Parameter(local_block(w0, "c/tp", mesh)), torch.nn.Parameter(s0.clone())

    @shard_map((("b/dp n c/tp", "c/tp", ""),), "// (dp, tp) -> ", mesh=mesh, check_vma=(mode == "check_vma"))
    def body(args):
        xb, wb, sb = args
        if mode == "manual":  # what check_vma does, by hand
            wb, sb = pvary(wb, "dp"), pvary(sb, ("dp", "tp"))
        return es.einshard("b/dp n c/tp -> // (dp, tp)", torch.sin(xb * wb) * sb)  # broadcasting in plain torch

    loss = body((local_block(x, "b/dp n c/tp", mesh), w, s))
    loss.backward()
    return {
        "loss": abs(loss.item() - ref.item()),
        "w": err(w.grad, local_block(wr.grad, "c/tp", mesh)),
        "s": err(s.grad, sr.grad),
    }


@pytest.mark.ranks(8)
def test_mixing_replicated_and_sharded_in_plain_torch(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    errs = {}
    for mode in ("check_vma", "manual"):
        for k, v in _mixed_case(mesh, mode).items():
            errs[f"{mode}/{k}"] = v
    agree_errors(errs)
    # check_vma=False without pvary: documented as the user's job, and indeed wrong
    wrong = _mixed_case(mesh, "none")
    t = torch.tensor([wrong["loss"], wrong["w"], wrong["s"]], dtype=DT)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    assert t[0].item() < 1e-10 and t[1].item() > 1e-6 and t[2].item() > 1e-6


# -- output checks ------------------------------------------------------------------------------


@pytest.mark.ranks(8)
def test_replicated_out_spec_on_varying_result_raises(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    x = torch.ones(2, 3)

    def body(xb):
        return {"y": xb * 2, "z": [xb.sum()]}

    sm = shard_map(body, in_specs="b/dp c", out_specs={"y": "b/dp c", "z": [""]}, mesh=mesh)
    with pytest.raises(ValueError, match=r"out\['z'\]\[0\] varies over mesh dimension 'dp'.*replicated"):
        sm(x)
    sm = shard_map(lambda xb: xb * 2, in_specs="b/dp c", out_specs="b c", mesh=mesh)
    with pytest.raises(ValueError, match=r"output out varies over mesh dimension 'dp'"):
        sm(x)
    # a partial out spec accepts a varying value; check_vma=False checks nothing
    assert shard_map(lambda xb: xb.sum(), in_specs="b/dp c", out_specs="// dp", mesh=mesh)(x).item() == 6
    assert shard_map(lambda xb: xb * 2, in_specs="b/dp c", out_specs="b c", mesh=mesh, check_vma=False)(x).shape == (2, 3)
    # an einshard operand that varies over a dimension its spec says is replicated
    sm = shard_map(lambda xb, w: es.einshard("b c, h/dp c -> b h/dp", xb * 1, w), in_specs=("b/dp c", "h/dp c"),
                   out_specs="b h/dp", mesh=mesh)
    with pytest.raises(ValueError, match=r"operand 0 \('b c'\) varies over mesh dimension 'dp'"):
        sm(x, torch.ones(2, 3))
    dist.barrier()


# -- conversions, ambient context, uneven shards -------------------------------------------------


@pytest.mark.ranks(8)
def test_conversions_and_ambient_split_shapes(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    errs = {}
    x = gen(10, 3, 8, seed=30)  # 10 over tp=4 -> [3, 3, 3, 1]
    xw = x.clone().requires_grad_()
    cot = gen(10, 3, 8, seed=31)
    seen = {}

    @shard_map("b n c -> b/tp n c/dp", "b/tp n c/dp -> b n c", mesh=mesh)
    def roundtrip(xb):
        seen["mesh"] = es.current_mesh()
        seen["shapes"] = dict(_context.current().shapes)
        # no mesh=, no shapes=: the split [3, 3, 3, 1] of b over tp is ambient
        whole = es.einshard("b/tp n c/dp -> b n c", xb)
        return es.einshard("b n c -> b/tp n c/dp", whole * 3)

    y = roundtrip(xw)
    (y * cot).sum().backward()
    errs["value"] = err(y, 3 * x)
    errs["grad"] = err(xw.grad, 3 * cot)
    assert seen["mesh"] is mesh
    assert seen["shapes"][(("tp",), "b")] == (3, 3, 3, 1) and seen["shapes"][(("dp",), "c")] == (4, 4)
    # the ambient split shapes are gone after the call
    assert _context.current().shapes == {} and _context.current().mesh is None

    # plain specs with explicit uneven shapes: the body needs no shapes= either
    shapes = {"tp": {"b": [1, 4, 0, 5]}}
    xl = local_block(x, "b/tp n c", mesh, shapes=shapes).requires_grad_()

    @shard_map("b/tp n c", "// tp", mesh=mesh, shapes=shapes)
    def total(xb):
        return es.einshard("b/tp n c -> b n c // tp", xb).sum()

    t = total(xl)
    errs["uneven_total"] = abs(t.item() - x.sum().item())  # every rank holds the gathered sum
    with pytest.raises(ValueError, match=r"args\[0\].*holds .* elements of axis 'b'"):
        total(local_block(x, "b/tp n c", mesh))  # even blocks: ranks disagree with shapes= (local check)
    agree_errors(errs)


# -- pytrees (one process, virtual mesh: no communication needed) ---------------------------------

Pair = collections.namedtuple("Pair", "first second")


def test_pytree_prefix_matching():
    mesh = Mesh.virtual((2, 4), ("dp", "tp"), coordinate=(1, 2))
    w = torch.nn.Parameter(torch.ones(4, 3))
    args = (
        {"layer": {"w": w, "b": torch.zeros(4, 3)}, "skip": {"x": torch.ones(2), "n": 3}},
        [Pair(torch.ones(2, 5), "label"), torch.ones(7)],
        None,
        5,
    )
    in_specs = ({"layer": "a c", "skip": None}, [Pair("b/dp c", None), "n/tp"], None, None)
    got = {}

    @shard_map(in_specs, ({"layer": "a c"}, None), mesh=mesh)
    def body(p, rest, nothing, k):
        got["w"] = p["layer"]["w"]
        got["skip"] = p["skip"]
        got["label"] = rest[0].second
        got["k"], got["nothing"] = k, nothing
        assert get_vma(rest[0].first) == {"dp"} and get_vma(rest[1]) == {"tp"}
        assert get_vma(p["layer"]["w"]) == frozenset()
        return {"layer": p["layer"]}, rest

    out_p, out_rest = body(*args)
    assert got["w"] is w and got["skip"] is args[0]["skip"] and got["label"] == "label" and got["k"] == 5
    assert got["nothing"] is None and out_p["layer"]["w"] is w and out_rest[0].second == "label"
    assert "_es_vma" not in w.__dict__  # no tags left on the caller's tensors

    # one spec for every argument; a list of specs counts as a tuple
    assert shard_map(lambda a, b: a + b, "b/dp", "b/dp", mesh=mesh)(torch.ones(3), torch.ones(3)).shape == (3,)
    assert shard_map(lambda a: a, ["b/dp"], "b/dp", mesh=mesh)(torch.ones(3)).shape == (3,)


def test_pytree_mismatches_name_both_paths():
    mesh = Mesh.virtual((2, 4), ("dp", "tp"))
    ident = lambda *a: a[0]  # noqa: E731
    cases = [
        (({"w": "a", "b": "a"},), ({"w": torch.ones(1), "v": torch.ones(1)},),
         r"in_specs\[0\] is a dict with keys \['b', 'w'\] but args\[0\] is a dict with keys \['v', 'w'\]"),
        ((Pair("a", "a"),), ((torch.ones(1), torch.ones(1)),),
         r"in_specs\[0\] is a namedtuple Pair .* but args\[0\] is a tuple of length 2"),
        (([None, {"x": "a"}],), ([1, torch.ones(1)],), r"in_specs\[0\]\[1\] is a dict .* but args\[0\]\[1\] is a Tensor"),
        (("a", "a"), (torch.ones(1),), r"in_specs is a tuple of length 2 but args is a tuple of length 1"),
    ]
    for specs, args, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            shard_map(ident, specs, None, mesh=mesh)(*args)
    with pytest.raises(ValueError, match=r"out_specs is not a pytree prefix of out: out_specs\['y'\]"):
        shard_map(lambda x: {"y": (x, x)}, "a", {"y": ["a", "a"]}, mesh=mesh)(torch.ones(1))
    with pytest.raises(ValueError, match=r"in_specs\[0\]\['w'\].*Invalid einshard expression"):
        shard_map(ident, ({"w": "a ( b"},), None, mesh=mesh)
    with pytest.raises(ValueError, match=r"in_specs\[0\]: a spec must be a string or None, got int"):
        shard_map(ident, (3,), None, mesh=mesh)
    with pytest.raises(ValueError, match=r"args\[0\]\['w'\] \(spec 'a b/tp'\).*names 2 dimensions but the tensor has 1"):
        shard_map(ident, ({"w": "a b/tp"},), None, mesh=mesh)({"w": torch.ones(3)})
    with pytest.raises(ValueError, match=r"args\[0\]\.first\['w'\] \(spec 'a b/tp'\)"):  # namedtuple fields by name
        shard_map(ident, (Pair({"w": "a b/tp"}, None),), None, mesh=mesh)(Pair({"w": torch.ones(3)}, 1))


def test_decorator_forms_and_ambient_mesh():
    mesh = Mesh.virtual((2, 4), ("dp", "tp"))

    def f(x):
        assert es.current_mesh() is mesh
        return x * 2

    a = es_shard_map_direct = shard_map(f, in_specs="b/dp", out_specs="b/dp", mesh=mesh)
    b = shard_map("b/dp", "b/dp", mesh=mesh)(f)
    c = shard_map(in_specs="b/dp", out_specs="b/dp")(f)  # mesh from the ambient at call time
    assert isinstance(a, ShardMap) and a.__name__ == "f" and es_shard_map_direct is a
    assert torch.equal(a(torch.ones(2)), b(torch.ones(2)))
    with pytest.raises(ValueError, match=r"Distributed einshard operations require mesh=\.\.\."):
        c(torch.ones(2))
    with es.use_mesh(mesh):
        assert torch.equal(c(torch.ones(2)), 2 * torch.ones(2))
    with pytest.raises(TypeError, match="in_specs and out_specs"):
        shard_map(f, in_specs="b")
    assert get_vma(torch.ones(1)) is None  # outside shard_map nothing is tracked


def test_check_vma_false_tracks_nothing():
    mesh = Mesh.virtual((2, 4), ("dp", "tp"))

    @shard_map("b/dp", "b", mesh=mesh, check_vma=False)
    def f(x):
        assert get_vma(x) is None
        return x + 1

    assert f(torch.ones(2)).shape == (2,)


# -- plan caching, and checks that agree on every call --------------------------------------------


@pytest.mark.ranks(8, timeout=30)
def test_plan_cache_and_checks_on_every_call(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    planned = []
    w = torch.nn.Parameter(torch.arange(24, dtype=DT).reshape(8, 3))

    class Counting(ShardMap):
        def _plan_inputs(self, *a):
            planned.append("in")
            return super()._plan_inputs(*a)

        def _plan_outputs(self, *a):
            planned.append("out")
            return super()._plan_outputs(*a)

    def body(wb, xb):
        return es.einshard("h/tp c, b/dp c -> b/dp h/tp", wb, xb)

    sm = Counting(body, ("h c -> h/tp c", "b/dp c"), "b/dp h/tp -> b h", mesh=mesh)
    x = torch.ones(2, 3, dtype=DT)
    for _ in range(3):  # planned once, replayed; the gradient lands on the parameter every time
        sm(w, x).sum().backward()
    assert planned == ["in", "out"] and torch.equal(w.grad, torch.full((8, 3), 3 * 4.0, dtype=DT))
    sm(w, torch.ones(3, 3, dtype=DT))  # other local shapes: planned again
    assert planned == ["in", "out"] * 2 and len(sm._in_plans) == 2

    # checks on: a rank whose local shape changed misses its plan cache while the others hit it; the
    # agreement must not be a collective of the planning ranks only (it mismatched the body's psum)
    f = shard_map(lambda xb: named.psum(xb.sum(), ("dp", "tp")), "b/tp c", "", mesh=mesh)
    es.set_checks(True)
    try:
        assert f(torch.ones(2, 3)).item() == 48
        rows = 1 if dist.get_rank() == 3 else 2
        assert f(torch.ones(rows, 3)).item() == 45
    finally:
        es.set_checks(False)
