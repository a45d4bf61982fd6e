"""Steady-state overhead of local ``es.einshard`` over the equivalent torch calls.

Each case runs ``es.einshard`` and the hand-written torch equivalent
(``torch.einsum`` / ``reshape`` / ``permute``) in the same process on the same
tensors, after a warm-up, interleaving the two; each repeat times ``--number``
calls, and the reported time is the median over ``--repeats`` repeats. One
JSON line per case goes to stdout::

    python benchmarks/bench_local.py            # all cases
    python benchmarks/bench_local.py --check    # exit 1 when a target is missed
    python benchmarks/bench_local.py --device cuda   # the tensors on the GPU (auto: a GPU where there is one)

Fields: ``case``, ``formula``, ``torch`` (the baseline call), ``shapes``,
``torch_us`` and ``einshard_us`` (median µs per call), ``overhead_us``
(their difference), ``ratio`` (einshard / torch), the same from the fastest
repeat (``torch_min_us``, ``einshard_min_us``, ``overhead_min_us``: less
sensitive to a busy machine), ``target_overhead_us``, ``ok`` (the median
overhead meets the target), ``number``, ``repeats``, ``threads``,
``torch_version``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch

import einshard as es
from einshard.testing import add_device_argument, local_device


def _cases(device):
    a, b = torch.randn(64, 64, device=device), torch.randn(64, 64, device=device)
    x4 = torch.randn(8, 16, 4, 32, device=device)
    xs = torch.randn(8, 64, 32, device=device)  # b (h p) c
    xm = torch.randn(8, 16, 4, 32, device=device)  # b h p c
    xw = torch.randn(2, 32, 32, 16, device=device)  # b (h kh) (w kw) c
    families = {"s": ("h", "w"), "w": ("kh", "kw")}
    window_sizes = {"w": (4, 4)}
    return [
        dict(
            case="matmul_64x64",
            formula="i j, j k -> i k",
            torch="torch.einsum('ij,jk->ik', a, b)",
            tensors=(a, b),
            einshard=lambda: es.einshard("i j, j k -> i k", a, b),
            baseline=lambda: torch.einsum("ij,jk->ik", a, b),
            target=3.0,
        ),
        dict(
            case="permute_4d",
            formula="a b c d -> d b a c",
            torch="x.permute(3, 1, 0, 2)",
            tensors=(x4,),
            einshard=lambda: es.einshard("a b c d -> d b a c", x4),
            baseline=lambda: x4.permute(3, 1, 0, 2),
            target=3.0,
        ),
        dict(
            case="factored_split",
            formula="b (h p) c -> b h p c  sizes={'p': 4}",
            torch="x.reshape(8, 16, 4, 32)",
            tensors=(xs,),
            einshard=lambda: es.einshard("b (h p) c -> b h p c", xs, sizes={"p": 4}),
            baseline=lambda: xs.reshape(8, 16, 4, 32),
            target=5.0,
        ),
        dict(
            case="factored_merge",
            formula="b h p c -> b (p h) c",
            torch="x.permute(0, 2, 1, 3).reshape(8, 64, 32)",
            tensors=(xm,),
            einshard=lambda: es.einshard("b h p c -> b (p h) c", xm),
            baseline=lambda: xm.permute(0, 2, 1, 3).reshape(8, 64, 32),
            target=5.0,
        ),
        dict(
            case="family_window_partition",
            formula="b [*s *w] c -> b *s *w c  families={'s': ('h', 'w'), 'w': ('kh', 'kw')}, sizes={'w': (4, 4)}",
            torch="x.reshape(2, 8, 4, 8, 4, 16).permute(0, 1, 3, 2, 4, 5)",
            tensors=(xw,),
            einshard=lambda: es.einshard("b [*s *w] c -> b *s *w c", xw, families=families, sizes=window_sizes),
            baseline=lambda: xw.reshape(2, 8, 4, 8, 4, 16).permute(0, 1, 3, 2, 4, 5),
            target=5.0,
        ),
    ]


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _time_us(fn, number: int) -> float:
    _sync()
    start = time.perf_counter_ns()
    for _ in range(number):
        fn()
    _sync()
    return (time.perf_counter_ns() - start) / number / 1000.0


def run_case(case: dict, number: int, repeats: int, warmup: int) -> dict:
    got, want = case["einshard"](), case["baseline"]()
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
        raise AssertionError(f"{case['case']}: einshard and torch disagree")
    for _ in range(warmup):
        case["einshard"]()
        case["baseline"]()
    ours, theirs = [], []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):  # interleaved, so drift affects both alike
            theirs.append(_time_us(case["baseline"], number))
            ours.append(_time_us(case["einshard"], number))
    finally:
        if gc_was_enabled:
            gc.enable()
    t, e = statistics.median(theirs), statistics.median(ours)
    best_t, best_e = min(theirs), min(ours)
    return {
        "case": case["case"],
        "formula": case["formula"],
        "torch": case["torch"],
        "shapes": [list(x.shape) for x in case["tensors"]],
        "torch_us": round(t, 3),
        "einshard_us": round(e, 3),
        "overhead_us": round(e - t, 3),
        "ratio": round(e / t, 3),
        "torch_min_us": round(best_t, 3),
        "einshard_min_us": round(best_e, 3),
        "overhead_min_us": round(best_e - best_t, 3),
        "target_overhead_us": case["target"],
        "ok": e - t <= case["target"],
        "number": number,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=2000, help="calls per repeat (default 2000)")
    parser.add_argument("--repeats", type=int, default=9, help="repeats; the median is reported (default 9)")
    parser.add_argument("--warmup", type=int, default=500, help="warm-up calls of each (default 500)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--case", action="append", help="run only this case (may be repeated)")
    parser.add_argument("--check", action="store_true", help="exit 1 when an overhead target is missed")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    failed = False
    for case in _cases(local_device(args.device)):
        if args.case and case["case"] not in args.case:
            continue
        result = run_case(case, args.number, args.repeats, args.warmup)
        failed |= not result["ok"]
        print(json.dumps(result, ensure_ascii=False), flush=True)
    return 1 if (args.check and failed) else 0


if __name__ == "__main__":
    sys.exit(main())
