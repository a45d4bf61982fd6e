"""The one exchange (``einshard.comm.exchange``): its transports, eager and traced, against whole tensors.

Transition exchanges (ownership swaps, mesh-dimension moves, many-peer
repartitions), halos and rolls all run on :class:`einshard.comm.exchange.Exchange`.
Values and gradients are compared with whole tensors in one process, with
even and uneven shards, on 1-D and 2-D meshes; bytes with ``es.explain``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import einshard as es
from einshard.core._split import compute_split_shapes
from einshard.comm.exchange import Exchange, runs_exchange
from einshard.core.layout import Layout
from einshard.testing import local_block
from test_halo import ref_pad

DT = torch.float64

# formula, global shape: even and uneven (default split shapes of odd sizes)
TRANSITIONS = [
    ("a/dp b/tp -> a/tp b/dp", (8, 12)),  # swap: whole blocks received in place, diagonal ranks keep
    ("a/dp b/tp -> a/tp b/dp", (7, 10)),
    ("a/dp b -> a/tp b", (8, 6)),  # mesh-dimension move: contiguous views sent as they are
    ("a/dp b -> a/tp b", (7, 5)),
    ("a/dp b/tp -> a b/dp-tp", (6, 16)),  # several peers, strided pieces (packed)
    ("a/dp b/tp -> a b/dp-tp", (5, 13)),
    ("a b/dp c/tp -> a/tp b c/dp", (3, 6, 5)),
]


def _randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _split(mesh, formula, gshape):
    """``shapes=`` holding the default split of every axis over every mesh dimension (uneven sizes)."""
    names = formula.split("->")[0].replace("/dp", "").replace("/tp", "").split()
    if len(set(gshape)) == 1:  # the flat form (the one traced code accepts)
        return {label: compute_split_shapes(gshape[0], mesh.size(mesh.dims(label))) for label in ("dp", "tp")}
    return {label: {a: compute_split_shapes(n, mesh.size(mesh.dims(label))) for a, n in zip(names, gshape)}
            for label in ("dp", "tp", "dp-tp")}


def _check_transition(mesh, formula, gshape, seed, make=None):
    """``make(shapes)``: the function to check (default: eager ``es.einshard``)."""
    src, dst = (s.strip() for s in formula.split("->"))
    shapes = _split(mesh, formula, gshape)
    whole, cot = _randn(gshape, seed), _randn(gshape, seed + 100)
    x = local_block(whole, src, mesh, shapes=shapes).clone().requires_grad_()
    y = (make or (lambda sh: lambda t: es.einshard(formula, t, mesh=mesh, shapes=sh)))(shapes)(x)
    torch.testing.assert_close(y, local_block(whole, dst, mesh, shapes=shapes), msg=f"{formula} {gshape} value")
    y.backward(local_block(cot, dst, mesh, shapes=shapes))
    torch.testing.assert_close(x.grad, local_block(cot, src, mesh, shapes=shapes), msg=f"{formula} {gshape} grad")
    return x, shapes


@pytest.mark.ranks(8)
def test_transition_exchanges_values_gradients_and_bytes(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    for k, (formula, gshape) in enumerate(TRANSITIONS):
        x, shapes = _check_transition(mesh, formula, gshape, k)
        plan = es.explain(formula, x.detach(), mesh=mesh, shapes=shapes)
        assert "exchange" in str(plan), str(plan)
        with es.count_communication() as stats:
            es.einshard(formula, x.detach(), mesh=mesh, shapes=shapes)
        sent = torch.tensor([float(stats.filter(kind="all_to_all_v").sent_bytes)], dtype=DT)
        dist.all_reduce(sent)
        assert sent.item() / dist.get_world_size() == pytest.approx(plan.forward_bytes), (formula, str(stats))
        # a non-contiguous input: its pieces are copied before they are sent, the rest read in place
        xt = x.detach().transpose(0, 1).contiguous().transpose(0, 1)
        torch.testing.assert_close(es.einshard(formula, xt, mesh=mesh, shapes=shapes),
                                   es.einshard(formula, x.detach(), mesh=mesh, shapes=shapes))


@pytest.mark.ranks(4, timeout=600)
def test_transition_exchange_traced_matches_eager():
    """Under torch.compile the exchange is one functional all-to-all; values and gradients as eager."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = es.wrap_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    torch._dynamo.reset()
    for k, (formula, gshape) in enumerate([("a/dp b/tp -> a/tp b/dp", (8, 12)), ("a/dp b/tp -> a/tp b/dp", (6, 6))]):
        def make(shapes, f=formula):
            return torch.compile(lambda t: es.einshard(f, t, mesh=mesh, shapes=shapes), fullgraph=True,
                                 backend="aot_eager")

        _check_transition(mesh, formula, gshape, k, make)


def _local_exchange(shape, runs):
    """A one-rank exchange of ``shape`` (``runs`` per dim), with its output shape."""
    out = [sum(r[2] for r in rs) for rs in runs]
    return Exchange(None, shape, out, [runs], [runs])


