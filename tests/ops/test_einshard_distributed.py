"""Distributed einshard: the documented examples, policies, explain, errors, caching, ambient mesh."""

import pytest
import torch
import torch.distributed as dist

import einshard as es
from dist_reference import check_formula, check_many, default_shapes
from einshard.notation import expand
from einshard.testing import MeshSpec, RankError, run_on_ranks

# Every documented distributed example (docs/distributed.md), with uneven sizes (10, 7, 9 over groups of 2 and 4).
DOC_EXAMPLES = [
    ("a/sp b/dp, b/dp c -> a/sp c", [(10, 6), (6, 7)]),
    ("b n c, h/tp c -> b n h/tp", [(3, 5, 6), (10, 6)]),
    ("b n c/tp, h c/tp -> b n h", [(3, 5, 10), (4, 10)]),
    ("b n c/tp, h c/tp -> b n h // tp", [(3, 5, 10), (4, 10)]),
    ("l f/tp, f/tp e -> l/tp e", [(10, 9), (9, 5)]),
    ("l/tp e, e f -> l f/tp", [(10, 5), (5, 9)]),
    ("l/sp e/dp, e/sp f/dp -> l/sp f/dp", [(10, 6), (6, 9)]),
    ("a k/dp m/sp, k/sp m/dp b -> a/sp b/dp", [(5, 6, 7), (6, 7, 9)]),
    ("b h q/tp d, b h k/tp d -> b h q/tp k", [(2, 3, 10, 4), (2, 3, 9, 4)]),
    ("... c, h/tp c -> ... h/tp", [(2, 3, 6), (10, 6)]),
    # layouts a hand-written case list would miss
    ("a/tp k, k/tp b -> a/dp b", [(10, 6), (6, 7)]),
    ("a k/dp m/tp, k/tp m/dp b -> a b", [(3, 6, 7), (6, 7, 5)]),
]

# Unary transitions of every kind, uneven.
TRANSITIONS = [
    ("a b -> a/tp b", [(10, 6)]),
    ("a/tp b -> a b", [(10, 6)]),
    ("a b // tp -> a b", [(10, 6)]),
    ("a b -> a b // tp", [(10, 6)]),
    ("a/tp b -> a b // tp", [(10, 6)]),
    ("a b // tp -> a/tp b", [(10, 6)]),
    ("a/tp b -> a b/tp", [(10, 7)]),
    ("a/tp b -> b a/tp", [(10, 7)]),
    ("a b/tp -> a", [(10, 7)]),
    ("a/dp b -> a/tp b", [(10, 7)]),
    ("a/dp b/tp -> a/tp b/dp", [(10, 7)]),
    ("a/dp-tp b -> a b/dp-tp", [(10, 9)]),
    ("a/tp-dp b -> a/dp b", [(10, 9)]),
    ("a b // (dp, tp) -> a/dp-tp b", [(10, 9)]),
    ("a b // dp-tp -> a b", [(10, 9)]),
    ("a b c -> c a/dp b/tp", [(5, 6, 7)]),
    ("(h/tp p) c -> h/tp p c", [(12, 3)]),
    ("h/tp p c -> (h/tp p) c", [(4, 3, 5)]),
    ("... a/tp -> ... a", [(2, 3, 10)]),
]


def _rename(formula, mapping):
    import re

    return re.sub(r"\b(dp|sp|tp)\b", lambda m: mapping.get(m.group(1), m.group(1)), formula)


def _cases(examples, names):
    """Each example on this mesh: mesh dimension names of the example mapped onto the mesh's."""
    out = []
    for formula, shapes in examples:
        used = [d for d in ("dp", "sp", "tp") if d in formula.replace("-", " ").replace("/", " ").split()
                or f"/{d}" in formula or f"{d}-" in formula or f"-{d}" in formula or f"// {d}" in formula
                or f"({d}" in formula or f", {d}" in formula]
        if len(used) > len(names):
            continue
        mapping = dict(zip(used, names[-len(used):] if used else ()))
        sizes = {"p": 3} if "(h" in formula else None
        out.append(dict(formula=_rename(formula, mapping), global_shapes=shapes, sizes=sizes))
    return out


