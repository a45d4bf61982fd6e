"""The torch version shims: every behaviour einshard relies on that differs between torch releases.

einshard supports torch 2.11 through 2.15. Where releases differ in something
einshard needs, the difference is settled here, once, and every other module
uses the shim; ``tests/core/test_torch_compat.py`` checks each shim against the
installed torch, so a release that changes what a shim assumes fails there.

- the two meanings of "compiling", each one predicate used everywhere
  (no other module asks torch): :func:`in_traced_code`, dynamo is tracing
  the calling code (its Python runs once, to build a graph); and
  :func:`compile_in_progress`, a graph is being built on this thread, in
  code dynamo traces or in the plain Python it runs while tracing (the
  planners marked ``assume_constant_result``, AOTAutograd's and compiled
  autograd's traces). ``torch.compiler.is_compiling`` says the latter in
  trace-time Python only from torch 2.13 on, so trace-time Python enters
  :func:`trace_time`.
- :func:`traced_function_result`: the copy that keeps torch 2.11 from
  zeroing a gradient through a traced autograd Function.
- :data:`DYNAMO_MARKS_DIRTY`: whether ``torch.compile`` keeps an autograd
  Function that writes its input in place (``ctx.mark_dirty``) in the
  gradient; torch 2.11's dynamo drops it, so in traced code einshard writes
  the result of an out-of-place Function back with ``copy_`` there.
- activation checkpointing (:class:`CheckpointFrame`,
  :func:`install_checkpoint`): ``torch.utils.checkpoint`` has no public hook
  that runs a region's recompute in a context of the caller's choosing with
  the region's arguments (``context_fn`` gets no arguments, and only where
  the caller passes it), so einshard subclasses the frame of the
  non-reentrant implementation and wraps the reentrant ``forward``. The
  frame learns the region's inputs through ``save_inputs`` from torch 2.12
  on; torch 2.11 saves them with ``_NoopSaveInputs``. :func:`checkpoint`:
  torch 2.11's non-reentrant checkpoint makes two zero-element anchor
  tensors with ``torch.empty`` and no ``device=`` (on the CPU, whatever the
  region's device); the shim makes them on the operands' device.
- torch internals with no public equivalent (the last section): the
  autograd engine's current graph task, functorch's transform state, the
  torch-function mode stack, fake tensors, a process group by name, the
  C entry points of ``einsum`` and ``autograd.Function.apply``, whether
  dynamo is compiling a frame (:func:`dynamo_compiling_frame`), the functional
  collectives (``functional_collectives``, ``c10d_functional``), ``DTensorSpec``,
  torch's pytree, a graph break (:func:`graph_break`). Each is a name here and
  nowhere else in einshard, but for :mod:`einshard.core._trace`, whose job is
  dynamo's trace-time machinery (it loads those modules only while compiling);
  ``tests/core/test_torch_compat.py`` checks that.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as _functional_collectives
import torch.distributed.distributed_c10d as _c10d
import torch.utils._pytree as _pytree
import torch.utils.checkpoint as _checkpoint
from torch._guards import CompileContext as _CompileContext
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec as _DTensorSpec

__all__ = ["TORCH_VERSION", "in_traced_code", "compile_in_progress", "trace_time", "traced_function_result",
           "DYNAMO_MARKS_DIRTY", "CheckpointFrame", "CHECKPOINT_ANCHORS_ON_DEFAULT_DEVICE", "checkpoint",
           "install_checkpoint", "original_reentrant_forward", "checkpoint_installed",
           "current_graph_task_id", "autograd_engine",
           "will_engine_execute_node", "functorch_transforms_active", "function_base_apply",
           "disabled_torch_function_impl", "DisableTorchFunction", "DisableTorchFunctionSubclass",
           "EnableTorchFunction", "push_torch_function_mode",
           "pop_torch_function_mode", "torch_function_stack_len", "FakeTensor", "einsum_entry", "resolve_process_group",
           "dynamo_compiling_frame", "functional_collectives", "c10d_functional", "DTensorSpec", "pytree",
           "graph_break"]

#: the installed torch release as ``(major, minor)``
TORCH_VERSION: tuple[int, ...] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

#: whether dynamo is tracing the calling code: its Python runs once, to build a graph (which holds a constant
#: ``True`` for this call); false in the plain Python dynamo runs while it traces (a planner) and in eager code.
#: The branch that picks what goes into a graph (a functional collective, a plan made at trace time).
in_traced_code = torch.compiler.is_dynamo_compiling

_torch_is_compiling = torch.compiler.is_compiling
_TRACE_TIME = [0]  # how many trace-time Python calls are running


def compile_in_progress() -> bool:
    """Whether ``torch.compile`` (or ``torch.export``) is building a graph on this thread: true in code dynamo
    traces (:func:`in_traced_code`) and also in the plain Python it runs while tracing (planners, on every
    release: see the module docstring) and in AOTAutograd's and compiled autograd's traces. The branch for state
    that must not be Python's own there (context variables), and for work a graph does instead."""
    return _torch_is_compiling() or _TRACE_TIME[0] > 0


