"""Fault injection: a failure that only some ranks see must surface on every rank (checks on).

Each case runs in FRESH rank processes (``einshard.testing.spawn``), so a case that aborts or
hangs a process costs that case only. In every case, every rank must raise within 10 s (of the
start, and of the first rank that raised), and a following all-reduce on the same group must
succeed; the ambient mesh must be gone and the next ``shard_map`` call must work. Gloo's own timeout is short (a guard, so a
hang fails fast); no case waits for it.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import einshard as es
from einshard import checks
from einshard import collectives as C
from einshard import testing
from einshard.testing import MeshSpec

MESH = MeshSpec((2, 2), ("dp", "tp"))
ODD = 1  # the rank that gets things wrong
WORLD = 4
LIMIT_S = 10.0

# -- the faults (run on every rank; ``odd`` is True on the faulty rank) -----------------------------


def _dtype_formula(mesh, odd):
    x = torch.ones(2, 3, dtype=torch.float64 if odd else torch.float32)
    es.einshard("a/tp b -> a b", x, mesh=mesh)


def _shape_formula(mesh, odd):
    es.einshard("a/tp b, b c -> a c", torch.ones(3 if odd else 2, 4), torch.ones(4, 5), mesh=mesh)


def _shapes_disagree(mesh, odd):
    es.einshard("a/tp b -> a b", torch.ones(3 if odd else 2, 4), mesh=mesh, shapes={"tp": [2, 2]})


def _named(op):
    def body():
        n = 3 if dist.get_rank() == ODD else 2
        x = torch.ones(n * 2, 2)
        if op == "psum-dtype":
            return es.psum(torch.ones(4, 2, dtype=torch.float64 if dist.get_rank() == ODD else torch.float32), "tp")
        if op == "psum":
            return es.psum(x, "tp")
        if op == "pmean":
            return es.pmean(x, "tp")
        if op == "pmax":
            return es.pmax(x, "tp")
        if op == "pmin":
            return es.pmin(x, "tp")
        if op == "all_gather":
            return es.all_gather(x, "tp", axis=1)
        if op == "psum_scatter":
            return es.psum_scatter(x, "tp", axis=0)
        if op == "all_to_all":
            return es.all_to_all(x, "tp", 0, 1)
        if op == "ppermute":
            return es.ppermute(x, "tp", [(0, 1), (1, 0)])
        raise AssertionError(op)

    return body


def _named_in_body(op):
    def run(mesh, odd):
        f = es.shard_map(_named(op), (), None, mesh=mesh, check_vma=False)
        f()

    return run


def _helper(op):
    def run(mesh, odd):
        x = torch.ones(3 if odd else 2, 4)
        if op == "all_reduce":
            C.all_reduce(x, None)
        elif op == "broadcast":
            C.broadcast(x, None, src=0)
        elif op == "all_gather":
            C.all_gather(x, None, 1)
        elif op == "reduce_scatter":
            C.reduce_scatter(torch.ones(4 if odd else 8), None, 0)
        elif op == "all_to_all":
            C.all_to_all(x, None, 1, 0)
        elif op == "ppermute":
            C.ppermute(x, None, [(0, 1), (1, 2), (2, 3), (3, 0)])
        else:
            raise AssertionError(op)

    return run


def _body_raises(where, who):
    """A shard_map body that raises on ``who`` ("one" or "all"); the others go on to ``where``."""

    def body(x):
        if who == "all" or dist.get_rank() == ODD:
            raise RuntimeError(f"boom on rank {dist.get_rank()}")
        if where == "psum":
            return es.psum(x, "tp")
        if where == "einshard":
            return es.einshard("a/dp b -> a b", x)
        return x  # straight to shard_map's exit

    def run(mesh, odd):
        f = es.shard_map(body, "a/dp b", "a b" if where == "einshard" else "a/dp b", mesh=mesh)
        f(torch.ones(2, 3))

    return run


def _interrupted(mesh, odd):
    def body(x):
        if dist.get_rank() == ODD:
            raise KeyboardInterrupt
        return es.psum(x, "tp")

    es.shard_map(body, "a/dp b", "a/dp b", mesh=mesh)(torch.ones(2, 3))


def _bad_backend(gm, example_inputs):
    raise RuntimeError("this backend cannot compile")


def _compile_failure(backend):
    """torch.compile fails (on every rank: compiling is deterministic) while tracing the call."""

    def run(mesh, odd):
        def body(x):
            return es.einshard("a/dp b -> a b", x).sin()

        f = es.shard_map(body, "a/dp b", "a b", mesh=mesh)
        try:
            torch.compile(f, backend=backend)(torch.ones(2, 3))
        finally:
            torch._dynamo.reset()

    return run


CASES = {
    "dtype-formula": (_dtype_formula, ValueError, ["rank 1 has (float64,)", "'a/tp b -> a b'"]),
    "shape-formula": (_shape_formula, ValueError, ["rank 1 has global sizes a=6", "'a/tp b, b c -> a c'"]),
    "shapes-disagree": (_shapes_disagree, ValueError, ["rank 1: ", "split shapes over 'tp' are [2, 2]"]),
    **{
        f"named-{op}": (_named_in_body(op), ValueError, ["shape: rank 0 has (4, 2); rank 1 has (6, 2)"])
        for op in ("psum", "pmean", "pmax", "pmin", "psum_scatter", "all_to_all")
    },
    "named-psum-dtype": (_named_in_body("psum-dtype"), ValueError, ["dtype: rank 0 has float32; rank 1 has float64"]),
    "named-all_gather": (_named_in_body("all_gather"), ValueError, ["shape: rank 0 has (4, *); rank 1 has (6, *)"]),
    "named-ppermute": (_named_in_body("ppermute"), ValueError, ["rank 0 sends 8 elements to rank 1, which expects 12"]),
    **{
        f"helper-{op}": (_helper(op), ValueError, [f"on {op}: shape: ranks 0, 2, 3 have (2, 4); rank 1 has (3, 4)"])
        for op in ("all_reduce", "broadcast", "all_gather", "all_to_all")
    },
    "helper-reduce_scatter": (_helper("reduce_scatter"), ValueError, ["ranks 0, 2, 3 have (8,); rank 1 has (4,)"]),
    "helper-ppermute": (_helper("ppermute"), ValueError, ["rank 0 sends 8 elements to rank 1, which expects 12"]),
    "body-one-psum": (_body_raises("psum", "one"), "failed", ["boom on rank 1"]),
    "body-one-einshard": (_body_raises("einshard", "one"), "failed", ["boom on rank 1"]),
    "body-one-exit": (_body_raises("exit", "one"), "failed", ["boom on rank 1"]),
    "body-all": (_body_raises("psum", "all"), RuntimeError, ["boom on rank {rank}"]),
    "keyboard-interrupt": (_interrupted, "interrupted", ["rank 1 raised in a shard_map body: KeyboardInterrupt"]),
    "compile-failure": (_compile_failure(_bad_backend), Exception, ["this backend cannot compile"]),
}


def run_case(mesh, name):
    """On every rank: inject the fault, time the error, then check the process is still usable."""
    fault = CASES[name][0]
    rank = dist.get_rank()
    start = time.monotonic()
    wall = None
    try:
        fault(mesh, rank == ODD)
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt included
        wall = time.time()  # one machine: comparable across the ranks
        raised = (type(exc).__name__, str(exc))
        caught = exc
    else:
        raised, caught = None, None
    seconds = time.monotonic() - start
    # the process group is still usable, on the world and on the mesh's groups
    total = torch.ones(1)
    dist.all_reduce(total)
    tp = torch.ones(1)
    dist.all_reduce(tp, group=mesh.get_group("tp"))
    # nothing the library pushed is left behind: the next shard_map call works
    ambient = es.current_mesh()
    again = es.shard_map(lambda x: es.psum(x, "tp"), "a/dp b", "a/dp b", mesh=mesh)(torch.ones(1, 2))
    return {
        "raised": raised,
        "is_value_error": isinstance(caught, ValueError),
        "is_failed": isinstance(caught, checks.RankFailedError),
        "failed_rank": getattr(caught, "rank", None),
        "seconds": seconds,
        "wall": wall,
        "after": (total.item(), tp.item()),
        "ambient": ambient,
        "again": again.tolist(),
    }


@pytest.mark.parametrize("name", sorted(CASES))
def test_fault_surfaces_on_every_rank(name, monkeypatch):
    monkeypatch.setenv("EINSHARD_TESTING_GLOO_TIMEOUT", "30")  # a guard: every case ends well before
    _, expected, fragments = CASES[name]
    results = testing.spawn(run_case, WORLD, args=(MESH, name), timeout=120)
    walls = [res["wall"] for res in results if res["wall"] is not None]
    assert len(walls) == WORLD and max(walls) - min(walls) < LIMIT_S, (name, walls)
    messages = set()
    for rank, res in enumerate(results):
        assert res["raised"] is not None, f"rank {rank} did not raise in {name}"
        kind, message = res["raised"]
        if not name.startswith("compile"):  # compiling alone may take longer: the spread is checked below
            assert res["seconds"] < LIMIT_S, f"rank {rank} took {res['seconds']:.1f} s to raise in {name}"
        assert res["after"] == (WORLD, 2), res
        assert res["ambient"] is None, f"rank {rank}: the ambient mesh survived {name}"
        assert res["again"] == [[2.0, 2.0]], res
        if expected is ValueError:
            assert res["is_value_error"], (rank, kind, message)
            messages.add(message)
        elif expected in ("failed", "interrupted"):
            if rank == ODD:
                assert kind == ("RuntimeError" if expected == "failed" else "KeyboardInterrupt"), (kind, message)
                continue
            assert res["is_failed"] and res["failed_rank"] == ODD, (rank, kind, message)
        else:
            assert kind != "RankFailedError", (rank, kind, message)
        for fragment in fragments:
            assert fragment.format(rank=rank) in message, (rank, fragment, message)
    if expected is ValueError:
        assert len(messages) == 1, messages  # the same error on every rank
