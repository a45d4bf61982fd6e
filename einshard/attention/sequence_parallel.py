"""Attention over a sequence split across ranks: ring attention and Ulysses (all-to-all) attention.

Both layers take this rank's block of queries, keys and values, ``(..., n, d)``
with the sequence ``n`` split over one (possibly compound) mesh dimension, and
return this rank's block of the attention output, the same as
``F.scaled_dot_product_attention`` on the whole sequence would give:

- :func:`ring_attention`: keys and values travel around the ring of the
  dimension's ranks, one block per step, while the current block is
  computed (the next transfer is started before the block's matmuls and
  waited for after them); blocks are combined with an online log-sum-exp
  softmax. A rank holds one block of scores at a time, never the whole
  sequence's keys. Backward runs the ring again (keys and values travel once
  more, their gradients travel with them and arrive home at the end), so
  nothing of the size of the sequence is saved.
- :func:`ulysses_attention`: one all-to-all swaps the sequence split for a
  split of the heads (``... h n/sp d -> ... h/sp n d``, an ``es.einshard``
  formula), attention runs on whole sequences, and a second all-to-all swaps
  back. Backward is the formulas' adjoints.

Causal attention on contiguous blocks leaves most of the work to the last
ranks; the *zigzag* layout cuts the sequence into ``2 * P`` chunks and gives
rank ``r`` chunks ``r`` and ``2P - 1 - r``, so every rank does the same work.
:func:`zigzag_indices` orders a whole sequence that way (then split it
contiguously with :func:`zigzag_shapes`); :func:`to_zigzag` and
:func:`from_zigzag` convert distributed blocks.

Eager transfers are batched ``isend``/``irecv`` (:func:`einshard.comm.collectives.isend_irecv`);
under ``torch.compile`` each is a functional ``all_to_all_single`` whose wait
stands after the block's computation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..comm import checks as _checks
from ..comm import collectives as C
from ..comm.exchange import Exchange
from ..comm.mesh import resolve_mesh
from ..core import _context, _torch_compat, _trace
from ..core._cache import BoundedCache
from ..core._split import compute_split_shapes, is_size
from ..core._torch_compat import compile_in_progress
from ..errors import EinshardError
from ..ops.einshard import einshard
from ..runtime import vma as _vma
from .kernels import enabled_backends
from .kernels import kernel as kernel_for

__all__ = ["ring_attention", "ulysses_attention", "zigzag_shapes", "zigzag_indices", "to_zigzag", "from_zigzag"]

_functional = _torch_compat.c10d_functional  # functional collectives as graph nodes: start, and wait where needed
LAYOUTS = ("contiguous", "zigzag")


# -- sequence layouts ---------------------------------------------------------------------------


def _zigzag_chunks(n: int, size: int) -> list[int]:
    """The ``2 * size`` chunk lengths of a zigzag layout: as even as possible, the longer ones first."""
    k = 2 * size
    return [n // k + (i < n % k) for i in range(k)]


def zigzag_shapes(n: int, size: int) -> list[int]:
    """How many positions of an ``n``-long sequence each of ``size`` ranks holds in the zigzag layout.

    >>> zigzag_shapes(10, 2)
    [5, 5]
    >>> zigzag_shapes(7, 2)
    [3, 4]
    """
    c = _zigzag_chunks(n, size)
    return [c[r] + c[2 * size - 1 - r] for r in range(size)]


def zigzag_indices(n: int, size: int, device=None) -> torch.Tensor:
    """The positions of an ``n``-long sequence in zigzag order: rank 0's block first, then rank 1's, ...

    ``x[..., zigzag_indices(n, P), :]`` reorders a whole sequence so that its
    contiguous blocks of :func:`zigzag_shapes` are the zigzag blocks (rank
    ``r``: chunks ``r`` and ``2P - 1 - r`` of ``2P``).

    >>> zigzag_indices(8, 2).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    order = [p for block in _blocks("zigzag", zigzag_shapes(n, size)) for start, length, _ in block
             for p in range(start, start + length)]
    return torch.tensor(order, dtype=torch.long, device=device)


def _blocks(layout: str, lengths) -> tuple:
    """Per block: its chunks ``(global start, length, offset in the block)``, in storage order, empty ones left out."""
    if layout == "contiguous":
        out: list[tuple] = []
        start = 0
        for n in lengths:
            out.append(((start, n, 0),) if n else ())
            start += n
        return tuple(out)
    size = len(lengths)
    chunks = _zigzag_chunks(sum(lengths), size)
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    out = []
    for r in range(size):
        a, b = r, 2 * size - 1 - r
        out.append(tuple((starts[i], chunks[i], off) for i, off in ((a, 0), (b, chunks[a])) if chunks[i]))
    return tuple(out)


def _shapes_arg(what: str, shapes):
    """``shapes=`` as a tuple of lengths (``None`` stays)."""
    if shapes is None:
        return None
    if isinstance(shapes, (str, bytes)) or not hasattr(shapes, "__len__") or not all(is_size(s) for s in shapes):
        raise EinshardError(f"{what}: shapes must be a list of per-rank sequence lengths, got {shapes!r}")
    return tuple(int(s) for s in shapes)


