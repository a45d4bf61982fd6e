"""Every context the library pushes is popped on every exit path.

Contexts: the ambient mesh (``es.use_mesh``, ``shard_map``), the split shapes and the variance
tracking of a ``shard_map`` body, the plan policy scope (``es.optimize``) and communication
counting (``es.count_communication``). Exit paths: an exception, ``KeyboardInterrupt``, a
generator closed, thrown into or dropped while suspended inside the context, and a
``torch.compile`` failure while tracing code that enters the context.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

import einshard as es
from einshard.core import _context, policy
from einshard.comm import checks, comm_stats
from einshard.runtime import vma as _vma


def _state() -> dict:
    amb = _context.current()
    return {
        "mesh": amb.mesh,
        "shapes": dict(amb.shapes),
        "shapes_key": amb.shapes_key,
        "body": amb.shard_map,
        "policy": policy._SCOPE.get(),
        "counting": len(comm_stats._ACTIVE),
        "tracking bodies": _vma.ACTIVE,
        "tracker": _vma.current(),
        "torch function modes": torch._C._len_torch_function_stack(),
        "planned": getattr(checks._PLANNED, "depth", 0),
    }


CLEAN = {
    "mesh": None,
    "shapes": {},
    "shapes_key": (),
    "body": None,
    "policy": None,
    "counting": 0,
    "tracking bodies": 0,
    "tracker": None,
    "torch function modes": 0,
    "planned": 0,
}


def _bad_backend(gm, example_inputs):
    """Compiles graphs without ``sin``: fails only on the code after a graph break, once the eager part
    before it has run (the case that used to leave the context pushed)."""
    if any("sin" in str(node.target) for node in gm.graph.nodes):
        raise RuntimeError("this backend cannot compile sin")
    return gm.forward


def _every_exit_path(enter, inside=lambda: None, compiled=True) -> list[str]:
    """Leave the context ``enter()`` in every way; the names of the paths that left state behind."""
    assert _state() == CLEAN, _state()
    leaks = []

    def check(path):
        if _state() != CLEAN:
            leaks.append(f"{path}: {_state()}")

    for exc in (ValueError("boom"), KeyboardInterrupt()):
        try:
            with enter():
                inside()
                raise exc
        except BaseException as got:  # noqa: BLE001
            assert got is exc
        check(type(exc).__name__)

    def gen():
        with enter():
            inside()
            yield 1
            yield 2

    g = gen()
    next(g)
    g.close()
    check("generator closed")
    g = gen()
    next(g)
    with pytest.raises(KeyboardInterrupt):
        g.throw(KeyboardInterrupt())
    check("generator thrown into")
    g = gen()
    next(g)
    del g
    gc.collect()
    check("generator dropped")

    if compiled:

        def fn(x):
            y = x * 2  # a first graph, compiled fine
            with enter():
                inside()
                return y.sin()

        # dynamo may run the context's frame eagerly (then the call succeeds) or fail while tracing
        # it (our backend, or dynamo itself on library internals): the state is clean either way
        try:
            torch.compile(fn, backend=_bad_backend)(torch.ones(2))
        except Exception:  # noqa: BLE001 - any compile failure
            pass
        finally:
            torch._dynamo.reset()
        check("torch.compile")
    return leaks


def _mesh():
    return es.wrap_mesh(torch.distributed.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),),
                                                                        mesh_dim_names=("tp",)))


@pytest.mark.ranks(2)
def test_ambient_mesh_use_mesh():
    mesh = _mesh()
    assert _every_exit_path(lambda: es.use_mesh(mesh), lambda: es.current_mesh() is mesh) == []


@pytest.mark.ranks(2)
def test_policy_scope():
    assert _every_exit_path(lambda: es.optimize("memory")) == []


@pytest.mark.ranks(2)
def test_communication_counting():
    mesh = _mesh()
    assert _every_exit_path(es.count_communication, lambda: es.spmd.psum(torch.ones(1), "tp", mesh=mesh)) == []


@pytest.mark.ranks(2)
def test_planned_operation_scope():
    assert _every_exit_path(checks.planned, compiled=False) == []


# -- shard_map: the ambient mesh, the split shapes and variance tracking of its body ----------------


class _Body:
    """A shard_map body that raises ``exc``, after an op that reads the ambient context."""

    def __init__(self, exc):
        self.exc = exc

    def __call__(self, x):
        y = es.einshard("a/tp b -> a b", x).sin()  # reads the ambient mesh and split shapes
        assert _context.current().shapes, "the split shapes are ambient in the body"
        if self.exc is not None:
            raise self.exc
        return y


def _shard_map_exits(check_vma: bool) -> list[str]:
    mesh = _mesh()
    leaks = []
    x = torch.ones(3 if dist.get_rank() == 0 else 2, 2)  # uneven blocks: split shapes [3, 2]
    shapes = {"tp": [3, 2]}

    def mapped(exc):
        return es.shard_map(_Body(exc), "a/tp b", "a b", mesh=mesh, shapes=shapes, check_vma=check_vma)

    def check(path):
        if _state() != CLEAN:
            leaks.append(f"{path}: {_state()}")

    assert mapped(None)(x).shape == (5, 2)
    check("return")
    for exc in (ValueError("boom"), KeyboardInterrupt()):
        try:
            mapped(exc)(x)
        except BaseException as got:  # noqa: BLE001
            assert got is exc, got
        check(type(exc).__name__)

    # a generator: the body raises StopIteration (a RuntimeError once it leaves the generator)
    def calls():
        yield mapped(None)(x)
        yield mapped(StopIteration())(x)

    with pytest.raises(RuntimeError, match="StopIteration"):
        list(calls())
    check("StopIteration in a generator")
    # a generator closed between calls
    g = calls()
    next(g)
    g.close()
    check("generator closed")

    # torch.compile fails while tracing the mapped function (after the context was pushed eagerly)
    try:
        with pytest.raises(Exception):  # noqa: B017 - dynamo's own error or our backend's
            torch.compile(mapped(None), backend=_bad_backend)(x)
    finally:
        torch._dynamo.reset()
    check("torch.compile failure")
    assert mapped(None)(x).shape == (5, 2)  # the next call works
    check("after")
    return leaks


@pytest.mark.ranks(2)
def test_shard_map_context_with_variance_tracking():
    assert _shard_map_exits(check_vma=True) == []


@pytest.mark.ranks(2, checks=False)
def test_shard_map_context_without_checks_or_tracking():
    assert _shard_map_exits(check_vma=False) == []
