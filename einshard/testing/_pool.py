"""Pools of gloo CPU rank processes, and the functions that run code on them."""

from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref

from ..errors import EinshardError
from . import _worker
from ._errors import RankError, RankTimeout

__all__ = ["RankPool", "get_pool", "run_on_ranks", "spawn", "close_all_pools", "mp_context"]

_PROTOCOL = pickle.HIGHEST_PROTOCOL


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return default


def _verbose() -> bool:
    return os.environ.get("EINSHARD_TESTING_VERBOSE", "").strip().lower() not in ("", "0", "false", "no")


# -- process start method ------------------------------------------------------
_CTX_LOCK = threading.Lock()
_CTX = None


def mp_context():
    """The multiprocessing context used for rank processes.

    ``forkserver`` (default where available): one server process imports
    torch once, and every rank is a cheap fork of it, so starting 8 ranks
    costs about one torch import instead of eight. ``spawn`` is the portable
    fallback. Both re-import the parent's ``__main__`` as ``__mp_main__`` in
    the children, so functions defined in a guarded script work. Override
    with ``EINSHARD_TESTING_START_METHOD=spawn|forkserver``.
    """
    global _CTX
    with _CTX_LOCK:
        if _CTX is not None:
            return _CTX
        method = os.environ.get("EINSHARD_TESTING_START_METHOD", "").strip()
        methods = mp.get_all_start_methods()
        if not method:
            method = "forkserver" if "forkserver" in methods else "spawn"
        if method not in ("spawn", "forkserver") or method not in methods:
            raise EinshardError(
                f"EINSHARD_TESTING_START_METHOD={method!r}: use 'spawn' or 'forkserver' "
                f"(available here: {methods})"
            )
        ctx = mp.get_context(method)
        if method == "forkserver":
            from multiprocessing import forkserver

            server = forkserver._forkserver
            if getattr(server, "_forkserver_pid", None) is None:  # not started yet: preload torch
                preload = ["torch", "torch.distributed", "einshard.testing._worker", "einshard.testing._mesh"]
                if "pytest" in sys.modules:
                    preload += ["pytest", "_pytest.assertion.rewrite"]
                preload += list(getattr(server, "_preload_modules", ()) or ())
                ctx.set_forkserver_preload(list(dict.fromkeys(preload)))
        _CTX = ctx
        return ctx


