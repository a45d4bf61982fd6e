"""Tests of einshard.comm.comm_stats: the records, the views, and byte counts of every collective."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from einshard.comm import collectives as C
from einshard.comm import comm_stats
from einshard.comm import mappings as M
from einshard.comm.comm_stats import CommRecord, CommStats, count_communication, record, register_group_label
from einshard.comm.mesh import wrap_mesh
from einshard.testing import make_mesh

# -- without ranks ------------------------------------------------------------------


class _FakeGroup:
    """Stands in for a ProcessGroup in single-process tests (registered labels need no torch.distributed)."""


def test_record_and_views():
    g = _FakeGroup()
    register_group_label(g, "tp")
    assert comm_stats._ACTIVE == []
    record("all_gather", g, 10, 30)  # no active context: nothing happens
    with count_communication() as outer:
        assert comm_stats.is_active()
        record("all_gather", g, 10, 30)
        with count_communication() as inner:
            record("all_gather", g, 10, 30)
            record("all_reduce", g, 5, 5)
        record("reduce_scatter", g, 7, 3)
    assert comm_stats._ACTIVE == [] and not comm_stats.is_active()

    assert (inner.calls, inner.sent_bytes, inner.received_bytes) == (2, 15, 35)
    assert (outer.calls, outer.sent_bytes, outer.received_bytes) == (4, 32, 68)
    assert outer.records[("all_gather", "tp", "forward")] == CommRecord(2, 20, 60)
    assert outer.by_kind() == {
        "all_gather": CommRecord(2, 20, 60),
        "all_reduce": CommRecord(1, 5, 5),
        "reduce_scatter": CommRecord(1, 7, 3),
    }
    assert outer.by_label() == {"tp": CommRecord(4, 32, 68)}
    assert outer.by_direction() == {"forward": CommRecord(4, 32, 68)}
    assert outer.backward.calls == 0 and outer.forward.calls == 4
    assert outer.filter(kind="all_reduce").sent_bytes == 5
    assert outer.filter(label="dp").calls == 0
    # views are copies
    view = outer.forward
    view.records[("all_gather", "tp", "forward")].calls = 99
    assert outer.calls == 4

    text = str(outer)
    lines = text.splitlines()
    assert lines[0].split() == ["kind", "group", "direction", "calls", "sent", "B", "received", "B"]
    assert any(line.split()[:4] == ["all_gather", "tp", "forward", "2"] for line in lines)
    assert lines[-1].split() == ["total", "4", "32", "68"]
    assert "CommStats(calls=4" in repr(outer)
    outer.reset()
    assert outer.calls == 0 and str(outer).splitlines()[-1].split() == ["total", "0", "0", "0"]


def test_backward_direction_and_threads():
    g = _FakeGroup()
    register_group_label(g, "sp")
    register_group_label(g, "dp-sp")  # the latest label wins

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(x):
            record("all_gather", g, 1, 2)
            return x.clone()

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, grad):
            record("reduce_scatter", g, 3, 4)
            return grad

    x = torch.ones(2, requires_grad=True)
    with count_communication() as stats:
        Probe.apply(x).sum().backward()
    assert stats.forward.by_kind() == {"all_gather": CommRecord(1, 1, 2)}
    assert stats.backward.by_kind() == {"reduce_scatter": CommRecord(1, 3, 4)}
    assert set(stats.records) == {("all_gather", "dp-sp", "forward"), ("reduce_scatter", "dp-sp", "backward")}
    table = str(stats).splitlines()
    assert table[1].split()[:3] == ["all_gather", "dp-sp", "forward"]  # forward rows first
    assert table[2].split()[:3] == ["reduce_scatter", "dp-sp", "backward"]

    # a context records collectives of other threads too
    import threading

    with count_communication() as stats:
        t = threading.Thread(target=record, args=("ppermute", g, 8, 8))
        t.start()
        t.join()
    assert stats.calls == 1


def test_stats_helpers():
    stats = CommStats()
    stats._add("all_gather", "tp", "forward", 32, 96)
    assert (stats.calls, stats.forward.received_bytes, stats.backward.calls) == (1, 96, 0)


# -- on ranks: byte counts of every collective -----------------------------------------


def _only(stats: CommStats, kind: str, label: str, direction: str = "forward") -> CommRecord:
    assert set(stats.records) == {(kind, label, direction)}, f"expected one {kind} record on {label}:\n{stats}"
    return stats.records[(kind, label, direction)]


def _expect(stats, kind, label, calls, sent, received, direction="forward"):
    rec = _only(stats, kind, label, direction)
    assert (rec.calls, rec.sent_bytes, rec.received_bytes) == (calls, sent, received), (
        f"{kind} on {label}: got calls={rec.calls} sent={rec.sent_bytes} received={rec.received_bytes}, "
        f"want calls={calls} sent={sent} received={received}\n{stats}"
    )


# checks off: this test counts exact communication, and checks add one small collective per
# operation (counted in tests/comm/test_checks.py)
@pytest.mark.ranks(8, checks=False)
def test_byte_counts(mesh_2x4, mesh_2x2x2):
    m24 = wrap_mesh(mesh_2x4)
    cases = [(m24.group("tp"), "tp"), (wrap_mesh(mesh_2x2x2).group("tp-sp"), "sp-tp"), (m24.group("dp"), "dp")]
    for group, label in cases:
        P, r = C.group_size(group), C.group_rank(group)
        assert comm_stats.group_label(group) == label

        # all_gather, even: N elements in total, each rank receives (P-1)/P N elements' bytes
        x = torch.zeros(2, 3)  # float32: 24 bytes per rank
        N = 2 * 3 * P * 4
        with count_communication() as s:
            C.all_gather(x, group, 0)
        _expect(s, "all_gather", label, 1, (P - 1) * 24, (P - 1) * N // P)
        assert s.received_bytes == (P - 1) * N // P and s.calls == 1

        # all_gather, uneven: padded to the largest block (3 rows of 3 float64 = 72 bytes)
        shapes = [3] * (P - 1) + [0]
        x = torch.zeros(shapes[r], 3, dtype=torch.float64)
        with count_communication() as s:
            C.all_gather(x, group, 0, shapes)
        _expect(s, "all_gather", label, 1, (P - 1) * 72, (P - 1) * 72)

        # reduce_scatter, even: N bytes in, own block N / P
        x = torch.zeros(4 * P, 3, dtype=torch.float64)
        N = x.numel() * 8
        with count_communication() as s:
            C.reduce_scatter(x, group, 0)
        _expect(s, "reduce_scatter", label, 1, N - N // P, (P - 1) * (N // P))

        # reduce_scatter, uneven (padded): blocks of 3 rows
        x = torch.zeros(sum(shapes), 3, dtype=torch.float64)
        with count_communication() as s:
            C.reduce_scatter(x, group, 0, shapes)
        _expect(s, "reduce_scatter", label, 1, (P - 1) * 72, (P - 1) * 72)

        # all_reduce: ring, 2 (P-1)/P N each way
        x = torch.zeros(6 * P, dtype=torch.complex64)
        N = x.numel() * 8
        with count_communication() as s:
            C.all_reduce(x, group)
            C.all_reduce(x, group, op="sum")
        _expect(s, "all_reduce", label, 2, 2 * (2 * (P - 1) * N // P), 2 * (2 * (P - 1) * N // P))

        # all_to_all, uneven: sent = the blocks for other ranks, received = those from other ranks
        src = [1 + q for q in range(P)]  # rows held by rank q
        dst = [2] * (P - 1) + [1]  # columns for rank q
        x = torch.zeros(src[r], sum(dst), dtype=torch.float64)
        with count_communication() as s:
            C.all_to_all(x, group, 0, 1, src, dst)
        sent = sum(src[r] * dst[q] * 8 for q in range(P) if q != r)
        received = sum(src[q] * dst[r] * 8 for q in range(P) if q != r)
        _expect(s, "all_to_all", label, 1, sent, received)

        # all_to_all_v: only the chunks for / from other ranks
        chunks = [torch.zeros(q + 1) for q in range(P)]
        with count_communication() as s:
            C.all_to_all_v(chunks, [r + 1] * P, group)
        _expect(s, "all_to_all_v", label, 1, sum((q + 1) * 4 for q in range(P) if q != r), (P - 1) * (r + 1) * 4)

        # broadcast: src sends N, the others receive N
        x = torch.zeros(5, dtype=torch.float64)
        with count_communication() as s:
            C.broadcast(x, group, src=P - 1)
        _expect(s, "broadcast", label, 1, 40 if r == P - 1 else 0, 0 if r == P - 1 else 40)

        # ppermute: what is sent / received; ranks outside the pair move nothing
        with count_communication() as s:
            C.ppermute(x, group, [(0, P - 1)])
        _expect(s, "ppermute", label, 1, 40 if r == 0 else 0, 40 if r == P - 1 else 0)

        # split never communicates
        with count_communication() as s:
            C.split(torch.zeros(P, 2), group, 0)
        assert s.calls == 0 and not s.records


# checks off: this test counts exact communication, and checks add one small collective per
# operation (counted in tests/comm/test_checks.py)
@pytest.mark.ranks(8, checks=False)
def test_forward_and_backward_records(mesh_2x4):
    group = wrap_mesh(mesh_2x4).group("tp")
    P, r = C.group_size(group), C.group_rank(group)
    x = torch.zeros(2, 3, requires_grad=True)  # float32, sharded rows
    with count_communication() as s:
        y = M.allgather_forward_reducescatter_backward(x, group, 0, None)  # (2P, 3)
        z = M.identity_forward_allreduce_backward(y, group)
        (z * 2).sum().backward()
    fwd, bwd = s.forward, s.backward
    assert fwd.by_kind() == {"all_gather": CommRecord(1, (P - 1) * 24, (P - 1) * 24)}, str(s)
    N = 2 * P * 3 * 4
    assert bwd.by_kind() == {
        "all_reduce": CommRecord(1, 2 * (P - 1) * N // P, 2 * (P - 1) * N // P),
        "reduce_scatter": CommRecord(1, N - N // P, (P - 1) * (N // P)),
    }, str(s)
    assert set(label for _, label, _ in s.records) == {"tp"}
    assert torch.allclose(x.grad, torch.full((2, 3), 2.0 * P * P))
    text = str(s)
    assert "backward" in text and "reduce_scatter" in text and "all_gather" in text


# checks off: this test counts exact communication, and checks add one small collective per
# operation (counted in tests/comm/test_checks.py)
@pytest.mark.ranks(8, checks=False)
def test_labels_and_single_rank_groups():
    r = dist.get_rank()
    # a group no mesh has named: "group(ranks...)"
    pair = [r // 2 * 2, r // 2 * 2 + 1]
    g = dist.new_group(pair, use_local_synchronization=True)
    with count_communication() as s:
        C.all_reduce(torch.ones(4), g)
    _expect(s, "all_reduce", f"group({pair[0]},{pair[1]})", 1, 16, 16)
    # group=None: the world group, under whatever label it has ("world" unless a mesh named it)
    label = comm_stats.group_label(None)
    assert label == comm_stats.group_label(dist.group.WORLD)
    with count_communication() as s:
        C.all_reduce(torch.ones(8), None)
    _expect(s, "all_reduce", label, 1, 2 * 7 * 32 // 8, 2 * 7 * 32 // 8)

    # groups of one rank communicate nothing and record nothing
    one = wrap_mesh(make_mesh((8, 1), ("dp", "one"))).group("one")
    with count_communication() as s:
        C.all_reduce(torch.ones(3), one)
        C.all_gather(torch.ones(3), one, 0)
        C.reduce_scatter(torch.ones(3), one, 0)
        C.all_to_all(torch.ones(3, 2), one, 0, 1)
        C.broadcast(torch.ones(3), one)
        C.ppermute(torch.ones(3), one, [(0, 0)])
        C.all_to_all_v([torch.ones(3)], [3], one)
        M.allgather_forward_split_backward(torch.ones(3, requires_grad=True), one, 0, None).sum().backward()
    assert s.calls == 0 and not s.records, str(s)
