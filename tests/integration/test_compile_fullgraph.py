"""``torch.compile(fullgraph=True)`` of everything that runs eagerly, checks on and off.

Each row of :data:`ROWS` is one operation on local blocks: a named collective
in a ``shard_map`` body (``check_vma=False``, explicit collectives), a
transition or contraction of ``es.einshard``, or a stencil / FFT op. It is
compiled with ``fullgraph=True`` (a graph break fails the row) and its value
and gradients are compared with the same computation on whole tensors in one
process (:func:`einshard.testing.local_block` cuts the expected blocks):
the rank's loss is ``<y, c>`` with ``c`` its block of a whole cotangent
``C``, so every input's gradient is its block of ``d<ref(X), C>/dX``.

Every row runs with ``aot_eager``, cross-rank checks on and off; the
``shard_map`` rows also with variance tracking (``check_vma=True``); a few
run with inductor. A row also checks compile hygiene: no warning from
einshard's code while dynamo traces, and no recompilation on the next call
(after the same operation ran eagerly, filling the library's caches).
Without a mesh, the stencil and FFT ops compile too (:data:`LOCAL`).
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import einshard as es
from einshard.testing import local_block, make_mesh

DT = torch.float64


def _randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _mesh(ndim):
    return es.wrap_mesh(make_mesh((2,), ("tp",)) if ndim == 1 else make_mesh((2, 2), ("dp", "tp")))


class Row:
    """One compiled operation and its whole-tensor reference.

    ``inputs``: ``(global shape, spec)`` per operand (the spec cuts the rank's
    block); ``make(mesh)``: the function of the local blocks to compile;
    ``out``: the spec of its result; ``ref``: the whole result from whole
    operands; ``shapes``: split shapes (``shapes=``) for uneven blocks.
    """

    def __init__(self, ndim, inputs, make, out, ref, shapes=None):
        self.ndim, self.inputs, self.make, self.out, self.ref, self.shapes = ndim, inputs, make, out, ref, shapes


def _body(body, in_specs, out_specs, shapes=None):
    """``make`` for a ``shard_map`` body with explicit collectives (variance tracking off unless asked)."""

    def make(mesh, check_vma=False):
        return es.shard_map(body, in_specs=in_specs, out_specs=out_specs, mesh=mesh, shapes=shapes,
                            check_vma=check_vma)

    make.body = True
    return make


def _formula(formula, shapes=None):
    return lambda mesh: lambda *xs: es.einshard(formula, *xs, mesh=mesh, shapes=shapes)


def _on_mesh(fn):
    """``make`` for an op that reads the ambient mesh (``es.use_mesh`` around the compiled call)."""
    return lambda mesh: fn


def _stencil(x):  # after a halo of width 1 along axis 0
    return x[:-2] + 2 * x[1:-1] + x[2:]


def _periodic(x, w):
    return torch.cat([x[-w:], x, x[:w]])


def _conv_ref(x, w):  # "a c, o c k -> a o", length-preserving zero padding
    return F.conv1d(x.T[None], w, padding=w.shape[-1] // 2)[0].T


TP2 = {"tp": [3, 2]}  # uneven blocks of an axis of 5 over tp
RING = [(0, 1), (1, 0)]

ROWS = {
    # -- named collectives in shard_map (1-D mesh) --
    "psum": Row(1, [((2, 3, 4), "p/tp n c")], _body(lambda x: es.spmd.psum(x[0], "tp"), "p/tp n c", "n c"), "n c",
                lambda x: x.sum(0)),
    "pmean": Row(1, [((2, 3, 4), "p/tp n c")], _body(lambda x: es.spmd.pmean(x[0], "tp"), "p/tp n c", "n c"), "n c",
                 lambda x: x.mean(0)),
    "pmax": Row(1, [((2, 5), "p/tp n")], _body(lambda x: es.spmd.pmax(x[0], "tp"), "p/tp n", "n"), "n",
                lambda x: x.amax(0)),
    "pmin": Row(1, [((2, 5), "p/tp n")], _body(lambda x: es.spmd.pmin(x[0], "tp"), "p/tp n", "n"), "n",
                lambda x: x.amin(0)),
    "all_gather": Row(1, [((4, 3), "a/tp c")], _body(lambda x: es.spmd.all_gather(x, "tp", axis=0), "a/tp c", "a c"),
                      "a c", lambda x: x),
    "all_gather uneven": Row(1, [((5, 3), "a/tp c")],
                             _body(lambda x: es.spmd.all_gather(x, "tp", axis=0, shapes=[3, 2]), "a/tp c", "a c", TP2),
                             "a c", lambda x: x, TP2),
    "all_gather stacked": Row(1, [((2, 3), "p/tp n")],
                              _body(lambda x: es.spmd.all_gather(x[0], "tp", axis=0, tiled=False), "p/tp n", "p n"),
                              "p n", lambda x: x),
    "psum_scatter uneven": Row(1, [((2, 5, 3), "p/tp a c")],
                               _body(lambda x: es.spmd.psum_scatter(x[0], "tp", axis=0), "p/tp a c", "a/tp c",
                                     {"tp": {"p": [1, 1], "a": [3, 2]}}),
                               "a/tp c", lambda x: x.sum(0), {"tp": {"p": [1, 1], "a": [3, 2]}}),
    "all_to_all uneven": Row(1, [((4, 5), "a/tp b")], _body(lambda x: es.spmd.all_to_all(x, "tp", 1, 0), "a/tp b", "a b/tp"),
                             "a b/tp", lambda x: x),
    "psum_scatter untiled": Row(1, [((2, 2, 3), "p/tp q c")],
                                _body(lambda x: es.spmd.psum_scatter(x[0], "tp", axis=0, tiled=False)[None], "p/tp q c",
                                      "q/tp c"),
                                "q/tp c", lambda x: x.sum(0)),
    "all_to_all untiled": Row(1, [((2, 2, 3), "p/tp q n")],
                              _body(lambda x: es.spmd.all_to_all(x[0], "tp", 0, 0, tiled=False)[None], "p/tp q n",
                                    "q/tp p n"),
                              "q/tp p n", lambda x: x.transpose(0, 1)),
    "ppermute": Row(1, [((2, 3), "p/tp n")], _body(lambda x: es.spmd.ppermute(x, "tp", RING), "p/tp n", "p/tp n"),
                    "p/tp n", lambda x: x.roll(1, 0)),
    "pvary, axis_index": Row(
        1, [((3, 4), "n c"), ((2, 3, 4), "p/tp n c")],
        _body(lambda w, x: es.spmd.pvary(w, "tp") * x * (1 + es.spmd.axis_index("tp")), ("n c", "p/tp n c"), "p/tp n c"),
        "p/tp n c", lambda w, x: w * x * torch.arange(1, 3, dtype=DT).view(2, 1, 1)),
    # -- named collectives, 2-D mesh --
    "psum over tp of dp x tp": Row(2, [((2, 2, 3), "d/dp t/tp n")],
                                   _body(lambda x: es.spmd.psum(x[:, 0], "tp"), "d/dp t/tp n", "d/dp n"), "d/dp n",
                                   lambda x: x.sum(1)),
    "psum compound": Row(2, [((4, 3), "p/dp-tp n")], _body(lambda x: es.spmd.psum(x[0], "dp-tp"), "p/dp-tp n", "n"), "n",
                         lambda x: x.sum(0)),
    "all_gather (dp, tp) uneven": Row(
        2, [((7, 3), "a/dp-tp c")],
        _body(lambda x: es.spmd.all_gather(x, ("tp", "dp"), axis=0, shapes=[2, 2, 2, 1]), "a/dp-tp c", "a c",
              {"dp-tp": [2, 2, 2, 1]}),
        "a c", lambda x: x, {"dp-tp": [2, 2, 2, 1]}),
    # -- transitions and contractions of es.einshard --
    "all-gather uneven": Row(1, [((5, 3), "a/tp b")], _formula("a/tp b -> a b", TP2), "a b", lambda x: x, TP2),
    "all-to-all": Row(1, [((4, 6), "a/tp b")], _formula("a/tp b -> a b/tp"), "a b/tp", lambda x: x),
    "all-to-all uneven": Row(1, [((5, 5), "a/tp b")], _formula("a/tp b -> a b/tp", TP2), "a b/tp", lambda x: x, TP2),
    "reduce-scatter (contraction)": Row(1, [((5, 5), "a c/tp"), ((3, 5), "b c/tp")],
                                        _formula("a c/tp, b c/tp -> a/tp b", TP2), "a/tp b", lambda x, w: x @ w.T,
                                        TP2),
    "all-reduce (contraction) uneven": Row(1, [((3, 5), "a c/tp"), ((2, 5), "b c/tp")],
                                           _formula("a c/tp, b c/tp -> a b", TP2), "a b", lambda x, w: x @ w.T, TP2),
    "exchange": Row(2, [((4, 6), "a/dp b/tp")], _formula("a/dp b/tp -> a/tp b/dp"), "a/tp b/dp", lambda x: x),
    "exchange uneven": Row(2, [((5, 5), "a/dp b/tp")], _formula("a/dp b/tp -> a/tp b/dp", {"dp": [3, 2], "tp": [3, 2]}),
                           "a/tp b/dp", lambda x: x, {"dp": [3, 2], "tp": [3, 2]}),
    "mesh move uneven": Row(2, [((5, 3), "a/dp b")], _formula("a/dp b -> a/tp b", {"dp": [3, 2], "tp": [3, 2]}),
                            "a/tp b", lambda x: x, {"dp": [3, 2], "tp": [3, 2]}),
    "compound dims": Row(2, [((4, 8), "a/dp b/tp")], _formula("a/dp b/tp -> a b/dp-tp"), "a b/dp-tp", lambda x: x),
    "compound dims uneven": Row(2, [((6, 6), "a/dp b/tp")], _formula("a/dp b/tp -> a b/dp-tp"), "a b/dp-tp",
                                lambda x: x),
    # -- stencils and FFTs --
    "einhalo uneven": Row(1, [((5, 3), "a/tp b")],
                          _on_mesh(lambda x: _stencil(es.einhalo("a/tp b", x, {"a": 1}, boundary="periodic",
                                                                 shapes=TP2))),
                          "a/tp b", lambda x: _stencil(_periodic(x, 1)), TP2),
    "einhalo 2-D": Row(2, [((4, 6), "a/dp b/tp")],
                       _on_mesh(lambda x: _stencil(_stencil(es.einhalo("a/dp b/tp", x, {"a": 1, "b": 1},
                                                                       boundary="periodic").T).T)),
                       "a/dp b/tp", lambda x: _stencil(_stencil(_periodic(_periodic(x, 1).T, 1)).T)),
    "einroll uneven": Row(1, [((5, 3), "a/tp b")], _on_mesh(lambda x: es.einroll("a/tp b", x, {"a": 2}, shapes=TP2)),
                          "a/tp b", lambda x: x.roll(2, 0), TP2),
    "einwindow uneven": Row(1, [((5, 3), "a/tp b")],
                            _on_mesh(lambda x: es.einwindow("a/tp b -> a/tp b k", x, {"a": "k"}, {"a": 1}, shapes=TP2)),
                            "a/tp b k", lambda x: F.pad(x, (0, 0, 1, 1)).unfold(0, 3, 1), TP2),
    "einconv uneven": Row(1, [((5, 2), "a/tp c"), ((3, 2, 3), "o c k")],
                          _on_mesh(lambda x, w: es.einconv("a/tp c, o c k -> a/tp o", x, w, {"a": "k"}, shapes=TP2)),
                          "a/tp o", _conv_ref, TP2),
    "einfft": Row(1, [((4, 10), "a/tp b")],  # (shapes no other row has: transitions of its own)
                  _on_mesh(lambda x: es.einfft("a/tp b -> ka kb/tp", x, {"a": "ka", "b": "kb"})),
                  "ka kb/tp", lambda x: torch.fft.fftn(x)),
    "einhalo in shard_map": Row(1, [((6, 3), "a/tp b")],
                                _body(lambda x: _stencil(es.einhalo("a/tp b", x, {"a": 1}, boundary="periodic")),
                                      "a/tp b", "a/tp b"),
                                "a/tp b", lambda x: _stencil(_periodic(x, 1))),
    "einconv in shard_map": Row(1, [((6, 2), "a/tp c"), ((3, 2, 3), "o c k")],
                                _body(lambda x, w: es.einconv("a/tp c, o c k -> a/tp o", x, w, {"a": "k"}),
                                      ("a/tp c", "o c k"), "a/tp o"),
                                "a/tp o", _conv_ref),
    "einfft in shard_map": Row(1, [((6, 4), "a/tp b")],
                               _body(lambda x: es.einfft("a/tp b -> ka kb/tp", x, {"a": "ka", "b": "kb"}), "a/tp b",
                                     "ka kb/tp"),
                               "ka kb/tp", lambda x: torch.fft.fftn(x)),
    "einfft four-step": Row(1, [((8,), "x/tp")], _on_mesh(lambda x: es.einfft("x/tp -> kx/tp", x, {"x": "kx"})),
                            "kx/tp", lambda x: torch.fft.fft(x)),
    "einfft uneven": Row(1, [((5, 5), "a/tp b")],
                         _on_mesh(lambda x: es.einfft("a/tp b -> ka kb/tp", x, {"a": "ka", "b": "kb"}, shapes=TP2)),
                         "ka kb/tp", lambda x: torch.fft.fftn(x), TP2),
}

INDUCTOR = ["ppermute", "all-to-all uneven", "einhalo uneven"]
NAMES_1D = [n for n, r in ROWS.items() if r.ndim == 1]
NAMES_2D = [n for n, r in ROWS.items() if r.ndim == 2]
BODIES_1D = [n for n in NAMES_1D if getattr(ROWS[n].make, "body", False)]
BODIES_2D = [n for n in NAMES_2D if getattr(ROWS[n].make, "body", False)]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def _ours(messages):
    """The warnings and log messages that point at einshard's code."""
    return [m for m in messages if "einshard" in m]


