"""Ring and Ulysses attention (``einshard.attention.sequence_parallel``) against attention on whole tensors in one process.

Every rank builds the same whole ``Q``, ``K``, ``V`` (float64), takes its
block of the sequence (contiguous or zigzag, even or uneven), runs the layer
and compares its block of the output and of the gradients of ``q``, ``k``,
``v`` with plain softmax attention on the whole tensors, to 1e-12. Meshes:
``sp`` of 2 and 4 ranks, and ``dp x sp`` (the batch split over ``dp`` too);
eager (under ``es.use_mesh`` and in ``shard_map`` with and without variance
tracking) and compiled (``torch.compile(backend="aot_eager")``). The ring's
overlap is shown by the order of operations: every transfer is started before
the block computed while it travels, and waited for after that block's
matmuls.
"""

from __future__ import annotations

import doctest

import pytest
import torch
import torch.distributed as dist
import torch.nn.attention
import torch.nn.functional as F
from torch._dynamo.testing import AotEagerAndRecordGraphs
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

import einshard as es
from einshard.attention import kernels as attention_kernels, sequence_parallel as attention
from einshard.comm import collectives as C
from einshard.core._split import compute_split_shapes
from einshard.attention import from_zigzag, to_zigzag, zigzag_indices, zigzag_shapes
from einshard.testing import MeshSpec

DT = torch.float64
TOL = dict(rtol=0, atol=1e-12)
# float32 through the fused kernel (CPU flash) against F.scaled_dot_product_attention on the whole tensors (the
# same kernel): blocks merged in another order, so rounding differs; torch's own float32 default tolerance
FUSED_TOL = dict(rtol=1.3e-6, atol=1e-5)
LAYERS = {"ring": es.attention.ring_attention, "ulysses": es.attention.ulysses_attention}
# (causal, layout, uneven): every combination the layers support
CASES = [(False, "contiguous", False), (False, "contiguous", True), (True, "contiguous", False),
         (True, "contiguous", True), (True, "zigzag", False), (True, "zigzag", True), (False, "zigzag", True)]


def _whole(n: int, seed: int = 0, batch: int = 2, heads: int = 3, d: int = 4, e: int = 5, dtype=DT, kv_heads=None):
    """Q, K, V and the cotangent; K and V with ``kv_heads`` heads (grouped-query attention) if given."""
    g = torch.Generator().manual_seed(seed)
    kv = heads if kv_heads is None else kv_heads
    return [torch.randn(batch, h, n, w, generator=g, dtype=DT).to(dtype)
            for h, w in ((heads, d), (kv, d), (kv, e), (heads, e))]


