"""Host work in a steady-state call: a detector, and one steady-state case of every public op.

``HostWork(device)`` records, while active, what would make a CUDA call wait for the host or leave the
device: reads of tensor values on the host (``.item()``, ``.tolist()``, ``bool(t)``, ``aten._local_scalar_dense``,
``aten.is_nonzero``, ``aten.equal``, data-dependent shapes like ``aten.nonzero``), tensors made off ``device``
(any output of an aten op on another device type but ``meta``), and tensor factories called without
``device=`` (on CUDA operands they would land on the CPU, so a CPU run finds them too). On the CPU it is
approximate (a CPU tensor is on the operands' device; a host read of one costs nothing), which is why
``tests/integration/test_cuda.py`` also runs the same cases under ``torch.cuda.set_sync_debug_mode("error")``.

``cases(mesh, device)`` gives ``{name: (call, want)}``: ``call()`` runs one forward and backward of the op on
tensors prepared beforehand (nothing of the test's own runs inside it) and returns the forward output;
``want`` is the same output from whole tensors in one process (plain torch, or the op's local form on
whole tensors). The mesh is 1-D, named ``tp``, of any size dividing 4; checks are off around the calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import einshard as es
from einshard.comm import helpers, mappings
from einshard.comm.helpers import compute_split_shapes
from einshard.ops.conv import einconv
from einshard.ops.window import einwindow
from einshard.testing import local_block

DT = torch.float64

# torch functions that make a tensor from sizes, values or ranges (their device is an argument)
FACTORIES = frozenset(
    getattr(torch, name) for name in
    "zeros ones empty full arange range tensor as_tensor asarray randn rand randint randperm normal linspace "
    "logspace eye empty_strided scalar_tensor tril_indices triu_indices".split() if hasattr(torch, name)
)
# Tensor methods that read values on the host (a device-to-host copy and a wait on CUDA)
HOST_READS = frozenset(getattr(torch.Tensor, name) for name in
                       "item tolist numpy cpu __bool__ __int__ __float__ __index__".split())
# aten ops that read values on the host, or whose output shape depends on values
SYNCING = frozenset(
    "aten._local_scalar_dense aten.is_nonzero aten.equal aten.nonzero aten.masked_select aten._unique2 "
    "aten.unique_consecutive aten.unique_dim aten.repeat_interleave aten.allclose".split()
)


class _Functions(TorchFunctionMode):
    def __init__(self, found):
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            self.found.append(f"torch.{func.__name__}(...) without device=")
        elif func in HOST_READS:
            self.found.append(f"Tensor.{func.__name__}")
        return func(*args, **kwargs)


class _Dispatch(TorchDispatchMode):
    def __init__(self, found, device_type):
        super().__init__()
        self.found, self.device_type = found, device_type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        if name in SYNCING:
            self.found.append(f"{func} (a host read)")
        elif name == "aten.lift_fresh":
            self.found.append(f"{func} (a tensor from host data: a host-to-device copy on CUDA)")
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type not in (self.device_type, "meta"):
                self.found.append(f"{func} made a tensor on {t.device.type}")
        return out


class HostWork:
    """``with HostWork(device) as found: call()``; ``found`` lists the host work seen (empty: none).

    On CUDA (``syncs=True``, the default) a device-to-host synchronisation raises, too
    (``torch.cuda.set_sync_debug_mode("error")``): pass ``syncs=False`` where the communication itself goes
    through the host (gloo moving CUDA tensors).
    """

    def __init__(self, device, syncs: bool = True):
        self.device_type = torch.device(device).type
        self.syncs = syncs and self.device_type == "cuda"
        self.found: list[str] = []

    def __enter__(self):
        if self.syncs:
            self._debug = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        self._modes = [_Functions(self.found), _Dispatch(self.found, self.device_type)]
        for mode in self._modes:
            mode.__enter__()
        return self.found

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        if self.syncs:
            torch.cuda.set_sync_debug_mode(self._debug)
        return False


def steady_host_work(call, device, syncs: bool = True) -> list[str]:
    """The host work of ``call()``'s third run (the first plans and caches, the second settles)."""
    call()
    call()
    with HostWork(device, syncs) as found:
        call()
    return sorted(set(found))


# -- the cases ------------------------------------------------------------------------------------------


def _gen(*shape, seed, device, dtype=DT):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).to(device)


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _fwd_bwd(op, *leaves):
    """``call()``: ``op(*leaves)``, then backward of a real sum of it (grads accumulate, unread)."""

    def call():
        out = op(*leaves)
        real = torch.view_as_real(out) if out.is_complex() else out
        if real.requires_grad:
            real.sum().backward()
        return out.detach()

    return call


