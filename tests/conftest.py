"""Shared pytest configuration for the einshard test suite.

The tests mirror the package: ``tests/<folder>/test_<module>.py`` for a module of ``einshard/<folder>/``,
and ``tests/integration/`` for the suites that cross folders (docs/testing.md, "Where tests live"). Every
test folder, and ``tests/`` itself (the shared helpers ``dist_reference``, ``probes``), is put on
``sys.path`` here, so a test module imports a helper or another test module by its plain name
(``from test_halo import ref_pad``), as the rank processes do (they get this ``sys.path``).
"""

import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent
for _folder in [TESTS, *sorted(p for p in TESTS.iterdir() if p.is_dir() and p.name.isidentifier() and not p.name.startswith("_"))]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

# Multi-rank tests: @pytest.mark.ranks(n) and the mesh fixtures (docs/testing.md).
pytest_plugins = ("einshard.testing.pytest_plugin",)


def _cuda_devices_needed(item) -> int:
    """0 for an unmarked test; else the CUDA devices ``@pytest.mark.cuda(devices=n)`` asks for (default 1)."""
    mark = item.get_closest_marker("cuda")
    if mark is None:
        return 0
    return int(mark.kwargs.get("devices", mark.args[0] if mark.args else 1))


def pytest_collection_modifyitems(config, items):
    """Deselect (not skip) the ``cuda`` tests this machine has too few CUDA devices for, so a CPU run
    reports no skips (docs/testing.md)."""
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    keep, drop = [], []
    for item in items:
        (drop if _cuda_devices_needed(item) > available else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
