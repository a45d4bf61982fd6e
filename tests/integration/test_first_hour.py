"""A first hour without surprises: a missing mesh, a one-line mistake on several ranks, a whole tensor
returned under a sharded out-spec. (The README's and the docs' code runs in tests/integration/test_doc_snippets.py.)"""

from __future__ import annotations

import pytest
import torch

import einshard as es
from einshard.testing import MeshSpec, RankError, local_block, run_on_ranks

# -- forgetting mesh= -------------------------------------------------------------------------------


def test_a_missing_mesh_names_the_formula_and_the_ways_to_pass_one():
    x, w = torch.randn(2, 3, 8), torch.randn(5, 8)
    with pytest.raises(es.EinshardError) as info:  # row-parallel: an all-reduce over tp
        es.einshard("b n h/tp, c h/tp -> b n c", x, w)
    text = str(info.value)
    assert text.startswith("'b n h/tp, c h/tp -> b n c': Distributed einshard operations require mesh=...")
    assert "es.use_mesh(mesh)" in text and "'b n h/tp, c h/tp -> b n c // tp'" in text
    assert isinstance(info.value, ValueError)


def test_a_formula_whose_shards_stay_runs_without_a_mesh():
    """The column-parallel formula: every rank multiplies its own blocks (as docs/getting-started.md says)."""
    x, w_block = torch.randn(2, 3, 8), torch.randn(4, 8)
    y = es.einshard("b n c, h/tp c -> b n h/tp", x, w_block)
    torch.testing.assert_close(y, x @ w_block.T)
    with pytest.raises(es.EinshardError, match=r"operand 0 needs a gradient.*es.use_mesh"):
        es.einshard("b n c, h/tp c -> b n h/tp", x.requires_grad_(), w_block)


def test_shard_map_without_a_mesh_names_itself():
    def body(x):
        return x

    f = es.shard_map(body, "a/tp", "a/tp")
    with pytest.raises(es.EinshardError) as info:
        f(torch.ones(2))
    assert str(info.value).startswith("shard_map(test_shard_map_without_a_mesh_names_itself.<locals>.body")
    assert "es.use_mesh(mesh)" in str(info.value)


# -- a one-line mistake on 4 ranks --------------------------------------------------------------------


def _one_line_mistake(mesh):
    mesh = es.wrap_mesh(mesh)
    return es.einshard("b c, h/tp c -> b h/tp", torch.ones(2, 3), torch.ones(4, 2), mesh=mesh)  # c: 3 and 2


def test_rank_error_shows_the_ranks_the_message_and_the_users_frame_first():
    with pytest.raises(RankError) as info:
        run_on_ranks(4, _one_line_mistake, MeshSpec((4,), ("tp",)))
    text = str(info.value)
    lines = text.splitlines()
    message = "'b c, h/tp c -> b h/tp': axis 'c' has global size 2 in operand 1 but 3 elsewhere"
    assert lines[0] == "4 of 4 ranks failed: [0, 1, 2, 3]"
    assert lines[1].startswith("ranks 0, 1, 2, 3: einshard.errors.") and message in lines[1]
    assert lines[2].startswith('  File "') and "test_first_hour.py" in lines[2] and "_one_line_mistake" in lines[2]
    assert "es.einshard(" in lines[3]
    assert text.count(message) == 2  # the summary and the traceback's last line; not again through chaining
    assert "direct cause" not in text


# -- a whole tensor returned under a sharded out-spec --------------------------------------------------


def _whole_under_a_sharded_out_spec(mesh):
    mesh = es.wrap_mesh(mesh)

    @es.shard_map("b n -> b/tp n", "b/tp n", mesh=mesh)
    def body(x):
        return es.einshard("b/tp n -> b n", x)  # the whole tensor, where the out-spec says a block

    with pytest.raises(es.EinshardError) as info:
        body(torch.ones(8, 3))
    text = str(info.value)
    assert "out_spec 'b/tp n'" in text and "it holds the whole axis" in text
    assert "'b' instead of 'b/tp'" in text and "pass shapes= with the real split" not in text

    @es.shard_map("b n -> b/tp n", "b n", mesh=mesh)  # the fix the message names
    def fixed(x):
        return es.einshard("b/tp n -> b n", x)

    whole = torch.arange(24.0).reshape(8, 3)
    torch.testing.assert_close(fixed(whole), whole)
    # a block of another size still points at shapes=
    uneven = local_block(torch.ones(7, 3), "b/tp n", mesh, shapes={"tp": [1, 2, 2, 2]})
    with pytest.raises(es.EinshardError, match="pass shapes= with the real split"):
        es.einshard("b/tp n -> b n", uneven, mesh=mesh, shapes={"tp": [2, 2, 2, 1]})
    return True


@pytest.mark.ranks(4)
def test_a_whole_tensor_under_a_sharded_out_spec_suggests_the_out_spec():
    assert _whole_under_a_sharded_out_spec(MeshSpec((4,), ("tp",)).build())
