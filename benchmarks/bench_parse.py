"""Parsing time of long formulas: linear in their length.

Each case parses (or rejects) a formula of ``--length`` characters and, as the
baseline measured interleaved in the same run, one of a tenth of that length
built the same way; linear parsing makes their ratio about 10. The parse
caches are cleared before every call, so each call parses the text afresh.
One JSON line per case goes to stdout::

    python benchmarks/bench_parse.py                 # 10,000-character formulas
    python benchmarks/bench_parse.py --check         # exit 1 when a case misses 50 ms

Fields: ``case``, ``chars`` and ``baseline_chars`` (the two lengths),
``ms`` and ``baseline_ms`` (median milliseconds per parse), ``ratio``
(``ms / baseline_ms``; about ``chars / baseline_chars`` when linear),
``target_ms``, ``ok``, ``outcome`` (``parsed`` or ``rejected``), ``repeats``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import einshard as es
from einshard import notation
from einshard.testing import add_device_argument, local_device


def _names(length: int) -> str:
    """Space-separated axis names (from a 52-name alphabet) filling ``length`` characters."""
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    words, total, i = [], 0, 0
    while total < length:
        word = letters[i % 52] + "/sp" * (i % 7 == 0)
        words.append(word)
        total += len(word) + 1
        i += 1
    return " ".join(words)


def _cases(length: int) -> dict:
    """Formula builders: ``name -> (length -> text)``."""
    return {
        # a repeated axis in the input is a local diagonal; sharded ones are rejected late
        "long_operand_rejected": lambda n: _names(n - 10) + " -> a/sp",
        "many_operands_parsed": lambda n: ", ".join(["a/sp (b c) ... d // tp"] * max(1, n // 24)) + " -> a/sp",
        "unclosed_group_rejected": lambda n: "(" + _names(n - 1),
        "trailing_error_rejected": lambda n: "a b " * (n // 4 - 1) + "a $",
    }


def _parse_ms(text: str) -> tuple[float, str]:
    es.parse_sharding.cache_clear()
    notation._parse.cache_clear()
    start = time.perf_counter()
    try:
        es.parse_sharding(text)
        outcome = "parsed"
    except ValueError:
        outcome = "rejected"
    return (time.perf_counter() - start) * 1e3, outcome


def run_case(name: str, build, length: int, repeats: int, target_ms: float) -> dict:
    text, base = build(length), build(length // 10)
    times, base_times = [], []
    outcome = None
    for _ in range(repeats):  # interleaved: baseline, then the long formula
        base_times.append(_parse_ms(base)[0])
        ms, outcome = _parse_ms(text)
        times.append(ms)
    ms, base_ms = statistics.median(times), statistics.median(base_times)
    return dict(
        case=name,
        chars=len(text),
        baseline_chars=len(base),
        ms=round(ms, 3),
        baseline_ms=round(base_ms, 3),
        ratio=round(ms / base_ms, 2) if base_ms else None,
        target_ms=target_ms,
        ok=ms <= target_ms,
        outcome=outcome,
        repeats=repeats,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=10_000, help="formula length in characters (default 10000)")
    parser.add_argument("--repeats", type=int, default=9, help="repeats; the median is reported (default 9)")
    parser.add_argument("--target-ms", type=float, default=50.0, help="goal per parse (default 50 ms)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a case misses the goal")
    # taken like every benchmark's, and checked; parsing makes no tensors, so where they would go changes nothing
    add_device_argument(parser)
    args = parser.parse_args(argv)
    local_device(args.device)
    missed = 0
    for name, build in _cases(args.length).items():
        row = run_case(name, build, args.length, args.repeats, args.target_ms)
        missed += not row["ok"]
        print(json.dumps(row), flush=True)
        print(f"{name:28s} {row['chars']:>7d} chars {row['ms']:9.3f} ms  ratio {row['ratio']}", file=sys.stderr)
    return 1 if (args.check and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