if TORCH_VERSION >= (2, 13):  # torch says so in trace-time Python itself: its own predicate (one call less)
    compile_in_progress = _torch_is_compiling


class trace_time:
    """Mark Python that dynamo runs while it traces (a planner), so that :func:`compile_in_progress` is true there."""

    __slots__ = ()

    def __enter__(self):
        _TRACE_TIME[0] += 1

    def __exit__(self, *exc):
        _TRACE_TIME[0] -= 1
        return False


#: torch 2.11's dynamo, tracing an autograd Function whose forward returns a functional collective's
#: result, adds an aliased output for it and, under a backend without AOTAutograd, the input's gradient is
#: then zero (2.12.1, 2.13 and 2.15 are right)
_ALIASED_FUNCTION_OUTPUT_BUG = TORCH_VERSION < (2, 12)


def traced_function_result(y: torch.Tensor) -> torch.Tensor:
    """What the forward of an autograd Function run under ``torch.compile`` returns for ``y``, the result of
    functional collectives: ``y``, or a copy of it on the releases with the aliased-output bug (above)."""
    return y.clone() if _ALIASED_FUNCTION_OUTPUT_BUG else y


#: whether dynamo records ``ctx.mark_dirty`` of an autograd Function it traces. torch 2.11's does not: the
#: Function's result is left out of the graph, the code after it uses the input as it was, and the
#: Function's backward never runs (a silently wrong gradient, under every backend); 2.13 and 2.15 record it
DYNAMO_MARKS_DIRTY = TORCH_VERSION >= (2, 12)


# -- activation checkpointing -------------------------------------------------------------------

_Frame = _checkpoint._CheckpointFrame
_Reentrant = _checkpoint.CheckpointFunction
_SAVES_INPUTS = hasattr(_Frame, "save_inputs")  # torch >= 2.12
_NEW_FRAME: list = []  # torch 2.11: the frame whose inputs are saved next

#: whether torch's non-reentrant checkpoint makes its anchor tensors (a ``requires_grad`` dummy and
#: ``_NoopSaveInputs``'s output, both of zero elements) with ``torch.empty`` and no ``device=``: on the
#: default device, the CPU, whatever the region's device (torch 2.11; from 2.12 the frame saves the inputs
#: itself and makes no tensor)
CHECKPOINT_ANCHORS_ON_DEFAULT_DEVICE = not _SAVES_INPUTS


def checkpoint(function, *args, use_reentrant: bool):
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant)`` that makes no tensor
    off the device of ``args``' first tensor: on torch 2.11 (:data:`CHECKPOINT_ANCHORS_ON_DEFAULT_DEVICE`) the
    call runs with that device as the default device (``torch.device`` as a context), so the anchors land there.
    (Traced by ``torch.compile``, the region is a graph of its own and no anchor is made at run time.)"""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    if CHECKPOINT_ANCHORS_ON_DEFAULT_DEVICE and device is not None and not compile_in_progress():
        with torch.device(device):
            return _checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant)
    return _checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant)


class CheckpointFrame(_Frame):
    """The frame of a non-reentrant checkpoint (``use_reentrant=False``), told its region's inputs.

    Subclasses override :meth:`inputs_saved`; :func:`install_checkpoint` makes
    ``torch.utils.checkpoint`` use the subclass.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not _SAVES_INPUTS:
            _NEW_FRAME[:] = [self]

    def inputs_saved(self, inputs: tuple) -> None:
        """Called as the region's forward starts with the inputs its recompute will get."""

    if _SAVES_INPUTS:

        def save_inputs(self, *args):
            self.inputs_saved(args)
            super().save_inputs(*args)


if not _SAVES_INPUTS:
    _NoopSaveInputs = _checkpoint._NoopSaveInputs  # type: ignore[attr-defined]  # torch 2.11 only

    class _SaveInputs(_NoopSaveInputs):  # type: ignore[valid-type,misc]
        """torch 2.11's ``_NoopSaveInputs``, applied to ``(dummy, kwargs, *args)`` right after the frame is made."""

        @staticmethod
        def forward(*args):
            if _NEW_FRAME:
                _NEW_FRAME.pop().inputs_saved(args[1:])
            return _NoopSaveInputs.forward(*args)


