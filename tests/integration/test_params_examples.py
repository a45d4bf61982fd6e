"""The parameter-metadata examples run as a user would run them; their last lines are the checks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def _run(script: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


def _last_number(out: str, text: str) -> float:
    last = out.strip().splitlines()[-1]
    found = re.fullmatch(re.escape(text) + r": ([0-9.eE+-]+)", last)
    assert found is not None, out
    return float(found.group(1))


def test_train_module_matches_single_process_training():
    out = _run("train_module.py")
    steps = re.findall(r"^step (\d+): loss ([0-9.]+)\s+single process ([0-9.]+)$", out, re.M)
    assert len(steps) >= 5, out
    assert float(steps[-1][1]) < float(steps[0][1]), out  # it trains
    assert _last_number(out, "max difference from single-process training") < 1e-10, out


def test_checkpoint_reloads_exactly_on_other_meshes():
    out = _run("checkpoint.py")
    assert "loaded on {'dp': 4, 'tp': 2}" in out and "unsharded" in out, out
    assert _last_number(out, "max difference after reloading on a different mesh") == 0.0, out
