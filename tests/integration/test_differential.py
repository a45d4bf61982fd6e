"""Every scenario of the differential harness (``tests/integration/differential.py``) in every mode it lists.

The default run (``python -m pytest``) runs every scenario eagerly (even and
uneven blocks) and the ``shard_map`` scenarios under ``aot_eager`` with even
blocks (``tests/integration/test_compile_fullgraph.py`` compiles the named
collectives, formulas and stencil ops there); compiles are slow on small
machines, so the other ``aot_eager`` and every ``inductor`` variant carry the
``matrix`` marker (``python -m pytest -m matrix``, which CI runs too).
"""

from __future__ import annotations

import pytest

from differential import SCENARIOS, check


def _cases():
    for sc in SCENARIOS.values():
        for variant in sc.sizes:
            for mode in sc.modes:
                marks = [pytest.mark.ranks(sc.ranks, timeout=900)]
                # compiled named collectives, formulas and stencil ops: test_compile_fullgraph in the default run
                if mode == "inductor" or (mode != "eager" and (variant != "even" or not sc.name.startswith("shard_map"))):
                    marks.append(pytest.mark.matrix)
                yield pytest.param(sc.name, variant, mode, marks=marks, id=f"{sc.name}-{variant}-{mode}")


@pytest.mark.parametrize("name, variant, mode", list(_cases()))
def test_scenario(name, variant, mode):
    check(name, variant, mode)
