"""Attention over a sequence split across ranks: ring attention, Ulysses, the zigzag layout
(:mod:`einshard.attention.sequence_parallel`), and the per-block kernels (:mod:`einshard.attention.kernels`)."""

from .sequence_parallel import (
    from_zigzag,
    ring_attention,
    to_zigzag,
    ulysses_attention,
    zigzag_indices,
    zigzag_shapes,
)

__all__ = ["ring_attention", "ulysses_attention", "zigzag_shapes", "zigzag_indices", "to_zigzag", "from_zigzag"]