_ORIGINAL: list = []  # (CheckpointFunction.forward, _CheckpointFrame, _NoopSaveInputs) once installed


def install_checkpoint(frame: type, reentrant_forward) -> None:
    """Make ``torch.utils.checkpoint`` use ``frame`` (a :class:`CheckpointFrame`) for non-reentrant regions and
    ``reentrant_forward(ctx, run_function, preserve_rng_state, *args)`` as ``CheckpointFunction.forward`` (which
    runs torch's own with :func:`original_reentrant_forward`)."""
    if _ORIGINAL:
        return
    forward = vars(_Reentrant)["forward"]
    _ORIGINAL[:] = [forward.__func__, _Frame, getattr(_checkpoint, "_NoopSaveInputs", None)]
    _Reentrant.forward = staticmethod(reentrant_forward)  # type: ignore[method-assign]
    _checkpoint._CheckpointFrame = frame  # type: ignore[misc,assignment]
    if not _SAVES_INPUTS:
        _checkpoint._NoopSaveInputs = _SaveInputs  # type: ignore[attr-defined]


def original_reentrant_forward(ctx, run_function, preserve_rng_state, *args):
    """torch's own ``CheckpointFunction.forward``."""
    return _ORIGINAL[0](ctx, run_function, preserve_rng_state, *args)


def checkpoint_installed(frame: type) -> bool:
    """Whether ``torch.utils.checkpoint`` runs non-reentrant regions with ``frame``."""
    return bool(_ORIGINAL) and _checkpoint._CheckpointFrame is frame


# -- torch internals with no public equivalent ----------------------------------------------------

#: the id of the autograd graph task running on this thread (-1: none, i.e. not in a backward)
current_graph_task_id = torch._C._current_graph_task_id
#: the autograd engine (its ``queue_callback`` runs a function at the end of the running backward)
autograd_engine = torch.autograd.Variable._execution_engine
#: whether the running backward will execute an autograd node (only inside a backward)
will_engine_execute_node = torch._C._will_engine_execute_node
#: whether a functorch transform (vmap, grad, jvp, ...) is active
functorch_transforms_active = torch._C._are_functorch_transforms_active
#: ``autograd.Function.apply`` without its Python-level handling of functorch transforms (unbound)
function_base_apply = torch._C._FunctionBase.__dict__["apply"]
#: the ``__torch_function__`` of a tensor subclass that opts out of the protocol
disabled_torch_function_impl = torch._C._disabled_torch_function_impl
#: the torch-function protocol off (on) for a ``with`` block, modes included
DisableTorchFunction = torch._C.DisableTorchFunction
#: the torch-function protocol off for tensor subclasses only (modes still run) for a ``with`` block
DisableTorchFunctionSubclass = torch._C.DisableTorchFunctionSubclass
EnableTorchFunction = torch._C._EnableTorchFunction
#: the torch-function mode stack, as ``TorchFunctionMode.__enter__``/``__exit__`` use it
push_torch_function_mode = torch._C._push_on_torch_function_stack
pop_torch_function_mode = torch._C._pop_torch_function_stack
torch_function_stack_len = torch._C._len_torch_function_stack
#: ``torch.einsum`` without its Python-level argument handling
einsum_entry = torch._C._VariableFunctions.einsum  # type: ignore[attr-defined]  # not in torch's stubs
#: the process group of a ``group.group_name``
resolve_process_group = _c10d._resolve_process_group


def dynamo_compiling_frame() -> bool:
    """Whether dynamo is compiling a frame on this thread: true in the code it traces and in the Python it runs
    meanwhile (building guards, which on torch 2.11 evaluates a guarded attribute such as ``w.T`` through the
    torch-function modes of the frame), false in the eager code of a graph break."""
    return _CompileContext.try_get() is not None


#: the functional collectives (``torch.distributed._functional_collectives``): what code dynamo traces calls, as
#: DTensor does (a graph node each, waited for where a result is used)
functional_collectives = _functional_collectives
#: the same collectives as raw ops (``torch.ops._c10d_functional``): started in a graph and waited for later
c10d_functional = torch.ops._c10d_functional
#: a DTensor's sharding spec (placements, mesh, shape), which DTensor's own constructors take
DTensorSpec = _DTensorSpec
#: torch's pytree (``torch.utils._pytree``), which dynamo traces natively: for the pytrees of code it may trace
pytree = _pytree


def graph_break(reason: str) -> None:
    """End dynamo's graph here, with ``reason`` (called only in code dynamo traces, so dynamo is loaded)."""
    torch._dynamo.graph_break(msg=reason)
