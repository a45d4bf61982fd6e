"""Initial synchronisation: ``init_param_``/``init_params_``/``sync_param_``/``sync_module_params_``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import einshard as es
from einshard.params import ParameterInitSync
from einshard.params import get_parameter_state as state_of

VMESH = es.Mesh.virtual((2, 4), ("dp", "tp"))
ONE = es.Mesh.virtual((1, 1), ("dp", "tp"))  # groups of size 1: the broadcasts are skipped


def _p(*shape):
    return torch.nn.Parameter(torch.zeros(shape))


# -- single process: building, validating, merging (no communication) -----------------------
def test_init_param_states():
    p = es.params.init_param_(_p(2), ONE, sharded="tp")
    s = state_of(p)
    assert s.spec is None and s.layout_shard_dims == ("tp",) and s.source == "init"
    assert s.init_sync == ParameterInitSync("inferred", ("dp",))
    q = es.params.init_param_(_p(2), None, sync="none", mesh_dim_names=("dp", "tp"))  # nothing shared: no mesh needed
    assert state_of(q).explicit_init_sync_none
    assert state_of(es.params.init_param_(_p(2), None, sync="external")).init_sync.mode == "external"
    r = es.params.init_param_(_p(2), ONE, sync=("dp",), sharded=None, source="mine")
    with pytest.raises(ValueError, match="virtual mesh"):
        es.params.init_param_(_p(2), VMESH, sync="dp")
    assert state_of(r).init_sync == ParameterInitSync("explicit", ("dp",)) and state_of(r).source == "mine"


def test_init_after_layout_keeps_the_layout():
    p = es.params.register_parameter_layout(_p(4, 2), "out/tp in", mesh=VMESH, grad="dp")
    es.params.init_param_(p, ONE, sharded="tp")
    s = state_of(p)
    assert s.layout == "out/tp in" and s.reduce == ("dp",) and s.shared == ("dp",)
    with pytest.raises(ValueError, match="footprint"):
        es.params.init_param_(p, VMESH, sharded="dp")


@pytest.mark.parametrize(
    "kw, exc, words",
    [
        ({"sync": ()}, ValueError, "explicit mode requires mesh_dims"),
        ({"sync": "dp:async"}, ValueError, "suffix"),
        ({"sync": "tp", "sharded": "tp"}, ValueError, "init_sync .* overlaps"),
        ({"sync": ["dp", "dp-tp"]}, ValueError, "init_sync groups overlap"),
        ({"sharded": 3}, TypeError, "iterable"),
        ({"sharded": ["tp", 1]}, TypeError, "str"),
        ({"sync": [1]}, TypeError, "str"),
        ({"sync": "xx"}, ValueError, "unknown mesh dimensions"),
    ],
)
def test_init_param_errors_attach_nothing(kw, exc, words):
    p = _p(2)
    with pytest.raises(exc, match=words):
        es.params.init_param_(p, VMESH, **kw)
    assert state_of(p) is None


def test_init_param_needs_a_mesh_and_resolvable_groups():
    p = _p(2)
    with pytest.raises(ValueError, match="requires mesh"):
        es.params.init_param_(p, None, mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match="'sp'"):
        es.params.init_param_(p, VMESH, sync="sp")
    assert state_of(p) is None
    with pytest.raises(TypeError):
        es.params.init_param_(torch.zeros(2), VMESH)


def test_init_params_validates_all_before_attaching():
    lin = torch.nn.Linear(3, 4)
    with pytest.raises(ValueError, match="'bias'"):
        es.params.init_params_(lin, None, sync={"bias": "tp"}, sharded={"bias": "tp"}, mesh_dim_names=("dp", "tp"))
    assert state_of(lin.weight) is None and state_of(lin.bias) is None
    with pytest.raises(ValueError, match="unknown parameter names"):
        es.params.init_params_(lin, VMESH, sync={"nope": "dp"})
    with pytest.raises(TypeError):
        es.params.init_params_([lin.weight], VMESH)
    p = es.params.init_params_(_p(2), None, sync="none")  # a Parameter delegates
    assert state_of(p).explicit_init_sync_none


def test_sync_param_type_errors():
    with pytest.raises(TypeError):
        es.params.sync_param_(_p(2), "c", VMESH)
    m = torch.nn.Module()
    m.p = _p(2)
    es.params.set_parameter_state(m.p, "c")
    with pytest.raises(TypeError):
        es.params.sync_module_params_(m, VMESH)


# -- multi-rank ----------------------------------------------------------------------------------
class Model(torch.nn.Module):
    """Column- and row-parallel linears (uneven over tp), a norm, and a free parameter."""

    def __init__(self, mesh):
        super().__init__()
        rank = dist.get_rank()
        torch.manual_seed(100 + rank)  # different values on every rank
        tp = mesh.size("tp")
        tp_index = mesh.index("tp")
        from einshard.core._split import compute_split_shapes

        f = compute_split_shapes(7, tp)[tp_index]
        self.up = torch.nn.Linear(3, f)
        self.down = torch.nn.Linear(f, 3)
        self.norm = torch.nn.LayerNorm(3)
        self.scale = torch.nn.Parameter(torch.randn(2))


def _origin_value(mesh, tensor, dims):
    """The value the rank at coordinate 0 along ``dims`` (same elsewhere) held: gathered from the world."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, tensor.detach().clone())
    coord = list(mesh.coordinate)
    for d in dims:
        coord[mesh.names.index(d)] = 0
    return values[mesh.rank_of(coord)]


