"""``es.einconv``: convolutions on spatially sharded grids.

``b h/sp w c, o c kh kw -> b h/sp w o`` with ``windows={"h": "kh", "w": "kw"}``
fetches the ghost rows each rank's block needs (:func:`einhalo`, width from
the kernel size, dilation and padding), then runs ``F.conv1d/2d/3d`` with
zero padding on the widened block: no window tensor is materialised.

The roles of the axes follow from where they appear:

====================== ======= ======== ======== ==========================
role                   input   weight   output   example
====================== ======= ======== ======== ==========================
spatial                yes     no       yes      ``h``, ``w`` (keys of ``windows``)
kernel                 no      yes      no       ``kh``, ``kw`` (values of ``windows``)
batch                  yes     no       yes      ``b`` (any number, sharding kept)
input channel          yes     yes      no       ``c`` (summed; at most one)
output channel         no      yes      yes      ``o`` (at most one)
channel group          yes     yes      yes      ``g`` (at most one)
====================== ======= ======== ======== ==========================

Channel groups: a *group axis* appears in the input, the weight and the
output. ``b h w g c, g o c kh kw -> b h w g o`` is a grouped convolution
with ``G = size(g)`` groups (``F.conv2d(groups=G)``, channels ordered
``(g c)`` and ``(g o)``); ``b h w c, c kh kw -> b h w c`` is depthwise (the
channel axis itself is the group axis) and ``b h w c, c m kh kw -> b h w c m``
depthwise with a channel multiplier. The PyTorch convention works too:
``b h w c, o c kh kw -> b h w o`` with ``groups=G``, where the weight's ``c``
holds the ``C/G`` channels of one group and ``o`` is ordered group-major.

The weight and bias are replicated: the result of every rank depends on
them, so their gradients are summed over the mesh dimensions that shard
the input (a replicated input gets the full gradient everywhere).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..comm import mappings
from ..core import _torch_compat
from ..core._cache import BoundedCache
from ..core.layout import MeshShape
from ..errors import EinshardError
from ..notation import expand, freeze_families
from ..runtime.dispatch import Operation
from ..runtime.pipeline import (
    check_boundary,
    check_kept_sharding,
    check_spec,
    family_table,
    freeze,
    per_axis,
    pick_mesh,
    width_pair,
)
from .halo import halo_plan

__all__ = ["einconv"]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CHECKPOINT_MODES = ("full", "conv", False, None)


class _ConvSpec:
    """The analysed formula: axis roles, permutations and halo widths (rank-independent)."""

    def __init__(self, formula, x_shape, w_shape, b_shape, windows, padding, dilation, groups, families):
        self.formula = formula
        parsed = expand(formula, freeze_families(families))
        if parsed.output is None or len(parsed.inputs) != 2:
            raise EinshardError("expects 'input, weight -> output'")
        xs, ws = parsed.inputs
        out = parsed.output
        check_spec(xs, "einconv", "the input")
        check_spec(ws, "einconv", "the weight")
        check_spec(out, "einconv", "the output")
        self.x_spec, self.x_text = xs, str(xs)
        x_names = [a.name for a in xs.axes]
        w_names = [a.name for a in ws.axes]
        out_axes = {a.name: a for a in out.axes}
        for a in ws.axes:
            if a.mesh:
                raise EinshardError(f"the weight must be replicated, but axis {a.name!r} is sharded")
        if len(x_shape) != len(x_names):
            raise EinshardError(f"the input names {len(x_names)} dimensions but has {len(x_shape)}")
        if len(w_shape) != len(w_names):
            raise EinshardError(f"the weight names {len(w_names)} dimensions but has {len(w_shape)}")
        xsize = dict(zip(x_names, x_shape))
        wsize = dict(zip(w_names, w_shape))

        wmap = per_axis(windows, x_names, families, "windows")
        table = family_table(families)
        if not wmap:
            raise EinshardError("windows= must map the spatial axes to kernel axes")
        if not 1 <= len(wmap) <= 3:
            raise EinshardError(f"1 to 3 spatial axes are supported, got {list(wmap)}")
        for axis, k in wmap.items():
            if isinstance(k, str) and k in table and len(table[k]) == 1:
                k = wmap[axis] = table[k][0]
            if not isinstance(k, str) or k not in w_names:
                raise EinshardError(f"kernel axis {k!r} of spatial axis {axis!r} is not a weight axis")
            if k in x_names or k in out_axes:
                raise EinshardError(f"kernel axis {k!r} must appear in the weight only")
            if axis in w_names:
                raise EinshardError(f"spatial axis {axis!r} must not appear in the weight")
        if len(set(wmap.values())) != len(wmap):
            raise EinshardError("two spatial axes share a kernel axis")
        self.spatial = [a for a in x_names if a in wmap]  # in input order
        kernels = [wmap[a] for a in self.spatial]

        batch, cin, grp = [], [], []
        for a in xs.axes:
            if a.name in wmap:
                continue
            in_w, in_o = a.name in wsize, a.name in out_axes
            if in_w and in_o:
                grp.append(a)
            elif in_w:
                cin.append(a)
            elif in_o:
                batch.append(a)
            else:
                raise EinshardError(f"input axis {a.name!r} is missing from the output")
        oc = []
        for name in w_names:
            if name in xsize or name in kernels:
                continue
            if name not in out_axes:
                raise EinshardError(
                    f"weight axis {name!r} is neither a kernel axis, a channel of the input "
                    f"nor an output axis"
                )
            oc.append(name)
        for role, found in (("input channel", cin), ("channel group", grp), ("output channel", oc)):
            if len(found) > 1:
                names = [getattr(a, "name", a) for a in found]
                raise EinshardError(f"at most one {role} axis, got {names}")
        for a in cin + grp:
            if a.mesh:
                raise EinshardError(f"channel axis {a.name!r} of the input must not be sharded")
        for a in xs.axes:
            if a.name in out_axes:
                check_kept_sharding(a, out_axes[a.name])
        for name in oc:
            if out_axes[name].mesh:
                raise EinshardError(f"output channel axis {name!r} must not be sharded")
        for name in out_axes:
            if name not in xsize and name not in oc:
                raise EinshardError(f"output axis {name!r} is not an input or output channel axis")
        self.batch = [a.name for a in batch]
        self.c = cin[0].name if cin else None
        self.g = grp[0].name if grp else None
        self.o = oc[0] if oc else None

        # channel counts and groups
        for name in ([self.g] if self.g else []):
            if wsize[name] != xsize[name]:
                raise EinshardError(
                    f"group axis {name!r} has size {xsize[name]} in the input but "
                    f"{wsize[name]} in the weight"
                )
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise EinshardError(f"groups must be a positive int, got {groups!r}")
        c_x = xsize[self.c] if self.c else 1
        c_w = wsize[self.c] if self.c else 1
        out_per = wsize[self.o] if self.o else 1
        if self.g:
            if groups not in (1, xsize[self.g]):
                raise EinshardError(f"groups={groups} but the group axis {self.g!r} has size {xsize[self.g]}")
            self.groups = xsize[self.g]
            if c_w != c_x:
                raise EinshardError(
                    f"input channel axis {self.c!r} has size {c_x} in the input but {c_w} in "
                    f"the weight"
                )
        else:
            self.groups = groups
            if c_x % groups or c_w != c_x // groups:
                raise EinshardError(
                    f"with groups={groups} the weight's channel axis {self.c!r} must hold "
                    f"{c_x}/{groups} channels; the input has {c_x}, the weight {c_w}"
                )
            if out_per % groups:
                raise EinshardError(f"output channel axis {self.o!r} ({out_per}) is not divisible by groups={groups}")
        self.out_channels = (xsize[self.g] if self.g else 1) * out_per

        # permutations
        x_order = self.batch + ([self.g] if self.g else []) + ([self.c] if self.c else []) + self.spatial
        self.x_perm = [x_names.index(a) for a in x_order]
        w_order = ([self.g] if self.g else []) + ([self.o] if self.o else []) + ([self.c] if self.c else []) + kernels
        self.w_perm = [w_names.index(a) for a in w_order]
        self.w_shape = (self.out_channels, c_w, *[wsize[k] for k in kernels])
        chans = ([self.g] if self.g else []) + ([self.o] if self.o else [])
        self.chan_sizes = [wsize[a] for a in chans]
        produced = self.batch + chans + self.spatial
        self.out_perm = [produced.index(a.name) for a in out.axes]
        self.out_text = str(out)

        # bias
        self.bias_perm = None
        if b_shape is not None:
            out_chans = [a.name for a in out.axes if a.name in chans]
            if len(b_shape) <= 1 and math.prod(b_shape) == self.out_channels:
                pass
            elif tuple(b_shape) == tuple(wsize[a] for a in out_chans):
                self.bias_perm = [out_chans.index(a) for a in chans]
            else:
                raise EinshardError(
                    f"bias must have {self.out_channels} elements "
                    f"(or the shape of the output channel axes {out_chans}), got shape {tuple(b_shape)}"
                )

        # dilation, padding -> halo widths per spatial axis
        self.dilation = []
        dil = _per_spatial(dilation, self.spatial, families, "dilation")
        pad = _per_spatial(padding, self.spatial, families, "padding")
        self.widths = {}
        for a, k in zip(self.spatial, kernels):
            d = dil.get(a, 1)
            if isinstance(d, bool) or not isinstance(d, int) or d < 1:
                raise EinshardError(f"dilation of axis {a!r} must be a positive int, got {d!r}")
            self.dilation.append(d)
            eff = d * (wsize[k] - 1) + 1
            p = pad.get(a)
            if p is None or p == "same":
                if eff % 2 == 0:
                    raise EinshardError(
                        f"axis {a!r} has an even effective kernel ({eff}); pass "
                        f"padding={{{a!r}: (left, right)}} with left + right = {eff - 1}"
                    )
                p = ((eff - 1) // 2, (eff - 1) // 2)
            else:
                p = width_pair(p, a, "padding")
            if sum(p) != eff - 1:
                raise EinshardError(
                    f"padding {p} of axis {a!r} does not preserve its length: with effective "
                    f"kernel {eff} it must add up to {eff - 1} (only length-preserving padding is supported)"
                )
            self.widths[a] = p
        self.conv = _CONV[len(self.spatial)]


def _per_spatial(value, spatial, families, arg) -> dict:
    if value is None or value == "same":
        return {}
    if isinstance(value, dict):
        return per_axis(value, spatial, families, arg)
    return dict.fromkeys(spatial, value)


def _check_stride(stride) -> None:
    values = stride.values() if isinstance(stride, dict) else stride if isinstance(stride, (tuple, list)) else [stride]
    if any(isinstance(s, bool) or s != 1 for s in values):
        raise EinshardError(
            f"stride={stride!r} is not supported: only stride 1 keeps the output in the input's layout; "
            f"subsample the result instead"
        )


_SPECS = BoundedCache(name="einshard.ops.conv.specs")


def _conv_spec(formula, x, weight, b_shape, windows, padding, dilation, groups, families):
    key = (formula, freeze_families(families), tuple(x.shape), tuple(weight.shape), b_shape, freeze(windows),
           freeze(padding), freeze(dilation), groups)
    spec = _SPECS.get(key)
    if spec is None:
        spec = _SPECS.put(key, _ConvSpec(formula, tuple(x.shape), tuple(weight.shape), b_shape, windows, padding,
                                         dilation, groups, families))
    return spec


def einconv(formula, x, weight, windows, *, bias=None, padding=None, stride=1, dilation=1, groups=1,
            boundary="constant", fill=0, mesh=None, shapes=None, families=None, checkpoint="full",
            use_reentrant=False):
    """Convolution on a (spatially sharded) grid: halo exchange, then ``F.conv1d/2d/3d``.

    ``windows`` maps each spatial input axis to its kernel axis in the
    weight. The output keeps the input's layout (length-preserving
    padding: ``padding=None`` is "same" padding for odd effective kernels
    ``dilation*(k-1)+1``; otherwise give ``(left, right)`` per axis adding up
    to ``effective - 1``); positions outside the domain follow ``boundary``
    (``"constant"`` with ``fill``, ``"periodic"``, ``"replicate"``).
    ``dilation`` and ``padding`` take one value or a dict keyed by axis (or
    family). ``checkpoint``: ``"full"`` recomputes halo and convolution in
    backward, ``"conv"`` only the convolution, ``False`` stores everything;
    ``use_reentrant`` is passed to ``torch.utils.checkpoint``. See the module
    docstring for grouped and depthwise notation.

    >>> import torch
    >>> from einshard.ops.conv import einconv
    >>> x, w = torch.randn(2, 8, 8, 3), torch.randn(4, 3, 3, 3)
    >>> y = einconv("b h w c, o c kh kw -> b h w o", x, w, {"h": "kh", "w": "kw"})
    >>> ref = torch.nn.functional.conv2d(x.permute(0, 3, 1, 2), w, padding=1).permute(0, 2, 3, 1)
    >>> torch.allclose(y, ref, atol=1e-5)
    True

    Distributed (rows sharded over ``sp``, periodic domain)::

        y = es.einconv("b h/sp w c, o c kh kw -> b h/sp w o", x_block, w, {"h": "kh", "w": "kw"},
                       bias=b, boundary="periodic", mesh=mesh)
    """
    args = (None if bias is None else tuple(bias.shape), windows, padding, stride, dilation, groups, boundary,
            checkpoint)
    run_args = (bias, fill, checkpoint, use_reentrant)
    return _EINCONV.dispatch(formula, (x, weight), (args, mesh, shapes, families, run_args))


def _run(planned, tensors, run_args):
    """The weight's gradient summed, then the halo and the convolution (checkpointed as asked)."""
    spec, plan, group = planned
    (x, weight), (bias, fill, checkpoint, use_reentrant) = tensors, run_args
    # the replicated weight and bias feed every rank's block: sum their gradients over the input's dims
    if group is not None:
        weight = mappings.identity_forward_allreduce_backward(weight, group)
        if bias is not None:
            bias = mappings.identity_forward_allreduce_backward(bias, group)

    def conv(xh, w, b):
        return _conv_core(spec, xh, w, b)

    def full(xv, w, b):
        return conv(plan(xv, fill), w, b)

    grad_needed = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if checkpoint == "full" and grad_needed:
        return _torch_compat.checkpoint(full, x, weight, bias, use_reentrant=use_reentrant)
    xh = plan(x, fill)
    if checkpoint == "conv" and grad_needed:
        return _torch_compat.checkpoint(conv, xh, weight, bias, use_reentrant=use_reentrant)
    return conv(xh, weight, bias)


