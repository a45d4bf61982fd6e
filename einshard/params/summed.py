"""Gradients a ``shard_map`` body sums: who may not sum them again.

Inside ``shard_map(check_vma=True)`` the body gives every parameter its whole
gradient (the formulas' backward and ``pvary`` sum it over the mesh dimensions
it is replicated over), whatever gradient duty the parameter carries. So:

- :func:`body_duty_error`: a parameter that another mechanism would sum as
  well is refused before the body runs: one whose native duty is summed by
  live gradient hooks, or whose duty is DDP's or an external system's;
- :func:`watch_body`: when backward reaches a body's outputs, the ``.grad`` of
  the body's parameters with a native duty is tagged once the contributions
  have arrived, and :func:`summed_by_body` tells ``reduce_grad_`` /
  ``reduce_module_grads_`` to refuse it (it is summed already).

A tag lives on the gradient tensor: a new ``.grad`` (``zero_grad()``, which
sets it to ``None``) carries none.
"""

from __future__ import annotations

import functools
import weakref

import torch

from ..core import _torch_compat
from .buckets import hooked_by
from .store import PARAM_STATE_ATTR

__all__ = ["body_duty_error", "native_duty", "duty_text", "watch_body", "summed_by_body", "SUMMED_TAG"]

SUMMED_TAG = "_es_summed_by_shard_map"
_engine = _torch_compat.autograd_engine
_graph_task = _torch_compat.current_graph_task_id
_PENDING: dict = {}  # graph task id -> {id(p): (weakref(p), snapshot of p.grad before the body's gradients)}


def duty_text(grad_comm) -> str:
    """A duty as ``grad=`` text: ``'dp'``, ``'dp:async'``, ``'dp:ddp'``, ``'async'`` (pending)...

    >>> from einshard.params.state import ParameterGradComm
    >>> duty_text(ParameterGradComm.from_annotation("dp-sp:async"))
    'dp-sp:async'
    """
    suffix = {"ddp": "ddp", "external": "external"}.get(grad_comm.backend)
    if suffix is None and grad_comm.schedule == "async":
        suffix = "async"
    groups = ",".join(grad_comm.mesh_dims)
    if not groups:
        return suffix or "native (pending)"
    return groups if suffix is None else f"{groups}:{suffix}"


def body_duty_error(p) -> str | None:
    """Why a ``shard_map(check_vma=True)`` body may not take ``p``, or ``None`` (``p``: any value)."""
    state = getattr(p, PARAM_STATE_ATTR, None) if isinstance(p, torch.nn.Parameter) else None
    if state is None:
        return None
    gc = state.grad_comm
    if gc.mode == "none" or gc.backend in ("none", "vma"):
        return None
    text = duty_text(gc)
    body = "a shard_map body with check_vma=True sums its gradient itself (formulas and pvary)"
    if gc.backend == "native":
        if hooked_by(p) is None:
            return None
        return (f"has the gradient duty {text!r}, which live gradient hooks sum "
                f"(es.params.register_native_grad_reduction_hooks_); {body}, so the hooks would sum it twice. "
                "Remove the hooks (handle.remove()) to train it with shard_map, or pass check_vma=False (the body then "
                "leaves it partial and the hooks sum it)")
    who = "DistributedDataParallel" if gc.backend == "ddp" else "an external system"
    return (f"has the gradient duty {text!r} ({who} sums it); {body}, so it would be summed twice. Register it "
            "without that duty (grad='none', or a native duty), or pass check_vma=False")


def native_duty(p) -> bool:
    """Whether ``p`` is a Parameter whose state carries a native gradient duty (pending or concrete)."""
    state = getattr(p, PARAM_STATE_ATTR, None) if isinstance(p, torch.nn.Parameter) else None
    return state is not None and state.grad_comm.mode != "none" and state.grad_comm.backend == "native"


def watch_body(outputs, params) -> None:
    """Tag the ``.grad`` of ``params`` once backward has brought them a body's contributions.

    ``outputs``: the body's result leaves; when backward reaches one of them (a
    prehook on its ``grad_fn``), the parameters' gradients are noted, and at the
    end of that backward every one that changed is tagged.
    """
    nodes = {}
    for o in outputs:
        if isinstance(o, torch.Tensor) and o.grad_fn is not None:
            nodes[id(o.grad_fn)] = o.grad_fn
    if not nodes or not params:
        return
    refs = tuple(weakref.ref(p) for p in params)

    def prehook(grad_outputs):
        task = _graph_task()
        entry = _PENDING.get(task)
        if entry is None:
            entry = _PENDING[task] = {}
            _engine.queue_callback(functools.partial(_tag, task))
        for r in refs:
            p = r()
            if p is not None and id(p) not in entry:
                entry[id(p)] = (r, _snapshot(p))

    for node in nodes.values():
        node.register_prehook(prehook)


def _snapshot(p):
    g = p.grad
    return None if g is None else (weakref.ref(g), g._version)


def _tag(task) -> None:
    for r, before in _PENDING.pop(task, {}).values():
        p = r()
        g = None if p is None else p.grad
        if g is None or (before is not None and before[0]() is g and before[1] == g._version):
            continue  # nothing arrived in this backward
        g.__dict__[SUMMED_TAG] = True


def summed_by_body(p) -> bool:
    """Whether ``p.grad`` holds contributions a ``shard_map`` body summed."""
    g = p.grad
    return g is not None and g.__dict__.get(SUMMED_TAG, False)
