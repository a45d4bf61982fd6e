"""The torch version shims (einshard.core._torch_compat), each checked against the installed torch.

Every test here states what the shim assumes about this torch release; a
release that changes it fails here, not somewhere deep in a compiled step.
"""

import ast
import pathlib
import re

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.utils._pytree as pytree
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

import einshard
from einshard.core import _torch_compat, _trace
from einshard.runtime import recompute


class _Thing:  # an object that is not a constant to dynamo
    pass


def _compile(fn, backend="eager"):
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True)


def test_the_declared_range_includes_this_torch():
    assert (2, 11) <= _torch_compat.TORCH_VERSION <= (2, 15), torch.__version__


def test_compile_in_progress_is_true_in_trace_time_python():
    seen = []

    @_trace.constant_result
    def planner(n):
        seen.append((torch.compiler.is_compiling(), _torch_compat.compile_in_progress()))
        return n + 1

    out = _compile(lambda x: x * planner(2))(torch.ones(2))
    assert out.tolist() == [3.0, 3.0]
    torch_says, shim_says = seen[0]
    assert shim_says
    # torch says so itself only from 2.13 on: the reason for the shim (a release that changes it fails here)
    assert torch_says == (_torch_compat.TORCH_VERSION >= (2, 13))
    assert not _torch_compat.compile_in_progress()  # eager code
    assert planner(2) == 3 and seen[1] == (False, False)  # called eagerly: plain Python, not at trace time


def test_the_two_predicates_of_compiling():
    """``in_traced_code``: dynamo traces this code (false in the Python it runs at trace time);
    ``compile_in_progress``: a graph is being built (true in both)."""
    seen = {}

    @_trace.constant_result
    def planner(n):
        seen["planner"] = (_torch_compat.in_traced_code(), _torch_compat.compile_in_progress())
        return n

    def traced(x):
        seen["traced"] = (_torch_compat.in_traced_code(), _torch_compat.compile_in_progress())
        return x * planner(2)

    assert _compile(traced)(torch.ones(2)).tolist() == [2.0, 2.0]
    assert seen == {"traced": (True, True), "planner": (False, True)}
    traced(torch.ones(2))
    assert seen == {"traced": (False, False), "planner": (False, False)}


def test_only_the_shims_ask_torch_whether_it_compiles():
    """Every module asks ``in_traced_code`` or ``compile_in_progress``; none asks torch itself."""
    root = pathlib.Path(einshard.__file__).parent
    asking = [str(p.relative_to(root)) for p in sorted(root.rglob("*.py"))
              if p.name != "_torch_compat.py" and re.search(r"\bis_(dynamo_)?compiling\b", p.read_text())]
    assert asking == []


def _private_torch_uses(tree) -> list[str]:
    """``torch.a._b`` attributes and imports of ``torch`` modules with a private part, in one module's code
    (strings and comments are not code)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "torch":
                path = ["torch", *reversed(parts)]
                if any(p.startswith("_") and not p.startswith("__") for p in path[1:]):
                    found.append(f"{node.lineno}: {'.'.join(path)}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                if name.split(".")[0] == "torch" and any(p.startswith("_") for p in name.split(".")[1:]):
                    found.append(f"{node.lineno}: import {name}")
    return found


def test_only_the_shims_use_torch_internals():
    """Torch's private modules and attributes are named in ``_torch_compat`` (and in ``_trace``, dynamo's
    trace-time machinery), nowhere else: a release that moves one breaks in one place."""
    root = pathlib.Path(einshard.__file__).parent
    uses = {}
    for p in sorted(root.rglob("*.py")):
        if p.name in ("_torch_compat.py", "_trace.py"):
            continue
        found = sorted(set(_private_torch_uses(ast.parse(p.read_text()))))
        if found:
            uses[str(p.relative_to(root))] = found
    assert uses == {}
    assert _private_torch_uses(ast.parse("import torch.utils._pytree as p\nx = torch.ops._c10d_functional"))


def test_planners_get_objects_by_identity():
    """Dynamo hands assume_constant_result functions only constants on torch 2.11; the handles give the planner
    the very object on every release, and a compiled function called with another object recompiles."""
    got = []

    @_trace.constant_result
    def planner(obj, n):
        got.append(obj)
        return n

    a, b = _Thing(), _Thing()
    fn = _compile(lambda x, o: x * planner(o, 2))
    assert fn(torch.ones(1), a).item() == 2 and got == [a]
    assert fn(torch.ones(1), a).item() == 2 and got == [a]  # no new trace
    assert fn(torch.ones(1), b).item() == 2 and got == [a, b]  # guarded on identity
    assert got[0] is a and got[1] is b


def test_planner_arguments_dynamo_refuses_without_handles():
    """Why the handles exist: torch <= 2.11 refuses objects as arguments of assume_constant_result functions."""

    @torch.compiler.assume_constant_result
    def plain(obj) -> int:
        return 2

    fn = _compile(lambda x, o: x * plain(o))
    if _torch_compat.TORCH_VERSION >= (2, 12):
        assert fn(torch.ones(1), _Thing()).item() == 2
    else:
        try:
            fn(torch.ones(1), _Thing())
        except Exception as e:  # noqa: BLE001 - dynamo's internal error type differs between releases
            assert "not a constant" in str(e)
        else:
            raise AssertionError("torch 2.11 now passes objects to assume_constant_result functions")


class _EndsInCollective(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shim):
        y = fc.all_reduce(x * 2, "sum", dist.group.WORLD)
        return _torch_compat.traced_function_result(y) if shim else y

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


def _grad(shim, backend):
    x = torch.ones(3, requires_grad=True)
    _compile(lambda x: _EndsInCollective.apply(x, shim).sum(), backend)(x).backward()
    return x.grad.tolist()


def test_traced_function_result_keeps_the_gradient(tmp_path):
    """torch 2.11 zeroes the gradient through an autograd Function whose forward ends in a functional collective
    (dynamo, backend without AOTAutograd); the shim's copy avoids it. Fails when a release fixes or brings it."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert _grad(True, "eager") == [2.0] * 3
        assert _grad(True, "aot_eager") == [2.0] * 3
        bug = _grad(False, "eager") == [0.0] * 3
        assert bug == _torch_compat._ALIASED_FUNCTION_OUTPUT_BUG
    finally:
        dist.destroy_process_group()


