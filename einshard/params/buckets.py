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
accumulated; the first backward after it (or ``wait()``) sums them all, once;
``zero_grad()`` (``.grad`` set to ``None``) drops them, as in one process.
``torch.autograd.grad`` never accumulates: the gradient it returns for a
hooked parameter is summed at once, synchronously (inside ``no_sync`` too: the
held contributions stay held). What a backward contributes is its own until it
ends (:mod:`einshard.comm.backwards`): a backward that raised leaves nothing behind
(the sums it started are waited for and dropped). A parameter frozen when the
bucketer is made gets its hooks when it requires gradients again (at the end
of a backward, or in ``wait()``), and what it accumulated meanwhile is summed.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable

import torch

from ..comm import collectives as C
from ..comm.backwards import PerBackward
from ..comm.grad_sums import DEFAULT_BUCKET_BYTES, accumulates, flatten, launch, write
from ..comm.mesh import Mesh, resolve_mesh
from ..errors import EinshardError

__all__ = ["GradBucketer", "DEFAULT_BUCKET_BYTES", "hooked_by"]

# id(Parameter) -> (weak references to it and to the GradBucketer whose hooks sum its gradient); weak, so a
# model dropped with its hooks still registered is freed
_HOOKED: dict = {}


def hooked_by(p) -> GradBucketer | None:
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
    __slots__ = ("params", "nodes", "group", "held", "in_grad")

    def __init__(self, params, group):
        self.params = params  # in the order gradients are expected
        with torch.enable_grad():  # their AccumulateGrad nodes (kept: the same node in every graph)
            self.nodes = [p.view_as(p).grad_fn.next_functions[0][0] for p in params]
        self.group = group
        self.held: dict = {}  # index -> contributions of finished backwards not yet summed, kept out of .grad
        # index -> the backward (_Pass) that accumulated into it, or None: .grad is exactly contributions
        # not yet summed (one fact about .grad, whichever backward, outer or reentrant, is running)
        self.in_grad: dict = {}

    def window(self) -> bool:
        """Whether some contribution waits to be summed."""
        return bool(self.held or self.in_grad)


