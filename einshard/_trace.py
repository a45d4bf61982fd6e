"""Plans made while ``torch.compile`` traces, reachable from traced code.

Planning runs as ordinary Python while dynamo traces (in functions marked
``torch.compiler.assume_constant_result``), which may return only constants.
They register the plan here and return its name; traced code fetches it with
:func:`lookup`, an attribute of a module-level object, which is a source
dynamo knows how to guard on.
"""

from __future__ import annotations

import operator
import sys

import torch

__all__ = ["register", "lookup", "static_shape", "constant_result"]


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
