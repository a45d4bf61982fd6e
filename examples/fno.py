"""Train a 2-D Fourier neural operator on a grid sharded over both dimensions of a 2x4 mesh.

The operator to learn is the solution operator of a screened Poisson problem on the
periodic unit square,

    (1 - ν Δ) u = a,

for random smooth sources ``a`` (a few low Fourier modes with random coefficients);
the script computes the targets ``u`` spectrally. The model is a small FNO:

1. **lifting**: every grid point's value is mapped to ``W`` channels;
2. **K Fourier layers**: ``h ← gelu(spectral(h) + pointwise(h))``, where ``spectral``
   transforms ``h`` with a real 2-D FFT (``es.einfft``), keeps the lowest
   ``M1 × M2`` modes (both signs along ``kx``), mixes their channels with complex
   weights (``es.einshard``), and transforms back; ``pointwise`` is a per-point
   channel mixing (the 1×1 convolution);
3. **projection**: ``W`` channels back to one value per point.

The grid ``x y`` (uneven over the mesh: 20 × 18 points on 2 × 4 ranks) lives as
``b x/px y/py w`` (pencils). For the spectral mixing the spectrum comes out of the
FFT as ``b/px kx ky w/py``: the batch and the channels take the shards, so every
rank holds *whole* frequency axes and truncates them locally. The mode mixing
``b/px kx ky i/py, kx ky i o -> b/px kx ky o/py`` contracts the sharded channel axis
(a reduce-scatter over ``py``), and the inverse FFT moves the shards back onto the
grid. No rank ever holds the whole grid.

The whole training step (forward, ``torch.autograd.grad``, SGD) is one
``es.shard_map`` body with ``check_vma=True``: the replicated parameters meet
per-rank data and receive gradients summed over every rank without a hand-written
all-reduce. The same model is trained in one process with ``torch.fft`` and
``torch.einsum`` on whole tensors (float64), and the script prints both loss curves
and the largest difference.

Run it from the repository root::

    python examples/fno.py                                # starts 8 gloo ranks itself
    torchrun --nproc-per-node 8 examples/fno.py           # or under torchrun (GPUs if it has 8, else CPUs)
    torchrun --nproc-per-node 8 examples/fno.py --device cuda   # one GPU per rank over NCCL

The whole tensors (data, parameters, the one-process reference) are made on the CPU from seeded
generators and moved to the rank's device (``es.testing.rank_device()``).
"""

from __future__ import annotations

import math
import sys
import time

import torch
import torch.nn.functional as F

import einshard as es
from einshard.comm.helpers import compute_split_shapes as split
from einshard.testing import device_mesh, launch, parse_device, rank_device

NX, NY = 20, 18  # grid points: uneven over the 2 x 4 mesh along y
B, W = 4, 8  # batch (split over px for the spectral mixing), channels (split over py there)
M1, M2 = 4, 4  # kept modes: kx in [0, M1) and [NX - M1, NX), ky in [0, M2)
LAYERS = 2
NU = 0.01  # the operator: (1 - NU Δ) u = a on the periodic unit square
STEPS, LR = 12, 0.1
DTYPE = torch.float64

GRID = "b x/px y/py"  # where the data lives
SPECTRUM = "b/px kx ky w/py"  # where the spectrum lives: whole frequency axes on every rank
AXES = {"x": "kx", "y": "ky"}  # the last entry, y, is the half-spectrum axis

PARAM_SPECS = {  # every parameter is replicated
    "lift_w": "w",
    "lift_b": "w",
    **{f"{name}{k}": spec for k in range(LAYERS)
       for name, spec in (("spec_re", "kx ky i o"), ("spec_im", "kx ky i o"), ("point_w", "o i"), ("point_b", "o"))},
    "proj_w": "w",
    "proj_b": "",
}


def split_shapes(px: int = 2, py: int = 4) -> dict:
    """The blocks of every sharded axis on a ``px x py`` mesh (uneven ones must be known on every rank)."""
    return {"px": {"x": split(NX, px), "b": split(B, px)}, "py": {"y": split(NY, py), "w": split(W, py)}}


