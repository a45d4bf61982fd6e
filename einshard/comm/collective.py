"""One definition per collective: the :class:`Collective` entry and the forms generated from it.

A collective is a :class:`~einshard.comm.primitives.Primitive` (a planner step
kind: ``run``, ``traffic``, ``what``, ``basis``, its variance rule ``vary``)
that also holds

- ``check(x, group, ...)``: the raw form's signature and documentation; it
  validates the arguments (errors every rank sees raise at once, rank-local
  ones are agreed, :mod:`einshard.comm.arguments`) and returns the
  arguments of both transports, ``(x.detach(), group, ...)``;
- ``eager(x, group, *args)``: the transport in place on a process group
  (``torch.distributed``), counted in :mod:`einshard.comm.comm_stats`;
- ``traced(x, group, *args)``: the same result through functional
  collectives, for code ``torch.compile`` traces;
- ``adjoint``: the entry whose autograd form is this one's backward, and
  ``transpose(*args)``: its arguments (default: the same);
- ``forward``: the autograd form's forward, where it is not the raw form
  (an identity, a contiguous block);
- ``named`` and ``bind``: the name and argument binding of its form for
  ``shard_map`` bodies (:mod:`einshard.spmd.named`).

From these come the **raw** form (``entry.raw``: check, then the
eager or the traced transport, ``es.comm.collectives``), the **traced** form
(``traced``, ``einshard.comm._traced_collectives``), the **autograd** form
(``entry.autograd``, an autograd Function whose backward is the
adjoint's autograd form, so double backward works; ``es.comm.mappings``) and the
**named** form. :func:`register` adds an entry to ``PRIMITIVES``; the modules
of :mod:`einshard.comm.entries` are the entries, one collective each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ..core import _torch_compat
from ..core._torch_compat import in_traced_code
from .primitives import PRIMITIVES, Primitive

__all__ = ["Collective", "register", "collectives", "make_mapping", "mapping_forms"]


@dataclass(frozen=True)
class Collective(Primitive):
    """One collective, defined once (see the module docstring)."""

    check: Callable | None = None  # (raw args) -> the transports' arguments (x detached, group, ...)
    eager: Callable | None = None  # (x, group, *args) -> y, in place on the group
    traced: Callable | None = None  # (x, group, *args) -> y, functional collectives
    form: Callable | None = None  # the raw form, where it is not check-then-transport
    adjoint: str = ""  # the entry whose autograd form is the backward ("": none)
    transpose: Callable | None = None  # (*autograd args) -> the adjoint's autograd args
    forward: Callable | None = None  # the autograd form's forward (default: the raw form)
    named: str = ""  # the named form's public name ("": none)
    bind: Callable | None = None  # (x, axes, *args, **kw) -> (autograd callable, its arguments)
    raw: Callable[..., Any] = field(init=False, repr=False, compare=False)  # made in __post_init__
    autograd: Callable[..., Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        # the forms, made once (attributes, not cached properties: dynamo cannot enter their lock)
        object.__setattr__(self, "raw", self.form if self.form is not None else self._raw())
        object.__setattr__(self, "autograd", self._autograd() if self.adjoint else None)

    def _raw(self) -> Callable | None:
        """The raw form: ``check``, then the eager transport, or the traced one in traced code."""
        check, eager, traced, now_traced = self.check, self.eager, self.traced, in_traced_code
        if check is None:
            return None
        eager, traced = cast(Callable, eager), cast(Callable, traced)  # an entry with a check has both

        @functools.wraps(check)
        def raw(*args, **kwargs):
            args = check(*args, **kwargs)
            return traced(*args) if now_traced() else eager(*args)

        raw.__name__ = raw.__qualname__ = self.name
        return raw

    def _autograd(self) -> Callable:
        """The autograd form ``(x, group, *args)``: the forward, and the adjoint's autograd form backward."""
        adjoint, transpose = self.adjoint, self.transpose

        def backward(grad, *args):
            form = cast(Collective, PRIMITIVES[adjoint]).autograd
            return form(grad, *transpose(*args)) if transpose is not None else form(grad, *args)

        return make_mapping(_camel(self.name) + _camel(adjoint), self.forward or self.raw, backward)


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def register(entry: Collective) -> Collective:
    """Add ``entry`` to ``PRIMITIVES`` (its name must be new)."""
    if entry.name in PRIMITIVES:
        raise ValueError(f"a primitive named {entry.name!r} is already defined")
    PRIMITIVES[entry.name] = entry
    return entry


def collectives() -> dict[str, Collective]:
    """Every registered collective, by name."""
    return {name: p for name, p in PRIMITIVES.items() if isinstance(p, Collective)}


_C_APPLY = _torch_compat.function_base_apply
_transforms_active = _torch_compat.functorch_transforms_active
_traced = in_traced_code  # (hot paths: one global read)


def make_mapping(name: str, forward, adjoint):
    """An autograd Function: ``forward(x, *args)`` (raw collectives); backward ``adjoint(grad, *args)``.

    ``adjoint`` is itself a mapping, so double backward works. Returned as a
    fast ``apply`` (every argument positional): ``Function.apply`` binds
    default arguments with ``inspect.signature`` on every call when
    ``setup_context`` is defined (about 15 µs); outside ``torch.func``
    transforms and code that dynamo traces, which need that path, the C
    implementation is called directly (and in traced code that needs no
    gradient, the forward alone).
    """
    return mapping_forms(name, forward, adjoint)[0]


def mapping_forms(name: str, forward, adjoint):
    """:func:`make_mapping`'s ``apply``, and the C implementation it calls in eager code: ``(apply, eager)``.

    ``eager(x, *args)`` is for a caller that has checked, once for a whole operation, that dynamo does not
    trace it and no ``torch.func`` transform is active (an einshard plan's replay); ``apply`` checks on every
    call.
    """

    class Mapping(torch.autograd.Function):
        @staticmethod
        def forward(x, *args):
            return forward(x, *args)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.args = inputs[1:]

        @staticmethod
        def backward(ctx, grad):
            return (adjoint(grad, *ctx.args),) + (None,) * len(ctx.args)

    Mapping.__name__ = Mapping.__qualname__ = name
    raw, slow = _C_APPLY.__get__(None, Mapping), Mapping.apply

    def apply(*args):
        if _traced():  # Function.apply; without a gradient to track, the forward (dynamo would pass it a ctx)
            return slow(*args) if args[0].requires_grad and torch.is_grad_enabled() else forward(*args)
        return slow(*args) if _transforms_active() else raw(*args)

    return apply, raw
