"""CUDA: formulas, named collectives and einfft on CUDA tensors, and the device of every tensor they make.

Marked ``cuda``: deselected where CUDA (or, for ``devices=2``, a second GPU) is missing (tests/conftest.py).
Over gloo (one GPU suffices, both ranks on it) only all-reduces run, as gloo moves CUDA tensors for those
alone; over NCCL (a GPU per rank) every collective does. The checks are module-level functions of a
device and a mesh, compared with the same computation on whole tensors in one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

import einshard as es
from einshard.helpers import compute_split_shapes
from einshard.testing import MeshSpec, local_block

DT = torch.float64
MESH_2 = MeshSpec((2,), ("tp",))


def gen(*shape, seed, device, dtype=DT):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).to(device)


def err(a, b) -> float:
    return (a.detach() - b.detach()).abs().max().item() if a.numel() else 0.0


def agree_errors(errs: dict, tol: float = 1e-10) -> None:
    names = sorted(errs)
    t = torch.tensor([float(errs[n]) for n in names], dtype=DT)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    bad = {n: v for n, v in zip(names, t.tolist()) if not v <= tol}
    assert not bad, f"errors above {tol}: {bad}"


class _Devices(TorchDispatchMode):
    """The device types of the tensors every aten op returns while active, by op."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, set] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.seen.setdefault(str(func), set()).add(t.device.type)
        return out


def off_device(device, fn, *args, **kwargs) -> dict:
    """The ops that made a tensor off ``device`` while ``fn`` ran (planned by a first call)."""
    fn(*args, **kwargs)  # plans are made (and cached) here; the second call is the steady state
    with _Devices() as mode:
        fn(*args, **kwargs)
    return {op: kinds for op, kinds in mode.seen.items() if kinds - {torch.device(device).type, "meta"}}


# -- the checks -----------------------------------------------------------------------------------------


def local_case(device) -> dict:
    x, w = gen(5, 4, seed=1, device=device), gen(3, 4, seed=2, device=device)
    y = es.einshard("b c, h c -> b h", x, w)
    f = es.einfft("b x y -> b kx ky", x.reshape(5, 2, 2), {"x": "kx", "y": "ky"})
    assert y.device == x.device and f.device == x.device
    assert not off_device(device, es.einshard, "b c, h c -> b h", x, w)
    return {"einshard": err(y, x @ w.T), "einfft": err(f, torch.fft.fftn(x.reshape(5, 2, 2), dim=(1, 2)))}


def reduce_case(mesh, device) -> dict:
    """A formula and named collectives whose only communication is all-reduce (gloo moves CUDA tensors then)."""
    x, w, v = gen(5, 6, seed=3, device=device), gen(3, 6, seed=4, device=device), gen(6, seed=5, device=device)
    xl = local_block(x, "b c/tp", mesh).requires_grad_()
    wl = local_block(w, "h c/tp", mesh).requires_grad_()
    y = es.einshard("b c/tp, h c/tp -> b h", xl, wl, mesh=mesh)  # partial sums, all-reduced
    assert y.device == xl.device
    assert not off_device(device, es.einshard, "b c/tp, h c/tp -> b h", xl, wl, mesh=mesh)

    vp = v.clone().requires_grad_()

    @es.shard_map(("b/tp c", "c"), "", mesh=mesh)
    def loss_fn(xb, p):  # p is replicated: its gradient is summed over tp (pvary's all-reduce)
        assert es.axis_index("tp").device.type == mesh.device_type
        return es.psum((xb * p).square().sum(), "tp")

    u = gen(6, 6, seed=11, device=device)
    ul = local_block(u, "b/tp c", mesh)
    loss = loss_fn(ul, vp)
    loss.backward()
    vr = v.clone().requires_grad_()
    ref = (u * vr).square().sum()
    ref.backward()
    assert not off_device(device, loss_fn, ul, vp)
    return {"formula": err(y, x @ w.T), "loss": err(loss, ref), "grad": err(vp.grad, vr.grad)}


