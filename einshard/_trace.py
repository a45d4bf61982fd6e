"""Plans made while ``torch.compile`` traces, reachable from traced code.

Planning runs as ordinary Python while dynamo traces (in functions marked
``torch.compiler.assume_constant_result``), which may return only constants.
They register the plan here and return its name; traced code fetches it with
:func:`lookup`, an attribute of a module-level object, which is a source
dynamo knows how to guard on.

:func:`traced` tells the two apart: it is true in code that dynamo traces
and false in such trace-time Python (``torch.compiler.is_compiling`` is true
in both). Process groups reach trace-time functions by name
(:func:`group_name`, :func:`resolve_group`): dynamo hands them a stand-in.
"""

from __future__ import annotations

import operator
import sys

import torch
import torch.distributed.distributed_c10d as _c10d

__all__ = ["register", "lookup", "static_shape", "constant_result", "traced", "group_name", "resolve_group",
           "stand_in"]

#: whether dynamo is tracing this code (a constant ``True`` in the graph; ``False`` when Python runs it)
traced = torch.compiler.is_dynamo_compiling


def constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing dynamo when ``einshard`` is imported.

    The public decorator imports ``torch._dynamo`` (about a second) to set one
    mark on ``fn`` that dynamo reads when it traces a call. Before dynamo is
    loaded, the mark is set here directly; a test checks that torch's own
    decorator still sets exactly this mark.
    """
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


class _Registry:
    """One attribute per registered object."""


_OBJECTS = _Registry()
_NAMES: dict = {}  # id(obj) -> (obj, name)


def register(obj) -> str:
    """The name under which ``obj`` is kept (registered once; kept for the life of the process)."""
    found = _NAMES.get(id(obj))
    if found is None or found[0] is not obj:
        found = (obj, f"obj{len(_NAMES)}")
        _NAMES[id(obj)] = found
        setattr(_OBJECTS, found[1], obj)
    return found[1]


def lookup(name: str):
    return getattr(_OBJECTS, name)


def static_shape(t) -> tuple:
    """``t.shape`` as ints: plans depend on shapes, so dynamic ones are specialised (guarded)."""
    return tuple(operator.index(s) for s in t.shape)


def group_name(group):
    """A process group as a constant for a trace-time function (``None``: the default group)."""
    return None if group is None else group.group_name


def resolve_group(name):
    """The process group named by :func:`group_name` (at trace time)."""
    return None if name is None else _c10d._resolve_process_group(name)


def stand_in(shape, dtype, device) -> torch.Tensor:
    """A tensor of ``shape``, ``dtype`` and ``device`` holding one element (for planners that read only those)."""
    return torch.empty((), dtype=dtype, device=device).expand(shape)
