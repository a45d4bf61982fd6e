"""The collective entries: one module per collective, each defining (and registering) its
:class:`einshard.comm.collective.Collective`.

Every module of this package is imported here, so adding a collective means adding its module (and its
test and doc): the raw, traced, autograd and named forms, the planner's step kind and the variance rule
come from the entry.
"""

from __future__ import annotations

import importlib
import pkgutil

from ..collective import Collective, collectives

__all__ = ["COLLECTIVES", "Collective"]

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

COLLECTIVES: dict[str, Collective] = collectives()  # every entry, by name