def _loss_and_grads(fn, tensors, cot):
    xs = [t.detach().clone().requires_grad_() for t in tensors]
    y = fn(*xs)
    (y * cot).real.sum().backward()
    return y.detach(), [x.grad for x in xs]


def _check(name, backend, checks, check_vma=False):
    row = ROWS[name]
    mesh = _mesh(row.ndim)
    wholes = [_randn(shape, seed=k) for k, (shape, _) in enumerate(row.inputs)]
    blocks = [local_block(w, spec, mesh, shapes=row.shapes) for w, (_, spec) in zip(wholes, row.inputs)]
    # the whole-tensor reference, in this process
    ws = [w.clone().requires_grad_() for w in wholes]
    whole_out = row.ref(*ws)
    cot = _randn(whole_out.shape, seed=99)
    (whole_out * cot).real.sum().backward()
    want = local_block(whole_out.detach(), row.out, mesh, shapes=row.shapes)
    want_grads = [local_block(w.grad, spec, mesh, shapes=row.shapes) for w, (_, spec) in zip(ws, row.inputs)]
    c = local_block(cot, row.out, mesh, shapes=row.shapes)

    fn = row.make(mesh, check_vma=True) if check_vma else row.make(mesh)
    es.set_checks(checks)
    records = _Records()
    loggers = [logging.getLogger(n) for n in ("torch._dynamo", "torch._inductor", "torch.fx")]
    for lg in loggers:
        lg.addHandler(records)
    try:
        torch._dynamo.reset()
        torch._dynamo.utils.warn_once_cache.clear()  # dynamo warns once per process: see every warning here
        compiled = torch.compile(fn, fullgraph=True, backend=backend)
        with es.use_mesh(mesh), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, got_grads = _loss_and_grads(compiled, blocks, c)
            eager, eager_grads = _loss_and_grads(fn, blocks, c)  # fills the eager caches
            with torch._dynamo.config.patch(error_on_recompile=True):
                again, _ = _loss_and_grads(compiled, blocks, c)
    finally:
        for lg in loggers:
            lg.removeHandler(records)
        es.set_checks(True)
    torch.testing.assert_close(got, want, msg=f"{name}: value")
    torch.testing.assert_close(again, want, msg=f"{name}: value, second call")
    torch.testing.assert_close(eager, want, msg=f"{name}: eager value")
    for k, (g, e, w) in enumerate(zip(got_grads, eager_grads, want_grads)):
        torch.testing.assert_close(g, w, msg=f"{name}: gradient of operand {k}")
        torch.testing.assert_close(e, w, msg=f"{name}: eager gradient of operand {k}")
    messages = [f"{w.filename}: {w.message}" for w in caught] + [r.getMessage() for r in records.records]
    assert not _ours(messages), _ours(messages)