def _blocks(x, p):
    """``x`` cut into ``p`` blocks along dim 0, stacked: ``(p, rows, ...)``."""
    return x.reshape(p, x.shape[0] // p, *x.shape[1:])


class _Stored(torch.nn.Module):
    """One linear whose weight is stored sharded over ``tp`` (ZeRO-3) and gathered before use."""

    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(w)

    def forward(self, x):
        return es.einshard("b c, f c -> b f", x, self.w)


def cases(mesh, device) -> dict:
    p, r = mesh.size("tp"), mesh.index("tp")
    out: dict = {}

    def block(t, spec, shapes=None):
        return local_block(t, spec, mesh, shapes)

    # formulas: local, and every collective a plan uses (uneven blocks too)
    x, w = _gen(8, 4, seed=1, device=device), _gen(6, 4, seed=2, device=device)
    out["einshard local"] = (_fwd_bwd(lambda a, b: es.einshard("b c, h c -> b h", a, b), _leaf(x), _leaf(w)),
                             x @ w.T)
    out["einshard all-reduce"] = (
        _fwd_bwd(lambda a, b: es.einshard("b c/tp, h c/tp -> b h", a, b, mesh=mesh),
                 _leaf(block(x, "b c/tp")), _leaf(block(w, "h c/tp"))), x @ w.T)
    out["einshard reduce-scatter"] = (
        _fwd_bwd(lambda a, b: es.einshard("b c/tp, h c/tp -> b/tp h", a, b, mesh=mesh),
                 _leaf(block(x, "b c/tp")), _leaf(block(w, "h c/tp"))), block(x @ w.T, "b/tp h"))
    out["einshard all-to-all"] = (_fwd_bwd(lambda a: es.einshard("b/tp c -> b c/tp", a, mesh=mesh),
                                           _leaf(block(x, "b/tp c"))), block(x, "b c/tp"))
    u = _gen(7, 4, seed=3, device=device)
    uneven = {"tp": compute_split_shapes(7, p)}
    out["einshard all-gather, uneven shapes="] = (
        _fwd_bwd(lambda a: es.einshard("b/tp c -> b c", a, mesh=mesh, shapes=uneven),
                 _leaf(block(u, "b/tp c", uneven))), u)

    # shard_map and the named collectives inside it (variance tracked)
    def mapped(body, in_specs, out_specs, *args):
        return _fwd_bwd(es.shard_map(body, in_specs, out_specs, mesh=mesh, check_vma=True), *args)

    xb = _leaf(block(x, "b/tp c"))
    rows = _blocks(x, p)
    out["shard_map, whole in and out"] = (
        mapped(lambda a: torch.tanh(a), "b c -> b/tp c", "b/tp c -> b c", _leaf(x)), torch.tanh(x))
    out["psum"] = (mapped(lambda a: es.spmd.psum(a, "tp"), "b/tp c", "b c", xb), rows.sum(0))
    out["pmean"] = (mapped(lambda a: es.spmd.pmean(a, "tp"), "b/tp c", "b c", xb), rows.mean(0))
    out["pmax"] = (mapped(lambda a: es.spmd.pmax(a, "tp"), "b/tp c", "b c", xb.detach()), rows.amax(0))
    out["pmin"] = (mapped(lambda a: es.spmd.pmin(a, "tp"), "b/tp c", "b c", xb.detach()), rows.amin(0))
    out["all_gather"] = (mapped(lambda a: es.spmd.all_gather(a, "tp"), "b/tp c", "b c", xb), x)
    z = _gen(p, 8, 4, seed=4, device=device)
    out["psum_scatter"] = (mapped(lambda a: es.spmd.psum_scatter(a[0], "tp"), "p/tp b c", "b/tp c",
                                  _leaf(block(z, "p/tp b c"))), block(z.sum(0), "b/tp c"))
    out["all_to_all"] = (mapped(lambda a: es.spmd.all_to_all(a, "tp", 1, 0), "b/tp c", "b c/tp", xb), block(x, "b c/tp"))
    ring = [(i, (i + 1) % p) for i in range(p)]
    out["ppermute"] = (mapped(lambda a: es.spmd.ppermute(a, "tp", ring), "b/tp c", "b/tp c", xb),
                       block(rows.roll(1, 0).reshape(x.shape), "b/tp c"))
    v = _gen(4, seed=5, device=device)
    out["axis_index, axis_size, pvary"] = (
        mapped(lambda a, q: a * es.spmd.pvary(q, "tp") * (es.spmd.axis_index("tp") + 1) / es.spmd.axis_size("tp"),
               ("b/tp c", "c"), "b/tp c", xb, _leaf(v)),
        block(x * v * (torch.arange(p, device=device).repeat_interleave(8 // p)[:, None] + 1) / p, "b/tp c"))

    # FFTs: a transpose, a four-step transform (twiddles), an inverse real four-step one (weights)
    g = _gen(8, 6, seed=6, device=device)
    out["einfft transpose"] = (
        _fwd_bwd(lambda a: es.einfft("x/tp y -> kx ky/tp", a, {"x": "kx", "y": "ky"}, mesh=mesh),
                 _leaf(block(g, "x/tp y"))), block(torch.fft.fftn(g), "kx ky/tp"))
    s = _gen(24, seed=7, device=device, dtype=torch.complex128)
    out["einfft four-step"] = (_fwd_bwd(lambda a: es.einfft("x/tp -> kx/tp", a, {"x": "kx"}, mesh=mesh),
                                        _leaf(block(s, "x/tp"))), block(torch.fft.fft(s), "kx/tp"))
    h = torch.fft.rfft(_gen(24, seed=8, device=device))  # 13 frequencies: uneven
    split = {"tp": {"kx": compute_split_shapes(13, p)}}
    out["einfft inverse real four-step, uneven shapes="] = (
        _fwd_bwd(lambda a: es.einfft("kx/tp -> x/tp", a, {"kx": "x"}, mesh=mesh, shapes=split, real=True,
                                     inverse=True, signal_sizes={"x": 24}), _leaf(block(h, "kx/tp", split))),
        block(torch.fft.irfft(h, n=24), "x/tp"))
    # the same uneven calls inside shard_map, whose specs make the split shapes ambient: nothing to agree on
    out["einshard all-gather, uneven, in shard_map"] = (
        _fwd_bwd(es.shard_map(lambda a: es.einshard("b/tp c -> b c", a), "b/tp c", "b c", mesh=mesh, shapes=uneven),
                 _leaf(block(u, "b/tp c", uneven))), u)
    out["einfft inverse real four-step, uneven, in shard_map"] = (
        _fwd_bwd(es.shard_map(lambda a: es.einfft("kx/tp -> x/tp", a, {"kx": "x"}, real=True, inverse=True,
                                                  signal_sizes={"x": 24}), "kx/tp", "x/tp", mesh=mesh,
                              shapes={"tp": {**split["tp"], "x": compute_split_shapes(24, p)}}),
                 _leaf(block(h, "kx/tp", split))), block(torch.fft.irfft(h, n=24), "x/tp"))

    # stencils: halos, windows, convolutions, rolls
    grid = _gen(8, 5, seed=9, device=device)
    n = 8 // p
    widened = torch.cat([grid[-1:], grid, grid[:1]])
    out["einhalo"] = (_fwd_bwd(lambda a: es.einhalo("x/tp y", a, {"x": 1}, boundary="periodic", mesh=mesh),
                               _leaf(block(grid, "x/tp y"))), widened[r * n:r * n + n + 2])
    img = _gen(2, 8, 6, 3, seed=10, device=device)
    out["einwindow"] = (
        _fwd_bwd(lambda a: einwindow("b h/tp w c -> b h/tp w kh c", a, {"h": "kh"}, {"h": 1}, mesh=mesh),
                 _leaf(block(img, "b h/tp w c"))),
        block(einwindow("b h w c -> b h w kh c", img, {"h": "kh"}, {"h": 1}), "b h/tp w kh c"))
    kernel, bias = _gen(4, 3, 3, 3, seed=11, device=device), _gen(4, seed=12, device=device)
    out["einconv"] = (
        _fwd_bwd(lambda a, k, b: einconv("b h/tp w c, o c kh kw -> b h/tp w o", a, k, {"h": "kh", "w": "kw"},
                                         bias=b, boundary="periodic", mesh=mesh),
                 _leaf(block(img, "b h/tp w c")), _leaf(kernel), _leaf(bias)),
        block(einconv("b h w c, o c kh kw -> b h w o", img, kernel, {"h": "kh", "w": "kw"}, bias=bias,
                      boundary="periodic"), "b h/tp w o"))
    out["einroll"] = (_fwd_bwd(lambda a: es.einroll("x/tp y", a, {"x": 3}, mesh=mesh), _leaf(block(grid, "x/tp y"))),
                      block(torch.roll(grid, 3, 0), "x/tp y"))

    # attention over a sequence split across the ranks
    q, k, vv = (_gen(1, 4, 8, 4, seed=13 + i, device=device) for i in range(3))
    whole = F.scaled_dot_product_attention(q, k, vv, is_causal=True)
    for name, fn in (("ring_attention", es.attention.ring_attention), ("ulysses_attention", es.attention.ulysses_attention)):
        out[name] = (_fwd_bwd(lambda a, b, c, fn=fn: fn(a, b, c, "tp", causal=True, mesh=mesh),
                              *(_leaf(block(t, "b h n/tp d")) for t in (q, k, vv))), block(whole, "b h n/tp d"))

    # whole trees to blocks and back
    out["tree_shard, tree_gather"] = (
        _fwd_bwd(lambda a: es.tree_gather(es.tree_shard(a, "b c/tp", mesh=mesh), "b c/tp", mesh=mesh), _leaf(x)), x)

    # ZeRO-3: a weight stored sharded over tp, gathered before use by the module's hooks
    wz = _gen(5, 4, seed=16, device=device)
    net = _Stored(wz.clone())
    es.params.register_module_parameter_layouts_(net, {"w": "f c"}, mesh=mesh, store={"w": "tp"}, sizes={"f": 5, "c": 4})
    handle = es.params.register_native_grad_reduction_hooks_(net, mesh)
    xr = x[:, :4]

    def zero_step():
        with es.use_mesh(mesh):
            y = net(xr)
            y.square().sum().backward()
        handle.wait()
        return y.detach()

    out["ZeRO gather"] = (zero_step, xr @ wz.T)

    # the plain collectives of es.comm.helpers and the autograd mappings of es.comm.mappings
    group = mesh.group("tp")
    out["helpers.all_reduce"] = (_fwd_bwd(lambda a: helpers.all_reduce(a.detach().clone(), group), xb.detach()),
                                 block(x, "b/tp c") * 0 + rows.sum(0))
    out["helpers.all_gather, uneven"] = (
        _fwd_bwd(lambda a: helpers.all_gather(a, group, 0, uneven["tp"]), block(u, "b/tp c", uneven)), u)
    out["helpers.reduce_scatter"] = (_fwd_bwd(lambda a: helpers.reduce_scatter(a[0], group, 0), block(z, "p/tp b c")),
                                     block(z.sum(0), "b/tp c"))
    out["helpers.all_to_all"] = (_fwd_bwd(lambda a: helpers.all_to_all(a, group, 0, 1), xb.detach()),
                                 block(x, "b c/tp"))
    out["mappings.allgather_forward_split_backward"] = (
        _fwd_bwd(lambda a: mappings.allgather_forward_split_backward(a, group, 0), xb), x)
    out["mappings.reducescatter_forward_allgather_backward"] = (
        _fwd_bwd(lambda a: mappings.reducescatter_forward_allgather_backward(a[0], group, 0),
                 _leaf(block(z, "p/tp b c"))), block(z.sum(0), "b/tp c"))
    out["mappings.alltoall_repartition"] = (
        _fwd_bwd(lambda a: mappings.alltoall_repartition(a, group, 0, 1), xb), block(x, "b c/tp"))
    out["mappings.ppermute"] = (_fwd_bwd(lambda a: mappings.ppermute(a, group, ring), xb),
                                block(rows.roll(1, 0).reshape(x.shape), "b/tp c"))
    return out


# cases whose host work is their documented design (docs/distributed.md, docs/params.md), with the reason; on a
# 1-rank mesh there is nobody to agree with, so they do none
BY_DESIGN = {
    "einshard all-gather, uneven shapes=": "an explicit shapes= is agreed on every call (one rank's block may "
                                           "contradict it); inside shard_map the specs' shapes cost nothing",
    "einfft inverse real four-step, uneven shapes=": "the same: an explicit shapes= is agreed on every call",
    "tree_shard, tree_gather": "tree_gather finds uneven splits from one all-gather of local sizes per call (a "
                               "checkpointing tool, not a training step)",
}


def check_cases(mesh, device) -> dict:
    """Every case's output checked against its whole-tensor reference; returns ``{name: host work found}`` for
    the cases whose host work is not exactly as :data:`BY_DESIGN` says (none there, some where it names)."""
    bad = {}
    for name, (call, want) in cases(mesh, device).items():
        got = call()
        assert got.device == want.device, f"{name}: output on {got.device}, operands on {want.device}"
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")
        expected = name in BY_DESIGN and mesh.size("tp") > 1
        found = steady_host_work(call, device, syncs=not expected)  # (by design: a sync on CUDA, seen here)
        if bool(found) != expected:
            bad[name] = found or "none, but BY_DESIGN says some"
    return bad
