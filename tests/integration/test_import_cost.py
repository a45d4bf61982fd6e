"""Importing einshard stays cheap: torch.compile's machinery (dynamo) is loaded only when used."""

from __future__ import annotations

import subprocess
import sys

import torch

from einshard.core import _trace


def test_import_einshard_does_not_load_dynamo():
    code = "import sys, einshard, torch_einshard; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_constant_result_sets_the_mark_torch_sets():
    def ours():
        return 1

    def theirs():
        return 1

    _trace._mark_constant(ours)  # what constant_result does to the planner it makes
    marked = torch.compiler.assume_constant_result(theirs)  # imports dynamo; fine in the test process
    assert marked is theirs
    added = set(vars(theirs))
    assert added == {"_dynamo_marked_constant"} and theirs._dynamo_marked_constant is True
    assert vars(ours) == vars(theirs)
    call = _trace.constant_result(ours)  # eagerly: ours itself runs
    assert call.__wrapped__ is ours and call() == 1