def _documents(n: int) -> list:
    """A packing of ``n`` positions into documents (one of them empty)."""
    return [n // 4, 0, n - n // 4 - 1, 1]


def _reference(Q, K, V, G, causal: bool, documents=None):
    """Attention on whole tensors: the output and the gradients of Q, K, V for cotangent G. Plain softmax
    attention in float64; ``F.scaled_dot_product_attention`` (its fused kernel) in lower precision.
    ``documents``: each document attended on its own."""
    Q, K, V = (t.clone().requires_grad_() for t in (Q, K, V))
    bounds = [0]
    for length in documents or [Q.shape[2]]:
        bounds.append(bounds[-1] + length)
    O = torch.cat([_attend_whole(Q[:, :, a:b], K[:, :, a:b], V[:, :, a:b], causal)
                   for a, b in zip(bounds, bounds[1:]) if b > a], 2)
    O.backward(G)
    return O.detach(), Q.grad, K.grad, V.grad


def _attend_whole(Q, K, V, causal: bool):
    groups = Q.shape[1] // K.shape[1]
    if Q.dtype != DT:
        return F.scaled_dot_product_attention(Q, K, V, is_causal=causal, enable_gqa=groups > 1)
    K, V = K.repeat_interleave(groups, 1), V.repeat_interleave(groups, 1)  # grouped-query: head i uses i // groups
    s = Q @ K.transpose(-1, -2) * Q.shape[-1] ** -0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ V


def _positions(n: int, size: int, block: int, layout: str, uneven: bool):
    """``(global positions this block holds, shapes= to pass)``."""
    if layout == "zigzag":
        shapes = zigzag_shapes(n, size)
        order = zigzag_indices(n, size)
    else:
        shapes = compute_split_shapes(n, size) if uneven else [n // size] * size
        order = torch.arange(n)
    start = sum(shapes[:block])
    return order[start:start + shapes[block]], (shapes if uneven else None)


def _length(size: int, uneven: bool) -> int:
    return 4 * size + 3 if uneven else 4 * size


def _check(layer, mesh, causal, layout, uneven, run=None, batch_dim=None, dim="sp", dtype=DT, heads=(3, None),
           packed=False):
    """One case on this rank: the layer's block of the output and gradients against the whole reference.

    ``run(fn, q, k, v, g)``: how to call ``fn(q, k, v)`` and backpropagate ``g`` (default: under
    ``es.use_mesh``); ``batch_dim``: the mesh dimension that splits the batch too; ``dim``: the one
    that splits the sequence; ``dtype``: float64 (the exact path, to 1e-12) or float32 (the fused kernel,
    against ``F.scaled_dot_product_attention`` on the whole tensors to ``FUSED_TOL``); ``heads``: of ``q``,
    and of ``k`` and ``v`` (``None``: as many).
    """
    size, block = mesh.size(dim), mesh.index(dim)
    n = _length(size, uneven) if dtype == DT else 40 * size + 3 * uneven  # longer blocks for the kernel
    widths = {} if dtype == DT else dict(d=8, e=8)
    Q, K, V, G = _whole(n, dtype=dtype, heads=heads[0], kv_heads=heads[1], **widths)
    documents = _documents(n) if packed else None
    O, dQ, dK, dV = _reference(Q, K, V, G, causal, documents)
    pos, shapes = _positions(n, size, block, layout, uneven)
    rows = slice(None)
    if batch_dim is not None:
        i = mesh.index(batch_dim)
        rows = slice(i, i + 1)  # batch 2 over 2 ranks
    q, k, v, g = (t[rows][:, :, pos].clone() for t in (Q, K, V, G))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def fn(q, k, v):
        return LAYERS[layer](q, k, v, dim, causal=causal, layout=layout, shapes=shapes,
                             **({"documents": documents} if packed else {}))

    if run is None:
        with es.use_mesh(mesh):
            o = fn(q, k, v)
        o.backward(g)
    else:
        o = run(fn, q, k, v, g)
    what = f"{layer} causal={causal} {layout} uneven={uneven} packed={packed} {dtype}"
    for name, got, want in (("out", o, O), ("dq", q.grad, dQ), ("dk", k.grad, dK), ("dv", v.grad, dV)):
        torch.testing.assert_close(got, want[rows][:, :, pos], **(TOL if dtype == DT else FUSED_TOL),
                                   msg=lambda m: f"{what} {name}: {m}")


# -- values and gradients, eager -------------------------------------------------------------------


@pytest.mark.parametrize("layer", ["ring", "ulysses"])
@pytest.mark.parametrize("size", [pytest.param(n, marks=pytest.mark.ranks(n)) for n in (2, 4)])
def test_layers_match_whole_attention(layer, size):
    mesh = es.wrap_mesh(MeshSpec((size,), ("sp",)).build())
    for causal, layout, uneven in CASES:
        _check(layer, mesh, causal, layout, uneven)


@pytest.mark.parametrize("size", [pytest.param(n, marks=pytest.mark.ranks(n)) for n in (1, 2, 4)])
def test_ring_on_the_fused_kernel_matches_whole_sdpa(size):
    # float32 on CPU: every block pair through aten._scaled_dot_product_flash_attention_for_cpu and its backward
    assert attention_kernels.kernel("cpu", torch.float32, 8, 8).name == "cpu_flash"
    mesh = es.wrap_mesh(MeshSpec((size,), ("sp",)).build())
    for causal, layout, uneven in CASES:
        _check("ring", mesh, causal, layout, uneven, dtype=torch.float32)


@pytest.mark.ranks(2)
@pytest.mark.parametrize("layer", ["ring", "ulysses"])
def test_grouped_query_attention_matches_whole_attention(layer, monkeypatch):
    # 6 query heads, 2 key/value heads: q head i attends with k/v head i // 3 (enable_gqa=True)
    sent = []
    original = C.isend_irecv

    def recording(sends, recvs, *args, **kwargs):
        sent.extend(tuple(t.shape) for _, t in sends)
        return original(sends, recvs, *args, **kwargs)

    monkeypatch.setattr(C, "isend_irecv", recording)
    mesh = es.wrap_mesh(MeshSpec((2,), ("sp",)).build())
    for dtype in (DT, torch.float32):
        for causal, layout, uneven in CASES:
            _check(layer, mesh, causal, layout, uneven, dtype=dtype, heads=(6, 2))
    if layer == "ring":  # keys and values travel with their own 2 heads, not repeated to 6
        assert sent and all(shape[1] == 2 for shape in sent), sent


def _positions_2d(n: int, mesh, layout: str, uneven: bool):
    """2-D: ``(positions this rank holds, shapes=)``: ring blocks over ``cp`` (contiguous or zigzag), each split
    contiguously over ``sp``; ``shapes`` in ``cp-sp`` order."""
    rings, uly = mesh.size("cp"), mesh.size("sp")
    if layout == "zigzag":
        order, ring_lengths = zigzag_indices(n, rings), zigzag_shapes(n, rings)
    else:
        order, ring_lengths = torch.arange(n), compute_split_shapes(n, rings)
    shapes = [s for length in ring_lengths for s in compute_split_shapes(length, uly)]
    block = mesh.index("cp") * uly + mesh.index("sp")
    start = sum(shapes[:block])
    return order[start:start + shapes[block]], (shapes if uneven else None)


@pytest.mark.ranks(4)
def test_2d_ring_over_one_dimension_ulysses_over_another():
    mesh = es.wrap_mesh(MeshSpec((2, 2), ("cp", "sp")).build())
    for dtype, heads in ((DT, (3, None)), (DT, (4, 2)), (torch.float32, (4, 2))):
        for causal, layout, uneven in CASES:
            n = (_length(4, uneven) if dtype == DT else 160 + 3 * uneven)
            Q, K, V, G = _whole(n, dtype=dtype, heads=heads[0], kv_heads=heads[1],
                                **({} if dtype == DT else dict(d=8, e=8)))
            documents = _documents(n) if heads[1] else None  # packed documents with the grouped heads
            O, dQ, dK, dV = _reference(Q, K, V, G, causal, documents)
            pos, shapes = _positions_2d(n, mesh, layout, uneven)
            q, k, v = (t[:, :, pos].clone().requires_grad_() for t in (Q, K, V))
            with es.use_mesh(mesh):
                o = es.attention.ring_attention(q, k, v, "cp", ulysses="sp", causal=causal, layout=layout, shapes=shapes,
                                      documents=documents)
            o.backward(G[:, :, pos])
            what = f"2-D {dtype} heads={heads} documents={documents} causal={causal} {layout} uneven={uneven}"
            for name, got, want in (("out", o, O), ("dq", q.grad, dQ), ("dk", k.grad, dK), ("dv", v.grad, dV)):
                torch.testing.assert_close(got, want[:, :, pos], **(TOL if dtype == DT else FUSED_TOL),
                                           msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.ranks(2)
@pytest.mark.parametrize("layer", ["ring", "ulysses"])
def test_packed_sequences_attend_within_their_documents(layer):
    mesh = es.wrap_mesh(MeshSpec((2,), ("sp",)).build())
    for dtype in (DT, torch.float32):
        for causal, layout, uneven in CASES:
            _check(layer, mesh, causal, layout, uneven, dtype=dtype, packed=True)


def test_packed_pairs_are_cut_at_document_bounds():
    # zigzag over 2 ranks of 16 positions: rank 0 holds chunks 0 (0-3) and 3 (12-15); documents 0-5, 6-15
    pairs = attention._document_pairs(((0, 4, 0), (12, 4, 4)), ((0, 4, 0), (12, 4, 4)), True, (6, 10))
    assert pairs == ((0, 4, 0, 4, True), (4, 4, 4, 4, True))  # 12-15 sees not 0-3: another document
    assert attention._document_pairs(((4, 4, 0),), ((0, 4, 0),), True, (6, 10)) == ((0, 2, 0, 4, False),)


@pytest.mark.ranks(4, timeout=600)  # compiles: minutes on a loaded 2-core machine
@pytest.mark.matrix  # the default run compiles the ring and Ulysses each on one dimension (below)
def test_2d_ring_compiles_fullgraph():
    mesh = es.wrap_mesh(MeshSpec((2, 2), ("cp", "sp")).build())
    n = 19
    Q, K, V, G = _whole(n, heads=4, kv_heads=2)
    O, dQ, dK, dV = _reference(Q, K, V, G, True, _documents(n))
    pos, shapes = _positions_2d(n, mesh, "zigzag", True)
    q, k, v = (t[:, :, pos].clone().requires_grad_() for t in (Q, K, V))

    def step(q, k, v):
        with es.use_mesh(mesh):
            return es.attention.ring_attention(q, k, v, "cp", ulysses="sp", causal=True, layout="zigzag", shapes=shapes,
                                     documents=_documents(n))

    torch._dynamo.reset()
    o = torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v)
    o.backward(G[:, :, pos])
    for got, want in ((o, O), (q.grad, dQ), (k.grad, dK), (v.grad, dV)):
        torch.testing.assert_close(got, want[:, :, pos], **TOL)


@pytest.mark.ranks(4)
@pytest.mark.parametrize("check_vma", [True, False])
def test_2d_ring_in_shard_map(check_vma):
    mesh = es.wrap_mesh(MeshSpec((2, 2), ("cp", "sp")).build())
    n = 16
    Q, K, V, G = _whole(n, heads=4, kv_heads=2)
    O, dQ, dK, dV = _reference(Q, K, V, G, True)
    order = zigzag_indices(n, 2)  # zigzag blocks over cp, each split over sp: contiguous blocks over cp-sp
    q, k, v = (t[:, :, order].clone().requires_grad_() for t in (Q, K, V))

    def body(q, k, v):
        o = es.attention.ring_attention(q, k, v, "cp", ulysses="sp", causal=True, layout="zigzag")
        if check_vma:
            assert es.spmd.get_vma(o) == frozenset({"cp", "sp"})
        return o

    attend = es.shard_map(body, in_specs=("b h n d -> b h n/cp-sp d",) * 3, out_specs="b h n/cp-sp d -> b h n d",
                          mesh=mesh, check_vma=check_vma)
    o = attend(q, k, v)
    o.backward(G[:, :, order])
    for got, want in ((o, O), (q.grad, dQ), (k.grad, dK), (v.grad, dV)):
        torch.testing.assert_close(got, want[:, :, order], **TOL)


_PERMUTED: dict = {}


def _permuted(ranks, names):
    """A wrapped mesh on a permuted rank tensor (group ranks are not block order), built once per process."""
    key = (str(ranks), names)
    if key not in _PERMUTED or _PERMUTED[key][0] is not dist.group.WORLD:
        _PERMUTED[key] = (dist.group.WORLD, es.wrap_mesh(DeviceMesh("cpu", torch.tensor(ranks), mesh_dim_names=names)))
    return _PERMUTED[key][1]


@pytest.mark.ranks(4)
@pytest.mark.parametrize("layer", ["ring", "ulysses"])
def test_layers_on_permuted_meshes_and_compound_dimensions(layer):
    for mesh, dim in ((_permuted([3, 1, 0, 2], ("sp",)), "sp"), (_permuted([[0, 2], [1, 3]], ("dp", "sp")), "dp-sp")):
        assert mesh.order(dim) is not None  # blocks are not in group-rank order: the ring must translate
        for causal, layout, uneven in CASES:
            _check(layer, mesh, causal, layout, uneven, dim=dim)
    if layer == "ring":  # and the zigzag conversions' exchange
        _check_zigzag(_permuted([3, 1, 0, 2], ("sp",)), 19, True, False)


def _shard_map_run(mesh, check_vma, compile_=False):
    """Call the layer in a ``shard_map`` body; backward outside. With variance tracking the output meets a
    replicated weight, whose gradient is then summed over ``dp`` and ``sp``."""
    weighted = check_vma

    def run(fn, q, k, v, g):
        w = torch.ones(v.shape[-1], dtype=DT, requires_grad=True)

        def body(q, k, v, w, g):
            o = fn(q, k, v)
            return ((o * w if weighted else o) * g).sum()  # partial over dp and sp

        b, dims = ("b/dp", "dp-sp") if "dp" in mesh.names else ("b", "sp")
        step = es.shard_map(body, in_specs=(f"{b} h n/sp d",) * 2 + (f"{b} h n/sp e", "e", f"{b} h n/sp e"),
                            out_specs=f"// {dims} -> ", mesh=mesh, check_vma=check_vma)
        if compile_:
            step = torch.compile(step, backend="aot_eager", fullgraph=True)
        step(q, k, v, w, g).backward()
        with torch.no_grad():
            o = fn(q, k, v)
        if weighted:  # sum(o * g) over the whole tensors
            want = es.spmd.psum((o * g).sum((0, 1, 2)), mesh.names, mesh=mesh)
            torch.testing.assert_close(w.grad, want, **TOL)
        return o

    return run


@pytest.mark.ranks(4)
@pytest.mark.parametrize("layer", ["ring", "ulysses"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_layers_in_shard_map_on_a_2d_mesh(layer, check_vma):
    mesh = es.wrap_mesh(MeshSpec((2, 2), ("dp", "sp")).build())
    run = _shard_map_run(mesh, check_vma)
    with es.use_mesh(mesh):  # the reference output call inside run() needs the mesh
        for causal, layout, uneven in CASES:
            _check(layer, mesh, causal, layout, uneven, run=run, batch_dim="dp")


@pytest.mark.ranks(4)
def test_outputs_vary_over_the_sequence_dimension_and_the_batch_one():
    mesh = es.wrap_mesh(MeshSpec((2, 2), ("dp", "sp")).build())
    seen = []

    @es.shard_map(("b/dp h n/sp d", "h n/sp d"), "// dp-sp", mesh=mesh)
    def f(x, y):
        for t in (x, y):
            seen.extend(es.spmd.get_vma(layer(t, t, t, "sp")) for layer in LAYERS.values())
        return x.sum()

    f(torch.randn(1, 2, 3, 4, dtype=DT), torch.randn(2, 3, 4, dtype=DT))
    assert seen == [frozenset({"dp", "sp"})] * 2 + [frozenset({"sp"})] * 2


# -- compiled ---------------------------------------------------------------------------------------


@pytest.mark.ranks(4, timeout=600)  # compiles: minutes on a loaded 2-core machine
@pytest.mark.parametrize("check_vma", [True, pytest.param(False, marks=pytest.mark.matrix)])  # (the long matrix: -m matrix)
def test_ring_attention_compiles_fullgraph_in_shard_map(check_vma):
    # no replicated weight in the compiled body: a traced body multiplying varying data by an invariant
    # tensor that requires grad fails in einshard.runtime.vma's tracking under dynamo (str.endswith on the op's
    # name in _is_inplace), with or without these layers
    mesh = es.wrap_mesh(MeshSpec((2, 2), ("dp", "sp")).build())
    run = _shard_map_run(mesh, check_vma, compile_=True)
    with es.use_mesh(mesh):
        for causal, layout, uneven in (CASES[1], CASES[5]):
            torch._dynamo.reset()
            _check("ring", mesh, causal, layout, uneven, run=run, batch_dim="dp")


def run_on(mesh):
    """Call the layer compiled (``fullgraph=True``) under ``es.use_mesh(mesh)``."""

    def run(fn, q, k, v, g):
        def step(q, k, v):
            with es.use_mesh(mesh):
                return fn(q, k, v)

        o = torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v)
        o.backward(g)
        return o

    return run


@pytest.mark.parametrize("size", [pytest.param(2, marks=pytest.mark.ranks(2, timeout=600)),
                                  pytest.param(4, marks=[pytest.mark.ranks(4, timeout=600), pytest.mark.matrix])])
def test_ring_attention_compiles_fullgraph_under_use_mesh(size):
    mesh = es.wrap_mesh(MeshSpec((size,), ("sp",)).build())
    run = run_on(mesh)
    for causal, layout, uneven in (CASES[0], CASES[3], CASES[5]):
        torch._dynamo.reset()
        _check("ring", mesh, causal, layout, uneven, run=run)
    torch._dynamo.reset()  # the fused kernel's ops in the graph, on a packed sequence's cut block pairs
    _check("ring", mesh, True, "zigzag", True, run=run, dtype=torch.float32, packed=True)
    single = es.wrap_mesh(MeshSpec((size, 1), ("dp", "sp")).build())  # a ring of one rank: no transfers
    torch._dynamo.reset()
    _check("ring", single, True, "zigzag", True, run=run_on(single))


@pytest.mark.ranks(4, timeout=600)  # compiles: minutes on a loaded 2-core machine
@pytest.mark.parametrize("check_vma", [True, pytest.param(False, marks=pytest.mark.matrix)])
def test_ulysses_attention_compiles_in_shard_map(check_vma):
    mesh = es.wrap_mesh(MeshSpec((2, 2), ("dp", "sp")).build())
    run = _shard_map_run(mesh, check_vma, compile_=True)
    with es.use_mesh(mesh):
        torch._dynamo.reset()
        _check("ulysses", mesh, *CASES[5], run=run, batch_dim="dp")  # causal, zigzag, uneven
    mesh = es.wrap_mesh(MeshSpec((4,), ("sp",)).build())  # 4 ranks of sp: 3 heads over 4 (one rank has none)
    run = _shard_map_run(mesh, check_vma, compile_=True)
    with es.use_mesh(mesh):
        torch._dynamo.reset()
        _check("ulysses", mesh, *CASES[1], run=run)  # not causal, contiguous, uneven


def test_the_fused_ops_have_the_signatures_the_kernels_call():
    for name, args in attention_kernels.FUSED_OPS.items():
        op = getattr(torch.ops.aten, name).default
        assert tuple(a.name for a in op._schema.arguments) == args, (name, op._schema)


def test_kernel_choice_follows_device_dtype_and_head_sizes(monkeypatch):
    kernel = attention_kernels.kernel
    assert kernel("cpu", torch.float32, 8, 8).name == "cpu_flash"
    assert kernel("cpu", torch.bfloat16, 64, 64).name == "cpu_flash"
    assert kernel("cpu", torch.float64, 8, 8) is attention_kernels.EXACT  # float64: the exact path
    assert kernel("cpu", torch.float32, 8, 5) is attention_kernels.EXACT  # no fused kernel for d != e
    assert kernel("cpu", torch.float32, 8, 8, groups=3).name == "cpu_flash"  # grouped heads: native
    assert kernel("cpu", torch.float64, 8, 8, groups=3).name == "exact (kv heads repeated x3 per block)"
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):  # what F.sdpa would run
        assert kernel("cpu", torch.float32, 8, 8) is attention_kernels.EXACT
    monkeypatch.setattr(attention_kernels, "_USABLE", set())  # a torch whose ops differ: the exact path
    assert kernel("cpu", torch.float32, 8, 8) is attention_kernels.EXACT


# -- the zigzag layout ------------------------------------------------------------------------------


def test_zigzag_indices_and_shapes():
    assert zigzag_indices(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert zigzag_indices(12, 3).tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    assert zigzag_shapes(7, 2) == [3, 4] and zigzag_shapes(5, 4) == [1, 1, 1, 2]
    for n, p in ((7, 2), (5, 4), (19, 4), (0, 3)):
        assert sorted(zigzag_indices(n, p).tolist()) == list(range(n))
        assert sum(zigzag_shapes(n, p)) == n


def _check_zigzag(mesh, n, uneven, compiled):
    size, block = mesh.size("sp"), mesh.index("sp")
    X, G = (torch.randn(2, n, 3, generator=torch.Generator().manual_seed(s), dtype=DT) for s in (1, 2))
    contiguous = compute_split_shapes(n, size) if uneven else [n // size] * size
    zz = zigzag_shapes(n, size)
    c0, z0 = sum(contiguous[:block]), sum(zz[:block])
    mine = zigzag_indices(n, size)[z0:z0 + zz[block]]
    x = X[:, c0:c0 + contiguous[block]].clone().requires_grad_()

    def there(x):
        return to_zigzag(x, "sp", axis=1, shapes=contiguous if uneven else None, mesh=mesh)

    def back(z):
        return from_zigzag(z, "sp", axis=1, shapes=zz if uneven else None, mesh=mesh)

    if compiled:
        there, back = (torch.compile(f, backend="aot_eager", fullgraph=True) for f in (there, back))
    z = there(x)
    torch.testing.assert_close(z, X[:, mine], rtol=0, atol=0)
    z.backward(G[:, mine])  # the adjoint: each gradient row back at its contiguous place
    torch.testing.assert_close(x.grad, G[:, c0:c0 + contiguous[block]], rtol=0, atol=0)
    y = back(z.detach())
    split = compute_split_shapes(n, size)
    s0 = sum(split[:block])
    torch.testing.assert_close(y, X[:, s0:s0 + split[block]], rtol=0, atol=0)


@pytest.mark.ranks(4, timeout=600)  # compiles: minutes on a loaded 2-core machine
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.matrix)])  # compiled zigzag
def test_to_and_from_zigzag(compiled):  # blocks: test_ulysses_attention_compiles_in_shard_map in the default run
    mesh = es.wrap_mesh(MeshSpec((4,), ("sp",)).build())
    for n, uneven in ((16, False), (8, False), (19, True), (5, True)):
        torch._dynamo.reset()
        _check_zigzag(mesh, n, uneven, compiled)


@pytest.mark.ranks(4)
def test_zigzag_conversion_on_a_2d_mesh_in_shard_map():
    mesh = es.wrap_mesh(MeshSpec((2, 2), ("dp", "sp")).build())
    X = torch.randn(2, 8, 3, dtype=DT, generator=torch.Generator().manual_seed(0))  # the same on every rank

    @es.shard_map("b n c -> b/dp n/sp c", "b/dp n/sp c -> b n c", mesh=mesh)
    def roundtrip(x):
        z = to_zigzag(x, "sp", axis=1)
        assert es.spmd.get_vma(z) == frozenset({"dp", "sp"})
        return from_zigzag(z * 2, "sp", axis=1)

    torch.testing.assert_close(roundtrip(X), 2 * X, rtol=0, atol=0)


# -- overlap: every transfer is in flight while a block computes --------------------------------------


class _Trace(TorchDispatchMode):
    """The order of matmuls and of the ring's transfers: ``("post", i)`` when batch ``i`` of point-to-point
    transfers has been started (``einshard.comm.collectives.isend_irecv``), ``("wait", i)`` when it is waited for."""

    def __init__(self):
        super().__init__()
        self.events = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.events.append((func.overloadpacket.__name__, None))
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self.original, events = C.isend_irecv, self.events

        def recording(*args, **kwargs):
            batch = sum(name == "post" for name, _ in events)
            works = [_Recorded(w, events, batch) for w in self.original(*args, **kwargs)]
            events.append(("post", batch))
            return works

        C.isend_irecv = recording
        return super().__enter__()

    def __exit__(self, *exc):
        C.isend_irecv = self.original
        return super().__exit__(*exc)


class _Recorded:
    """A ``Work`` whose ``wait`` is recorded."""

    def __init__(self, work, events, batch):
        self.work, self.events, self.batch = work, events, batch

    def wait(self, timeout=None):
        self.events.append(("wait", self.batch))
        return self.work.wait()


def _check_overlap(events, posts: int, final_exempt: bool):
    """Every batch of transfers is started before a block's matmuls and waited for after them."""
    names = [name for name, _ in events]
    assert names.count("post") == posts, names
    for batch in range(posts):
        start = events.index(("post", batch))
        end = events.index(("wait", batch))
        if final_exempt and batch == posts - 1:
            continue  # the last gradient's way home: nothing is left to compute
        between = names[start + 1:end]
        # the block's q k^T and p v (or their gradients), or one call of the fused kernel (or its backward)
        assert between.count("bmm") >= 2 or any(n.startswith(FLASH) for n in between), (batch, between)


FLASH = "_scaled_dot_product_flash_attention_for_cpu"


@pytest.mark.ranks(4)
@pytest.mark.parametrize("causal,layout,dtype", [(False, "contiguous", DT), (True, "zigzag", DT),
                                                 (True, "zigzag", torch.float32)])
def test_ring_transfers_overlap_the_block_computations(causal, layout, dtype):
    mesh = es.wrap_mesh(MeshSpec((4,), ("sp",)).build())
    q, k, v = (torch.randn(1, 2, 8, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    with es.use_mesh(mesh):
        with _Trace() as forward:
            o = es.attention.ring_attention(q, k, v, "sp", causal=causal, layout=layout)
        names = [name for name, _ in forward.events]
        assert ("bmm" in names) == (dtype == DT) and (FLASH in names) == (dtype != DT), names  # which path
        if dtype != DT:  # the math backend chosen for F.sdpa: the ring's exact path
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH), _Trace() as math:
                es.attention.ring_attention(q, k, v, "sp", causal=causal, layout=layout)
            assert "bmm" in [name for name, _ in math.events]
        _check_overlap(forward.events, 3, final_exempt=False)  # P - 1 transfers of keys and values
        with _Trace() as backward:
            o.backward(torch.ones_like(o))
        _check_overlap(backward.events, 3 + 4, final_exempt=True)  # keys and values again, gradients' 4 hops


@pytest.mark.ranks(2, timeout=600)  # compiles: minutes on a loaded 2-core machine
def test_compiled_ring_waits_after_the_block_computations():
    mesh = es.wrap_mesh(MeshSpec((2,), ("sp",)).build())
    backend = AotEagerAndRecordGraphs()
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=DT, requires_grad=True) for _ in range(3))

    def step(q, k, v):
        with es.use_mesh(mesh):
            return es.attention.ring_attention(q, k, v, "sp")

    torch._dynamo.reset()
    torch.compile(step, backend=backend, fullgraph=True)(q, k, v).sum().backward()
    for graph in backend.fw_graphs + backend.bw_graphs:
        nodes = list(graph.graph.nodes)
        names = [str(n.target) for n in nodes]
        sends = [i for i, s in enumerate(names) if "all_to_all_single" in s]
        assert sends, names
        if graph in backend.fw_graphs:  # one transfer on 2 ranks: none of backward's moved here to be kept
            assert len(sends) == 1, names
        for i in sends:
            wait = next(j for j in range(i + 1, len(nodes)) if "wait_tensor" in names[j] and nodes[i] in
                        nodes[j].all_input_nodes)
            if i == sends[-1] and graph in backend.bw_graphs:
                continue  # the last gradient's way home
            assert sum("bmm" in s for s in names[i + 1:wait]) >= 2, ("backward" if graph in backend.bw_graphs else "forward", i, names)


