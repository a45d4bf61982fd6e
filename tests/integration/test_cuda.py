"""CUDA: every public op, and training steps of the GPT and FNO examples, on GPUs; no host work in a steady call.

Marked ``cuda``: deselected where CUDA (or, for ``devices=2``, a second GPU) is missing (tests/conftest.py).

- One GPU: every public op (tests/integration/host_work.py's cases: forward and backward, compared with the same
  computation on whole tensors in one process) on a 1-rank NCCL mesh, each steady-state call under
  ``torch.cuda.set_sync_debug_mode("error")`` and the host-work detector; a few training steps of
  ``examples/gpt.py`` (both styles) and ``examples/fno.py`` on a 1-rank NCCL mesh (one ``torchrun`` rank,
  ``launch(device="cuda")``) against their one-process references on the same GPU.
- Two ranks over gloo on one GPU: the paths whose only communication is all-reduce (gloo moves CUDA tensors
  for those alone; it stages them through the host, so no sync-debug mode there).
- Two GPUs: every public op over a 2-rank NCCL mesh, as on one.

The unmarked tests run the same functions on CPU ranks, so a machine without a GPU checks that they are sane.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention import SDPBackend, sdpa_kernel

import einshard as es
from einshard.attention import kernels as attention_kernels
from einshard.testing import local_block, rank_device
from host_work import HostWork, check_cases
from scripts import ROOT, torchrun

sys.path.insert(0, str(ROOT / "examples"))
import fno  # noqa: E402  (examples/fno.py)
import gpt  # noqa: E402  (examples/gpt.py)

DT = torch.float64
GPT_STEPS = 3


def gen(*shape, seed, device, dtype=DT):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).to(device)


def err(a, b) -> float:
    return (a.detach() - b.detach()).abs().max().item() if a.numel() else 0.0


def agree_errors(errs: dict, tol: float = 1e-10) -> None:
    names = sorted(errs)
    t = torch.tensor([float(errs[n]) for n in names], dtype=DT)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # (the pool's gloo group: a CPU tensor)
    bad = {n: v for n, v in zip(names, t.tolist()) if not v <= tol}
    assert not bad, f"errors above {tol}: {bad}"


# -- meshes ---------------------------------------------------------------------------------------------

_NCCL: dict = {}


def nccl_group():
    """An NCCL group over every rank of the pool, a GPU per rank (made once per process; the rank's device set)."""
    if "group" not in _NCCL:
        torch.cuda.set_device(dist.get_rank())
        _NCCL["group"] = dist.new_group(backend="nccl")
    return _NCCL["group"]


def group_mesh(group, device_type: str):
    """A 1-D mesh ``tp`` over every rank of ``group``."""
    return es.wrap_mesh(DeviceMesh.from_group(group, device_type, mesh_dim_names=("tp",)))


def nccl_mesh():
    return group_mesh(nccl_group(), "cuda")


def cpu_mesh():
    """The same kind of mesh on the pool's gloo group."""
    return group_mesh(dist.group.WORLD, "cpu")


# -- the checks -----------------------------------------------------------------------------------------


def reduce_case(mesh, device) -> dict:
    """A formula and a shard_map step whose only communication is all-reduce (gloo moves CUDA tensors then).
    What the body computes is the library's alone: the test's own values are made outside the measured call."""
    x, w, v = gen(5, 6, seed=3, device=device), gen(3, 6, seed=4, device=device), gen(6, seed=5, device=device)
    xl = local_block(x, "b c/tp", mesh).requires_grad_()
    wl = local_block(w, "h c/tp", mesh).requires_grad_()

    def formula():
        return es.einshard("b c/tp, h c/tp -> b h", xl, wl, mesh=mesh)  # partial sums, all-reduced

    y = formula()
    assert y.device == xl.device
    vp = v.clone().requires_grad_()

    @es.shard_map(("b/tp c", "c"), "", mesh=mesh)
    def loss_fn(xb, p):  # p is replicated: its gradient is summed over tp (pvary's all-reduce)
        return es.spmd.psum((xb * p).square().sum(), "tp")

    u = gen(6, 6, seed=11, device=device)
    ul = local_block(u, "b/tp c", mesh)
    loss = loss_fn(ul, vp)
    loss.backward()
    vr = v.clone().requires_grad_()
    ref = (u * vr).square().sum()
    ref.backward()
    for call in (formula, lambda: loss_fn(ul, vp)):
        call()  # plans are made (and cached) by the first calls; this one is the steady state
        with HostWork(device, syncs=False) as found:
            call()
        assert not found, found
    return {"formula": err(y, x @ w.T), "loss": err(loss, ref), "grad": err(vp.grad, vr.grad)}


def gpt_case(mesh, style: str) -> float:
    """``GPT_STEPS`` Adam steps of examples/gpt.py on ``mesh`` (dp x sp x tp) against the one-process training
    on the same device: the largest loss difference."""
    cfg = gpt.CONFIG
    model = gpt.sharded_model(mesh, gpt.init_values(cfg), cfg, style)
    assert {p.device for p in model.parameters()} == {rank_device()}
    optimizer = torch.optim.Adam(model.parameters(), lr=gpt.LR)
    losses = gpt.train(mesh, model, optimizer, range(GPT_STEPS), style)
    ref = gpt.reference_training(GPT_STEPS, cfg)
    return max(abs(a - b) for a, b in zip(losses, ref))


def fno_case(mesh) -> float:
    """examples/fno.py's training on ``mesh`` (px x py) against the one-process training: the largest difference
    of losses and parameters (the example's own report)."""
    lines = fno.run(mesh.device_mesh)
    return float(re.search(r"max difference from single-process training: (\S+)", lines[-1]).group(1))


def examples_case(mesh3, mesh2) -> dict:
    return {"gpt shard_map": gpt_case(mesh3, "shard_map"), "gpt einshard": gpt_case(mesh3, "einshard"),
            "fno": fno_case(mesh2)}


def _blockwise(kern, q, k, v, dout, causal: bool, blocks: int):
    """Attention of ``q`` to ``k``, ``v`` cut into ``blocks`` key blocks, each pair on ``kern``, merged with the
    log-sum-exps as a ring merges them (fp32), the backward of every pair from the merged output and
    log-sum-exp; causal: the queries cut alike, pairs above the diagonal skipped, the diagonal causal."""
    n = q.shape[-2]
    cuts = [n * i // blocks for i in range(blocks + 1)]
    scale = q.shape[-1] ** -0.5
    rows = []
    for i in range(blocks):
        qi = q[..., cuts[i]:cuts[i + 1], :]
        parts = [kern.forward(qi, k[..., cuts[j]:cuts[j + 1], :], v[..., cuts[j]:cuts[j + 1], :],
                              causal and i == j, scale) for j in range(i + 1 if causal else blocks)]
        lse = torch.logsumexp(torch.stack([p[1].float() for p in parts]), 0)
        out = sum(p[0].float() * (p[1].float() - lse).exp().unsqueeze(-1) for p in parts)
        rows.append((out.to(q.dtype), lse))
    out = torch.cat([o for o, _ in rows], -2)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    for i, (oi, lse) in enumerate(rows):
        qs = slice(cuts[i], cuts[i + 1])
        for j in range(i + 1 if causal else blocks):
            ks = slice(cuts[j], cuts[j + 1])
            gq, gk, gv = kern.backward(dout[..., qs, :], q[..., qs, :], k[..., ks, :], v[..., ks, :], oi, lse,
                                       causal and i == j, scale)
            dq[..., qs, :] += gq
            dk[..., ks, :] += gk.float()
            dv[..., ks, :] += gv.float()
    return out, dq, dk.to(k.dtype), dv.to(v.dtype)


def _whole_and_floor(q, k, v, dout, dtype, **sdpa):
    """Whole attention in float64 (output and the gradients of ``q``, ``k``, ``v`` for ``dout``), the inputs in
    ``dtype`` (leaves needing gradients), and per part the error of ``F.scaled_dot_product_attention`` itself in
    ``dtype`` against float64 (at least 1e-6): the floor a fused path's error is measured against."""
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out = F.scaled_dot_product_attention(*ref, **sdpa)
    want = (want_out, *torch.autograd.grad(want_out, ref, dout))
    low = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    low_out = F.scaled_dot_product_attention(*low, **sdpa)
    floor = [max(err(s.double(), w), 1e-6) for s, w in zip((low_out, *torch.autograd.grad(low_out, low,
                                                                                         dout.to(dtype))), want)]
    return want, low, floor


def fused_kernel_case(device, dtype, n: int = 256, heads: int = 4, width: int = 64) -> dict:
    """Every fused kernel ``attention_kernels`` can pick on ``device`` for ``dtype``, on 1 and 3 key blocks,
    causal and not: values and gradients against float64 whole attention, as a ratio to the error of
    ``F.scaled_dot_product_attention`` itself in ``dtype`` (the fused kernel's own tolerance; the largest)."""
    q, k, v, dout = (gen(2, heads, n, width, seed=s, device=device) for s in (21, 22, 23, 24))
    backends = ([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
                if torch.device(device).type == "cuda" else [SDPBackend.FLASH_ATTENTION])
    ratios = {}
    for causal in (False, True):
        want, low, floor = _whole_and_floor(q, k, v, dout, dtype, is_causal=causal)
        for backend in backends:
            with sdpa_kernel([backend]):
                kern = attention_kernels.kernel(str(torch.device(device).type), dtype, width, width)
            assert kern is not attention_kernels.EXACT, (device, dtype, backend)
            ratios[kern.name] = 0.0  # (which kernels ran: the test names them)
            for blocks in (1, 3):
                got = _blockwise(kern, *(t.detach() for t in low), dout.to(dtype), causal, blocks)
                for name, g, w, f in zip(("out", "dq", "dk", "dv"), got, want, floor):
                    ratios[f"{kern.name} causal={causal} blocks={blocks} {name}"] = err(g.double(), w) / f
    return ratios


def ring_on_one_gpu_case(mesh, device, dtype) -> dict:
    """``es.attention.ring_attention`` and ``es.attention.ulysses_attention`` on ``mesh`` (one rank: the whole sequence one block)
    in ``dtype``, causal zigzag and grouped-query: error against float64 whole attention as a ratio to
    ``F.scaled_dot_product_attention``'s own in ``dtype``."""
    n, heads, kv_heads, width = 512, 8, 2, 64
    q = gen(1, heads, n, width, seed=31, device=device)
    k, v = (gen(1, kv_heads, n, width, seed=s, device=device) for s in (32, 33))
    dout = gen(1, heads, n, width, seed=34, device=device)
    want, low, floor = _whole_and_floor(q, k, v, dout, dtype, is_causal=True, enable_gqa=True)
    ratios = {}
    with es.use_mesh(mesh):
        for name, fn in (("ring", es.attention.ring_attention), ("ulysses", es.attention.ulysses_attention)):
            xs = [t.detach().clone().requires_grad_() for t in low]
            out = fn(*xs, "tp", causal=True, **({"layout": "zigzag"} if name == "ring" else {}))
            got = (out, *torch.autograd.grad(out, xs, dout.to(dtype)))
            for part, g, w, f in zip(("out", "dq", "dk", "dv"), got, want, floor):
                ratios[f"{name} {part}"] = err(g.double(), w) / f
    return ratios


#: a fused path may differ from whole attention by at most this many times F.sdpa's own error in its dtype
FUSED_ERROR_RATIO = 4.0


# the examples' steps as a user runs them: one torchrun rank, launch(device=...) (NCCL world on a GPU)
EXAMPLES_SCRIPT = textwrap.dedent(f"""
    import json, sys
    sys.path[:0] = [{str(Path(__file__).resolve().parent)!r}]
    import einshard as es
    from einshard.testing import device_mesh, launch
    import test_cuda

    def on_rank():
        mesh3 = es.wrap_mesh(device_mesh((1, 1, 1), ("dp", "sp", "tp")))
        return test_cuda.examples_case(mesh3, es.wrap_mesh(device_mesh((1, 1), ("px", "py"))))

    if __name__ == "__main__":
        results = launch(on_rank, 1, device=sys.argv[1])
        print("ERRORS", json.dumps(results[0]), flush=True)
""")


def examples_under_torchrun(tmp_path, device: str) -> dict:
    script = tmp_path / "example_steps.py"
    script.write_text(EXAMPLES_SCRIPT)
    proc = torchrun(script, 1, device, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return json.loads(re.search(r"^ERRORS (.*)$", proc.stdout, re.M).group(1))


# -- CPU ranks: the same functions, so that a machine without a GPU checks them -------------------------------


@pytest.mark.ranks(1, checks=False)
def test_every_public_op_on_one_cpu_rank():
    assert not check_cases(cpu_mesh(), "cpu")


@pytest.mark.ranks(2, checks=False)
def test_all_reduce_paths_on_cpu_ranks():
    agree_errors(reduce_case(cpu_mesh(), "cpu"))


def test_example_steps_under_torchrun_on_one_cpu_rank(tmp_path):
    errs = examples_under_torchrun(tmp_path, "cpu")
    assert set(errs) == {"gpt shard_map", "gpt einshard", "fno"} and max(errs.values()) < 1e-10, errs


# -- GPUs -----------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.ranks(1, checks=False)
def test_every_public_op_on_one_gpu_over_nccl():
    mesh = nccl_mesh()
    bad = check_cases(mesh, "cuda:0")  # each steady call under set_sync_debug_mode("error") and the detector
    assert not bad, bad


@pytest.mark.cuda
def test_gpt_and_fno_examples_train_on_one_gpu_over_nccl(tmp_path):
    """One torchrun rank with ``--device cuda``: an NCCL world, the examples' tensors on the GPU."""
    errs = examples_under_torchrun(tmp_path, "cuda")
    assert set(errs) == {"gpt shard_map", "gpt einshard", "fno"} and max(errs.values()) < 1e-10, errs


@pytest.mark.cuda
@pytest.mark.ranks(2, checks=False)  # checks agree on host flags over gloo: not the operands' device
def test_all_reduce_formula_and_shard_map_on_cuda_over_gloo():
    agree_errors(reduce_case(cpu_mesh(), "cuda"))


@pytest.mark.cuda(devices=2)
@pytest.mark.ranks(2, checks=False)
def test_every_public_op_over_nccl_on_two_gpus():
    bad = check_cases(nccl_mesh(), f"cuda:{dist.get_rank()}")
    assert not bad, bad


def test_fused_kernel_blocks_merge_to_whole_attention_on_cpu():
    ratios = fused_kernel_case("cpu", torch.float32)
    assert max(ratios.values()) <= FUSED_ERROR_RATIO, ratios


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_kernel_blocks_merge_to_whole_attention_on_a_gpu(dtype):
    """The CUDA flash and memory-efficient kernels ring attention runs per block pair, merged over key blocks."""
    ratios = fused_kernel_case("cuda", dtype)
    assert {"cuda_cudnn", "cuda_flash", "cuda_efficient"} <= set(ratios), sorted(ratios)
    assert max(ratios.values()) <= FUSED_ERROR_RATIO, ratios


@pytest.mark.ranks(1, checks=False)
def test_ring_and_ulysses_on_one_cpu_rank_in_low_precision():
    ratios = ring_on_one_gpu_case(cpu_mesh(), "cpu", torch.bfloat16)
    assert max(ratios.values()) <= FUSED_ERROR_RATIO, ratios


@pytest.mark.cuda
@pytest.mark.ranks(1, checks=False)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ring_and_ulysses_on_one_gpu_over_nccl(dtype):
    ratios = ring_on_one_gpu_case(nccl_mesh(), "cuda:0", dtype)
    assert max(ratios.values()) <= FUSED_ERROR_RATIO, ratios
