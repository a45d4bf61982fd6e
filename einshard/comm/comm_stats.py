"""Communication accounting: calls and bytes per collective kind and mesh dimension.

>>> with es.count_communication() as stats:  # doctest: +SKIP
...     y = es.einshard("a/tp b -> a b", x, mesh=mesh)  # x: 8 float32 per rank, tp = 4 ranks
>>> stats.received_bytes, stats.calls  # doctest: +SKIP
(96, 1)
>>> print(stats)  # doctest: +SKIP
kind        group  direction  calls  sent B  received B
all_gather  tp     forward        1      96          96
total                             1      96          96

Every collective in :mod:`einshard.comm.collectives` calls :func:`record`. When no
``count_communication`` context is active, recording costs one truthiness
test of a module-level list.

Bytes are this rank's, under a direct or ring algorithm, padded where
padding is used: each collective's traffic rule in :mod:`einshard.comm.primitives`
(the numbers the planner prices), e.g. ``2 (P-1) N / P`` each way for an
all-reduce of ``N`` bytes over ``P`` ranks. ``check`` rows are the 8-byte
flags of ``checks.agree``. Groups of one rank communicate nothing and are not recorded.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist

from ..core import _torch_compat
from ..core._table import text_table

__all__ = [
    "CommRecord",
    "CommStats",
    "count_communication",
    "record",
    "register_group_label",
    "group_label",
    "is_active",
]

# The active CommStats objects. Collectives test ``is_active()`` before doing
# any accounting work, so the cost without a context is one call and a truthiness test.
_ACTIVE: list[CommStats] = []
_LOCK = threading.Lock()

FORWARD = "forward"
BACKWARD = "backward"


@dataclass
class CommRecord:
    """Calls and bytes of one (kind, group label, direction) entry, for this rank."""

    calls: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0

    def _add(self, other: CommRecord) -> None:
        self.calls += other.calls
        self.sent_bytes += other.sent_bytes
        self.received_bytes += other.received_bytes


class CommStats:
    """This rank's communication, recorded while a :func:`count_communication` context is active.

    Attributes and views:

    - ``sent_bytes``, ``received_bytes``, ``calls``: this rank's totals.
    - ``records``: ``{(kind, label, direction): CommRecord}``; ``kind`` is the
      collective (``"all_gather"``, ...), ``label`` the mesh dimension of the
      group (``"tp"``, ``"dp-sp"``; ``"world"`` or ``"group(0,2)"`` for groups
      no mesh has named) and ``direction`` ``"forward"`` or ``"backward"``
      (recorded inside autograd's backward pass).
    - ``forward`` / ``backward``: new ``CommStats`` holding only that direction.
    - ``filter(kind=None, label=None, direction=None)``: a new ``CommStats``.
    - ``by_kind()``, ``by_label()``, ``by_direction()``: ``{key: CommRecord}`` sums.

    >>> stats = CommStats()
    >>> stats._add("all_gather", "tp", "forward", 32, 96)
    >>> stats.calls, stats.forward.received_bytes, stats.backward.calls
    (1, 96, 0)
    """

    def __init__(self) -> None:
        self.records: dict[tuple[str, str, str], CommRecord] = {}

    # -- recording ---------------------------------------------------------
    def _add(self, kind: str, label: str, direction: str, sent: int, received: int, calls: int = 1) -> None:
        self.records.setdefault((kind, label, direction), CommRecord())._add(CommRecord(calls, sent, received))

    def reset(self) -> None:
        """Forget everything recorded so far."""
        self.records.clear()

    # -- totals ------------------------------------------------------------
    @property
    def sent_bytes(self) -> int:
        return sum(r.sent_bytes for r in self.records.values())

    @property
    def received_bytes(self) -> int:
        return sum(r.received_bytes for r in self.records.values())

    @property
    def calls(self) -> int:
        return sum(r.calls for r in self.records.values())

    # -- views -------------------------------------------------------------
    def filter(self, kind: str | None = None, label: str | None = None, direction: str | None = None) -> CommStats:
        """A new ``CommStats`` with the records that match every given key."""
        out = CommStats()
        for (k, lab, d), r in self.records.items():
            if ((kind is None or k == kind) and (label is None or lab == label)
                    and (direction is None or d == direction)):
                out.records[(k, lab, d)] = CommRecord(r.calls, r.sent_bytes, r.received_bytes)
        return out

    @property
    def data(self) -> CommStats:
        """The records of the data's collectives: every kind but ``check`` (the cross-ranks agreements of
        checks, and of calls given an explicit ``shapes=``)."""
        out = CommStats()
        out.records = {key: CommRecord(r.calls, r.sent_bytes, r.received_bytes)
                       for key, r in self.records.items() if key[0] != "check"}
        return out

    @property
    def forward(self) -> CommStats:
        """The forward records only."""
        return self.filter(direction=FORWARD)

    @property
    def backward(self) -> CommStats:
        """The records made inside autograd's backward pass only."""
        return self.filter(direction=BACKWARD)

    def _group_by(self, index: int) -> dict[str, CommRecord]:
        out: dict[str, CommRecord] = {}
        for key, r in self.records.items():
            out.setdefault(key[index], CommRecord())._add(r)
        return out

    def by_kind(self) -> dict[str, CommRecord]:
        """``{kind: CommRecord}`` summed over labels and directions."""
        return self._group_by(0)

    def by_label(self) -> dict[str, CommRecord]:
        """``{mesh-dimension label: CommRecord}`` summed over kinds and directions."""
        return self._group_by(1)

    def by_direction(self) -> dict[str, CommRecord]:
        """``{"forward" | "backward": CommRecord}``."""
        return self._group_by(2)

    # -- display -----------------------------------------------------------
    def __str__(self) -> str:
        header = ("kind", "group", "direction", "calls", "sent B", "received B")
        order = {FORWARD: 0, BACKWARD: 1}
        rows = [
            (k, lab, d, str(r.calls), str(r.sent_bytes), str(r.received_bytes))
            for (k, lab, d), r in sorted(self.records.items(), key=lambda kv: (order.get(kv[0][2], 2), kv[0]))
        ]
        rows.append(("total", "", "", str(self.calls), str(self.sent_bytes), str(self.received_bytes)))
        return "\n".join(text_table(header, rows, rule=False, right=(3, 4, 5)))

    def __repr__(self) -> str:
        return f"CommStats(calls={self.calls}, sent_bytes={self.sent_bytes}, received_bytes={self.received_bytes})"


