"""Host CPU time per training step: einshard's styles against hand-written collectives, one process.

torch's fake process group (``init_process_group("fake", ...)``) lets one
process act as rank 0 of ``--world-size`` ranks: every collective returns at
once without moving data, so what is left of a step is the host's work
(Python and the dispatcher) — what a GPU waits for whenever its kernels are
short. Each variant runs one training step (forward, ``.square().sum()``,
backward) of an ``--layers``-layer tensor-parallel MLP with tiny tensors
(``y = x + gelu(x W1^T + b1) W2^T + b2`` per layer, ``W1``/``b1``
column-parallel and ``W2`` row-parallel over ``tp``):

On the mesh ``tp`` (``world_size`` ranks):

- ``hand``: hand-written autograd Functions (Megatron's copy to / reduce from
  the tensor-parallel region) around ``F.linear``: the baseline;
- ``formulas``: two ``es.einshard`` formulas per layer;
- ``shard_map_vma`` / ``shard_map``: the same body in ``es.shard_map`` with
  ``check_vma=True`` / ``False``, the layer's parameters passed as arguments
  with their specs (``f/tp c``, ...): each varies as its spec says, so nothing
  is pvary-ed or summed, and what ``shard_map_vma`` adds over ``shard_map`` is
  the cost of tracking. (A body that captured the parameters instead would
  declare them the same on every rank: tracking would pvary them and sum their
  gradients over ``tp``, which is wrong for blocks that differ by rank; see
  ``docs/shard_map.md``.)
- ``dtensor``: ``nn.Linear`` layers parallelised with DTensor's
  ``ColwiseParallel`` / ``RowwiseParallel``.

On the mesh ``dp`` x ``tp`` (2 x ``world_size / 2``), rows split over ``dp``:

- ``hand_dp``: ``hand`` plus one all-reduce over ``dp`` per gradient after backward;
- ``hooks``: formulas on a module whose parameters carry ``grad="dp"``,
  summed by ``es.params.register_native_grad_reduction_hooks_``;
- ``zero``: the same with ``store="dp"`` (ZeRO-3: the hooks gather each
  layer's parameters and reduce-scatter their gradients).

And one formula alone (forward + backward), ``size1``: ``b n c, f/one c -> b n
f/one`` on a mesh dimension ``one`` of size 1 against ``local``, the same
formula without the mesh (``b n c, f c -> b n f``), and ``torch``
(``F.linear``): ``extra_us`` is what the distributed formula costs beyond the
local one when nothing moves.

Every variant's gradients are checked against its baseline (``hand``,
``hand_dp``, ``torch``) first: the fake group's in-place collectives leave
their buffers as they are, so every style sees the same rank-0 numbers
(``zero`` and ``dtensor`` are not checked, ``nan``: a fake all-gather or
functional collective returns no rank's data; ``bench_tp_mlp.py`` checks
DTensor on real ranks). Then ``--rounds`` interleaved rounds time
``--number`` steps of each variant with ``time.process_time()`` (this
process's CPU time, steadier than wall time on a shared machine); the
medians are reported. One JSON line per variant and world size::

    python benchmarks/bench_host.py                       # world sizes 2 and 8
    python benchmarks/bench_host.py --world-size 2 --rounds 21
    python benchmarks/bench_host.py --group formula        # the size-1 formula alone

Fields: ``bench`` (``"host"``), ``group`` (``tp``, ``dp_tp``, ``formula``),
``variant``, ``world_size``, ``us_per_step`` (median), ``min_us``,
``ratio`` (to the group's baseline), ``extra_us`` (``us_per_step`` minus the
baseline's), ``extra_us_per_linear`` (over the ``2 * layers`` tensor-parallel
linears), ``max_rel_grad_error``, ``layers``, ``shape`` (``b, n, c, f``),
``number``, ``rounds``, ``torch_version``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import einshard as es
from bench_tp_mlp import CopyToTP, ReduceFromTP  # Megatron's copy to / reduce from the tp region


class Layer(torch.nn.Module):
    """One MLP layer holding this rank's blocks; ``style`` picks how it is written."""

    def __init__(self, w1, b1, w2, b2, style, group=None):
        super().__init__()
        self.w1, self.b1 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(b1.clone())
        self.w2, self.b2 = torch.nn.Parameter(w2.clone()), torch.nn.Parameter(b2.clone())
        self.style, self.group = style, group

    def forward(self, x):
        if self.style == "hand":
            h = F.gelu(F.linear(CopyToTP.apply(x, self.group), self.w1, self.b1))
            return x + ReduceFromTP.apply(F.linear(h, self.w2), self.group) + self.b2
        if self.style == "rows":  # rows split over dp (hooks, zero)
            h = F.gelu(es.einshard("b/dp n c, f/tp c -> b/dp n f/tp", x, self.w1) + self.b1)
            return x + es.einshard("b/dp n f/tp, c f/tp -> b/dp n c", h, self.w2) + self.b2
        return x + _body(x, self.w1, self.b1, self.w2, self.b2)


