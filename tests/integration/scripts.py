"""Running the docs' whole scripts: inside a harness rank (its process group kept), or under torchrun as a
user would (a fresh process per rank, this checkout first on ``PYTHONPATH``)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


@contextlib.contextmanager
def kept_process_group():
    """While active, a script's own ``destroy_process_group()`` is a no-op (the harness's group stays up)."""
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *a, **k: None
    try:
        yield
    finally:
        dist.destroy_process_group = destroy


def script_env(**extra) -> dict:
    """This environment without launcher variables, with the checkout prepended to ``PYTHONPATH`` (never
    replacing it: an image may bring packages through it)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**env, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script, nproc: int, *args: str, timeout: float = 300, log_dir=None) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc script args...`` (the ``torch.distributed.run`` module of this Python).

    With ``log_dir``, torchrun also keeps every rank's stderr there (``--tee 2``; the captured
    stderr gets it too, each line prefixed with its rank): :func:`rank_stderr` reads it back.
    """
    logs = [] if log_dir is None else ["--log-dir", str(log_dir), "--tee", "2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), *logs, str(script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=timeout)


def rank_stderr(log_dir, tail: int = 2000) -> str:
    """The last ``tail`` characters of each rank's stderr in a :func:`torchrun` ``log_dir``, rank by rank (for a
    failure message: torchrun's own report of a failed rank says no more than its exit code)."""
    parts = []
    paths = Path(log_dir).glob("*/attempt_*/*/stderr.log")  # (one folder per local rank)
    for path in sorted(paths, key=lambda p: (str(p.parent.parent), int(p.parent.name))):
        text = path.read_text(errors="replace")
        parts.append(f"---- {path.parent.parent.name} rank {path.parent.name} stderr ({len(text)} chars, last {tail}):\n"
                     f"{text[-tail:]}")
    return "\n".join(parts) or f"(no rank logs under {log_dir})"
