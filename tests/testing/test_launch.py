"""einshard.testing.launch: one script, started by itself or under torchrun."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch, torch.distributed as dist
    from einshard.comm.checks import checks_enabled
    from einshard.testing import launch, rank_device

    def on_rank(scale):
        assert checks_enabled(), "ranks run with checks on by default"
        t = torch.tensor([float(dist.get_rank())], device=rank_device())  # (a GPU under torchrun where there are 2)
        dist.all_reduce(t)
        return scale * t.item()

    if __name__ == "__main__":
        results = launch(on_rank, 2, args=(10,))
        # one write per line: under torchrun both ranks share the pipe, and their lines must not interleave
        if results is not None:
            sys.stdout.write(f"results {results}\\n")
        sys.stdout.write(f"checks after launch {checks_enabled()}\\n")  # restored: launch leaves no state behind
    """
)


def _clean_env():
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS")
    return {k: v for k, v in os.environ.items() if k not in drop}


def test_launch_starts_its_own_ranks(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=_clean_env(), timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines() == ["results [10.0, 10.0]", "checks after launch False"]


def test_launch_under_torchrun_prints_once(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    # --standalone: torchrun binds its rendezvous store to a port of the system's choosing and hands that one to the
    # ranks (a port found free beforehand and released can be taken by another process before torchrun binds it)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env(), timeout=180)
    assert out.returncode == 0, out.stderr
    assert [line for line in out.stdout.splitlines() if line.startswith("results")] == ["results [10.0, 10.0]"]
    assert [line for line in out.stdout.splitlines() if line.startswith("checks")] == ["checks after launch False"] * 2