def _body(x, w1, b1, w2, b2):
    h = F.gelu(es.einshard("b n c, f/tp c -> b n f/tp", x, w1) + b1)
    return es.einshard("b n f/tp, c f/tp -> b n c", h, w2) + b2


_SPECS = {"w1": "f/tp c", "b1": "f/tp", "w2": "c f/tp", "b2": "c"}


def _weights(layers, c, f, tp, seed=0):
    """Per layer, this rank's (rank 0's) blocks and the whole weights."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        w1, b1 = torch.randn(f, c, generator=g) / c**0.5, torch.randn(f, generator=g) / 10
        w2, b2 = torch.randn(c, f, generator=g) / f**0.5, torch.randn(c, generator=g) / 10
        fl = f // tp
        out.append(((w1[:fl], b1[:fl], w2[:, :fl], b2), (w1, b1, w2, b2)))
    return out


def _model(weights, style, group=None):
    return torch.nn.Sequential(*[Layer(*blocks, style, group) for blocks, _ in weights])


def _step(model, x, before=None, after=None):
    """One training step of ``model`` on a fresh leaf copy of ``x``; returns (x's grad, parameter grads)."""
    def run():
        model.zero_grad(set_to_none=True)
        xl = x.detach().requires_grad_()
        if before is not None:
            before()
        model(xl).square().sum().backward()
        if after is not None:
            after()
        return xl

    return run


def _tp_variants(weights, mesh, x):
    group = mesh.group("tp")
    variants, models = {}, {}
    m = models["hand"] = _model(weights, "hand", group)
    variants["hand"] = _step(m, x)
    step = _step(models.setdefault("formulas", _model(weights, "formulas")), x)

    def formulas():
        with es.use_mesh(mesh):
            return step()

    variants["formulas"] = formulas
    # the parameters as arguments with their specs: each varies as its spec says, so nothing is pvary-ed
    for name, vma in (("shard_map_vma", True), ("shard_map", False)):
        m = models[name] = _model(weights, "formulas")
        for layer in m:
            body = es.shard_map(_layer_body, in_specs=("b n c", *_SPECS.values()), out_specs="b n c", mesh=mesh,
                                check_vma=vma)
            layer.forward = functools.partial(_with_parameters, body, layer)
        variants[name] = _step(m, x)
    variants["dtensor"], models["dtensor"] = _dtensor(weights, mesh, x)
    return variants, models


def _layer_body(x, w1, b1, w2, b2):
    return x + _body(x, w1, b1, w2, b2)


def _with_parameters(body, layer, x):
    return body(x, layer.w1, layer.b1, layer.w2, layer.b2)


def _dtensor(weights, mesh, x):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class Residual(torch.nn.Module):
        def __init__(self, w1, b1, w2, b2):
            super().__init__()
            self.up, self.down = torch.nn.Linear(w1.shape[1], w1.shape[0]), torch.nn.Linear(w2.shape[1], w2.shape[0])
            with torch.no_grad():  # whole weights: parallelize_module keeps this rank's shard
                self.up.weight.copy_(w1), self.up.bias.copy_(b1), self.down.weight.copy_(w2), self.down.bias.copy_(b2)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(x)))

    model = torch.nn.Sequential(*[Residual(*whole) for _, whole in weights])
    plan = {}
    for i in range(len(weights)):
        plan[f"{i}.up"], plan[f"{i}.down"] = ColwiseParallel(), RowwiseParallel()
    model = parallelize_module(model, mesh.device_mesh["tp"], plan)
    return _step(model, x), model


def _dp_tp_variants(weights, mesh, x):
    """Rows split over dp: x holds this rank's rows."""
    tp, dp = mesh.group("tp"), mesh.group("dp")
    variants, models = {}, {}
    m = models["hand_dp"] = _model(weights, "hand", tp)

    def sum_grads(m=m):
        for p in m.parameters():
            dist.all_reduce(p.grad, group=dp)

    variants["hand_dp"] = _step(m, x, after=sum_grads)
    for name, store in (("hooks", None), ("zero", "dp")):
        m = models[name] = _model(weights, "rows")
        for layer in m:
            es.params.register_module_parameter_layouts_(layer, _SPECS, mesh=mesh, grad="dp",
                                                  store=None if store is None else {k: store for k in ("w1", "w2", "b2")})
        handle = es.params.register_native_grad_reduction_hooks_(m, mesh, units=list(m) if store else None)

        def run(m=m, handle=handle):
            with es.use_mesh(mesh):
                xl = _step(m, x)()
            handle.wait()
            return xl

        variants[name] = run
    return variants, models


