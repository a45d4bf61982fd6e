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
from einshard.comm import checks
from einshard.comm import collectives as C
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


def _dtype_second_operand(mesh, odd):
    """Mixed dtypes on one rank only: rank-local, so agreed (it used to raise there before the agreement)."""
    w = torch.ones(3, 2, dtype=torch.float64 if odd else torch.float32)
    es.einshard("a/tp b, b c -> a c", torch.ones(2, 3), w, mesh=mesh)


def _device_formula(mesh, odd):
    es.einshard("a/tp b -> a b", torch.ones(2, 3, device="meta" if odd else "cpu"), mesh=mesh)


def _device_psum(mesh, odd):
    f = es.shard_map(lambda x: es.spmd.psum(x.to("meta") if dist.get_rank() == ODD else x, "tp"), "a b", "a b",
                     mesh=mesh, check_vma=False)
    f(torch.ones(2, 3))


def _dtype_exchange(op):
    """einfft / einhalo / einroll with another dtype on one rank (their exchanges would abort gloo)."""

    def run(mesh, odd):
        x = torch.ones(4, 2, dtype=torch.float64 if odd else torch.float32)
        if op == "einfft":
            es.einfft("a b/tp -> a k/tp", x, {"b": "k"}, mesh=mesh)
        elif op == "einfft-ndim":  # a planning error on one rank only
            es.einfft("a b/tp -> a k/tp", torch.ones(4, 2, 1) if odd else torch.ones(4, 2), {"b": "k"}, mesh=mesh)
        elif op == "einhalo":
            es.einhalo("a/tp b", x, {"a": 1}, mesh=mesh)
        else:
            es.einroll("a/tp b", x, {"a": 1}, mesh=mesh)

    return run


def _structure(kind):
    """shard_map arguments whose pytree structure differs on one rank."""

    def run(mesh, odd):
        if kind == "args":
            f = es.shard_map(lambda *a: a[0], ("a/dp b",), "a/dp b", mesh=mesh)
            f(*((torch.ones(2, 3), torch.ones(1)) if odd else (torch.ones(2, 3),)))
        else:
            f = es.shard_map(lambda d: d["x"], ({"x": "a/dp b"},), "a/dp b", mesh=mesh)
            f({"y": torch.ones(2, 3)} if odd else {"x": torch.ones(2, 3)})

    return run


def _not_a_tensor(mesh, odd):
    x = [[1.0] * 3] * 2 if odd else torch.ones(2, 3)
    es.einshard("a/tp b -> a b", x, mesh=mesh)


def _malformed_shapes(mesh, odd):
    es.einshard("a/tp b -> a b", torch.ones(2, 3), mesh=mesh, shapes={"tp": [2.0, 2] if odd else [2, 2]})


def _shape_formula(mesh, odd):
    es.einshard("a/tp b, b c -> a c", torch.ones(3 if odd else 2, 4), torch.ones(4, 5), mesh=mesh)


def _shapes_disagree(mesh, odd):
    es.einshard("a/tp b -> a b", torch.ones(3 if odd else 2, 4), mesh=mesh, shapes={"tp": [2, 2]})


