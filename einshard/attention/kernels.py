"""The per-block kernels of ring attention: one block pair's output and log-sum-exp, and its gradients.

A ring step attends this rank's queries to one block of keys; the blocks are
merged with their log-sum-exps, and backward recomputes every block pair from
the merged output and log-sum-exp. A *kernel* does one pair:

- ``forward(q, k, v, causal, scale) -> (out, lse)``: ``out`` in ``q``'s
  dtype, ``lse`` (shape ``q.shape[:-1]``) in float32 (float64 for float64);
- ``backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)`` with
  ``out`` and ``lse`` those of the *merged* rows.

``causal`` masks a square pair as a chunk against itself (position ``i`` sees
``<= i``). :func:`kernel` picks one for a device, dtype and head sizes: the
fused SDPA op that ``F.scaled_dot_product_attention`` would run there (CPU:
its flash kernel; CUDA: cuDNN, flash or memory-efficient), or :data:`EXACT`, plain
matmuls with a materialised block of scores, where none applies — always for
float64, whose exactness is the point of choosing it.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

from ..core import _trace

__all__ = ["EXACT", "kernel", "enabled_backends", "FUSED_OPS"]

_aten = torch.ops.aten

#: every fused op used here and the argument names it is called with; an op missing from this torch, or
#: whose arguments differ, is not used (its blocks take the exact path)
FUSED_OPS = {
    "_scaled_dot_product_flash_attention_for_cpu": (
        "query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale"),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        "grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal", "attn_mask", "scale"),
    "_scaled_dot_product_flash_attention": (
        "query", "key", "value", "dropout_p", "is_causal", "return_debug_mask", "scale"),
    "_scaled_dot_product_flash_attention_backward": (
        "grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
        "dropout_p", "is_causal", "philox_seed", "philox_offset", "scale"),
    "_scaled_dot_product_efficient_attention": (
        "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "scale"),
    "_scaled_dot_product_efficient_attention_backward": (
        "grad_out_", "query", "key", "value", "attn_bias", "out", "logsumexp", "philox_seed", "philox_offset",
        "dropout_p", "grad_input_mask", "is_causal", "scale"),
    "_scaled_dot_product_cudnn_attention": (
        "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "return_debug_mask",
        "scale"),
    "_scaled_dot_product_cudnn_attention_backward": (
        "grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset", "attn_bias",
        "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale"),
}


def _matches(name: str) -> bool:
    packet = getattr(_aten, name, None)
    if packet is None or "default" not in packet.overloads():
        return False
    return tuple(a.name for a in packet.default._schema.arguments) == FUSED_OPS[name]


_USABLE = {name for name in FUSED_OPS if _matches(name)}


def _4d(x: torch.Tensor) -> torch.Tensor:
    """``(..., n, d)`` as the ``(1, heads, n, d)`` the fused ops take (leading dimensions as heads; a view)."""
    return x.reshape(1, -1, x.shape[-2], x.shape[-1])


def _rows(lse: torch.Tensor) -> torch.Tensor:
    """A log-sum-exp ``(..., n)`` as the ``(1, heads, n)`` the fused backward ops take."""
    return lse.reshape(1, -1, lse.shape[-1])


def _block_result(o: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, v: torch.Tensor) -> tuple:
    """A fused op's ``(1, heads, n, e)`` output and its log-sum-exp (``n`` values a row) in the shapes of
    ``q``'s rows: ``(..., n, e)`` and ``(..., n)``."""
    return o.reshape(q.shape[:-1] + v.shape[-1:]), lse.reshape(q.shape[:-1])


def _block_grads(grads, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """A fused backward op's gradients of ``q``, ``k``, ``v`` (4-D) in their shapes."""
    return tuple(g.reshape(t.shape) for g, t in zip(grads, (q, k, v)))


# -- the exact path -------------------------------------------------------------------------------


def _scores(q, k, scale: float, causal: bool) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if causal:  # a chunk against itself: position i sees positions <= i
        n = s.shape[-1]
        s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    return s


class _Exact:
    """Plain matmuls, the block's scores materialised: exact in any dtype (the reference in float64)."""

    name, native_gqa = "exact", False

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        s = _scores(q, k, scale, causal)
        m = s.amax(-1, keepdim=True)
        p = s.sub_(m).exp_()
        total = p.sum(-1, keepdim=True)
        lse = (m + total.log()).squeeze(-1)
        return torch.matmul(p, v).div_(total), lse.to(torch.promote_types(lse.dtype, torch.float32))

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float):
        delta = (dout * out).sum(-1, keepdim=True)
        p = _scores(q, k, scale, causal).sub_(lse.to(q.dtype).unsqueeze(-1)).exp_()
        dv = torch.matmul(p.transpose(-1, -2), dout)
        ds = p.mul_(torch.matmul(dout, v.transpose(-1, -2)).sub_(delta)).mul_(scale)
        return torch.matmul(ds, k), torch.matmul(ds.transpose(-1, -2), q), dv


