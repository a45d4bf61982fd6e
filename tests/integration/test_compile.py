"""``torch.compile``: local formulas, distributed ``es.einshard`` and ``shard_map`` bodies.

Every compiled result and gradient is compared with the same code run
eagerly (itself checked against whole tensors elsewhere). ``fullgraph=True``
everywhere: a graph break is a failure. Compiles are slow, so the cases are
few and tiny; inductor runs once per kind.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import einshard as es
from einshard.testing import MeshSpec

DT = torch.float64


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _grads(fn, tensors):
    xs = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*xs)
    out.square().sum().backward()
    return out.detach(), [x.grad for x in xs]


def _compare(fn, tensors, backend):
    want, want_grads = _grads(fn, tensors)
    got, got_grads = _grads(torch.compile(fn, fullgraph=True, backend=backend), tensors)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


LOCAL_CASES = [
    ("contraction", "i j, j k -> i k", [(3, 4), (4, 5)], {}),
    ("three operands", "i j, j k, k l -> i l", [(3, 4), (4, 5), (5, 2)], {}),
    ("permutation", "a b c -> c a b", [(2, 3, 4)], {}),
    ("sum", "i j -> j", [(3, 4)], {}),
    ("factored split", "b (h p) -> b h p", [(2, 8)], {"sizes": {"p": 4}}),
    ("factored merge", "b h p -> b (p h)", [(2, 3, 4)], {}),
    ("families", "b [*s *w] c -> b *s *w c", [(2, 8, 12, 3)],
     {"families": {"s": ("h", "w"), "w": ("kh", "kw")}, "sizes": {"w": (2, 3)}}),
    ("ellipsis", "... i, i -> ...", [(2, 3, 4), (4,)], {}),
]


@pytest.mark.parametrize("name, formula, shapes, kwargs", LOCAL_CASES, ids=[c[0] for c in LOCAL_CASES])
def test_local_formulas_compile_fullgraph(name, formula, shapes, kwargs):
    torch._dynamo.reset()
    tensors = [_randn(*s, seed=i) for i, s in enumerate(shapes)]
    _compare(lambda *xs: es.einshard(formula, *xs, **kwargs), tensors, "aot_eager")


def test_local_formula_compiles_with_inductor_and_dynamic_shapes():
    torch._dynamo.reset()

    def fn(a, b):
        return es.einshard("b (h p), p c -> b h c", a, b, sizes={"p": 4})

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for n in (2, 3):  # shapes are specialised (plans depend on them): one graph per shape, no error
        a, b = _randn(n, 8, seed=n), _randn(4, 5, seed=9)
        torch.testing.assert_close(compiled(a, b), fn(a, b))


# -- distributed (2 ranks) -----------------------------------------------------------------------


def _collective_ops(ops):
    """A backend that records every call target (also inside autograd-Function subgraphs), then runs eagerly."""

    def backend(gm, example_inputs):
        for mod in gm.modules():
            graph = getattr(mod, "graph", None)
            if graph is not None:
                ops.extend(str(n.target) for n in graph.nodes if n.op == "call_function")
        return gm.forward

    return backend


def _tp_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return es.wrap_mesh(init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))


def _tp_mlp(x, w1, w2):
    h = torch.tanh(es.einshard("b c, f/tp c -> b f/tp", x, w1))
    return es.einshard("b f/tp, c f/tp -> b c", h, w2)


@pytest.mark.ranks(2, timeout=600)
def test_distributed_einshard_traces_functional_collectives():
    mesh = _tp_mesh()
    r = dist.get_rank()
    x, w1, w2 = _randn(4, 6, seed=1), _randn(8, 6, seed=2), _randn(6, 8, seed=3)
    tensors = [x, w1[4 * r : 4 * r + 4], w2[:, 4 * r : 4 * r + 4]]
    with es.use_mesh(mesh):
        ops = []
        torch._dynamo.reset()
        _compare(_tp_mlp, tensors, _collective_ops(ops))
        assert "_c10d_functional.all_reduce" in ops and "_c10d_functional.wait_tensor" in ops
        assert not any("_c10d_functional" not in o and "c10d" in o for o in ops)  # no in-place collective
        # uneven blocks (f = 7: [4, 3]): padded functional all-gather / reduce-scatter
        w3 = _randn(7, 6, seed=4)
        shapes = [4, 3]
        local = w3[:4] if r == 0 else w3[4:]

        def gather(x, w):
            y = es.einshard("b c, f/tp c -> b f/tp", x, w, shapes=shapes)
            return es.einshard("b f/tp -> b f", y, shapes=shapes)

        def scatter(x, w):
            y = es.einshard("b c, f c -> b f // tp", x, w)
            return es.einshard("b f // tp -> b f/tp", y, shapes=shapes)

        torch._dynamo.reset()
        _compare(gather, [x, local], "aot_eager")
        _compare(scatter, [x, w3], "aot_eager")


SPECS = {"w1": "f/tp c", "b1": "f/tp", "w2": "c f/tp", "b2": "c"}


def _sm_body(p, x):
    h = F.gelu(es.einshard("b n c, f/tp c -> b n f/tp", x, p["w1"]) + p["b1"])
    return es.einshard("b n f/tp, c f/tp -> b n c", h, p["w2"]) + p["b2"]


def _dp_body(p, x):  # plain torch ops on replicated parameters: check_vma pvary-s them over dp
    y = torch.tanh(x @ p["w"].T + p["b"])
    return es.einshard("b/tp h -> // tp", y.square())


def _pieces_body(p, x):  # the pieces of multi-output ops vary like x: w is pvary-ed, its gradient summed over tp
    a, b = x.chunk(2, dim=1)
    first, _rest = x.split([1, 5], dim=1)
    column = torch.unbind(x, dim=1)[2]
    return (a * p["w"]).sum(1) + (b * p["w"]).sum(1) + first.squeeze(1) * p["w"][0] + column * p["w"][1]


def _run_step(step, params, x):
    p = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    out = step(p, x)
    out.square().sum().backward()
    return out.detach(), {k: v.grad for k, v in p.items()}


@pytest.mark.ranks(2, timeout=900)
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.matrix)])
def test_shard_map_step_compiles_with_vma(backend):
    mesh = _tp_mesh()
    r = dist.get_rank()
    sl = slice(4 * r, 4 * r + 4)
    full = {"w1": _randn(8, 6, seed=1), "b1": _randn(8, seed=2), "w2": _randn(6, 8, seed=3), "b2": _randn(6, seed=4)}
    params = {"w1": full["w1"][sl], "b1": full["b1"][sl], "w2": full["w2"][:, sl], "b2": full["b2"]}
    x = _randn(2, 3, 6, seed=5)
    cases = [(_sm_body, (SPECS, "b n c"), "b n c", params, x)]
    if backend == "aot_eager":  # a body where variance tracking inserts pvary (gradients summed over tp)
        cases.append((_dp_body, ({"w": "h c", "b": "h"}, "b/tp c"), "// tp",
                       {"w": _randn(5, 6, seed=6), "b": _randn(5, seed=7)}, _randn(3, 6, seed=8 + r)))
        cases.append((_pieces_body, ({"w": "h"}, "b/tp c"), "b/tp", {"w": _randn(3, seed=9)}, _randn(4, 6, seed=10 + r)))
    cases = [case + (None,) for case in cases]
    if backend == "inductor":  # the gradient sums of replicated parameters, bucketed by inductor
        cases.append((_dp_body, ({"w": "h c", "b": "h"}, "b/tp c"), "// tp",
                      {"w": _randn(5, 6, seed=6), "b": _randn(5, seed=7)}, _randn(3, 6, seed=8 + r),
                      {"bucket_all_reduces_fx": "all"}))
    for body, in_specs, out_specs, ps, xs, options in cases:
        step = es.shard_map(body, in_specs=in_specs, out_specs=out_specs, mesh=mesh, check_vma=True)
        want, want_grads = _run_step(step, ps, xs)
        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True, backend=backend, options=options)
        got, got_grads = _run_step(compiled, ps, xs)
        torch.testing.assert_close(got, want)
        for k in want_grads:
            torch.testing.assert_close(got_grads[k], want_grads[k])


def _breaking_body(p, x):
    y = es.einshard("b n c, f/tp c -> b n f/tp", x, p["w1"])
    torch._dynamo.graph_break()
    return y


@pytest.mark.ranks(2, timeout=600)
def test_failed_compile_leaves_no_context_behind():
    from einshard.core import _context
    from einshard.runtime import vma as _vma

    mesh = _tp_mesh()
    step = es.shard_map(_breaking_body, in_specs=({"w1": "f/tp c"}, "b n c"), out_specs="b n f/tp", mesh=mesh)
    p, x = {"w1": _randn(4, 6, seed=1)}, _randn(2, 3, 6, seed=2)
    torch._dynamo.reset()
    with pytest.raises(Exception):  # dynamo's error for a graph break under fullgraph=True
        torch.compile(step, fullgraph=True, backend="aot_eager")(p, x)
    assert _context.current() is _context._EMPTY and _context._STATE.ambient is _context._EMPTY
    assert _vma.ACTIVE == 0 and _vma.current() is None
    torch.testing.assert_close(step(p, x), torch.einsum("bnc,fc->bnf", x, p["w1"]))  # eager still works


def _attribute_body(x, w):
    y = F.gelu(x @ w.T)  # an attribute of the body frame's input: dynamo names it ``w.T`` and guards on it
    torch._dynamo.graph_break()
    return y * 2


@pytest.mark.ranks(2, timeout=600)
def test_an_attribute_of_a_body_input_before_a_graph_break():
    """torch 2.11's dynamo builds a guard of the body's frame by evaluating ``w.T`` through the body's
    torch-function modes; the variance tracker must tag nothing then (dynamo's own work), or the guard fails on
    the frame that made it ("Guard failed on the same frame it was created"). Compared with whole tensors."""
    mesh = _tp_mesh()
    rows = slice(4 * dist.get_rank(), 4 * dist.get_rank() + 4)
    x, w_whole = _randn(3, 6, seed=1), _randn(8, 6, seed=2)
    step = es.shard_map(_attribute_body, in_specs=("b c", "f/tp c"), out_specs="b f/tp", mesh=mesh)
    torch._dynamo.reset()
    got, (gw,) = _grads(lambda w: torch.compile(step, backend="aot_eager")(x, w), [w_whole[rows]])
    want, (ww,) = _grads(lambda w: _attribute_body(x, w), [w_whole])
    torch.testing.assert_close(got, want[:, rows])
    torch.testing.assert_close(gw, ww[rows])


@pytest.mark.ranks(2, timeout=600)
def test_compiled_formula_refuses_gradient_duties():
    """Traced formulas reduce every gradient themselves: a duty (annotated or registered) would sum twice."""
    from einshard.params import ParameterState, register_parameter_state

    mesh = _tp_mesh()
    r = dist.get_rank()
    x, w = _randn(4, 3, seed=1), _randn(3, 5, seed=2)
    xl = x[2 * r : 2 * r + 2]
    annotated = "b/tp c, c h [param, grad=tp] -> b/tp h"
    with es.use_mesh(mesh):
        wp = torch.nn.Parameter(w.clone())
        torch._dynamo.reset()
        with es.count_communication() as stats, pytest.raises(Exception, match=r"operand 1 carries a gradient duty") as err:
            torch.compile(lambda a, b: es.einshard(annotated, a, b), fullgraph=True, backend="aot_eager")(xl, wp)
        assert annotated in str(err.value) and stats.calls == 0
        wr = torch.nn.Parameter(w.clone())
        register_parameter_state(wr, ParameterState.from_layout("c h", mesh=mesh, grad="tp"))
        plain = "b/tp c, c h -> b/tp h"
        torch._dynamo.reset()
        with pytest.raises(Exception, match=r"'b/tp c, c h -> b/tp h': operand 1 carries a gradient duty over \('tp',\)"):
            torch.compile(lambda a, b: es.einshard(plain, a, b), fullgraph=True, backend="aot_eager")(xl, wr)
        # without a duty the same formula compiles and matches eager, gradients included
        torch._dynamo.reset()
        _compare(lambda a, b: es.einshard(plain, a, b), [xl, w], "aot_eager")


def _first_call_compiled(fullgraph):
    """In a fresh process: compile a check_vma body before any eager call (no warm caches), compare with eager."""
    import differential

    es.set_checks(False)
    sc = differential.SCENARIOS["shard_map_transpose_T"]
    for variant in ("even", "uneven"):
        differential.check_in(sc, variant, "aot_eager", fullgraph=fullgraph)
    return True


@pytest.mark.parametrize("fullgraph", [True, False])
def test_compiles_before_any_eager_call(fullgraph):
    """Compiling a tracked body first in a process used to abort (``str.endswith`` in the in-place check with
    ``fullgraph=True``; "NYI SymInt equality" without)."""
    from einshard import testing

    assert testing.spawn(_first_call_compiled, 2, args=(fullgraph,), timeout=600, checks=False) == [True, True]


def test_common_subexpression_pass_keeps_collectives_apart():
    # AOTAutograd's CSE merges nodes with equal ops and inputs. Two collectives merged on some ranks only
    # (a rank whose empty block makes two inputs one node) leave that rank a collective short: all hang.
    import torch.distributed._functional_collectives  # noqa: F401  (registers the ops)
    import torch.fx as fx
    from torch._functorch.compile_utils import fx_graph_cse

    from einshard.core import _trace

    _trace.keep_collectives_apart()
    graph = fx.Graph()
    x = graph.placeholder("x")
    ops = (torch.ops._c10d_functional.all_reduce.default, torch.ops._c10d_functional.all_to_all_single.default)
    args = ((x, "sum", "0"), (x, [1, 1], [1, 1], "0"))
    graph.output(tuple(graph.call_function(op, a) for op, a in zip(ops, args) for _ in range(2)))
    kept = [n.target for n in fx_graph_cse(graph).nodes if n.op == "call_function"]
    assert kept == [op for op in ops for _ in range(2)]


@pytest.mark.ranks(2)
def test_called_again_with_other_split_shapes():
    # dynamo passes ints that changed since the last compile as dynamic values; plans take them as constants
    mesh = es.wrap_mesh(MeshSpec((2,), ("sp",)).build())
    rank = mesh.index("sp")
    step = torch.compile(lambda x, shapes: es.einshard("h n/sp d -> h/sp n d", x, shapes=shapes, mesh=mesh),
                         backend="aot_eager", fullgraph=True)
    for heads in ([1, 1], [2, 1], [3, 2], [0, 2]):
        whole = torch.randn(sum(heads), 4, 3, generator=torch.Generator().manual_seed(sum(heads)))
        got = step(whole[:, 2 * rank:2 * rank + 2], {"sp": {"n": [2, 2], "h": heads}})
        torch.testing.assert_close(got, whole[sum(heads[:rank]):sum(heads[:rank + 1])])


# -- tensor hooks in a compiled shard_map body ------------------------------------------------------------


class HookError(Exception):
    pass


def _double(g):
    return g * 2


_SEEN = []


def _record(g):  # a side effect: dynamo cannot trace it into the graph (a graph break; fullgraph refuses)
    _SEEN.append(g.shape)


def _raise(g):
    raise HookError("raised by the hook")


HOOKS = {"double": _double, "record": _record, "raise": _raise}


def _hooked_mlp(p, x, *, hook):
    h = torch.tanh(es.einshard("b c, f/tp c -> b f/tp", x, p["w1"]))
    h.register_hook(hook)
    return es.einshard("b f/tp, c f/tp -> b c", h, p["w2"])


def _whole_mlp(p, x, *, hook):
    h = torch.tanh(x @ p["w1"].T)
    h.register_hook(hook)
    return h @ p["w2"].T


def _outcome(fn, params, x, hook):
    """``(output, gradients)`` of ``fn`` on copies of ``params``, or the type of what it raised (forward or
    backward)."""
    p = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    try:
        out = fn(p, x, hook=HOOKS[hook])
        out.square().sum().backward()
    except Exception as exc:  # noqa: BLE001 (the outcome compared)
        return type(exc)
    return out.detach(), {k: v.grad for k, v in p.items()}


@pytest.mark.ranks(2, timeout=900)
@pytest.mark.parametrize("f, vma", [  # the default run takes each value once; the other two pairs: -m matrix
    pytest.param(8, True, id="even-vma"), pytest.param(7, False, id="uneven-per-rank"),
    pytest.param(8, False, id="even-per-rank", marks=pytest.mark.matrix),
    pytest.param(7, True, id="uneven-vma", marks=pytest.mark.matrix)])
def test_a_tensor_hook_in_a_compiled_shard_map_body_runs_as_in_one_process(vma, f):
    """``h.register_hook(fn)`` on an intermediate of a compiled body: the outcome of the same compiled
    function on whole tensors in one process (float64). A hook that modifies the gradient modifies it; one
    dynamo cannot trace (a side effect) or that raises makes dynamo run the call eagerly (fullgraph=True
    refuses, as for one process), where the hook runs in backward, and its exception reaches the caller
    from backward; the next step is exact. Dynamo used to fail inside einshard's eager call
    (InternalTorchDynamoError, reading the variance tags as plain Python)."""
    mesh = _tp_mesh()
    r = dist.get_rank()
    splits = [4, f - 4]
    sl = slice(sum(splits[:r]), sum(splits[:r + 1]))
    whole = {"w1": _randn(f, 6, seed=1), "w2": _randn(6, f, seed=2)}
    x = _randn(3, 6, seed=3)
    local = {"w1": whole["w1"][sl], "w2": whole["w2"][:, sl]}
    step = es.shard_map(_hooked_mlp, ({"w1": "f/tp c", "w2": "c f/tp"}, "b c"), "b c", mesh=mesh, check_vma=vma,
                        shapes={"tp": {"f": splits}})
    for hook in HOOKS:
        for fullgraph in (False, True):
            torch._dynamo.reset()
            want = _outcome(torch.compile(_whole_mlp, backend="aot_eager", fullgraph=fullgraph), whole, x, hook)
            torch._dynamo.reset()
            _SEEN.clear()
            got = _outcome(torch.compile(step, backend="aot_eager", fullgraph=fullgraph), local, x, hook)
            if isinstance(want, type):
                assert got is want, (hook, fullgraph, got, want)
                continue
            assert not isinstance(got, type), (hook, fullgraph, got)
            torch.testing.assert_close(got[0], want[0])
            torch.testing.assert_close(got[1]["w1"], want[1]["w1"][sl])
            torch.testing.assert_close(got[1]["w2"], want[1]["w2"][:, sl])
            assert hook != "record" or _SEEN == [(3, splits[r])]
    # after a backward the hook broke off, a step with a gradient-modifying hook is exact
    torch._dynamo.reset()
    got = _outcome(torch.compile(step, backend="aot_eager"), local, x, "double")
    want = _outcome(_whole_mlp, whole, x, "double")
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1]["w1"], want[1]["w1"][sl])
