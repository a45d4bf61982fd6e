"""pytest plugin: run tests marked ``@pytest.mark.ranks(n)`` on ``n`` gloo CPU ranks.

Enable it in a ``conftest.py``::

    pytest_plugins = ("einshard.testing.pytest_plugin",)

A marked test function is not called in the pytest process: it is pickled by
reference and called on every rank of the shared pool
``einshard.testing.get_pool(n)`` with its fixture and parametrize values as
keyword arguments. A failure on any rank fails the test with that rank's
remote traceback; a hang fails it after the timeout (marker ``timeout=``,
else ``--ranks-timeout`` / ini ``ranks_timeout``, else 120 s). The ranks run
the test with cross-rank checks on (``es.set_checks(True)``: a rank-local
error raises on every rank instead of hanging the others) unless the marker
says ``checks=False``.

Fixtures: ``mesh_8``, ``mesh_2x4``, ``mesh_2x2x2`` (``MeshSpec`` objects that
every rank receives as built ``DeviceMesh`` objects) and ``mesh``,
parametrized over the three. See ``docs/testing.md``.
"""

from __future__ import annotations

import inspect
import pickle

import pytest

from ._errors import RankError
from ._mesh import MeshSpec
from ._pool import close_all_pools, get_pool, mp_context

DEFAULT_TIMEOUT = 120.0
_MARKER_LINE = (
    "ranks(n, timeout=None, checks=True): run the test on n gloo CPU ranks (einshard.testing), "
    "with es.set_checks(checks)"
)

MESH_8 = MeshSpec((8,), ("tp",))
MESH_2X4 = MeshSpec((2, 4), ("dp", "tp"))
MESH_2X2X2 = MeshSpec((2, 2, 2), ("dp", "sp", "tp"))


def pytest_addoption(parser):
    group = parser.getgroup("einshard", "einshard multi-rank tests")
    group.addoption(
        "--ranks-timeout",
        action="store",
        type=float,
        default=None,
        dest="ranks_timeout",
        metavar="SECONDS",
        help="default timeout of @pytest.mark.ranks tests (a marker's "
             "timeout= wins; default 120, or ini ranks_timeout)",
    )
    parser.addini(
        "ranks_timeout",
        "default timeout in seconds of @pytest.mark.ranks tests (default 120)",
        default=None,
    )


def pytest_configure(config):
    declared = [str(line).split(":")[0].split("(")[0].strip() for line in config.getini("markers")]
    if "ranks" not in declared:
        config.addinivalue_line("markers", _MARKER_LINE)


def pytest_report_header(config):
    try:
        method = mp_context().get_start_method()
    except Exception as exc:  # noqa: BLE001
        method = f"unavailable ({exc})"
    return f"einshard.testing: ranks start method {method}, default ranks timeout {_default_timeout(config):g} s"


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    close_all_pools()


def _default_timeout(config) -> float:
    value = config.getoption("ranks_timeout", None)
    if value is None:
        ini = config.getini("ranks_timeout")
        if ini not in (None, "", []):
            try:
                value = float(ini)
            except (TypeError, ValueError):
                raise pytest.UsageError(f"ini option ranks_timeout must be a number, got {ini!r}") from None
    return DEFAULT_TIMEOUT if value is None else float(value)


