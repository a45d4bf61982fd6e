"""The notation: parsing, families, and the errors for malformed expressions."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import einshard as es
from einshard.notation import Axis, EllipsisItem, Group, expand


def _error(expression: str, *args, parse=es.parse_sharding) -> str:
    with pytest.raises(ValueError) as info:
        parse(expression, *args)
    return str(info.value)


def _assert_caret(message: str, expression: str, position: int) -> None:
    lines = message.splitlines()
    assert lines[0].startswith("Invalid einshard expression"), message
    assert lines[1] == "    " + expression, message
    assert lines[2] == "    " + " " * position + "^", message


# -- valid expressions -------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, canonical",
    [
        ("i j, j k -> i k", "i j, j k -> i k"),
        ("a/sp b, b c -> a/sp c", "a/sp b, b c -> a/sp c"),
        ("a b // tp -> a b", "a b // tp -> a b"),
        ("a b//(sp,dp)->a b", "a b // (sp, dp) -> a b"),
        ("a/dp-sp b -> a b // sp-dp", "a/dp-sp b -> a b // sp-dp"),
        ("b (h/sp p) -> b h/sp p", "b (h/sp p) -> b h/sp p"),
        ("... c, h/tp c -> ... h/tp", "... c, h/tp c -> ... h/tp"),
        ("b *spatial c -> b c", "b *spatial c -> b c"),
        ("b [*s *w] c -> b *s *w c", "b [*s *w] c -> b *s *w c"),
        ("w [param, grad = dp], x -> x", "w [param, grad=dp], x -> x"),
        ("x [init_sync=dp-tp] -> x", "x [init_sync=dp-tp] -> x"),
        ("-> ", " -> "),  # scalar to scalar
        ("a b, -> a", "a b,  -> a"),  # a scalar operand
        ("i i -> i", "i i -> i"),  # local diagonal
        ("snake_case _lead x2 -> x2", "snake_case _lead x2 -> x2"),
        ("höhe breite/ŝp -> breite/ŝp höhe", "höhe breite/ŝp -> breite/ŝp höhe"),
        ("\tq\n k ->k  q ", "q k -> k q"),
        ("a/sp b", "a/sp b"),  # a bare tensor spec
    ],
)
def test_valid_expressions_round_trip(text, canonical):
    parsed = es.parse_sharding(text)
    assert str(parsed) == canonical
    assert str(es.parse_sharding(str(parsed))) == canonical


def test_parsed_objects():
    f = es.parse_sharding("a/sp (b c) ... // (tp, dp) [param, grad=dp], b c/dp-sp -> a/sp c // tp")
    first, second = f.inputs
    assert first.items[0] == Axis("a", "sp")
    assert first.items[1] == Group((Axis("b"), Axis("c")))
    assert isinstance(first.items[2], EllipsisItem)
    assert first.axes == (Axis("a", "sp"), Axis("b"), Axis("c"))
    assert first.partial == ("tp", "dp")
    assert [str(a) for a in first.annotations] == ["param", "grad=dp"]
    assert second.axes[1].mesh_components == ("dp", "sp")
    assert f.output.partial == ("tp",)
    assert f.mesh_components == {"sp", "tp", "dp"}
    assert not f.is_local
    assert es.parse_sharding("i j, j k -> i k").is_local
    assert es.parse_sharding("a b").output is None


def test_parse_is_cached_and_immutable():
    f = es.parse_sharding("a/sp b, b c -> a/sp c")
    assert es.parse_sharding("a/sp b, b c -> a/sp c") is f
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.inputs[0].items[0].name = "z"
    with pytest.raises((dataclasses.FrozenInstanceError, AttributeError)):
        f.output = None
    assert isinstance(f.inputs, tuple) and isinstance(f.inputs[0].items, tuple)


def test_family_expansion():
    families = {"s": ("h/sp", "w"), "w": ("kh", "kw")}
    f = expand("b [*s *w] c -> b *s *w c", families)
    assert str(f) == "b (h/sp kh) (w kw) c -> b h/sp w kh kw c"
    # the dict form and the frozen form hit the same cache entry
    assert expand("b [*s *w] c -> b *s *w c", {"w": ["kh", "kw"], "s": ["h/sp", "w"]}) is f
    assert str(expand("x *one -> x", {"one": "h"})) == "x h -> x"
    assert expand("a b -> a") is es.parse_sharding("a b -> a")


@pytest.mark.parametrize(
    "expression, families, reason",
    [
        ("*s -> *s", {}, "unknown family 's' (families: none given)"),
        ("b *s -> b", {"t": ("h",)}, "unknown family 's' (families: t)"),
        ("[*s *w] -> *s", {"s": ("h", "w"), "w": ("k",)}, "zipped families must have equal lengths"),
        ("*s -> *s", {"s": ("h w",)}, "is not an axis"),
        ("*s -> *s", {"s": (1,)}, "must hold axis names"),
        ("*s, *s -> h h", {"s": ("h",)}, "appears more than once in the output"),
        ("*s h -> h", {"s": ("h/sp",)}, "a diagonal cannot be sharded"),
    ],
)
def test_family_errors(expression, families, reason):
    message = _error(expression, families, parse=expand)
    assert "Invalid einshard expression" in message or "must hold axis names" in message
    assert expression in message
    assert reason in message


# -- malformed expressions -----------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, position, reason",
    [
        ("(a b -> a b", 0, "'(' is never closed"),
        ("a b) -> a b", 3, "')' has no matching '('"),
        ("a -> (a", 5, "'(' is never closed"),
        ("(a b), (c d -> a", 7, "'(' is never closed"),
        ("((a b)) -> a", 1, "groups cannot be nested"),
        ("(a (b c)) -> a b c", 3, "groups cannot be nested"),
        ("() -> a", 0, "'()' is empty"),
        ("... ... a -> a", 4, "at most one '...'"),
        ("a ..., ... b ... -> a", 13, "at most one '...'"),
        ("a.. -> a", 1, "an ellipsis is written '...'"),
        ("a -> a -> a", 7, "exactly one arrow"),
        ("a, b", 4, "needs '->' and an output"),
        ("a/ -> a", 3, "'/' must be followed by a mesh dimension"),
        ("a/sp/tp -> a", 4, "compound one as 'sp-tp'"),
        ("a // -> a", 5, "'//' must be followed by a mesh dimension"),
        ("a // sp // tp -> a", 8, "at most one '//'"),
        ("a-b -> a", 1, "unexpected '-'"),
        ("1a -> a", 0, "unexpected character '1'"),
        ("a$ -> a", 1, "unexpected character '$'"),
        ("[*a *b -> a", 0, "'[' is never closed"),
        ("[*a (b)] -> a", 4, "a zip holds families only"),
        ("a b -> a ]", 9, "']' has no matching '['"),
        ("a b -> a a", 9, "appears more than once in the output"),
        ("a -> b", 5, "Output dimension 'b' does not appear in any input"),
        ("a -> ...", 5, "the output has '...' but no input has"),
        ("a/sp a -> a", 5, "a diagonal cannot be sharded"),
        ("a/sp b/sp -> a b", 5, "mesh dimension 'sp' shards both 'a' and 'b'"),
        ("a/sp // sp -> a", 0, "both shards 'a' and is partial"),
        ("a // (sp, sp) -> a", 0, "partial over 'sp' twice"),
        ("a -> a [param]", 5, "allowed on inputs only"),
        ("a [bogus] -> a", 0, "unknown annotation 'bogus'"),
        ("a [grad] -> a", 0, "needs a value"),
        ("a [param=dp] -> a", 0, "takes no value"),
    ],
)
def test_malformed_expressions(expression, position, reason):
    message = _error(expression, parse=expand)  # the syntax, then the meaning (as es.einshard checks)
    assert reason in message
    _assert_caret(message, expression, position)


_SEMANTIC = ["a b -> a a", "a -> b", "a -> ...", "a/sp a -> a", "a/sp b/sp -> a b", "a/sp // sp -> a",
             "a // (sp, sp) -> a", "b c, out/tp c/tp [param] -> b out", "out/dp-dp in"]


@pytest.mark.parametrize("expression", _SEMANTIC)
def test_parse_sharding_checks_syntax_only(expression):
    """Well-formed text parses; its meaning is checked where it is used (expand, es.einshard, ParameterState)."""
    parsed = es.parse_sharding(expression)
    assert str(es.parse_sharding(str(parsed))) == str(parsed)
    with pytest.raises(ValueError, match="Invalid einshard expression"):
        expand(expression)


def test_non_string_is_rejected():
    assert "Invalid einshard expression" in _error(None)


_ALPHABET = list("ab_éζ ()[]*.,-/>=1") + ["->", "...", "//", "/sp", "*f"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_ALPHABET), max_size=16).map("".join))
def test_any_string_parses_or_reports_position(text):
    try:
        es.parse_sharding(text)
    except ValueError as err:
        lines = str(err).splitlines()
        assert lines[0].startswith("Invalid einshard expression"), str(err)
        assert lines[1] == "    " + text
        caret = lines[2]
        assert caret.strip() == "^" and 4 <= caret.index("^") <= 4 + len(text)


_NAMES = st.sampled_from(["a", "b_1", "_c", "é", "Ωmega", "x2", "long_name"])
_MESH = st.sampled_from(["sp", "tp", "dp", "dp-sp"])


@st.composite
def _specs(draw):
    names = draw(st.lists(_NAMES, unique=True, max_size=5))
    used = set()
    items = []
    for name in names:
        dim = draw(st.none() | _MESH)
        if dim is not None and not (set(dim.split("-")) & used):
            used.update(dim.split("-"))
            items.append(f"{name}/{dim}")
        else:
            items.append(name)
    if len(items) >= 2 and draw(st.booleans()):
        k = draw(st.integers(0, len(items) - 2))
        items[k : k + 2] = ["(" + " ".join(items[k : k + 2]) + ")"]
    if draw(st.booleans()):
        items.insert(draw(st.integers(0, len(items))), "...")
    spec = " ".join(items)
    free = [d for d in ("sp", "tp", "dp") if d not in used]
    if free and draw(st.booleans()):
        spec += " // " + draw(st.sampled_from(free))
    return spec, names


@settings(max_examples=100, deadline=None)
@given(st.lists(_specs(), min_size=1, max_size=3), st.data())
def test_generated_formulas_round_trip(specs, data):
    inputs = [s for s, _ in specs]
    names = sorted({n for _, ns in specs for n in ns})
    out = data.draw(st.permutations(names)) if names else []
    ellipsis = any("..." in s for s in inputs)
    text = ", ".join(inputs) + " -> " + " ".join(out + (["..."] if ellipsis else []))
    parsed = es.parse_sharding(text)
    again = es.parse_sharding(str(parsed))
    assert again.inputs == parsed.inputs and again.output == parsed.output
    assert [a.name for a in parsed.output.axes] == out
