"""``es.explain``: the plan a distributed formula would run, without running it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.mesh import resolve_mesh
from ..core._table import text_table
from ..core.layout import MeshShape
from ..core.policy import PlanPolicy, resolve_policy
from ..errors import EinshardError
from ..notation import expand, freeze_families
from ..params.formula import explain_duties
from ..params.state import gather_formula
from ..params.store import get_parameter_state
from ..plan.contraction import ANY
from ..plan.local import freeze_sizes
from ..runtime.distributed import plan_distributed

__all__ = ["explain", "Explanation"]


@dataclass(frozen=True)
class Row:
    """One collective (or local step) of a plan."""

    phase: str  # "forward" or "backward"
    tensor: str  # "operand 0", "operand 1 (pvary)", "result", "step 2: operand 0", ...
    move: str  # "all-gather along c", "all-reduce", "local slice", ...
    mesh_dims: str  # "tp", "dp-sp", "" for local steps
    bytes_per_rank: float


@dataclass(frozen=True)
class Explanation:
    """The chosen plan and its alternatives; ``str()`` is a readable table.

    ``rows`` lists every step (forward and backward) of the chosen plan;
    ``alternatives`` lists ``(description, cost)`` for every candidate the
    planner priced, best first (the first is the chosen one).
    """

    formula: str
    policy: PlanPolicy
    local: bool
    rows: tuple[Row, ...]
    alternatives: tuple[tuple[str, dict], ...]
    # (operand index, mesh dims): gradients the formula leaves partial for their gradient duty to sum
    grad_partials: tuple[tuple[int, str], ...] = ()

    @property
    def forward_bytes(self) -> float:
        return sum(r.bytes_per_rank for r in self.rows if r.phase == "forward")

    @property
    def backward_bytes(self) -> float:
        return sum(r.bytes_per_rank for r in self.rows if r.phase == "backward")

    @property
    def collectives(self) -> int:
        return sum(1 for r in self.rows if r.mesh_dims)

    def __str__(self) -> str:
        lines = [f"einshard plan for {self.formula!r} (policy: {self.policy.name})"]
        if self.local:
            lines.append("  local formula: one torch call, no communication")
            for k, dims in self.grad_partials:  # every rank computes the same value (einshard.params.replicated)
                lines.append(f"  operand {k}: gradient kept on group rank 0 of {dims}, zeros elsewhere; its gradient "
                             "duty sums it")
            return "\n".join(lines)
        header = ("phase", "tensor", "move", "mesh dim", "bytes/rank")
        rows = [(r.phase, r.tensor, r.move, r.mesh_dims or "-", f"{r.bytes_per_rank:,.0f}") for r in self.rows]
        lines += text_table(header, rows or [("-", "-", "no communication", "-", "0")], indent="  ", right=(4,))
        lines.append(
            f"  total: forward {self.forward_bytes:,.0f} B, backward {self.backward_bytes:,.0f} B, "
            f"{self.collectives} collective(s)"
        )
        for k, dims in self.grad_partials:
            lines.append(f"  operand {k}: gradient left partial over {dims}; its gradient duty sums it")
        if len(self.alternatives) > 1:
            lines.append("alternatives (best first):")
            for text, cost in self.alternatives[: min(len(self.alternatives), 8)]:
                lines.append(
                    f"  fwd {cost['forward_bytes']:>12,.0f} B  bwd {cost['backward_bytes']:>12,.0f} B  "
                    f"calls {cost['collectives']:>2}  peak {cost['peak_bytes']:>12,.0f} B  {text}"
                )
            if len(self.alternatives) > 8:
                lines.append(f"  ... and {len(self.alternatives) - 8} more")
        return "\n".join(lines)


def _schedule_rows(plan) -> tuple[Row, ...]:
    mesh = plan.problem.mesh
    itemsize = plan.problem.itemsize
    rows = []
    multi = len(plan.chosen.steps) > 1
    for n, (_indices, _axes, cand) in enumerate(plan.chosen.steps):
        prefix = f"step {n + 1}: " if multi else ""
        for move in cand.moves:
            for phase, steps in (("forward", move.forward), ("backward", move.backward)):
                for step in steps:
                    dims = "-".join(step.dims) if step.is_collective else ""
                    sent = step.bytes_per_rank(mesh, itemsize)
                    rows.append(Row(phase, prefix + move.what, step.describe(), dims, sent))
    order = {"forward": 0, "backward": 1}
    rows.sort(key=lambda r: order[r.phase])
    return tuple(rows)


def _describe_schedule(schedule, mesh: MeshShape) -> str:
    if len(schedule.steps) == 1:
        return schedule.steps[0][2].describe_roles(mesh)
    return "; ".join(f"contract {tuple(indices)} [{cand.describe_roles(mesh)}]" for indices, _, cand in schedule.steps)


def explain(
    formula: str,
    *tensors_or_shapes,
    mesh=None,
    shapes=None,
    sizes=None,
    families=None,
    optimize=None,
    policy=None,
    dtype=None,
) -> Explanation:
    """The plan ``einshard`` would run for these operands, without running it.

    Operands are tensors or local shapes (what this rank holds; ``dtype``,
    default float32, sets the element size for shapes). A parameter stored
    sharded (``store=``) is explained as its module uses it: gathered first
    (rows ``operand k: gather``), then the formula on its compute block. The mesh may be a
    virtual one (``es.Mesh.virtual((2, 4), ("dp", "tp"))``): explaining
    needs no process group.

    >>> mesh = es.Mesh.virtual((4,), ("tp",))
    >>> print(es.explain("b c/tp, h c/tp -> b h", (8, 4), (16, 4), mesh=mesh))  # doctest: +SKIP
    """
    pol = resolve_policy(optimize, policy)
    frozen = freeze_families(families)
    parsed = expand(formula, frozen)
    local_shapes, itemsizes = [], []
    default_itemsize = torch.empty((), dtype=dtype or torch.float32, device="meta").element_size()
    for k, t in enumerate(tensors_or_shapes):
        if isinstance(t, torch.Tensor):
            local_shapes.append(tuple(t.shape))
            itemsizes.append(t.element_size())
        elif isinstance(t, (tuple, list, torch.Size)):
            local_shapes.append(tuple(int(s) for s in t))
            itemsizes.append(default_itemsize)
        else:
            raise EinshardError(f"explain: operand {k} must be a tensor or a shape, got {type(t).__name__}")
    if parsed.is_local:
        kept = tuple((k, "-".join(d)) for k, d in enumerate(explain_duties(parsed, tensors_or_shapes))
                     if d is not None and d != ANY)
        return Explanation(formula, pol, True, (), (), kept)
    mesh = resolve_mesh(mesh)
    gathers = _stored_gathers(parsed, tensors_or_shapes, local_shapes, mesh, pol)
    plan = plan_distributed(
        parsed, local_shapes, max(itemsizes, default=default_itemsize), mesh, shapes, freeze_sizes(sizes), pol, frozen,
        explain_duties(parsed, tensors_or_shapes),
    )
    if plan.local_error is not None:
        raise EinshardError(plan.local_error)
    shape = MeshShape.of(mesh)
    alternatives = tuple(
        (
            _describe_schedule(s, shape),
            {
                "forward_bytes": s.cost.fwd_bytes,
                "backward_bytes": s.cost.bwd_bytes,
                "collectives": s.cost.fwd_calls + s.cost.bwd_calls,
                "peak_bytes": s.cost.peak_bytes,
            },
        )
        for s in plan.schedules
    )
    partials = tuple(
        (k, "-".join(d for d in shape.names if d in dims)) for k, dims in enumerate(plan.grad_partials()) if dims
    )
    return Explanation(formula, pol, False, gathers + _schedule_rows(plan), alternatives, partials)


def _stored_gathers(parsed, tensors, local_shapes, mesh, pol) -> tuple:
    """The gathers of the operands stored sharded (``store=``, ZeRO-3) that the formula uses in their compute
    layout: their rows (``operand k: gather``), and their compute blocks' shapes put in ``local_shapes``."""
    rows = []
    for k, t in enumerate(tensors):
        state = get_parameter_state(t) if isinstance(t, torch.nn.Parameter) else None
        if state is None or state.store is None or k >= len(parsed.inputs):
            continue
        if " ".join(map(str, parsed.inputs[k].items)) == state.layout:  # the storage itself (its gather formula)
            continue
        dim = state.store_axis
        assert dim is not None and state.spec is not None  # a stored parameter's state
        n = mesh.size(tuple(d for d in mesh.names if d in state.store.split("-")))
        whole = state.global_shape[dim] if state.global_shape is not None else t.shape[dim] * n
        sizes = {} if state.global_shape is None else {
            a.name: m for a, m in zip(state.spec.axes, state.global_shape) if a.mesh}
        moved = explain(gather_formula(state), tuple(t.shape), mesh=mesh, sizes=sizes, policy=pol,
                        dtype=t.dtype)
        rows += [Row(r.phase, f"operand {k}: gather ({gather_formula(state)})", r.move, r.mesh_dims,
                     r.bytes_per_rank) for r in moved.rows]
        local_shapes[k] = tuple(whole if i == dim else s for i, s in enumerate(t.shape))
    return tuple(rows)