class _TwiceInPlace(torch.autograd.Function):
    """Writes its input in place (the value stays, the gradient doubles)."""

    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def _in_place_function(x):
    y = x * 1.0
    _TwiceInPlace.apply(y)
    return (y * 3.0).sum()


def test_dynamo_marks_dirty_as_the_shim_says():
    """torch 2.11's dynamo drops ctx.mark_dirty: the in-place Function's backward never runs and the gradient is
    silently 3 instead of 6, under every backend (einshard's traced in-place pvary writes back an out-of-place one
    there). Fails when a release fixes or brings it."""
    for backend in ("eager", "aot_eager"):
        x = torch.ones(3, requires_grad=True)
        _compile(_in_place_function, backend)(x).backward()
        assert x.grad.tolist() == ([6.0] * 3 if _torch_compat.DYNAMO_MARKS_DIRTY else [3.0] * 3), backend


def test_checkpoint_frames_learn_their_inputs():
    """The non-reentrant checkpoint's frame is the installed one and is told the region's inputs (torch >= 2.12:
    save_inputs; 2.11: _NoopSaveInputs); the reentrant forward is the installed one."""
    assert recompute.installed()
    told = []

    class Probe(recompute._Frame):
        def inputs_saved(self, inputs):
            told.append(inputs)
            super().inputs_saved(inputs)

    frame = torch_checkpoint._CheckpointFrame
    torch_checkpoint._CheckpointFrame = Probe
    try:
        x = torch.ones(2, requires_grad=True)
        y = torch_checkpoint.checkpoint(lambda a, b: (a * b).sin(), x, 3.0, use_reentrant=False)
        y.sum().backward()
    finally:
        torch_checkpoint._CheckpointFrame = frame
    assert len(told) == 1
    inputs = [v for v in told[0] if not isinstance(v, dict)]  # (2.11 passes the kwargs first)
    assert inputs[0] is x and inputs[1] == 3.0
    assert torch.allclose(x.grad, 3.0 * torch.cos(3.0 * x.detach()))
    assert torch_checkpoint.CheckpointFunction.forward is recompute._reentrant_forward


class _Devices(TorchDispatchMode):
    """The device types of every tensor the aten ops run while active make."""

    def __init__(self):
        super().__init__()
        self.types = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.types |= {t.device.type for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)}
        return out


def _checkpointed_devices(checkpoint, use_reentrant):
    x = torch.ones(3, device="meta", requires_grad=True)  # (meta stands for CUDA on a CPU machine)
    with _Devices() as seen:
        checkpoint(lambda a, b: (a * b).sin(), x, 2.0, use_reentrant=use_reentrant).sum().backward()
    assert x.grad is not None and x.grad.device.type == "meta"
    return seen.types


