"""The registry of primitives: one definition per kind, and the planner's bytes are the recorded ones."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import einshard as es
from einshard.comm.comm_stats import count_communication
from einshard.core.layout import Layout, MeshShape
from einshard.plan.cost import price
from einshard.plan.transition import plan_transition
from einshard.comm.primitives import PRIMITIVES
from einshard.testing.reference import local_block

PLANNER_KINDS = ("slice", "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "exchange", "embed",
                 "embed_adjoint", "keep_root")


def test_every_step_kind_is_one_definition():
    for kind in PLANNER_KINDS:
        prim = PRIMITIVES[kind]
        assert prim.name == kind and prim.run is not None and prim.what is not None
        if prim.transport:
            assert PRIMITIVES[prim.transport].traffic is not None
    # variance rules of the collectives shard_map tracks (bit masks: input {0, 2}, collective {1, 2})
    assert PRIMITIVES["all_reduce"].vary(0b101, 0b110) == 0b001
    assert PRIMITIVES["all_gather"].vary(0b101, 0b110) == 0b001
    for kind in ("reduce_scatter", "all_to_all", "ppermute", "pvary"):
        assert PRIMITIVES[kind].vary(0b101, 0b110) == 0b111


def test_traffic_rules():
    assert PRIMITIVES["all_reduce"].traffic(4, 32, None) == (48, 48)  # ring: 2 (P-1) N / P
    assert PRIMITIVES["all_gather"].traffic(4, 8, None) == (24, 24)  # (P-1) padded blocks
    assert PRIMITIVES["broadcast"].traffic(4, 8, True) == (8, 0)
    assert PRIMITIVES["broadcast"].traffic(4, 8, False) == (0, 8)
    assert PRIMITIVES["broadcast"].traffic(4, 8, None) == (2, 6)  # the group's mean


def test_metrics_of_the_one_cost_function():
    mesh = MeshShape(("tp",), (4,))
    uneven = Layout(("a",), (10,), (("tp",),), ((3, 3, 3, 1),))
    whole = Layout(("a",), (10,), ((),), (None,))
    fwd, bwd = plan_transition(uneven, whole, mesh), plan_transition(whole, uneven, mesh)
    sent = price(fwd, bwd, mesh, 4)
    assert (sent.fwd_bytes, sent.fwd_calls, sent.bwd_bytes, sent.bwd_calls) == (36.0, 1, 0.0, 0)  # padded blocks
    received = price(fwd, bwd, mesh, 4, "max_received")
    assert (received.fwd_bytes, received.fwd_calls, received.bwd_bytes) == (36, 1, 0)  # the 1-row rank gets 9 rows
    policy = es.PlanPolicy("fft", collective_weight=0.0, metric="max_received")
    assert policy.metric == "max_received" and hash(policy) != hash(es.PlanPolicy("fft", collective_weight=0.0))


CASES = [  # (formula, global shape, split shapes of the sharded input)
    ("a/tp b -> a b", (10, 3), {"tp": [3, 3, 3, 1]}),  # all-gather, uneven (padded)
    ("a b -> a/tp b", (10, 3), None),  # slice
    ("a/tp b -> a b/tp", (8, 6), None),  # all-to-all
    ("a/dp b -> a/tp b", (9, 3), {"dp": [5, 4]}),  # exchange
    ("a/tp b -> b", (8, 6), None),  # sum: all-reduce
    ("a/tp b -> b/tp", (8, 6), None),  # sum: reduce-scatter, uneven output
    ("a/dp-tp b -> a b", (13, 2), {"dp-tp": [2, 2, 2, 2, 2, 1, 1, 1]}),  # all-gather over a compound group
    ("a/tp b -> a // tp", (10, 3), {"tp": [3, 3, 3, 1]}),  # embed (zero-padded contributions)
    ("a b -> // tp", (4, 3), None),  # kept on group rank 0 as the contribution; backward: broadcast from it
]


# checks off: checks add their own small collective per operation
@pytest.mark.ranks(8, checks=False)
def test_planned_bytes_are_the_recorded_bytes(mesh_2x4):
    """``explain``'s bytes (averaged over the ranks) are what ``count_communication`` records, forward and backward."""
    mesh = es.wrap_mesh(mesh_2x4)
    kinds = set()
    for formula, shape, shapes in CASES:
        whole = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        x = local_block(whole, formula.split("->")[0].strip(), mesh, shapes=shapes).requires_grad_()
        plan = es.explain(formula, x, mesh=mesh, shapes=shapes)
        kinds.update(row.move for row in plan.rows)
        with count_communication() as stats:
            y = es.einshard(formula, x, mesh=mesh, shapes=shapes)
            y.backward(torch.ones_like(y))
        stats = stats.data  # (a call with shapes= also agrees across ranks: a 'check', not data)
        got = torch.tensor([float(stats.forward.sent_bytes), float(stats.backward.sent_bytes)], dtype=torch.float64)
        dist.all_reduce(got)
        got /= dist.get_world_size()
        assert got.tolist() == pytest.approx([plan.forward_bytes, plan.backward_bytes]), formula
    assert {"embed as contributions (zero-padded)", "broadcast from group rank 0", "all-reduce"} <= kinds, kinds
