"""``es.einfft``: named-axis ``fftn``/``ifftn``/``rfftn``/``irfftn`` on local or sharded tensors.

One call: parse and validate the formula and ``axes`` (errors before any
collective), resolve the input and output layouts for this rank, plan once
(:mod:`einshard.plan.fft`: the cheapest sequence of all-to-all transposes,
local ``torch.fft`` calls and four-step transforms), bind the plan to this
rank and run it. Plans are cached per (formula, axes, mode, local shape,
dtype, split shapes, mesh, ambient split shapes): steady-state calls only
execute. Transposes are :mod:`einshard.runtime.execute` transitions (autograd
Functions with exact adjoints) and the local transforms are ``torch.fft``
calls, so backward needs no hand-written FFT gradient.
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from ..comm import checks
from ..comm.mesh import resolve_mesh
from ..core import _context, _trace
from ..core._cache import BoundedCache
from ..core._split import compute_split_shapes
from ..core._table import text_table
from ..core._torch_compat import in_traced_code
from ..core.layout import Layout, MeshShape
from ..errors import EinshardError, naming
from ..notation import (
    Axis,
    Formula,
    TensorSpec,
    check_semantics,
    expand_tensor,
    family_member,
    freeze_families,
    invalid,
)
from ..notation.grammar import parse_text
from ..plan.fft import FFTPlan, FFTProblem, FourStep, LocalFFT, Move, plan_fft
from ..plan.resolve import Splits, resolve
from ..plan.transition import plan_transition
from ..runtime.dispatch import Operation
from ..runtime.execute import Transition, transition
from ..runtime.pipeline import (
    agree,
    agrees_always,
    check_spec,
    family_table,
    freeze,
    per_axis,
)

__all__ = ["einfft", "FFTExplanation", "FFTStep"]

_NORMS = (None, "backward", "ortho", "forward")
_PLANS = BoundedCache(name="einshard.ops.fft.plans")


# -- parsing and validation -------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    """A validated einfft request, rank- and tensor-independent."""

    text: str
    inp: TensorSpec
    out: TensorSpec
    pairs: tuple[tuple[str, str], ...]  # (input axis, output axis) in `axes` order
    is_local: bool

    @property
    def in_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.inp.axes)

    @property
    def proxy(self) -> str:
        """The same layouts as an einshard formula (frequency axes renamed back): for variance rules."""
        back = {b: a for a, b in self.pairs}
        out = " ".join(str(Axis(back.get(a.name, a.name), a.mesh)) for a in self.out.axes)
        return f"{self.inp} -> {out}"


def _axes_form(formula: str, axes) -> str:
    """The error for an ``axes=`` that is neither a dict nor an iterable of axis names."""
    return (
        f"{formula!r}: axes= must be a dict {{input axis: output axis}} such as {{'x': 'kx', 'y': 'ky'}}, or an "
        f"iterable of input axis names transformed in place such as ['x', 'y'], got {axes!r}"
    )


def _axes_arg(formula: str, axes):
    """``axes=`` as a mapping: an iterable of input axis (or family) names transforms them in place.

    A string is a ``TypeError`` (``"xy"`` is not two axis names); anything else that is no mapping and
    no iterable of names is refused as :func:`_axes_form` says.
    """
    if isinstance(axes, Mapping):
        return axes
    if isinstance(axes, str):
        raise TypeError(
            f"{formula!r}: axes= must be a mapping or an iterable of axis names, not a string ({axes!r}); "
            f"name each axis, e.g. {{'x': 'kx', 'y': 'ky'}} or ['x', 'y'] (a string is not accepted)"
        )
    if isinstance(axes, torch.Tensor) or not isinstance(axes, Iterable):
        raise EinshardError.named(_axes_form(formula, axes), formula)
    names = tuple(axes)
    if not names or not all(isinstance(n, str) for n in names):
        raise EinshardError.named(_axes_form(formula, axes), formula)
    return {n: n for n in names}


def _expand_pairs(axes, in_names, families) -> tuple[tuple[str, str], ...]:
    """``axes=`` as ``(input axis, output axis)`` pairs, in order (family keys expanded)."""
    pairs = tuple(per_axis(axes, in_names, families, "axes").items())
    if not pairs:
        raise EinshardError(f"axes= must be a non-empty dict {{input axis: output axis}}, got {axes!r}")
    seen = set()
    for a, b in pairs:
        if not isinstance(b, str) or not b.isidentifier():
            raise EinshardError(f"axes[{a!r}] must be an output axis name, got {b!r}")
        if b in seen:
            raise EinshardError(f"output axis {b!r} is the transform of two axes in axes=")
        seen.add(b)
    return pairs


@naming()
def _parse(text: str, axes_key, families: tuple) -> _Spec:
    inputs, output = parse_text(text)
    if output is None:
        raise EinshardError("einfft needs a formula 'input -> output', e.g. 'b x y -> b kx ky'")
    if len(inputs) != 1:
        raise EinshardError(f"einfft takes one input tensor, the formula has {len(inputs)}")
    table_axes = {name: tuple(family_member(text, name, m) for m in members) for name, members in families}
    inp = expand_tensor(text, inputs[0], table_axes)
    out = expand_tensor(text, output, table_axes)
    check_spec(inp, "einfft", "the input")
    check_spec(out, "einfft", "the output", unique=False)  # repeated names: below, with a caret
    check_semantics(Formula(text, (inp,), None))
    in_names = tuple(a.name for a in inp.axes)
    pairs = _expand_pairs(dict(axes_key), in_names, families)
    transformed = {a for a, _ in pairs}
    untouched = [n for n in in_names if n not in transformed]
    for _, b in pairs:
        if b in untouched:
            raise EinshardError(
                f"transform output axis {b!r} already exists among the untouched input axes; "
                f"give the frequency axis a new name"
            )
    back = {b: a for a, b in pairs}
    seen = set()
    for ax in out.axes:
        if ax.name in seen:
            raise invalid(text, ax.pos, f"axis {ax.name!r} appears more than once in the output")
        seen.add(ax.name)
        if ax.name not in back and ax.name not in untouched:
            hint = " (it is transformed; use its output name)" if ax.name in transformed else ""
            raise EinshardError(
                f"output axis {ax.name!r} is neither an untouched input axis nor an output of "
                f"axes={hint}"
            )
    for name in untouched:
        if name not in seen:
            raise EinshardError(f"input axis {name!r} is missing from the output; einfft keeps every axis")
    for a, b in pairs:
        if b not in seen:
            raise EinshardError(f"transform output axis {b!r} (of {a!r}) is missing from the output")
    renamed = TensorSpec(tuple(Axis(back.get(x.name, x.name), x.mesh, x.pos) for x in out.axes), (), (), out.pos)
    check_semantics(Formula(text, (inp,), renamed))  # mesh dimensions of the output
    is_local = inp.is_local and out.is_local
    return _Spec(text, inp, out, pairs, is_local)


_PARSED = BoundedCache(name="einshard.ops.fft.parsed")


def _parse_cached(text, axes_key, families) -> _Spec:
    found = _PARSED.get((text, axes_key, families))
    if found is None:
        found = _PARSED.put((text, axes_key, families), _parse(text, axes_key, families))
    return found


# -- sizes and dtypes ------------------------------------------------------------------


def _complex_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype.is_complex:
        return dtype
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    return {torch.float64: torch.complex128, torch.float16: torch.complex32}.get(dtype, torch.complex64)


def _real_dtype(dtype: torch.dtype) -> torch.dtype:
    return {torch.complex128: torch.float64, torch.complex32: torch.float16}.get(_complex_dtype(dtype), torch.float32)


def _signal_sizes(spec: _Spec, signal_sizes, real: bool, inverse: bool, table) -> dict[str, int]:
    """``signal_sizes`` keyed by input axis (family keys expanded, output names mapped back)."""
    if signal_sizes is None:
        return {}
    if not (real and inverse):
        raise EinshardError("signal_sizes= is for inverse real transforms (real=True, inverse=True)")
    if not isinstance(signal_sizes, Mapping):
        raise EinshardError(f"signal_sizes= must be a dict {{axis: length}}, got {signal_sizes!r}")
    back = {b: a for a, b in spec.pairs}
    ins = {a for a, _ in spec.pairs}
    out: dict[str, int] = {}
    for key, value in signal_sizes.items():
        if key not in ins and key not in back and key in table:
            members = table[key]
            if isinstance(value, int) or len(value) != len(members):
                raise EinshardError(f"signal_sizes[{key!r}] needs one length per member of family {key!r}")
            items = list(zip(members, value))
        else:
            items = [(key, value)]
        for name, n in items:
            axis = name if name in ins else back.get(name)
            if axis is None:
                raise EinshardError(f"signal_sizes names axis {name!r}, which is not a transformed axis")
            if isinstance(n, bool) or int(n) != n or n < 1:
                raise EinshardError(f"signal_sizes[{name!r}] must be a positive length, got {n!r}")
            out[axis] = int(n)
    return out


def _after_sizes(spec: _Spec, before: dict, real, inverse, signal) -> dict[str, int]:
    after = dict(before)
    half = spec.pairs[-1][0] if real else None
    for a, _ in spec.pairs:
        n = before[a]
        if n == 0:
            raise EinshardError(f"transform axis {a!r} is empty")
        if a == half:
            if inverse:
                length = signal.get(a, 2 * (n - 1))
                if length < 1 or length // 2 + 1 != n:
                    raise EinshardError(
                        f"the inverse real transform of half-spectrum axis {a!r} (size {n}) needs an "
                        f"output length L with L//2+1 == {n}; got {length}"
                        + ("" if a in signal else " (pass signal_sizes=)")
                    )
                after[a] = length
            else:
                after[a] = n // 2 + 1
        elif a in signal and signal[a] != n:
            raise EinshardError(
                f"signal_sizes[{a!r}] = {signal[a]} but axis {a!r} has size {n}; only the half-spectrum "
                f"axis (the last entry of axes=) can have a length of its own"
            )
    return after


# -- resolution -----------------------------------------------------------------------


@naming()
def _problem(spec: _Spec, shape, dtype, mesh, shapes, real, inverse, signal) -> tuple[FFTProblem, str | None]:
    text = spec.text
    ambient = _context.shapes_for(mesh)
    labels = {mesh.label(mesh.dims(a.mesh)) for t in (spec.inp, spec.out) for a in t.axes if a.mesh}
    if shapes is not None and not isinstance(shapes, Mapping) and len(labels) != 1:
        raise EinshardError(
            f"shapes= as a list needs exactly one sharded mesh dimension, but the formula shards over "
            f"{sorted(labels)}; use {{'dim': [...]}} instead"
        )
    known = [a.name for t in (spec.inp, spec.out) for a in t.axes]
    resolved = resolve(Formula(text, (spec.inp,), spec.inp), [tuple(shape)], mesh, shapes=shapes, ambient=ambient,
                       axes=known)
    src = resolved.operands[0]
    before = dict(zip(src.axes, src.sizes))
    after = _after_sizes(spec, before, real, inverse, signal)
    lookup = Splits(shapes, ambient, mesh, labels)
    back = {b: a for a, b in spec.pairs}
    shard: dict = {}
    splits: dict[str, tuple | None] = {}
    for ax in spec.out.axes:
        name = back.get(ax.name, ax.name)
        dims = mesh.dims(ax.mesh) if ax.mesh else ()
        shard[name] = dims
        if not dims:
            splits[name] = None
            continue
        found = lookup.explicit(dims, ax.name, missing_ok=True)
        if found is not None and shapes is not None and not isinstance(shapes, Mapping) and sum(found) != after[name]:
            found = None  # the list form gives the input's split; a resized frequency axis gets the default
        if found is None and ax.name not in back and src.shard[src.axes.index(name)] == dims:
            found = src.splits[src.axes.index(name)]
        if found is None:
            found = tuple(compute_split_shapes(after[name], mesh.size(dims)))
        elif sum(found) != after[name]:
            raise EinshardError(
                f"split shapes {list(found)} of output axis {ax.name!r} sum to {sum(found)} but the "
                f"axis has size {after[name]}"
            )
        splits[name] = tuple(found)
    names = src.axes
    dst = Layout(names, tuple(after[n] for n in names), tuple(shard[n] for n in names), tuple(splits[n] for n in names))
    problem = _fft_problem(spec, src, dst, dtype, real, inverse, MeshShape.of(mesh))
    return problem, resolved.local_error


def _fft_problem(spec: _Spec, src: Layout, dst: Layout, dtype, real, inverse, mesh_shape) -> FFTProblem:
    index = {n: i for i, n in enumerate(src.axes)}
    renamed = dict(spec.pairs)
    cdtype = _complex_dtype(dtype)
    out_dtype = _real_dtype(dtype) if real and inverse else cdtype
    return FFTProblem(
        src.axes, tuple(renamed.get(n, n) for n in src.axes), src.sizes, dst.sizes,
        tuple(index[a] for a, _ in spec.pairs), real, inverse, src, dst, mesh_shape,
        dtype.itemsize, cdtype.itemsize, out_dtype.itemsize,
    )


def _local_plan(spec: _Spec, shape, dtype, real, inverse, signal) -> FFTPlan:
    names = spec.in_names
    after = _after_sizes(spec, dict(zip(names, shape)), real, inverse, signal)
    sizes_a = tuple(after[n] for n in names)
    src = Layout(names, tuple(shape), ((),) * len(names), (None,) * len(names))
    dst = Layout(names, sizes_a, src.shard, src.splits)
    problem = _fft_problem(spec, src, dst, dtype, real, inverse, MeshShape((), ()))
    transform = problem.transform
    if real:
        dims = tuple(sorted(transform[:-1])) + (transform[-1],)
        kind = "c2r" if inverse else "r2c"
    else:
        dims, kind = tuple(sorted(transform)), "c2c"
    return FFTPlan(problem, (LocalFFT(dims, kind, tuple(sizes_a[i] for i in dims), src, dst),), (0, 0), ())


# -- running -------------------------------------------------------------------------


def _safe_fft(x, fn, out_shape, out_dtype):
    """``fn(x)``, or an empty result wired into autograd when there is nothing to transform."""
    if x.numel() == 0:
        z = x.sum() * 0
        if z.is_complex() and not out_dtype.is_complex:
            z = z.real
        return torch.zeros(out_shape, dtype=out_dtype, device=x.device) + z
    return fn(x)


def _compile_local_fft(act: LocalFFT, inverse: bool, norm, dtypes):
    dims, sizes, kind = list(act.dims), list(act.sizes), act.kind
    cdtype, rdtype = dtypes
    if kind == "c2c":
        torch_fn = torch.fft.ifftn if inverse else torch.fft.fftn

        def fn(x):
            return torch_fn(x, dim=dims, norm=norm)

        out_dtype = cdtype
    elif kind == "r2c":

        def fn(x):
            return torch.fft.rfftn(x, dim=dims, norm=norm)

        out_dtype = cdtype
    else:

        def fn(x):
            return torch.fft.irfftn(x, s=sizes, dim=dims, norm=norm)

        out_dtype = rdtype

    def run(x):
        shape = list(x.shape)
        for d, s in zip(dims, sizes):
            shape[d] = s
        return _safe_fft(x, fn, shape, out_dtype)

    return run


def _compile_four_step(fs: FourStep, mesh, inverse: bool, norm, dtypes, device):
    """The steps of a four-step transform; its weights and twiddles are computed in float64 on the host
    and stored once on ``device`` (the input's) in the plan's dtype."""
    shape = MeshShape.of(mesh)
    coord = mesh.coordinate
    i = fs.axis
    cdtype, rdtype = dtypes
    fft1 = torch.fft.ifft if inverse else torch.fft.fft
    steps: list = []  # transitions and local steps, each called with the local tensor
    if fs.real == "c2r":
        assert fs.padded is not None  # a c2r four-step pads
        lo, hi = fs.pre.interval(i, coord, shape)
        k = torch.arange(lo, hi, dtype=torch.float64, device="cpu")
        weight = torch.where((k == 0) | (2 * k == fs.n), 1.0, 2.0).to(device=device, dtype=rdtype)
        view = [1] * len(fs.pre.axes)
        view[i] = hi - lo
        weight = weight.view(view)
        pad = fs.padded.local_shape(coord, shape)[i] - (hi - lo)

        def weigh_and_pad(x, weight=weight, pad=pad):
            x = x * weight
            if pad:
                zshape = list(x.shape)
                zshape[i] = pad
                x = torch.cat([x, x.new_zeros(zshape)], dim=i)
            return x

        steps.append(weigh_and_pad)
    start = fs.padded if fs.padded is not None else fs.pre
    steps.append(transition(start, fs.flat_a, mesh))
    a_shape = fs.a.local_shape(coord, shape)
    steps.append(lambda x: x.reshape(a_shape))
    steps.append(transition(fs.a, fs.b, mesh))
    b_shape = list(fs.b.local_shape(coord, shape))
    q0, q1 = fs.b.interval(i + 1, coord, shape)
    sign = 1.0 if inverse else -1.0
    k_hi = torch.arange(fs.n1, dtype=torch.float64, device="cpu").view(-1, 1)
    lo_idx = torch.arange(q0, q1, dtype=torch.float64, device="cpu").view(1, -1)
    angle = sign * 2 * math.pi * torch.remainder(k_hi * lo_idx, fs.n) / fs.n
    twiddle = torch.polar(torch.ones_like(angle), angle).to(device=device, dtype=cdtype)
    tview = [1] * len(fs.a.axes)
    tview[i], tview[i + 1] = fs.n1, q1 - q0
    twiddle = twiddle.view(tview)
    b_out = list(b_shape)

    def first(x, twiddle=twiddle):
        y = _safe_fft(x, lambda t: fft1(t, dim=i, norm=norm), b_out, cdtype)
        return y * twiddle

    steps.append(first)
    steps.append(transition(fs.b, fs.c, mesh))
    c_shape = list(fs.c.local_shape(coord, shape))
    steps.append(lambda x: _safe_fft(x, lambda t: fft1(t, dim=i + 1, norm=norm), c_shape, cdtype))
    steps.append(transition(fs.c, fs.d, mesh))
    flat_shape = fs.flat_d.local_shape(coord, shape)
    steps.append(lambda x: x.transpose(i, i + 1).reshape(flat_shape))
    end: Layout | None
    if fs.real == "r2c":
        assert fs.cropped is not None  # an r2c four-step crops
        keep = fs.cropped.local_shape(coord, shape)[i]
        steps.append(lambda x: x.narrow(i, 0, keep))
        end = fs.cropped
    elif fs.real == "c2r":
        steps.append(lambda x: x.real)
        end = fs.flat_d
    else:
        end = fs.flat_d
    steps.append(transition(end, fs.post, mesh))
    steps = [s for s in steps if not getattr(s, "trivial", False)]

    def run(x):
        for s in steps:
            x = s(x)
        return x

    run.steps = steps  # type: ignore[attr-defined]  # a function attribute, for _Bound.prepare_traced
    return run


class _Bound:
    """A plan bound to this rank: call it with the local tensor."""

    __slots__ = ("plan", "steps", "local_error", "warning", "mesh", "fingerprint", "call")

    def __init__(self, plan: FFTPlan, mesh, norm, dtype, order, local_error=None, warning=None, device=None):
        self.plan = plan
        self.local_error = local_error
        self.warning = warning
        self.mesh = mesh
        # equal on every rank when they agree on the global sizes and split shapes (checked with checks on)
        self.fingerprint = zlib.crc32(repr((plan.problem.src, plan.problem.dst)).encode())
        p = plan.problem
        dtypes = (_complex_dtype(dtype), _real_dtype(dtype))
        steps: list = []
        for act in plan.actions:
            if isinstance(act, Move):
                t = transition(act.src, act.dst, mesh)
                if not t.trivial:
                    steps.append(t)
            elif isinstance(act, LocalFFT):
                steps.append(_compile_local_fft(act, p.inverse, norm, dtypes))
            else:
                steps.append(_compile_four_step(act, mesh, p.inverse, norm, dtypes, device))
        if order != tuple(range(len(order))):
            steps.append(lambda x: x.permute(order))
        self.steps = tuple(steps)

    def prepare_traced(self) -> _Bound:
        """This plan ready for traced code (the functional steps of its transitions built)."""
        for step in self.steps:
            for s in (step,) if isinstance(step, Transition) else getattr(step, "steps", ()):  # (a four-step's)
                if isinstance(s, Transition):
                    s.prepare_traced()
        return self

    def __call__(self, x):
        for step in self.steps:
            x = step(x)
        return x


# -- explain ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FFTStep:
    """One step of an FFT plan: a transpose (transition), a local FFT or a four-step stage."""

    kind: str  # "transpose", "fft", "four-step", "local"
    what: str
    layout: str  # the layout after the step (frequency axes under their output names)
    mesh_dims: str  # "" for local steps
    forward_bytes: float  # bytes each rank sends, averaged over the ranks
    backward_bytes: float


@dataclass(frozen=True)
class FFTExplanation:
    """The plan ``einfft`` runs for one call; ``str()`` is a readable table.

    ``steps`` in execution order; ``gathered`` lists transform axes the plan
    gathers whole on every rank (the warning path; normally empty).
    """

    formula: str
    mode: str
    input_layout: str
    output_layout: str
    steps: tuple[FFTStep, ...]
    gathered: tuple[str, ...]

    @property
    def forward_bytes(self) -> float:
        return sum(s.forward_bytes for s in self.steps)

    @property
    def backward_bytes(self) -> float:
        return sum(s.backward_bytes for s in self.steps)

    @property
    def collectives(self) -> int:
        return sum(1 for s in self.steps if s.mesh_dims)

    def __str__(self) -> str:
        lines = [f"einfft plan for {self.formula!r} ({self.mode}): {self.input_layout} -> {self.output_layout}"]
        header = ("#", "step", "what", "layout after", "mesh dim", "fwd B/rank", "bwd B/rank")
        rows = [
            (str(n + 1), s.kind, s.what, s.layout, s.mesh_dims or "-", f"{s.forward_bytes:,.0f}",
             f"{s.backward_bytes:,.0f}")
            for n, s in enumerate(self.steps)
        ]
        lines += text_table(header, rows, indent="  ", right=(5, 6))
        lines.append(
            f"  total: forward {self.forward_bytes:,.0f} B, backward {self.backward_bytes:,.0f} B, "
            f"{self.collectives} collective(s)"
        )
        if self.gathered:
            lines.append(
                f"  warning: gathers transform axis {', '.join(self.gathered)} whole on every rank "
                f"(no all-to-all or four-step plan exists for this layout)"
            )
        return "\n".join(lines)


def _show(layout: Layout, p: FFTProblem, done) -> str:
    parts = []
    for name, dims in zip(layout.axes, layout.shard):
        if name in p.names:
            i = p.names.index(name)
            name = p.out_names[i] if i in done else name
        parts.append(f"{name}/{'-'.join(dims)}" if dims else name)
    return " ".join(parts)


def _transition_step(src, dst, p: FFTProblem, itemsize, done, prefix="") -> FFTStep | None:
    mesh = p.mesh
    fwd = plan_transition(src, dst, mesh)
    bwd = plan_transition(dst, src, mesh)
    if not fwd and not bwd:
        return None
    what = "; ".join(f"{s.describe()} ({'-'.join(s.dims)})" if s.is_collective else s.describe() for s in fwd)
    what = what or "nothing forward"
    dims = mesh.sort({d for s in fwd + bwd if s.is_collective for d in s.dims})
    return FFTStep(
        "transpose",
        prefix + what,
        _show(dst, p, done),
        "-".join(dims),
        sum(s.bytes_per_rank(mesh, itemsize) for s in fwd),
        sum(s.bytes_per_rank(mesh, itemsize) for s in bwd),
    )


def _explain(plan: FFTPlan, text: str, mode: str, out_spec: TensorSpec) -> FFTExplanation:
    p = plan.problem
    rows = []
    done: frozenset = frozenset()
    names = {True: "ifft", False: "fft"}[p.inverse]
    for act in plan.actions:
        if isinstance(act, Move):
            row = _transition_step(act.src, act.dst, p, p.itemsize(done), done)
            if row is not None:
                rows.append(row)
        elif isinstance(act, LocalFFT):
            done = done | frozenset(act.dims)
            fn = {"c2c": names + "n", "r2c": "rfftn", "c2r": "irfftn"}[act.kind]
            over = ", ".join(p.names[i] for i in act.dims)
            rows.append(FFTStep("fft", f"local {fn} over {over}", _show(act.dst, p, done), "", 0.0, 0.0))
        else:
            fs = act
            name = p.names[fs.axis]
            prefix = f"four-step {name} ({fs.n} = {fs.n1}x{fs.n2}): "
            isz = (p.itemsize(done), p.itemsize_complex, p.itemsize_out if fs.real == "c2r" else p.itemsize_complex)
            moves = fs.moves()
            labels: list[str | None] = [None, None, f"local {names} over {name}.hi, twiddle",
                                        f"local {names} over {name}.lo", None]
            if fs.real == "c2r":
                rows.append(FFTStep("four-step", prefix + "weight and zero-pad the half spectrum", "", "", 0.0, 0.0))
            for k, (src, dst, stage) in enumerate(moves):
                label = labels[k]
                if label is not None:
                    rows.append(FFTStep("four-step", prefix + label, "", "", 0.0, 0.0))
                row = _transition_step(src, dst, p, isz[stage], done if k < 4 else done | {fs.axis}, prefix)
                if row is not None:
                    rows.append(FFTStep("four-step", row.what, row.layout, row.mesh_dims, row.forward_bytes,
                                        row.backward_bytes))
                if k == 3:
                    tail = {"r2c": "local transpose, crop to the half spectrum", "c2r": "local transpose, real part"}
                    rows.append(FFTStep("four-step", prefix + tail.get(fs.real, "local transpose"), "", "", 0.0, 0.0))
            done = done | {fs.axis}
    return FFTExplanation(
        text, mode, _show(p.src, p, frozenset()), str(out_spec), tuple(rows), plan.gathered
    )


def _mode(real: bool, inverse: bool, norm) -> str:
    fn = ("irfftn" if inverse else "rfftn") if real else ("ifftn" if inverse else "fftn")
    return f"{fn}, norm={norm or 'backward'}"


# -- the public function ----------------------------------------------------------------


def einfft(
    formula: str,
    x,
    axes,
    *,
    inverse: bool = False,
    norm: str | None = None,
    mesh=None,
    shapes=None,
    families=None,
    real: bool = False,
    signal_sizes=None,
    explain: bool = False,
):
    """Named-axis ``fftn``/``ifftn``/``rfftn``/``irfftn`` on a local or sharded tensor.

    ``axes`` maps each transformed input axis to its frequency axis in the
    output (``{"x": "kx"}``; a family name maps to a tuple or to another
    family), or lists the input axes (or families) transformed in place
    (``["x", "y"]``: the output axes keep their names; a string is a
    ``TypeError``). Other axes keep their names; the output spec may permute them.
    ``inverse=True`` runs the inverse transform; ``real=True`` the real one,
    whose half-spectrum axis is the *last* entry of ``axes``
    (``signal_sizes={"ky": n}`` gives an inverse real length that
    ``2 * (m - 1)`` would get wrong, e.g. odd ``n``). ``norm`` as in
    ``torch.fft``. Sharded layouts (any, uneven included) move data with
    all-to-all transposes so that every transform runs locally;
    ``explain=True`` returns the plan (:class:`FFTExplanation`) instead of
    running it (``x`` may then be a local shape, with float32 /
    complex64 for inverse real transforms).

    >>> import torch, einshard as es
    >>> from einshard.ops.fft import einfft   # also es.einfft where exported
    >>> x = torch.randn(2, 8, 6)
    >>> y = einfft("b x y -> b kx ky", x, axes={"x": "kx", "y": "ky"})
    >>> torch.allclose(y, torch.fft.fftn(x, dim=(1, 2)))
    True
    >>> einfft("b x y -> ky b kx", x, axes={"x": "kx", "y": "ky"}, real=True).shape
    torch.Size([4, 2, 8])
    >>> einfft("b kx ky -> b x y", torch.fft.rfftn(x, dim=(1, 2)), axes={"kx": "x", "ky": "y"},
    ...        real=True, inverse=True, signal_sizes={"y": 6}).shape
    torch.Size([2, 8, 6])
    >>> mesh = es.Mesh.virtual((2, 4), ("dp", "tp"))       # plan only: no process group needed
    >>> plan = einfft("x/dp y/tp z -> kx ky/dp kz/tp", (16, 8, 32), {"x": "kx", "y": "ky", "z": "kz"},
    ...               mesh=mesh, explain=True)
    >>> plan.collectives, plan.forward_bytes
    (2, 40960.0)
    """
    if norm not in _NORMS:
        raise EinshardError(f"einfft: norm must be None, 'backward', 'ortho' or 'forward', got {norm!r}")
    if not explain:
        if not isinstance(x, torch.Tensor):
            raise EinshardError(f"einfft: x must be a torch.Tensor, got {type(x).__name__}")
        if type(axes) is not dict:
            axes = _axes_arg(formula, axes)
        return _EINFFT.dispatch(formula, (x,), ((axes, inverse, norm, real, signal_sizes), mesh, shapes, families, ()))
    if isinstance(x, torch.Tensor):
        shape, dtype, device = tuple(x.shape), x.dtype, x.device
    elif isinstance(x, (tuple, list, torch.Size)):
        shape = tuple(int(s) for s in x)
        dtype = torch.complex64 if (real and inverse) else torch.float32
        device = torch.device("meta")
    else:
        raise EinshardError(f"einfft: x must be a torch.Tensor, got {type(x).__name__}")
    if type(axes) is not dict:
        axes = _axes_arg(formula, axes)
    axes_key, fam_key = freeze(axes), freeze_families(families)
    bound = _bound(formula, axes, axes_key, fam_key, shape, dtype, device, inverse, norm, real, signal_sizes, mesh,
                   shapes, True)
    if bound.local_error is not None:
        raise EinshardError.named(bound.local_error, formula)
    return _explain(bound.plan, formula, _mode(real, inverse, norm), _parse_cached(formula, axes_key, fam_key).out)


def _bound(formula, axes, axes_key, fam_key, shape, dtype, device, inverse, norm, real, signal_sizes, mesh, shapes,
           explain):
    """The plan of one call for an input on ``device``, bound to this rank (the ranks agree on a build error)."""
    try:
        bound, _spec = _build(formula, axes, axes_key, fam_key, shape, dtype, inverse, norm, real, signal_sizes,
                             mesh, shapes, device)
    except ValueError as err:
        if not explain:
            _agree_on_build_error(err, formula, axes, axes_key, fam_key, mesh)
        raise
    if not explain and bound.mesh is None and bound.plan.problem.mesh.names:
        raise EinshardError("a virtual mesh has no process groups; use it with explain=True").within(formula)
    return bound


def _plan(formula, tensors, args, mesh, shapes, families) -> _Bound:
    """:func:`_bound` for the dispatch, with what :func:`_agree` needs before it runs."""
    x, (axes, inverse, norm, real, signal_sizes) = tensors[0], args
    bound = _bound(formula, axes, freeze(axes), freeze_families(families), tuple(x.shape), x.dtype, x.device,
                   inverse, norm, real, signal_sizes, mesh, shapes, False)
    bound.call = (formula, x.dtype, x.device, agrees_always(bound.mesh, shapes))
    return bound


def _run(bound, tensors, run_args):
    if not in_traced_code():  # (traced: agreed at trace time, by _graph_plan)
        _agree(bound, *bound.call)
    return bound(tensors[0])


def _graph_plan(bound):
    """:func:`_agree` at trace time (the warning, too, is given once per compile), and the plan for a graph."""
    _agree(bound, *bound.call)
    return bound.prepare_traced()


def _vma_rule(formula, args, families):
    """The formula variance tracking reads for ``einfft`` (at trace time: dynamo would trace the parser)."""
    axes = args[0]
    if in_traced_code():
        return _traced_proxy(formula, axes, families), None
    return _parse_cached(formula, freeze(axes), freeze_families(families)).proxy, None


def _agree(bound, formula, dtype, device, always=False) -> None:
    """Before communicating: the ranks agree (checks on, ``always``: an explicit ``shapes=``, or a rank-local
    error); the plan's warning."""
    if bound.mesh is not None and (bound.local_error is not None or checks.ENABLED or always):
        agree(
            bound.mesh,
            None if bound.local_error is None else EinshardError.named(bound.local_error, formula),
            fingerprint=bound.fingerprint,
            what=f"the layouts of {formula!r}",
            facts=(("dtype", dtype), ("device", device)),
            point="einfft",
            always=always,
        )
    if bound.warning is not None:
        warnings.warn(bound.warning, RuntimeWarning, stacklevel=3)


@_trace.constant_result
def _traced_proxy(formula, axes, families) -> str:
    return _parse_cached(formula, freeze(axes), freeze_families(families)).proxy


def _agree_on_build_error(err, formula, axes, axes_key, fam_key, mesh) -> None:
    """Checks on: a planning error of a distributed call (it may depend on this rank's dtype or shape)
    is raised on every rank, which are at the agreement before communicating."""
    if not checks.checks_enabled() or checks.was_agreed(err) or not isinstance(axes, Mapping):
        return
    try:
        if _parse_cached(formula, axes_key, fam_key).is_local:
            return  # no rank communicates
        m = resolve_mesh(mesh)
    except ValueError:  # the formula or the mesh is wrong: every rank sees that
        return
    if m.device_mesh is not None:
        agree(m, err, point="einfft")


@naming()
def _build(formula, axes, axes_key, fam_key, shape, dtype, inverse, norm, real, signal_sizes, mesh, shapes, device):
    """Parse, validate, resolve and plan one call for an input on ``device``; returns ``(bound plan, spec)``."""
    if not isinstance(axes, Mapping):
        raise EinshardError.named(_axes_form(formula, axes), formula)
    spec = _parse_cached(formula, axes_key, fam_key)
    if real and not inverse and dtype.is_complex:
        raise EinshardError(f"real=True (rfftn) needs a real input, got {dtype}")
    signal = _signal_sizes(spec, signal_sizes, real, inverse, family_table(fam_key, formula))
    order_names = spec.in_names
    out_index = {}
    back = {b: a for a, b in spec.pairs}
    for ax in spec.out.axes:
        out_index[ax.name] = order_names.index(back.get(ax.name, ax.name))
    order = tuple(out_index[a.name] for a in spec.out.axes)
    if len(shape) != len(order_names):
        raise EinshardError(
            f"the input '{spec.inp}' names {len(order_names)} dimensions but the tensor has {len(shape)}"
        )
    if spec.is_local:
        plan = _local_plan(spec, shape, dtype, real, inverse, signal)
        return _Bound(plan, None, norm, dtype, order), spec
    m = resolve_mesh(mesh)
    problem, local_error = _problem(spec, shape, dtype, m, shapes, real, inverse, signal)  # errors: agreed by einfft
    plan = plan_fft(problem)
    warning = None
    if plan.gathered:
        warning = (
            f"{formula!r}: no all-to-all or four-step plan exists for this layout; einfft gathers transform "
            f"axis {', '.join(repr(a) for a in plan.gathered)} whole on every rank (see docs/fft.md, "
            f"'When einfft gathers')"
        )
    if m.device_mesh is None:  # a virtual mesh: plan only (explain)
        bound = _Bound.__new__(_Bound)
        bound.plan, bound.steps, bound.local_error, bound.warning = plan, (), local_error, warning
        bound.mesh, bound.fingerprint = None, 0
        return bound, spec
    return _Bound(plan, m, norm, dtype, order, local_error, warning, device), spec


_EINFFT = Operation("einfft", plan=_plan, run=_run, vma_rule=_vma_rule, graph_plan=_graph_plan, names_op=False,
                    cache=_PLANS)
