"""Agreeing across ranks before communicating, so that no rank is left behind.

An error that only one rank can see (its local size disagrees with
``shapes``, its tensor has another dtype, its ``shard_map`` body raised)
would leave the other ranks waiting in the next collective, or make gloo
abort the process on a size mismatch. With checks on (``es.set_checks(True)``
or ``EINSHARD_CHECKS=1``) every communicating operation first runs one
*agreement*: the ranks all-gather one fixed-size record each (8 ``int64``:
a status, the operation, a fingerprint of what must be equal), and when
anything is wrong every rank raises the same error. Only on that error path
do the ranks exchange text (messages and readable descriptions, as UTF-8
bytes in a tensor; nothing is unpickled).

Every agreement is the same collective, so a rank whose ``shard_map`` body
raised can join whatever agreement its peers reach next
(:func:`report_failure`); they raise :class:`RankFailedError`. Inside a
``shard_map`` body every agreement runs on the body's whole mesh, for that
reason. Checks are off by default: :func:`agree` then only raises the local
error and costs nothing. See ``docs/reliability.md``.

Under ``torch.compile`` an agreement in traced code runs at trace time, as
plain Python (:func:`_agree_at_trace_time`): what it compares (shapes,
dtypes, devices, split shapes) is static in the graph, so the ranks agree
once, when they all trace, and the compiled graph runs no check.
"""

from __future__ import annotations

import os
import threading
import weakref
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..core import _context, _trace
from ..core._cache import BoundedCache
from ..core._torch_compat import in_traced_code
from ..errors import EinshardError
from . import comm_stats

__all__ = ["set_checks", "checks_enabled", "agree", "report_failure", "RankFailedError"]


def _env_default() -> bool:
    return os.environ.get("EINSHARD_CHECKS", "").strip().lower() in ("1", "true", "yes", "on")


ENABLED: bool = _env_default()  # read by the hot paths of other modules; set it with set_checks

# Inside a planned operation every argument has been checked (and agreed on) once for the
# whole operation, so its collectives skip their own agreement: see :func:`planned`.
_PLANNED = threading.local()

# the record each rank contributes to an agreement
_OK, _ERROR, _FAILED = 0, 1, 2
# a record: status, message length, point (operation) code, group key, fingerprint, elements sent,
# elements expected, destination (8 int64)
_MASK = (1 << 62) - 1


class RankFailedError(RuntimeError):
    """Raised on the other ranks when some ranks' ``shard_map`` body raised (checks on).

    ``rank`` is the lowest failing (global) rank, ``message`` its exception
    as text (``"TypeName: message"``), ``ranks`` every failing rank. The
    failing ranks themselves re-raise their own exception.

    >>> err = RankFailedError(3, "RuntimeError: boom", (3,))
    >>> (err.rank, err.ranks)
    (3, (3,))
    """

    def __init__(self, rank: int, message: str, ranks=()):
        self.rank = int(rank)
        self.message = str(message)
        self.ranks = tuple(int(r) for r in ranks) or (self.rank,)
        others = [r for r in self.ranks if r != self.rank]
        also = f" (ranks {', '.join(map(str, self.ranks))} failed)" if others else ""
        super().__init__(f"rank {self.rank} raised in a shard_map body{also}: {self.message}")

    def __reduce__(self):
        return (RankFailedError, (self.rank, self.message, self.ranks))


class planned:
    """Context: the collectives inside run a plan whose arguments were already agreed on."""

    __slots__ = ()

    def __enter__(self):
        _PLANNED.depth = getattr(_PLANNED, "depth", 0) + 1

    def __exit__(self, *exc):
        _PLANNED.depth -= 1


def agreement_needed() -> bool:
    """Checks are on and no planned operation has agreed already."""
    return ENABLED and not getattr(_PLANNED, "depth", 0)


def set_checks(flag: bool) -> None:
    """Turn cross-rank checks on or off for this process.

    On: every communicating operation first agrees across ranks (one small
    all-gather), so a rank-local error raises the same ``ValueError`` on
    every rank, and an exception in a ``shard_map`` body on some ranks
    raises :class:`RankFailedError` on the others. See ``docs/reliability.md``.

    >>> es.set_checks(True)   # every rank raises the same ValueError  # doctest: +SKIP
    """
    global ENABLED
    ENABLED = bool(flag)


def checks_enabled() -> bool:
    """Whether cross-rank checks are on (default: ``EINSHARD_CHECKS=1`` in the environment).

    >>> checks_enabled() in (True, False)
    True
    """
    return ENABLED


def was_agreed(exc: BaseException, body: bool = False) -> bool:
    """``exc`` was raised on every rank of an agreement (no failure agreement is needed for it).

    ``body``: on every rank of the running ``shard_map`` body too (not only of a group reaching
    outside its mesh).
    """
    mark = getattr(exc, "_einshard_agreed", False)
    return mark is True or (not body and mark == "group")


