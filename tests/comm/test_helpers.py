"""``es.comm.helpers``: split shapes and process-group start-up."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import einshard as es
from einshard.comm.helpers import (
    compute_split_shapes,
    compute_split_shapes_for_factors,
    init_process_group,
    resolve_split_shapes,
)

# -- compute_split_shapes -------------------------------------------------------------------


@pytest.mark.parametrize(
    "size, n, expected",
    [
        (10, 4, [3, 3, 3, 1]),  # chunks of ceil(size/n), remainder last
        (9, 4, [2, 2, 2, 3]),  # ceil would leave the last chunk empty: floor, remainder last
        (8, 4, [2, 2, 2, 2]),
        (7, 1, [7]),
        (0, 1, [0]),
        (5, 4, [1, 1, 1, 2]),  # ceil overshoots: floor
        (13, 5, [3, 3, 3, 3, 1]),
        (2, 4, [0, 0, 0, 2]),  # fewer elements than ranks
        (0, 3, [0, 0, 0]),
    ],
)
def test_compute_split_shapes_examples(size, n, expected):
    assert compute_split_shapes(size, n) == expected


def _reference_split(size, n):
    """The split-shape rule (docs/distributed.md), written out independently."""
    if n == 1:
        return [size]
    chunk = -(-size // n)
    last = size - chunk * (n - 1)
    if last <= 0:
        chunk = size // n
        last = size - chunk * (n - 1)
    return [chunk] * (n - 1) + [last]


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 64))
def test_compute_split_shapes_properties(size, n):
    shapes = compute_split_shapes(size, n)
    assert shapes == _reference_split(size, n)
    assert len(shapes) == n and sum(shapes) == size and min(shapes) >= 0
    assert len(set(shapes[:-1])) <= 1  # every chunk but the last has one size
    if size >= n:
        assert min(shapes) > 0  # no rank is left empty when there is enough to go round


@pytest.mark.parametrize(
    "size, n, factor, expected",
    [
        (721, 4, 4, [180, 180, 180, 181]),
        (720, 4, 4, [180, 180, 180, 180]),
        (10, 2, 3, [6, 4]),  # compute_split_shapes(3, 2) = [2, 1] -> [6, 3], + 10 % 3 on the last
        (12, 3, 1, [4, 4, 4]),
        (7, 1, 2, [7]),
    ],
)
def test_compute_split_shapes_for_factors_examples(size, n, factor, expected):
    assert compute_split_shapes_for_factors(size, n, factor) == expected


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5000), st.integers(1, 16), st.integers(1, 16))
def test_compute_split_shapes_for_factors_properties(size, n, factor):
    shapes = compute_split_shapes_for_factors(size, n, factor)
    expected = [s * factor for s in _reference_split(size // factor, n)]
    expected[-1] += size % factor
    assert shapes == expected
    assert sum(shapes) == size
    assert all(s % factor == 0 for s in shapes[:-1])


@pytest.mark.parametrize(
    "call",
    [
        lambda: compute_split_shapes(4, 0),
        lambda: compute_split_shapes(-1, 2),
        lambda: compute_split_shapes_for_factors(8, 2, 0),
    ],
)
def test_split_shapes_reject_bad_arguments(call):
    with pytest.raises(ValueError):
        call()


def test_helpers_are_public():
    assert es.comm.helpers.compute_split_shapes is compute_split_shapes
    for name in ("compute_split_shapes", "compute_split_shapes_for_factors", "resolve_split_shapes"):
        assert name in es.comm.helpers.__all__


# -- resolve_split_shapes ---------------------------------------------------------------------


def test_resolve_split_shapes_forms():
    assert resolve_split_shapes(None, "sp", "a") is None
    assert resolve_split_shapes([3, 3, 4], "sp", "a") == [3, 3, 4]
    assert resolve_split_shapes((3, 3, 4), "sp", "a", group=3) == [3, 3, 4]
    assert resolve_split_shapes({"sp": [1, 2], "dp": [5, 5]}, "dp", "a") == [5, 5]
    nested = {"dp": {"a": [2, 2], "b": [1, 3]}, "sp": [4, 4]}
    assert resolve_split_shapes(nested, "dp", "b", group=2) == [1, 3]
    assert resolve_split_shapes(nested, "sp", "b") == [4, 4]
    # a compound dimension may be written in either order
    assert resolve_split_shapes({"sp-dp": [1, 1, 1, 5]}, "dp-sp", "a", group=4) == [1, 1, 1, 5]
    # the result is a fresh list of ints
    shapes = {"sp": [torch.tensor(2).item(), 3]}
    out = resolve_split_shapes(shapes, "sp", "a")
    assert out == [2, 3] and out is not shapes["sp"]


@pytest.mark.parametrize(
    "shapes, mesh_dim, axis, group, message",
    [
        ({"dp": [2, 2]}, "sp", "a", None, "no entry for mesh dimension 'sp'"),
        ({"dp": {"b": [2, 2]}}, "dp", "a", None, "no entry for axis 'a'"),
        ([2, 2, 2], "sp", "a", 2, "3 entries but the group has 2 ranks"),
        ({"sp": [4]}, "sp", "a", 2, "1 entries but the group has 2 ranks"),
        ({"dp": {"a": [1, 2, 3]}}, "dp", "a", 4, "the group has 4 ranks"),
        ([2, -1], "sp", "a", None, "non-negative integers"),
        ([2, 1.5], "sp", "a", None, "non-negative integers"),
        ("22", "sp", "a", None, "shapes must"),
        (3, "sp", "a", None, "list of per-rank sizes"),
    ],
)
def test_resolve_split_shapes_errors(shapes, mesh_dim, axis, group, message):
    with pytest.raises(ValueError, match=message):
        resolve_split_shapes(shapes, mesh_dim, axis, group=group)


# -- init_process_group -------------------------------------------------------------------------

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


@pytest.fixture
def fake_dist(monkeypatch):
    """Records init_process_group calls instead of starting torch.distributed."""
    import torch.distributed as dist

    for name in _ENV + ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    calls = []
    state = {"initialized": False}

    def fake_init(backend, rank, world_size, **kwargs):
        calls.append({"backend": backend, "rank": rank, "world_size": world_size, **kwargs})
        state["initialized"] = True

    monkeypatch.setattr(dist, "init_process_group", fake_init)
    monkeypatch.setattr(dist, "is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(dist, "get_rank", lambda group=None: calls[-1]["rank"])
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: calls[-1]["world_size"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return calls


def test_init_process_group_reads_torchrun_variables(fake_dist, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert init_process_group("gloo", use_cuda=False) == (1, 3, 8)
    assert fake_dist == [{"backend": "gloo", "rank": 3, "world_size": 8}]
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and os.environ["MASTER_PORT"] == "29500"
    # once initialised, a second call returns the same triple without initialising again
    assert init_process_group("gloo", use_cuda=False) == (1, 3, 8)
    assert len(fake_dist) == 1


def test_init_process_group_reads_slurm_variables(fake_dist, monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "6")
    monkeypatch.setenv("SLURM_LOCALID", "2")
    monkeypatch.setenv("MASTER_PORT", "12345")
    assert init_process_group(use_cuda=False) == (2, 5, 6)
    assert fake_dist[0]["backend"] == "gloo"  # the default without CUDA
    assert os.environ["MASTER_PORT"] == "12345"  # a given port is kept


def test_init_process_group_prefers_torchrun_and_defaults_local_rank(fake_dist, monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("SLURM_PROCID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "9")
    assert init_process_group("gloo", False) == (2, 2, 4)


def test_init_process_group_errors(fake_dist, monkeypatch):
    with pytest.raises(ValueError, match="RANK and WORLD_SIZE"):
        init_process_group("gloo", use_cuda=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="RANK and WORLD_SIZE"):
        init_process_group("gloo", use_cuda=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="CUDA is not available"):
        init_process_group("nccl", use_cuda=True)
    assert fake_dist == []  # nothing was started


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_init_process_group_starts_a_real_single_rank_group():
    code = """
import json
import torch.distributed as dist
from einshard.comm.helpers import init_process_group
first = init_process_group("gloo", use_cuda=False)
second = init_process_group("gloo", use_cuda=False)
print(json.dumps([first, second, dist.get_backend(), dist.get_world_size()]))
dist.destroy_process_group()
"""
    env = {k: v for k, v in os.environ.items() if k not in _ENV}
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second, backend, world = json.loads(out.stdout.strip().splitlines()[-1])
    assert first == second == [0, 0, 1]
    assert backend == "gloo" and world == 1