def test_checkpoint_makes_nothing_off_the_operands_device():
    """torch 2.11's non-reentrant checkpoint makes its anchor tensors on the CPU whatever the region's device
    (CHECKPOINT_ANCHORS_ON_DEFAULT_DEVICE; a release that changes that fails here); the shim makes none off the
    operands' device, in both modes, and its gradient is torch's."""
    anchors_on_cpu = _checkpointed_devices(torch_checkpoint.checkpoint, False) == {"meta", "cpu"}
    assert anchors_on_cpu == _torch_compat.CHECKPOINT_ANCHORS_ON_DEFAULT_DEVICE == (_torch_compat.TORCH_VERSION < (2, 12))
    for use_reentrant in (False, True):
        assert _checkpointed_devices(_torch_compat.checkpoint, use_reentrant) == {"meta"}
        x = torch.linspace(-1, 1, 5, dtype=torch.float64, requires_grad=True)
        y = _torch_compat.checkpoint(lambda a, b: (a * b).sin(), x, 3.0, use_reentrant=use_reentrant)
        y.sum().backward()
        assert torch.allclose(y, torch.sin(3.0 * x.detach())) and torch.allclose(x.grad, 3.0 * torch.cos(3.0 * x.detach()))


# -- torch internals with no public equivalent ----------------------------------------------------


def test_autograd_engine_internals():
    seen = {}
    x = torch.ones(2, requires_grad=True)
    y = x * 3

    def hook(grad):
        seen["task"] = _torch_compat.current_graph_task_id()
        seen["executes"] = _torch_compat.will_engine_execute_node(y.grad_fn)
        _torch_compat.autograd_engine.queue_callback(lambda: seen.setdefault("end", x.grad is not None))
        return grad

    y.register_hook(hook)
    assert _torch_compat.current_graph_task_id() == -1
    y.sum().backward()
    assert seen["task"] != -1 and seen["executes"] is True
    assert seen["end"] is True  # the callback ran at the end of the backward: the leaf's gradient was in by then


def test_functorch_and_function_apply():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    x = torch.ones(3, requires_grad=True)
    raw = _torch_compat.function_base_apply.__get__(None, Double)
    raw(x).sum().backward()
    assert x.grad.tolist() == [2.0] * 3
    assert not _torch_compat.functorch_transforms_active()
    assert torch.func.vmap(lambda t: t * int(_torch_compat.functorch_transforms_active()))(x).tolist() == [1.0] * 3


def test_torch_function_internals():
    calls = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    depth = _torch_compat.torch_function_stack_len()
    mode = Mode()
    _torch_compat.push_torch_function_mode(mode)
    try:
        assert _torch_compat.torch_function_stack_len() == depth + 1
        torch.ones(1).add(1)
        seen = len(calls)
        with _torch_compat.DisableTorchFunction():
            torch.ones(1).add(1)
            assert len(calls) == seen
            with _torch_compat.EnableTorchFunction():
                torch.ones(1).add(1)
                assert len(calls) > seen
    finally:
        assert _torch_compat.pop_torch_function_mode() is mode

    class Plain(torch.Tensor):
        __torch_function__ = _torch_compat.disabled_torch_function_impl

    assert type(torch.ones(2).as_subclass(Plain) + 1) is torch.Tensor

    class Wrapped(torch.Tensor):
        pass

    assert type(torch.ones(2).as_subclass(Wrapped) + 1) is Wrapped
    with _torch_compat.DisableTorchFunctionSubclass():
        assert type(torch.ones(2).as_subclass(Wrapped) + 1) is torch.Tensor


def test_dynamo_compiling_frame_is_true_while_dynamo_compiles_only():
    """True in the Python dynamo runs while it compiles a frame (a planner here; guards are built there too),
    false eagerly and in the eager code a compiled function runs (a disabled function, a graph break's)."""
    seen = []

    @_trace.constant_result
    def planner(n):
        seen.append(("planner", _torch_compat.dynamo_compiling_frame()))
        return n

    @torch._dynamo.disable
    def eager_part(x):
        seen.append(("eager part", _torch_compat.dynamo_compiling_frame()))
        return x + 1

    assert not _torch_compat.dynamo_compiling_frame()
    torch._dynamo.reset()
    out = torch.compile(lambda x: eager_part(x * planner(2)), backend="eager")(torch.ones(2))
    assert out.tolist() == [3.0, 3.0]
    assert set(seen) == {("planner", True), ("eager part", False)}  # (the planner may run again: a restart)
    assert not _torch_compat.dynamo_compiling_frame()


def test_fake_tensors_einsum_and_groups(tmp_path):
    with torch._subclasses.fake_tensor.FakeTensorMode():
        assert isinstance(torch.ones(2), _torch_compat.FakeTensor)
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    assert torch.equal(_torch_compat.einsum_entry("ij,jk->ik", [a, b], path=None), torch.einsum("ij,jk->ik", a, b))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        assert _torch_compat.resolve_process_group(group.group_name) is group
    finally:
        dist.destroy_process_group()