def _mark_agreed(exc: BaseException, mark=True) -> BaseException:
    try:
        exc._einshard_agreed = mark  # type: ignore[attr-defined]  # a mark on any exception
    except AttributeError:  # an exception type without a __dict__: treated as not agreed
        pass
    return exc


# -- codes: plain integers that are equal on two ranks when the values are -------------------------

_DTYPE_CODES = {
    dt: i + 1
    for i, dt in enumerate(
        getattr(torch, name)
        for name in (
            "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "int64", "int32",
            "int16", "int8", "uint8", "bool", "complex32", "uint16", "uint32", "uint64",
        )
        if hasattr(torch, name)
    )
}
_DEVICE_CODES = BoundedCache(name="einshard.comm.checks.device_codes")
_STR_CODES = BoundedCache(name="einshard.comm.checks.str_codes")


def _code(value) -> int:
    if value is None:
        return -1
    if isinstance(value, int):  # bool included
        return int(value)
    if isinstance(value, torch.dtype):
        code = _DTYPE_CODES.get(value)
        return code if code is not None else _text_code(str(value))
    if isinstance(value, torch.device):
        code = _DEVICE_CODES.get(value)
        if code is None:
            code = _DEVICE_CODES.put(value, _text_code(str(value)))
        return code
    if isinstance(value, str):
        return _text_code(value)
    if isinstance(value, (tuple, list)):
        return hash(tuple(_code(v) for v in value))  # ints hash the same in every process
    raise TypeError(f"checks: cannot fingerprint a {type(value).__name__}")


def _text_code(text: str) -> int:
    code = _STR_CODES.get(text)
    if code is None:
        code = _STR_CODES.put(text, zlib.crc32(text.encode()))
    return code


def _render(value) -> str:
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, torch.Size):
        return str(tuple(value))
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_render(v) for v in value)
        return f"({inner},)" if isinstance(value, tuple) and len(value) == 1 else (
            f"({inner})" if isinstance(value, tuple) else f"[{inner}]")
    return str(value)


# -- groups ------------------------------------------------------------------------------------------

_RANKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _group_ranks(group) -> tuple[int, ...]:
    """The global ranks of ``group`` (cached)."""
    if group is None:
        group = dist.group.WORLD
    try:
        ranks = _RANKS.get(group)
    except TypeError:
        ranks = None
    if ranks is None:
        ranks = tuple(dist.get_process_group_ranks(group))
        try:
            _RANKS[group] = ranks
        except TypeError:
            pass
    return ranks


def _flag_device(group) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _body_group():
    """The agreement group of the running ``shard_map`` body (checks on), else ``None``."""
    body = _context.current().shard_map
    return None if body is None else getattr(body, "group", None)


_all_gather_tensor = None  # looked up on first use: a wrapper put on ``dist`` later (benchmarks) is seen


def _gather(record: torch.Tensor, group, size: int) -> torch.Tensor:
    global _all_gather_tensor
    if _all_gather_tensor is None:
        _all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    out = record.new_empty((size,) + tuple(record.shape))
    _all_gather_tensor(out.view(-1), record.contiguous().view(-1), group=group)
    if comm_stats.is_active():
        n = (size - 1) * record.numel() * record.element_size()
        comm_stats.record("check", group, n, n)
    return out


# -- the agreement -----------------------------------------------------------------------------------


def agree(
    group,
    error: BaseException | None,
    fingerprint: int | None = None,
    what: str = "",
    *,
    facts=(),
    point: str = "",
    sent: int = -1,
    received: int = -1,
    pairs=None,
    describe=None,
    always: bool = False,
) -> None:
    """Raise ``error`` here, or (checks on) the same error on every rank of ``group``.

    With checks off: raises ``error`` if it is not ``None``; no communication. ``always``: agree
    even with checks off (a call whose arguments one rank alone can contradict, such as an
    explicit ``shapes=``, costs this one all-gather per call).

    With checks on: one all-gather of a fixed-size ``int64`` record per rank
    over ``group`` (over the whole mesh inside a ``shard_map`` body). Every
    rank then raises the same error when

    - some rank passed an ``error``: ``ValueError("rank R: <message>")`` for
      the lowest failing global rank ``R`` (other types are reported as
      ``"TypeName: message"``);
    - some rank's ``shard_map`` body raised (:func:`report_failure`):
      :class:`RankFailedError`;
    - the ranks are at different operations (``point``), or disagree on
      ``fingerprint`` or on ``facts`` (``(label, value)`` pairs: dtypes,
      devices, shapes, ints, strings, tuples of them; compared among the
      ranks of ``group``): a ``ValueError`` naming ``what``, the
      disagreeing ranks and their values;
    - ``pairs`` (``(src, dst)`` group ranks, for point-to-point exchanges)
      has a source whose ``sent`` element count differs from its
      destination's ``received`` one.

    ``describe`` (optional): a function that renders what ``fingerprint``
    stands for, called on the error path only.

    Messages and readable values are exchanged (as UTF-8 bytes) only when
    something is wrong.

    >>> err = None if x.shape[0] == shapes[rank] else ValueError("size mismatch")  # doctest: +SKIP
    >>> agree(group, err, facts=(("dtype", x.dtype),), point="all_gather")  # doctest: +SKIP
    """
    if not (ENABLED or always):
        if error is not None:
            raise error
        return
    if in_traced_code():  # code that dynamo traces: agree now, at trace time (``describe`` is not carried)
        _agree_at_trace_time(_trace.group_name(group), _trace.group_name(_body_group()),
                             None if error is None else (type(error), error.args), fingerprint, what, tuple(facts),
                             point, sent, received, pairs)
        return
    _agree(group, _body_group(), error, fingerprint, what, facts, point, sent, received, pairs, describe)