def _marker_params(item, marker):
    args, kwargs = list(marker.args), dict(marker.kwargs)
    n = kwargs.pop("n", None)
    if n is None:
        if not args:
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.ranks needs the number of ranks, e.g. ranks(8)")
        n = args.pop(0)
    timeout = kwargs.pop("timeout", None)
    if timeout is None and args:
        timeout = args.pop(0)
    checks = kwargs.pop("checks", True)
    if not isinstance(checks, bool):
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.ranks(checks=...) needs True or False, got {checks!r}")
    if args or kwargs:
        raise pytest.UsageError(f"{item.nodeid}: unexpected arguments to @pytest.mark.ranks: {args} {kwargs}")
    if not isinstance(n, int) or n < 1:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.ranks(n) needs a positive int, got {n!r}")
    if timeout is None:
        timeout = _default_timeout(item.config)
    return n, float(timeout), checks


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    marker = pyfuncitem.get_closest_marker("ranks")
    if marker is None:
        return None
    n, timeout, checks = _marker_params(pyfuncitem, marker)
    fn = pyfuncitem.obj
    if getattr(fn, "is_hypothesis_test", False):
        pytest.fail(
            "@pytest.mark.ranks cannot wrap a hypothesis @given test (every rank would draw its own "
            "examples). Leave the test unmarked and call einshard.testing.run_on_ranks(n, fn, ...) "
            "with each drawn example instead.",
            pytrace=False,
        )
    if inspect.iscoroutinefunction(fn):
        pytest.fail("@pytest.mark.ranks does not support async test functions", pytrace=False)
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    for name, value in kwargs.items():
        if isinstance(value, MeshSpec) and value.size != n:
            pytest.fail(
                f"argument {name}={value} spans {value.size} ranks but the test is marked ranks({n})",
                pytrace=False,
            )
    failure = pickling_error = None
    try:
        get_pool(n)._run(fn, (), kwargs, timeout, checks)
    except RankError as err:  # RankTimeout included
        failure = err
    except TypeError as err:
        if not str(err).startswith("einshard.testing:"):
            raise
        pickling_error = err
    # Fail outside the except blocks, so the report carries no chained-exception noise.
    if pickling_error is not None:
        bad = [name for name, value in kwargs.items() if not _picklable(value)]
        hint = (
            f"the test's arguments {bad} cannot be pickled; a ranks(n) test only gets picklable "
            "fixture values (they are sent to every rank)"
            if bad
            else "the test function must be importable at module level"
        )
        pytest.fail(f"{pickling_error}\n{hint}", pytrace=False)
    if failure is not None:
        reason = _all_ranks_outcome(failure, "Skipped")
        if reason is not None:
            try:
                skip = pytest.skip.Exception(reason, _use_item_location=True)
            except TypeError:  # older pytest
                skip = pytest.skip.Exception(reason)
            raise skip
        reason = _all_ranks_outcome(failure, "XFailed")
        if reason is not None:
            pytest.xfail(reason)
        pytest.fail(str(failure), pytrace=False)
    return True


def _picklable(value) -> bool:
    try:
        pickle.dumps(value)
        return True
    except Exception:  # noqa: BLE001
        return False


def _all_ranks_outcome(err: RankError, kind: str):
    """The reason if every failing rank called ``pytest.skip``/``xfail`` (and none hung)."""
    if err.unfinished or not err.failures:
        return None
    reasons = []
    for rank in sorted(err.failures):
        exc = err.exceptions.get(rank)
        if type(exc).__name__ != kind or type(exc).__module__ not in ("builtins", "_pytest.outcomes"):
            return None
        reasons.append(getattr(exc, "msg", None) or str(exc))
    ranks = sorted(err.failures)
    return f"{reasons[0]} (on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"


# -- fixtures ---------------------------------------------------------------------
@pytest.fixture
def mesh_8() -> MeshSpec:
    """``MeshSpec((8,), ("tp",))``: an 8-rank 1-d mesh (for ``ranks(8)`` tests)."""
    return MESH_8


@pytest.fixture
def mesh_2x4() -> MeshSpec:
    """``MeshSpec((2, 4), ("dp", "tp"))`` (for ``ranks(8)`` tests)."""
    return MESH_2X4


@pytest.fixture
def mesh_2x2x2() -> MeshSpec:
    """``MeshSpec((2, 2, 2), ("dp", "sp", "tp"))`` (for ``ranks(8)`` tests)."""
    return MESH_2X2X2


@pytest.fixture(params=[MESH_8, MESH_2X4, MESH_2X2X2], ids=["8", "2x4", "2x2x2"])
def mesh(request) -> MeshSpec:
    """Each of ``mesh_8``, ``mesh_2x4`` and ``mesh_2x2x2`` in turn (ids "8", "2x4", "2x2x2")."""
    return request.param
