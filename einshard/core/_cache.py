"""``BoundedCache``: the one bounded dict behind the library's plan and parse caches."""

from __future__ import annotations

__all__ = ["BoundedCache"]


class BoundedCache(dict):
    """A dict that empties itself when full (plans are cheap to rebuild; a miss only costs a replan).

    Reads are plain ``dict.get`` (the eager fast path); :meth:`put` stores.

    >>> cache = BoundedCache(2)
    >>> [cache.put(k, k * k) for k in range(3)], sorted(cache)
    ([0, 1, 4], [2])
    """

    __slots__ = ("limit",)

    def __init__(self, limit: int = 4096):
        super().__init__()
        self.limit = limit

    def put(self, key, value):
        """Store ``value`` under ``key`` (emptying the cache first when it is full); returns ``value``."""
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value
