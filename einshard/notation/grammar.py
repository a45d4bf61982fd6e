"""The Parsley grammar of the notation (SPEC §2) and syntax-error reporting."""

from __future__ import annotations

import parsley
from ometa.runtime import ParseError

from .objects import Annotation, Axis, EllipsisItem, Family, Group, TensorSpec, Zip

GRAMMAR = r"""
ws        = (' ' | '\t' | '\n' | '\r')*
name      = <(letter | '_') (letterOrDigit | '_')*>
meshdim   = <name ('-' name)*>

axis      = pos:p name:n (ws '/' ~'/' ws meshdim)?:m -> Axis(n, m, p)
group     = pos:p '(' (ws axis)+:xs ws ')' -> Group(tuple(xs), p)
ellipsis  = pos:p '...' -> EllipsisItem(p)
family    = pos:p '*' name:n -> Family(n, p)
zip       = pos:p '[' (ws family)+:fs ws ']' -> Zip(tuple(fs), p)
item      = ws (ellipsis | group | zip | family | axis)

partial   = ws '//' ws ( meshdim:m -> (m,)
                       | '(' ws meshdim:m (ws ',' ws meshdim)*:ms ws ')' -> (m,) + tuple(ms))
annvalue  = <meshdim (':' name)?>
annitem   = name:k (ws '=' ws annvalue:v -> Annotation(k, v)
                    | -> Annotation(k, None))
annotation = ws '[' ws annitem:a (ws ',' ws annitem)*:rest ws ']' -> (a,) + tuple(rest)

tensor    = ws pos:p item*:xs partial?:pt annotation?:an
            -> TensorSpec(tuple(xs), pt or (), an or (), p)
inputs    = tensor:first (ws ',' tensor)*:rest -> (first,) + tuple(rest)
formula   = inputs:ins ws '->' tensor:out ws end -> (ins, out)
          | tensor:t ws end -> ((t,), None)
"""

_BINDINGS = {
    "Axis": Axis,
    "Group": Group,
    "EllipsisItem": EllipsisItem,
    "Family": Family,
    "Zip": Zip,
    "Annotation": Annotation,
    "TensorSpec": TensorSpec,
}


def _make_parser():
    base = parsley.makeGrammar(GRAMMAR, _BINDINGS)._grammarClass

    class _Grammar(base):
        def rule_pos(self):
            """Zero-width rule returning the current input offset."""
            return self.input.position, self.input.nullError()

    return parsley.wrapGrammar(_Grammar)


_PARSER = _make_parser()


def invalid(expression: str, position: int, reason: str) -> ValueError:
    """A ``ValueError`` with the expression and a caret under ``position``."""
    position = max(0, min(position, len(expression)))
    caret = " " * position + "^"
    return ValueError(f"Invalid einshard expression: {reason}\n    {expression}\n    {caret}")


def _explain_syntax_error(text: str, index: int) -> tuple[int, str]:
    """A readable reason for a syntax error detected at ``index``."""
    while index < len(text) and text[index].isspace():
        index += 1
    before = text[:index].rstrip()
    if before.endswith("//"):
        return index, "'//' must be followed by a mesh dimension or '(dim, ...)'"
    if before.endswith("/"):
        return index, "'/' must be followed by a mesh dimension name"
    depth_paren = 0
    depth_bracket = 0
    for i, ch in enumerate(text[:index]):
        if ch == "(":
            depth_paren += 1
        elif ch == ")":
            depth_paren -= 1
        elif ch == "[":
            depth_bracket += 1
        elif ch == "]":
            depth_bracket -= 1
    if index >= len(text):
        if depth_paren > 0:
            return text.rfind("("), "unbalanced parentheses: '(' is never closed"
        if depth_bracket > 0:
            return text.rfind("["), "unbalanced brackets: '[' is never closed"
        if "->" not in text and "," in text:
            return index, "a formula with several operands needs '->' and an output"
        return index, "unexpected end of expression"
    ch = text[index]
    ends_tensor = text.startswith("->", index) or ch in ",["
    if depth_paren > 0 and ends_tensor:
        return text.rfind("(", 0, index), "unbalanced parentheses: '(' is never closed"
    if depth_bracket > 0 and ends_tensor:
        return text.rfind("[", 0, index), "unbalanced brackets: '[' is never closed"
    if depth_bracket > 0 and ch == "(":
        return index, "a zip holds families only, like [*a *b]"
    if ch == ")" and depth_paren > 0 and text[:index].rstrip().endswith("("):
        return index - 1, "a group needs at least one axis: '()' is empty"
    if ch == "(" and depth_paren > 0:
        return index, "groups cannot be nested: '(' inside a group"
    if ch == ")" and depth_paren <= 0:
        return index, "unbalanced parentheses: ')' has no matching '('"
    if ch == "]" and depth_bracket <= 0:
        return index, "unbalanced brackets: ']' has no matching '['"
    if ch == "." and text[index : index + 3] != "...":
        return index, "an ellipsis is written '...'"
    if ch == "*" and depth_paren > 0:
        return index, "a family cannot appear inside a group; use a zip [*a *b]"
    if text.startswith("//", index):
        return index, "a tensor has at most one '//'; write '// (sp, tp)' for several dimensions"
    if ch == "/":
        return index, "an axis is split over one mesh dimension; write a compound one as 'sp-tp'"
    if ch == "-" and text[index : index + 2] != "->":
        return index, "unexpected '-' (compound mesh dimensions are written 'dp-sp', arrows '->')"
    if ch == ">" or text[index : index + 2] == "->":
        return index, "unexpected '->' (a formula has exactly one arrow)"
    return index, f"unexpected character {ch!r}"


def parse_text(text: str):
    """Parse ``text`` into ``(inputs, output)`` or raise an ``invalid`` error."""
    if not isinstance(text, str):
        raise ValueError(f"Invalid einshard expression: expected a string, got {type(text).__name__}")
    try:
        return _PARSER(text).formula()
    except ParseError as err:
        # a failed expectation reports the offending offset; a failed 'end' the one after it
        index = err.position if err.error else max(0, (err.position or 1) - 1)
        position, reason = _explain_syntax_error(text, index)
        raise invalid(text, position, reason) from None
