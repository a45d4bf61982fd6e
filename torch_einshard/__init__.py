"""``torch_einshard``: an alias of :mod:`einshard` (the distribution's own name).

``import torch_einshard as es`` gives the very module object ``import
einshard as es`` gives, and ``torch_einshard.X`` is ``einshard.X`` for every
submodule (``import torch_einshard.helpers``, ``from torch_einshard.mappings
import ...``): each module is executed once, as ``einshard.X``, and shared.
The module paths of torch-einshard 1.0 keep working: a module that has moved
into a folder since (``helpers`` is ``einshard.comm.helpers``) is found under
its old name too (``_MOVED``).

>>> import einshard, torch_einshard, torch_einshard.helpers
>>> torch_einshard is einshard, torch_einshard.helpers is einshard.comm.helpers
(True, True)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

import einshard as _einshard

_ALIAS = __name__  # "torch_einshard"
_TARGET = _einshard.__name__  # "einshard"

_MOVED = {  # module paths of torch-einshard 1.0 (and of einshard before its folders) -> where they live now
    "attention_kernels": "attention.kernels", "backwards": "comm.backwards", "checks": "comm.checks",
    "collectives": "comm.collectives", "comm_stats": "comm.comm_stats", "distributed": "runtime.distributed",
    "dtensor": "spmd.dtensor", "dtensor_mesh": "spmd.dtensor_mesh", "exchange": "comm.exchange",
    "execute": "runtime.execute", "explain": "ops.explain", "grad_sums": "comm.grad_sums",
    "helpers": "comm.helpers", "layout": "core.layout", "local": "plan.local", "mappings": "comm.mappings",
    "mesh": "comm.mesh", "named": "spmd.named", "pipeline": "runtime.pipeline", "policy": "core.policy",
    "primitives": "comm.primitives", "recompute": "runtime.recompute", "resolve": "plan.resolve",
    "shard_map": "spmd.shard_map", "stationary": "plan.stationary", "tree": "spmd.tree",
    "visualize": "ops.visualize", "vma": "runtime.vma",
}


def _real_name(alias_name: str) -> str:
    """``torch_einshard.X.Y`` -> ``einshard.X.Y``, ``X`` translated where its module moved (``_MOVED``)."""
    head, dot, tail = alias_name[len(_ALIAS) + 1 :].partition(".")
    return f"{_TARGET}.{_MOVED.get(head, head)}{dot}{tail}"


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``torch_einshard.X`` to the module object ``einshard.X``."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_ALIAS + "."):
            return None
        real_name = _real_name(fullname)
        try:
            real_spec = importlib.util.find_spec(real_name)
        except (ImportError, ValueError):
            return None
        if real_spec is None:
            return None
        return importlib.machinery.ModuleSpec(
            fullname,
            self,
            origin=real_spec.origin,
            loader_state={"name": real_name},
            is_package=real_spec.submodule_search_locations is not None,
        )

    def create_module(self, spec):
        module = importlib.import_module(spec.loader_state["name"])
        # the import system is about to stamp the alias spec onto the module
        spec.loader_state["spec"] = module.__spec__
        return module

    def exec_module(self, module):
        # already executed as einshard.X; only give it its own spec back
        module.__spec__ = module.__spec__.loader_state["spec"]


if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())

# The alias *is* the package: the same object, attributes and submodules.
sys.modules[_ALIAS] = _einshard

# Register the alias names of the submodules einshard has already imported. Importing a
# name that is not in sys.modules makes the import system set it as an attribute of the
# parent package, and the parent *is* einshard: `import torch_einshard.shard_map` would
# replace the function `es.shard_map` by its module. Pre-registered names are found in
# sys.modules, so nothing is rebound.
for _name, _module in list(sys.modules.items()):
    if _name.startswith(_TARGET + "."):
        sys.modules.setdefault(_ALIAS + _name[len(_TARGET) :], _module)
for _old, _new in _MOVED.items():
    if f"{_TARGET}.{_new}" in sys.modules:
        sys.modules.setdefault(f"{_ALIAS}.{_old}", sys.modules[f"{_TARGET}.{_new}"])