def _with_checks_on_and_off(names):
    """Every row with checks on and off. With checks off the traced graph is the same (checks agree at trace
    time), so the default run compiles the first row so; the others run so in the long matrix (-m matrix)."""
    for i, name in enumerate(names):
        yield pytest.param(name, True, id=f"{name}-checks")
        yield pytest.param(name, False, id=f"{name}-no-checks", marks=[pytest.mark.matrix] if i else [])


@pytest.mark.ranks(2, timeout=900)
@pytest.mark.parametrize("name, checks", list(_with_checks_on_and_off(NAMES_1D)))
def test_compiles_fullgraph_1d(name, checks):
    _check(name, "aot_eager", checks)


@pytest.mark.ranks(4, timeout=900)
@pytest.mark.parametrize("name, checks", list(_with_checks_on_and_off(NAMES_2D)))
def test_compiles_fullgraph_2d(name, checks):
    _check(name, "aot_eager", checks)


@pytest.mark.ranks(2, timeout=900)
@pytest.mark.parametrize("name", BODIES_1D)
def test_compiles_fullgraph_with_variance_tracking_1d(name):
    _check(name, "aot_eager", True, check_vma=True)


@pytest.mark.ranks(4, timeout=900)
@pytest.mark.parametrize("name", BODIES_2D)
def test_compiles_fullgraph_with_variance_tracking_2d(name):
    _check(name, "aot_eager", True, check_vma=True)