def test_local_exchange_views_packing_and_adjoint():
    """Multi-run pieces (packed), blank boxes set to fill, and the adjoint sums back (gradcheck)."""
    x = _randn((4, 5), 0).requires_grad_()
    runs = (((2, 0, 2), (0, 2, 2)), ((1, 0, 3),))  # rows 2,3 then 0,1; columns 1..3
    ex = _local_exchange((4, 5), runs)
    y = ex(x)
    torch.testing.assert_close(y, torch.cat([x[2:4, 1:4], x[0:2, 1:4]]))
    torch.autograd.gradcheck(lambda t: ex(t), (x,))
    torch.autograd.gradgradcheck(lambda t: ex(t), (x,))
    stay = (((0, 1, 4),), ((1, 0, 3),))
    padded = Exchange(None, (4, 5), (6, 3), [stay], [stay],
                      blank=[((0, 1), (0, 3)), ((5, 1), (0, 3))])
    torch.testing.assert_close(padded(x, -1.0), torch.cat([torch.full((1, 3), -1.0, dtype=DT), x[:, 1:4],
                                                            torch.full((1, 3), -1.0, dtype=DT)]))
    torch.autograd.gradcheck(lambda t: padded(t, 2.0), (x,))


def test_layout_exchange_without_a_mesh_is_local():
    layout = Layout(("a", "b"), (4, 3), ((), ()), (None, None))
    ex = runs_exchange(layout, layout, (), None, lambda i, owner, dest: ((0, 1, 4),), (0,), {0: 5}, [((0, 1), (0, 3))])
    x = _randn((4, 3), 1)
    torch.testing.assert_close(ex(x, 7.0), torch.cat([torch.full((1, 3), 7.0, dtype=DT), x]))


HALOS = [  # spec, global shape, halos, boundary, shapes
    ("h/tp w", (16, 3), {"h": 1}, "periodic", None),  # 1-row pieces received in place
    ("h/tp w", (13, 3), {"h": (2, 1)}, "constant", None),  # uneven, fill folded into the exchange
    ("w h/tp", (3, 16), {"h": 2}, "replicate", None),  # strided pieces (packed), repeated edge cells
    ("h/tp w", (11, 4), {"h": 3, "w": 1}, "periodic", {"tp": [3, 0, 2, 0, 1, 2, 3, 0]}),  # empty blocks
]


@pytest.mark.ranks(8)
def test_halo_and_roll_exchanges_one_d_mesh(mesh_8):
    mesh = es.wrap_mesh(mesh_8)
    for k, (spec, gshape, halos, boundary, shapes) in enumerate(HALOS):
        names = spec.replace("/tp", "").split()
        widths = {names.index(a): (w, w) if isinstance(w, int) else w for a, w in halos.items()}
        whole, h = _randn(gshape, k), names.index("h")
        split = shapes["tp"] if shapes else compute_split_shapes(gshape[h], 8)
        x = local_block(whole, spec, mesh, shapes={"tp": split}).clone().requires_grad_()
        y = es.einhalo(spec, x, halos, boundary=boundary, fill=-2.0, mesh=mesh, shapes={"tp": split})
        start, n = sum(split[: dist.get_rank()]), split[dist.get_rank()]
        want = ref_pad(whole, widths, boundary, fill=-2.0).narrow(h, start, n + sum(widths[h]))
        torch.testing.assert_close(y, want, msg=f"halo {spec} {halos} {boundary}")
        # the gradient is the adjoint: <halo(x), c> == <x, grad>, summed over the ranks (linear: fill 0)
        y = es.einhalo(spec, x, halos, boundary=boundary, mesh=mesh, shapes={"tp": split})
        c = _randn(tuple(y.shape), k + 50 + dist.get_rank())
        y.backward(c)
        dots = torch.stack([(y.detach() * c).sum(), (x.detach() * x.grad).sum()])
        dist.all_reduce(dots)
        assert abs(dots[0] - dots[1]) < 1e-9 * (1 + abs(dots[0])), (spec, halos, boundary, dots)
    # roll with uneven split shapes against torch.roll
    for k, shapes in enumerate([{"tp": compute_split_shapes(13, 8)}, {"tp": [3, 1, 2, 2, 0, 3, 1, 1]}]):
        whole = _randn((13, 2), k)
        x = local_block(whole, "h/tp w", mesh, shapes=shapes).clone().requires_grad_()
        y = es.einroll("h/tp w", x, {"h": 5}, mesh=mesh, shapes=shapes)
        torch.testing.assert_close(y, local_block(torch.roll(whole, 5, 0), "h/tp w", mesh, shapes=shapes))
        cot = _randn((13, 2), k + 9)
        y.backward(local_block(cot, "h/tp w", mesh, shapes=shapes))
        torch.testing.assert_close(x.grad, local_block(torch.roll(cot, -5, 0), "h/tp w", mesh, shapes=shapes))
