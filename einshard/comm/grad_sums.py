"""Gradient sums started while backward runs: buckets, asynchronous all-reduces, the end-of-backward wait.

One engine for every gradient sum the library defers:

- :func:`launch` and :func:`write`: a bucket of gradient contributions
  flattened into one buffer, summed by one asynchronous all-reduce, then
  written back into the parameters' ``.grad`` (``es.count_communication``
  counts it as any all-reduce). :class:`einshard.params.buckets.GradBucketer`
  (the native gradient hooks) runs its buckets on them.
- :func:`launch_scatter` and :func:`write_scatter`: a bucket of gradient
  contributions split into one chunk per group rank, laid out rank by rank and
  reduce-scattered by one asynchronous call; each rank adds its chunks into
  the ``.grad`` of the parameters it stores a slice of (ZeRO-3,
  :mod:`einshard.params.zero`, through :meth:`DeferredSums.add_scatter`).
- :data:`DEFERRED`, a :class:`DeferredSums`: the gradient sums of leaf
  tensors (parameters) that feed per-rank computation, :func:`leaf_sum`: a
  ``shard_map`` body's pvary of a parameter (:mod:`einshard.runtime.vma`), and a
  formula's replicated parameter operand, whose gradient arrives partial
  (:mod:`einshard.runtime.execute`). Contributions are added as backward produces them,
  grouped by process group, dtype and device into buckets of about
  ``bucket_bytes``; a full bucket starts its all-reduce at once, and at the end
  of the backward (a callback of the autograd engine, as DDP and FSDP do) the
  rest start, every one is waited for and the sums are added into ``.grad``.
  Every rank produces its contributions in the same order (the same
  backward), so the buckets match across ranks. What a backward that raised
  deferred is dropped (:mod:`einshard.comm.backwards`): the next backward starts clean.
"""

from __future__ import annotations

import math

import torch

from ..core import _torch_compat
from . import collectives as C
from .backwards import PerBackward
from .mappings import allreduce_forward_identity_backward

__all__ = ["DEFAULT_BUCKET_BYTES", "accumulates", "flatten", "launch", "write", "launch_scatter", "write_scatter",
           "DeferredSums", "DEFERRED", "leaf_sum"]

DEFAULT_BUCKET_BYTES = 25 * 2**20


def accumulates(node) -> bool:
    """Whether the running backward accumulates into the leaf of AccumulateGrad ``node`` (``False`` inside
    ``torch.autograd.grad``, which returns the gradient instead)."""
    try:
        return _torch_compat.will_engine_execute_node(node)
    except RuntimeError as err:  # torch refuses the question for leaves while autograd.grad runs
        if "autograd.grad" in str(err):
            return False
        raise


def flatten(parts) -> torch.Tensor:
    """The tensors ``parts`` one after the other in one flat buffer."""
    return torch.cat([g.reshape(-1) for g in parts]) if len(parts) > 1 else parts[0].reshape(-1)


def launch(parts, group):
    """Start the sum over ``group`` of the tensors ``parts`` (one flat buffer): ``(flat, work)``."""
    return C.all_reduce(flatten(parts), group, async_op=True)


def write(flat, params, modes) -> None:
    """Write the summed ``flat`` into the parameters' ``.grad``, one slice each, in order.

    ``modes[k]``: ``"copy"`` (the slice replaces ``.grad``), ``"add"`` (it is
    added), ``None`` (a placeholder slice: nothing written). A parameter
    without ``.grad`` gets its slice as a view of ``flat`` (no copy).
    """
    offset = 0
    with torch.no_grad():
        for p, mode in zip(params, modes):
            n = p.numel()
            summed = flat[offset : offset + n].view(p.shape)
            offset += n
            if mode is None:
                continue
            if p.grad is None:
                p.grad = summed
            elif mode == "copy":
                p.grad.copy_(summed)
            else:
                p.grad.add_(summed)