def _plan(formula, tensors, args, mesh, shapes, families):
    """``(conv spec, halo plan, group)`` of one call: the group (or ``None``) sums the gradients of the weight
    and bias, which feed every rank's block."""
    (x, weight), (b_shape, windows, padding, stride, dilation, groups, boundary, checkpoint) = tensors, args
    check_boundary(boundary)
    _check_stride(stride)
    if checkpoint not in _CHECKPOINT_MODES:
        raise EinshardError(f"checkpoint must be 'full', 'conv' or False, got {checkpoint!r}")
    spec = _conv_spec(formula, x, weight, b_shape, windows, padding, dilation, groups, families)
    m = pick_mesh(spec.x_spec, mesh)
    plan = halo_plan(spec.x_spec, spec.x_text, x, spec.widths, boundary, m, shapes, "einconv",
                     freeze_families(families))
    group = None
    if m is not None:
        shape = MeshShape.of(m)
        dims = shape.sort(d for ds in plan.layout.shard for d in ds)
        if shape.size(dims) > 1:
            group = m.group(dims)
    return spec, plan, group


def _graph_plan(planned):
    spec, plan, group = planned
    return spec, plan.prepare_traced(), group


_EINCONV = Operation("einconv", plan=_plan, run=_run, graph_plan=_graph_plan,
                     cache=BoundedCache(name="einshard.ops.conv.calls"))