class _Sequence:
    """A sequence split over a mesh dimension, seen from this rank.

    ``size`` ranks, this rank's ``block``, the ``group`` (``None`` for one
    rank) and the group rank holding each block (``ranks``), every block's
    ``lengths`` (``shapes=``, or this rank's length everywhere) and ``chunks``
    (:func:`_blocks`); ``error``: a rank-local problem (this rank's length
    differs from ``shapes``), raised on every rank before communicating.
    """

    __slots__ = ("what", "size", "block", "group", "ranks", "label", "layout", "lengths", "chunks", "error")

    def __init__(self, what: str, mesh, dim, layout: str, local: int, shapes):
        if layout not in LAYOUTS:
            raise EinshardError(f"{what}: layout must be one of {list(LAYOUTS)}, got {layout!r}")
        try:
            dims = mesh.dims(dim)
        except EinshardError as err:
            raise EinshardError(f"{what}: {err}") from None
        self.what, self.layout, self.label = what, layout, mesh.label(dims)
        self.size, self.block = size, block = mesh.size(dims), mesh.index(dims)
        order = mesh.order(dims) if size > 1 else None
        self.ranks = tuple(range(size)) if order is None else tuple(order)
        self.group = mesh.group(dims) if size > 1 else None
        self.error = None
        if shapes is None:
            lengths = [local] * size
        else:
            lengths = list(shapes)
            if len(lengths) != size:
                raise EinshardError(f"{what}: shapes has {len(lengths)} entries but mesh dimension {self.label!r} "
                                    f"has {size} ranks")
            if lengths[block] != local:
                self.error = (f"{what}: this rank (block {block} of {self.label!r}) holds {local} positions of the "
                              f"sequence, but shapes says {lengths[block]} ({lengths})")
        if layout == "zigzag" and lengths != zigzag_shapes(sum(lengths), size):
            raise EinshardError(
                f"{what}: zigzag blocks of a {sum(lengths)}-long sequence over {size} ranks hold "
                f"{zigzag_shapes(sum(lengths), size)} positions, but the ranks hold {lengths}; "
                f"pass shapes=zigzag_shapes(n, {size})"
            )
        self.lengths = tuple(lengths)
        self.chunks = _blocks(layout, lengths)

    def runs(self):
        """The chunks of the whole sequence stored block after block, in the sequence's order: ``(offset in
        that storage, length, position)``; ``None`` when that order is the sequence's."""
        runs, offset = [], 0
        for block in self.chunks:
            for start, length, _ in block:
                runs.append((start, length, offset))
                offset += length
        runs.sort()
        if all(start == offset for start, _, offset in runs):
            return None
        return tuple((offset, length, start) for start, length, offset in runs)


_PLANS = BoundedCache(name="einshard.attention.sequence_parallel.plans")


def _plan(build, *args):
    """``build(*args)``, made once per arguments; under ``torch.compile`` made while tracing (a constant)."""
    if compile_in_progress():
        return _trace.lookup(_plan_name(build, *_trace.static_value(args)))
    return _cached(build, *args)


def _cached(build, *args):
    key = (build, args)
    found = _PLANS.get(key)
    if found is None:
        found = _PLANS.put(key, build(*args))
    return found


@_trace.constant_result
def _plan_name(build, *args) -> str:
    return _trace.register(_cached(build, *args))


def _dim_name(what: str, dim) -> str:
    """A mesh dimension argument (a name, compound ``"dp-sp"`` or a tuple of names) as one name."""
    if isinstance(dim, (tuple, list)) and dim and all(isinstance(d, str) for d in dim):
        return "-".join(dim)
    if not isinstance(dim, str) or not dim:
        raise EinshardError(f"{what}: the sequence's mesh dimension must be a name like 'sp', got {dim!r}")
    return dim


