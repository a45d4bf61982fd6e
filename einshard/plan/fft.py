"""Planning a distributed FFT: which axes to transform when, and how data moves between.

A transform axis can only be transformed where it is whole on every rank.
The planner searches the cheapest sequence of

* **moves**: one mesh dimension moves its shard to another axis (a
  transition, normally one all-to-all: the pencil/slab transpose), or to no
  axis (a gather; only where the output is replicated over that dimension,
  or, with a ``RuntimeWarning``, where nothing else works);
* **local transforms**: every transform axis that is whole (and allowed by
  the real-transform order: ``rfftn``'s half-spectrum axis first, ``irfftn``'s
  last) is transformed with one local ``torch.fft`` call as soon as possible;
* **four-step transforms**: a sharded axis of length ``N = N1 * N2`` is
  transformed in place by the distributed Cooley–Tukey (four-step)
  decomposition (three all-to-alls over its own mesh dimensions, local FFTs
  of lengths ``N1`` and ``N2``, one twiddle multiplication);

then a last transition to the requested output layout. States are
``(where each mesh dimension's shard lives, which axes are transformed)``;
the search is Dijkstra's over them, with costs ``(bytes, collectives)``
summed over forward and backward (the backward of a transition is the
reverse transition). Bytes are the largest amount any rank receives, so
layouts that pile the data on a few ranks lose against balanced ones.

Everything here is rank-independent; :mod:`einshard.ops.fft` binds a plan
to a rank and runs it.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Any

from ..core._cache import cached
from ..core._split import compute_split_shapes
from ..core.layout import Layout, MeshShape
from ..core.policy import PlanPolicy
from .cost import price
from .transition import plan_transition

__all__ = ["FFTProblem", "Move", "LocalFFT", "FourStep", "FFTPlan", "plan_fft", "four_step_factors"]


@dataclass(frozen=True)
class FFTProblem:
    """One distributed FFT, rank-independent.

    Axes are those of the input, in input order (the "state order" the data
    keeps until the final permutation); ``out_names`` are their names after
    the transform. ``transform`` lists the transformed axes in ``axes=``
    order (the last is the half-spectrum axis of a real transform).
    """

    names: tuple[str, ...]
    out_names: tuple[str, ...]
    before: tuple[int, ...]  # global sizes before the transform
    after: tuple[int, ...]  # global sizes after it
    transform: tuple[int, ...]
    real: bool
    inverse: bool
    src: Layout  # the input layout
    dst: Layout  # the output layout, in state order, with input names and `after` sizes
    mesh: MeshShape
    itemsize_in: int
    itemsize_complex: int
    itemsize_out: int

    @property
    def half(self) -> int | None:
        """The half-spectrum axis of a real transform."""
        return self.transform[-1] if self.real else None

    def itemsize(self, done: frozenset) -> int:
        if not done:
            return self.itemsize_in
        if self.real and self.inverse and self.half in done:
            return self.itemsize_out
        return self.itemsize_complex

    def size(self, i: int, done: frozenset) -> int:
        return self.after[i] if i in done else self.before[i]

    def splits(self, i: int, dims: tuple, transformed: bool):
        """Split shapes of axis ``i`` over ``dims``: the input's or output's where they apply."""
        if not dims:
            return None
        size = self.after[i] if transformed else self.before[i]
        is_t = i in self.transform
        if dims == self.src.shard[i] and (not is_t or not transformed) and self.src.sizes[i] == size:
            return self.src.splits[i]
        if dims == self.dst.shard[i] and (not is_t or transformed) and self.dst.sizes[i] == size:
            return self.dst.splits[i]
        return tuple(compute_split_shapes(size, self.mesh.size(dims)))

    @cached(65536)
    def layout(self, assign: tuple, done: frozenset) -> Layout:
        """The layout where mesh dimension ``k`` shards axis ``assign[k]`` (``-1``: none)."""
        names = self.mesh.names
        shard, splits, sizes = [], [], []
        for i in range(len(self.names)):
            dims = tuple(names[k] for k, a in enumerate(assign) if a == i)
            shard.append(dims)
            splits.append(self.splits(i, dims, i in done))
            sizes.append(self.size(i, done))
        return Layout(self.names, tuple(sizes), tuple(shard), tuple(splits))

    def assignment(self, layout: Layout) -> tuple:
        return tuple(-1 if layout.owner(d) is None else layout.owner(d) for d in self.mesh.names)


# -- actions -------------------------------------------------------------------


@dataclass(frozen=True)
class Move:
    """A transition ``src -> dst`` (same axes and sizes)."""

    src: Layout
    dst: Layout


@dataclass(frozen=True)
class LocalFFT:
    """One local ``torch.fft`` call over tensor dimensions ``dims`` (all whole).

    ``kind``: ``"c2c"`` (fftn/ifftn), ``"r2c"`` (rfftn: the last of ``dims`` is
    the half-spectrum axis), ``"c2r"`` (irfftn with output lengths ``sizes``).
    """

    dims: tuple[int, ...]
    kind: str
    sizes: tuple[int, ...]
    src: Layout
    dst: Layout


@dataclass(frozen=True)
class FourStep:
    """The distributed Cooley–Tukey transform of axis ``axis`` (length ``n = n1 * n2``).

    The axis is viewed as ``(hi, lo)`` of sizes ``(n1, n2)`` (row-major, so a
    rank's contiguous block is a block of ``hi`` rows when its block is a
    multiple of ``n2``), then: ``hi`` whole (all-to-all), FFT over ``hi``,
    twiddle ``exp(∓2πi lo·k_hi/n)``, ``lo`` whole (all-to-all), FFT over
    ``lo``, ``k_hi`` whole again (all-to-all), and the local transpose
    ``(k_hi, k_lo) -> k_lo·n1 + k_hi`` gives the spectrum in natural order.
    ``real`` is ``"r2c"`` (the input is real and the result is cropped to
    ``n//2+1``), ``"c2r"`` (the half spectrum is weighted and zero-padded to
    ``n`` first, and the real part taken last) or ``None``.
    """

    axis: int
    n: int
    n1: int
    n2: int
    real: str | None
    pre: Layout  # the state layout before
    padded: Layout | None  # c2r: after weighting and zero-padding to n
    flat_a: Layout  # axis length n, blocks multiples of n2
    a: Layout  # (hi/S, lo)
    b: Layout  # (hi, lo/S)
    c: Layout  # (k_hi/S, lo)
    d: Layout  # (k_hi, k_lo/S)
    flat_d: Layout  # axis length n, blocks multiples of n1
    cropped: Layout | None  # r2c: length n//2+1
    post: Layout  # the state layout after

    def moves(self):
        """``(src, dst, stage)`` of its transitions; ``stage`` 0 before any FFT, 1 between, 2 after."""
        start = self.padded if self.padded is not None else self.pre
        end = self.cropped if self.cropped is not None else self.flat_d
        return ((start, self.flat_a, 0), (self.a, self.b, 0), (self.b, self.c, 1), (self.c, self.d, 1),
                (end, self.post, 2))


@dataclass(frozen=True)
class FFTPlan:
    """A chosen plan: ``actions`` in order (``Move``, ``LocalFFT``, ``FourStep``)."""

    problem: FFTProblem
    actions: tuple
    cost: tuple  # (bytes fwd+bwd as the planner priced them, collectives)
    gathered: tuple[str, ...]  # transform axes gathered whole on every rank (warning path)


# -- costs ---------------------------------------------------------------------


# the search's metric: the most bytes any rank receives, so balanced layouts win; merging moves
# compares the library's own (bytes sent) prices
_SEARCH = PlanPolicy("fft", collective_weight=0.0, metric="max_received")
_MERGE = PlanPolicy("fft-merge", collective_weight=0.0)


def move_cost(src: Layout, dst: Layout, mesh: MeshShape, itemsize: int, policy: PlanPolicy = _SEARCH) -> tuple:
    """``(bytes, collectives)`` of ``src -> dst`` forward plus its reverse in backward, under ``policy``'s metric."""
    if src == dst:
        return (0, 0)
    fwd: tuple | list
    bwd: tuple | list
    if policy.metric == "sent":
        fwd, bwd = plan_transition(src, dst, mesh), plan_transition(dst, src, mesh)
    else:  # the metric reads a move's ends only: no need to plan its steps
        fwd, bwd = (Move(src, dst),), (Move(dst, src),)
    c = price(fwd, bwd, mesh, itemsize, policy.metric)
    return (c.fwd_bytes + c.bwd_bytes, c.fwd_calls + c.bwd_calls)


