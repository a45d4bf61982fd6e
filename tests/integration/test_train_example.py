"""The main example, ``examples/train.py``, runs as a user would run it and matches one-process training."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_train_example_matches_single_process():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID",
                                                             "SLURM_NTASKS", "SLURM_LOCALID")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-4000:]
    steps = re.findall(r"^step (\d+): loss ([0-9.]+)\s+single process ([0-9.]+)$", out, re.M)
    assert len(steps) >= 5, out
    losses = [float(a) for _, a, _ in steps]
    assert losses[-1] < losses[0], out  # it trains
    found = re.search(r"max difference from single-process training: ([0-9.eE+-]+)", out)
    assert found is not None, out
    assert float(found.group(1)) < 1e-5, out
