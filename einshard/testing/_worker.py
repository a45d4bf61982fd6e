"""The code that runs inside each rank process of a :class:`RankPool`.

Protocol (all messages are pickled tuples of builtins sent with
``Connection.send_bytes``; the task payload is a nested ``bytes`` object that
is unpickled only after ``sys.path`` has been set up):

parent -> worker
    ``("task", task_id, context, payload)``  run ``fn(*args, **kwargs)``
    ``("check", task_id)``                   barrier on the world group
    ``("stop",)``                            exit now
worker -> parent
    ``("ready", rank, pid, seconds)`` / ``("init_error", rank, traceback)``
    ``("result", task_id, rank, ok, value, exception, output, healthy)``
    ``("checked", task_id, rank, ok)``

The worker redirects its file descriptors 1 and 2 into a per-rank log file
for its whole life; the log is truncated at the start of every task and sent
back with the result, so ``print`` output and C-level output (gloo warnings)
are both captured. ``SIGUSR1`` makes the worker dump every thread's Python
stack into the log (the parent does this before killing a hung rank).
"""

from __future__ import annotations

import ast
import faulthandler
import importlib
import importlib.util
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from ..comm.checks import set_checks
from ._mesh import MeshSpec

_PROTOCOL = pickle.HIGHEST_PROTOCOL
_MAX_OUTPUT_BYTES = 1 << 20  # never ship more than 1 MiB of output per rank and task
_THIS_FILE = os.path.normcase(os.path.abspath(__file__))


def main(rank, world_size, conn, lifeline, store_path, log_path, gloo_timeout_s):
    """Entry point of a rank process (the ``target`` of ``multiprocessing.Process``)."""
    t0 = time.monotonic()
    try:  # own process group, so the parent can kill us and anything we start
        os.setpgid(0, 0)
    except OSError:
        pass
    _redirect_output(log_path)
    _start_watchdog(lifeline)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    os.environ.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
    )
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        _init_distributed(rank, world_size, store_path, gloo_timeout_s)
    except BaseException:
        _send(conn, ("init_error", rank, traceback.format_exc()))
        _exit(1)
    _send(conn, ("ready", rank, os.getpid(), time.monotonic() - t0))
    _serve(rank, conn, log_path)
    _exit(0)


# -- set-up ------------------------------------------------------------------
def _redirect_output(log_path):
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Line-buffered text streams on the redirected descriptors, so that a
    # killed rank's last lines are already in the log.
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr  # type: ignore[misc]  # the rank's own streams


def _start_watchdog(lifeline):
    """Exit as soon as the parent goes away (its end of ``lifeline`` closes)."""

    def watch():
        try:
            lifeline.poll(None)  # returns on EOF: the parent is gone or closed the pool
        except Exception:
            pass
        os._exit(3)

    threading.Thread(target=watch, name="einshard-parent-watchdog", daemon=True).start()


def _init_distributed(rank, world_size, store_path, gloo_timeout_s):
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=gloo_timeout_s),
    )


# -- task loop ---------------------------------------------------------------
def _serve(rank, conn, log_path):
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "task":
            _, task_id, context, payload = msg
            _send(conn, _run_task(rank, task_id, context, payload, log_path))
        elif kind == "check":
            _send(conn, ("checked", msg[1], rank, _barrier()))


def _run_task(rank, task_id, context, payload, log_path):
    _reset_log()
    ok, value, exc_bytes = True, None, None
    try:
        _prepare(context)
        set_checks(context.get("checks", True))  # cross-rank checks: on unless the task opted out
        fn, args, kwargs = pickle.loads(payload)
        args, kwargs = _materialise(args, kwargs)
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        ok, value, exc_bytes = False, _format_exception(exc), _pickle_exception(exc)
    else:
        try:
            value = pickle.dumps(result, protocol=_PROTOCOL)
        except BaseException as exc:  # noqa: BLE001
            ok = False
            value = (
                f"the result of the rank function could not be pickled "
                f"(type {type(result).__module__}.{type(result).__qualname__}):\n" + _format_exception(exc)
            )
    return ("result", task_id, rank, ok, value, exc_bytes, _read_log(log_path), _healthy())


def _prepare(context):
    """Make the parent's modules importable here, then import fn's module."""
    try:
        os.chdir(context["cwd"])
    except (OSError, KeyError, TypeError):
        pass
    parent_path = [p for p in context.get("sys_path", ()) if isinstance(p, str)]
    if parent_path:
        rest = [p for p in sys.path if p not in parent_path]
        sys.path[:] = parent_path + rest
    module, file = context.get("module"), context.get("file")
    if not module or module in sys.modules or module in ("__main__", "__mp_main__", "builtins"):
        return
    if context.get("rewrite") and file and os.path.isfile(file):
        try:
            _import_rewritten(module, file)
            return
        except ImportError:
            raise
        except Exception:  # rewriting machinery unavailable: plain import below
            sys.modules.pop(module, None)
    try:
        importlib.import_module(module)
    except ImportError:
        if not (file and os.path.isfile(file)):
            raise
        _load_from_file(module, file)