@_trace.constant_result
def _agree_at_trace_time(group, outer, error, fingerprint, what, facts, point, sent, received, pairs) -> None:
    """:func:`agree` run as plain Python while dynamo traces: the facts are constants of the graph (shapes are
    static in traced code), so agreeing once, when every rank traces, covers every call of the graph."""
    if error is not None:
        error = error[0](*error[1])
    _agree(_trace.resolve_group(group), _trace.resolve_group(outer), error, fingerprint, what, facts, point, sent,
           received, pairs, None)


def _agree(group, outer, error, fingerprint, what, facts, point, sent, received, pairs, describe) -> None:
    agreed = True  # whether the error raised below reaches every rank that must hear of it
    if outer is not None and group is not outer and not set(_group_ranks(group)) <= set(_group_ranks(outer)):
        # a group reaching outside the body's mesh (an explicit mesh= in the body): agree on it alone; an
        # error raised here is reported to the body's other ranks like a failure of the body
        outer, agreed = None, False
    wide = outer if outer is not None else group
    size = dist.get_world_size(wide)
    if size == 1:
        if error is not None:
            raise error
        return
    if fingerprint is not None:
        label = "what each rank derived from its arguments (uneven shards passed without shapes=?)"
        facts = ((label, _Fingerprint(fingerprint, describe)),) + tuple(facts)
    dst = -1  # where this rank sends ``sent`` elements, as a rank of the agreement group
    if pairs:
        me = dist.get_rank(group)
        dst = next((d for s, d in pairs if s == me and d != me), -1)
        if dst >= 0 and outer is not None:
            dst = _group_ranks(outer).index(_group_ranks(group)[dst])
    _run(wide, size, group if outer is not None else None, _ERROR if error is not None else _OK, error, facts, point,
         what, sent, received, dst, agreed)


class _Fingerprint(int):
    """A fingerprint; rendered by ``describe`` (or as a number) on the error path."""

    describe: Callable[[], object] | None

    def __new__(cls, value, describe=None):
        self = super().__new__(cls, value)
        self.describe = describe
        return self

    def __str__(self) -> str:
        if self.describe is not None:
            try:
                return str(self.describe())
            except Exception:  # noqa: BLE001 - the error path must not fail here
                pass
        return f"fingerprint {int(self) & 0xFFFFFFFF:08x}"


def report_failure(group, exc: BaseException) -> None:
    """Join the peers' next agreement on ``group`` with ``exc`` (a ``shard_map`` body raised here).

    The peers raise :class:`RankFailedError`; this rank returns and its
    caller re-raises ``exc`` (marked as agreed, so an enclosing body does
    not report it again). Needs checks on; nothing to do when ``exc`` was
    raised by an agreement (every rank has it already).

    >>> try:  # doctest: +SKIP
    ...     out = body(x)
    ... except BaseException as exc:
    ...     report_failure(group, exc)
    ...     raise
    """
    if not ENABLED or was_agreed(exc, body=True):
        return
    size = dist.get_world_size(group)
    _mark_agreed(exc)
    if size == 1:
        return
    try:
        _run(group, size, None, _FAILED, exc, (), "shard_map body", "", -1, -1, -1, True)
    except RankFailedError:
        pass  # this rank failed too: it raises its own exception