@pytest.mark.ranks(8)
def test_init_params_broadcast_replicated_groups(mesh):
    with torch.random.fork_rng():  # rank-dependent seeds: the pool's later tests keep equal RNG states
        _check_init_params(mesh)
    dist.barrier()


def _check_init_params(mesh):
    m = es.wrap_mesh(mesh)
    names = m.names
    model = Model(m)
    es.params.register_linear_parameters_(model.up, weight_layout="f/tp c", mesh=m)
    es.params.register_linear_parameters_(model.down, weight_layout="c f/tp", bias_layout="c", mesh=m)
    es.params.register_norm_parameters_(model.norm, mesh=m)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    es.params.init_params_(model, m, sync={"scale": "external"})
    for name, p in model.named_parameters():
        shared = state_of(p).shared
        if name == "scale":
            assert shared == () and torch.equal(p, before[name])  # external: left alone
            continue
        rest = tuple(n for n in names if not (name.startswith("up") or name == "down.weight") or n != "tp")
        assert shared == rest, (name, shared)
        want = _origin_value(m, before[name], [d for g in shared for d in m.dims(g)])
        assert torch.equal(p.detach(), want), name
    # sync_module_params_ with explicit compound groups on the module's states gives the same
    q = _p(4)
    with torch.no_grad():
        q.copy_(torch.randn(4))
    start = q.detach().clone()
    group = "-".join(reversed(names))  # every mesh dimension, in reverse order: one compound group
    es.params.init_param_(q, m, sync=group)
    assert torch.equal(q.detach(), _origin_value(m, start, list(names)))


@pytest.mark.ranks(8)
def test_sync_module_params_and_raw_device_mesh(mesh_2x2x2):
    m = es.wrap_mesh(mesh_2x2x2)
    with torch.random.fork_rng():
        torch.manual_seed(dist.get_rank())
        lin = torch.nn.Linear(2, 3)
    es.params.register_linear_parameters_(lin, weight_layout="o/tp i", mesh=m, init_sync="dp-sp")
    before = {n: p.detach().clone() for n, p in lin.named_parameters()}
    es.params.sync_module_params_(lin, m)
    for n, p in lin.named_parameters():
        assert torch.equal(p.detach(), _origin_value(m, before[n], ["dp", "sp"]))
    # a compound group on a raw DeviceMesh: ValueError naming wrap_mesh, before any broadcast
    r = _p(2)
    with pytest.raises(ValueError, match="wrap_mesh"):
        es.params.init_param_(r, mesh_2x2x2, sync="dp-sp")
    assert state_of(r) is None
    es.params.init_param_(r, mesh_2x2x2, sync=("dp", "sp"))  # atomic groups one after the other work
    assert state_of(r).init_sync.mesh_dims == ("dp", "sp")
    dist.barrier()
