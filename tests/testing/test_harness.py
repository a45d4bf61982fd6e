"""Tests of the multi-rank harness itself (einshard.testing and its pytest plugin)."""

import importlib.util
import os
import pickle
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch
import torch.distributed as dist

from einshard import testing
from einshard.testing import MeshSpec, RankError, RankPool, RankTimeout, make_mesh, run_on_ranks

pytest_plugins = ("pytester",)


# -- rank functions (module level: they travel by pickle, by reference) ---------------
def rank_sum():
    t = torch.tensor([dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(t)
    return t.item()


def rank_and_args(x, *, y):
    return dist.get_rank(), dist.get_world_size(), x, y


def pid():
    return os.getpid()


def fail_on(rank, message="boom"):
    print(f"hello from rank {dist.get_rank()}")
    if dist.get_rank() == rank:
        raise ValueError(f"{message} on rank {rank}")
    return dist.get_rank()


def fail_everywhere():
    raise KeyError(f"bad argument (rank {dist.get_rank() * 0})")


def fail_then_others_wait(rank):
    if dist.get_rank() == rank:
        raise RuntimeError(f"rank {rank} gives up before the collective")
    dist.barrier()  # never completes: rank `rank` is missing


def hang_on(rank):
    if dist.get_rank() == rank:
        wait_forever_marker()
    return dist.get_rank()


def wait_forever_marker():
    time.sleep(10_000)


def describe_mesh(mesh):
    return tuple(mesh.mesh.shape), mesh.mesh_dim_names, tuple(mesh.get_coordinate())


def die_on(rank):
    if dist.get_rank() == rank:
        os._exit(7)
    return dist.get_rank()


def destroy_group():
    dist.destroy_process_group()
    return "destroyed"


def print_something():
    print(f"output of rank {dist.get_rank()}")
    return None


def _coordinate(rank, shape):
    coord = []
    for size in reversed(shape):
        coord.append(rank % size)
        rank //= size
    return tuple(reversed(coord))


# -- marked tests: the plugin runs them on n ranks -----------------------------------
@pytest.mark.parametrize(
    "n", [pytest.param(n, marks=pytest.mark.ranks(n), id=f"ranks{n}") for n in (2, 4, 8)]
)
def test_marked_collective(n):
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    assert dist.get_world_size() == n
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    assert t.item() == n * (n - 1) / 2
    assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"


@pytest.mark.ranks(8)
def test_mesh_fixture(mesh):
    from torch.distributed.device_mesh import DeviceMesh

    assert isinstance(mesh, DeviceMesh)
    shape = tuple(mesh.mesh.shape)
    assert shape in {(8,), (2, 4), (2, 2, 2)}
    assert mesh.mesh_dim_names == {1: ("tp",), 2: ("dp", "tp"), 3: ("dp", "sp", "tp")}[len(shape)]
    assert tuple(mesh.get_coordinate()) == _coordinate(dist.get_rank(), shape)
    # the per-process cache: building the same spec again gives the same object
    assert make_mesh(shape, mesh.mesh_dim_names) is mesh
    # a collective over the last mesh dimension
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh.get_group(mesh.mesh_dim_names[-1]))
    assert t.item() == shape[-1]


@pytest.mark.ranks(8, timeout=60)
def test_named_mesh_fixtures(mesh_8, mesh_2x4, mesh_2x2x2):
    assert mesh_8.mesh_dim_names == ("tp",) and tuple(mesh_8.mesh.shape) == (8,)
    assert mesh_2x4.mesh_dim_names == ("dp", "tp") and tuple(mesh_2x4.mesh.shape) == (2, 4)
    assert mesh_2x2x2.mesh_dim_names == ("dp", "sp", "tp")
    assert mesh_2x4["tp"].size() == 4 and mesh_2x2x2["sp"].size() == 2


def test_unmarked_tests_run_in_process():
    assert not dist.is_initialized()


# -- the API, used directly ------------------------------------------------------------
def test_run_on_ranks_results_and_mesh_arguments():
    assert run_on_ranks(4, rank_and_args, "x", y=[1]) == [(r, 4, "x", [1]) for r in range(4)]
    assert run_on_ranks(4, rank_sum) == [6] * 4
    spec = MeshSpec((2, 4), ("dp", "tp"))
    results = run_on_ranks(8, describe_mesh, spec)
    assert results == [((2, 4), ("dp", "tp"), _coordinate(r, (2, 4))) for r in range(8)]
    assert run_on_ranks(8, describe_mesh, mesh=spec) == results


def test_failure_on_one_rank_is_reported_and_pool_survives():
    pool = testing.get_pool(4)
    pool.start()
    pids = pool.pids
    with pytest.raises(RankError) as info:
        pool.run(fail_on, 2)
    err = info.value
    assert type(err) is RankError and sorted(err.failures) == [2]
    text = str(err)
    assert "rank 2" in text and "[2]" in text
    assert "Traceback (most recent call last)" in text
    assert "in fail_on" in text and "ValueError: boom on rank 2" in text
    assert "hello from rank 2" in text  # captured output
    assert "hello from rank 2" in err.outputs[2] and "hello from rank 0" in err.outputs[0]
    assert isinstance(err.exceptions[2], ValueError)
    assert pool.pids == pids  # every rank returned: the pool stays
    assert pool.run(rank_sum) == [6] * 4


def test_all_ranks_failing_keeps_pool():
    pool = testing.get_pool(4)
    pool.start()
    pids = pool.pids
    with pytest.raises(RankError) as info:
        pool.run(fail_everywhere)
    assert sorted(info.value.failures) == [0, 1, 2, 3]
    assert "ranks 0, 1, 2, 3: traceback (identical)" in str(info.value)
    assert "KeyError" in str(info.value)
    assert pool.pids == pids
    assert pool.run(rank_sum) == [6] * 4


def test_failure_while_others_wait_in_collective_restarts_pool():
    with RankPool(4, grace=1.0) as pool:
        pool.start()
        pids = pool.pids
        t0 = time.monotonic()
        with pytest.raises(RankError) as info:
            pool.run(fail_then_others_wait, 1, timeout=30)
        assert time.monotonic() - t0 < 15
        err = info.value
        assert not isinstance(err, RankTimeout)
        assert sorted(err.failures) == [1] and err.unfinished == [0, 2, 3]
        text = str(err)
        assert "RuntimeError: rank 1 gives up before the collective" in text
        assert "barrier" in text  # where the others were stuck
        assert pool.run(rank_sum) == [6] * 4  # restarted transparently
        assert set(pool.pids).isdisjoint(pids)


def test_hang_is_reported_as_timeout_and_pool_recovers():
    pool = testing.get_pool(2)
    pool.start()
    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        pool.run(hang_on, 1, timeout=3)
    elapsed = time.monotonic() - t0
    assert 3 <= elapsed < 15
    err = info.value
    assert err.unfinished == [1] and err.timeout == 3
    text = str(err)
    assert text.startswith("timed out after 3 s on ranks [1]")
    assert "wait_forever_marker" in text  # the hung rank's stack
    assert pool.run(hang_on, 99) == [0, 1]


def test_dead_rank_and_broken_process_group_restart_the_pool():
    pool = testing.get_pool(2)
    with pytest.raises(RankError, match="exited with code 7"):
        pool.run(die_on, 1, timeout=30)
    assert pool.run(rank_sum) == [1, 1]
    pids = pool.pids
    assert pool.run(destroy_group) == ["destroyed"] * 2  # results still come back...
    assert pool.run(rank_sum) == [1, 1]  # ...and the next run gets fresh processes
    assert set(pool.pids).isdisjoint(pids)


def test_unpicklable_function_is_rejected_early():
    with pytest.raises(TypeError, match="module-level"):
        run_on_ranks(2, lambda: 1)


def test_function_loaded_from_a_file_outside_sys_path(tmp_path):
    name = f"einshard_harness_tmp_{uuid.uuid4().hex}"
    path = tmp_path / "elsewhere" / f"{name}.py"
    path.parent.mkdir()
    path.write_text("import torch.distributed as dist\n\ndef double_rank():\n    return 2 * dist.get_rank()\n")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        assert run_on_ranks(2, module.double_rank) == [0, 2]
    finally:
        del sys.modules[name]


def test_spawn_uses_fresh_processes():
    pool_pids = set(testing.get_pool(2).pids)
    results = testing.spawn(rank_and_args, 2, args=(5,), kwargs={"y": 6})
    assert results == [(0, 2, 5, 6), (1, 2, 5, 6)]
    assert set(testing.spawn(pid, 2)).isdisjoint(pool_pids)


def test_spawn_from_a_main_script(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, torch.distributed as dist
            from einshard import testing

            def total():
                t = torch.tensor([dist.get_rank() + 1])
                dist.all_reduce(t)
                return t.item()

            if __name__ == "__main__":
                print("RESULT", testing.spawn(total, 3, timeout=120))
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert "RESULT [6, 6, 6]" in out.stdout


def test_verbose_forwards_output(monkeypatch, capsys):
    assert run_on_ranks(2, print_something) == [None, None]
    assert "output of rank" not in capsys.readouterr().out
    monkeypatch.setenv("EINSHARD_TESTING_VERBOSE", "1")
    run_on_ranks(2, print_something)
    out = capsys.readouterr().out
    assert "rank 1 output" in out and "output of rank 1" in out


# -- pieces that need no ranks --------------------------------------------------------------
def test_mesh_spec():
    spec = MeshSpec([2, 4], ["dp", "tp"])
    assert spec == MeshSpec((2, 4), ("dp", "tp")) and spec.size == 8
    assert str(spec) == "2x4(dp,tp)"
    assert pickle.loads(pickle.dumps(spec)) == spec
    with pytest.raises(ValueError):
        MeshSpec((2, 4), ("dp",))
    with pytest.raises(ValueError):
        MeshSpec((2, 2), ("dp", "dp"))
    with pytest.raises(RuntimeError, match="inside a rank"):
        spec.build()


def test_rank_error_message_and_pickling():
    err = RankError({3: "Traceback...\nValueError: x\n", 1: "Traceback...\nTypeError: y\n"}, world_size=4)
    text = str(err)
    assert text.startswith("2 of 4 ranks failed: [1, 3]")
    assert text.index("rank 1:") < text.index("rank 3:")
    again = pickle.loads(pickle.dumps(err))
    assert again.failures == err.failures and str(again) == text
    timeout = RankTimeout({2: "stack"}, timeout=5, world_size=4, unfinished=[2])
    assert str(timeout).startswith("timed out after 5 s on ranks [2]")
    assert isinstance(timeout, RankError)
    assert pickle.loads(pickle.dumps(timeout)).timeout == 5


# -- the plugin seen from outside: a pytest run in a subprocess ------------------------------
INNER_TESTS = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.ranks(2)
def test_passes():
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2


@pytest.mark.ranks(2, timeout=60)
def test_fails_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("inner failure on rank one")


@pytest.mark.ranks(2)
def test_assertion_is_explained():
    value = dist.get_rank() + 40
    assert value == 40


@pytest.mark.ranks(2)
def test_skipped_everywhere():
    pytest.skip("not on this mesh")


class TestInAClass:
    @pytest.mark.ranks(2)
    @pytest.mark.parametrize("k", [3])
    def test_method(self, k, tmp_path):
        assert dist.get_world_size() == 2 and k == 3 and tmp_path.exists()
"""


def test_plugin_reports_failing_rank(pytester):
    pytester.makeconftest('pytest_plugins = ("einshard.testing.pytest_plugin",)\n')
    pytester.makepyfile(test_inner=INNER_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", timeout=180)
    result.assert_outcomes(passed=2, failed=2, skipped=1)
    out = result.stdout.str()
    assert "1 of 2 ranks failed: [1]" in out
    assert "rank 1: traceback" in out
    assert 'raise ValueError("inner failure on rank one")' in out
    assert "ValueError: inner failure on rank one" in out
    assert "assert 41 == 40" in out  # assertion rewriting works inside the ranks
    assert "not on this mesh" in out
