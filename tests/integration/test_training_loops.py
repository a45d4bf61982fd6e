"""Training loops as random event sequences: every mechanism against the whole model, after every event.

Hypothesis draws a mechanism, a mesh (ascending or permuted rank order), even or uneven sizes, an
optimizer and a sequence of events in the pytest process; each example runs the whole sequence once
on 4 gloo ranks (``training_loops.run_sequence``), so a failing sequence shrinks to the shortest one
that still diverges. The default run draws a bounded number of sequences over the eager mechanisms;
the long run (``-m matrix``) draws sequences for every mechanism and mesh and runs fixed compiled loops.
``EINSHARD_LOOPS_EXAMPLES`` sets the number of sequences per long-run test. The end of the file keeps
what the harness found beyond issue 29's table, shrunk, as regression tests.
"""

from __future__ import annotations

import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from einshard.testing import run_on_ranks
from training_loops import EVENTS, MECHANISMS, MESHES, PARAMS, SIZES, known_failing, run_sequence

EAGER = tuple(k for k, m in MECHANISMS.items() if not m.compiled)
COMPILED = tuple(k for k, m in MECHANISMS.items() if m.compiled)
SEEDS = st.integers(0, 3)
ARGS = {
    "forward": SEEDS,
    "backward": st.just(False),
    "retain": st.none(),
    "grad": st.tuples(st.sets(st.sampled_from(PARAMS), min_size=1).map(lambda s: tuple(sorted(s))), st.booleans()),
    "no_sync": SEEDS,
    "raise": SEEDS,
    "aux": st.booleans(),
    "inplace": SEEDS,
    "reload": SEEDS,
    "partial": SEEDS,
    "functional": SEEDS,
    "dcp": st.none(),
    "step": st.none(),
    "zero_grad": st.booleans(),
}
assert set(ARGS) == set(EVENTS)


def _settings(examples: int):
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def cases(draw, mechanisms, meshes=tuple(MESHES), max_events=10):
    """(mechanism, mesh, size, optimizer, events), without what :data:`KNOWN_FAILING` excludes."""
    pairs = [(m, s) for m in mechanisms for s in meshes if not known_failing(m, s)]
    mech, mesh = draw(st.sampled_from(pairs))
    allowed = [e for e in EVENTS if not known_failing(mech, mesh, e)]
    event = st.one_of([st.tuples(st.just(e), ARGS[e]) for e in allowed])
    events = draw(st.lists(event, min_size=1, max_size=max_events))
    return mech, mesh, draw(st.sampled_from(sorted(SIZES))), draw(st.sampled_from(["sgd", "adam"])), events


def check(case, step_around=True, checks=True) -> None:
    """One sequence on 4 ranks (a short timeout: a hanging example costs seconds while shrinking; compiling
    costs minutes on a busy machine); ``checks=False``: the steady-state paths that cross-rank checks bypass
    (formula replays, kept plans) are the ones exercised."""
    with tempfile.TemporaryDirectory() as ckpt:
        timeout = 600 if MECHANISMS[case[0]].compiled else 120
        run_on_ranks(4, run_sequence, *case, ckpt, step_around, timeout=timeout, checks=checks)


@_settings(int(os.environ.get("EINSHARD_LOOPS_DEFAULT_EXAMPLES", "40")))
@given(case=cases(EAGER), checks=st.booleans())
def test_eager_training_loops_match_one_process(case, checks):
    check(case, checks=checks)


# compiled (long run only: one compiled loop costs about a minute on 2 busy cores): a short loop, and one
# with every event
SHORT = [("forward", 1), ("backward", False), ("step", None), ("forward", 2), ("backward", False)]
EVERY_EVENT = [("forward", 1), ("backward", False), ("step", None), ("zero_grad", True),
               ("grad", (("down.w", "up.w"), False)), ("no_sync", 2), ("backward", False), ("retain", None),
               ("aux", True), ("partial", 3), ("functional", 0), ("inplace", 1), ("reload", 2), ("dcp", None),
               ("raise", 3), ("backward", False), ("step", None), ("zero_grad", False), ("forward", 2),
               ("backward", False)]
COMPILED_PAIRS = [m for m in COMPILED if not known_failing(m, "2x2")]


def _compiled_loop(mechanism, events):
    check((mechanism, "2x2", "uneven", "adam", [e for e in events if not known_failing(mechanism, "2x2", e[0])]))


@pytest.mark.matrix
@pytest.mark.parametrize("mechanism", COMPILED_PAIRS)
def test_compiled_training_loop_matches_one_process(mechanism):
    _compiled_loop(mechanism, SHORT)


@pytest.mark.matrix
@pytest.mark.parametrize("mechanism", COMPILED_PAIRS)
def test_compiled_training_loop_with_every_event(mechanism):
    _compiled_loop(mechanism, EVERY_EVENT)


# -- the long run ---------------------------------------------------------------------------------------------

LONG = int(os.environ.get("EINSHARD_LOOPS_EXAMPLES", "30"))


PAIRS = [(m, s) for m in MECHANISMS for s in MESHES if not known_failing(m, s)]


@pytest.mark.matrix
@pytest.mark.parametrize("mechanism, mesh", PAIRS, ids=[f"{m}-{s}" for m, s in PAIRS])
def test_training_loops_long(mechanism, mesh):
    @_settings(LONG if not MECHANISMS[mechanism].compiled else max(LONG // 6, 4))
    @given(case=cases((mechanism,), (mesh,), max_events=14))
    def run(case):
        check(case)

    run()


# -- what the harness found beyond issue 29's table: shrunk sequences, as regression tests --------------------
# Each was an xfail (strict) until fixed; the fix removed the mark and its KNOWN_FAILING entry.


def test_stored_parameters_in_a_check_vma_body_under_no_grad():
    """F1 (fixed): a check_vma=True body with stored parameters under torch.no_grad() computes the values."""
    check(("zero-shard_map", "2x2", "even", "sgd", [("partial", 0)]))


@pytest.mark.parametrize("mechanism", ["hooks-sync", "hooks-async", "shard_map-novma", "zero-hooks-units"])
def test_a_formula_on_a_parameter_that_does_not_vary_over_dp_counts_its_gradient_once(mechanism):
    """F2 (fixed): a local formula on a replicated parameter with a dp duty ('c, c ->', the aux term) gives it
    its gradient once, kept on dp rank 0, not once per dp rank."""
    check((mechanism, "4", "even", "sgd", [("aux", True), ("backward", False)]))


@pytest.mark.parametrize("mechanism", ["hooks-sync", "zero-hooks"])
def test_zero_grad_drops_a_held_no_sync_micro_batch(mechanism):
    """F3 (fixed with issue 29's no_sync fixes): zero_grad() after a no_sync micro-batch drops it."""
    check((mechanism, "2x2", "even", "sgd", [("no_sync", 0), ("zero_grad", True), ("backward", False)]), False)


def test_a_compiled_body_that_hooks_an_intermediate():
    """F4 (fixed): a tensor hook that raises inside a compiled shard_map body raises from backward, as in one
    process, and the next step is exact."""
    check(("compiled", "2x2", "even", "sgd", [("raise", 0)]))


def test_functional_call_keeps_the_guard_on_a_parents_read():
    """F5 (fixed): the storage blocks passed to functional_call with the ZeRO hooks installed are guarded for
    the call as the stored parameters are: a parent's read of its child's scale vector refuses on every rank
    instead of using this rank's slice."""
    check(("zero-hooks-parent", "2x2", "even", "sgd", [("functional", 0)]))