@pytest.mark.ranks(2, timeout=900)
@pytest.mark.parametrize("name", INDUCTOR)
def test_compiles_fullgraph_inductor(name):
    _check(name, "inductor", True)


def _vma_body(p, x):  # formulas no other test uses: their lookups miss every cache when traced
    h = torch.tanh(es.einshard("b q c, g/tp c -> b q g/tp", x, p["w"]))
    return es.einshard("b q g/tp, c g/tp -> b q c", h, p["v"])


@pytest.mark.ranks(2, timeout=600)
def test_compiled_shard_map_step_warns_nothing_from_einshard():
    """With variance tracking, a formula's parameter recorder is looked up at trace time: dynamo traces no
    parser (no warnings about the notation's lru_caches) and the step does not recompile on the next call."""
    mesh = _mesh(1)
    r = dist.get_rank()
    full = {"w": _randn((4, 3), seed=1), "v": _randn((3, 4), seed=2)}
    params = {"w": full["w"][2 * r : 2 * r + 2], "v": full["v"][:, 2 * r : 2 * r + 2]}
    x = _randn((2, 2, 3), seed=3)
    step = es.shard_map(_vma_body, in_specs=({"w": "g/tp c", "v": "c g/tp"}, "b q c"), out_specs="b q c", mesh=mesh,
                        check_vma=True)
    torch._dynamo.reset()
    torch._dynamo.utils.warn_once_cache.clear()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compiled(params, x)
        with torch._dynamo.config.patch(error_on_recompile=True):
            compiled(params, x)
    messages = [f"{w.filename}: {w.message}" for w in caught]
    assert not _ours(messages), _ours(messages)
    want = torch.tanh(x @ full["w"].T) @ full["v"].T
    torch.testing.assert_close(got, want)