def _add(a, b):
    return tuple(x + y for x, y in zip(a, b))


# -- the four-step transform ----------------------------------------------------


def four_step_factors(n: int, p: int) -> list[tuple[int, int]]:
    """Every ``(n1, n2)`` with ``n1 * n2 == n`` and both at least ``p`` (the group size).

    >>> four_step_factors(64, 8)
    [(8, 8)]
    >>> four_step_factors(7, 2)
    []
    """
    divisors: set[int] = set()
    d = 1
    while d * d <= n:
        if n % d == 0:
            divisors.update((d, n // d))
        d += 1
    return [(n // n2, n2) for n2 in sorted(divisors) if n2 >= p and n // n2 >= p]


def _split_axis(layout: Layout, i: int, names, sizes, shard_hi: bool, splits) -> Layout:
    """``layout`` with axis ``i`` replaced by ``(hi, lo)``, sharded (by axis ``i``'s dims) on one of them."""
    dims = layout.shard[i]
    axes = layout.axes[:i] + tuple(names) + layout.axes[i + 1 :]
    gsizes = layout.sizes[:i] + tuple(sizes) + layout.sizes[i + 1 :]
    pair_shard = (dims, ()) if shard_hi else ((), dims)
    pair_splits = (tuple(splits), None) if shard_hi else (None, tuple(splits))
    return Layout(
        axes,
        gsizes,
        layout.shard[:i] + pair_shard + layout.shard[i + 1 :],
        layout.splits[:i] + pair_splits + layout.splits[i + 1 :],
    )


def _with_axis(layout: Layout, i: int, size: int, splits) -> Layout:
    sizes = list(layout.sizes)
    sizes[i] = size
    spl = list(layout.splits)
    spl[i] = tuple(splits)
    return Layout(layout.axes, tuple(sizes), layout.shard, tuple(spl), layout.partial)


def _build_four_step(p: FFTProblem, pre: Layout, post: Layout, i: int, n1: int, n2: int, real) -> FourStep:
    dims = pre.shard[i]
    g = p.mesh.size(dims)
    n = n1 * n2
    name = p.names[i]
    padded = None
    start = pre
    start_splits, post_splits = pre.splits[i], post.splits[i]
    assert start_splits is not None and post_splits is not None  # the transformed axis is split at both ends
    if real == "c2r":
        m = pre.sizes[i]
        spl = list(start_splits)
        spl[-1] += n - m
        padded = _with_axis(pre, i, n, spl)
        start, start_splits = padded, tuple(spl)
    if all(s % n2 == 0 for s in start_splits):
        r = tuple(s // n2 for s in start_splits)
    else:
        r = tuple(compute_split_shapes(n1, g))
    flat_a = _with_axis(start, i, n, tuple(s * n2 for s in r))
    hi, lo = f"{name}.hi", f"{name}.lo"
    a = _split_axis(flat_a, i, (hi, lo), (n1, n2), True, r)
    q = compute_split_shapes(n2, g)
    b = _split_axis(flat_a, i, (hi, lo), (n1, n2), False, q)
    c = _split_axis(flat_a, i, (hi, lo), (n1, n2), True, compute_split_shapes(n1, g))
    if post.sizes[i] == n and all(s % n1 == 0 for s in post_splits):
        q2 = tuple(s // n1 for s in post_splits)
    else:
        q2 = tuple(compute_split_shapes(n2, g))
    d = _split_axis(flat_a, i, (hi, lo), (n1, n2), False, q2)
    d_splits = tuple(s * n1 for s in q2)
    flat_d = _with_axis(flat_a, i, n, d_splits)
    cropped = None
    if real == "r2c":
        m = post.sizes[i]
        bounds = list(itertools.accumulate((0, *d_splits)))
        clipped = tuple(min(bounds[k + 1], m) - min(bounds[k], m) for k in range(g))
        cropped = _with_axis(flat_d, i, m, clipped)
    return FourStep(i, n, n1, n2, real, pre, padded, flat_a, a, b, c, d, flat_d, cropped, post)


def _four_step_cost(p: FFTProblem, fs: FourStep, done_before: frozenset) -> tuple[int, int]:
    sizes = (
        p.itemsize(done_before),
        p.itemsize_complex,
        p.itemsize_out if fs.real == "c2r" else p.itemsize_complex,
    )
    cost = (0, 0)
    for src, dst, stage in fs.moves():
        cost = _add(cost, move_cost(src, dst, p.mesh, sizes[stage]))
    return cost


@cached(4096)
def _best_four_step(p: FFTProblem, pre: Layout, post: Layout, i: int, done_before: frozenset):
    dims = pre.shard[i]
    if not dims:
        return None
    g = p.mesh.size(dims)
    if g == 1:  # a group of one rank: moving its (empty) shard elsewhere is free
        return None
    real = None
    if p.real and i == p.half:
        real = "c2r" if p.inverse else "r2c"
    n = post.sizes[i] if real == "c2r" else pre.sizes[i]
    best = None
    for n1, n2 in four_step_factors(n, g):
        fs = _build_four_step(p, pre, post, i, n1, n2, real)
        cost = _four_step_cost(p, fs, done_before)
        key = (cost, abs(n1 - n2))
        if best is None or key < best[0]:
            best = (key, fs)
    return None if best is None else (best[1], best[0][0])


# -- the search ------------------------------------------------------------------


def _local_stage(p: FFTProblem, assign: tuple, done: frozenset):
    """The axes transformed locally now: ``(axes in call order, kind)`` or ``None``."""
    whole = [i for i in p.transform if i not in done and i not in assign]
    whole.sort()
    if p.real:
        c = p.half
        others = [i for i in whole if i != c]
        if not p.inverse:
            if c not in done:
                return (tuple(others) + (c,), "r2c") if c in whole else None
            return (tuple(others), "c2c") if others else None
        waiting = [i for i in p.transform if i != c and i not in done and i not in others]
        if c in whole and not waiting:
            return tuple(others) + (c,), "c2r"
        return (tuple(others), "c2c") if others else None
    return (tuple(whole), "c2c") if whole else None


def _may_transform(p: FFTProblem, i: int, done: frozenset) -> bool:
    if not p.real:
        return True
    c = p.half
    if not p.inverse:
        return i == c if c not in done else True
    if i != c:
        return True
    return all(j in done for j in p.transform if j != c)


def _closure(p: FFTProblem, assign: tuple, done: frozenset):
    """Transform everything that is whole now; returns ``(done, actions)``."""
    stage = _local_stage(p, assign, done)
    if stage is None:
        return done, ()
    axes, kind = stage
    new_done = done | frozenset(axes)
    src = p.layout(assign, done)
    dst = p.layout(assign, new_done)
    action = LocalFFT(axes, kind, tuple(p.after[i] for i in axes), src, dst)
    return new_done, (action,)


_STRICT, _RELAXED, _GATHER = 0, 1, 2


def _moves(p: FFTProblem, assign: tuple, done: frozenset, level: int, active: tuple):
    """Candidate single-dimension moves: ``(new assignment, gathered axis or None)``."""
    names = p.mesh.names
    for k in active:
        d = names[k]
        here = assign[k]
        targets = list(range(len(p.names))) + [-1]
        for t in targets:
            if t == here:
                continue
            new = assign[:k] + (t,) + assign[k + 1 :]
            if t == -1:
                if p.dst.owner(d) is None:
                    yield new, None
                elif level >= _GATHER and here >= 0:
                    yield new, here
                continue
            if level == _STRICT:
                dims = tuple(names[j] for j, a in enumerate(new) if a == t)
                size = p.size(t, done)
                transformed = t in done
                is_t = t in p.transform
                matches = (dims == p.src.shard[t] and (not is_t or not transformed)) or (
                    dims == p.dst.shard[t] and (not is_t or transformed)
                )
                if size < p.mesh.size(dims) and not matches:
                    continue
            yield new, None


def _search(p: FFTProblem, level: int):
    all_done = frozenset(p.transform)
    names = p.mesh.names
    active = tuple(
        k for k, d in enumerate(names) if p.src.owner(d) is not None or p.dst.owner(d) is not None
    )
    start_assign = p.assignment(p.src)
    done0, acts0 = _closure(p, start_assign, frozenset())
    start = (start_assign, done0)
    counter = itertools.count()
    # state (assignment, done) or "goal" -> (cost, parent state, actions, gathered)
    best: dict[Any, tuple] = {start: ((0, 0, 0), None, acts0, ())}
    heap: list[tuple] = [((0, 0, 0), next(counter), start)]
    goal = None
    while heap:
        cost, _, state = heapq.heappop(heap)
        if state == "goal":
            goal = cost
            break
        if best[state][0] != cost:
            continue
        assign, done = state
        layout = p.layout(assign, done)
        edges: list[tuple] = []
        if done == all_done:
            final = move_cost(layout, p.dst, p.mesh, p.itemsize(done))
            edges.append(("goal", final, (Move(layout, p.dst),), ()))
        else:
            for new, gathered in _moves(p, assign, done, level, active):
                target = p.layout(new, done)
                c = move_cost(layout, target, p.mesh, p.itemsize(done))
                new_done, acts = _closure(p, new, done)
                kept = (gathered,) if gathered is not None else ()
                edges.append(((new, new_done), c, (Move(layout, target),) + acts, kept))
            for i in p.transform:
                if i in done or not _may_transform(p, i, done) or i not in assign:
                    continue
                post = p.layout(assign, done | {i})
                found = _best_four_step(p, layout, post, i, done)
                if found is None:
                    continue
                fs, c = found
                new_done, acts = _closure(p, assign, done | {i})
                edges.append(((assign, new_done), c, (fs,) + acts, ()))
        for target, c, acts, gathered in edges:
            total = (cost[0] + c[0], cost[1] + c[1], cost[2] + 1)
            old = best.get(target)
            if old is None or total < old[0]:
                best[target] = (total, state, acts, gathered)
                heapq.heappush(heap, (total, next(counter), target))
    if goal is None:
        return None
    actions: list = []
    gathered = []
    state = "goal"
    while state is not None:
        _, parent, acts, gath = best[state]
        actions[:0] = acts
        gathered[:0] = gath
        state = parent
    return actions, goal, gathered


def _merge_moves(p: FFTProblem, actions: list) -> tuple:
    """Fuse consecutive moves into one transition where the library plans it no dearer."""
    out: list = []
    for act in actions:
        if isinstance(act, Move) and act.src == act.dst:
            continue
        if isinstance(act, Move) and out and isinstance(out[-1], Move):
            prev = out[-1]
            itemsize = 8  # relative comparison only
            merged = move_cost(prev.src, act.dst, p.mesh, itemsize, _MERGE)
            apart = _add(move_cost(prev.src, prev.dst, p.mesh, itemsize, _MERGE),
                         move_cost(act.src, act.dst, p.mesh, itemsize, _MERGE))
            if (merged[0], merged[1]) <= (apart[0], apart[1]):
                out[-1] = Move(prev.src, act.dst)
                if out[-1].src == out[-1].dst:
                    out.pop()
                continue
        out.append(act)
    return tuple(out)


@cached(1024)
def plan_fft(p: FFTProblem) -> FFTPlan:
    """The cheapest plan for ``p`` (cached).

    Tries, in order: balanced intermediate layouts; any intermediate layout;
    and, only if neither reaches the output, gathering a transform axis
    (the plan then lists it in ``gathered`` and the op warns).
    """
    for level in (_STRICT, _RELAXED, _GATHER):
        found = _search(p, level)
        if found is not None:
            actions, cost, gathered = found
            names = tuple(dict.fromkeys(p.names[i] for i in gathered if i in p.transform))
            return FFTPlan(p, _merge_moves(p, actions), cost[:2], names)
    raise AssertionError("an FFT plan always exists once gathers are allowed")  # pragma: no cover
