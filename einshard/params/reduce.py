"""Gradient reduction outside ``shard_map``: explicit helpers, per-parameter hooks, and a DDP comm hook.

A concrete *native* duty over groups ``G1, G2, ...`` means: the gradient is a
SUM (no averaging) over each group in turn. The groups are disjoint from each
other and from the shards, so local shapes match and nothing is counted twice.
``ddp``, ``external``, ``vma`` and ``none`` duties are someone else's job.

- :func:`reduce_grad_` / :func:`reduce_module_grads_`: after backward, synchronously.
- :func:`install_sum_hooks` (the sums of ``es.params.register_native_grad_reduction_hooks_``, which
  :mod:`einshard.params.zero` completes with the gathers): during backward, through the one
  :class:`~einshard.params.buckets.GradBucketer`: ``synchronous`` and
  ``backend_default`` duties SUM each incoming contribution before it is
  accumulated; ``async`` duties are bucketed and their all-reduces start as soon
  as a bucket's gradients are accumulated, overlapping the rest of backward;
  :meth:`NativeGradReductionHandle.wait` waits for them, and
  :meth:`NativeGradReductionHandle.no_sync` accumulates micro-batches without
  communicating.
- :func:`register_grad_reduction_hook_`: a ``DistributedDataParallel`` comm hook that
  averages over ``ddp_group`` and SUMs the extra native/ddp groups of each parameter.

One mechanism sums a gradient: the helpers refuse a gradient that live hooks
sum, or that a ``shard_map(check_vma=True)`` body summed already.

Every all-reduce goes through :func:`einshard.comm.collectives.all_reduce`, so
``es.count_communication`` records it (calls and bytes, as ``backward`` inside backward).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..comm import collectives as C
from ..errors import EinshardError
from .buckets import DEFAULT_BUCKET_BYTES, GradBucketer, hooked_by
from .names import check_group_syntax, components, resolve_dims, resolve_group, runtime_mesh
from .state import ParameterState
from .store import get_parameter_state, iter_parameter_states
from .summed import duty_text, summed_by_body
from .validate import check_not_pending

__all__ = [
    "reduce_grad_",
    "reduce_module_grads_",
    "install_sum_hooks",
    "NativeGradReductionHandle",
    "register_grad_reduction_hook_",
]


def _native_groups(state: ParameterState) -> tuple[str, ...]:
    """The groups the reducers sum over: none for a stored parameter (``store=``), whose gather's backward
    sums its gradient (see :mod:`einshard.params.zero`)."""
    g = state.grad_comm
    return g.mesh_dims if g.backend == "native" and g.mode != "none" and state.store is None else ()


def _check_state(state, where: str) -> None:
    if not isinstance(state, ParameterState):
        raise TypeError(f"{where}: expected a ParameterState, got {type(state).__name__}")
    check_not_pending(state, where)


def _summed_elsewhere(p, state, where: str) -> None:
    """ValueError when another mechanism sums ``p``'s gradient over its native groups already."""
    if not _native_groups(state):
        return
    if summed_by_body(p):
        raise EinshardError(
            f"{where}: this gradient was summed by the es.shard_map body that used the parameter (check_vma=True "
            f"sums it over the dimensions it is replicated over); summing it over {state.grad_comm.mesh_dims!r} "
            "again would count it twice. Gradients computed inside shard_map need no reduction; to mix styles, "
            "start each step from .grad = None (zero_grad(set_to_none=True))"
        )
    if hooked_by(p) is not None:
        raise EinshardError(
            f"{where}: the parameter's duty {duty_text(state.grad_comm)!r} is summed by live gradient hooks "
            "(es.params.register_native_grad_reduction_hooks_); reducing it here too would count it twice. Use one: "
            "handle.wait(), or remove the hooks (handle.remove())"
        )


def _sum_(p, groups) -> None:
    """Replace ``p.grad`` by its SUM over each resolved ``(group, size)`` in turn."""
    for group, size in groups:
        if size == 1:
            continue
        p.grad = C.all_reduce(p.grad, group)  # a new tensor, counted by es.count_communication


def reduce_grad_(p, state, mesh) -> torch.nn.Parameter:
    """SUM ``p.grad`` over each group of a concrete native duty (others: nothing); returns ``p``.

    >>> import torch, einshard as es
    >>> p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.ones(2)
    >>> reduce_grad_(p, es.params.ParameterState.from_layout("c", grad="dp"), es.Mesh.virtual((1,), ("dp",))).grad
    tensor([1., 1.])
    """
    if not isinstance(state, ParameterState):
        raise TypeError(f"reduce_grad_: expected a ParameterState, got {type(state).__name__}")
    if p.grad is None:
        return p
    _check_state(state, "reduce_grad_")
    _summed_elsewhere(p, state, "reduce_grad_")
    groups = _native_groups(state)
    if groups:
        rt = runtime_mesh(mesh)
        _sum_(p, [resolve_group(rt, g, "grad") for g in groups])
    return p