def nccl_case(mesh, device) -> dict:
    """Every kind of collective: an uneven gather, a transpose FFT, a four-step FFT (twiddles), an inverse
    real four-step FFT (weights), a shard_map step."""
    shapes = {"tp": [3, 2]}
    x = gen(5, 4, seed=6, device=device)
    xl = local_block(x, "b/tp c", mesh, shapes)
    whole = es.einshard("b/tp c -> b c", xl, mesh=mesh, shapes=shapes)
    assert not off_device(device, es.einshard, "b/tp c -> b c", xl, mesh=mesh, shapes=shapes)

    z = gen(8, 6, seed=7, device=device)
    zl = local_block(z, "x/tp y", mesh)
    f = es.einfft("x/tp y -> kx ky/tp", zl, {"x": "kx", "y": "ky"}, mesh=mesh)
    s = gen(24, seed=8, device=device, dtype=torch.complex128)
    sl = local_block(s, "x/tp", mesh)
    g = es.einfft("x/tp -> kx/tp", sl, {"x": "kx"}, mesh=mesh)
    assert not off_device(device, es.einfft, "x/tp -> kx/tp", sl, {"x": "kx"}, mesh=mesh)
    h = torch.fft.rfft(gen(24, seed=9, device=device))  # 13 frequencies: [7, 6]
    split = {"tp": {"kx": compute_split_shapes(13, 2)}}
    hl = local_block(h, "kx/tp", mesh, split)
    r = es.einfft("kx/tp -> x/tp", hl, {"kx": "x"}, mesh=mesh, shapes=split, real=True, inverse=True,
                  signal_sizes={"x": 24})
    assert {t.device for t in (whole, f, g, r)} == {x.device}

    wp = gen(3, 4, seed=10, device=device).requires_grad_()

    @es.shard_map(("b/tp c", "h c"), "// tp", mesh=mesh, shapes=shapes)
    def step(xb, p):
        assert es.axis_index("tp").device.type == mesh.device_type
        return es.einshard("b/tp h -> // tp", torch.tanh(es.einshard("b/tp c, h c -> b/tp h", xb, p)) ** 2)

    part = step(xl, wp)
    part.backward()
    total = part.detach().clone()
    dist.all_reduce(total, group=mesh.group("tp"))
    wr = wp.detach().clone().requires_grad_()
    ref = (torch.tanh(x @ wr.T) ** 2).sum()
    ref.backward()
    return {
        "gather": err(whole, x),
        "transpose fft": err(f, local_block(torch.fft.fftn(z), "kx ky/tp", mesh)),
        "four-step fft": err(g, local_block(torch.fft.fft(s), "kx/tp", mesh)),
        "inverse real four-step": err(r, local_block(torch.fft.irfft(h, n=24), "x/tp", mesh)),
        "step loss": err(total, ref),
        "step grad": err(wp.grad, wr.grad),
    }


_NCCL: dict = {}


def nccl_mesh():
    """A 1-D ``tp`` mesh on NCCL over every rank of the pool, one GPU per rank (made once per process)."""
    if "mesh" not in _NCCL:
        torch.cuda.set_device(dist.get_rank())
        group = dist.new_group(backend="nccl")
        _NCCL["mesh"] = es.wrap_mesh(DeviceMesh.from_group(group, "cuda", mesh_dim_names=("tp",)))
    return _NCCL["mesh"]


# -- the tests ------------------------------------------------------------------------------------------


def test_off_device_sees_tensors_made_elsewhere():  # (runs everywhere: the detector itself)
    def make():
        return torch.arange(3) + torch.tensor(1, dtype=torch.int64)

    assert set(off_device("cuda", make)) >= {"aten.arange.default", "aten.add.Tensor"}
    assert not off_device("cpu", make)



@pytest.mark.cuda
def test_local_formula_and_fft_on_cuda():
    errs = local_case("cuda")
    assert max(errs.values()) < 1e-10, errs


@pytest.mark.cuda
@pytest.mark.ranks(2, checks=False)  # checks agree on host flags over gloo: not the operands' device
def test_all_reduce_formula_and_shard_map_on_cuda_over_gloo():
    agree_errors(reduce_case(es.wrap_mesh(MESH_2.build()), "cuda"))


@pytest.mark.cuda(devices=2)
@pytest.mark.ranks(2, checks=False)
def test_collectives_einfft_and_shard_map_over_nccl():
    mesh = nccl_mesh()
    errs = reduce_case(mesh, f"cuda:{dist.get_rank()}")
    errs.update(nccl_case(mesh, f"cuda:{dist.get_rank()}"))
    agree_errors(errs)