def _conv_core(spec: _ConvSpec, xh: torch.Tensor, w: torch.Tensor, b) -> torch.Tensor:
    nb = len(spec.batch)
    xp = xh.permute(spec.x_perm)
    batch_sizes = list(xp.shape[:nb])
    spatial_in = list(xp.shape[xp.dim() - len(spec.spatial):])
    spatial_out = [n - sum(spec.widths[a]) for n, a in zip(spatial_in, spec.spatial)]
    out_shape = batch_sizes + spec.chan_sizes + spatial_out
    if b is not None and spec.bias_perm is not None:
        b = b.permute(spec.bias_perm)
    if b is not None:
        b = b.reshape(-1)
    if math.prod(out_shape) == 0 or xh.numel() == 0:
        # Nothing to compute on this rank, but every rank must run the same collectives in
        # backward: keep the inputs in the graph (the halo exchange's adjoint and the weight's
        # gradient reduction), and save a tensor computed after the exchange so that a
        # non-reentrant checkpoint recomputes the exchange here as on the other ranks.
        link = xh.sum() * w.sum()
        if b is not None:
            link = link + b.sum()
        return (xh.new_zeros(out_shape) + 0 * link).permute(spec.out_perm)
    n = math.prod(batch_sizes)
    xc = xp.reshape(n, -1, *spatial_in)
    wc = w.permute(spec.w_perm).reshape(spec.w_shape)
    y = spec.conv(xc, wc, b, stride=1, padding=0, dilation=spec.dilation, groups=spec.groups)
    return y.reshape(out_shape).permute(spec.out_perm)
