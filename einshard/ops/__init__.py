"""The operations: einshard, einfft, einhalo/einwindow/einconv, einroll."""

from .einshard import einshard

__all__ = ["einshard"]
