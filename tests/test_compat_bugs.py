"""Bugs found by random and adversarial testing: each one pinned by a test."""

from __future__ import annotations

import pytest
import torch

import einshard as es


def _caret(message: str) -> int:
    return message.splitlines()[2].index("^") - 4


# -- parsing -----------------------------------------------------------------------------


@pytest.mark.parametrize("text, position", [("a/ b -> a b", 2), ("a / sp b", 3), ("(a/\tsp b) -> a sp b", 3)])
def test_whitespace_after_slash_is_an_error_with_a_caret(text, position):
    with pytest.raises(ValueError, match="no space is allowed after '/'") as info:
        es.parse_sharding(text)
    assert _caret(str(info.value)) == position
    assert str(es.parse_sharding("a /sp b")) == "a/sp b"  # before '/' spaces are fine


def test_long_formulas_parse_and_reject():
    """A 10,000-character formula parses (and a broken one is rejected at the right offset)."""
    text = ", ".join(["a/sp (b c) ... d // tp"] * 420) + " -> a/sp"
    assert len(text) > 10_000
    assert len(es.parse_sharding(text).inputs) == 420
    broken = "a b " * 2500 + "$"
    with pytest.raises(ValueError, match=r"unexpected character '\$'") as info:
        es.parse_sharding(broken)
    assert _caret(str(info.value)) == len(broken) - 1
    with pytest.raises(ValueError, match="'\\(' is never closed"):
        es.parse_sharding("(" + " ".join(["x"] * 5000))