def _named(op):
    def body():
        n = 3 if dist.get_rank() == ODD else 2
        x = torch.ones(n * 2, 2)
        if op == "psum-dtype":
            return es.spmd.psum(torch.ones(4, 2, dtype=torch.float64 if dist.get_rank() == ODD else torch.float32), "tp")
        if op == "psum":
            return es.spmd.psum(x, "tp")
        if op == "pmean":
            return es.spmd.pmean(x, "tp")
        if op == "pmax":
            return es.spmd.pmax(x, "tp")
        if op == "pmin":
            return es.spmd.pmin(x, "tp")
        if op == "all_gather":
            return es.spmd.all_gather(x, "tp", axis=1)
        if op == "psum_scatter":
            return es.spmd.psum_scatter(x, "tp", axis=0)
        if op == "all_to_all":
            return es.spmd.all_to_all(x, "tp", 0, 1)
        if op == "ppermute":
            return es.spmd.ppermute(x, "tp", [(0, 1), (1, 0)])
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
            return es.spmd.psum(x, "tp")
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
        return es.spmd.psum(x, "tp")

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
    "dtype-second-operand": (_dtype_second_operand, ValueError, ["rank 1: ", "different dtypes (torch.float32, torch.float64)"]),
    "device-formula": (_device_formula, ValueError, ["devices: ranks 0, 2, 3 have (cpu,); rank 1 has (meta,)"]),
    "device-psum": (_device_psum, ValueError, ["device: rank 0 has cpu; rank 1 has meta"]),
    "einfft-dtype": (_dtype_exchange("einfft"), ValueError, ["dtype: ranks 0, 2, 3 have float32; rank 1 has float64"]),
    "einfft-ndim": (_dtype_exchange("einfft-ndim"), ValueError, ["rank 1: ", "names 2 dimensions but the tensor has 3"]),
    "einhalo-dtype": (_dtype_exchange("einhalo"), ValueError, ["dtype: ranks 0, 2, 3 have float32; rank 1 has float64"]),
    "einroll-dtype": (_dtype_exchange("einroll"), ValueError, ["dtype: ranks 0, 2, 3 have float32; rank 1 has float64"]),
    "structure-args": (_structure("args"), ValueError, ["rank 1: in_specs is not a pytree prefix of args"]),
    "structure-keys": (_structure("keys"), ValueError, ["rank 1: ", "keys only in args: ['y']"]),
    "not-a-tensor": (_not_a_tensor, ValueError, ["rank 1: ", "operand 0 must be a torch.Tensor, got list"]),
    "malformed-shapes": (_malformed_shapes, ValueError, ["rank 1: ", "got [2.0, 2]"]),
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
    again = es.shard_map(lambda x: es.spmd.psum(x, "tp"), "a/dp b", "a/dp b", mesh=mesh)(torch.ones(1, 2))
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


# -- a collective in a body over a group that reaches outside the body's mesh -----------------------


def _outside_the_body(mesh):
    """Bodies over mesh["dp"] that communicate over "tp" (mesh= given explicitly)."""
    rank = dist.get_rank()
    x = torch.full((1, 2), float(rank))
    # fine everywhere: values, and a point-to-point exchange whose peer is outside the body's group
    swapped = es.shard_map(lambda x: es.spmd.ppermute(x, "tp", [(0, 1), (1, 0)], mesh=mesh), "a b", "a b",
                           mesh=mesh["dp"], check_vma=False)(x)
    summed = es.shard_map(lambda x: es.spmd.psum(x, "tp", mesh=mesh), "a b", "a b", mesh=mesh["dp"], check_vma=False)(x)
    # a shape that differs on one rank: its tp group agrees on the error, the rest of each body hears of it
    start = time.monotonic()
    try:
        y = torch.ones(3 if rank == ODD else 2, 2)
        es.shard_map(lambda x: es.spmd.psum(x, "tp", mesh=mesh), "a b", "a b", mesh=mesh["dp"], check_vma=False)(y)
    except Exception as exc:  # noqa: BLE001
        raised = (type(exc).__name__, str(exc), getattr(exc, "rank", None))
    else:
        raised = None
    seconds = time.monotonic() - start
    total = torch.ones(1)
    dist.all_reduce(total)
    return swapped.tolist(), summed.tolist(), raised, seconds, total.item(), es.current_mesh()


def test_collective_reaching_outside_the_body_mesh(monkeypatch):
    monkeypatch.setenv("EINSHARD_TESTING_GLOO_TIMEOUT", "30")
    results = testing.spawn(_outside_the_body, WORLD, args=(MESH,), timeout=120)
    message = "the ranks disagree on all_reduce: shape: rank 0 has (2, 2); rank 1 has (3, 2)"
    for rank, (swapped, summed, raised, seconds, total, ambient) in enumerate(results):
        peer = rank ^ 1  # the other rank of this rank's tp group
        assert swapped == [[float(peer)] * 2] and summed == [[float(rank + peer)] * 2], rank
        assert raised is not None and seconds < LIMIT_S and total == WORLD and ambient is None, (rank, raised)
        if rank in (0, 1):  # ODD's tp group
            assert raised == ("EinshardError", message, None), (rank, raised)
        else:  # told by its dp peer, which raised in the body
            assert raised[0] == "RankFailedError" and raised[2] == rank - 2 and message in raised[1], (rank, raised)