def init_params(seed: int = 0) -> dict[str, torch.Tensor]:
    """The whole parameters (the same on every rank: seeded)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale):
        return torch.randn(shape, generator=g, dtype=DTYPE) * scale

    params = {"lift_w": rand(W, scale=1.0), "lift_b": rand(W, scale=0.1)}
    for k in range(LAYERS):
        params[f"spec_re{k}"] = rand(2 * M1, M2, W, W, scale=1 / W)
        params[f"spec_im{k}"] = rand(2 * M1, M2, W, W, scale=1 / W)
        params[f"point_w{k}"] = rand(W, W, scale=W**-0.5)
        params[f"point_b{k}"] = rand(W, scale=0.1)
    params["proj_w"] = rand(W, scale=W**-0.5)
    params["proj_b"] = rand(scale=0.1)
    return {k: v.to(rank_device()) for k, v in params.items()}


# -- the data: random smooth sources and the solutions of the screened Poisson problem ----------


def sample(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole sources ``a`` and solutions ``u`` of one step (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    kx = torch.fft.fftfreq(NX, 1 / NX).to(DTYPE)[:, None]
    ky = torch.fft.rfftfreq(NY, 1 / NY).to(DTYPE)[None, :]
    low = (kx.abs() <= 3) & (ky <= 3)
    coeff = torch.complex(torch.randn(B, NX, NY // 2 + 1, generator=g, dtype=DTYPE),
                          torch.randn(B, NX, NY // 2 + 1, generator=g, dtype=DTYPE))
    a_hat = torch.where(low, coeff, 0) * NX * NY / 8
    a = torch.fft.irfft2(a_hat, s=(NX, NY))
    symbol = 1 + NU * (2 * math.pi) ** 2 * (kx**2 + ky**2)
    u = torch.fft.irfft2(torch.fft.rfft2(a) / symbol, s=(NX, NY))
    return a.to(rank_device()), u.to(rank_device())


# -- the model on this rank's blocks (inside shard_map: mesh and split shapes are ambient) -----


def truncate(h_hat):
    """Keep the lowest modes of a ``b kx ky w`` spectrum whose frequency axes are whole."""
    return torch.cat([h_hat[:, :M1, :M2], h_hat[:, NX - M1:, :M2]], dim=1)


def pad(modes):
    """The inverse of :func:`truncate`: zeros everywhere else (``ky`` is NY // 2 + 1 long)."""
    modes = F.pad(modes, (0, 0, 0, NY // 2 + 1 - M2))
    middle = modes.new_zeros(modes.shape[0], NX - 2 * M1, *modes.shape[2:])
    return torch.cat([modes[:, :M1], middle, modes[:, M1:]], dim=1)


def fourier_layer(p, k, h, last):
    h_hat = es.einfft(f"{GRID} w -> {SPECTRUM}", h, AXES, real=True)  # moves the shards onto b and w
    weights = torch.complex(p[f"spec_re{k}"], p[f"spec_im{k}"])
    mixed = es.einshard("b/px kx ky i/py, kx ky i o -> b/px kx ky o/py", truncate(h_hat), weights)
    s = es.einfft(f"{SPECTRUM} -> {GRID} w", pad(mixed), {"kx": "x", "ky": "y"}, real=True, inverse=True,
                  signal_sizes={"y": NY})
    out = s + es.einshard(f"{GRID} i, o i -> {GRID} o", h, p[f"point_w{k}"]) + p[f"point_b{k}"]
    return out if last else F.gelu(out)


def fno(p, a):
    h = es.einshard(f"{GRID}, w -> {GRID} w", a, p["lift_w"]) + p["lift_b"]
    for k in range(LAYERS):
        h = fourier_layer(p, k, h, last=k == LAYERS - 1)
    return es.einshard(f"{GRID} w, w -> {GRID}", h, p["proj_w"]) + p["proj_b"]


def train_step(params, a, u):
    err = ((fno(params, a) - u) ** 2).sum()  # this rank's share of the squared error
    loss = es.spmd.psum(err, ("px", "py")) / (B * NX * NY)  # the mean over the whole grid and batch
    names = list(params)
    grads = torch.autograd.grad(loss, [params[k] for k in names])
    with torch.no_grad():
        new = {k: (params[k] - LR * g).requires_grad_() for k, g in zip(names, grads)}
    return new, loss.detach()


def sharded_train_step(mesh):
    """:func:`train_step` as one ``shard_map`` body on ``mesh`` (any ``px x py``; the 2 x 4 one by default)."""
    return es.shard_map(
        train_step,
        in_specs=(PARAM_SPECS, f"b x y -> {GRID}", f"b x y -> {GRID}"),  # the data arrives whole: split it
        out_specs=(PARAM_SPECS, ""),
        shapes=split_shapes(mesh.size("px"), mesh.size("py")),
        check_vma=True,
        mesh=mesh,
    )


# -- the same model and training in one process ---------------------------------------------------


def reference_fno(p, a):
    h = torch.einsum("bxy,w->bxyw", a, p["lift_w"]) + p["lift_b"]
    for k in range(LAYERS):
        h_hat = torch.fft.rfft2(h, dim=(1, 2))
        weights = torch.complex(p[f"spec_re{k}"], p[f"spec_im{k}"])
        mixed = torch.einsum("bxyi,xyio->bxyo", truncate(h_hat), weights)
        s = torch.fft.irfft2(pad(mixed), s=(NX, NY), dim=(1, 2))
        out = s + torch.einsum("bxyi,oi->bxyo", h, p[f"point_w{k}"]) + p[f"point_b{k}"]
        h = out if k == LAYERS - 1 else F.gelu(out)
    return torch.einsum("bxyw,w->bxy", h, p["proj_w"]) + p["proj_b"]


def reference_training():
    params = {k: v.clone().requires_grad_() for k, v in init_params().items()}
    losses = []
    for step in range(STEPS):
        a, u = sample(step)
        loss = ((reference_fno(params, a) - u) ** 2).mean()
        grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            params = {k: (p - LR * g).requires_grad_() for (k, p), g in zip(params.items(), grads)}
        losses.append(loss.item())
    return {k: v.detach() for k, v in params.items()}, losses


# -- driver ----------------------------------------------------------------------------------------


def run(device_mesh) -> list[str]:
    """Train on every rank; returns the report lines (the same on every rank)."""
    torch.set_num_threads(1)
    mesh = es.wrap_mesh(device_mesh)
    params = {k: v.requires_grad_() for k, v in init_params().items()}  # replicated: the same everywhere
    step_fn = sharded_train_step(mesh)
    losses = []
    start = time.perf_counter()
    with es.use_mesh(mesh):
        for step in range(STEPS):
            a, u = sample(step)
            params, loss = step_fn(params, a, u)
            losses.append(loss.item())
    elapsed = time.perf_counter() - start
    ref_params, ref_losses = reference_training()
    lines = [f"FNO on a {NX}x{NY} grid sharded '{GRID}' over mesh {dict(zip(mesh.names, mesh.shape))}, "
             f"{LAYERS} Fourier layers, {M1}x{M2} modes, {STEPS} SGD steps, float64"]
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        lines.append(f"step {step}: loss {a:.10f}   single process {b:.10f}")
    diff_params = max((params[k].detach() - ref_params[k]).abs().max().item() for k in ref_params)
    diff_losses = max(abs(a - b) for a, b in zip(losses, ref_losses))
    lines.append(f"sharded training took {elapsed:.2f} s")
    lines.append(f"max difference from single-process training: {max(diff_params, diff_losses):.3e}")
    return lines


def on_rank() -> list[str]:
    """What every rank runs: build the 2 x 4 mesh, train, compare."""
    return run(device_mesh((2, 4), ("px", "py")))


def main(argv=None) -> int:
    # under torchrun/srun this process is one rank (on a GPU with --device cuda); otherwise 8 gloo ranks start here
    results = launch(on_rank, 8, timeout=300, device=parse_device(argv, __doc__.splitlines()[0]))
    if results is not None:
        print("\n".join(results[0]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
