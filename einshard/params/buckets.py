"""Bucketed asynchronous gradient reduction, started during backward.

:class:`GradBucketer` is the engine behind ``grad=G:async`` and the native
per-parameter hooks. Parameters are grouped by the mesh groups their gradients
are summed over, in reverse registration order (the order backward usually
produces their gradients, as in DDP), into buckets of about ``bucket_bytes``.
A ``register_post_accumulate_grad_hook`` on every parameter marks it ready;
when a bucket's last gradient arrives its gradients are flattened into one
buffer and a SUM ``all_reduce`` over the union of its groups starts at once
(``async_op=True``, counted by ``es.count_communication``) while backward goes on. :meth:`GradBucketer.wait` waits
for what is in flight and writes the sums back into ``.grad``.

Repeated ``backward()`` without zeroing is exact: when a parameter already
holds a gradient, only the new contribution is reduced (it is held back from
accumulation and added once summed).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .. import collectives as C
from ..mesh import Mesh, resolve_mesh

__all__ = ["GradBucketer", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 25 * 2**20


class _Bucket:
    __slots__ = ("params", "group", "ready", "held", "had_grad")

    def __init__(self, params, group):
        self.params = params  # in the order gradients are expected
        self.group = group
        self.ready = 0
        self.held = {}  # param index -> contribution held back from an existing .grad
        self.had_grad = set()


class GradBucketer:
    """Sum parameters' gradients over mesh groups, bucketed, overlapping backward.

    ``params_and_groups``: ``(parameter, groups)`` pairs, ``groups`` a tuple of
    mesh-dimension names (atomic or compound ``dp-sp``); each gradient is summed
    (not averaged) over every group, as one all-reduce over their union.
    ``mesh``: an ``es.Mesh`` or a ``DeviceMesh`` with those names. Every rank
    must run backward over the same parameters; call :meth:`wait` before
    reading the gradients (an optimizer step, the next forward).

    >>> import torch, einshard as es
    >>> mesh = es.Mesh.virtual((1,), ("dp",))  # doctest: +SKIP
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> b = GradBucketer([(w, ("dp",))], mesh)  # doctest: +SKIP
    >>> (w * 2).sum().backward(); b.wait().remove()  # doctest: +SKIP
    """

    def __init__(self, params_and_groups: Iterable, mesh, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"GradBucketer: bucket_bytes must be a positive int, got {bucket_bytes!r}")
        mesh = mesh if isinstance(mesh, Mesh) else resolve_mesh(mesh)
        by_key: dict = {}
        seen: set = set()
        for p, groups in params_and_groups:
            if not isinstance(p, torch.nn.Parameter):
                raise TypeError(f"GradBucketer: expected a torch.nn.Parameter, got {type(p).__name__}")
            if id(p) in seen:
                continue
            seen.add(id(p))
            dims = _union_dims(mesh, tuple(groups))
            if dims and not p.requires_grad:
                raise ValueError(f"GradBucketer: a parameter of shape {tuple(p.shape)} does not require gradients")
            if mesh.size(dims) > 1:
                by_key.setdefault((dims, p.dtype, p.device), []).append(p)
        self.mesh = mesh
        self.bucket_bytes = bucket_bytes
        self.buckets: list[_Bucket] = []
        for (dims, _dtype, _device), params in by_key.items():
            group = mesh.group(dims)
            current, size = [], 0
            for p in reversed(params):  # backward produces the last-registered gradients first
                nbytes = p.numel() * p.element_size()
                if current and size + nbytes > bucket_bytes:
                    self.buckets.append(_Bucket(current, group))
                    current, size = [], 0
                current.append(p)
                size += nbytes
            if current:
                self.buckets.append(_Bucket(current, group))
        self._works: list = []  # (work, flat buffer, bucket, had_grad, held)
        self._handles = []
        try:
            for bucket in self.buckets:
                for i, p in enumerate(bucket.params):
                    self._handles.append(p.register_hook(self._pre_hook(bucket, i, p)))
                    self._handles.append(p.register_post_accumulate_grad_hook(self._post_hook(bucket)))
        except BaseException:
            self.remove()
            raise

    # -- hooks ------------------------------------------------------------
    def _pre_hook(self, bucket: _Bucket, i: int, p):
        def hook(grad):
            if p.grad is None:
                return grad
            # accumulation on an existing gradient: reduce only this contribution
            bucket.held[i] = grad
            bucket.had_grad.add(i)
            return torch.zeros_like(grad)

        return hook

    def _post_hook(self, bucket: _Bucket):
        def hook(_p):
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._launch(bucket)

        return hook

    def _launch(self, bucket: _Bucket) -> None:
        parts = []
        for i, p in enumerate(bucket.params):
            g = bucket.held.get(i)
            if g is None:
                g = p.grad
            parts.append(torch.zeros(p.shape, dtype=p.dtype, device=p.device) if g is None else g)
        flat, work = C.all_reduce(torch.cat([g.reshape(-1) for g in parts]), bucket.group, async_op=True)
        self._works.append((work, flat, bucket, frozenset(bucket.had_grad)))
        bucket.ready = 0
        bucket.held = {}
        bucket.had_grad = set()

    # -- public -----------------------------------------------------------
    @property
    def pending(self) -> int:
        """The number of all-reduces started and not yet waited for."""
        return len(self._works)

    def flush(self) -> "GradBucketer":
        """Start the buckets that got some but not all of their gradients (unused parameters)."""
        for bucket in self.buckets:
            if bucket.ready:
                self._launch(bucket)
        return self

    def wait(self) -> "GradBucketer":
        """Wait for every started all-reduce and write the sums into ``.grad``; returns ``self``."""
        self.flush()
        while self._works:
            work, flat, bucket, had_grad = self._works[0]
            work.wait()
            self._works.pop(0)
            offset = 0
            with torch.no_grad():
                for i, p in enumerate(bucket.params):
                    n = p.numel()
                    summed = flat[offset : offset + n].view(p.shape)
                    offset += n
                    if p.grad is None:
                        p.grad = summed.clone()
                    elif i in had_grad:
                        p.grad.add_(summed)
                    else:
                        p.grad.copy_(summed)
        return self

    def remove(self) -> "GradBucketer":
        """Wait, then detach every hook (idempotent); returns ``self``."""
        self.wait()
        for h in self._handles:
            h.remove()
        self._handles = []
        return self


def _union_dims(mesh, groups: tuple) -> tuple:
    """The atomic mesh dimensions of ``groups`` together, in mesh order (ValueError if unknown)."""
    dims: set = set()
    for g in groups:
        if not isinstance(g, str):
            raise TypeError(f"GradBucketer: a group must be a str, got {type(g).__name__}")
        for c in g.split("-"):
            if c not in mesh.names:
                raise ValueError(f"GradBucketer: mesh dimension {c!r} (in {g!r}) is not in the mesh; it has {list(mesh.names)}")
        dims.update(g.split("-"))
    return tuple(d for d in mesh.names if d in dims)