EXACT = _Exact()


# -- the fused ops --------------------------------------------------------------------------------


class _CpuFlash:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward."""

    name, native_gqa = "cpu_flash", True  # kv heads broadcast over groups of q heads, as enable_gqa=True

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        o, lse = _aten._scaled_dot_product_flash_attention_for_cpu(_4d(q), _4d(k), _4d(v), 0.0, causal, scale=scale)
        return _block_result(o, lse, q, v)

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float):
        grads = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _4d(dout), _4d(q), _4d(k), _4d(v), _4d(out), _rows(lse).contiguous(), 0.0,
            causal, scale=scale)
        return _block_grads(grads, q, k, v)


class _CudaFlash:
    """``aten._scaled_dot_product_flash_attention`` and its backward (no dropout: the random state unused)."""

    name, native_gqa = "cuda_flash", True

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        o, lse = _aten._scaled_dot_product_flash_attention(_4d(q), _4d(k), _4d(v), 0.0, causal, False,
                                                           scale=scale)[:2]
        return _block_result(o, lse, q, v)

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float):
        unused = torch.empty(0, dtype=torch.int64, device=q.device)
        grads = _aten._scaled_dot_product_flash_attention_backward(
            _4d(dout), _4d(q), _4d(k), _4d(v), _4d(out), _rows(lse).contiguous(),
            None, None, q.shape[-2], k.shape[-2], 0.0, causal, unused, unused, scale=scale)
        return _block_grads(grads, q, k, v)


class _CudaEfficient:
    """``aten._scaled_dot_product_efficient_attention`` and its backward (its log-sum-exp padded to 32 rows)."""

    name, native_gqa = "cuda_efficient", False

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        o, lse = _aten._scaled_dot_product_efficient_attention(_4d(q), _4d(k), _4d(v), None, True, 0.0, causal,
                                                               scale=scale)[:2]
        return _block_result(o, lse[..., : q.shape[-2]], q, v)  # (its log-sum-exp padded to 32 rows)

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float):
        n = q.shape[-2]
        padded = torch.nn.functional.pad(_rows(lse), (0, -n % 32)).contiguous()
        unused = torch.empty((), dtype=torch.int64, device=q.device)
        grads = _aten._scaled_dot_product_efficient_attention_backward(
            _4d(dout), _4d(q), _4d(k), _4d(v), None, _4d(out), padded, unused, unused, 0.0,
            [True, True, True, False], causal, scale=scale)[:3]
        return _block_grads(grads, q, k, v)


class _CudaCudnn:
    """``aten._scaled_dot_product_cudnn_attention`` and its backward (its log-sum-exp ``(..., n, 1)``; no dropout,
    so the random state and the nested-tensor offsets are unused)."""

    name, native_gqa = "cuda_cudnn", False

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        o, lse = _aten._scaled_dot_product_cudnn_attention(_4d(q), _4d(k), _4d(v), None, True, 0.0, causal, False,
                                                           scale=scale)[:2]
        return _block_result(o, lse, q, v)

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float):
        unused = torch.empty((), dtype=torch.int64, device=q.device)
        grads = _aten._scaled_dot_product_cudnn_attention_backward(
            _4d(dout), _4d(q), _4d(k), _4d(v), _4d(out), _rows(lse).unsqueeze(-1).contiguous(), unused, unused,
            None, None, None, q.shape[-2], k.shape[-2], 0.0, causal, scale=scale)
        return _block_grads(grads, q, k, v)


def _repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``(..., h, n, d)`` with every head repeated ``groups`` times in place (``repeat_interleave`` on ``-3``)."""
    shape = x.shape
    return x.unsqueeze(-3).expand(*shape[:-2], groups, *shape[-2:]).reshape(*shape[:-3], -1, *shape[-2:])


