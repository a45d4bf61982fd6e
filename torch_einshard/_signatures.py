"""1.0's parameter names on einshard's functions: ``legacy_names(es_fn, p="param")``.

einshard names some parameters differently from torch-einshard 1.0 (``p`` for ``param``,
``formula`` for ``shard``). The wrapper has 1.0's names in its signature and accepts them
as keywords; it calls einshard's function with einshard's.

>>> def f(p, *, mesh=None): return p, mesh
>>> g = legacy_names(f, p="param")
>>> g(param=1, mesh=2), str(inspect.signature(g))
((1, 2), '(param, *, mesh=None)')
"""

from __future__ import annotations

import functools
import inspect

__all__ = ["legacy_names"]


def legacy_names(fn, **renames):
    """``fn`` under 1.0's parameter names: ``renames`` maps einshard's name to 1.0's."""
    signature = inspect.signature(fn)
    unknown = set(renames) - set(signature.parameters)
    if unknown:
        raise TypeError(f"legacy_names: {fn.__qualname__} has no parameter(s) {sorted(unknown)}")
    to_einshard = {legacy: name for name, legacy in renames.items()}

    @functools.wraps(fn)
    def call(*args, **kwargs):
        for legacy, name in to_einshard.items():
            if legacy in kwargs:
                kwargs[name] = kwargs.pop(legacy)
        return fn(*args, **kwargs)

    call.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[p.replace(name=renames.get(p.name, p.name)) for p in signature.parameters.values()]
    )
    return call