# -- what raises ------------------------------------------------------------------------------------


@pytest.mark.ranks(2)
def test_refusals_before_any_transfer():
    mesh = es.wrap_mesh(MeshSpec((2,), ("sp",)).build())
    q = torch.randn(1, 2, 4, 3, dtype=DT)
    with es.use_mesh(mesh):
        for layer in LAYERS.values():
            with pytest.raises(ValueError, match="layout must be one of"):
                layer(q, q, q, "sp", layout="strided")
            with pytest.raises(ValueError, match="shapes has 3 entries"):
                layer(q, q, q, "sp", shapes=[4, 4, 4])
            with pytest.raises(ValueError, match="not in the mesh"):
                layer(q, q, q, "cp")
            with pytest.raises(ValueError, match="k must have q's shape"):
                layer(q, q[:, :, :3], q[:, :, :3], "sp")
            with pytest.raises(ValueError, match="one dtype"):
                layer(q, q.float(), q, "sp")
            with pytest.raises(ValueError, match="zigzag blocks of a 7-long sequence"):
                layer(q, q, q, "sp", layout="zigzag", shapes=[4, 3])
            with pytest.raises(ValueError, match=r"the documents' lengths \[3, 3\] sum to 6, but the sequence has 8"):
                layer(q, q, q, "sp", documents=[3, 3])
            with pytest.raises(ValueError, match="fewer heads .* that divide q's"):
                layer(q, q[:, :1].expand(1, 3, 4, 3), q[:, :1], "sp")
        with pytest.raises(ValueError, match="at least 3 dimensions"):
            es.attention.ulysses_attention(q[0, 0], q[0, 0], q[0, 0], "sp")
        with pytest.raises(ValueError, match="must be a torch.Tensor"):
            es.attention.ring_attention(q, None, q, "sp")


