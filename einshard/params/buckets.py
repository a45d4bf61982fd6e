"""Gradient sums over mesh groups, during backward: the one engine behind the native hooks.

:class:`GradBucketer` sums parameters' gradients over the mesh groups of their
duties. Parameters are grouped by those groups, in reverse registration order
(the order backward usually produces their gradients, as in DDP), into buckets
of about ``bucket_bytes``. A tensor hook on every parameter sees each incoming
contribution before it is accumulated; a ``register_post_accumulate_grad_hook``
marks the parameter ready. When every parameter of a bucket is ready its
contributions are flattened into one buffer and a SUM ``all_reduce`` over the
union of its groups starts at once (``async_op=True``, counted by
``es.count_communication``) while backward goes on. At the end of every
backward the buckets that got only some of their gradients (parameters unused
or frozen in this backward) start too. :meth:`GradBucketer.wait` waits for
what is in flight and writes the sums into ``.grad``. With ``synchronous=True``
each contribution is summed in its hook instead, before accumulation.

What is summed is exactly what arrived since the last sum: earlier (summed)
contents of ``.grad`` are held apart, so repeated ``backward()`` without
zeroing (micro-batches) is exact, and a parameter that got no gradient keeps
``.grad is None``. Inside :meth:`GradBucketer.no_sync` contributions are only
accumulated; the first backward after it (or ``wait()``) sums them all, once.
``torch.autograd.grad`` never accumulates: the gradient it returns for a
hooked parameter is summed at once, synchronously. A parameter frozen when the
bucketer is made gets its hooks when it requires gradients again (at the end
of a backward, or in ``wait()``), and what it accumulated meanwhile is summed.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable

import torch

from .. import _torch_compat
from .. import collectives as C
from ..errors import EinshardError
from ..grad_sums import DEFAULT_BUCKET_BYTES, accumulates, flatten, launch, write
from ..mesh import Mesh, resolve_mesh

__all__ = ["GradBucketer", "DEFAULT_BUCKET_BYTES", "hooked_by"]

# id(Parameter) -> (weak references to it and to the GradBucketer whose hooks sum its gradient); weak, so a
# model dropped with its hooks still registered is freed
_HOOKED: dict = {}
_engine = _torch_compat.autograd_engine
_graph_task = _torch_compat.current_graph_task_id


def hooked_by(p) -> "GradBucketer | None":
    """The live :class:`GradBucketer` that sums ``p``'s gradient, or ``None``.

    >>> hooked_by(torch.nn.Parameter(torch.ones(2))) is None
    True
    """
    entry = _HOOKED.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    owner = entry[1]()
    return None if owner is None or owner._removed else owner


def _hook_owner(p, bucketer) -> None:
    key = id(p)
    _HOOKED[key] = (weakref.ref(p, lambda _r: _HOOKED.pop(key, None)), weakref.ref(bucketer))


def _release(p, bucketer) -> None:
    if hooked_by(p) is bucketer:
        del _HOOKED[id(p)]


class _Bucket:
    __slots__ = ("params", "nodes", "group", "ready", "held", "in_grad")

    def __init__(self, params, group):
        self.params = params  # in the order gradients are expected
        with torch.enable_grad():  # their AccumulateGrad nodes (kept: the same node in every graph)
            self.nodes = [p.view_as(p).grad_fn.next_functions[0][0] for p in params]
        self.group = group
        self.ready: set = set()  # indices whose gradient was accumulated in the running backward
        self.held: dict = {}  # index -> contributions not yet summed, kept out of .grad
        self.in_grad: set = set()  # indices whose .grad is exactly their contributions not yet summed

    def window(self) -> bool:
        """Whether some contribution waits to be summed."""
        return bool(self.held or self.in_grad)


class GradBucketer:
    """Sum parameters' gradients over mesh groups, bucketed, overlapping backward.

    ``params_and_groups``: ``(parameter, groups)`` pairs, ``groups`` a tuple of
    mesh-dimension names (atomic or compound ``dp-sp``); each gradient is summed
    (not averaged) over every group, as one all-reduce over their union.
    ``mesh``: an ``es.Mesh`` or a ``DeviceMesh`` with those names.
    ``synchronous=True``: each contribution is summed in its hook, before it is
    accumulated (no buckets). Every rank must run backward over the same
    parameters; call :meth:`wait` before reading the gradients (an optimizer
    step). A parameter already summed by another live bucketer is refused.

    >>> import torch, einshard as es
    >>> mesh = es.Mesh.virtual((1,), ("dp",))  # doctest: +SKIP
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> b = GradBucketer([(w, ("dp",))], mesh)  # doctest: +SKIP
    >>> (w * 2).sum().backward(); b.wait().remove()  # doctest: +SKIP
    """

    def __init__(self, params_and_groups: Iterable, mesh, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
                 synchronous: bool = False):
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise EinshardError(f"GradBucketer: bucket_bytes must be a positive int, got {bucket_bytes!r}")
        mesh = mesh if isinstance(mesh, Mesh) else resolve_mesh(mesh)
        by_key: dict = {}
        frozen = []
        seen: set = set()
        for p, groups in params_and_groups:
            if not isinstance(p, torch.nn.Parameter):
                raise TypeError(f"GradBucketer: expected a torch.nn.Parameter, got {type(p).__name__}")
            if id(p) in seen:
                continue
            seen.add(id(p))
            dims = _union_dims(mesh, tuple(groups))
            if mesh.size(dims) <= 1:
                continue
            if hooked_by(p) is not None:
                raise EinshardError(
                    f"GradBucketer: a parameter of shape {tuple(p.shape)} already has gradient hooks that sum it "
                    "(an earlier es.register_native_grad_reduction_hooks_ or GradBucketer); remove them first "
                    "(handle.remove()), or its gradient would be summed twice"
                )
            if p.requires_grad:
                by_key.setdefault((dims, p.dtype, p.device), []).append(p)
            else:
                frozen.append((p, dims))
        self.mesh = mesh
        self.bucket_bytes = bucket_bytes
        self.synchronous = bool(synchronous)
        self.buckets: list[_Bucket] = []
        self._frozen = frozen  # (parameter, dims): hooked once it requires gradients
        self._works: list = []  # (work, flat buffer, bucket, per-parameter write mode)
        self._handles: list = []
        self._no_sync = 0
        self._armed = None  # the graph task whose end-of-backward callback is queued
        self._removed = False
        try:
            for (dims, _dtype, _device), params in by_key.items():
                self._add_buckets(dims, params)
            for p, _ in frozen:
                _hook_owner(p, self)
        except BaseException:
            self.remove()
            raise

    def _add_buckets(self, dims, params) -> list:
        group = self.mesh.group(dims)
        chunks, current, size = [], [], 0
        for p in reversed(params):  # backward produces the last-registered gradients first
            nbytes = p.numel() * p.element_size()
            if current and (self.synchronous or size + nbytes > self.bucket_bytes):
                chunks.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            chunks.append(current)
        added = []
        for chunk in chunks:
            bucket = _Bucket(chunk, group)
            self.buckets.append(bucket)
            added.append(bucket)
            for i, p in enumerate(chunk):
                _hook_owner(p, self)
                self._handles.append(p.register_hook(self._pre_hook(bucket, i, p)))
                if not self.synchronous:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._post_hook(bucket, i)))
        return added

    # -- hooks ------------------------------------------------------------
    def _pre_hook(self, bucket: _Bucket, i: int, p):
        node = bucket.nodes[i]

        def hook(grad):
            if not accumulates(node):  # torch.autograd.grad returns it: summed now, .grad untouched
                return C.all_reduce(grad, bucket.group)
            self._arm()
            if self.synchronous and not self._no_sync:
                held = bucket.held.pop(i, None)
                return C.all_reduce(grad if held is None else held + grad, bucket.group)
            if not self.synchronous and p.grad is None and i not in bucket.in_grad and i not in bucket.held:
                bucket.in_grad.add(i)  # the first contribution: accumulated as it is, summed in place later
                return grad
            held = bucket.held.get(i)
            bucket.held[i] = grad if held is None else held + grad
            return torch.zeros_like(grad)  # earlier (summed) contents of .grad stay apart

        return hook

    def _post_hook(self, bucket: _Bucket, i: int):
        def hook(_p):
            bucket.ready.add(i)
            if len(bucket.ready) == len(bucket.params) and not self._no_sync:
                self._launch(bucket)

        return hook

    def _arm(self) -> None:
        """Queue :meth:`_end_of_backward` once per backward (graph task)."""
        task = _graph_task()
        if self._armed != task:
            self._armed = task
            _engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._armed = None
        self._adopt_unfrozen()
        for bucket in self.buckets:
            bucket.ready.clear()
        if not self._no_sync:
            self.flush()

    def _adopt_unfrozen(self) -> None:
        """Hook the parameters frozen at construction that require gradients now; what their ``.grad``
        accumulated meanwhile (without hooks: not summed) is summed with the next flush."""
        thawed = [(p, dims) for p, dims in self._frozen if p.requires_grad]
        if not thawed:
            return
        self._frozen = [(p, dims) for p, dims in self._frozen if not p.requires_grad]
        by_key: dict = {}
        for p, dims in thawed:
            by_key.setdefault((dims, p.dtype, p.device), []).append(p)
        for (dims, _dtype, _device), params in by_key.items():
            for bucket in self._add_buckets(dims, list(reversed(params))):
                for i, p in enumerate(bucket.params):
                    if p.grad is None:
                        continue
                    if self.synchronous:
                        bucket.held[i] = p.grad.clone()
                        p.grad.zero_()
                    else:
                        bucket.in_grad.add(i)

    def _launch(self, bucket: _Bucket) -> None:
        """Start the sum of the bucket's contributions (synchronous: add it to ``.grad`` now)."""
        parts, modes = [], []
        for i, p in enumerate(bucket.params):
            held = bucket.held.get(i)
            own = p.grad if i in bucket.in_grad else None
            if own is not None:
                parts.append(own if held is None else own + held)
                modes.append("copy")
            elif held is not None:
                parts.append(held)
                modes.append("add")
            else:  # no contribution here (not used in this window): zeros, nothing written
                parts.append(torch.zeros(p.shape, dtype=p.dtype, device=p.device))
                modes.append(None)
        bucket.ready.clear()
        bucket.held = {}
        bucket.in_grad = set()
        if self.synchronous:
            write(C.all_reduce(flatten(parts), bucket.group), bucket.params, modes)
            return
        flat, work = launch(parts, bucket.group)
        self._works.append((work, flat, bucket, tuple(modes)))

    # -- public -----------------------------------------------------------
    @property
    def pending(self) -> int:
        """The number of all-reduces started and not yet waited for."""
        return len(self._works)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate without communicating (like DDP's ``no_sync()``): the first backward after the block,
        or :meth:`wait`, sums everything accumulated, once."""
        self._no_sync += 1
        try:
            yield self
        finally:
            self._no_sync -= 1

    def flush(self) -> "GradBucketer":
        """Start the sums of every bucket holding contributions not yet summed (unused parameters, ``no_sync``)."""
        for bucket in self.buckets:
            if bucket.window():
                self._launch(bucket)
        return self

    def wait(self) -> "GradBucketer":
        """Sum what is not summed yet, wait for every started all-reduce and write the sums into ``.grad``."""
        self._adopt_unfrozen()
        self.flush()
        while self._works:
            work, flat, bucket, modes = self._works[0]
            work.wait()
            self._works.pop(0)
            write(flat, bucket.params, modes)
        return self

    def remove(self) -> "GradBucketer":
        """Wait, then detach every hook (idempotent); returns ``self``."""
        if self._removed:
            return self
        self.wait()
        for h in self._handles:
            h.remove()
        self._handles = []
        for bucket in self.buckets:
            for p in bucket.params:
                _release(p, self)
        for p, _ in self._frozen:
            _release(p, self)
        self._removed = True
        return self


def _union_dims(mesh, groups: tuple) -> tuple:
    """The atomic mesh dimensions of ``groups`` together, in mesh order (ValueError if unknown)."""
    dims: set = set()
    for g in groups:
        if not isinstance(g, str):
            raise TypeError(f"GradBucketer: a group must be a str, got {type(g).__name__}")
        for c in g.split("-"):
            if c not in mesh.names:
                raise EinshardError(f"GradBucketer: mesh dimension {c!r} (in {g!r}) is not in the mesh; it has {list(mesh.names)}")
        dims.update(g.split("-"))
    return tuple(d for d in mesh.names if d in dims)