def _mesh_of(spec):
    return MeshSpec(spec[0], spec[1])


MESHES = [((8,), ("tp",)), ((2, 4), ("dp", "tp")), ((4, 2), ("sp", "dp")), ((2, 2, 2), ("dp", "sp", "tp"))]


@pytest.mark.parametrize("mesh", MESHES, ids=["8", "2x4", "4x2", "2x2x2"])
def test_spec_examples_values_and_gradients(mesh):
    cases = _cases(DOC_EXAMPLES, mesh[1])
    assert cases
    run_on_ranks(8, check_many, _mesh_of(mesh), cases, timeout=240)


@pytest.mark.parametrize("mesh", MESHES, ids=["8", "2x4", "4x2", "2x2x2"])
def test_transitions_values_and_gradients(mesh):
    cases = _cases(TRANSITIONS, mesh[1])
    assert cases
    run_on_ranks(8, check_many, _mesh_of(mesh), cases, timeout=240)


def _three_operands(mesh):
    cases = [
        dict(formula="a b/tp, b c, c d -> a d", global_shapes=[(5, 8), (8, 6), (6, 7)]),
        dict(formula="a b, b/tp c/dp, c d -> a/dp d", global_shapes=[(5, 8), (8, 6), (6, 7)]),
        dict(formula="i j, j k/tp, k l -> i l // tp", global_shapes=[(5, 8), (8, 6), (6, 7)]),
        dict(formula="x/dp h, h o/tp, o -> x/dp", global_shapes=[(6, 5), (5, 9), (9,)]),
    ]
    return check_many(mesh, cases)


@pytest.mark.ranks(8)
def test_three_operand_contractions(mesh_2x4):
    _three_operands(mesh_2x4)


# -- policies and explain (planning only: virtual meshes, no ranks) --------------------------


def test_memory_and_communication_policies_choose_different_plans():
    mesh = es.Mesh.virtual((2, 4), ("dp", "tp"))
    args = ("a b, b c -> a c/tp", (8, 64), (64, 16))
    comm = es.explain(*args, mesh=mesh, optimize="communication")
    memory = es.explain(*args, mesh=mesh, optimize="memory")
    assert comm.alternatives[0][0] != memory.alternatives[0][0]
    # communication moves fewer bytes, memory keeps the smaller peak
    assert comm.forward_bytes + comm.backward_bytes < memory.forward_bytes + memory.backward_bytes
    assert memory.alternatives[0][1]["peak_bytes"] < comm.alternatives[0][1]["peak_bytes"]


def test_policy_precedence():
    mesh = es.Mesh.virtual((2, 4), ("dp", "tp"))
    args = ("a b, b c -> a c/tp", (8, 64), (64, 16))
    memory = es.explain(*args, mesh=mesh, optimize="memory").alternatives[0][0]
    comm = es.explain(*args, mesh=mesh, optimize="communication").alternatives[0][0]
    with es.optimize("memory"):
        assert es.explain(*args, mesh=mesh).alternatives[0][0] == memory
        assert es.explain(*args, mesh=mesh, optimize="communication").alternatives[0][0] == comm
        policy = es.PlanPolicy.from_mode("communication")
        assert es.explain(*args, mesh=mesh, policy=policy).alternatives[0][0] == comm
    es.set_default_policy("memory")
    try:
        assert es.explain(*args, mesh=mesh).policy.name == "memory"
        with es.optimize("communication"):
            assert es.explain(*args, mesh=mesh).policy.name == "communication"
    finally:
        es.set_default_policy(None)
    assert es.explain(*args, mesh=mesh).policy.name == "training"
    with pytest.raises(ValueError, match="either optimize or policy"):
        es.explain(*args, mesh=mesh, optimize="memory", policy=es.PlanPolicy.from_mode("memory"))
    with pytest.raises(ValueError, match="unknown optimize mode"):
        es.PlanPolicy.from_mode("fastest")