def _fold(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The adjoint of :func:`_repeat`: every run of ``groups`` heads summed."""
    shape = x.shape
    return x.reshape(*shape[:-3], -1, groups, *shape[-2:]).sum(-3)


class _Grouped:
    """Grouped-query attention on a kernel without it: the block's keys and values repeated over each group of
    query heads (here, per block pair; never before they travel), their gradients summed back."""

    native_gqa = True

    def __init__(self, base, groups: int):
        self.base, self.groups = base, groups
        self.name = f"{base.name} (kv heads repeated x{groups} per block)"

    def forward(self, q, k, v, causal: bool, scale: float):
        return self.base.forward(q, _repeat(k, self.groups), _repeat(v, self.groups), causal, scale)

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        dq, dk, dv = self.base.backward(dout, q, _repeat(k, self.groups), _repeat(v, self.groups), out, lse,
                                        causal, scale)
        return dq, _fold(dk, self.groups), _fold(dv, self.groups)


_FUSED = {  # device type, backend: the kernel, needing these ops
    ("cpu", SDPBackend.FLASH_ATTENTION): (_CpuFlash(), ("_scaled_dot_product_flash_attention_for_cpu",
                                                        "_scaled_dot_product_flash_attention_for_cpu_backward")),
    ("cuda", SDPBackend.FLASH_ATTENTION): (_CudaFlash(), ("_scaled_dot_product_flash_attention",
                                                          "_scaled_dot_product_flash_attention_backward")),
    ("cuda", SDPBackend.EFFICIENT_ATTENTION): (_CudaEfficient(), ("_scaled_dot_product_efficient_attention",
                                                                  "_scaled_dot_product_efficient_attention_backward")),
    ("cuda", SDPBackend.CUDNN_ATTENTION): (_CudaCudnn(), ("_scaled_dot_product_cudnn_attention",
                                                          "_scaled_dot_product_cudnn_attention_backward")),
}


@_trace.constant_result
def enabled_backends() -> str:
    """Which SDPA backends are enabled now (``torch.nn.attention.sdpa_kernel`` sets them), as a string of
    the names (a constant under ``torch.compile``)."""
    b = torch.backends.cuda
    flags = {"flash": b.flash_sdp_enabled(), "efficient": b.mem_efficient_sdp_enabled(),
             "math": b.math_sdp_enabled(), "cudnn": b.cudnn_sdp_enabled()}
    return " ".join(name for name, on in flags.items() if on)


def kernel(device: str, dtype: torch.dtype, d: int, e: int, enabled: str = "", groups: int = 1):
    """The kernel for blocks of ``dtype`` on ``device`` with key width ``d`` and value width ``e``.

    The backend ``F.scaled_dot_product_attention`` chooses for such tensors
    (``aten._fused_sdp_choice`` on a probe of that device, dtype and head
    sizes, under the backends enabled now: on CUDA cuDNN, flash or the
    memory-efficient kernel; blocks are contiguous ``(..., n, d)``, the
    layout cuDNN's backward expects of its forward's output). Grouped heads
    choosing cuDNN take flash or the memory-efficient kernel, whose grouped
    heads need no repeated keys. :data:`EXACT` for float64,
    for the math backend, for CUDA head sizes that are not a multiple of 8
    (``F.scaled_dot_product_attention`` pads those itself), and where this
    torch lacks the op or its arguments differ (:data:`FUSED_OPS`).

    ``groups``: query heads per key/value head (grouped-query attention,
    ``enable_gqa=True``; head ``i`` of ``q`` attends with key/value head
    ``i // groups``): a kernel without it gets keys and values repeated per
    block pair.

    ``enabled``: :func:`enabled_backends` when the choice is made, for a
    caller that keeps choices (the choice depends on them; not read here).
    """
    found = _fused(torch.device(device), dtype, d, e, groups)
    return found if groups == 1 or found.native_gqa else _Grouped(found, groups)


def _fused(dev: torch.device, dtype: torch.dtype, d: int, e: int, groups: int):
    if dtype == torch.float64 or dev.type not in ("cpu", "cuda") or (dev.type == "cuda" and (d % 8 or e % 8)):
        return EXACT
    q, k, v = (torch.zeros(1, h, 16, w, dtype=dtype, device=dev) for h, w in ((groups, d), (1, d), (1, e)))
    gqa = groups > 1
    choice = SDPBackend(_aten._fused_sdp_choice(q, k, v, enable_gqa=gqa))
    if dev.type == "cuda" and choice == SDPBackend.CUDNN_ATTENTION and gqa:  # its GQA repeats keys and values
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, gqa)
        choice = (SDPBackend.FLASH_ATTENTION if torch.backends.cuda.can_use_flash_attention(params) else
                  SDPBackend.EFFICIENT_ATTENTION if torch.backends.cuda.can_use_efficient_attention(params) else
                  SDPBackend.MATH)
    found, ops = _FUSED.get((dev.type, choice), (EXACT, ()))
    return found if all(op in _USABLE for op in ops) else EXACT
