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


def torchrun(script, nproc: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc script args...`` (the ``torch.distributed.run`` module of this Python)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), str(script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=timeout)
