"""The registry of caches (einshard.core._cache): every plan and parse cache of the package is registered,
listed with its size, and emptied by ``clear_caches``."""

import ast
import importlib
import inspect
import pkgutil

import pytest
import torch

import einshard
import einshard as es
from einshard.core._cache import BoundedCache, cached, caches, clear_caches, registered

# Module-level dicts that are state, not caches: emptying them would change what the library does.
STATE = {
    "einshard.core._cache._REGISTRY": "the registry itself",
    "einshard.comm.primitives.PRIMITIVES": "the table of step kinds, filled as their modules are imported",
    "einshard.core._trace._NAMES": "objects traced code looks up by name",
    "einshard.comm.checks._RANKS": "weak: a process group's ranks",
    "einshard.comm.comm_stats._LABELS": "weak: labels given by the user",
    "einshard.comm.comm_stats._STRONG_LABELS": "labels given by the user",
    "einshard.params.buckets._HOOKED": "the hooks installed on parameters",
    "einshard.params.summed._PENDING": "gradients summed in the running backward",
    "einshard.spmd.dtensor_mesh._TWINS": "weak: a DeviceMesh's twin (identity)",
    "einshard.testing._mesh._MESH_CACHE": "the test harness's process groups",
    "einshard.testing._pool._POOLS": "the test harness's rank pools",
}


def _modules():
    for info in pkgutil.walk_packages(einshard.__path__, "einshard."):
        yield importlib.import_module(info.name)
    yield einshard


def _lru(value) -> bool:
    return hasattr(value, "cache_info") and hasattr(value, "__wrapped__")


def _module_objects():
    """``(qualified name, object)`` of every module-level object and class attribute defined in einshard."""
    for mod in _modules():
        for name, value in vars(mod).items():
            yield f"{mod.__name__}.{name}", value
            if isinstance(value, type) and value.__module__ == mod.__name__:
                for attr, member in vars(value).items():
                    yield f"{mod.__name__}.{name}.{attr}", member


def test_every_cache_is_registered():
    known = {id(c) for c in registered().values()}
    missing = [name for name, value in _module_objects()
               if (isinstance(value, BoundedCache) or _lru(value)) and id(value) not in known]
    assert missing == []


def _empty_dicts():
    """``(qualified name, object)`` of the module-level dicts a module's source makes empty (``{}``,
    ``dict()``, a ``weakref`` dictionary): they fill at run time."""
    for mod in _modules():
        tree = ast.parse(inspect.getsource(mod))
        for node in tree.body:
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            value = getattr(node, "value", None)
            empty = (isinstance(value, ast.Dict) and not value.keys) or (
                isinstance(value, ast.Call) and not value.args
                and ast.unparse(value.func) in ("dict", "weakref.WeakKeyDictionary", "weakref.WeakValueDictionary"))
            if isinstance(target, ast.Name) and empty:
                yield f"{mod.__name__}.{target.id}", getattr(mod, target.id)


def test_no_module_keeps_a_dict_cache_outside_the_registry():
    """A module-level dict that starts empty fills at run time: a cache (registered) or listed state."""
    known = {id(c) for c in registered().values()}
    found = {name for name, value in _empty_dicts() if id(value) not in known}
    assert found == set(STATE)


def test_names_are_unique_and_say_where_the_cache_is():
    for name, cache in registered().items():
        assert name.startswith(("einshard.", __name__)), name
        with pytest.raises(ValueError, match="registered already"):
            BoundedCache(name=name)
    assert "einshard.ops.einshard.local_plans" in caches()
    assert "einshard.plan.transition.plan_transition" in caches()  # a cached function


def test_caches_lists_sizes_and_clear_caches_empties_them():
    x = torch.randn(3, 4)
    before = es.einshard("a b -> b a", x)
    assert caches()["einshard.ops.einshard.local_plans"] >= 1
    assert caches()["einshard.notation._expand_cached"] + caches()["einshard.notation._parse"] >= 1
    clear_caches()
    assert set(caches().values()) == {0}
    torch.testing.assert_close(es.einshard("a b -> b a", x), before)  # planned again
    assert caches()["einshard.ops.einshard.local_plans"] == 1


_CALLS = []


@cached(2)
def _double(n):
    _CALLS.append(n)
    return 2 * n


def test_cached_is_an_lru_cache_registered_by_name():
    _double.cache_clear()
    _CALLS.clear()
    assert [_double(1), _double(1), _double(2)] == [2, 2, 4] and _CALLS == [1, 2]
    assert registered()[f"{__name__}._double"] is _double
    assert caches()[f"{__name__}._double"] == 2
    clear_caches()
    assert _double(1) == 2 and _CALLS == [1, 2, 1]