def _load_from_file(module, file, code=None):
    if "." in module:  # make sure the parent package exists, as an import would
        parent, _, child = module.rpartition(".")
        try:
            parent_mod = importlib.import_module(parent)
        except ImportError:
            parent_mod = None
    spec = importlib.util.spec_from_file_location(module, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load module {module!r} from {file!r}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    try:
        if code is None:
            spec.loader.exec_module(mod)
        else:
            exec(code, mod.__dict__)
    except BaseException:
        sys.modules.pop(module, None)
        raise
    if "." in module and parent_mod is not None:
        setattr(parent_mod, child, mod)
    return mod


def _import_rewritten(module, file):
    """Import a pytest test module with pytest's assertion rewriting."""
    from _pytest.assertion.rewrite import rewrite_asserts

    with open(file, "rb") as f:
        source = f.read()
    tree = ast.parse(source, filename=file)
    rewrite_asserts(tree, source, file, None)
    code = compile(tree, file, "exec", dont_inherit=True)
    _install_reprcompare()
    _load_from_file(module, file, code)


_REPRCOMPARE_INSTALLED = False


def _install_reprcompare():
    """Give rewritten asserts pytest's detailed ``==`` explanations (no config here)."""
    global _REPRCOMPARE_INSTALLED
    if _REPRCOMPARE_INSTALLED:
        return
    _REPRCOMPARE_INSTALLED = True
    try:
        from _pytest.assertion import util
    except ImportError:
        return

    class _Writer:
        def _highlight(self, source, lexer="python"):
            return source

    class _Config:
        def get_verbosity(self, *args, **kwargs):
            return 0

        def get_terminal_writer(self):
            return _Writer()

        def getoption(self, name, default=None, skip=False):
            return default

        def getini(self, name):
            return None

    def callbinrepr(op, left, right):
        try:
            expl = util.assertrepr_compare(_Config(), op, left, right)
        except Exception:
            return None
        if not expl:
            return None
        if len(expl) > 40:
            expl = expl[:40] + ["...", "(explanation truncated by einshard.testing)"]
        return "\n~".join(line.replace("\n", "\\n") for line in expl).replace("%", "%%")

    if util._reprcompare is None:
        util._reprcompare = callbinrepr


def _materialise(args, kwargs):
    """Replace top-level MeshSpec arguments by their built DeviceMesh."""
    args = tuple(a.build() if isinstance(a, MeshSpec) else a for a in args)
    kwargs = {k: (v.build() if isinstance(v, MeshSpec) else v) for k, v in kwargs.items()}
    return args, kwargs


def _barrier():
    try:
        dist.barrier()
        return True
    except BaseException:  # noqa: BLE001
        return False


def _healthy():
    try:
        return bool(dist.is_initialized())
    except BaseException:  # noqa: BLE001
        return False


# -- helpers -----------------------------------------------------------------
def _format_exception(exc):
    tb = exc.__traceback__
    # Drop the harness's own frames from the top of the traceback.
    while tb is not None and os.path.normcase(os.path.abspath(tb.tb_frame.f_code.co_filename)) == _THIS_FILE:
        tb = tb.tb_next
    try:
        # an exception whose message already holds its cause's (an error every rank agreed on, re-raised
        # from this rank's own) would show the message twice: the cause's traceback is left out, unless
        # EINSHARD_TESTING_VERBOSE is set
        chain = _verbose() or not _repeats_its_cause(exc)
        return "".join(traceback.format_exception(type(exc), exc, tb if tb is not None else exc.__traceback__,
                                                  chain=chain))
    except BaseException:  # noqa: BLE001 - e.g. a broken __str__
        return f"{type(exc).__module__}.{type(exc).__qualname__}: <exception could not be formatted>\n"


def _repeats_its_cause(exc) -> bool:
    cause = exc.__cause__ if exc.__cause__ is not None else exc.__context__
    if cause is None or cause.__cause__ is not None or cause.__context__ is not None:
        return False
    text = str(cause)
    return bool(text) and text in str(exc)


def _verbose() -> bool:
    return os.environ.get("EINSHARD_TESTING_VERBOSE", "").strip().lower() not in ("", "0", "false", "no")


def _pickle_exception(exc):
    outcomes = sys.modules.get("_pytest.outcomes")
    if outcomes is not None and isinstance(exc, outcomes.OutcomeException):
        # pytest.skip/xfail/fail exceptions claim to live in `builtins` and do not pickle.
        return pickle.dumps(("__pytest_outcome__", type(exc).__name__, exc.msg), protocol=_PROTOCOL)
    try:
        data = pickle.dumps(exc, protocol=_PROTOCOL)
        pickle.loads(data)  # make sure the parent side can rebuild it too
        return data
    except BaseException:  # noqa: BLE001
        return None


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _reset_log():
    _flush()
    try:
        os.ftruncate(1, 0)
    except OSError:
        pass


def _read_log(log_path):
    _flush()
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _MAX_OUTPUT_BYTES))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="backslashreplace")
    if size > _MAX_OUTPUT_BYTES:
        text = f"[... {size - _MAX_OUTPUT_BYTES} earlier bytes omitted ...]\n" + text
    return text


def _send(conn, msg):
    conn.send_bytes(pickle.dumps(msg, protocol=_PROTOCOL))


def _exit(code):
    _flush()
    os._exit(code)
