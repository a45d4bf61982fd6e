"""Refusals under ``torch.compile`` reach the caller as ``EinshardError`` with einshard's message first.

Dynamo wraps what a traced function raises: an error in trace-time Python became an
``InternalTorchDynamoError`` ("EinshardError: ..."), a ``raise`` in traced code its "Observed exception".
Each case here is refused on every rank with the same message as the eager call gives (where eager
refuses too), with and without ``fullgraph``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import einshard as es
from einshard.testing import MeshSpec

MESH = MeshSpec((2,), ("dp",))
FULLGRAPH = pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-breaks", "fullgraph"])


def _refusal(fn, *args) -> str:
    with pytest.raises(es.EinshardError) as info:
        fn(*args)
    return str(info.value)


def _compiled(fn, fullgraph):
    torch._dynamo.reset()
    return torch.compile(fn, backend="eager", fullgraph=fullgraph)


@pytest.mark.ranks(2)
@FULLGRAPH
def test_a_bad_formula_in_a_compiled_body_is_einshards_error(fullgraph):
    m = es.wrap_mesh(MESH.build())

    @es.shard_map("b c -> b/dp c", "b/dp c", mesh=m)
    def body(x):
        return es.einshard("b/dp c -> b/dp q", x)  # 'q' is in no input

    x = torch.ones(4, 3)
    eager = _refusal(body, x)
    assert eager.startswith("Invalid einshard expression: Output dimension 'q'")
    got = _refusal(_compiled(body, fullgraph), x)
    assert got.startswith(eager), got
    torch._dynamo.reset()
    dist.barrier()


@pytest.mark.ranks(2)
@FULLGRAPH
def test_a_bad_in_spec_of_a_compiled_shard_map_is_einshards_error(fullgraph):
    m = es.wrap_mesh(MESH.build())

    @es.shard_map("b c -> b/zz c", "b/zz c", mesh=m)
    def body(x):
        return x * 2

    got = _refusal(_compiled(body, fullgraph), torch.ones(4, 3))
    assert got.startswith("rank 0: shard_map: argument args[0] (spec 'b c -> b/zz c'): Invalid einshard expression: "
                          "mesh dimension 'zz'"), got
    torch._dynamo.reset()
    dist.barrier()


@pytest.mark.ranks(2)
def test_a_compiled_refusal_raised_in_traced_code_is_einshards_error():
    """A refusal raised by code dynamo traces (a parameter with a gradient duty given to a compiled
    ``check_vma`` body) was dynamo's "Observed exception" with ``fullgraph=True``."""
    m = es.wrap_mesh(MESH.build())
    holder = torch.nn.Module()
    holder.w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    es.params.register_module_parameter_layouts_(holder, {"w": "c"}, mesh=m, grad="dp")

    @es.shard_map(("c", "b c -> b/dp c"), "b/dp c", mesh=m)
    def body(w, x):
        return x * w

    got = _refusal(_compiled(body, True), holder.w, torch.ones(4, 3, dtype=torch.float64))
    assert got.startswith("shard_map under torch.compile: argument leaf 0 (shape (3,)) carries a gradient duty"), got
    torch._dynamo.reset()
    dist.barrier()