def reduce_module_grads_(module, mesh):
    """:func:`reduce_grad_` for every parameter with a state; every state is checked before the first collective.

    Returns ``module``.
    """
    work = []
    rt = None
    for name, p, state in iter_parameter_states(module):
        _check_state(state, f"reduce_module_grads_ ({name!r})")
        groups = _native_groups(state)
        if groups and p.grad is not None:
            _summed_elsewhere(p, state, f"reduce_module_grads_ ({name!r})")
            rt = rt or runtime_mesh(mesh)
            for g in groups:
                resolve_dims(rt, g, f"{name!r} grad")
            work.append((p, groups))
    for p, groups in work:
        _sum_(p, [resolve_group(rt, g, "grad") for g in groups])
    return module


class NativeGradReductionHandle:
    """What :func:`register_native_grad_reduction_hooks_` returns.

    ``pending``: all-reduces started during backward and not yet waited for
    (only ``async`` duties start any). ``wait()`` sums what is not summed yet,
    waits and writes the sums into ``.grad`` (unfinished works are kept on
    error); ``no_sync()`` accumulates without communicating (like DDP's); ``remove()``
    waits, detaches every hook, and is idempotent. ``wait`` and ``remove`` return the handle.

    >>> with handle.no_sync():                 # doctest: +SKIP
    ...     loss_fn(micro_batch_1).backward()  # accumulated locally
    >>> loss_fn(micro_batch_2).backward()      # doctest: +SKIP
    >>> handle.wait()                          # doctest: +SKIP
    """

    def __init__(self, bucketers):
        self._bucketers = [b for b in bucketers if b is not None]

    @property
    def pending(self) -> int:
        return sum(b.pending for b in self._bucketers)

    def adopt(self, part) -> NativeGradReductionHandle:
        """Add ``part`` (``pending``, ``wait()``, ``no_sync()``, ``remove()``, as a bucketer has) to the handle."""
        self._bucketers.append(part)
        return self

    def wait(self) -> NativeGradReductionHandle:
        for b in self._bucketers:
            b.wait()
        return self

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without communicating; the first backward after the block (or ``wait()``)
        sums everything accumulated, once."""
        with contextlib.ExitStack() as stack:
            for b in self._bucketers:
                stack.enter_context(b.no_sync())
            yield self

    def remove(self) -> NativeGradReductionHandle:
        self.wait()
        for b in self._bucketers:
            b.remove()
        self._bucketers = []
        return self

    def __enter__(self) -> NativeGradReductionHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def install_sum_hooks(module, mesh, *, bucket_bytes=DEFAULT_BUCKET_BYTES):
    """The gradient-sum half of :func:`einshard.params.zero.register_native_grad_reduction_hooks_`: hooks that
    SUM each native-duty gradient over its groups during backward (``async`` duties in buckets of about
    ``bucket_bytes``); returns the handle. Every check passes before any group is created or hook added."""
    rt = None
    plan = []  # (p, state): every check passes before any group is created or hook added
    for name, p, state in iter_parameter_states(module):
        if not isinstance(state, ParameterState):
            raise TypeError(f"{name!r}: expected a ParameterState, got {type(state).__name__}")
        if state.grad_comm.backend != "native":
            continue
        check_not_pending(state, f"native gradient hooks ({name!r})")
        groups = _native_groups(state)
        if not groups:
            continue
        rt = rt or runtime_mesh(mesh)
        for g in groups:
            resolve_dims(rt, g, f"{name!r} grad")
        if hooked_by(p) is not None:
            raise EinshardError(
                f"native gradient hooks ({name!r}): the parameter already has gradient hooks that sum it (an "
                "earlier register_native_grad_reduction_hooks_); remove them first (handle.remove()), or its "
                "gradient would be summed twice"
            )
        plan.append((p, state))
    bucketers = []
    try:
        for synchronous in (True, False):
            chosen = [(p, s.grad_comm.mesh_dims) for p, s in plan if (s.grad_comm.schedule != "async") == synchronous]
            if chosen:
                bucketers.append(GradBucketer(chosen, rt, bucket_bytes=bucket_bytes, synchronous=synchronous))
    except BaseException:
        for b in bucketers:
            b.remove()
        raise
    return NativeGradReductionHandle(bucketers)


# -- DDP ---------------------------------------------------------------------------------------
def _ddp_groups(state) -> tuple[str, ...]:
    g = state.grad_comm
    return g.mesh_dims if g.backend in ("native", "ddp") and g.mode != "none" else ()


def _check_ddp_state(name, state, rt, ddp_parts) -> None:
    where = f"DDP comm hook ({name!r})"
    if not isinstance(state, ParameterState):
        raise TypeError(f"{where}: expected a ParameterState, got {type(state).__name__}")
    check_not_pending(state, where)
    if state.store is not None:
        raise EinshardError(
            f"{where}: the parameter is stored sharded over {state.store!r} (store=): its gather's backward "
            "reduce-scatters its gradient, and DDP would all-reduce it a second time; train it without DDP"
        )
    for g in _ddp_groups(state):
        if set(components(g)) & ddp_parts:
            raise EinshardError(f"{where}: grad group {g!r} touches ddp_group; DDP already reduces over it")
        resolve_dims(rt, g, "grad")


def _completed(tensor):
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


class _DdpHook:
    """The comm hook: states are re-read at every call."""

    def __init__(self, rt, ddp_group, ddp_parts, combined_group, combined_reduce):
        self.rt = rt
        self.ddp_parts = ddp_parts
        self.ddp = (None, dist.get_world_size()) if ddp_group is None else resolve_group(rt, ddp_group, "ddp_group")
        self.combined = None if combined_group is None else resolve_group(rt, combined_group, "combined_reduce_group")
        self.combined_set = None if combined_reduce is None else set(combined_reduce)

    def _states(self, params):
        states = []
        for p in params:
            state = get_parameter_state(p)
            if state is not None:
                _check_ddp_state(f"shape {tuple(p.shape)}", state, self.rt, self.ddp_parts)
            states.append(state)
        return states

    def __call__(self, state, bucket):
        buffer = bucket.buffer()
        params = list(bucket.parameters())
        states = self._states(params)
        groups = [() if s is None else _ddp_groups(s) for s in states]
        ddp_pg, ddp_size = self.ddp
        if (
            self.combined is not None
            and self.combined[1] > 1
            and all(set(g) == self.combined_set for g in groups)
        ):
            pg, _ = self.combined
            summed, work = C.all_reduce(buffer, pg, async_op=True)
            return work.get_future().then(lambda f: buffer.copy_(summed).div_(ddp_size))
        if ddp_size > 1:
            summed, work = C.all_reduce(buffer, ddp_pg, async_op=True)
            fut = work.get_future()
        else:
            summed, fut = buffer, _completed([buffer])

        def rest(f):
            f.wait()
            out = buffer.copy_(summed) if summed is not buffer else buffer
            out.div_(ddp_size)
            views, offset = [], 0
            for p in params:
                views.append(out[offset : offset + p.numel()])
                offset += p.numel()
            for extra in sorted({g for gs in groups for g in gs}):
                pg, size = resolve_group(self.rt, extra, "grad")
                members = [v for v, gs in zip(views, groups) if extra in gs]
                if size == 1 or not members:
                    continue
                flat = C.all_reduce(torch.cat(members), pg)
                offset = 0
                for v in members:
                    v.copy_(flat[offset : offset + v.numel()])
                    offset += v.numel()
            return out

        return fut.then(rest)


def register_grad_reduction_hook_(ddp_model, mesh, ddp_group="dp", combined_reduce_group=None, combined_reduce=None):
    """Register a DDP comm hook: average over ``ddp_group``, then SUM each parameter's extra native/ddp groups.

    Fast path: when every parameter of a bucket reduces exactly over ``combined_reduce``,
    one SUM over ``combined_reduce_group`` (= ``ddp_group`` ∪ ``combined_reduce``) then
    division by the ``ddp_group`` size. Returns ``ddp_model``.
    """
    rt = runtime_mesh(mesh)
    if (combined_reduce_group is None) != (combined_reduce is None):
        missing = "combined_reduce" if combined_reduce is None else "combined_reduce_group"
        raise EinshardError(f"combined_reduce_group and combined_reduce go together: {missing} is missing")
    if combined_reduce is not None:
        if ddp_group is None:
            raise EinshardError("combined_reduce_group needs a ddp_group")
        if isinstance(combined_reduce, str):
            combined_reduce = (combined_reduce,)
        combined_reduce = tuple(combined_reduce)
        for g in (combined_reduce_group, ddp_group, *combined_reduce):
            check_group_syntax(g, "DDP hook")
        extra = {c for g in combined_reduce for c in components(g)}
        if extra & set(components(ddp_group)) or len(extra) != sum(len(components(g)) for g in combined_reduce):
            raise EinshardError(f"combined_reduce {combined_reduce!r} and ddp_group {ddp_group!r} overlap")
        if set(components(combined_reduce_group)) != extra | set(components(ddp_group)):
            raise EinshardError(
                f"combined_reduce_group {combined_reduce_group!r} must span ddp_group {ddp_group!r} "
                f"and combined_reduce {combined_reduce!r} exactly"
            )
    elif ddp_group is not None:
        check_group_syntax(ddp_group, "ddp_group")
    ddp_parts = set(rt.names) if ddp_group is None else set(resolve_dims(rt, ddp_group, "ddp_group"))
    if combined_reduce_group is not None:
        resolve_dims(rt, combined_reduce_group, "combined_reduce_group")
    module = getattr(ddp_model, "module", ddp_model)
    for name, _, state in iter_parameter_states(module):
        _check_ddp_state(name, state, rt, ddp_parts)
    impl = _DdpHook(rt, ddp_group, ddp_parts, combined_reduce_group, combined_reduce)

    def einshard_grad_reduction_hook(state, bucket):
        return impl(state, bucket)

    ddp_model.register_comm_hook(None, einshard_grad_reduction_hook)
    return ddp_model