def test_inference_ignores_backward_costs():
    mesh = es.Mesh.virtual((8,), ("tp",))
    # column-parallel: forward needs nothing, backward an all-reduce of grad x
    plan = es.explain("b c, h/tp c -> b h/tp", (64, 64), (8, 64), mesh=mesh, optimize="inference")
    assert plan.forward_bytes == 0


def test_explain_table_lists_steps_bytes_and_alternatives():
    mesh = es.Mesh.virtual((8,), ("tp",))
    plan = es.explain("b c/tp, h c/tp -> b h", (16, 8), (32, 8), mesh=mesh)
    text = str(plan)
    assert "all-reduce" in text and "tp" in text and "alternatives" in text
    (row,) = [r for r in plan.rows if r.phase == "forward"]
    assert row.mesh_dims == "tp"
    assert row.bytes_per_rank == pytest.approx(2 * 7 / 8 * 16 * 32 * 4)
    assert plan.backward_bytes == 0
    local = es.explain("b c, h c -> b h", (2, 3), (4, 3))
    assert local.local and "no communication" in str(local)


def test_explain_three_operand_schedule_is_pairwise_or_direct():
    mesh = es.Mesh.virtual((2, 4), ("dp", "tp"))
    plan = es.explain("a b/tp, b c, c d -> a d", (16, 16), (64, 32), (32, 16), mesh=mesh)
    assert plan.alternatives and "fwd" in str(plan)


# -- errors ----------------------------------------------------------------------------


def test_no_mesh_raises_spec_message():
    with pytest.raises(ValueError, match=r"Distributed einshard operations require mesh=\.\.\."):
        es.einshard("a/tp b -> a b", torch.ones(2, 3))


def _errors(mesh):
    mesh = es.wrap_mesh(mesh)
    x = torch.ones(4, 3)
    found = {}
    for name, call in {
        "unknown dim": lambda: es.einshard("a/xx b -> a b", x, mesh=mesh),
        "list with two dims": lambda: es.einshard("a/dp b/tp -> a b", x, mesh=mesh, shapes=[2, 2]),
        "wrong list length": lambda: es.einshard("a/tp b -> a b", x, mesh=mesh, shapes=[4, 4]),
        "missing axis": lambda: es.einshard("a/tp b -> a b", x, mesh=mesh, shapes={"tp": {"b": [1, 1, 1, 0]}}),
        "operand count": lambda: es.einshard("a b, b c -> a c", x, mesh=mesh),
        "rank mismatch": lambda: es.einshard("a/tp b c -> a b c", x, mesh=mesh),
        "size mismatch": lambda: es.einshard("a/tp b, b c -> a c", x, torch.ones(5, 2), mesh=mesh),
        "plain mesh compound": lambda: es.einshard("a/dp-tp b -> a b", x, mesh=mesh.device_mesh),
    }.items():
        try:
            call()
            found[name] = None
        except ValueError as err:
            found[name] = str(err)
    return found


@pytest.mark.ranks(8)
def test_errors_are_raised_on_every_rank_before_communicating(mesh_2x4):
    found = _errors(mesh_2x4)
    assert "it has ['dp', 'tp']" in found["unknown dim"]
    assert "exactly one sharded mesh dimension" in found["list with two dims"]
    assert "has 4 ranks" in found["wrong list length"]
    assert "no entry for axis 'a'" in found["missing axis"]
    assert "2 operand(s) but 1 tensor(s)" in found["operand count"]
    assert "names 3 dimensions but the tensor has 2" in found["rank mismatch"]
    assert "'b'" in found["size mismatch"]
    assert "wrap_mesh" in found["plain mesh compound"]


def _local_mismatch(mesh, checks, catch=True):
    mesh = es.wrap_mesh(mesh)
    es.set_checks(checks)
    try:
        rows = 3 if dist.get_rank() != 5 else 2  # rank 5 disagrees with shapes
        x = torch.ones(rows, 2)
        try:
            es.einshard("a/tp b -> a b", x, mesh=mesh, shapes={"tp": [3, 3, 3, 3]})
        except ValueError as err:
            if not catch:
                raise
            return str(err)
        return None
    finally:
        es.set_checks(False)


