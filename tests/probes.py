"""Probes for ordering tests: run a check at the moment backward reaches a point of the graph."""

from __future__ import annotations

import torch


class OnBackward(torch.autograd.Function):
    """``OnBackward.apply(x, probe)``: ``x`` unchanged; when backward reaches it, ``probe()`` runs.

    Put it at the start of a computation and ``probe`` sees the state of the
    last step of backward (what is still in flight there).
    """

    @staticmethod
    def forward(ctx, x, probe):
        ctx.probe = probe
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.probe()
        return grad, None