@contextlib.contextmanager
def count_communication() -> Iterator[CommStats]:
    """Record this rank's collectives while the block runs.

    Nested and concurrent contexts all record every collective of the process.

    >>> with es.count_communication() as stats:  # doctest: +SKIP
    ...     y = es.comm.collectives.all_gather(x, group, dim=0)
    >>> print(stats)  # doctest: +SKIP
    """
    stats = CommStats()
    try:  # appended inside the try, so that no exit path skips the removal
        with _LOCK:
            _ACTIVE.append(stats)
        yield stats
    finally:
        with _LOCK:
            for i, s in enumerate(_ACTIVE):
                if s is stats:
                    del _ACTIVE[i]
                    break


def is_active() -> bool:
    """Whether any :func:`count_communication` context is recording."""
    return bool(_ACTIVE)


# -- group labels -------------------------------------------------------------

# Labels are kept weakly (ProcessGroup objects are weak-referenceable); the
# strong fallback covers group objects that are not.
_LABELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_STRONG_LABELS: dict[int, tuple[object, str]] = {}


def register_group_label(group, label: str) -> None:
    """Name ``group`` in the accounting (``Mesh.group`` registers mesh dimension names).

    The latest registration wins when one group serves several names.

    >>> register_group_label(mesh.get_group("tp"), "tp")  # doctest: +SKIP
    """
    group = dist.group.WORLD if group is None else group
    try:
        _LABELS[group] = label
    except TypeError:  # not weak-referenceable
        _STRONG_LABELS[id(group)] = (group, label)


def group_label(group) -> str:
    """The registered label of ``group``, else ``"world"`` or ``"group(r0,r1,...)"``.

    >>> group_label(None)  # doctest: +SKIP
    'world'
    """
    group = dist.group.WORLD if group is None else group
    try:
        label = _LABELS.get(group)
    except TypeError:
        label = None
    if label is None:
        entry = _STRONG_LABELS.get(id(group))
        if entry is not None and entry[0] is group:
            label = entry[1]
    if label is not None:
        return label
    if group is dist.group.WORLD:
        return "world"
    try:
        ranks = dist.get_process_group_ranks(group)
    except Exception:  # pragma: no cover
        return "group(?)"
    return "group(" + ",".join(str(r) for r in ranks) + ")"


def record(kind: str, group, sent_bytes: int, received_bytes: int, calls: int = 1) -> None:
    """Add one collective call to every active :func:`count_communication` context.

    ``group`` names the row (its registered label); the direction is
    ``"backward"`` inside autograd's backward pass, else ``"forward"``.

    >>> record("all_gather", group, sent_bytes=96, received_bytes=96)  # doctest: +SKIP
    """
    if not _ACTIVE:
        return
    label = group_label(group)
    direction = BACKWARD if _torch_compat.current_graph_task_id() != -1 else FORWARD
    for stats in list(_ACTIVE):
        stats._add(kind, label, direction, int(sent_bytes), int(received_bytes), calls)
