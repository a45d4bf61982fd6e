"""The library's plan and parse caches, registered in one place: :class:`BoundedCache`, :func:`cached`,
:func:`caches`, :func:`clear_caches`.

Every module-level cache of the package is a named :class:`BoundedCache` or a function decorated with
:func:`cached` (a ``functools.lru_cache`` with a name); both are registered here as they are made, so
:func:`caches` lists them all with their sizes and :func:`clear_caches` empties them (plans are rebuilt on the
next call). Per-object caches (a ``shard_map``'s plans, a mesh's formula rules) are unnamed and go with their
object. ``tests/core/test_cache.py`` checks that no module keeps a cache outside the registry.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["BoundedCache", "cached", "caches", "clear_caches", "registered"]

_REGISTRY: dict[str, Any] = {}  # name -> a BoundedCache or an lru_cache wrapper


def _register(name: str, cache):
    if name in _REGISTRY:
        raise ValueError(f"a cache named {name!r} is registered already")
    _REGISTRY[name] = cache
    return cache


class BoundedCache(dict):
    """A dict that empties itself when full (plans are cheap to rebuild; a miss only costs a replan).

    Reads are plain ``dict.get`` (the eager fast path); :meth:`put` stores. A ``name`` registers the cache
    (module-level caches have one; see the module docstring).

    >>> cache = BoundedCache(2)
    >>> [cache.put(k, k * k) for k in range(3)], sorted(cache)
    ([0, 1, 4], [2])
    """

    __slots__ = ("limit",)

    def __init__(self, limit: int = 4096, name: str | None = None):
        super().__init__()
        self.limit = limit
        if name is not None:
            _register(name, self)

    def put(self, key, value):
        """Store ``value`` under ``key`` (emptying the cache first when it is full); returns ``value``."""
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value


def cached(maxsize: int):
    """``functools.lru_cache(maxsize)``, registered under the function's module and qualified name.

    >>> @cached(16)
    ... def square(n):
    ...     return n * n
    >>> square(3), caches()[f"{__name__}.square"]
    (9, 1)
    """

    def wrap(fn):
        return _register(f"{fn.__module__}.{fn.__qualname__}", functools.lru_cache(maxsize=maxsize)(fn))

    return wrap


def caches() -> dict[str, int]:
    """``{name: number of entries}`` of every registered cache.

    >>> import einshard.ops.einshard
    >>> "einshard.ops.einshard.local_plans" in caches()
    True
    """
    return {name: len(c) if isinstance(c, dict) else c.cache_info().currsize for name, c in _REGISTRY.items()}


def clear_caches() -> None:
    """Empty every registered cache (each plan is built again on its next call)."""
    for c in _REGISTRY.values():
        if isinstance(c, dict):
            c.clear()
        else:
            c.cache_clear()


def registered() -> dict[str, Any]:
    """``{name: cache}`` of every registered cache (for the tests that check the registry)."""
    return dict(_REGISTRY)