@pytest.mark.ranks(2, timeout=600)
def test_compiled_rank_local_error_is_agreed():
    """Checks on: a collective's error that one rank sees while tracing (its block disagrees with shapes=) is
    raised on every rank, before any rank communicates; the group stays usable."""
    mesh = _mesh(1)
    r = dist.get_rank()
    body = es.shard_map(lambda x: es.spmd.all_gather(x, "tp", axis=0, shapes=[3, 3]), in_specs="a/tp c", out_specs="a c",
                        mesh=mesh, shapes=TP2, check_vma=False)
    x = _randn((5, 3), seed=0)[:3] if r == 0 else _randn((5, 3), seed=0)[3:]
    torch._dynamo.reset()
    with es.count_communication() as stats, pytest.raises(Exception, match=r"rank 1: all_gather: this rank \(group rank 1\) "
                                                                           r"holds 2 elements along dim 0 but shapes\[1\] = 3"):
        torch.compile(body, fullgraph=True, backend="aot_eager")(x)
    assert stats.filter(kind="all_gather").calls == 0
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2


LOCAL = {  # the same ops without a mesh (one process): whole tensors in, whole tensors out
    "einhalo": (lambda x, w: _stencil(es.einhalo("a b", x, {"a": 1}, boundary="periodic")),
                lambda x, w: _stencil(_periodic(x, 1))),
    "einroll": (lambda x, w: es.einroll("a b", x, {"a": 2}), lambda x, w: x.roll(2, 0)),
    "einwindow": (lambda x, w: es.einwindow("a b -> a b k", x, {"a": "k"}, {"a": 1}),
                  lambda x, w: F.pad(x, (0, 0, 1, 1)).unfold(0, 3, 1)),
    "einconv": (lambda x, w: es.einconv("a c, o c k -> a o", x, w, {"a": "k"}), _conv_ref),
    "einfft": (lambda x, w: es.einfft("a b -> ka kb", x, {"a": "ka", "b": "kb"}), lambda x, w: torch.fft.fftn(x)),
}


@pytest.mark.parametrize("name", list(LOCAL))
def test_local_ops_compile_fullgraph(name):
    fn, ref = LOCAL[name]
    x, w = _randn((5, 3), seed=0), _randn((4, 3, 3), seed=1)
    want = ref(x, w)
    cot = _randn(want.shape, seed=2)
    want_grads = _loss_and_grads(ref, [x, w], cot)[1]
    torch._dynamo.reset()
    got, got_grads = _loss_and_grads(torch.compile(fn, fullgraph=True, backend="aot_eager"), [x, w], cot)
    torch.testing.assert_close(got, want)
    for k, (g, e) in enumerate(zip(got_grads, want_grads)):
        assert (g is None) == (e is None), f"{name}: gradient of operand {k}"
        if g is not None:
            torch.testing.assert_close(g, e, msg=f"{name}: gradient of operand {k}")
