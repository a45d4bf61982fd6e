"""The operations: einshard, einfft, einhalo/einwindow/einconv, einroll."""

from .conv import einconv
from .einshard import einshard
from .fft import einfft
from .halo import einhalo
from .roll import einroll
from .window import einwindow

__all__ = ["einshard", "einfft", "einhalo", "einwindow", "einconv", "einroll"]
