"""No host work in a steady-state call: every public op, forward and backward, checks off (tests/integration/host_work.py).

On CPU ranks the detector finds host reads of values (a device-to-host wait on CUDA) and tensor factories
without ``device=``; ``tests/integration/test_cuda.py`` runs the same cases on a GPU under
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import pytest
import torch

import einshard as es
from einshard.testing import MeshSpec
from host_work import HostWork, check_cases, steady_host_work


def test_the_detector_sees_host_work():
    x = torch.ones(3)

    def reads():
        return x.sum().item(), bool(x[0]), x.tolist()

    def factory():
        return x + torch.zeros(3)

    found = steady_host_work(reads, "cpu")
    assert any("local_scalar_dense" in f for f in found) and "Tensor.tolist" in found, found
    assert steady_host_work(factory, "cpu") == ["torch.zeros(...) without device="]
    with HostWork("cuda", syncs=False) as elsewhere:  # a CPU tensor where the operands are CUDA ones
        x + 1
    assert elsewhere and all("made a tensor on cpu" in f for f in elsewhere), elsewhere
    assert not steady_host_work(lambda: x + torch.zeros(3, device=x.device), "cpu")


@pytest.mark.ranks(2, checks=False)
def test_no_host_work_in_steady_state_calls():
    assert not check_cases(es.wrap_mesh(MeshSpec((2,), ("tp",)).build()), "cpu")


@pytest.mark.ranks(4, checks=False)
def test_no_host_work_in_steady_state_calls_on_4_ranks():
    assert not check_cases(es.wrap_mesh(MeshSpec((4,), ("tp",)).build()), "cpu")
