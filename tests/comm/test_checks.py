"""Tests of einshard.comm.checks: set_checks / checks_enabled / agree, and checked collectives."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from einshard.comm import checks
from einshard.comm import collectives as C
from einshard.comm import comm_stats
from einshard.comm import mappings as M
from einshard.comm.mesh import wrap_mesh

# -- without ranks ------------------------------------------------------------------


def test_set_checks_and_default(monkeypatch):
    before = checks.checks_enabled()
    try:
        checks.set_checks(True)
        assert checks.checks_enabled() is True
        checks.set_checks(False)
        assert checks.checks_enabled() is False
    finally:
        checks.set_checks(before)
    for value, expected in [("1", True), ("true", True), ("0", False), ("", False), ("no", False)]:
        monkeypatch.setenv("EINSHARD_CHECKS", value)
        assert checks._env_default() is expected, value
    monkeypatch.delenv("EINSHARD_CHECKS")
    assert checks._env_default() is False


def test_agree_with_checks_off_is_local():
    before = checks.checks_enabled()
    checks.set_checks(False)
    try:
        checks.agree(None, None)  # no process group needed: no communication
        err = ValueError("local problem")
        with pytest.raises(ValueError) as info:
            checks.agree(None, err)
        assert info.value is err
        with pytest.raises(TypeError):
            checks.agree(None, TypeError("kept as is"))
    finally:
        checks.set_checks(before)


# -- on ranks -----------------------------------------------------------------------------


class _checks_on:
    def __enter__(self):
        self.before = checks.checks_enabled()
        checks.set_checks(True)

    def __exit__(self, *exc):
        checks.set_checks(self.before)


def _raises_agreed(fn, rank_prefix: str, fragment: str) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    message = str(info.value)
    assert message.startswith(rank_prefix), message
    assert fragment in message, message
    return message


@pytest.mark.ranks(8)
def test_agree_on_ranks(mesh_2x2x2):
    rank = dist.get_rank()
    with _checks_on():
        # nobody failed: one small all-gather (a record of 8 int64 per rank), no error
        with comm_stats.count_communication() as s:
            checks.agree(None, None)
        assert s.by_kind() == {"check": comm_stats.CommRecord(1, 7 * 64, 7 * 64)}, str(s)

        # equal fingerprints pass; different ones raise the same error everywhere
        checks.agree(None, None, fingerprint=1234, what="the shapes")
        with pytest.raises(ValueError, match="the ranks disagree on the shapes"):
            checks.agree(None, None, fingerprint=rank % 2, what="the shapes")

        # ranks 5 and 2 fail: every rank raises rank 2's message
        err = ValueError(f"bad size on rank {rank}") if rank in (2, 5) else None
        msg = _raises_agreed(lambda: checks.agree(None, err), "rank 2: ", "bad size on rank 2")
        assert msg == "rank 2: bad size on rank 2 (reported by ranks 2, 5)"

        # other exception types are reported by name
        err = TypeError("not a tensor") if rank == 7 else None
        _raises_agreed(lambda: checks.agree(None, err), "rank 7: ", "TypeError: not a tensor")

        # compound group of a 2x2x2 mesh: the lowest failing *group* rank, reported by its global rank
        group = wrap_mesh(mesh_2x2x2).group("tp-dp")  # e.g. ranks [0, 1, 4, 5]
        members = dist.get_process_group_ranks(group)
        err = ValueError(f"oops {rank}") if rank in members[1:] else None
        _raises_agreed(lambda: checks.agree(group, err), f"rank {members[1]}: ", f"oops {members[1]}")

        # still in step
        assert C.all_reduce(torch.ones(1), None).item() == 8


@pytest.mark.ranks(8)
def test_checked_collectives_raise_everywhere(mesh_2x4):
    """A size only rank 3 gets wrong: with checks on, every rank raises the same ValueError."""
    rank = dist.get_rank()
    group = wrap_mesh(mesh_2x4).group("dp-tp")  # all 8 ranks
    shapes = [2] * 8
    bad = rank == 3
    with _checks_on():
        x = torch.zeros(3 if bad else 2, 4)
        m1 = _raises_agreed(lambda: C.all_gather(x, group, 0, shapes), "rank 3: ", "shapes[3] = 2")
        m2 = _raises_agreed(lambda: M.allgather_forward_split_backward(x, group, 0, shapes), "rank 3: ", "shapes[3] = 2")
        assert m1 == m2

        whole = torch.zeros(17 if bad else 16, 2)
        _raises_agreed(lambda: C.reduce_scatter(whole, group, 0, shapes), "rank 3: ", "sum to 16")
        _raises_agreed(lambda: C.split(whole, group, 0, shapes), "rank 3: ", "sum to 16")
        _raises_agreed(lambda: M.split_forward_allgather_backward(whole, group, 0, shapes), "rank 3: ", "sum to 16")

        y = torch.zeros(3 if bad else 2, 16)
        _raises_agreed(lambda: C.all_to_all(y, group, 0, 1, shapes, shapes), "rank 3: ", "src_shapes[3] = 2")
        z = torch.zeros(2, 15 if bad else 16)
        _raises_agreed(lambda: C.all_to_all(z, group, 0, 1, shapes, shapes), "rank 3: ", "dst_shapes")
        # a bad dim on one rank only (its tensor has fewer dimensions)
        w = torch.zeros(2) if bad else torch.zeros(2, 2)
        _raises_agreed(lambda: C.all_gather(w, group, 1), "rank 3: ", "out of range")
        chunks = [torch.zeros(1)] * 8
        _raises_agreed(lambda: C.all_to_all_v(chunks, [2 if bad else 1] * 8, group), "rank 3: ", "recv_numels[3]")

        # shared errors still raise before any communication, even with checks on
        with comm_stats.count_communication() as s:
            with pytest.raises(ValueError, match="has 7 entries"):
                C.all_gather(x, group, 0, [2] * 7)
        assert s.calls == 0

        # valid calls still work, with one extra small collective each
        with comm_stats.count_communication() as s:
            got = C.all_gather(torch.full((2, 1), float(rank)), group, 0, shapes)
        assert got.flatten().tolist() == [float(q) for q in range(8) for _ in range(2)]
        assert set(s.by_kind()) == {"check", "all_gather"}, str(s)
    assert checks.checks_enabled()  # einshard.testing runs ranks with checks on (restored by _checks_on)


@pytest.mark.ranks(2, checks=False)
def test_ranks_marker_can_opt_out_of_checks():
    assert not checks.checks_enabled()
    with comm_stats.count_communication() as s:
        C.all_reduce(torch.ones(1), None)
    assert set(s.by_kind()) == {"all_reduce"}, str(s)


@pytest.mark.ranks(2)
def test_ranks_run_with_checks_on_by_default():
    assert checks.checks_enabled()
    with comm_stats.count_communication() as s:
        C.all_reduce(torch.ones(1), None)
    assert set(s.by_kind()) == {"check", "all_reduce"}, str(s)


def _refuse(*args, **kwargs):
    raise AssertionError("the checks must not (un)pickle anything")


@pytest.mark.ranks(4)
def test_error_path_exchanges_plain_bytes_only():
    """Messages and values travel as UTF-8 bytes in a tensor: no object collective, no unpickling."""
    import pickle

    rank = dist.get_rank()
    saved = dist.all_gather_object, dist.broadcast_object_list, pickle.loads
    dist.all_gather_object = dist.broadcast_object_list = pickle.loads = _refuse
    try:
        err = ValueError(f"bad size on rank {rank} ünïcode") if rank == 2 else None
        msg = _raises_agreed(lambda: checks.agree(None, err), "rank 2: ", "bad size on rank 2 ünïcode")
        with pytest.raises(ValueError) as info:
            checks.agree(None, None, facts=(("dtype", torch.float64 if rank == 3 else torch.float32),), point="op")
        shape_msg = str(info.value)
    finally:
        dist.all_gather_object, dist.broadcast_object_list, pickle.loads = saved
    assert msg == "rank 2: bad size on rank 2 ünïcode"
    assert shape_msg == "the ranks disagree on op: dtype: ranks 0, 1, 2 have float32; rank 3 has float64", shape_msg
    assert C.all_reduce(torch.ones(1), None).item() == 4  # still in step


@pytest.mark.ranks(4)
def test_ranks_at_different_operations():
    rank = dist.get_rank()
    with pytest.raises(ValueError, match=r"different collective operations: ranks 0, 1, 2 at psum; rank 3 at all_gather"):
        checks.agree(None, None, point="all_gather" if rank == 3 else "psum")
    assert C.all_reduce(torch.ones(1), None).item() == 4


def test_rank_failed_error_carries_the_failure():
    import pickle

    err = checks.RankFailedError(3, "RuntimeError: boom", (3, 5))
    assert (err.rank, err.message, err.ranks) == (3, "RuntimeError: boom", (3, 5))
    assert str(err) == "rank 3 raised in a shard_map body (ranks 3, 5 failed): RuntimeError: boom"
    again = pickle.loads(pickle.dumps(err))  # the test harness sends it to the parent
    assert (type(again), again.rank, again.ranks, str(again)) == (checks.RankFailedError, 3, (3, 5), str(err))
    assert str(checks.RankFailedError(1, "KeyboardInterrupt")) == "rank 1 raised in a shard_map body: KeyboardInterrupt"