@pytest.mark.ranks(2)
def test_a_rank_whose_length_disagrees_raises_on_every_rank():
    # checks are on in the harness: the ranks agree before the ring starts, so none waits in it
    mesh = es.wrap_mesh(MeshSpec((2,), ("sp",)).build())
    n = 3 + dist.get_rank()  # 3 and 4 positions
    q = torch.randn(1, 2, n, 3, dtype=DT)
    with es.use_mesh(mesh):
        for layer in LAYERS.values():
            with pytest.raises(ValueError, match="holds 3 positions of the sequence, but shapes says 4"):
                layer(q, q, q, "sp", shapes=[4, 4])
            with pytest.raises(ValueError, match="lengths"):  # uneven blocks without shapes=
                layer(q, q, q, "sp")
        with pytest.raises(ValueError, match="lengths"):
            to_zigzag(q, "sp")


@pytest.mark.ranks(2)
def test_double_backward_through_the_ring_is_refused():
    mesh = es.wrap_mesh(MeshSpec((2,), ("sp",)).build())
    q = torch.randn(1, 2, 4, 3, dtype=DT, requires_grad=True)
    with es.use_mesh(mesh):
        o = es.attention.ring_attention(q, q, q, "sp")
    with pytest.raises(ValueError, match="double backward"):
        torch.autograd.grad(o.sum(), q, create_graph=True)
    (g,) = torch.autograd.grad(o.sum(), q)  # a first-order gradient still works after the refusal
    assert g.shape == q.shape