@pytest.mark.ranks(8)
def test_rank_local_error_with_checks_is_raised_everywhere(mesh_2x4):
    message = _local_mismatch(mesh_2x4, True)
    assert message is not None and message.startswith("rank 5:"), message
    assert "operand 0 holds 2 elements of axis 'a'" in message


def _uneven_without_shapes(mesh):
    mesh = es.wrap_mesh(mesh)
    es.set_checks(True)
    try:
        rows = [3, 3, 3, 1][mesh.index("tp")]  # compute_split_shapes(10, 4), passed without shapes=
        try:
            es.einshard("a/tp b -> a b", torch.ones(rows, 2), mesh=mesh)
        except ValueError as err:
            return str(err)
        return None
    finally:
        es.set_checks(False)


@pytest.mark.ranks(8)
def test_checks_catch_ranks_that_disagree_on_global_shapes(mesh_2x4):
    message = _uneven_without_shapes(mesh_2x4)
    assert message is not None and "disagree" in message and "shapes=" in message


def test_rank_local_error_without_checks_raises_only_there():
    # only rank 5 sees its mismatch; with checks off the others would wait in the all-gather,
    # so the harness kills the pool: the failure is reported on rank 5 with its own message
    with pytest.raises(RankError) as err:
        run_on_ranks(8, _local_mismatch, MeshSpec((2, 4), ("dp", "tp")), False, False, timeout=60)
    assert 5 in err.value.failures
    assert "operand 0 holds 2 elements" in err.value.failures[5]


# -- caching, ambient mesh, double backward ----------------------------------------------


def _cache(mesh):
    from einshard.runtime import distributed

    mesh = es.wrap_mesh(mesh)
    x = torch.randn(4, 6)
    es.einshard("a b -> a/tp b", x, mesh=mesh)
    before = len(distributed._PLANS)
    calls = []
    original = distributed.plan_distributed
    distributed.plan_distributed = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        for _ in range(3):
            es.einshard("a b -> a/tp b", x, mesh=mesh)
    finally:
        distributed.plan_distributed = original
    return before == len(distributed._PLANS) and not calls


@pytest.mark.ranks(8)
def test_plans_are_cached(mesh_2x4):
    assert _cache(mesh_2x4)


def _ambient(mesh):
    wrapped = es.wrap_mesh(mesh)
    x = torch.arange(8.0).reshape(8, 1)
    with es.use_mesh(mesh):
        y = es.einshard("a b -> a/tp b", x)
        assert es.current_mesh() is not None
    assert es.current_mesh() is None
    z = es.einshard("a b -> a/tp b", x, mesh=wrapped)
    return torch.equal(y, z)


@pytest.mark.ranks(8)
def test_ambient_mesh(mesh_2x4):
    assert _ambient(mesh_2x4)


