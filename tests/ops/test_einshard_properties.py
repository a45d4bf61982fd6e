"""Property tests: random layouts and contractions on 8 ranks against whole-tensor einsum.

Hypothesis draws the cases in the pytest process (so shrinking works); each
example is a batch of cases run on the rank pool in one dispatch.
"""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dist_reference import MESHES, check_many, composition, render
from einshard.testing import MeshSpec, run_on_ranks

pytestmark = pytest.mark.matrix  # property searches: long; CI runs them with -m matrix

SETTINGS = settings(
    max_examples=int(os.environ.get("EINSHARD_PROPERTY_EXAMPLES", "4")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PER_EXAMPLE = 6
AXES = "abcdefg"


def _choice(draw, axes, names, allow_partial=True):
    options = [("R",)] + [("S", a) for a in axes] + ([("P",)] if allow_partial else [])
    return tuple(draw(st.sampled_from(options)) for _ in names)


def _shapes(draw, specs_choices, sizes, shape, names):
    """Random uneven split shapes for every (mesh dimension label, axis) that is sharded."""
    table = {}
    for choice in specs_choices:
        for a in set(c[1] for c in choice if c[0] == "S"):
            dims = [d for d, c in zip(names, choice) if c == ("S", a)]
            label = "-".join(dims)
            n = 1
            for d in dims:
                n *= shape[names.index(d)]
            if a not in table.setdefault(label, {}):
                table[label][a] = composition(lambda lo, hi: draw(st.integers(lo, hi)), sizes[a], n)
    return table


@st.composite
def unary_case(draw, mesh_key):
    shape, names = MESHES[mesh_key]
    n = draw(st.integers(1, 3))
    axes = list(AXES[:n])
    sizes = {a: draw(st.integers(1, 9)) for a in axes}
    src = _choice(draw, axes, names)
    out_axes = draw(st.permutations(axes))
    if n > 1 and draw(st.booleans()):
        out_axes = out_axes[:-1]  # sum over a dropped axis
    dst = _choice(draw, out_axes, names)
    formula = f"{render(axes, src, names)} -> {render(out_axes, dst, names)}"
    shapes = _shapes(draw, [src, dst], sizes, shape, names)
    return dict(formula=formula, global_shapes=[tuple(sizes[a] for a in axes)], shapes=shapes)


@st.composite
def contraction_case(draw, mesh_key, operands):
    shape, names = MESHES[mesh_key]
    pool = list(AXES[: draw(st.integers(2, 5))])
    sizes = {a: draw(st.integers(1, 7)) for a in pool}
    ops = []
    for _ in range(operands):
        k = draw(st.integers(1, min(3, len(pool))))
        ops.append(draw(st.permutations(pool))[:k])
    used = sorted({a for op in ops for a in op}, key=pool.index)
    out_axes = [a for a in draw(st.permutations(used)) if draw(st.booleans())]
    # at most one partial operand per mesh dimension keeps most cases cheap; any layout is valid
    choices = [_choice(draw, op, names) for op in ops]
    summed = bool(set(used) - set(out_axes)) or any(("P",) in c for c in choices)
    out_choice = _choice(draw, out_axes, names, allow_partial=summed)
    specs = [render(op, c, names) for op, c in zip(ops, choices)]
    formula = ", ".join(specs) + " -> " + render(out_axes, out_choice, names)
    shapes = _shapes(draw, choices + [out_choice], sizes, shape, names)
    return dict(
        formula=formula,
        global_shapes=[tuple(sizes[a] for a in op) for op in ops],
        shapes=shapes,
    )


def _run(mesh_key, cases):
    shape, names = MESHES[mesh_key]
    run_on_ranks(8, check_many, MeshSpec(shape, names), cases, timeout=240)


@pytest.mark.parametrize("mesh_key", list(MESHES))
@SETTINGS
@given(data=st.data())
def test_random_transitions(mesh_key, data):
    cases = [data.draw(unary_case(mesh_key)) for _ in range(PER_EXAMPLE)]
    _run(mesh_key, cases)


@pytest.mark.parametrize("mesh_key", list(MESHES))
@SETTINGS
@given(data=st.data())
def test_random_two_operand_contractions(mesh_key, data):
    cases = [data.draw(contraction_case(mesh_key, 2)) for _ in range(PER_EXAMPLE)]
    _run(mesh_key, cases)


@pytest.mark.parametrize("mesh_key", list(MESHES))
@SETTINGS
@given(data=st.data())
def test_random_three_operand_contractions(mesh_key, data):
    cases = [data.draw(contraction_case(mesh_key, 3)) for _ in range(PER_EXAMPLE // 2)]
    _run(mesh_key, cases)