def test_docstring_examples():
    result = doctest.testmod(attention)
    assert result.failed == 0 and result.attempted >= 3



@pytest.mark.ranks(2, timeout=600)
@pytest.mark.parametrize("layer", ["ring", "ulysses"])
def test_self_attention_on_one_tensor_compiles_fullgraph(layer):
    """``fn(x, x, x)`` (one tensor as query, key and value) under ``torch.compile(fullgraph=True)``: equal to
    attention on the whole tensor, its gradient the sum of the three uses (dynamo refused one tensor passed
    twice to an autograd Function)."""
    mesh = es.wrap_mesh(MeshSpec((2,), ("sp",)).build())
    X, _, _, G = _whole(10, heads=2, d=4, e=4)
    O, gq, gk, gv = _reference(X, X, X, G, causal=True)
    x = es.tree_shard(X, "b h n/sp d", mesh=mesh).requires_grad_()
    g = es.tree_shard(G, "b h n/sp d", mesh=mesh)

    def step(t):
        return LAYERS[layer](t, t, t, "sp", causal=True, mesh=mesh)

    torch._dynamo.reset()
    o = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    o.backward(g)
    torch.testing.assert_close(es.tree_gather(o.detach(), "b h n/sp d", mesh=mesh), O, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(es.tree_gather(x.grad, "b h n/sp d", mesh=mesh), gq + gk + gv,
                               rtol=1e-12, atol=1e-12)
