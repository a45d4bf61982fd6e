"""A faster ``Function.apply`` for the library's own autograd Functions.

``torch.autograd.Function.apply`` binds default arguments with
``inspect.signature`` on every call when ``setup_context`` is defined (about
15 µs). The library always passes every argument, so outside ``torch.func``
transforms it can call the C implementation directly; inside them it falls
back to the regular path, which ``torch.func`` needs.
"""

from __future__ import annotations

import torch

__all__ = ["fast_apply"]

_C_APPLY = torch._C._FunctionBase.__dict__["apply"]
_transforms_active = torch._C._are_functorch_transforms_active


def fast_apply(cls):
    """``cls.apply`` without the per-call signature binding (all arguments positional)."""
    raw = _C_APPLY.__get__(None, cls)
    slow = cls.apply

    def apply(*args):
        if _transforms_active():
            return slow(*args)
        return raw(*args)

    apply.__doc__ = f"Fast ``{cls.__name__}.apply`` (every argument must be passed positionally)."
    return apply
