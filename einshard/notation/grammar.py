"""The grammar of the notation (a linear-time recursive-descent parser) and syntax-error reporting.

The grammar, with ``ws`` (spaces, tabs, newlines) allowed between tokens::

    formula    := inputs '->' tensor | tensor
    inputs     := tensor (',' tensor)*
    tensor     := item* partial? annotation?
    item       := '...' | '(' (family | axis)+ ')' | '[' family+ ']' | family | axis
    axis       := NAME ('/' MESHDIM)?        # no whitespace after '/'
    family     := '*' NAME
    partial    := '//' (MESHDIM | '(' MESHDIM (',' MESHDIM)* ')')
    annotation := '[' annitem (',' annitem)* ']'
    annitem    := NAME ('=' MESHDIM (':' NAME)?)?
    NAME       := (letter | '_') (letter | digit | '_')*
    MESHDIM    := NAME ('-' NAME)*

Each rule looks at most a few characters ahead and never re-reads input, so
parsing (and rejecting) takes time linear in the length of the text. On a
syntax error the parser reports the furthest offset at which an expected
token was missing; :func:`_explain_syntax_error` turns it into a reason.
"""

from __future__ import annotations

from typing import NoReturn

from ..errors import EinshardError
from .objects import Annotation, Axis, EllipsisItem, Family, Group, TensorSpec, Zip

_WS = " \t\n\r"


class _Fail(Exception):
    """Internal: the current alternative does not match."""


class _Parser:
    """Recursive descent over ``text``; ``far`` is the furthest failed offset."""

    def __init__(self, text: str):
        self.text = text
        self.n = len(text)
        self.far = 0

    def fail(self, pos: int) -> NoReturn:
        if pos > self.far:
            self.far = pos
        raise _Fail

    def ws(self, i: int) -> int:
        text, n = self.text, self.n
        while i < n and text[i] in _WS:
            i += 1
        return i

    def lit(self, i: int, token: str) -> int:
        if self.text.startswith(token, i):
            return i + len(token)
        self.fail(i)

    def name(self, i: int) -> tuple[str, int]:
        text, n = self.text, self.n
        if i < n and (text[i].isalpha() or text[i] == "_"):
            j = i + 1
            while j < n and (text[j].isalnum() or text[j] == "_"):
                j += 1
            if j > self.far:
                self.far = j
            return text[i:j], j
        self.fail(i)

    def meshdim(self, i: int) -> tuple[str, int]:
        _, j = self.name(i)
        while j < self.n and self.text[j] == "-":
            try:
                _, j = self.name(j + 1)
            except _Fail:
                break
        return self.text[i:j], j

    def axis(self, i: int) -> tuple[Axis, int]:
        name, j = self.name(i)
        k = self.ws(j)
        if k < self.n and self.text[k] == "/":
            if k + 1 < self.n and self.text[k + 1] == "/":
                self.far = max(self.far, k + 1)
                return Axis(name, None, i), j  # '//' starts the partial spec
            after = self.ws(k + 1)
            if after > k + 1 and after < self.n and (self.text[after].isalpha() or self.text[after] == "_"):
                raise _Unrecoverable(k + 1, "no space is allowed after '/': write 'a/sp'")
            try:
                mesh, m = self.meshdim(k + 1)
                return Axis(name, mesh, i), m
            except _Fail:
                pass
        elif k > self.far:
            self.far = k
        return Axis(name, None, i), j

    def some(self, i: int, opener: str, closer: str, element):
        """``opener (ws element)+ ws closer``; returns the elements and the offset after ``closer``."""
        j = self.lit(i, opener)
        elements = []
        while True:
            k = self.ws(j)
            try:
                element_value, j = element(k)
            except _Fail:
                break
            elements.append(element_value)
        if not elements:
            self.fail(j)
        return tuple(elements), self.lit(self.ws(j), closer)

    def member(self, i: int):
        """A group member: an axis, or a family whose axes join the group."""
        return self.family(i) if self.text.startswith("*", i) else self.axis(i)

    def family(self, i: int) -> tuple[Family, int]:
        j = self.lit(i, "*")
        name, j = self.name(j)
        return Family(name, i), j

    def item(self, i: int):
        i = self.ws(i)
        text = self.text
        ch = text[i] if i < self.n else ""
        if ch == ".":
            return EllipsisItem(i), self.lit(i, "...")
        if ch == "(":
            axes, j = self.some(i, "(", ")", self.member)
            return Group(axes, i), j
        if ch == "[":
            families, j = self.some(i, "[", "]", self.family)
            return Zip(families, i), j
        if ch == "*":
            return self.family(i)
        return self.axis(i)

    def partial(self, i: int) -> tuple[tuple[str, ...], int]:
        j = self.ws(self.lit(self.ws(i), "//"))
        if j < self.n and self.text[j] == "(":
            dim, k = self.meshdim(self.ws(j + 1))
            dims = [dim]
            while True:
                try:
                    m = self.lit(self.ws(k), ",")
                    dim, k = self.meshdim(self.ws(m))
                except _Fail:
                    break
                dims.append(dim)
            return tuple(dims), self.lit(self.ws(k), ")")
        dim, k = self.meshdim(j)
        return (dim,), k

    def annvalue(self, i: int) -> tuple[str, int]:
        """``MESHDIM (':' NAME)?``: a group and an optional suffix (``dp:async``)."""
        _, j = self.meshdim(i)
        if j < self.n and self.text[j] == ":":
            _, j = self.name(j + 1)
        return self.text[i:j], j

    def annitem(self, i: int) -> tuple[Annotation, int]:
        key, j = self.name(i)
        try:
            value, k = self.annvalue(self.ws(self.lit(self.ws(j), "=")))
            return Annotation(key, value), k
        except _Fail:
            return Annotation(key, None), j

    def annotation(self, i: int) -> tuple[tuple[Annotation, ...], int]:
        j = self.ws(self.lit(self.ws(i), "["))
        first, k = self.annitem(j)
        items = [first]
        while True:
            try:
                item, k = self.annitem(self.ws(self.lit(self.ws(k), ",")))
            except _Fail:
                break
            items.append(item)
        return tuple(items), self.lit(self.ws(k), "]")

    def optional(self, rule, i: int):
        try:
            return rule(i)
        except _Fail:
            return None, i

    def tensor(self, i: int) -> tuple[TensorSpec, int]:
        pos = self.ws(i)
        items = []
        j = pos
        while True:
            try:
                item, j = self.item(j)
            except _Fail:
                break
            items.append(item)
        partial, j = self.optional(self.partial, j)
        annotations, j = self.optional(self.annotation, j)
        return TensorSpec(tuple(items), partial or (), annotations or (), pos), j

    def end(self, i: int) -> None:
        if i < self.n:
            self.fail(i)

    def formula(self):
        first, i = self.tensor(0)
        inputs = [first]
        while True:
            try:
                tensor, j = self.tensor(self.lit(self.ws(i), ","))
            except _Fail:
                break
            inputs.append(tensor)
            i = j
        try:
            output, j = self.tensor(self.lit(self.ws(i), "->"))
            self.end(self.ws(j))
            return tuple(inputs), output
        except _Fail:
            pass
        if len(inputs) > 1:
            self.fail(i)
        self.end(self.ws(i))
        return (first,), None