def _message(error: BaseException) -> str:
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - a broken __str__
        text = "<unprintable>"
    if isinstance(error, ValueError) and not isinstance(error, RankFailedError):
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _run(group, size, inner, status, error, facts, point, what, sent, received, dst, agreed):
    codes = tuple(_code(v) for _, v in facts)
    fp = hash(codes) & _MASK
    key = 0 if inner is None else _group_ranks(inner)[0]
    message = b"" if error is None else _message(error).encode("utf-8", "backslashreplace")
    record = torch.tensor(
        [status, len(message), _text_code(point), key, fp, sent, received, dst],
        dtype=torch.int64,
        device=_flag_device(group),
    )
    rows = _gather(record, group, size).tolist()
    # decided from the gathered rows only, so that every rank takes the same path
    if all(r[0] == _OK and r[2] == rows[0][2] for r in rows) and not _bad_pairs(rows):
        if all(r[4] == rows[0][4] for r in rows) or _same_within_groups(rows):
            return
    # -- the error path: every rank takes it (the decision depends only on the gathered rows) --
    members = _group_ranks(group)
    text = _payload(message, point, inner, facts)
    texts = _exchange(text, group, size)
    error_out = _mark_agreed(_decide(rows, texts, members, what), True if agreed else "group")
    if error is not None and status == _ERROR:
        raise error_out from error
    raise error_out


def _same_within_groups(rows) -> bool:
    first: dict = {}
    for r in rows:
        if first.setdefault(r[3], r[4]) != r[4]:
            return False
    return True


def _bad_pairs(rows):
    """(source, destination) rows where what the source sends is not what the destination expects."""
    return [(s, r[7]) for s, r in enumerate(rows) if 0 <= r[7] < len(rows) and r[5] != rows[r[7]][6]]


def _payload(message: bytes, point: str, inner, facts) -> bytes:
    where = point + (f" on group {comm_stats.group_label(inner)!r}" if inner is not None else "")
    parts = [where.encode(), message]
    parts += [f"{label}: {_render(value)}".encode("utf-8", "backslashreplace") for label, value in facts]
    return b"\x1e".join(parts)


def _exchange(data: bytes, group, size) -> list[list[str]]:
    """Every rank's ``data`` (UTF-8 fields separated by 0x1e): lengths, then padded bytes."""
    lengths = _gather(torch.tensor([len(data)], dtype=torch.int64, device=_flag_device(group)), group, size)
    n = max(1, int(lengths.max()))
    buf = torch.zeros(n, dtype=torch.uint8, device=_flag_device(group))
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = _gather(buf, group, size).cpu()
    result = []
    for j, length in enumerate(lengths.view(-1).tolist()):
        raw = bytes(out[j, :length].tolist())
        result.append(raw.decode("utf-8", "backslashreplace").split("\x1e"))
    return result


def _ranks_text(ranks) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _decide(rows, texts, members, what) -> BaseException:
    failed = [j for j, r in enumerate(rows) if r[0] == _FAILED]
    if failed:
        j = failed[0]
        return RankFailedError(members[j], texts[j][1], [members[k] for k in failed])
    errors = [j for j, r in enumerate(rows) if r[0] == _ERROR]
    if errors:
        j = errors[0]
        text = f"rank {members[j]}: {texts[j][1]}"
        if len(errors) > 1:
            text += f" (reported by {_ranks_text(members[k] for k in errors)})"
        # named as rank j named it: no entry point adds the expression on the way out, whether this rank
        # agreed inside the planner that names its errors or after it, so every rank raises the same message
        return EinshardError.named(text, "")
    points: dict = {}
    for j in range(len(rows)):
        points.setdefault(texts[j][0], []).append(members[j])
    if len({r[2] for r in rows}) > 1:
        where = "; ".join(f"{_ranks_text(rs)} at {p}" for p, rs in points.items())
        return EinshardError(f"the ranks reached different collective operations: {where}")
    bad = _bad_pairs(rows)
    if bad:
        s, d = bad[0]
        return EinshardError(
            f"the ranks disagree on the sizes of {what or texts[s][0]}: "
            f"rank {members[s]} sends {rows[s][5]} elements to rank {members[d]}, which expects {rows[d][6]}"
        )
    # facts: compare within each group (same key), label by label
    by_key: dict = {}
    for j, r in enumerate(rows):
        by_key.setdefault(r[3], []).append(j)
    for js in by_key.values():
        if len({rows[j][4] for j in js}) == 1:
            continue
        subject = what or texts[js[0]][0]
        nfacts = max(len(texts[j]) for j in js)
        for f in range(2, nfacts):
            values: dict = {}
            for j in js:
                line = texts[j][f] if f < len(texts[j]) else ""
                label, _, value = line.partition(": ")
                values.setdefault(value, []).append(members[j])
            if len(values) > 1:
                how = "; ".join(f"{_ranks_text(rs)} {'has' if len(rs) == 1 else 'have'} {v}"
                                for v, rs in values.items())
                return EinshardError(f"the ranks disagree on {subject}: {label or 'a value'}: {how}")
        return EinshardError(f"the ranks disagree on {subject}")
    return EinshardError(f"the ranks disagree on {what or texts[0][0]}")
