"""Exceptions raised by the multi-rank harness (no torch import here)."""

from __future__ import annotations

import os
import re
import sysconfig

__all__ = ["RankError", "RankTimeout"]

# Frames of these directories are not "the user's own" (the summary shows the innermost other one).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # einshard/
_LIBRARY_DIRS = tuple(
    os.path.normcase(os.path.abspath(d)) + os.sep
    for d in {_PACKAGE_DIR, *(sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib"))}
    if d
)
_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line \d+, in .*$')

# Limits that keep error messages readable.
_MAX_TRACEBACK_CHARS = 20_000
_MAX_OUTPUT_CHARS = 3_000
_MAX_STACK_CHARS = 6_000


def _tail(text: str, limit: int) -> str:
    """The last ``limit`` characters of ``text``, marking what was cut."""
    if len(text) <= limit:
        return text
    cut = len(text) - limit
    return f"[... {cut} earlier characters omitted ...]\n" + text[cut:]


def _fmt_ranks(ranks) -> str:
    return "[" + ", ".join(str(r) for r in sorted(ranks)) + "]"


def _group_identical(texts: dict[int, str]) -> list[tuple[list[int], str]]:
    """Group ranks whose text is identical, in rank order of first occurrence."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(texts):
        groups.setdefault(texts[rank], []).append(rank)
    return [(ranks, text) for text, ranks in groups.items()]


def _own_code(path: str) -> bool:
    if path.startswith("<"):  # code given to exec or compile is the user's; frozen modules are not
        return not path.startswith("<frozen")
    full = os.path.normcase(os.path.abspath(path)) + ""
    return not any(full.startswith(d) for d in _LIBRARY_DIRS)


def _summary(text: str) -> str:
    """The exception line(s) of a formatted traceback, then the innermost frame of the user's own code
    (not einshard's, the standard library's or an installed package's), with its source line."""
    lines = text.rstrip("\n").splitlines()
    frames = [i for i, line in enumerate(lines) if _FRAME.match(line)]
    if not frames:
        return text.strip()
    end = frames[-1] + 1
    while end < len(lines) and lines[end].startswith("    "):  # the frame's source line (and its carets)
        end += 1
    message = "\n".join(lines[end:]).strip() or text.strip()
    own = [i for i in frames if (m := _FRAME.match(lines[i])) is not None and _own_code(m.group("file"))]
    if not own:
        return message
    i = own[-1]
    where = [lines[i]] + [line for line in lines[i + 1 : i + 2] if line.startswith("    ") and line.strip("^~ ")]
    return message + "\n" + "\n".join(where)


def _section(ranks, title: str, text: str, limit: int, bar: str = "========") -> str:
    """One titled block of a message: ``text`` (shared by ``ranks``), cut to its last ``limit`` characters."""
    label = "rank" if len(ranks) == 1 else "ranks"
    return f"\n{bar} {label} {', '.join(map(str, ranks))}: {title} {bar}\n" + _tail(text.rstrip("\n"), limit)


class RankError(Exception):
    """One or more ranks raised (or died) while running a function.

    Attributes:
        failures: ``{rank: traceback text}`` for every failing rank; the text
            is the remote formatted traceback including the exception message.
        exceptions: ``{rank: exception object}`` where the remote exception
            could be pickled back (``None`` otherwise).
        outputs: ``{rank: captured stdout+stderr}`` of every rank for the task.
        unfinished: ranks that had not returned when the pool was torn down.
        stacks: ``{rank: Python stack dump}`` of the unfinished ranks, taken
            just before they were killed.
        world_size: number of ranks of the pool.

    >>> try:
    ...     run_on_ranks(2, my_fn)          # doctest: +SKIP
    ... except RankError as err:
    ...     print(sorted(err.failures))     # doctest: +SKIP
    [1]
    """

    def __init__(
        self,
        failures: dict[int, str] | str,
        *,
        world_size: int | None = None,
        outputs: dict[int, str] | None = None,
        exceptions: dict[int, BaseException | None] | None = None,
        unfinished=(),
        stacks: dict[int, str] | None = None,
        note: str = "",
    ):
        if isinstance(failures, str):  # plain message (e.g. re-raised by users)
            note, failures = failures, {}
        self.failures: dict[int, str] = dict(failures)
        self.world_size = world_size
        self.outputs: dict[int, str] = dict(outputs or {})
        self.exceptions: dict[int, BaseException | None] = dict(exceptions or {})
        self.unfinished: list[int] = sorted(unfinished)
        self.stacks: dict[int, str] = dict(stacks or {})
        self.note = note
        super().__init__(self._format())

    def __reduce__(self):
        return (
            _rebuild,
            (
                type(self),
                self.failures,
                {
                    "world_size": self.world_size,
                    "outputs": self.outputs,
                    "unfinished": self.unfinished,
                    "stacks": self.stacks,
                    "note": self.note,
                },
            ),
        )

    # -- message -----------------------------------------------------------
    def _headline(self) -> str:
        n = len(self.failures)
        if self.world_size:
            head = f"{n} of {self.world_size} ranks failed: {_fmt_ranks(self.failures)}"
        else:
            head = f"{n} rank{'s' if n != 1 else ''} failed: {_fmt_ranks(self.failures)}"
        if self.unfinished:
            head += f"; ranks {_fmt_ranks(self.unfinished)} had not finished and were killed"
        return head

    def _format(self) -> str:
        return "\n".join([self._headline()] + ([self.note] if self.note else []) + self._summaries() + self._sections()
                         + self._outputs())

    def _summaries(self) -> list[str]:
        """First, per group of ranks: the exception and the user's own frame where it was raised."""
        out = []
        tracebacks = {r: _summary(t) for r, t in self.failures.items() if "Traceback (most recent call last)" in t}
        for ranks, text in _group_identical(tracebacks):
            label = "rank" if len(ranks) == 1 else "ranks"
            out.append(f"{label} {', '.join(map(str, ranks))}: " + _tail(text, _MAX_OUTPUT_CHARS))
        return out

    def _sections(self) -> list[str]:
        parts = [
            _section(ranks, "traceback" + (" (identical)" if len(ranks) > 1 else ""), text, _MAX_TRACEBACK_CHARS)
            for ranks, text in _group_identical(self.failures)
        ]
        stacks = {r: t for r, t in self.stacks.items() if r not in self.failures}
        return parts + [_section(rs, "stack when killed", t, _MAX_STACK_CHARS) for rs, t in _group_identical(stacks)]

    def _outputs(self) -> list[str]:
        shown = {r: o for r, o in self.outputs.items() if o and o.strip()}
        order = sorted(shown, key=lambda r: (r not in self.failures, r))
        return [
            _section(ranks, "captured stdout/stderr", text, _MAX_OUTPUT_CHARS, "--------")
            for ranks, text in _group_identical({r: shown[r] for r in order})
        ]


class RankTimeout(RankError):
    """Not every rank finished within the timeout.

    The pool was killed (process groups included) and is restarted
    transparently by the next ``run()``. ``unfinished`` lists the ranks that
    had not returned; ``failures`` maps each of them to a dump of its Python
    stack at the moment of the timeout, so the message shows where each rank
    was stuck. ``timeout`` is the limit in seconds.

    >>> try:
    ...     run_on_ranks(2, waits_forever, timeout=5)     # doctest: +SKIP
    ... except RankTimeout as err:
    ...     print(err.unfinished)                         # doctest: +SKIP
    [0, 1]
    """

    def __init__(self, failures=None, *, timeout: float | None = None, **kwargs):
        self.timeout = timeout
        super().__init__(failures or {}, **kwargs)

    def __reduce__(self):
        fn, (cls, failures, kw) = super().__reduce__()
        kw["timeout"] = self.timeout
        return fn, (cls, failures, kw)

    def _headline(self) -> str:
        of = f" (of {self.world_size})" if self.world_size else ""
        t = f"{self.timeout:g} s" if self.timeout is not None else "the time limit"
        return (
            f"timed out after {t} on ranks {_fmt_ranks(self.unfinished)}{of}; "
            "the pool was killed and restarts on the next run"
        )

    def _sections(self) -> list[str]:
        parts = []
        for ranks, text in _group_identical(self.failures):
            raised = all(r not in self.unfinished for r in ranks)
            title = "traceback" if raised else "stack when the timeout expired"
            parts.append(_section(ranks, title, text, _MAX_TRACEBACK_CHARS if raised else _MAX_STACK_CHARS))
        return parts


def _rebuild(cls, failures, kwargs):
    return cls(failures, **kwargs)
