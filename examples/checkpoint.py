"""Save a sharded model with ``torch.distributed.checkpoint`` and load it on a different mesh.

The transformer block of ``train_module.py`` is trained for one step on a
2 x 4 (dp x tp) mesh and saved with DCP: ``es.params.to_dtensor(model)`` turns every
parameter into a ``DTensor`` whose placements come from its registered layout
(``h/tp d c`` is ``[Replicate(), Shard(0)]``), uneven blocks included. The
checkpoint is then loaded

- into the same model registered on a 4 x 2 mesh and on an 8 x 1 mesh: DCP
  reads, for every rank, exactly the part of each tensor its new block covers
  (the resharding is DCP's, not hand-written), and ``es.params.load_from_dtensor_``
  copies the blocks into the parameters;
- into an unsharded model (whole tensors, as a single-process user would).

Every parameter is compared with the trained one; the last line is the
largest difference, exactly 0.

Run it from the repository root::

    python examples/checkpoint.py                          # starts 8 gloo ranks itself
    torchrun --nproc-per-node 8 examples/checkpoint.py     # or under torchrun (GPUs if it has 8, else CPUs)
    torchrun --nproc-per-node 8 examples/checkpoint.py --device cuda   # one GPU per rank over NCCL
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import einshard as es
from einshard.comm.helpers import compute_split_shapes
from einshard.testing import device_mesh, launch, parse_device, rank_device

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_module import FF, H, LAYOUTS, LR, Block, batch  # noqa: E402

B, N, C = batch(0)[0].shape
PATH = os.path.join(tempfile.gettempdir(), "einshard_checkpoint_example")  # the same on every rank


def sharded_block(mesh) -> Block:
    """The block with this rank's blocks for ``mesh``, its layouts registered."""
    tp, i = mesh.size("tp"), mesh.index("tp")
    model = Block(compute_split_shapes(H, tp)[i], compute_split_shapes(FF, tp)[i]).to(rank_device())
    return es.params.register_module_parameter_layouts_(model, LAYOUTS, mesh=mesh, grad="dp:async")


def train_one_step(model, mesh) -> None:
    handle = es.params.register_native_grad_reduction_hooks_(model, mesh)
    with es.use_mesh(mesh):
        x, target = es.tree_shard(batch(0), "b/dp n c")
        (((model(x) - target) ** 2).sum() / (B * N * C)).backward()
    handle.remove()  # waits: gradients summed over dp
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad


def run() -> list[str]:
    torch.set_num_threads(1)
    torch.manual_seed(dist.get_rank())
    mesh = es.wrap_mesh(device_mesh((2, 4), ("dp", "tp")))
    model = es.params.init_params_(sharded_block(mesh), mesh)
    train_one_step(model, mesh)
    trained = es.tree_gather(model, mesh=mesh)  # whole tensors, to compare with
    dcp.save(es.params.to_dtensor(model, mesh=mesh), checkpoint_id=PATH)
    lines = [f"saved a model trained on {dict(zip(mesh.names, mesh.shape))} to {PATH}"]
    diff = 0.0
    for shape in ((4, 2), (8, 1)):
        other = es.wrap_mesh(device_mesh(shape, ("dp", "tp")))
        fresh = sharded_block(other)
        state = es.params.to_dtensor(fresh, mesh=other)  # where DCP writes: this rank's blocks on the new mesh
        dcp.load(state, checkpoint_id=PATH)
        es.params.load_from_dtensor_(fresh, state, mesh=other)
        loaded = es.tree_gather(fresh, mesh=other)
        d = max((loaded[k] - trained[k]).abs().max().item() for k in trained)
        lines.append(f"loaded on {dict(zip(other.names, other.shape))}: max difference {d:.3e}")
        diff = max(diff, d)
    whole = {k: torch.zeros_like(v) for k, v in Block().to(rank_device()).state_dict().items()}  # an unsharded model
    dcp.load(whole, checkpoint_id=PATH)
    d = max((whole[k] - trained[k]).abs().max().item() for k in trained)
    lines.append(f"loaded into an unsharded model: max difference {d:.3e}")
    diff = max(diff, d)
    lines.append(f"max difference after reloading on a different mesh: {diff:.3e}")
    return lines


def main(argv=None) -> int:
    # under torchrun/srun this process is one rank (on a GPU with --device cuda); otherwise 8 gloo ranks start here
    results = launch(run, 8, timeout=240, device=parse_device(argv, __doc__.splitlines()[0]))
    if results is not None:
        print("\n".join(results[0]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
