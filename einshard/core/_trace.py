"""Plans made while ``torch.compile`` traces, reachable from traced code.

Planning runs as ordinary Python while dynamo traces (in functions marked
``torch.compiler.assume_constant_result``), which may return only constants.
They register the plan here and return its name; traced code fetches it with
:func:`lookup`, an attribute of a module-level object, which is a source
dynamo knows how to guard on.

:func:`einshard.core._torch_compat.in_traced_code` tells the two apart: it is
true in code that dynamo traces and false in such trace-time Python
(:func:`~einshard.core._torch_compat.compile_in_progress` is true in both).
Process groups reach trace-time functions by name
(:func:`group_name`, :func:`resolve_group`): dynamo hands them a stand-in.

Code that must see the graph dynamo is building runs in :func:`at_trace_time`
(``torch._dynamo.comptime``): it gets the graph and the traced frames' local
variables, and hands a result back under a :func:`fresh_name` with
:func:`publish`. Errors found there are raised with :func:`trace_error`, an
``EinshardError`` that dynamo passes to the caller as it is.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import itertools
import operator
import sys
import types
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..errors import EinshardError
from . import _torch_compat
from ._torch_compat import in_traced_code

__all__ = ["register", "lookup", "static_shape", "constant_result", "group_name", "resolve_group",
           "stand_in", "fresh_name", "publish", "at_trace_time", "trace_error", "refuse", "keep_collectives_apart",
           "static_value"]

def constant_result(fn):
    """Make ``fn`` a trace-time planner: under ``torch.compile`` dynamo runs it as plain Python and keeps its
    result (a constant of the graph); called from eager code, it simply runs.

    Dynamo hands such a function only constants on torch <= 2.11 (later
    releases pass any object, guarded on its identity). So traced code passes
    every argument that is not a constant as a handle, ``(_HANDLE, id(obj))``,
    which dynamo computes with the same identity guard on every release, and
    the planner gets the object back (:func:`_from_handle`). The planner runs
    under :class:`einshard.core._torch_compat.trace_time`.

    A refusal (``EinshardError``) it raises while dynamo traces reaches the caller as an ``EinshardError``
    whose message is einshard's (:func:`trace_error`), not dynamo's wrapper around it.
    """

    @functools.wraps(fn)
    def planner(*args):
        with _torch_compat.trace_time():
            try:
                return fn(*[_from_handle(a) for a in args])
            except EinshardError as err:
                if isinstance(err, tuple(_TRACE_ERROR)):
                    raise
                raise trace_error(str(err)) from err

    _mark_constant(planner)
    _PLANNERS.append(planner)
    _PLANNERS.append(fn)

    @functools.wraps(fn)
    def call(*args):
        if in_traced_code():
            return planner(*[_handle(a) for a in args])
        return fn(*args)

    return call


def _mark_constant(fn) -> None:
    """``torch.compiler.assume_constant_result`` without importing dynamo when ``einshard`` is imported.

    The public decorator imports ``torch._dynamo`` (about a second) to set one
    mark on ``fn`` that dynamo reads when it traces a call. Before dynamo is
    loaded, the mark is set here directly; a test checks that torch's own
    decorator still sets exactly this mark.
    """
    if "torch._dynamo" in sys.modules:
        torch.compiler.assume_constant_result(fn)
    else:
        fn._dynamo_marked_constant = True


_HANDLE = "einshard.core._trace handle"
#: what dynamo hands a planner as it is on every release: tensors, constants, functions, torch's ops,
#: device meshes and process groups (the rest, einshard's own objects, goes as a handle)
_PLAIN = (torch.Tensor, type(None), bool, int, float, complex, str, bytes, tuple, list, dict, frozenset,
          torch.dtype, torch.device, torch.Size, type, types.FunctionType, types.BuiltinFunctionType,
          types.MethodDescriptorType, types.WrapperDescriptorType, types.MethodWrapperType,
          type(torch.ops.aten.add), type(torch.ops.aten.add.Tensor), DeviceMesh, dist.ProcessGroup)


def _handle(arg):
    """``arg`` as dynamo can hand it to a planner (in traced code): itself, or its handle."""
    if isinstance(arg, _PLAIN):
        return arg
    return (_HANDLE, id(arg))


def _from_handle(arg):
    """The object behind a handle (at trace time; the traced frame that passed it keeps it alive)."""
    if type(arg) is tuple and len(arg) == 2 and arg[0] == _HANDLE:
        return ctypes.cast(arg[1], ctypes.py_object).value
    return arg


_PLANNERS: list = []  # every planner made by constant_result, and the function each one runs
_SKIPPED: list = []  # how many of them dynamo was told to leave alone as frames of their own


def _leave_planners_alone() -> None:
    """Tell dynamo never to compile a trace-time planner (nor what it calls) as a frame of its own.

    Dynamo calls them itself while it traces. But where a graph break makes it
    run part of a compiled function eagerly, every Python frame called there is
    compiled on its own, these included: wasted compile time, and warnings
    about the caches they use. Done once dynamo is loaded (at trace time).
    """
    if len(_SKIPPED) == len(_PLANNERS):
        return
    eval_frame = sys.modules["torch._dynamo.eval_frame"]
    if not hasattr(eval_frame, "set_code_exec_strategy"):  # (older torch: such frames are compiled)
        _SKIPPED.extend(_PLANNERS[len(_SKIPPED):])
        return
    skip = eval_frame.FrameExecStrategy(eval_frame.FrameAction.SKIP, eval_frame.FrameAction.SKIP)
    for fn in _PLANNERS[len(_SKIPPED):]:
        eval_frame.set_code_exec_strategy(fn.__code__, skip)
        _SKIPPED.append(fn)


class _Registry:
    """One attribute per registered object."""


_OBJECTS = _Registry()
_NAMES: dict = {}  # id(obj) -> (obj, name)


#: the functional collectives no graph pass may merge (``(namespace, op)``; those this torch lacks are left out)
_COLLECTIVE_OPS = [(ns, op) for ns in ("_c10d_functional", "_c10d_functional_autograd")
                   for op in ("all_reduce", "all_reduce_coalesced", "all_gather_into_tensor",
                              "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
                              "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast",
                              "batch_p2p_ops", "isend", "irecv")]
_APART: list = []  # [True] once the collectives are kept apart


def keep_collectives_apart() -> None:
    """Tell AOTAutograd's common-subexpression pass never to merge two functional collectives.

    The pass merges nodes with the same op and the same input nodes. For a
    collective that is wrong whenever the merge happens on some ranks only:
    a rank whose block is empty gets its inputs from decompositions that make
    equal empty results one node (two heads' gradients of an attention over
    zero heads), the others do not, and that rank then runs one collective
    fewer: every rank hangs. A collective's result depends on the other
    ranks, not only on its inputs, so it is kept out of the pass the way
    random ops are (``torch._functorch.compile_utils.rand_ops``); a test
    checks that the pass still reads that list.
    """
    if _APART:
        return
    rand_ops = importlib.import_module("torch._functorch.compile_utils").rand_ops
    for ns, op in _COLLECTIVE_OPS:
        packet = getattr(getattr(torch.ops, ns), op, None) if hasattr(torch.ops, ns) else None
        if packet is not None and packet not in rand_ops:
            rand_ops.append(packet)
    _APART.append(True)


def register(obj) -> str:
    """The name under which ``obj`` is kept (registered once; kept for the life of the process)."""
    _leave_planners_alone()
    keep_collectives_apart()
    found = _NAMES.get(id(obj))
    if found is None or found[0] is not obj:
        found = (obj, f"obj{len(_NAMES)}")
        _NAMES[id(obj)] = found
        setattr(_OBJECTS, found[1], obj)
    return found[1]


def lookup(name: str):
    return getattr(_OBJECTS, name)


_FRESH = itertools.count()


@constant_result
def fresh_name() -> str:
    """A name no object is registered under yet (a trace-time constant), for :func:`publish`."""
    return f"fresh{next(_FRESH)}"


def publish(name: str, value) -> None:
    """Register ``value`` under ``name`` (at trace time; traced code reads it with :func:`lookup`)."""
    setattr(_OBJECTS, name, value)


def at_trace_time(fn) -> None:
    """Run ``fn(ctx)`` while dynamo traces the caller (``torch._dynamo.comptime``).

    ``ctx.get_local(name, stacklevel=1)`` reads the caller's local variables
    (tensors as graph proxies), ``ctx.graph()`` is the graph being built. Only
    for code that runs while compiling (dynamo is loaded then).
    """
    torch._dynamo.comptime.comptime(fn)


_TRACE_ERROR: list = []


def trace_error(message: str) -> EinshardError:
    """An ``EinshardError`` to raise at trace time; dynamo passes it to the caller unwrapped.

    Dynamo rewraps most exceptions raised while it traces; its ``UserError``
    ("valid in eager, not supported by the compiler") reaches the caller as it
    is, so the error is both.
    """
    if not _TRACE_ERROR:
        exc: Any = importlib.import_module("torch._dynamo.exc")  # loaded while compiling (not when unpickling)

        class EinshardCompileError(EinshardError, exc.UserError):
            """An einshard error found while ``torch.compile`` traces."""

            def __init__(self, msg: str):
                exc.UserError.__init__(self, exc.UserErrorType.INVALID_INPUT, msg)

            def __str__(self) -> str:
                return self.msg

            def __reduce__(self):  # made again in the process that unpickles it
                return trace_error, (self.msg,)

        EinshardCompileError.__module__, EinshardCompileError.__qualname__ = "einshard", "EinshardCompileError"
        _TRACE_ERROR.append(EinshardCompileError)
    return _TRACE_ERROR[0](message)


def refuse(message: str) -> None:
    """Raise ``EinshardError(message)`` so that it reaches the caller as an ``EinshardError`` with einshard's
    message, from any code: in code dynamo traces, from trace-time Python (a ``raise`` there would reach
    the caller as dynamo's "Observed exception"); else directly.

    Under ``torch.compile(fullgraph=True)`` the caller gets a :func:`trace_error`. Without ``fullgraph``,
    dynamo runs the frame eagerly instead of compiling it (as for any code it does not support), and the
    eager call refuses or not as eager code does.
    """
    if in_traced_code():
        _refuse_at_trace_time(message)
    raise EinshardError(message)


@constant_result
def _refuse_at_trace_time(message: str) -> int:
    raise trace_error(message)


def static_shape(t) -> tuple:
    """``t.shape`` as ints: plans depend on shapes, so dynamic ones are specialised (guarded)."""
    return tuple(operator.index(s) for s in t.shape)


def static_value(obj):
    """``obj`` (ints in dicts, lists and tuples) with every int a constant: a compiled function called again
    with other ints there may get them as dynamic values, which plans cannot take (they are specialised)."""
    if isinstance(obj, dict):
        return {k: static_value(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        values = [static_value(v) for v in obj]
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
    if isinstance(obj, (int, torch.SymInt)) and not isinstance(obj, bool):
        return operator.index(obj)
    return obj


def group_name(group):
    """A process group as a constant for a trace-time function (``None``: the default group)."""
    return None if group is None else group.group_name


def resolve_group(name):
    """The process group named by :func:`group_name` (at trace time)."""
    return None if name is None else _torch_compat.resolve_process_group(name)


def stand_in(shape, dtype, device) -> torch.Tensor:
    """A tensor of ``shape``, ``dtype`` and ``device`` holding one element (for planners that read only those)."""
    return torch.empty((), dtype=dtype, device=device).expand(shape)