# -- the pool --------------------------------------------------------------------
class _Incarnation:
    """One set of live rank processes (a pool restarts with a new one)."""

    def __init__(self, world_size, gloo_timeout):
        ctx = mp_context()
        self.world_size = world_size
        self.tmpdir = tempfile.mkdtemp(prefix=f"einshard-ranks{world_size}-")
        self.logs = [os.path.join(self.tmpdir, f"rank{r}.log") for r in range(world_size)]
        store = os.path.join(self.tmpdir, "store")
        self.started = time.monotonic()
        self.ready = [False] * world_size
        self.startup_seconds = None
        self.procs, self.conns = [], []
        lifeline_r, self.lifeline = ctx.Pipe(duplex=False)
        try:
            for rank in range(world_size):
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_worker.main,
                    args=(rank, world_size, child_conn, lifeline_r, store, self.logs[rank], gloo_timeout),
                    name=f"einshard-rank{rank}-of-{world_size}",
                    daemon=False,
                )
                proc.start()
                child_conn.close()
                self.procs.append(proc)
                self.conns.append(parent_conn)
        except BaseException:
            lifeline_r.close()
            self.kill()
            raise
        lifeline_r.close()

    @property
    def pids(self):
        return [p.pid for p in self.procs]

    def read_log(self, rank, limit=1 << 20, offset=None):
        """The last ``limit`` bytes of ``rank``'s log; from ``offset``: the first ``limit`` bytes after it."""
        try:
            with open(self.logs[rank], "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - limit) if offset is None else offset)
                return f.read(limit).decode("utf-8", errors="backslashreplace")
        except (OSError, IndexError):
            return ""

    def replies(self, ranks, timeout, wanted):
        """``(rank, message)`` of ``ranks`` that answer within ``timeout`` while ``wanted(rank)``; ``None``: it died."""
        objs = {self.conns[r]: r for r in ranks}
        objs.update({self.procs[r].sentinel: r for r in ranks})
        for obj in mp_connection.wait(list(objs), timeout=timeout):
            r = objs[obj]
            if wanted(r):
                yield r, _recv(self.conns[r]) if obj is self.conns[r] else None

    def describe_death(self, rank, during="while running the task"):
        proc = self.procs[rank]
        proc.join(1.0)
        code = proc.exitcode
        if code is None:
            what = "closed its connection"
        elif code < 0:
            try:
                what = f"was killed by signal {signal.Signals(-code).name}"
            except ValueError:
                what = f"was killed by signal {-code}"
        else:
            what = f"exited with code {code}"
        log = self.read_log(rank, 8000).rstrip()
        text = f"rank {rank} (pid {proc.pid}) {what} {during}"
        if log:
            text += "\nlast output of the process:\n" + log
        return text + "\n"

    def _log_size(self, rank):
        try:
            return os.path.getsize(self.logs[rank])
        except OSError:
            return 0

    def dump_stacks(self, ranks, wait=1.0):
        """Make ``ranks`` write their Python stacks into their logs (SIGUSR1).

        Returns ``(stacks, outputs)``: the cleaned stack dump and the output
        the task had written before the dump, per rank.
        """
        sizes = {r: self._log_size(r) for r in ranks}
        before = {r: self.read_log(r) for r in ranks}
        if not hasattr(signal, "SIGUSR1"):
            return {}, before
        for r in ranks:
            try:
                os.kill(self.procs[r].pid, signal.SIGUSR1)
            except (OSError, TypeError):
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(0.1)
            if all("_run_task" in self.read_log(r, offset=sizes[r]) for r in ranks):
                time.sleep(0.05)  # let the last lines land
                break
        stacks = {r: _clean_stack(self.read_log(r, offset=sizes[r])) for r in ranks}
        return stacks, before

    def kill(self):
        """Kill every rank's process group, reap the processes, delete files."""
        me = os.getpgrp()
        for proc in self.procs:
            pid = proc.pid
            if pid is None:
                continue
            try:
                if os.getpgid(pid) == pid and pid != me:
                    os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                proc.kill()
            except (OSError, AttributeError, ValueError):
                pass
        self._reap(5.0)

    def stop(self, wait=3.0):
        """Ask the ranks to exit; kill what is still there after ``wait`` s."""
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(("stop",), protocol=_PROTOCOL))
            except (OSError, ValueError):
                pass
        try:
            self.lifeline.close()
        except OSError:
            pass
        deadline = time.monotonic() + wait
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        if any(p.is_alive() for p in self.procs):
            self.kill()
        else:
            self._reap(1.0)

    def _reap(self, wait):
        deadline = time.monotonic() + wait
        for proc in self.procs:
            try:
                proc.join(max(0.0, deadline - time.monotonic()))
            except (OSError, ValueError, AssertionError):
                pass
        for conn in self.conns + [self.lifeline]:
            try:
                conn.close()
            except OSError:
                pass
        for proc in self.procs:
            try:
                if proc.exitcode is not None:
                    proc.close()
            except ValueError:
                pass
        shutil.rmtree(self.tmpdir, ignore_errors=True)


_THREAD_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+")


def _clean_stack(text):
    """Tidy a faulthandler dump: drop the harness's watchdog thread and frames."""
    blocks: list = []
    block: list = []
    for line in text.splitlines():
        if _THREAD_HEADER.match(line):
            if block:
                blocks.append(block)
            # drop the thread id, so identical stacks of different ranks group together
            block = [_THREAD_HEADER.sub(lambda m: m.group(1), line)]
        elif line.strip():
            block.append(line)
    if block:
        blocks.append(block)
    kept = []
    for block in blocks:
        if any("in watch" in line and "_worker.py" in line for line in block):
            continue  # the parent-watchdog thread
        lines = []
        for line in block:
            if "_worker.py" in line and line.rstrip().endswith("in _run_task"):
                break  # everything below is the harness and multiprocessing
            lines.append(line)
        kept.append("\n".join(lines))
    out = "\n\n".join(kept).strip("\n")
    return (out or text.strip("\n") or "(no stack could be obtained)") + "\n"


