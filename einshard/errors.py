"""``EinshardError``: the one error class of invalid calls, and how it names the expression.

Every invalid call (a bad formula, operand, argument or layout) raises
:class:`EinshardError`, a ``ValueError``, before any collective starts. A
check deep inside the library states only what is wrong; the function that
knows the expression (a public op, or the module entry that receives the
formula) attaches it once, as ``'<expression>': <reason>``, with
:meth:`EinshardError.within` or the :func:`naming` decorator.
"""

from __future__ import annotations

import functools

__all__ = ["EinshardError", "naming"]


class EinshardError(ValueError):
    """An invalid einshard call; ``expression`` is the formula or spec its message names.

    An error raised without ``expression`` gets it from the entry point that
    knows it (:meth:`within`); one raised with it is complete as it is.

    >>> import einshard as es
    >>> try:
    ...     es.einshard("a b -> c", __import__("torch").ones(2, 2))
    ... except es.EinshardError as err:
    ...     print(err.expression, isinstance(err, ValueError))
    a b -> c True
    """

    expression: str | None = None

    def __init__(self, message: str = "", expression: str | None = None):
        super().__init__(message)
        if expression is not None:
            self.expression = expression

    def within(self, expression: str, op: str | None = None) -> "EinshardError":
        """This error, its message prefixed by ``'expression': `` (``op: 'expression': ``) unless it names one.

        >>> str(EinshardError("axis 'h' is empty").within("b h", "einhalo"))
        "einhalo: 'b h': axis 'h' is empty"
        """
        if self.expression is None:
            self.expression = expression
            prefix = f"{expression!r}: " if op is None else f"{op}: {expression!r}: "
            self.args = (prefix + (self.args[0] if self.args else ""),)
        return self


def naming(expression_arg: int = 0):
    """Decorate a function whose positional argument ``expression_arg`` is the expression (or a parsed
    ``Formula``): the :class:`EinshardError` s it raises name it (see :meth:`EinshardError.within`).

    >>> @naming()
    ... def check(text):
    ...     raise EinshardError("no such axis")
    >>> try:
    ...     check("a b")
    ... except EinshardError as err:
    ...     print(err)
    'a b': no such axis
    """

    def wrap(fn):
        @functools.wraps(fn)
        def named(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except EinshardError as err:
                expression = getattr(args[expression_arg], "text", args[expression_arg])
                if isinstance(expression, str):
                    err.within(expression)
                raise

        return named

    return wrap