def _one_formula(mesh, x, w):
    def dist_():
        xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
        es.einshard("b n c, f/one c -> b n f/one", xl, wl, mesh=mesh).square().sum().backward()
        return xl, wl

    def local():
        xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
        es.einshard("b n c, f c -> b n f", xl, wl).square().sum().backward()
        return xl, wl

    def plain():
        xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
        F.linear(xl, wl).square().sum().backward()
        return xl, wl

    return {"torch": plain, "local": local, "size1": dist_}


def _grads(name, out, models):
    if isinstance(out, tuple):
        return [t.grad for t in out]
    m = models[name]
    grads = [out.grad]
    for p in m.parameters():
        g = p.grad
        grads.append(g.to_local() if hasattr(g, "to_local") else g)
    return grads


def _check(variants, models, baseline):
    want = _grads(baseline, variants[baseline](), models)
    errors = {}
    for name, run in variants.items():
        got = _grads(name, run(), models)
        if name in ("zero", "dtensor"):  # fake functional collectives / all-gathers return no rank's data
            errors[name] = float("nan")
            continue
        errors[name] = max(float((g - w).abs().max()) / (float(w.abs().max()) + 1e-30) for g, w in zip(got, want))
    return errors


def _time(variants, number, rounds, warmup):
    for _ in range(warmup):
        for run in variants.values():
            run()
    times = {k: [] for k in variants}
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            for name, run in variants.items():
                t0 = time.process_time()
                for _ in range(number):
                    run()
                times[name].append((time.process_time() - t0) / number * 1e6)
    finally:
        gc.enable()
    return times


def _report(group, times, errors, baseline, args, ws, linears):
    base = statistics.median(times[baseline])
    for name, ts in times.items():
        med = statistics.median(ts)
        line = {"bench": "host", "group": group, "variant": name, "world_size": ws, "us_per_step": round(med, 1),
                "min_us": round(min(ts), 1), "ratio": round(med / base, 3), "extra_us": round(med - base, 1),
                "extra_us_per_linear": round((med - base) / linears, 2) if linears else None,
                "max_rel_grad_error": float(f"{errors[name]:.2e}"), "layers": args.layers,
                "shape": [args.batch, args.seq, args.hidden, 4 * args.hidden], "number": args.number,
                "rounds": args.rounds, "torch_version": torch.__version__}
        print(json.dumps(line), flush=True)
        print(f"ws={ws} {group:>7} {name:>14}: {med:9.1f} us/step  x{med / base:.3f}  (grad err {errors[name]:.1e})",
              file=sys.stderr)
        if errors[name] > 1e-4:  # (nan: not checked)
            raise SystemExit(f"{name}: gradients differ from {baseline} by {errors[name]:.1e}")


def run_world(ws, args):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ws)
    try:
        b, n, c = args.batch, args.seq, args.hidden
        f = 4 * c
        torch.manual_seed(0)
        x = torch.randn(b, n, c)
        linears = 2 * args.layers
        if "tp" in args.group:
            mesh = es.wrap_mesh(init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",)))
            weights = _weights(args.layers, c, f, ws)
            variants, models = _tp_variants(weights, mesh, x)
            _report("tp", _time(variants, args.number, args.rounds, args.warmup), _check(variants, models, "hand"),
                    "hand", args, ws, linears)
        if "dp_tp" in args.group:
            mesh2 = es.wrap_mesh(init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp", "tp")))
            weights = _weights(args.layers, c, f, ws // 2)
            variants, models = _dp_tp_variants(weights, mesh2, x)
            _report("dp_tp", _time(variants, args.number, args.rounds, args.warmup),
                    _check(variants, models, "hand_dp"), "hand_dp", args, ws, linears)
        if "formula" in args.group:
            mesh1 = es.wrap_mesh(init_device_mesh("cpu", (1, ws), mesh_dim_names=("one", "tp")))
            variants = _one_formula(mesh1, x, torch.randn(f, c))
            _report("formula", _time(variants, args.number * args.layers, args.rounds, args.warmup),
                    _check(variants, {}, "torch"), "torch", args, ws, 0)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--group", nargs="+", default=["tp", "dp_tp", "formula"], choices=["tp", "dp_tp", "formula"],
                        help="which groups of variants to run (default all)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=16, help="c (default 16); f = 4c")
    parser.add_argument("--number", type=int, default=20, help="steps per round (default 20)")
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds; medians reported (default 11)")
    parser.add_argument("--warmup", type=int, default=5, help="steps of each variant before timing (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for ws in args.world_size:
        run_world(ws, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