class RankPool:
    """A long-lived pool of ``world_size`` CPU processes with ``torch.distributed`` (gloo) initialised.

    The processes start (in parallel, in the background) when the pool is
    created; :meth:`run` waits until they are ready. Start-up has its own
    limit (``startup_timeout``, default 120 s or
    ``EINSHARD_TESTING_STARTUP_TIMEOUT``) and does not count against a
    task's ``timeout``. When a task times out, or a rank fails while others
    are stuck, the processes are killed and the next :meth:`run` starts new
    ones transparently. Calls are serialised (one task at a time).

    Args:
        world_size: number of ranks.
        grace: seconds to wait for the other ranks after the first rank
            raised before killing the pool (default 3, or
            ``EINSHARD_TESTING_GRACE``).
        gloo_timeout: timeout of gloo collectives inside the ranks (default
            120 s, or ``EINSHARD_TESTING_GLOO_TIMEOUT``); the parent-side
            ``timeout`` of :meth:`run` is the real guard.
        startup_timeout: limit for starting the processes.

    >>> import torch, torch.distributed as dist
    >>> def total():                     # must be a module-level function
    ...     t = torch.tensor([dist.get_rank()])
    ...     dist.all_reduce(t)
    ...     return t.item()
    >>> with RankPool(4) as pool:                     # doctest: +SKIP
    ...     pool.run(total)
    [6, 6, 6, 6]
    """

    def __init__(
        self,
        world_size: int,
        *,
        grace: float | None = None,
        gloo_timeout: float | None = None,
        startup_timeout: float | None = None,
    ):
        world_size = int(world_size)
        if world_size < 1:
            raise EinshardError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.grace = _env_float("EINSHARD_TESTING_GRACE", 3.0) if grace is None else float(grace)
        self.gloo_timeout = (
            _env_float("EINSHARD_TESTING_GLOO_TIMEOUT", 120.0) if gloo_timeout is None else float(gloo_timeout)
        )
        self.startup_timeout = (
            _env_float("EINSHARD_TESTING_STARTUP_TIMEOUT", 120.0) if startup_timeout is None else float(startup_timeout)
        )
        self._lock = threading.RLock()
        self._inc: _Incarnation | None = None
        self._closed = False
        self._task_id = 0
        self.restarts = 0  # how many times the processes were (re)started
        self._launch()

    # -- lifecycle -------------------------------------------------------------
    def __repr__(self):
        state = "closed" if self._closed else ("running" if self._inc is not None else "stopped")
        return f"<RankPool world_size={self.world_size} {state}>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def pids(self) -> list[int]:
        """Process ids of the current rank processes (empty if none are running)."""
        inc = self._inc
        return inc.pids if inc is not None else []

    @property
    def startup_seconds(self) -> float | None:
        """Wall time the current processes took to become ready (None before)."""
        inc = self._inc
        return inc.startup_seconds if inc is not None else None

    def start(self, timeout: float | None = None) -> RankPool:
        """Start the processes if needed and wait until every rank is ready.

        >>> pool = RankPool(8).start()      # doctest: +SKIP
        """
        with self._lock:
            self._ensure_ready(self.startup_timeout if timeout is None else timeout)
        return self

    def close(self) -> None:
        """Stop the processes (idempotent). A closed pool cannot run tasks.

        >>> pool = RankPool(2); pool.close()     # doctest: +SKIP
        """
        with self._lock:
            self._closed = True
            inc, self._inc = self._inc, None
            if inc is not None:
                inc.stop()

    def __del__(self):
        try:
            if not self._closed and self._inc is not None:
                self._closed = True
                self._kill()
        except Exception:
            pass

    def _launch(self):
        _register_atexit()
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        self._inc = _Incarnation(self.world_size, self.gloo_timeout)
        self.restarts += 1
        _LIVE_POOLS.add(self)

    def _kill(self):
        inc, self._inc = self._inc, None
        if inc is not None:
            inc.kill()

    def _ensure_ready(self, timeout):
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if self._inc is None:
            self._launch()
        inc = self._inc
        assert inc is not None  # launched above
        if all(inc.ready):
            return
        deadline = inc.started + timeout
        failures: dict = {}
        grace_deadline = None
        try:
            while not all(inc.ready):
                waiting = [r for r in range(self.world_size) if not inc.ready[r] and r not in failures]
                if not waiting:
                    break
                if failures:  # the others are likely stuck in the rendezvous: short grace
                    deadline = min(deadline, grace_deadline)
                    if time.monotonic() >= deadline:
                        break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    stacks, outputs = inc.dump_stacks(waiting)
                    self._kill()
                    raise RankTimeout(
                        stacks,
                        timeout=timeout,
                        world_size=self.world_size,
                        outputs=outputs,
                        unfinished=waiting,
                        note="(while starting the rank processes: torch import + gloo initialisation)",
                    )
                for r, msg in inc.replies(waiting, remaining, lambda r: r not in failures and not inc.ready[r]):
                    if msg is None or msg[0] == "init_error":
                        failures[r] = msg[2] if msg is not None else inc.describe_death(r, "while starting")
                        grace_deadline = grace_deadline or time.monotonic() + self.grace
                    elif msg[0] == "ready":
                        inc.ready[r] = True
            if failures:
                outputs = {r: inc.read_log(r) for r in range(self.world_size)}
                self._kill()
                raise RankError(
                    failures,
                    world_size=self.world_size,
                    outputs=outputs,
                    note=(
                        "(the rank processes failed to start"
                        + (
                            "; if this runs from a script, guard its entry point with "
                            '`if __name__ == "__main__":`)'
                            if any(" while starting" in t for t in failures.values())
                            else ")"
                        )
                    ),
                )
            inc.startup_seconds = time.monotonic() - inc.started
        except BaseException:
            if self._inc is inc:
                self._kill()
            raise

    # -- running tasks -------------------------------------------------------------
    def run(self, fn, *args, timeout: float = 120.0, checks: bool = True, **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``fn`` must be a module-level (importable) function; it and the
        arguments travel by pickle. ``MeshSpec`` arguments (top level) are
        replaced by their built ``DeviceMesh`` on every rank. Raises
        :class:`RankError` if any rank raised and :class:`RankTimeout` if
        not every rank finished within ``timeout`` seconds (the pool is then
        restarted on the next call). ``checks`` (default on): the ranks run
        ``fn`` with ``es.set_checks(checks)``, so a rank-local error raises
        the same error on every rank instead of hanging the others. To pass a
        keyword named ``timeout`` or ``checks`` to ``fn``, bind it with
        ``functools.partial``.

        >>> get_pool(2).run(torch.distributed.get_rank)     # doctest: +SKIP
        [0, 1]
        """
        return self._run(fn, args, kwargs, timeout, checks)

    def _run(self, fn, args=(), kwargs=None, timeout=120.0, checks=True):
        kwargs = dict(kwargs or {})
        context, payload = _prepare_task(fn, args, kwargs, checks)
        with self._lock:
            self._ensure_ready(self.startup_timeout)
            try:
                return self._run_ready(context, payload, float(timeout))
            except (RankError, RankTimeout):
                raise
            except BaseException:  # KeyboardInterrupt, broken pipes...: state unknown
                self._kill()
                raise

    def _run_ready(self, context, payload, timeout):
        inc = self._inc
        assert inc is not None  # _ensure_ready launched it
        n = self.world_size
        self._task_id += 1
        task_id = self._task_id
        message = pickle.dumps(("task", task_id, context, payload), protocol=_PROTOCOL)
        results, failures, exceptions, outputs = {}, {}, {}, {}
        pending = set(range(n))
        broken = False
        start = time.monotonic()
        deadline = start + timeout
        grace_deadline = None
        for r in range(n):
            try:
                inc.conns[r].send_bytes(message)
            except (OSError, ValueError):
                failures[r] = inc.describe_death(r)
                pending.discard(r)
                broken = True
                grace_deadline = grace_deadline or time.monotonic() + self.grace
        while pending:
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            for r, msg in inc.replies(pending, remaining, pending.__contains__):
                if msg is not None and (msg[0] != "result" or msg[1] != task_id):
                    continue  # stale message; cannot happen with a healthy pool
                pending.discard(r)
                if msg is None:  # the process died
                    failures[r] = inc.describe_death(r)
                    broken = True
                else:
                    _, _, _, ok, value, exc_bytes, output, healthy = msg
                    outputs[r] = output
                    if not healthy:
                        broken = True
                    if ok:
                        try:
                            results[r] = pickle.loads(value)
                        except BaseException:  # noqa: BLE001
                            ok = False
                            value = "the rank's result could not be unpickled in the parent:\n" + traceback.format_exc()
                    if not ok:
                        failures[r] = value
                        exceptions[r] = _unpickle_exception(exc_bytes)
                if r in failures and grace_deadline is None:
                    grace_deadline = time.monotonic() + self.grace

        if pending:
            unfinished = sorted(pending)
            stacks, before = inc.dump_stacks(unfinished)
            outputs.update(before)
            self._kill()
            if failures:
                waited = min(timeout, time.monotonic() - start)
                raise RankError(
                    failures,
                    world_size=n,
                    outputs=outputs,
                    exceptions=exceptions,
                    unfinished=unfinished,
                    stacks=stacks,
                    note=(
                        f"(after the first failure, ranks {unfinished} did not return within "
                        f"{self.grace:g} s - probably waiting in a collective for a failed rank - "
                        f"so the pool was killed after {waited:.1f} s; it restarts on the next run)"
                    ),
                )
            raise RankTimeout(
                stacks, timeout=timeout, world_size=n, outputs=outputs, unfinished=unfinished
            )
        if failures and not broken and not self._check(inc):
            broken = True
        if broken:
            self._kill()
        if failures:
            raise RankError(failures, world_size=n, outputs=outputs, exceptions=exceptions)
        if _verbose():
            _forward_outputs(outputs)
        return [results[r] for r in range(n)]

    def _check(self, inc, timeout=5.0):
        """After a failed task: a barrier shows whether the ranks are still in step."""
        self._task_id += 1
        task_id = self._task_id
        msg = pickle.dumps(("check", task_id), protocol=_PROTOCOL)
        try:
            for conn in inc.conns:
                conn.send_bytes(msg)
        except (OSError, ValueError):
            return False
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            for r, reply in inc.replies(pending, remaining, pending.__contains__):
                if reply is None or reply[0] != "checked" or reply[1] != task_id or not reply[3]:
                    return False
                pending.discard(r)
        return True


# -- helpers ---------------------------------------------------------------------
def _recv(conn):
    try:
        return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return None


def _unpickle_exception(data):
    if data is None:
        return None
    try:
        exc = pickle.loads(data)
        if isinstance(exc, tuple) and exc[:1] == ("__pytest_outcome__",):
            from _pytest import outcomes

            cls = getattr(outcomes, exc[1], None)
            return cls(exc[2]) if isinstance(cls, type) and issubclass(cls, BaseException) else None
        return exc
    except BaseException:  # noqa: BLE001
        return None


def _forward_outputs(outputs):
    for r in sorted(outputs):
        text = outputs[r]
        if text and text.strip():
            sys.stdout.write(f"-------- rank {r} output --------\n{text}")
            if not text.endswith("\n"):
                sys.stdout.write("\n")
    sys.stdout.flush()


def _target(fn):
    """The object whose module must be importable for ``fn`` to unpickle."""
    seen = 0
    while seen < 10:
        seen += 1
        if hasattr(fn, "func") and callable(fn.func):  # functools.partial
            fn = fn.func
        elif hasattr(fn, "__func__"):  # bound method
            fn = fn.__func__
        else:
            break
    return fn


def _prepare_task(fn, args, kwargs, checks=True):
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    target = _target(fn)
    module = getattr(target, "__module__", None)
    mod = sys.modules.get(module) if module else None
    file = getattr(mod, "__file__", None) if mod is not None else None
    loader = getattr(mod, "__loader__", None)
    rewrite = type(loader).__name__ == "AssertionRewritingHook"
    qualname = getattr(target, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise TypeError(
            f"einshard.testing: {module}.{qualname} is not a module-level function; rank functions "
            "travel by pickle (by reference), so define them at the top level of an importable module"
        )
    try:
        payload = pickle.dumps((fn, tuple(args), dict(kwargs)), protocol=_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"einshard.testing: the function {module}.{qualname} and its arguments must be picklable "
            f"(module-level function, picklable arguments): {type(exc).__name__}: {exc}"
        ) from exc
    context = {
        "sys_path": list(sys.path),
        "cwd": os.getcwd(),
        "module": module,
        "file": file,
        "rewrite": rewrite,
        "checks": bool(checks),
    }
    return context, payload


# -- shared pools -------------------------------------------------------------------
_POOLS: dict[int, RankPool] = {}
_POOLS_LOCK = threading.Lock()
_LIVE_POOLS: weakref.WeakSet[RankPool] = weakref.WeakSet()
_ATEXIT_DONE = False


def _register_atexit():
    global _ATEXIT_DONE
    if not _ATEXIT_DONE:
        _ATEXIT_DONE = True
        atexit.register(_close_everything)


def get_pool(world_size: int) -> RankPool:
    """The shared pool with ``world_size`` ranks, created (and started) on first use.

    Shared pools are closed by :func:`close_all_pools`, at interpreter exit
    and at the end of a pytest session.

    >>> pool = get_pool(4)                       # doctest: +SKIP
    >>> pool.run(torch.distributed.get_world_size)   # doctest: +SKIP
    [4, 4, 4, 4]
    """
    world_size = int(world_size)
    with _POOLS_LOCK:
        pool = _POOLS.get(world_size)
        if pool is None or pool.closed:
            pool = RankPool(world_size)
            _POOLS[world_size] = pool
        return pool


def run_on_ranks(world_size: int, fn, *args, timeout: float = 120.0, checks: bool = True, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on every rank of the shared pool; return per-rank results.

    Same as ``get_pool(world_size).run(fn, *args, timeout=timeout, checks=checks, **kwargs)``
    (checks on by default).

    >>> def rank_times(x):          # module level, importable
    ...     return torch.distributed.get_rank() * x
    >>> run_on_ranks(4, rank_times, 10)      # doctest: +SKIP
    [0, 10, 20, 30]
    """
    return get_pool(world_size)._run(fn, args, kwargs, timeout, checks)


def spawn(fn, world_size: int = 8, args=(), kwargs=None, *, timeout: float = 300.0, checks: bool = True) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh rank processes, then tear them down.

    Like ``torch.multiprocessing.spawn``, but ``torch.distributed`` (gloo) is
    already initialised in every process, ``fn`` is *not* passed the rank
    (use ``torch.distributed.get_rank()``), results come back in rank order,
    and failures raise :class:`RankError` / :class:`RankTimeout`. ``timeout``
    covers start-up and the call; ``checks`` (default on) is
    ``es.set_checks`` in the ranks while ``fn`` runs. Works with functions defined in a script's
    ``__main__`` if the script has an ``if __name__ == "__main__":`` guard.

    >>> def hello():
    ...     return f"rank {torch.distributed.get_rank()}"
    >>> if __name__ == "__main__":
    ...     print(spawn(hello, 2))      # doctest: +SKIP
    ['rank 0', 'rank 1']
    """
    context, payload = _prepare_task(fn, args, kwargs or {})  # fail fast, before starting processes
    del context, payload
    start = time.monotonic()
    pool = RankPool(world_size, startup_timeout=timeout)
    try:
        pool.start()
        remaining = max(0.001, timeout - (time.monotonic() - start))
        return pool._run(fn, args, kwargs, remaining, checks)
    finally:
        pool.close()


def close_all_pools() -> None:
    """Close every shared pool (``get_pool``); they restart lazily if used again.

    >>> close_all_pools()     # doctest: +SKIP
    """
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    _close_pools(pools)


def _close_pools(pools):
    # Ask all of them to stop first, then wait: the processes exit in parallel.
    incs = []
    for pool in pools:
        with pool._lock:
            pool._closed = True
            inc, pool._inc = pool._inc, None
        if inc is not None:
            incs.append(inc)
            for conn in inc.conns:
                try:
                    conn.send_bytes(pickle.dumps(("stop",), protocol=_PROTOCOL))
                except (OSError, ValueError):
                    pass
    for inc in incs:
        inc.stop()


def _close_everything():
    close_all_pools()
    _close_pools(list(_LIVE_POOLS))
    if _CTX is None:
        return
    # Stop multiprocessing's helper processes now (and reap them) rather than
    # letting them notice our exit later and linger as orphans for a moment.
    try:
        if _CTX.get_start_method() == "forkserver":
            from multiprocessing import forkserver

            server = forkserver._forkserver
            pid = getattr(server, "_forkserver_pid", None)
            if pid is not None:
                # It holds no state; killing it spares a second torch finalisation.
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            server._stop()  # type: ignore[attr-defined]  # closes its pipe and reaps it
        from multiprocessing import resource_tracker

        resource_tracker._resource_tracker._stop()  # type: ignore[attr-defined]
    except Exception:
        pass
