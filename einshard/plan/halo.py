"""Interval planning for halo exchanges and rolls: which runs of which block go where.

Both operations move rectangular pieces of rank blocks between the ranks of
one group (the mesh dimensions that shard the axes involved). Per axis the
pieces are described by *runs* ``(src_start, dst_start, length)``: elements
``src_start .. src_start+length`` of the owner's local block land at
``dst_start ..`` of the receiver's buffer. A piece of a multi-axis exchange
is the product of the runs of every exchanged axis, so corner (diagonal
neighbour) cells of 2-D and 3-D halos are simply the pieces whose runs are
non-empty on several axes at once, and they move in the same single exchange.

Halo: the receiver's buffer along an axis holds the *distinct* global
indices its widened block reads (``needed``), in the order it reads them (so
a wrap-around needs no reordering); each element moves once
per receiver even when a periodic halo wraps several times or a replicate
halo repeats an edge. :func:`halo_axis` then maps every output position of
the widened block to a buffer position (or to the constant ``fill``).

Roll: the receiver's buffer is its own output block; every source element
lands exactly once.

Everything here is pure arithmetic on global intervals; the runs are turned
into an exchange by :func:`einshard.comm.exchange.runs_exchange`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BOUNDARIES",
    "HaloAxis",
    "halo_needed",
    "halo_axis",
    "halo_runs",
    "roll_runs",
    "merge_runs",
]

BOUNDARIES = ("constant", "periodic", "replicate")

Interval = tuple[int, int]
Run = tuple[int, int, int]  # (src_start, dst_start, length)


def halo_needed(start: int, stop: int, left: int, right: int, n: int, boundary: str) -> tuple[Interval, ...]:
    """The disjoint global intervals that the widened block ``[start-left, stop+right)`` reads, in reading order.

    >>> halo_needed(4, 8, 2, 1, 10, "constant")
    ((2, 9),)
    >>> halo_needed(0, 3, 2, 0, 10, "periodic")
    ((8, 10), (0, 3))
    >>> halo_needed(8, 10, 0, 3, 10, "replicate")
    ((8, 10),)
    """
    lo, hi = start - left, stop + right
    if hi <= lo:
        return ()
    if boundary == "constant":
        a, b = max(lo, 0), min(hi, n)
        return ((a, b),) if b > a else ()
    if n <= 0:
        return ()
    if boundary == "replicate":
        a = min(max(lo, 0), n - 1)
        b = min(max(hi - 1, 0), n - 1) + 1
        return ((a, b),)
    # periodic
    if hi - lo >= n:
        return ((0, n),)
    s = lo % n
    if s + (hi - lo) <= n:
        return ((s, s + hi - lo),)
    return ((s, n), (0, s + hi - lo - n))


@dataclass(frozen=True)
class HaloAxis:
    """How one axis of a widened block is read from its buffer.

    ``needed``: the buffer's global intervals (see :func:`halo_needed`);
    ``left_fill`` / ``right_fill``: output positions outside the domain
    (``boundary="constant"``); ``index``: for every other output position,
    its position in the buffer, or ``None`` when that is the identity.
    """

    needed: tuple[Interval, ...]
    left_fill: int
    index: tuple[int, ...] | None
    right_fill: int

    @property
    def buffer_size(self) -> int:
        return sum(b - a for a, b in self.needed)


def halo_axis(start: int, stop: int, left: int, right: int, n: int, boundary: str) -> HaloAxis:
    """The read pattern of the widened block ``[start-left, stop+right)`` of an axis of size ``n``.

    >>> halo_axis(0, 3, 1, 1, 3, "periodic")
    HaloAxis(needed=((0, 3),), left_fill=0, index=(2, 0, 1, 2, 0), right_fill=0)
    >>> halo_axis(0, 2, 2, 0, 4, "constant")
    HaloAxis(needed=((0, 2),), left_fill=2, index=None, right_fill=0)
    """
    needed = halo_needed(start, stop, left, right, n, boundary)
    lo, hi = start - left, stop + right
    if boundary == "constant":
        lf = min(max(0 - lo, 0), hi - lo)
        rf = min(max(hi - max(n, lo), 0), hi - lo - lf)
        return HaloAxis(needed, lf, None, rf)
    if boundary == "periodic":
        sources = [p % n for p in range(lo, hi)]
    else:
        sources = [min(max(p, 0), n - 1) for p in range(lo, hi)]
    position = {g: k for k, g in enumerate(g for a, b in needed for g in range(a, b))}
    index = tuple(position[g] for g in sources)
    if index == tuple(range(len(index))) and len(index) == sum(b - a for a, b in needed):
        return HaloAxis(needed, 0, None, 0)
    return HaloAxis(needed, 0, index, 0)


def merge_runs(runs) -> tuple[Run, ...]:
    """Join runs that continue each other in both source and destination."""
    out: list[list[int]] = []
    for s, d, n in runs:
        if n <= 0:
            continue
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += n
        else:
            out.append([s, d, n])
    return tuple((s, d, n) for s, d, n in out)


def halo_runs(owner: Interval, needed: tuple[Interval, ...]) -> tuple[Run, ...]:
    """Runs from the owner block ``owner`` into a receiver buffer of global intervals ``needed``.

    >>> halo_runs((0, 10), ((0, 2), (8, 10)))
    ((0, 0, 2), (8, 2, 2))
    >>> halo_runs((4, 6), ((2, 9),))
    ((0, 2, 2),)
    """
    a, b = owner
    runs = []
    off = 0
    for lo, hi in needed:
        s, e = max(lo, a), min(hi, b)
        if e > s:
            runs.append((s - a, off + s - lo, e - s))
        off += hi - lo
    return merge_runs(runs)


def roll_runs(owner: Interval, dest: Interval, shift: int, n: int) -> tuple[Run, ...]:
    """Runs from the owner block into the destination block of ``torch.roll(x, shift)`` on an axis of size ``n``.

    Output position ``t`` holds source ``(t - shift) mod n``.

    >>> roll_runs((0, 5), (5, 10), 3, 10)      # t = 5..9 reads 2..6
    ((2, 0, 3),)
    >>> roll_runs((8, 10), (0, 5), 3, 10)      # t = 0..4 read 7, 8, 9, 0, 1: 8 and 9 are owned here
    ((0, 1, 2),)
    """
    s, e = dest
    a, b = owner
    length = e - s
    if length <= 0 or b <= a or n <= 0:
        return ()
    first = (s - shift) % n
    pieces = [(first, min(n, first + length), s)]
    if first + length > n:
        pieces.append((0, first + length - n, s + n - first))
    runs = []
    for lo, hi, t0 in pieces:
        x, y = max(lo, a), min(hi, b)
        if y > x:
            runs.append((x - a, t0 + (x - lo) - s, y - x))
    runs.sort(key=lambda r: r[1])
    return merge_runs(runs)