class _Unrecoverable(Exception):
    """Internal: a syntax error with its own offset and reason (no backtracking past it)."""

    def __init__(self, position: int, reason: str):
        super().__init__(reason)
        self.position = position
        self.reason = reason


def parse_axis(text: str) -> Axis | None:
    """``text`` as one axis (``'h'`` or ``'h/sp'``, surrounding spaces allowed), or ``None``."""
    parser = _Parser(text.strip())
    try:
        axis, j = parser.axis(0)
        parser.end(j)
    except (_Fail, _Unrecoverable):
        return None
    return Axis(axis.name, axis.mesh)


def invalid(expression: str, position: int, reason: str) -> EinshardError:
    """An ``EinshardError`` with the expression and a caret under ``position``."""
    position = max(0, min(position, len(expression)))
    caret = " " * position + "^"
    return EinshardError.named(f"Invalid einshard expression: {reason}\n    {expression}\n    {caret}", expression)


def _explain_syntax_error(text: str, index: int) -> tuple[int, str]:
    """A readable reason for a syntax error detected at ``index``."""
    while index < len(text) and text[index] in _WS:  # only the whitespace the grammar skips
        index += 1
    before = text[:index].rstrip()
    if before.endswith("//"):
        return index, "'//' must be followed by a mesh dimension or '(dim, ...)'"
    if before.endswith("/"):
        return index, "'/' must be followed by a mesh dimension name"
    depth_paren = 0
    depth_bracket = 0
    for ch in text[:index]:
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
        raise EinshardError(f"Invalid einshard expression: expected a string, got {type(text).__name__}")
    parser = _Parser(text)
    try:
        return parser.formula()
    except _Unrecoverable as err:
        raise invalid(text, err.position, err.reason) from None
    except _Fail:
        position, reason = _explain_syntax_error(text, parser.far)
        raise invalid(text, position, reason) from None