def launch_scatter(chunks, group):
    """Start the reduce-scatter over ``group`` of several contributions, each cut into one chunk per group
    rank (``chunks[k][j]``: contribution ``k``'s chunk for group rank ``j``): ``(row, work)``, where ``row``
    (after ``work.wait()``) holds this rank's summed chunks one after the other (then padding)."""
    size = len(chunks[0])
    rows = [[c[j].reshape(-1) for c in chunks] for j in range(size)]
    width = max(sum(t.numel() for t in r) for r in rows)
    buf = chunks[0][0].new_zeros((size, width))
    for j, r in enumerate(rows):
        offset = 0
        for t in r:
            buf[j, offset : offset + t.numel()].copy_(t)
            offset += t.numel()
    return C.reduce_scatter_rows(buf, group, async_op=True)


def write_scatter(row, params, shapes) -> None:
    """Add this rank's summed chunks (``row``, from :func:`launch_scatter`) into the parameters' ``.grad``
    (``shapes[k]``: parameter ``k``'s chunk shape, its shard's); a parameter without ``.grad`` gets its own copy."""
    offset = 0
    with torch.no_grad():
        for p, shape in zip(params, shapes):
            n = math.prod(shape)
            part = row[offset : offset + n].view(shape)
            offset += n
            if part.dtype != p.dtype:
                part = part.to(p.dtype)
            if p.grad is None:
                p.grad = part.clone()
            else:
                p.grad.add_(part)


class _Filling:
    """A bucket being filled: contributions to add into their parameters' ``.grad`` (summed, or
    reduce-scattered: ``grads`` then holds each contribution's per-rank chunks)."""

    __slots__ = ("group", "params", "grads", "nbytes", "scatter")

    def __init__(self, group, scatter=False):
        self.group, self.params, self.grads, self.nbytes, self.scatter = group, [], [], 0, scatter


class _Backward:
    """What one backward deferred: the buckets being filled and the sums started, in the order started."""

    __slots__ = ("filling", "works")

    def __init__(self):
        self.filling: dict = {}  # (group, dtype, device, scatter) -> _Filling
        self.works: list = []  # (work, flat, params, chunk shapes or None)


class DeferredSums:
    """Gradient contributions summed over process groups in buckets during backward (see the module).

    Each backward's contributions are its own (:class:`einshard.comm.backwards.PerBackward`): a backward that
    raises leaves nothing behind; the sums it started are waited for (the ranks stay matched) and dropped
    when the next backward starts (or at :attr:`pending`).

    >>> sums = DeferredSums()
    >>> sums.pending
    0
    """

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.bucket_bytes = bucket_bytes
        self._backwards = PerBackward(_Backward, self._end_of_backward, _drop)

    @property
    def pending(self) -> int:
        """The number of all-reduces started and not yet waited for."""
        return sum(len(b.works) for b in self._backwards.states())

    def arm(self) -> None:
        """Queue the end-of-backward wait for the running backward (once per backward)."""
        self._backwards.current()

    def add(self, p: torch.Tensor, grad: torch.Tensor, group) -> None:
        """Sum ``grad`` over ``group`` and add it into ``p.grad`` before the running backward returns."""
        self._add(p, grad, group, grad, False)

    def add_scatter(self, p: torch.Tensor, chunks, group, order=None) -> None:
        """Reduce-scatter a contribution over ``group``, cut into ``chunks`` (one per block, in block order),
        and add this rank's summed chunk into ``p.grad`` (``p`` holds that slice) before the running backward
        returns. ``order``: the group rank holding each block (``es.Mesh.order``; default: block ``j`` on
        group rank ``j``)."""
        if order is not None:  # the buckets lay chunks out by group rank
            chunks = [chunks[order.index(j)] for j in range(len(chunks))]
        self._add(p, tuple(chunks), group, chunks[0], True)

    def _add(self, p, grad, group, sample, scatter) -> None:
        now = self._backwards.current()
        key = (group, sample.dtype, sample.device, scatter)
        bucket = now.filling.get(key)
        if bucket is None:
            bucket = now.filling[key] = _Filling(group, scatter)
        bucket.params.append(p)
        bucket.grads.append(grad)
        parts = grad if scatter else (grad,)
        bucket.nbytes += sum(g.numel() for g in parts) * sample.element_size()
        if bucket.nbytes >= self.bucket_bytes:
            del now.filling[key]
            now.works.append(_start(bucket))

    def start_filling(self) -> None:
        """Start every partly filled bucket of the running backward now (a unit of work is complete: its
        sums need not wait)."""
        _start_filling(self._backwards.current())

    def _end_of_backward(self, now: _Backward) -> None:
        _start_filling(now)
        for work, flat, params, shapes in now.works:
            work.wait()
            if shapes is None:
                write(flat, params, ("add",) * len(params))
            else:
                write_scatter(flat, params, shapes)
        now.works = []