def _double_backward(mesh):
    mesh = es.wrap_mesh(mesh)
    torch.manual_seed(0)
    whole = torch.randn(8, 3, dtype=torch.float64)
    x = es.testing.local_block(whole, "a/tp b", mesh).clone().requires_grad_()
    y = es.einshard("a/tp b -> a b", x, mesh=mesh)
    (g,) = torch.autograd.grad((y**3).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    expected = es.testing.local_block(6 * whole, "a/tp b", mesh)
    return torch.allclose(gg, expected)


@pytest.mark.ranks(8)
def test_double_backward_through_a_transition(mesh_2x4):
    assert _double_backward(mesh_2x4)


def _policies_agree(mesh):
    for mode in ("training", "inference", "memory", "communication", "latency"):
        check_formula(mesh, "a b, b c -> a c/tp", [(6, 9), (9, 10)], optimize=mode)
        check_formula(mesh, "a k/dp m/tp, k/tp m/dp b -> a/tp b/dp", [(3, 6, 7), (6, 7, 5)], optimize=mode)


@pytest.mark.ranks(8)
def test_every_policy_gives_the_same_values_and_gradients(mesh_2x4):
    _policies_agree(mesh_2x4)


def _one_agreement_per_call(mesh):
    mesh = es.wrap_mesh(mesh)
    es.set_checks(True)
    try:
        x = torch.randn(3, 8, requires_grad=True)
        es.einshard("a/tp b -> a b/tp", x, mesh=mesh, shapes={"tp": {"a": [3, 3, 3, 3]}})  # plan
        with es.count_communication() as stats:
            y = es.einshard("a/tp b -> a b/tp", x, mesh=mesh, shapes={"tp": {"a": [3, 3, 3, 3]}})
            y.sum().backward()
        return {kind: rec.calls for kind, rec in stats.by_kind().items()}
    finally:
        es.set_checks(False)


@pytest.mark.ranks(8)
def test_checks_agree_once_per_call_not_per_collective(mesh_2x4):
    assert _one_agreement_per_call(mesh_2x4) == {"check": 1, "all_to_all": 2}


def _ambient_shapes_stay_with_their_mesh(mesh_2x4, mesh_8):
    m24, m8 = es.wrap_mesh(mesh_2x4), es.wrap_mesh(mesh_8)

    @es.shard_map(in_specs="b n -> b/tp n", out_specs="b/tp n -> b n", mesh=m24, shapes={"tp": [3, 3, 3, 1]})
    def body(x):
        # another mesh inside the body: the body's split shapes (4 entries for its tp) do not apply
        y = es.einshard("b n -> b/tp n", torch.ones(10, 2), mesh=m8)
        with es.use_mesh(m8):
            z = es.einshard("b n -> b/tp n", torch.ones(10, 2))
        assert y.shape == z.shape == (es.comm.helpers.compute_split_shapes(10, 8)[m8.index("tp")], 2)
        return x * 2

    out = body(torch.arange(20.0).reshape(10, 2))
    return torch.equal(out, 2 * torch.arange(20.0).reshape(10, 2))


@pytest.mark.ranks(8)
def test_ambient_split_shapes_apply_only_to_their_own_mesh(mesh_2x4, mesh_8):
    assert _ambient_shapes_stay_with_their_mesh(mesh_2x4, mesh_8)


def test_mixed_dtypes_are_rejected_before_communicating():
    mesh = es.Mesh.virtual((4,), ("tp",))
    with pytest.raises(ValueError, match="different dtypes"):
        es.einshard("a b, b c -> a c/tp", torch.ones(2, 3), torch.ones(3, 4, dtype=torch.float64), mesh=mesh)


def _owned_reduction(mesh):
    """A product's sum over ranks is reduced in the product itself (no copy): right values and gradients,
    even and uneven, and the caller's tensors are never written."""
    mesh = es.wrap_mesh(mesh)
    cases = [
        ("b n f/tp, c f/tp -> b n c", [(2, 3, 8), (5, 8)]),  # F.linear, even
        ("b n f/tp, c f/tp -> b n c", [(2, 3, 10), (5, 10)]),  # uneven
        ("b f/dp-tp, f/dp-tp c -> b c", [(3, 11), (11, 4)]),  # torch.matmul, over both mesh dimensions
        ("a k/tp, k/tp m, m -> a", [(3, 9), (9, 4), (4,)]),  # einsum of three operands
        ("a k // tp -> k a", [(3, 4)]),  # no product: the caller's partial operand is reduced in a copy
        ("a k // tp -> a k", [(3, 4)]),
    ]
    for formula, shapes in cases:
        check_formula(mesh, formula, shapes)
        splits = default_shapes(mesh, expand(formula, None), shapes, None)
        xs = [torch.randn(s, dtype=torch.float64) for s in shapes]
        locals_ = [es.testing.local_block(x, str(spec), mesh, shapes=splits)
                   for x, spec in zip(xs, expand(formula, None).inputs)]
        before = [t.clone() for t in locals_]
        y = es.einshard(formula, *locals_, mesh=mesh, shapes=splits)
        assert all(torch.equal(a, b) for a, b in zip(locals_, before)), formula
        assert all(y.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in locals_), formula
    return True


@pytest.mark.ranks(8)
def test_a_products_sum_over_ranks_reduces_in_place(mesh_2x4):
    assert _owned_reduction(mesh_2x4)
