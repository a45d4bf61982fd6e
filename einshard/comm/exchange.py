"""One exchange of rectangular pieces between the ranks of a group, bound to this rank.

Transition ``exchange`` steps, halos (so windows and convolutions) and rolls
run on it. A piece is, per dimension, a tuple of *runs* ``(src_start,
dst_start, length)`` (:mod:`einshard.plan.halo`). Decided once: contiguous
pieces are sent as views and received into views of the output, the part
that stays is copied while messages fly, a rank keeping its block returns
it. Eager: batched ``isend``/``irecv`` with the peers that have data;
traced: one functional ``all_to_all_single``. The adjoint adds back.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core import _torch_compat
from ..core._torch_compat import in_traced_code
from ..core.layout import Layout, MeshShape
from . import _traced_collectives as TC
from . import checks as _checks
from . import collectives as C
from .collective import make_mapping

_transforms_active = _torch_compat.functorch_transforms_active

__all__ = ["Exchange", "exchange_group", "runs_exchange"]


def _narrow(t: torch.Tensor, cuts) -> torch.Tensor:
    for dim, start, length in cuts:
        t = t.narrow(dim, start, length)
    return t


def _cuts(shape, box) -> tuple:
    """The ``(dim, start, length)`` narrows taking ``box`` (``(start, length)`` per dim) out of ``shape``."""
    return tuple((d, s, n) for d, ((s, n), full) in enumerate(zip(box, shape)) if s or n != full)


def _contiguous(shape, box) -> bool:
    """Whether ``box`` of a contiguous tensor of ``shape`` is contiguous itself."""
    inner = False
    for full, (_, n) in zip(shape, box):
        if inner and n != full:
            return False
        inner = inner or n > 1
    return True


def _boxes(runs) -> tuple[list, tuple]:
    """``([(src box, dst box, packed box)] per combination of runs, packed shape)`` of a piece."""
    per_dim, shape = [], []
    for rs in runs:
        off, opts = 0, []
        for s, d, n in rs:
            opts.append(((s, n), (d, n), (off, n)))
            off += n
        per_dim.append(opts)
        shape.append(off)
    return [tuple(zip(*combo)) for combo in itertools.product(*per_dim)], tuple(shape)


def _numel(runs) -> int:
    return 0 if runs is None else math.prod([sum(r[2] for r in rs) for rs in runs])  # (dynamo: no generator)


def _flip(runs):
    return None if runs is None else tuple(tuple((d, s, n) for s, d, n in rs) for rs in runs)


class Exchange:
    """Pieces of this rank's block to and from the ranks of ``group`` (``None``: this rank alone).

    ``sends[j]`` / ``recvs[j]``: the runs per dimension of the piece sent to /
    received from group rank ``j`` (``None``: nothing; ``j`` = this rank: the
    part that stays; :func:`runs_exchange` puts a mesh group's members, found
    in block order, in group-rank order). Output elements are written once, or
    lie in a ``blank`` box, set to ``fill``. ``add``: sum into zeros (the adjoint).
    """

    __slots__ = ("group", "in_shape", "out_shape", "sends", "recvs", "add", "blank", "send_to", "recv_from",
                 "local", "keep", "whole", "recv_numels", "_adjoint")

    def __init__(self, group, in_shape, out_shape, sends, recvs, add=False, blank=()):
        rank = 0 if group is None else C.group_rank(group)
        self.group, self.add, self._adjoint = group, add, None
        self.in_shape, self.out_shape = ins, outs = tuple(in_shape), tuple(out_shape)
        self.sends, self.recvs = list(sends), list(recvs)
        self.blank = tuple(_cuts(outs, b) for b in blank)
        self.recv_numels = [_numel(r) for r in self.recvs]
        self.send_to, self.recv_from, self.local, self.whole = [], [], [], None
        for j, (send, recv) in enumerate(zip(self.sends, self.recvs)):
            if _numel(send):
                boxes, shape = _boxes(send)
                if j == rank:
                    self.local = [(_cuts(ins, s), _cuts(outs, d)) for s, d, _ in boxes]
                else:
                    self.send_to.append((j, [(_cuts(ins, s), _cuts(shape, p)) for s, _, p in boxes], shape))
            if j != rank and self.recv_numels[j]:
                boxes, shape = _boxes(recv)
                direct = len(boxes) == 1 and not add and _contiguous(outs, boxes[0][1])
                if direct and self.recv_numels[j] == math.prod(outs):
                    self.whole = j
                self.recv_from.append((j, direct, [(_cuts(outs, d), _cuts(shape, p)) for _, d, p in boxes], shape))
        self.keep = not add and not blank and ins == outs and self.local == [((), ())]

    def prepare_traced(self) -> Exchange:
        """This exchange with its adjoint built (traced code reads it, and must not build it)."""
        self.adjoint()
        return self

    def adjoint(self) -> Exchange:
        """The same pieces moved back, summed into the sources (the exact adjoint)."""
        if self._adjoint is None:
            back = Exchange(self.group, self.out_shape, self.in_shape, [_flip(r) for r in self.recvs],
                            [_flip(s) for s in self.sends], add=not self.add)
            back._adjoint, self._adjoint = self, back
        return self._adjoint

    def _into(self, out, piece, cuts):
        target = _narrow(out, cuts)
        (target.add_ if self.add else target.copy_)(piece)

    def _pack(self, x, boxes, shape):
        if len(boxes) == 1:
            return _narrow(x, boxes[0][0])
        buf = x.new_empty(shape)
        for src, packed in boxes:
            _narrow(buf, packed).copy_(_narrow(x, src))
        return buf

    def _finish(self, x, out, fill):
        """The part that stays, and the blank boxes (while messages are in flight)."""
        for src, dst in self.local:
            self._into(out, _narrow(x, src), dst)
        for cuts in self.blank:
            _narrow(out, cuts).fill_(fill)

    def run(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """The exchange on this rank (eager, point-to-point): the output block."""
        if self.group is not None and _checks.agreement_needed():
            _checks.agree(self.group, None, facts=(("dtype", x.dtype), ("device", x.device)), point="exchange")
        out = x if self.keep else (x.new_zeros if self.add else x.new_empty)(self.out_shape)
        sends = [(j, self._pack(x, boxes, shape).contiguous()) for j, boxes, shape in self.send_to]
        recvs = [(j, _narrow(out, boxes[0][0]) if direct else x.new_empty(shape))
                 for j, direct, boxes, shape in self.recv_from]  # direct: straight into the output
        later = [(buf, boxes) for (_, buf), (_, direct, boxes, _) in zip(recvs, self.recv_from) if not direct]
        works = C.isend_irecv(sends, recvs, self.group) if self.group is not None else ()
        if not self.keep:
            self._finish(x, out, fill)
        for work in works:
            work.wait()
        for buf, boxes in later:
            for dst, packed in boxes:
                self._into(out, _narrow(buf, packed), dst)
        return out

    def run_traced(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """The exchange in code that ``torch.compile`` traces (one functional all-to-all)."""
        chunks = [x.new_empty(0)] * len(self.recvs)
        for j, boxes, shape in self.send_to:
            chunks[j] = self._pack(x, boxes, shape)
        got = TC.all_to_all_v(chunks, self.recv_numels, self.group) if self.group is not None else chunks
        if self.keep:
            return x
        if self.whole is not None:
            return got[self.whole].view(self.out_shape)
        out = (x.new_zeros if self.add else x.new_empty)(self.out_shape)
        self._finish(x, out, fill)
        for j, _, boxes, shape in self.recv_from:
            buf = got[j].view(shape)
            for dst, packed in boxes:
                self._into(out, _narrow(buf, packed), dst)
        return out

    def __call__(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """The exchange as an autograd Function (backward: :meth:`adjoint`) when a backward may run.

        In code that dynamo traces: :meth:`run_traced`, backward the adjoint's (build it at trace time first,
        :meth:`prepare_traced`).
        """
        if in_traced_code():
            if self.group is not None and _checks.agreement_needed():
                _checks.agree(self.group, None, facts=(("dtype", x.dtype), ("device", x.device)), point="exchange")
            return _TracedExchange.apply(x, self, fill)
        if not (x.requires_grad and torch.is_grad_enabled()) and not _transforms_active():
            return self.run(x, fill)
        return _exchange(x, self, fill)


def _forward(x, ex, fill):
    y = ex.run(x, fill)
    return x.view_as(x) if y is x else y


# each direction's backward is the other one
_exchange: Callable = make_mapping("Exchange", _forward, lambda g, ex, fill: _exchange(g, ex.adjoint(), 0))


class _TracedExchange(torch.autograd.Function):
    """An exchange under ``torch.compile``: one functional all-to-all forward, the adjoint's backward."""

    @staticmethod
    def forward(ctx, x, ex, fill):
        ctx.ex = ex
        y = ex.run_traced(x, fill)
        return x.view_as(x) if y is x else _torch_compat.traced_function_result(y)

    @staticmethod
    def backward(ctx, grad):
        return ctx.ex.adjoint().run_traced(grad, 0), None, None


