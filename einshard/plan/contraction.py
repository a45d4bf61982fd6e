"""Contractions: choose operand layouts that make a local ``einsum`` valid.

For every mesh dimension the planner picks a *role*:

- ``("R",)``: every operand replicated over it; the local result is too;
- ``("S", x)``: axis ``x`` sharded over it in every operand that has ``x``
  (alike: same split shapes); the result is sharded on ``x`` if the output
  keeps ``x``, and partial otherwise (``x`` is summed);
- ``("P", i)``: operand ``i`` stays partial over it; the result is partial.

An operand that neither holds the sharded axis nor is the partial one feeds
rank-specific computation, so it is marked varying (``pvary``): identity
forward, gradients summed over the dimension in backward.

Each candidate's price is the sum of its transitions (operands to their
targets, result to the output), forward and backward (the reverse
transitions), priced by the policy. Roles per dimension are few (replicated,
the axes that dimension shards anywhere, the partial operands), so the
candidates are enumerated.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from ..core._cache import cached
from ..core._split import compute_split_shapes
from ..core.layout import Layout, MeshShape, broadcast_size
from ..core.policy import PlanPolicy
from ..errors import EinshardError
from .cost import Cost, price
from .transition import Step, plan_gradient, plan_transition

__all__ = ["Problem", "Candidate", "Schedule", "plan_contraction", "plan_schedule", "duty_dims", "ANY"]


@dataclass(frozen=True)
class Problem:
    """A contraction to plan: operand layouts, the requested output layout, the mesh.

    ``summed`` holds the output's partial dimensions that must carry per-rank
    contributions (the formula sums over an axis or has a partial input);
    ``fixed`` holds axes that may not be sharded (diagonals, ``...``,
    broadcast axes).
    """

    operands: tuple[Layout, ...]
    output: Layout
    mesh: MeshShape
    itemsize: int
    summed: frozenset = frozenset()
    fixed: frozenset = frozenset()
    free_output: bool = False  # an intermediate: keep whatever layout the einsum produces
    # per operand (empty: none): the mesh dimensions its gradient may come back partial over
    # (a gradient duty reduces it later), ``ANY`` for a pending duty, ``None`` for no duty
    grad_duties: tuple = ()

    def duty(self, k: int):
        return self.grad_duties[k] if self.grad_duties else None


ANY = "any"  # a pending gradient duty: the planner leaves the gradient partial wherever it varies


def duty_dims(duties, mesh_names) -> tuple:
    """Planner duties: each operand's duty groups (``("dp", "sp-tp")``) as a set of atomic mesh dimensions.

    ``None`` (no duty) and :data:`ANY` pass through; a name not in the mesh is an error.

    >>> none, dims = duty_dims([None, ("dp", "sp-tp")], ("dp", "sp", "tp"))
    >>> none, sorted(dims)
    (None, ['dp', 'sp', 'tp'])
    """
    out = []
    for k, duty in enumerate(duties):
        if duty is None or duty == ANY:
            out.append(duty)
            continue
        dims = set()
        for g in duty:
            for c in g.split("-"):
                if c not in mesh_names:
                    raise EinshardError(
                        f"operand {k} has a gradient duty over {g!r}, but {c!r} is not in the mesh {list(mesh_names)}"
                    )
                dims.add(c)
        out.append(frozenset(dims))
    return tuple(out)


@dataclass(frozen=True)
class Move:
    """One planned transition of a candidate: what it moves, forward and backward."""

    what: str  # "operand 0", "operand 1 (pvary)", "result"
    src: Layout
    dst: Layout
    forward: tuple[Step, ...]
    backward: tuple[Step, ...]


@dataclass(frozen=True)
class Candidate:
    """One way to run a contraction, with its transitions and cost."""

    roles: tuple
    targets: tuple[Layout, ...]  # the operands as the local einsum sees them
    chains: tuple  # per operand: the layouts it passes through, from its own to the einsum's
    result: Layout  # the local einsum's result
    moves: tuple[Move, ...]
    cost: Cost
    embedded: Layout | None = None  # the result after embedding it as contributions (E roles)
    grads: tuple = ()  # per operand: the layout its gradient comes back in, when a duty changes it

    def grad_of(self, k: int) -> Layout | None:
        return self.grads[k] if self.grads else None

    def describe_roles(self, mesh: MeshShape) -> str:
        parts = []
        for name, role in zip(mesh.names, self.roles):
            if role[0] == "R":
                parts.append(f"{name}: replicated")
            elif role[0] == "S":
                parts.append(f"{name}: shard {role[1]}")
            elif role == ("E", None):
                parts.append(f"{name}: replicated, kept on rank 0 as the contribution")
            elif role[0] == "E":
                parts.append(f"{name}: shard {role[1]}, zero-padded into contributions")
            else:
                parts.append(f"{name}: partial operand {role[1]}")
        return ", ".join(parts)


def _axis_roles(problem: Problem, dim: str) -> list:
    """The roles worth trying for one mesh dimension."""
    out_axes = set(problem.output.axes)
    mentioned: list[str] = []
    for layout in problem.operands + (problem.output,):
        i = layout.owner(dim)
        if i is not None and layout.axes[i] not in mentioned:
            mentioned.append(layout.axes[i])
    partial_ops = [("P", k) for k, op in enumerate(problem.operands) if dim in op.partial]
    roles: list[tuple] = [("R",)] + [("S", x) for x in mentioned if x not in problem.fixed] + partial_ops
    if dim in problem.summed:
        summed_axes = []
        for op in problem.operands:
            for x in op.axes:
                if x not in out_axes and x not in problem.fixed and x not in summed_axes:
                    summed_axes.append(x)
        contributing = [r for r in roles if (r[0] == "S" and r[1] not in out_axes) or r[0] == "P"]
        contributing += [("S", x) for x in summed_axes if ("S", x) not in contributing]
        # embeddings: compute sharded on an output axis (or replicated) and embed the result as
        # contributions (zero-padded blocks, or the value on group rank 0 and zeros elsewhere)
        shardable_out = [x for x in problem.output.axes if x not in problem.fixed]
        contributing += [("E", x) for x in shardable_out] + [("E", None)]
        roles = contributing
    return roles


def _splits_for(problem: Problem, axis: str, dims: tuple[str, ...], size: int):
    for layout in (problem.output,) + problem.operands:
        if axis in layout.axes:
            i = layout.axes.index(axis)
            if layout.shard[i] == dims:
                return layout.splits[i]
    return tuple(compute_split_shapes(size, problem.mesh.size(dims)))


def _layout_for(base: Layout, roles, names, problem: Problem, partial_dims) -> Layout:
    shard, splits = [], []
    for axis, size in zip(base.axes, base.sizes):
        dims = tuple(d for d, r in zip(names, roles) if r in (("S", axis), ("E", axis)))
        shard.append(dims)
        splits.append(_splits_for(problem, axis, dims, size) if dims else None)
    return Layout(base.axes, base.sizes, tuple(shard), tuple(splits), frozenset(partial_dims))


def _move(what: str, src: Layout, dst: Layout, mesh: MeshShape, itemsize: int, metric: str,
          back=None) -> tuple[Move, Cost]:
    """``src -> dst`` forward; backward ``dst -> back`` (default ``src``; a gradient duty's partial layout)."""
    fwd = plan_transition(src, dst, mesh)
    bwd = plan_transition(dst, src, mesh) if back is None else plan_gradient(dst, back, mesh)
    return Move(what, src, dst, fwd, bwd), price(fwd, bwd, mesh, itemsize, metric)


def _sharding_role(role) -> bool:
    """The role shards an axis in the local einsum (``S x`` or the embedding ``E x``)."""
    return role[0] in ("S", "E") and role[1] is not None


def _candidate(problem: Problem, roles, metric: str) -> Candidate | None:
    mesh = problem.mesh
    names = mesh.names
    embedded_axes = {r[1] for r in roles if r[0] == "E" and r[1] is not None}
    if any(r[0] == "S" and r[1] in embedded_axes for r in roles):
        return None  # an embedded axis is sharded only over the dimensions it is embedded over
    moves: list[Move] = []
    cost = Cost()
    targets = []
    live_bytes = 0.0
    chains = []
    grads = []
    for k, op in enumerate(problem.operands):
        own_partial = [d for d, r in zip(names, roles) if r == ("P", k)]
        target = _layout_for(op, roles, names, problem, own_partial)
        varying = {
            d
            for d, r in zip(names, roles)
            if r not in (("R",), ("P", k), ("E", None)) and not (_sharding_role(r) and r[1] in op.axes)
        }
        marked = target.with_partial(target.partial | varying)
        # one transition straight to the marked layout (so its reverse can reduce-scatter),
        # unless the operand is truly partial over a dim it must first reduce, then pvary
        chain = (op, target, marked) if varying & op.partial else (op, marked)
        grad = _grad_layout(op, problem.duty(k), varying)
        grads.append(grad)
        for n, (src, dst) in enumerate(itertools.pairwise(chain)):
            back = grad if n == 0 and grad is not None else src
            move, c = _move(f"operand {k}" + (" (pvary)" if n else ""), src, dst, mesh, problem.itemsize, metric, back)
            if move.forward or move.backward:
                moves.append(move)
            cost += c
        chains.append(chain)
        targets.append(target)
        live_bytes += target.mean_numel(mesh) * problem.itemsize
    out_axes = set(problem.output.axes)
    result_partial = [
        d for d, r in zip(names, roles) if r[0] == "P" or (r[0] == "S" and r[1] not in out_axes)
    ]
    result = _layout_for(problem.output, roles, names, problem, result_partial)
    embedded = result
    embed_dims = tuple(d for d, r in zip(names, roles) if r[0] == "E")
    if embed_dims:
        embedded = _embedded(result, embed_dims)
        move, c = _embed_move(result, embedded, embed_dims, tuple(d for d, r in zip(names, roles) if r == ("E", None)),
                              mesh, problem.itemsize, metric)
        moves.append(move)
        cost += c
    if not problem.free_output:
        move, c = _move("result", embedded, problem.output, mesh, problem.itemsize, metric)
        if move.forward or move.backward:
            moves.append(move)
        cost += c
    live_bytes += max(result.mean_numel(mesh), embedded.mean_numel(mesh)) * problem.itemsize
    cost = Cost(cost.fwd_bytes, cost.bwd_bytes, cost.fwd_calls, cost.bwd_calls, max(cost.peak_bytes, live_bytes))
    kept = tuple(grads) if any(g is not None for g in grads) else ()
    return Candidate(tuple(roles), tuple(targets), tuple(chains), result, tuple(moves), cost, embedded, kept)


def _grad_layout(op: Layout, duty, varying) -> Layout | None:
    """The layout operand ``op``'s gradient comes back in under a gradient duty (``None``: ``op``).

    A duty over dimensions ``G`` leaves the gradient partial over ``G`` (the duty's
    executor sums it later): the adjoint of ``pvary`` is skipped there, and where
    the operand was not varying its gradient is kept on group rank 0 only
    (replicated to partial, no communication). A pending duty (``ANY``) keeps
    the gradient partial exactly where the operand varies.
    """
    if duty is None or op.partial:
        return None
    sharding = {d for dims in op.shard for d in dims}
    keep = (set(varying) if duty == ANY else set(duty)) - sharding
    return op.with_partial(keep) if keep else None


def _embedded(result: Layout, dims: tuple[str, ...]) -> Layout:
    """``result`` with the embedded dimensions turned into contributions (partial)."""
    out = result
    for i, shard in enumerate(result.shard):
        if any(d in dims for d in shard):
            out = out.with_shard(i, (), None)  # an embedded axis is sharded only over embedded dims
    return out.with_partial(result.partial | set(dims))


def _embed_move(result, embedded, dims, at_root, mesh: MeshShape, itemsize: int, metric: str) -> tuple[Move, Cost]:
    """Embedding into contributions: zero-padding forward, a slice back (and a broadcast from
    group rank 0 for a replicated result kept on that rank only). Its memory is the result's,
    counted with the candidate's live bytes."""
    forward = (Step("embed", result, embedded, dims),)
    backward = (Step("embed_adjoint", embedded, result, at_root),)
    cost = replace(price(forward, backward, mesh, itemsize, metric), peak_bytes=0.0)
    return Move("embed", result, embedded, forward, backward), cost


@dataclass(frozen=True)
class Schedule:
    """A contraction as a sequence of local einsums.

    Each step contracts the operands at ``indices`` of the current operand
    list (removing them and appending the result) with ``candidate``'s
    layouts; the last step produces the output.
    """

    steps: tuple  # ((indices, axes of the step's result, candidate), ...)
    cost: Cost


def _needed_axes(operands, keep_out, i, j) -> tuple[str, ...]:
    """Axes of operands ``i`` and ``j`` that the rest of the contraction still needs."""
    later = set(keep_out)
    for k, op in enumerate(operands):
        if k not in (i, j):
            later.update(op.axes)
    out = []
    for axis in operands[i].axes + operands[j].axes:
        if axis in later and axis not in out:
            out.append(axis)
    return tuple(out)


def _sizes_of(operands, axes):
    table: dict = {}
    for op in operands:
        for a, s in zip(op.axes, op.sizes):
            table[a] = broadcast_size(table.get(a, 1), s)
    return tuple(table[a] for a in axes)


_BEAM = 4  # intermediate layouts kept per pair
_EXHAUSTIVE = 4  # up to this many operands every pair order is searched; beyond, greedily


def _pair_problem(problem: Problem, i: int, j: int) -> tuple[Problem, tuple[str, ...]]:
    """Contracting operands ``i`` and ``j`` alone, keeping whatever layout results."""
    axes = _needed_axes(problem.operands, problem.output.axes, i, j)
    free = Layout(axes, _sizes_of(problem.operands, axes), ((),) * len(axes), (None,) * len(axes))
    pair = Problem(
        (problem.operands[i], problem.operands[j]), free, problem.mesh, problem.itemsize,
        fixed=problem.fixed, free_output=True,
        grad_duties=(problem.duty(i), problem.duty(j)) if problem.grad_duties else (),
    )
    return pair, axes


def _shares_axis(problem: Problem, i: int, j: int) -> bool:
    return bool(set(problem.operands[i].axes) & set(problem.operands[j].axes))


@cached(1024)
def plan_schedule(problem: Problem, policy: PlanPolicy) -> tuple[Schedule, ...]:
    """Schedules best first: one einsum over every operand, or pairwise contractions.

    With three or more operands, pairwise orders compete with the single
    einsum. Up to ``_EXHAUSTIVE`` operands every pair is tried (its best
    ``_BEAM`` intermediate layouts), then the rest recursively; with more,
    the cheapest pair that shares an axis is contracted first (greedy, like
    ``opt_einsum``'s greedy path), so planning stays polynomial.
    """
    everything = tuple(range(len(problem.operands)))
    schedules = [
        Schedule(((everything, problem.output.axes, c),), c.cost) for c in plan_contraction(problem, policy)
    ]
    n = len(problem.operands)
    if n >= 3:
        pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
        beam = _BEAM
        if n > _EXHAUSTIVE:
            sharing = [(i, j) for i, j in pairs if _shares_axis(problem, i, j)] or pairs
            best_pair = min(
                sharing,
                key=lambda ij: (plan_contraction(_pair_problem(problem, *ij)[0], policy)[0].cost.key(policy), ij),
            )
            pairs, beam = [best_pair], 1
        for i, j in pairs:
            pair, axes = _pair_problem(problem, i, j)
            seen = set()
            for cand in plan_contraction(pair, policy):
                if cand.result in seen:
                    continue
                seen.add(cand.result)
                rest = tuple(op for k, op in enumerate(problem.operands) if k not in (i, j)) + (cand.result,)
                duties = ()
                if problem.grad_duties:
                    duties = tuple(problem.duty(k) for k in range(n) if k not in (i, j)) + (None,)
                sub = Problem(rest, problem.output, problem.mesh, problem.itemsize, problem.summed, problem.fixed,
                              grad_duties=duties)
                best = plan_schedule(sub, policy)[0]
                schedules.append(Schedule((((i, j), axes, cand),) + best.steps, cand.cost + best.cost))
                if len(seen) == beam:
                    break
    order = sorted(range(len(schedules)), key=lambda k: (schedules[k].cost.key(policy), k))
    return tuple(schedules[k] for k in order)


@cached(4096)
def plan_contraction(problem: Problem, policy: PlanPolicy) -> tuple[Candidate, ...]:
    """Every candidate, best first under ``policy`` (deterministic on every rank)."""
    options = [_axis_roles(problem, d) for d in problem.mesh.names]  # never empty: ("R",) or ("E", None)
    candidates = [c for roles in itertools.product(*options)
                  if (c := _candidate(problem, roles, policy.metric)) is not None]
    order = sorted(range(len(candidates)), key=lambda k: (candidates[k].cost.key(policy), k))
    return tuple(candidates[k] for k in order)
