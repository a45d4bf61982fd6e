"""einconv: values and gradients (input, weight, bias) against F.conv1d/2d/3d on whole tensors.

The reference pads the whole input with the boundary mode (``ref_pad``:
F.pad / modular / clamped indices) and runs ``F.conv*d`` with zero padding
in NC* layout. Gradients of the replicated weight and bias must be the
full gradients on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import einshard as es
from einshard.comm.mesh import Mesh
from einshard.ops.conv import einconv
from einshard.testing import local_block
from test_halo import assert_all, max_err, randn, ref_pad

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def nc_ref(x_nc, w, b, pads, boundary, fill=0.0, dilation=1, groups=1):
    """``x_nc``: (N, C, *S); ``pads``: per spatial dim (left, right)."""
    widths = {2 + i: p for i, p in enumerate(pads)}
    return CONV[len(pads)](ref_pad(x_nc, widths, boundary, fill), w, b, dilation=dilation, groups=groups)


def check_conv(mesh, formula, xshape, wshape, windows, ref, bias_shape=None, shapes=None, seed=0, **kw):
    name = f"{formula} {xshape} {kw} shapes={shapes}"
    left, out_text = [s.strip() for s in formula.split("->")]
    x_text = left.split(",")[0].strip()
    x = randn(xshape, seed, "x").requires_grad_()
    w = randn(wshape, seed, "w").requires_grad_()
    b = randn(bias_shape, seed, "b").requires_grad_() if bias_shape else None
    x_local = local_block(x.detach(), x_text, mesh, shapes=shapes).clone().requires_grad_()
    w_local = w.detach().clone().requires_grad_()
    b_local = b.detach().clone().requires_grad_() if b is not None else None
    y = einconv(formula, x_local, w_local, windows, bias=b_local, mesh=mesh, shapes=shapes, **kw)
    want = ref(x, w, b)
    errors = [(name + " value", max_err(y.detach(), local_block(want.detach(), out_text, mesh, shapes=shapes)))]
    cot = randn(want.shape, seed, "cot")
    want.backward(cot)
    y.backward(local_block(cot, out_text, mesh, shapes=shapes))
    grad_x = x_local.grad if x_local.grad is not None else torch.zeros_like(x_local)
    errors.append((name + " grad x", max_err(grad_x, local_block(x.grad, x_text, mesh, shapes=shapes))))
    errors.append((name + " grad w", max_err(w_local.grad, w.grad)))
    if b is not None:
        errors.append((name + " grad b", max_err(b_local.grad, b.grad)))
    return errors


def run_conv_cases(mesh, cases):
    mesh = es.wrap_mesh(mesh)
    errors = []
    for k, case in enumerate(cases):
        errors += check_conv(mesh, seed=k, **case)
    assert_all(errors, atol=1e-9)


BOUNDS = ("constant", "periodic", "replicate")


def _bchw(fn):
    """Reference for 'b h w c' layouts: permute to NCHW and back."""
    def ref(x, w, b):
        return fn(x.permute(0, 3, 1, 2), w, b).permute(0, 2, 3, 1)
    return ref


@pytest.mark.ranks(8)
def test_conv_1d_mesh(mesh_8):
    cases = []
    for bd in BOUNDS:
        cases += [
            dict(formula="b c h/tp, o c k -> b o h/tp", xshape=(2, 3, 16), wshape=(4, 3, 3), windows={"h": "k"},
                 bias_shape=(4,), boundary=bd,
                 ref=lambda x, w, b, bd=bd: nc_ref(x, w, b, [(1, 1)], bd)),
            # uneven shards with empty blocks, dilated kernel: halos wider than a neighbour's block
            dict(formula="b c h/tp, o c k -> b o h/tp", xshape=(1, 2, 12), wshape=(3, 2, 3), windows={"h": "k"},
                 dilation=3, boundary=bd, shapes=[3, 0, 2, 0, 4, 1, 0, 2],
                 ref=lambda x, w, b, bd=bd: nc_ref(x, w, b, [(3, 3)], bd, dilation=3)),
        ]
    cases += [
        # even kernel with explicit padding, fill value
        dict(formula="b h/tp w c, o c kh kw -> b h/tp w o", xshape=(1, 16, 5, 2), wshape=(3, 2, 4, 3),
             windows={"h": "kh", "w": "kw"}, padding={"h": (1, 2), "w": 1}, fill=0.5,
             ref=_bchw(lambda x, w, b: nc_ref(x, w, b, [(1, 2), (1, 1)], "constant", 0.5))),
        # channels first, output axes permuted
        dict(formula="c h/tp, o c k -> h/tp o", xshape=(2, 8), wshape=(5, 2, 5), windows={"h": "k"},
             boundary="periodic",
             ref=lambda x, w, b: nc_ref(x.unsqueeze(0), w, b, [(2, 2)], "periodic")[0].T),
    ]
    run_conv_cases(mesh_8, cases)


@pytest.mark.ranks(8)
def test_conv_2d_mesh(mesh_2x4):
    f2 = "b h/dp w/tp c, o c kh kw -> b h/dp w/tp o"
    cases = []
    for bd in BOUNDS:
        cases += [
            dict(formula=f2, xshape=(2, 6, 8, 3), wshape=(4, 3, 3, 3), windows={"h": "kh", "w": "kw"},
                 bias_shape=(4,), boundary=bd,
                 ref=_bchw(lambda x, w, b, bd=bd: nc_ref(x, w, b, [(1, 1), (1, 1)], bd))),
            dict(formula=f2, xshape=(1, 5, 7, 2), wshape=(3, 2, 3, 5), windows={"h": "kh", "w": "kw"},
                 boundary=bd, dilation={"w": 2}, shapes={"dp": [4, 1], "tp": [2, 0, 4, 1]},
                 ref=_bchw(lambda x, w, b, bd=bd: nc_ref(x, w, b, [(1, 1), (4, 4)], bd, dilation=(1, 2)))),
        ]
    cases += [
        # batch sharded too: the weight's gradient sums over dp and tp
        dict(formula="b/dp h w/tp c, o c kh kw -> b/dp h w/tp o", xshape=(2, 4, 8, 2), wshape=(3, 2, 3, 3),
             windows={"h": "kh", "w": "kw"}, bias_shape=(3,), boundary="periodic",
             ref=_bchw(lambda x, w, b: nc_ref(x, w, b, [(1, 1), (1, 1)], "periodic"))),
    ]
    run_conv_cases(mesh_2x4, cases)


@pytest.mark.ranks(8)
def test_conv_grouped_and_depthwise(mesh_2x4):
    win = {"h": "kh", "w": "kw"}
    cases = [
        # channel-group axis g: G = 2 groups of 2 input and 3 output channels
        dict(formula="b h/dp w/tp g c, g o c kh kw -> b h/dp w/tp g o", xshape=(1, 4, 8, 2, 2),
             wshape=(2, 3, 2, 3, 3), windows=win, bias_shape=(2, 3), boundary="replicate",
             ref=lambda x, w, b: nc_ref(x.flatten(3).permute(0, 3, 1, 2), w.reshape(6, 2, 3, 3), b.reshape(6),
                                        [(1, 1), (1, 1)], "replicate", groups=2)
             .permute(0, 2, 3, 1).unflatten(3, (2, 3))),
        # depthwise: the channel axis is the group axis
        dict(formula="b h/dp w/tp c, c kh kw -> b h/dp w/tp c", xshape=(2, 4, 8, 3), wshape=(3, 3, 3),
             windows=win, bias_shape=(3,), boundary="periodic",
             ref=_bchw(lambda x, w, b: nc_ref(x, w.unsqueeze(1), b, [(1, 1), (1, 1)], "periodic", groups=3))),
        # depthwise with a channel multiplier m
        dict(formula="b h/dp w/tp c, c m kh kw -> b h/dp w/tp c m", xshape=(1, 4, 8, 2), wshape=(2, 2, 3, 3),
             windows=win, boundary="constant",
             ref=lambda x, w, b: nc_ref(x.permute(0, 3, 1, 2), w.reshape(4, 1, 3, 3), b, [(1, 1), (1, 1)],
                                        "constant", groups=2).permute(0, 2, 3, 1).unflatten(3, (2, 2))),
        # PyTorch convention: groups=2, the weight's c holds C/2 channels
        dict(formula="b h/dp w/tp c, o c kh kw -> b h/dp w/tp o", xshape=(1, 4, 8, 4), wshape=(6, 2, 3, 3),
             windows=win, groups=2, bias_shape=(6,), boundary="constant",
             ref=_bchw(lambda x, w, b: nc_ref(x, w, b, [(1, 1), (1, 1)], "constant", groups=2))),
    ]
    run_conv_cases(mesh_2x4, cases)


@pytest.mark.ranks(8)
def test_conv_3d_mesh(mesh_2x2x2):
    f3 = "b d/dp h/sp w/tp c, o c kd kh kw -> b d/dp h/sp w/tp o"
    win = {"d": "kd", "h": "kh", "w": "kw"}

    def ref3(bd, pads=((1, 1),) * 3):
        return lambda x, w, b: nc_ref(x.permute(0, 4, 1, 2, 3), w, b, list(pads), bd).permute(0, 2, 3, 4, 1)

    cases = [dict(formula=f3, xshape=(1, 4, 4, 6, 2), wshape=(2, 2, 3, 3, 3), windows=win, bias_shape=(2,),
                  boundary=bd, ref=ref3(bd)) for bd in BOUNDS]
    cases.append(dict(formula=f3, xshape=(1, 3, 5, 2, 1), wshape=(2, 1, 3, 3, 3), windows=win, boundary="periodic",
                      shapes={"dp": [3, 0], "sp": [1, 4], "tp": [0, 2]}, ref=ref3("periodic")))
    run_conv_cases(mesh_2x2x2, cases)


@pytest.mark.ranks(8)
def test_conv_checkpoint_modes_same_gradients(mesh_2x4):
    f2 = "b h/dp w/tp c, o c kh kw -> b h/dp w/tp o"
    cases = []
    for mode in ("full", "conv", False):
        for reentrant in (False, True):
            cases.append(dict(formula=f2, xshape=(1, 6, 8, 2), wshape=(3, 2, 3, 3), windows={"h": "kh", "w": "kw"},
                              bias_shape=(3,), boundary="periodic", checkpoint=mode, use_reentrant=reentrant,
                              ref=_bchw(lambda x, w, b: nc_ref(x, w, b, [(1, 1), (1, 1)], "periodic"))))
    run_conv_cases(mesh_2x4, cases)


def test_conv_local_and_families():
    x = torch.randn(2, 6, 7, 3, dtype=torch.float64)
    w = torch.randn(4, 3, 3, 5, dtype=torch.float64)
    fam = {"s": ("h", "w"), "k": ("kh", "kw")}
    y = einconv("b *s c, o c *k -> b *s o", x, w, {"s": "k"}, families=fam, padding={"s": (1, (2, 2))})
    ref = F.conv2d(x.permute(0, 3, 1, 2), w, padding=(1, 2)).permute(0, 2, 3, 1)
    assert torch.allclose(y, ref)
    with torch.no_grad():
        y2 = einconv("b h w c, o c kh kw -> b h w o", x, w, {"h": "kh", "w": "kw"})
    assert torch.allclose(y2, ref)


def test_conv_errors():
    x = torch.zeros(1, 4, 4, 2)
    w = torch.zeros(3, 2, 3, 3)
    win = {"h": "kh", "w": "kw"}
    f = "b h w c, o c kh kw -> b h w o"
    vmesh = Mesh.virtual((2,), ("sp",))
    with pytest.raises(ValueError, match="stride"):
        einconv(f, x, w, win, stride=2)
    with pytest.raises(ValueError, match="checkpoint"):
        einconv(f, x, w, win, checkpoint="yes")
    with pytest.raises(ValueError, match="'h'.*even effective kernel"):
        einconv(f, x, torch.zeros(3, 2, 2, 3), win)
    with pytest.raises(ValueError, match="padding.*'w'.*length"):
        einconv(f, x, w, win, padding={"w": 2})
    with pytest.raises(ValueError, match="'q'"):
        einconv(f, x, w, {"q": "kh", "w": "kw"})
    with pytest.raises(ValueError, match="weight must be replicated.*'o'"):
        einconv("b h/sp w c, o/sp c kh kw -> b h/sp w o", x, w, win, mesh=vmesh)
    with pytest.raises(ValueError, match="sharding of axis 'h'"):
        einconv("b h/sp w c, o c kh kw -> b h w o", x, w, win, mesh=vmesh)
    with pytest.raises(ValueError, match="channel axis 'c'.*sharded"):
        einconv("b h w c/sp, o c kh kw -> b h w o", x, w, win, mesh=vmesh)
    with pytest.raises(ValueError, match="groups=2"):
        einconv(f, x, w, win, groups=2)
    with pytest.raises(ValueError, match="bias"):
        einconv(f, x, w, win, bias=torch.zeros(5))
    with pytest.raises(ValueError, match="factored"):
        einconv("b h w (c), o c kh kw -> b h w o", x, w, win)
    with pytest.raises(ValueError, match=r"\.\.\."):
        einconv("... h w c, o c kh kw -> ... h w o", x, w, win)
    with pytest.raises(ValueError, match="'w' is empty"):
        einconv(f, torch.zeros(1, 4, 0, 2), w, win, boundary="periodic")
    with pytest.raises(ValueError, match="'b' is missing"):
        einconv("b h w c, o c kh kw -> h w o", x, w, win)
