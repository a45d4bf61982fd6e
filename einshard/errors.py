"""``EinshardError``: the error of every invalid call, and how it comes to name the expression.

A check deep inside the library states only what is wrong; the function that
knows the expression (a public op, or the entry of a module that receives
the formula: :func:`naming`) prefixes it once, as ``'<expression>': <reason>``.
"""

from __future__ import annotations

import functools

__all__ = ["EinshardError", "SizeMismatchError", "naming"]


class EinshardError(ValueError):
    """An invalid einshard call (formula, operand, argument or layout), raised before any collective.

    ``expression``: the formula or spec the message names (``None`` until an entry point attaches it).

    >>> import torch, einshard as es
    >>> try:
    ...     es.einshard("a b -> a", torch.ones(2, 3), torch.ones(3))
    ... except es.EinshardError as err:
    ...     print(err)
    'a b -> a': the formula has 1 operand(s) but 2 tensor(s) were given
    """

    expression: str | None = None  # no __init__ of its own: torch.compile traces raising it

    @classmethod
    def named(cls, message: str, expression: str) -> EinshardError:
        """An error whose ``message`` names ``expression`` already (:meth:`within` adds nothing)."""
        err = cls(message)
        err.expression = expression
        return err

    def within(self, expression: str, op: str | None = None) -> EinshardError:
        """This error as ``'expression': message`` (``op: 'expression': message``) unless it names one already.

        >>> str(EinshardError("axis 'h' is empty").within("b h", "einhalo"))
        "einhalo: 'b h': axis 'h' is empty"
        """
        if self.expression is None:
            self.expression = expression
            prefix = f"{expression!r}: " if op is None else f"{op}: {expression!r}: "
            self.args = (prefix + (self.args[0] if self.args else ""),)
        return self


class SizeMismatchError(EinshardError, RuntimeError):
    """An axis whose sizes disagree between operands: an :class:`EinshardError` (so a ``ValueError``) and,
    as ``torch.einsum``'s own size error, a ``RuntimeError``.

    >>> import torch, einshard as es
    >>> try:
    ...     es.einshard("b c, c -> b", torch.ones(2, 4), torch.ones(3))
    ... except RuntimeError as err:
    ...     print(type(err).__name__, isinstance(err, ValueError))
    SizeMismatchError True
    """


def naming(expression_arg: int = 0):
    """Decorator: the :class:`EinshardError` s of the function name its argument ``expression_arg``
    (a formula string or a parsed ``Formula``), see :meth:`EinshardError.within`."""

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