class _Pass:
    """What one running backward did to the buckets: which parameters' gradients were accumulated
    (``ready``), its contributions held out of ``.grad`` and not yet summed (``held``, by ``(bucket,
    index)``). Merged into the buckets when the backward ends; dropped if it raised, with the ``in_grad``
    marks it made and the sums it started (the bucketer's works it owns)."""

    __slots__ = ("ready", "held", "buckets")

    def __init__(self):
        self.ready: dict = {}  # bucket -> indices
        self.held: dict = {}
        self.buckets: list = []  # the buckets whose in_grad it marked


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
                    "(an earlier es.params.register_native_grad_reduction_hooks_ or GradBucketer); remove them first "
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
        # (work, flat buffer, bucket, per-parameter write mode, the running backward that started it or None),
        # in the order started (a later sum may overwrite .grad: "copy")
        self._works: list = []
        self._handles: list = []
        self._no_sync = 0
        self._backwards = PerBackward(_Pass, self._end_of_backward, self._drop)
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
        chunks: list = []
        current: list = []
        size = 0
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
            now = self._backwards.current()
            key = (bucket, i)
            _forget_if_dropped(bucket, i, p)
            if self.synchronous and not self._no_sync:
                held = _sum(bucket.held.pop(i, None), now.held.pop(key, None))
                return C.all_reduce(grad if held is None else held + grad, bucket.group)
            if (not self.synchronous and p.grad is None and i not in bucket.in_grad and i not in bucket.held
                    and key not in now.held):
                bucket.in_grad[i] = now  # the first contribution: accumulated as it is, summed in place later
                now.buckets.append(bucket)
                return grad
            now.held[key] = _sum(now.held.get(key), grad)
            return torch.zeros_like(grad)  # earlier (summed) contents of .grad stay apart

        return hook

    def _post_hook(self, bucket: _Bucket, i: int):
        def hook(_p):
            now = self._backwards.current()
            ready = now.ready.setdefault(bucket, set())
            ready.add(i)
            if len(ready) == len(bucket.params) and not self._no_sync:
                self._launch(bucket, now)

        return hook

    def _end_of_backward(self, now: _Pass) -> None:
        """The backward ``now`` ended: its contributions join the buckets' windows, its sums the started ones."""
        for bucket in now.buckets:
            for i, owner in bucket.in_grad.items():
                if owner is now:
                    bucket.in_grad[i] = None
        for (bucket, i), grad in now.held.items():
            bucket.held[i] = _sum(bucket.held.get(i), grad)
        self._works = [w[:4] + (None,) if w[4] is now else w for w in self._works]
        self._adopt_unfrozen()
        if not self._no_sync:
            self.flush()

    def _drop(self, now: _Pass) -> None:
        """A backward that raised: its contributions are dropped (what it accumulated into ``.grad`` is no
        longer taken for contributions), the sums it started waited for and dropped."""
        for bucket in now.buckets:
            bucket.in_grad = {i: owner for i, owner in bucket.in_grad.items() if owner is not now}
        for work, *_ in (w for w in self._works if w[4] is now):
            work.wait()
        self._works = [w for w in self._works if w[4] is not now]

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
                        bucket.in_grad[i] = None

    def _launch(self, bucket: _Bucket, now: _Pass | None = None) -> None:
        """Start the sum of the bucket's contributions, of finished backwards and of the running one
        (``now``, which keeps the sum started; synchronous: add it to ``.grad`` now)."""
        parts: list[torch.Tensor] = []
        modes: list[str | None] = []
        for i, p in enumerate(bucket.params):
            key = (bucket, i)
            _forget_if_dropped(bucket, i, p)
            held = _sum(bucket.held.get(i), None if now is None else now.held.pop(key, None))
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
        if now is not None:
            now.ready.pop(bucket, None)
        bucket.held = {}
        bucket.in_grad = {}
        if self.synchronous:
            write(C.all_reduce(flatten(parts), bucket.group), bucket.params, modes)
            return
        flat, work = launch(parts, bucket.group)
        self._works.append((work, flat, bucket, tuple(modes), now))

    # -- public -----------------------------------------------------------
    @property
    def pending(self) -> int:
        """The number of all-reduces started and not yet waited for."""
        self._backwards.purge()
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

    def flush(self) -> GradBucketer:
        """Start the sums of every bucket holding contributions not yet summed (unused parameters, ``no_sync``)."""
        for bucket in self.buckets:
            if bucket.window():
                self._launch(bucket)
        return self

    def wait(self) -> GradBucketer:
        """Sum what is not summed yet, wait for every started all-reduce and write the sums into ``.grad``
        (what a backward that raised started is waited for and dropped)."""
        self._backwards.purge()
        self._adopt_unfrozen()
        self.flush()
        while self._works:
            work, flat, bucket, modes, _ = self._works[0]
            work.wait()
            self._works.pop(0)
            write(flat, bucket.params, modes)
        return self

    def remove(self) -> GradBucketer:
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


def _forget_if_dropped(bucket: _Bucket, i: int, p) -> None:
    """``p.grad is None`` although finished backwards left contributions to sum (they always leave a
    ``.grad``): the user dropped the gradient (``zero_grad()``), as in one process they are gone."""
    if p.grad is None:
        bucket.held.pop(i, None)
        if i in bucket.in_grad and bucket.in_grad[i] is None:
            del bucket.in_grad[i]


def _sum(a, b):
    """``a + b``, either may be ``None`` (nothing)."""
    return b if a is None else a if b is None else a + b




def _union_dims(mesh, groups: tuple) -> tuple:
    """The atomic mesh dimensions of ``groups`` together, in mesh order (ValueError if unknown)."""
    dims: set = set()
    for g in groups:
        if not isinstance(g, str):
            raise TypeError(f"GradBucketer: a group must be a str, got {type(g).__name__}")
        for c in g.split("-"):
            if c not in mesh.names:
                raise EinshardError(f"GradBucketer: mesh dimension {c!r} (in {g!r}) "
                                    f"is not in the mesh; it has {list(mesh.names)}")
        dims.update(g.split("-"))
    return tuple(d for d in mesh.names if d in dims)