def _intersect(i, owner, dest):
    """The run of the intersection of two intervals, relative to each (none when empty)."""
    lo, hi = max(owner[0], dest[0]), min(owner[1], dest[1])
    return ((lo - owner[0], lo - dest[0], hi - lo),) if hi > lo else ()


def exchange_group(layout: Layout, axes, mesh) -> tuple[tuple, tuple]:
    """``(exchanged axes, mesh dims)``: those of ``axes`` sharded over more than one rank, and their dims."""
    if mesh is None:
        return (), ()
    shape = MeshShape.of(mesh)
    ex = [i for i in axes if layout.shard[i] and shape.size(layout.shard[i]) > 1]
    return tuple(ex), shape.sort(d for i in ex for d in layout.shard[i])


def runs_exchange(src: Layout, dst: Layout, dims, mesh, runs_fn=_intersect, axes=None, out_sizes=None,
                  blank=()) -> Exchange:
    """An :class:`Exchange` from ``src`` to ``dst`` blocks over the mesh ``dims`` (none: a local one).

    On each of ``axes`` (default all) a piece is ``runs_fn(i, owner's src
    interval, receiver's dst interval)`` (default: their intersection); other
    axes move whole; ``out_sizes[i]`` overrides an output size. Replicated
    data moves once, from the receiver's own copy, else one whose holder
    reads from the receiver too (pairs), else the one at its coordinates.
    """
    # no mesh: one process, whole tensors and no dims (nothing below reads the mesh's shape then)
    shape: Any = MeshShape.of(mesh) if mesh is not None else None
    coord: Any = tuple(mesh.coordinate) if mesh is not None else None
    in_shape = src.local_shape(coord, shape) if shape is not None else tuple(src.sizes)
    out_shape: Sequence[int] = dst.local_shape(coord, shape) if shape is not None else tuple(dst.sizes)
    axes = range(len(in_shape)) if axes is None else axes
    free = [shape.names.index(d) for d in dims if src.owner(d) is None]

    def intervals(layout, c):
        return {i: layout.interval(i, c, shape) if shape is not None else (0, layout.sizes[i]) for i in axes}

    def piece(owner, dest):
        runs = []
        for d, n in enumerate(in_shape):
            r = runs_fn(d, owner[d], dest[d]) if d in owner else ((0, 0, n),) if n else ()
            if not r:
                return None
            runs.append(r)
        return tuple(runs)

    members = shape.group_coords(dims, coord) if dims else [coord]

    def reads_from(r, s) -> bool:
        """Whether receiver ``r`` reads sender ``s``'s src block from ``s`` (and not from another copy)."""
        if not free:
            return True
        copies = [c for c in members if all(c[p] == s[p] for p in range(len(s)) if p not in free)]
        if r in copies:
            return r == s
        pairs = [c for c in copies if all(_intersect(0, *iv) for iv in zip(dst.box(c, shape), src.box(r, shape)))]
        same = next(c for c in copies if all(c[p] == r[p] for p in free))
        return (same if same in pairs or not pairs else pairs[0]) == s

    mine_src, mine_dst = intervals(src, coord), intervals(dst, coord)
    sends, recvs = [], []
    for m in members:
        sends.append(piece(mine_src, intervals(dst, m)) if reads_from(m, coord) else None)
        recvs.append(piece(intervals(src, m), mine_dst) if reads_from(coord, m) else None)
    out_shape = [(out_sizes or {}).get(d, n) for d, n in enumerate(out_shape)]
    order = mesh.order(dims) if dims else None
    if order is not None:  # members are in block order; the exchange indexes peers by group rank
        blocks = [order.index(j) for j in range(len(order))]
        sends, recvs = [sends[b] for b in blocks], [recvs[b] for b in blocks]
    return Exchange(mesh.group(dims) if dims else None, in_shape, out_shape, sends, recvs, blank=blank)
