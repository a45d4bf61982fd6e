"""``examples/gpt.py`` trains a dp x sp x tp language model exactly like one process does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def run_example(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "gpt.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.parametrize("style", ["shard_map", pytest.param("einshard", marks=pytest.mark.matrix)])
def test_gpt_example_matches_single_process_and_resumes_on_another_mesh(style, tmp_path):
    out = run_example("--style", style, "--checkpoint-dir", str(tmp_path))
    steps = re.findall(r"^step (\d+): loss ([0-9.]+)\s+single process ([0-9.]+)(\s+\(resumed\))?$", out, re.M)
    assert len(steps) >= 8, out
    losses = [float(a) for _, a, _, _ in steps]
    assert losses[-1] < losses[0] - 0.5, out  # it learns the corpus
    assert sum(bool(resumed) for *_, resumed in steps) >= 4, out  # the second half ran on the other mesh
    overall, after = out.strip().splitlines()[-2:]
    found = re.fullmatch(r"max loss difference from single-process training: ([0-9.eE+-]+)", overall)
    assert found is not None and float(found.group(1)) < 1e-9, out
    found = re.fullmatch(r"max loss difference after resuming on another mesh: ([0-9.eE+-]+)", after)
    assert found is not None and float(found.group(1)) < 1e-9, out


# the default run trains the example once (above); ring and Ulysses attention (tests/attention) and ZeRO storage
# (tests/params/test_zero.py) have their own default tests, so the example's variants run with -m matrix
@pytest.mark.parametrize("attention,style", [pytest.param("ring", "shard_map", marks=pytest.mark.matrix),
                                             pytest.param("ring", "einshard", marks=pytest.mark.matrix),
                                             pytest.param("ulysses", "shard_map", marks=pytest.mark.matrix)])
def test_gpt_example_with_ring_and_ulysses_attention_matches_single_process(attention, style, tmp_path):
    # 4 steps: 2 with sp=2 (ring: the sequence in zigzag order), 2 resumed with sp=1
    out = run_example("--attention", attention, "--style", style, "--steps", "4", "--checkpoint-dir", str(tmp_path))
    assert f"{attention} attention" in out, out
    steps = re.findall(r"^step (\d+): loss ([0-9.]+)\s+single process ([0-9.]+)", out, re.M)
    assert len(steps) == 4, out
    for line in out.strip().splitlines()[-2:]:
        found = re.fullmatch(r"max loss difference (?:from single-process training|after resuming on another mesh): "
                             r"([0-9.eE+-]+)", line)
        assert found is not None and float(found.group(1)) < 1e-9, out


def _differences(out):
    overall, after = out.strip().splitlines()[-2:]
    found = [re.fullmatch(r"max loss difference (?:from single-process training|after resuming on another mesh): "
                          r"([0-9.eE+-]+)", line) for line in (overall, after)]
    assert all(f is not None for f in found), out
    return [float(f.group(1)) for f in found]


@pytest.mark.parametrize("style", [pytest.param("einshard", marks=pytest.mark.matrix),
                                   pytest.param("shard_map", marks=pytest.mark.matrix)])
def test_gpt_example_with_states_stored_sharded_over_dp(style, tmp_path):
    """--zero: parameters, gradients and Adam states stored sharded over dp; the same losses as one
    process, also after resuming on dp 4 from the checkpoint."""
    out = run_example("--style", style, "--zero", "--checkpoint-dir", str(tmp_path))
    assert "stored sharded over dp" in out, out
    assert max(_differences(out)) < 1e-9, out


@pytest.mark.matrix
def test_gpt_example_zero_bf16_matches_the_same_recipe(tmp_path):
    """--zero --precision bf16: within 4 bf16 ulps (0.0625 at losses between 2 and 4) of one process
    running the same recipe (bf16 compute, float64 masters)."""
    out = run_example("--style", "einshard", "--zero", "--precision", "bf16", "--checkpoint-dir", str(tmp_path))
    assert max(_differences(out)) <= 0.0625, out