def _start(bucket: _Filling):
    """Start the sum (or reduce-scatter) of ``bucket``: ``(work, buffer, params, chunk shapes or None)``."""
    if bucket.scatter:
        me = C.group_rank(bucket.group)
        row, work = launch_scatter(bucket.grads, bucket.group)
        return work, row, bucket.params, [tuple(c[me].shape) for c in bucket.grads]
    flat, work = launch(bucket.grads, bucket.group)
    return work, flat, bucket.params, None


def _start_filling(now: _Backward) -> None:
    filling, now.filling = now.filling, {}
    now.works.extend(_start(bucket) for bucket in filling.values())


def _drop(now: _Backward) -> None:
    """A backward that raised: its buckets not started are dropped, its started sums waited for and dropped."""
    now.filling = {}
    for work, *_ in now.works:
        work.wait()
    now.works = []


#: the deferred gradient sums of ``shard_map`` bodies (one per process)
DEFERRED = DeferredSums()


class _LeafSum(torch.autograd.Function):
    """Identity forward; the gradient summed over ``group``: deferred (:data:`DEFERRED`) where it can wait."""

    @staticmethod
    def forward(ctx, x, group, detached=False):
        ctx.group = group
        return x.detach() if detached else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        leaf = ctx.next_functions[0][0]  # the leaf's AccumulateGrad
        if _deferrable(leaf):
            DEFERRED.add(leaf.variable, grad, ctx.group)
            return None, None, None
        # summed on the spot; its own backward is the identity's adjoint: double backward sums again
        return allreduce_forward_identity_backward(grad, ctx.group), None, None


def leaf_sum(x: torch.Tensor, group, detached: bool = False) -> torch.Tensor:
    """``x`` (a leaf that requires grad) as it is, its gradient summed over ``group`` (JAX's ``pvary``).

    The sum waits for the end of the backward, bucketed and overlapped with
    it, where it can: the engine accumulates into ``x`` in the running
    backward (not ``torch.autograd.grad``, which returns the gradient), no
    graph of the backward is built (``create_graph``), and no hook of ``x``
    reads the gradient before that (tensor or post-accumulate hooks). Else it
    is summed on the spot. Only the part of the gradient that comes through
    here is summed; other uses of ``x`` accumulate as usual. ``detached``: the
    result shares ``x``'s storage without being a view of it (autograd's), so
    it may be used again after ``x`` is modified in place under ``no_grad``
    (:mod:`einshard.runtime.vma_aliases` keeps it from one call to the next).

    >>> y = leaf_sum(w, dp_group) @ x_block   # doctest: +SKIP
    """
    return _LeafSum.apply(x, group, detached)


def _deferrable(node) -> bool:
    if torch.is_grad_enabled() or not accumulates(node):
        return False
    x = node.variable
    return not x._backward_hooks and not getattr(x, "_post_accumulate_grad_hooks", None)
