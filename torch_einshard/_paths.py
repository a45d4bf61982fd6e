"""torch-einshard 1.0's module paths that are einshard's modules: ``torch_einshard.params`` is ``einshard.params``.

A meta-path finder resolves ``torch_einshard.X[.Y]`` to the module object
``einshard.<MOVED[X]>[.Y]``: each module is executed once, as its einshard name, and
shared. The modules 1.0 had that einshard does not (``helpers``, ``mappings``,
``sharding``, ``symbolic``, ``einsum``, ``families``, ``mesh``, ``distributed``) are files of
this package instead.

>>> import einshard.params, torch_einshard.params
>>> torch_einshard.params is einshard.params
True
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

_ALIAS = "torch_einshard"
_TARGET = "einshard"

MOVED = {  # module paths of torch-einshard 1.0 (and of einshard before its folders) -> einshard's module
    "attention_kernels": "attention.kernels", "backwards": "comm.backwards", "checks": "comm.checks",
    "collectives": "comm.collectives", "comm_stats": "comm.comm_stats", "conv": "ops.conv",
    "dtensor": "spmd.dtensor", "dtensor_mesh": "spmd.dtensor_mesh", "exchange": "comm.exchange",
    "execute": "runtime.execute", "explain": "ops.explain", "fft": "ops.fft", "grad_sums": "comm.grad_sums",
    "halo": "ops.halo", "layout": "core.layout", "local": "plan.local", "named": "spmd.named",
    "params": "params", "pipeline": "runtime.pipeline", "policy": "core.policy", "primitives": "comm.primitives",
    "recompute": "runtime.recompute", "resolve": "plan.resolve", "roll": "ops.roll",
    "shard_map": "spmd.shard_map", "stationary": "plan.stationary", "tree": "spmd.tree",
    "visualize": "ops.visualize", "vma": "runtime.vma",
}


def real_name(alias_name: str) -> str | None:
    """``torch_einshard.X.Y`` -> ``einshard.MOVED[X].Y``; ``None`` when ``X`` is not a moved module."""
    head, dot, tail = alias_name[len(_ALIAS) + 1 :].partition(".")
    if head not in MOVED:
        return None
    return f"{_TARGET}.{MOVED[head]}{dot}{tail}"


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``torch_einshard.X`` (``X`` in :data:`MOVED`) to einshard's module object."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_ALIAS + "."):
            return None
        real = real_name(fullname)
        if real is None:
            return None
        try:
            real_spec = importlib.util.find_spec(real)
        except (ImportError, ValueError):
            return None
        if real_spec is None:
            return None
        return importlib.machinery.ModuleSpec(
            fullname,
            self,
            origin=real_spec.origin,
            loader_state={"name": real},
            is_package=real_spec.submodule_search_locations is not None,
        )

    def create_module(self, spec):
        module = importlib.import_module(spec.loader_state["name"])
        spec.loader_state["spec"] = module.__spec__  # the import system is about to stamp the alias spec on it
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state["spec"]  # executed as einshard.X already: its own spec back


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