def _check_qkv(what: str, q, k, v, min_dim: int) -> str | None:
    """The first problem with ``q``, ``k``, ``v`` (``None``: fine); raised at once for non-tensors."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise EinshardError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() < min_dim:
        return f"{what}: q must have at least {min_dim} dimensions ({'... h n d' if min_dim > 2 else '... n d'}), " \
               f"got shape {tuple(q.shape)}"
    if not q.is_floating_point():
        return f"{what}: q, k and v must be floating point, got {q.dtype}"
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
        return f"{what}: q, k and v must have one dtype and device, got {q.dtype}/{q.device}, " \
               f"{k.dtype}/{k.device}, {v.dtype}/{v.device}"
    if k.shape != q.shape and not _grouped(q, k):
        return f"{what}: k must have q's shape {tuple(q.shape)} (self-attention: q, k and v split alike), " \
               f"or fewer heads (dimension -3) that divide q's (grouped-query attention), got {tuple(k.shape)}"
    if v.shape[:-1] != k.shape[:-1]:
        return f"{what}: v must have k's shape but for the last dimension, got {tuple(v.shape)} for k of " \
               f"shape {tuple(k.shape)}"
    return None


def _grouped(q, k) -> bool:
    """Whether ``k`` has ``q``'s shape but for fewer heads (dimension ``-3``) that divide ``q``'s."""
    return (q.dim() >= 3 and k.dim() == q.dim() and k.shape[:-3] == q.shape[:-3] and k.shape[-2:] == q.shape[-2:]
            and 0 < k.shape[-3] and q.shape[-3] % k.shape[-3] == 0)


def _groups(q, k) -> int:
    """Query heads per key/value head (1 without grouped-query attention)."""
    return q.shape[-3] // k.shape[-3] if k.shape != q.shape else 1


def _agree(what: str, group, error: str | None, facts) -> None:
    """Raise a local problem here (checks off) or on every rank of ``group`` (checks on), before the ring."""
    err = None if error is None else EinshardError(error)
    if compile_in_progress() or group is None or not _checks.agreement_needed():
        if err is not None:
            raise err
        return
    _checks.agree(group, err, facts=facts, point=what)


# -- ring attention: the plan ---------------------------------------------------------------------


class _Ring:
    """One ring of one call, bound to this rank: its neighbours and, per step, the block pairs it computes.

    Step ``t`` holds the keys and values of block ``(b - t) % P`` (``b``: this
    rank's block); every step sends them on to block ``b + 1`` and receives
    those of block ``(b - t - 1) % P`` from block ``b - 1``. A pair is
    ``(q offset, q length, k offset, k length, diagonal)``: rows of this rank's
    queries against a run of the held keys, all visible, or (``diagonal``) one
    chunk against itself under the causal mask.
    """

    __slots__ = ("size", "group", "group_name", "send_to", "recv_from", "steps")

    def __init__(self, seq: _Sequence, causal: bool, documents=None):
        size, b, lengths, chunks = seq.size, seq.block, seq.lengths, seq.chunks
        self.size, self.group = size, seq.group
        self.group_name = seq.group.group_name if seq.group is not None else None
        self.send_to, self.recv_from = seq.ranks[(b + 1) % size], seq.ranks[(b - 1) % size]
        self.steps = []  # per step: (held block's length, pairs, length of the block received next)
        for t in range(size):
            j = (b - t) % size
            pairs = (_pairs(chunks[b], chunks[j], lengths[b], lengths[j], causal) if documents is None else
                     _document_pairs(chunks[b], chunks[j], causal, documents))
            self.steps.append((lengths[j], pairs,
                               lengths[(j - 1) % size]))


def _pairs(qs, ks, nq: int, nk: int, causal: bool) -> tuple:
    """The ``(q offset, q length, k offset, k length, diagonal)`` pairs of query chunks ``qs`` against keys ``ks``."""
    if not causal:
        return ((0, nq, 0, nk, False),) if nq and nk else ()
    out = []
    for qstart, qlen, qoff in qs:
        visible: list = []  # runs of whole chunks before this one: merged where adjacent in the block
        for kstart, klen, koff in ks:
            if kstart + klen <= qstart:
                if visible and visible[-1][0] + visible[-1][1] == koff:
                    visible[-1] = (visible[-1][0], visible[-1][1] + klen)
                else:
                    visible.append((koff, klen))
            elif (kstart, klen) == (qstart, qlen):
                out.append((qoff, qlen, koff, klen, True))
            # else: wholly after the query chunk (chunks of one layout never overlap in part)
        out.extend((qoff, qlen, koff, klen, False) for koff, klen in visible)
    return tuple(out)


def _spans(documents) -> list:
    """The ``(start, end)`` of every non-empty document in the whole sequence."""
    spans, start = [], 0
    for length in documents:
        if length:
            spans.append((start, start + length))
        start += length
    return spans


def _document_pairs(qs, ks, causal: bool, documents) -> tuple:
    """:func:`_pairs` of a packed sequence: every chunk pair cut at the documents' bounds into the pairs of
    their parts in one document (attention stays within documents: no pair needs a mask)."""
    out, spans = [], _spans(documents)
    for qstart, qlen, qoff in qs:
        for kstart, klen, koff in ks:
            diagonal = (kstart, klen) == (qstart, qlen)
            if causal and not diagonal and kstart + klen > qstart:
                continue  # wholly after the query chunk
            for a, b in spans:
                qa, qb, ka, kb = max(qstart, a), min(qstart + qlen, b), max(kstart, a), min(kstart + klen, b)
                if qb > qa and kb > ka:
                    out.append((qoff + qa - qstart, qb - qa, koff + ka - kstart, kb - ka, causal and diagonal))
    return tuple(out)


def _documents_arg(what: str, documents, n: int):
    """``documents=`` as a tuple of lengths summing to ``n`` (``None`` stays); a problem as a message."""
    if documents is None:
        return None, None
    if isinstance(documents, torch.Tensor):
        documents = documents.tolist()
    if isinstance(documents, (str, bytes)) or not hasattr(documents, "__len__") or \
            not all(is_size(s) for s in documents):
        return None, f"{what}: documents must be a list of per-document lengths, got {documents!r}"
    documents = tuple(int(s) for s in documents)
    if sum(documents) != n:
        return None, (f"{what}: the documents' lengths {list(documents)} sum to {sum(documents)}, but the "
                      f"sequence has {n} positions")
    return documents, None


# -- ring attention: the transfers ------------------------------------------------------------------


def _start(ring: _Ring, x: torch.Tensor | None, n: int):
    """Start sending ``x`` (``(..., m, w)``) to the next block and receiving ``n`` positions from the previous one.

    Returns what :func:`_wait` needs: eager, a fresh buffer and the works of
    batched ``isend``/``irecv``; traced, a functional ``all_to_all_single``
    (with every other rank it exchanges nothing) and the received shape.
    """
    assert x is not None  # a ring of two ranks or more: its block travels
    shape = x.shape[:-2] + (n, x.shape[-1])
    if compile_in_progress():
        ins, outs = [0] * ring.size, [0] * ring.size
        ins[ring.send_to] = x.numel()
        outs[ring.recv_from] = math.prod(shape)
        # the op itself: fc.all_to_all_single would wait at once while dynamo traces
        return _functional.all_to_all_single(x.reshape(-1), outs, ins, ring.group_name), shape
    buf = x.new_empty(shape)
    sends = [(ring.send_to, x)] if x.numel() else []
    recvs = [(ring.recv_from, buf)] if buf.numel() else []
    return buf, C.isend_irecv(sends, recvs, ring.group, kind="ppermute")


def _wait(pending) -> torch.Tensor:
    """The tensor :func:`_start` receives, once it has arrived."""
    got, rest = pending
    if compile_in_progress():
        return _functional.wait_tensor(got).view(rest)
    for work in rest:
        work.wait()
    return got


# -- ring attention: the block computations ---------------------------------------------------------


def _sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where block results are merged and gradients summed: float32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _merge(acc, o, lse):
    """Two partial attention results over disjoint keys combined (log-sum-exp weights), in ``lse``'s dtype
    (float32, or float64 for float64). A first result stays as the kernel made it: rows with one block of keys
    (one rank, a causal first chunk) are never converted."""
    if acc is None:
        return o, lse
    o0, lse0 = acc
    new = torch.logaddexp(lse0, lse)
    return (o0.to(lse.dtype) * (lse0 - new).exp().unsqueeze(-1) + o.to(lse.dtype) * (lse - new).exp().unsqueeze(-1),
            new)


def _add(total, part, offset: int, n: int, dtype: torch.dtype):
    """``total`` (``None``: nothing yet) plus ``part`` at rows ``offset ...`` of an ``n``-row sum along ``-2``,
    summed in ``dtype``; a first part covering every row is kept as it is (a sum of one term)."""
    if total is None and offset == 0 and part.shape[-2] == n:
        return part
    if total is None:
        total = part.new_zeros(part.shape[:-2] + (n, part.shape[-1]), dtype=dtype)
    elif total.dtype != dtype:
        total = total.to(dtype)
    total[..., offset:offset + part.shape[-2], :] += part
    return total


def _split(kv, d: int):
    return kv[..., :d], kv[..., d:]


def _ring_forward(ring: _Ring, kernel, q, k, v, scale: float):
    """``(out, lse)`` of this rank's queries against every block of keys, the ring's transfers overlapped."""
    d = q.shape[-1]
    acc: dict[int, tuple] = {}  # q offset -> (out, lse) of that chunk of rows so far
    kv = torch.cat([k, v], -1) if ring.size > 1 else None  # what travels: keys and values in one message
    last = ring.size - 1
    for t, (_, pairs, incoming) in enumerate(ring.steps):
        pending = _start(ring, kv, incoming) if t < last else None  # in flight while this block computes
        for qo, ql, ko, kl, diagonal in pairs:
            o, lse = kernel.forward(q[..., qo:qo + ql, :], k[..., ko:ko + kl, :], v[..., ko:ko + kl, :],
                                    diagonal, scale)
            acc[qo] = _merge(acc.get(qo), o, lse)
        if pending is not None:
            kv = _wait(pending)
            k, v = _split(kv, d)
    if not acc:  # this rank holds no positions
        return v.new_zeros(q.shape[:-1] + (v.shape[-1],)), q.new_zeros(q.shape[:-1], dtype=_sum_dtype(q.dtype))
    order = sorted(acc)  # runs of rows (chunks, or their parts in one document) that partition the rows
    out = acc[0][0] if len(order) == 1 else torch.cat([acc[i][0] for i in order], -2)
    lse = acc[0][1] if len(order) == 1 else torch.cat([acc[i][1] for i in order], -1)
    return out.to(q.dtype), lse


def _ring_backward(ring: _Ring, kernel, q, k, v, out, lse, dout, scale: float):
    """``(dq, dk, dv)``: the ring once more, each block's key/value gradients travelling with it back home.

    Every block pair's gradients come from the kernel's backward given the
    merged output and log-sum-exp of its rows; they are summed in ``lse``'s
    dtype (float32, or float64), and key/value gradients travel in it.
    """
    d, n, acc = q.shape[-1], q.shape[-2], _sum_dtype(q.dtype)
    dq = None
    kv = torch.cat([k, v], -1) if ring.size > 1 else None
    if kv is not None and compile_in_progress():  # tied to dout (a sum of none of its elements): the partitioner cannot
        kv = kv + dout.reshape(-1)[:0].sum()  # move the backward's transfers into the forward, away from their work
        k, v = _split(kv, d)
    last = ring.size - 1
    travelling = None  # the gradient of the held block, summed over the ranks it has visited
    for t, (held, pairs, incoming) in enumerate(ring.steps):
        pending = _start(ring, kv, incoming) if t < last else None
        dk = dv = None
        for qo, ql, ko, kl, diagonal in pairs:
            rows = slice(qo, qo + ql)
            gq, gk, gv = kernel.backward(dout[..., rows, :], q[..., rows, :], k[..., ko:ko + kl, :],
                                         v[..., ko:ko + kl, :], out[..., rows, :], lse[..., rows], diagonal, scale)
            dq = _add(dq, gq, qo, n, acc)
            dk, dv = _add(dk, gk, ko, held, acc), _add(dv, gv, ko, held, acc)
        if ring.size == 1:
            break
        assert kv is not None  # a ring of two ranks or more
        # what travels is summed on every rank it visits: in the summing dtype on every rank alike
        grads = (torch.cat([dk.to(acc), dv.to(acc)], -1) if dk is not None and dv is not None else
                 kv.new_zeros(kv.shape[:-2] + (held, kv.shape[-1]), dtype=acc))
        if travelling is not None:
            grads = grads + _wait(travelling)
        # on to the next rank; after the last step every block's gradient arrives at its owner
        travelling = _start(ring, grads, incoming)
        if pending is not None:
            kv = _wait(pending)
            k, v = _split(kv, d)
    if travelling is not None:
        dk, dv = _split(_wait(travelling), d)
    dq = q.new_zeros(q.shape) if dq is None else dq
    dk = k.new_zeros(k.shape) if dk is None else dk
    dv = v.new_zeros(v.shape) if dv is None else dv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Ring attention on local blocks: the forward ring, and a backward that runs the ring again."""

    @staticmethod
    def forward(ctx, q, k, v, ring, kernel, scale):
        out, lse = _ring_forward(ring, kernel, q, k, v, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.kernel, ctx.scale = ring, kernel, scale
        # the output is saved for backward too: under torch.compile on torch 2.11 a saved output that is also
        # returned lost the gradient of q (see _torch_compat.traced_function_result)
        return _torch_compat.traced_function_result(out) if compile_in_progress() else out

    @staticmethod
    def backward(ctx, dout):
        if torch.is_grad_enabled() and not compile_in_progress():  # create_graph=True: the raw transfers have no graph
            raise EinshardError("ring_attention: double backward (create_graph=True) is not supported")
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.ring, ctx.kernel, q, k, v, out, lse, dout.contiguous(), ctx.scale)
        return dq, dk, dv, None, None, None


def _ring_op(formula, q, k, v, *, dim, causal, layout, scale, shapes, mesh, documents):
    what = "ring_attention"
    error = _check_qkv(what, q, k, v, 2)
    seq = _plan(_Sequence, what, resolve_mesh(mesh), _dim_name(what, dim), layout,
                _trace.static_shape(q)[-2] if q.dim() >= 2 else 0, _shapes_arg(what, shapes))
    documents, bad = _documents_arg(what, documents, sum(seq.lengths))
    _agree(what, seq.group, error or bad or seq.error,
           (("dtype", q.dtype), ("device", q.device), ("leading dims", (tuple(q.shape[:-2]), tuple(k.shape[:-2]))),
            ("head dims", (tuple(q.shape[-1:]), tuple(v.shape[-1:]))), ("layout", layout), ("causal", bool(causal)),
            ("lengths", seq.lengths), ("documents", documents)))
    ring = _plan(_Ring, seq, bool(causal), documents)
    kernel = _plan(kernel_for, str(q.device), q.dtype, q.shape[-1], v.shape[-1], enabled_backends(), _groups(q, k))
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q, k, v = _distinct(q.contiguous(), k.contiguous(), v.contiguous())
    return _RingAttention.apply(q, k, v, ring, kernel, scale)


def _distinct(*tensors) -> tuple:
    """``tensors`` with a repeated one (self-attention's ``x, x, x``) as views of it: torch.compile refuses one tensor
    passed twice to an autograd Function, and each view's gradient flows back to the same tensor."""
    seen: list = []
    out = []
    for t in tensors:
        out.append(t.view_as(t) if any(t is s for s in seen) else t)
        seen.append(t)
    return tuple(out)


def _formula(dim: str) -> str:
    """The variance rule of a layer, as a formula: q, k and v split over ``dim`` along the sequence."""
    return f"... n/{dim} d, ... n/{dim} d, ... n/{dim} e -> ... n/{dim} e"


def ring_attention(q, k, v, dim, *, causal: bool = False, layout: str = "contiguous", scale=None, shapes=None,
                   mesh=None, ulysses=None, documents=None):
    """Attention of this rank's queries to the whole sequence, keys and values passed around a ring.

    ``q``, ``k``: ``(..., n, d)``, ``v``: ``(..., n, e)``, this rank's block of
    a sequence split over mesh dimension ``dim`` (``"sp"``, or compound
    ``"dp-sp"``); returns this rank's block ``(..., n, e)`` of
    ``F.scaled_dot_product_attention(Q, K, V, is_causal=causal, scale=scale)``
    on the whole tensors. ``layout``: ``"contiguous"`` (block ``r`` holds the
    ``r``-th run of positions) or ``"zigzag"`` (chunks ``r`` and ``2P - 1 - r``
    of ``2P``, so causal work is even: :func:`zigzag_indices`). ``shapes``:
    every rank's number of positions (default: as many as this rank).
    Grouped-query attention: ``k`` and ``v`` ``(..., h_kv, n, d)`` with
    ``h_kv`` dividing ``q``'s heads (``enable_gqa=True``); they travel
    unrepeated. Block pairs run on the fused kernel
    ``F.scaled_dot_product_attention`` would run (:mod:`einshard.attention.kernels`;
    float64: exact matmuls).
    Works inside ``shard_map`` (the output varies over ``dim``), under
    ``es.use_mesh`` and under ``torch.compile``; double backward is not
    supported.

    Packed sequences: ``documents`` (the lengths of the documents packed
    one after another into the whole sequence, summing to its length; the
    ``cu_seqlens`` convention as lengths) keeps attention within each
    document: block pairs are cut at the documents' bounds, pairs of
    different documents skipped (no mask is formed).
    2-D sequence parallelism: with ``ulysses="sp"`` the sequence is split
    over the compound dimension ``dim-ulysses`` (``dim`` major; ``shapes``:
    every rank's length in that order); an all-to-all over ``ulysses``
    swaps its split for a head split (as :func:`ulysses_attention`), the
    ring runs over ``dim`` on the ring blocks (``layout`` is theirs: with
    zigzag, each zigzag block split contiguously over ``ulysses``), and a
    second all-to-all swaps back. ``q``, ``k``, ``v`` then need heads:
    ``(..., h, n, d)``.

    >>> o = es.attention.ring_attention(q, k, v, "sp", causal=True, layout="zigzag")  # doctest: +SKIP
    >>> o = es.attention.ring_attention(q, k, v, "cp", ulysses="sp", causal=True)  # doctest: +SKIP
    """
    if ulysses is not None:
        return _ring_ulysses(q, k, v, dim, ulysses, causal=causal, layout=layout, scale=scale, shapes=shapes,
                             mesh=mesh, documents=documents)
    return _vma.formula_op(_ring_op, _formula(_dim_text(dim)), (q, k, v), dim=dim, causal=causal,
                           layout=layout, scale=scale, shapes=shapes, mesh=mesh, documents=documents)


def _dim_text(dim) -> str:
    if isinstance(dim, (tuple, list)) and dim and all(isinstance(d, str) for d in dim):
        return "-".join(dim)
    return dim if isinstance(dim, str) and dim else "?"


# -- Ulysses attention ---------------------------------------------------------------------------


def ulysses_attention(q, k, v, dim, *, causal: bool = False, layout: str = "contiguous", scale=None,
                      shapes=None, mesh=None, documents=None):
    """Attention on whole sequences after an all-to-all swaps the sequence split for a head split.

    Same interface as :func:`ring_attention`, with heads: ``q``, ``k``
    ``(..., h, n, d)``, ``v`` ``(..., h, n, e)``. Two ``es.einshard``
    formulas move the data, ``... h n/dim d -> ... h/dim n d`` and back; in
    between every rank runs ``F.scaled_dot_product_attention`` on its heads
    and the whole sequence (a zigzag sequence is put in order first). Heads
    that do not divide by the ranks are split as evenly as possible (the
    first ranks take one more; with fewer heads than ranks some get none).
    Grouped-query attention (``k``, ``v`` with fewer heads, dividing ``q``'s):
    the key/value heads are split so, the query heads by whole groups.
    Packed sequences (``documents``, as for :func:`ring_attention`): one
    ``F.scaled_dot_product_attention`` per document, on its slice of the
    whole sequence. Backward: the formulas' adjoints around attention's own
    backward.

    >>> o = es.attention.ulysses_attention(q, k, v, "sp", causal=True)  # doctest: +SKIP
    """
    what = "ulysses_attention"
    error = _check_qkv(what, q, k, v, 3)
    where = resolve_mesh(mesh)
    seq = _plan(_Sequence, what, where, _dim_name(what, dim), layout,
                _trace.static_shape(q)[-2] if q.dim() >= 2 else 0, _shapes_arg(what, shapes))
    documents, bad = _documents_arg(what, documents, sum(seq.lengths))
    _agree(what, seq.group, error or bad or seq.error,
           (("dtype", q.dtype), ("device", q.device), ("layout", layout), ("causal", bool(causal)),
            ("shapes but n", (q.shape[:-2], k.shape[:-2])), ("lengths", seq.lengths), ("documents", documents)))
    groups = _groups(q, k)
    qh, kh, vh, back = _to_heads(q, k, v, seq.label, seq.size, {seq.label: {"n": list(seq.lengths)}}, mesh)
    runs = seq.runs() if layout == "zigzag" else None
    if runs is not None:  # attend in the sequence's own order: its chunks sorted
        qh, kh, vh = _reorder(qh, runs), _reorder(kh, runs), _reorder(vh, runs)
    spans = [(0, sum(seq.lengths))] if documents is None else _spans(documents) or [(0, 0)]
    parts = [F.scaled_dot_product_attention(qh[..., a:b, :], kh[..., a:b, :], vh[..., a:b, :],
                                            is_causal=bool(causal), scale=scale, enable_gqa=groups > 1)
             for a, b in spans]
    o = parts[0] if len(parts) == 1 else torch.cat(parts, -2)
    if runs is not None:
        o = _reorder(o, sorted(((pos, n, off) for off, n, pos in runs), key=lambda r: r[2]))  # back to storage
    return back(o)


def _reorder(x: torch.Tensor, runs) -> torch.Tensor:
    """The runs ``(start, length, ...)`` of ``x`` along the sequence axis, concatenated in that order."""
    return torch.cat([x.narrow(-2, start, n) for start, n, _ in runs], -2)


def _to_heads(q, k, v, label: str, size: int, sequence: dict, mesh, split_to: str = ""):
    """``q``, ``k``, ``v`` with a sequence split swapped for a head split over ``label`` (``size`` ranks), and the
    function swapping an output back: ``... h n/{label} d -> ... h/{label} n d`` (2-D: the sequence split over
    a compound dimension, of which ``split_to`` keeps its split: ``... h n/{cp-sp} d -> ... h/{sp} n/{cp} d``).
    ``sequence``: the formulas' shapes of ``n``. Key/value heads as even as possible (the first ranks take one
    more), query heads by whole groups with them."""
    groups, heads = _groups(q, k), k.shape[-3]
    split = [heads // size + (i < heads % size) for i in range(size)]
    where = resolve_mesh(mesh)
    kv_shapes, q_shapes = (_ambient_shapes(where, {**sequence, label: {**sequence.get(label, {}),
                                                                        "h": [h * g for h in split]}})
                           for g in (1, groups))
    kw = {} if mesh is None else {"mesh": mesh}

    def move(formula, x, shapes):  # derived split shapes, ambient as in shard_map: no agreement on every call
        token = _context.push(mesh=where, shapes=shapes)
        try:
            return einshard(formula, x, **kw)
        finally:
            _context.pop(token)

    n_in = f"n/{next(iter(sequence))}"
    n_out = f"n/{split_to}" if split_to else "n"
    to_heads, to_sequence = f"... h {n_in} d -> ... h/{label} {n_out} d", f"... h/{label} {n_out} d -> ... h {n_in} d"
    qh, kh, vh = move(to_heads, q, q_shapes), move(to_heads, k, kv_shapes), move(to_heads, v, kv_shapes)
    return qh, kh, vh, lambda o: move(to_sequence, o, q_shapes)


def _ambient_shapes(mesh, shapes: dict) -> dict:
    """``shapes`` (``{label: {axis: split}}``, as ``shapes=`` takes them) over the ambient ones of ``mesh``."""
    return {**_context.shapes_for(mesh), **{(mesh.dims(label), axis): tuple(split)
                                            for label, axes in shapes.items() for axis, split in axes.items()}}


# -- 2-D: Ulysses over one mesh dimension, the ring over another ---------------------------------------


def _ring_ulysses(q, k, v, dim, ulysses, *, causal, layout, scale, shapes, mesh, documents):
    """:func:`ring_attention` with ``ulysses=``: a head split over ``ulysses``, the ring over ``dim`` between."""
    what = "ring_attention"
    error = _check_qkv(what, q, k, v, 3)
    m = resolve_mesh(mesh)
    ring_name, uly_name = _dim_name(what, dim), _dim_name(what, ulysses)
    local = _trace.static_shape(q)[-2] if q.dim() >= 2 else 0
    whole = _plan(_Sequence, what, m, f"{ring_name}-{uly_name}", "contiguous", local, _shapes_arg(what, shapes))
    ring_lengths = _plan(_ring_blocks, m, uly_name, whole.lengths)
    zigzag = zigzag_shapes(sum(ring_lengths), len(ring_lengths))
    if layout == "zigzag" and list(ring_lengths) != zigzag:
        error = error or (f"{what}: zigzag blocks of a {sum(ring_lengths)}-long sequence over the "
                          f"{len(ring_lengths)} ranks of {ring_name!r} hold {zigzag} positions, but the ring "
                          f"blocks (each split over {uly_name!r}) hold {list(ring_lengths)}")
    documents, bad = _documents_arg(what, documents, sum(whole.lengths))
    _agree(what, whole.group, error or bad or whole.error,
           (("dtype", q.dtype), ("device", q.device), ("shapes but n", (q.shape[:-2], k.shape[:-2])),
            ("layout", layout), ("causal", bool(causal)), ("lengths", whole.lengths), ("documents", documents)))
    ring_label, uly = m.label(m.dims(ring_name)), m.dims(uly_name)
    qh, kh, vh, back = _to_heads(q, k, v, m.label(uly), m.size(uly), {
        whole.label: {"n": list(whole.lengths)}, ring_label: {"n": list(ring_lengths)}}, mesh, split_to=ring_label)
    o = ring_attention(qh, kh, vh, dim, causal=causal, layout=layout, scale=scale, shapes=ring_lengths, mesh=mesh,
                       documents=documents)
    return back(o)


def _ring_blocks(mesh, ulysses: str, lengths) -> tuple:
    """Every ring block's length: the sum over its ``ulysses`` ranks (``lengths``: in ``ring-ulysses`` order)."""
    size = mesh.size(mesh.dims(ulysses))
    return tuple(sum(lengths[r * size:(r + 1) * size]) for r in range(len(lengths) // size))


# -- converting between layouts ----------------------------------------------------------------------


def _pieces(src, dst) -> tuple:
    """The runs ``(src offset, dst offset, length)`` where the chunks of ``src`` and ``dst`` overlap."""
    runs = []
    for s_start, s_len, s_off in src:
        for d_start, d_len, d_off in dst:
            lo, hi = max(s_start, d_start), min(s_start + s_len, d_start + d_len)
            if hi > lo:
                runs.append((s_off + lo - s_start, d_off + lo - d_start, hi - lo))
    return tuple(runs)


def _conversion(src: _Sequence, dst: _Sequence, shape: tuple, axis: int) -> Exchange:
    """The exchange taking this rank's block of ``src`` (local ``shape``) to its block of ``dst``, along ``axis``."""
    b = src.block
    sends: list = [None] * src.size
    recvs: list = [None] * src.size
    other = tuple(((0, 0, n),) if n else () for n in shape)
    for j, rank in enumerate(src.ranks):
        for box, runs in ((sends, _pieces(src.chunks[b], dst.chunks[j])),
                          (recvs, _pieces(src.chunks[j], dst.chunks[b]))):
            if runs and all(other[i] for i in range(len(shape)) if i != axis):
                box[rank] = tuple(runs if i == axis else other[i] for i in range(len(shape)))
    out_shape = shape[:axis] + (dst.lengths[b],) + shape[axis + 1:]
    # The adjoint is built here, with the plan: a compiled backward reads it and must not build it.
    return Exchange(src.group, shape, out_shape, sends, recvs).prepare_traced()


class _TracedExchange(torch.autograd.Function):
    """An exchange under ``torch.compile``: one functional all-to-all forward, its adjoint backward."""

    @staticmethod
    def forward(ctx, x, ex):
        ctx.ex = ex
        return _torch_compat.traced_function_result(ex.run_traced(x))

    @staticmethod
    def backward(ctx, grad):
        return _TracedExchange.apply(grad, ctx.ex.adjoint()), None


def _convert_op(formula, x, *, dim, axis, zigzag, shapes, mesh):
    what = "to_zigzag" if zigzag else "from_zigzag"
    if not isinstance(x, torch.Tensor):
        raise EinshardError(f"{what}: x must be a torch.Tensor, got {type(x).__name__}")
    if not -x.dim() <= axis < x.dim():
        raise EinshardError(f"{what}: axis {axis} is out of range for a tensor with {x.dim()} dimensions")
    axis %= x.dim()
    shape, name, m = _trace.static_shape(x), _dim_name(what, dim), resolve_mesh(mesh)
    src = _plan(_Sequence, what, m, name, "contiguous" if zigzag else "zigzag", shape[axis], _shapes_arg(what, shapes))
    n = sum(src.lengths)
    dst_lengths = zigzag_shapes(n, src.size) if zigzag else compute_split_shapes(n, src.size)
    dst = _plan(_Sequence, what, m, name, "zigzag" if zigzag else "contiguous", dst_lengths[src.block],
                tuple(dst_lengths))
    _agree(what, src.group, src.error, (("dtype", x.dtype), ("device", x.device), ("lengths", src.lengths)))
    ex = _plan(_conversion, src, dst, shape, axis)
    if compile_in_progress():
        return _TracedExchange.apply(x, ex)
    return ex(x)


def _axis_formula(dim: str, ndim: int, axis: int) -> str:
    if not isinstance(ndim, int) or ndim < 1 or not -ndim <= axis < ndim:
        return f"... n/{dim}"
    names = [f"x{i}" if i != axis % ndim else f"n/{dim}" for i in range(ndim)]
    return " ".join(names) + " -> " + " ".join(names)


def to_zigzag(x, dim, *, axis: int = -2, shapes=None, mesh=None):
    """This rank's zigzag block of a sequence given as contiguous blocks over ``dim``.

    ``x``: this rank's contiguous block along ``axis`` (``shapes``: every
    rank's length, default: as many as this rank; uneven sizes otherwise
    follow ``compute_split_shapes``). Returns chunks ``r`` and ``2P - 1 - r``
    of the ``2P`` zigzag chunks (lengths :func:`zigzag_shapes`). One exchange
    with the ranks that hold them; backward moves the gradient back.

    >>> qz = es.attention.to_zigzag(q, "sp")  # doctest: +SKIP
    """
    ndim = x.dim() if isinstance(x, torch.Tensor) else 0
    return _vma.formula_op(_convert_op, _axis_formula(_dim_text(dim), ndim, axis), (x,), dim=dim, axis=axis,
                           zigzag=True, shapes=shapes, mesh=mesh)


def from_zigzag(x, dim, *, axis: int = -2, shapes=None, mesh=None):
    """The contiguous block (``compute_split_shapes`` of the whole length) of a sequence given as zigzag blocks.

    The inverse of :func:`to_zigzag`; ``shapes``: every rank's zigzag length
    (default: as many as this rank).

    >>> o = es.attention.from_zigzag(o_zigzag, "sp")  # doctest: +SKIP
    """
    ndim = x.dim() if isinstance(x, torch.Tensor) else 0
    return _vma.formula_op(_convert_op, _axis_formula(_dim_text(dim), ndim, axis), (x,), dim=dim, axis=axis,
                           zigzag=False, shapes=shapes, mesh=mesh)
