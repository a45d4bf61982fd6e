"""The torch version shims: every behaviour einshard relies on that differs between torch releases.

einshard supports torch 2.11 through 2.15. Where releases differ in something
einshard needs, the difference is settled here, once, and every other module
uses the shim; ``tests/test_torch_compat.py`` checks each shim against the
installed torch, so a release that changes what a shim assumes fails there.

- :func:`is_compiling`: true while ``torch.compile`` traces, both in the code
  dynamo traces and in the plain Python it runs while tracing (the planners
  marked ``assume_constant_result``). ``torch.compiler.is_compiling`` is true
  in the latter only from torch 2.13 on, so trace-time Python enters
  :func:`trace_time`.
"""

from __future__ import annotations

import torch

__all__ = ["TORCH_VERSION", "is_compiling", "trace_time"]

#: the installed torch release as ``(major, minor)``
TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

_torch_is_compiling = torch.compiler.is_compiling
_TRACE_TIME = [0]  # how many trace-time Python calls are running


def is_compiling() -> bool:
    """``torch.compiler.is_compiling()``, also true in trace-time Python on every release (see the module docstring)."""
    return _torch_is_compiling() or _TRACE_TIME[0] > 0


class trace_time:
    """Mark Python that dynamo runs while it traces (a planner), so that :func:`is_compiling` is true there."""

    __slots__ = ()

    def __enter__(self):
        _TRACE_TIME[0] += 1

    def __exit__(self, *exc):
        _TRACE_TIME[0] -= 1
        return False


#: torch 2.11's dynamo, tracing an autograd Function whose forward returns a functional collective's
#: result, adds an aliased output for it and, under a backend without AOTAutograd, the input's gradient is
#: then zero (2.12.1, 2.13 and 2.15 are right)
_ALIASED_FUNCTION_OUTPUT_BUG = TORCH_VERSION < (2, 12)


def traced_function_result(y: torch.Tensor) -> torch.Tensor:
    """What the forward of an autograd Function run under ``torch.compile`` returns for ``y``, the result of
    functional collectives: ``y``, or a copy of it on the releases with the aliased-output bug (above)."""
    return y.clone() if _ALIASED_FUNCTION_OUTPUT_BUG else y
