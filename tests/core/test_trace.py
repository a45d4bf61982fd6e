"""``einshard.core._trace``: trace-time planners, the object registry, static shapes and values, refusals.

One process, no mesh. The one compile here (``backend="eager"``, a graph of
one multiplication) checks what the module is for: a planner handed an object
dynamo cannot pass as a constant runs once while tracing, and its result is a
constant of the graph.
"""

import collections
import pickle

import pytest
import torch

from einshard import EinshardError
from einshard.core import _torch_compat, _trace


class Box:
    """An object of no type dynamo hands a planner as it is (it goes as a handle)."""

    def __init__(self, n):
        self.n = n


PLANNED = []


@_trace.constant_result
def planned(box, k):
    PLANNED.append(k)
    return box.n * k


def test_constant_result_runs_eagerly_as_the_function():
    PLANNED.clear()
    assert planned(Box(5), 3) == 15 and PLANNED == [3]
    assert not _torch_compat.in_traced_code()


def test_constant_result_plans_once_while_tracing():
    PLANNED.clear()
    box = Box(5)

    def step(x):
        return x * planned(box, 3)

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 15.0))
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 15.0))
    assert PLANNED == [3]  # planned at trace time, once; the graph holds the constant


def test_register_and_lookup():
    a, b = Box(1), Box(2)
    name = _trace.register(a)
    assert _trace.register(a) == name and _trace.register(b) != name
    assert _trace.lookup(name) is a and _trace.lookup(_trace.register(b)) is b
    fresh = _trace.fresh_name()
    assert fresh != _trace.fresh_name()
    _trace.publish(fresh, b)
    assert _trace.lookup(fresh) is b


def test_static_shape_and_value():
    shape = _trace.static_shape(torch.empty(2, 3))
    assert shape == (2, 3) and all(type(s) is int for s in shape)
    Pair = collections.namedtuple("Pair", "x y")
    value = _trace.static_value({"a": [1, (2, 3)], "b": True, "c": Pair(4, "s")})
    assert value == {"a": [1, (2, 3)], "b": True, "c": Pair(4, "s")}
    assert type(value["c"]) is Pair and value["b"] is True


def test_refuse_and_trace_error():
    with pytest.raises(EinshardError, match="^no such thing$"):
        _trace.refuse("no such thing")
    err = _trace.trace_error("at trace time")
    assert isinstance(err, EinshardError) and str(err) == "at trace time"
    again = pickle.loads(pickle.dumps(err))  # made again where it is unpickled (a rank's error reaching the parent)
    assert type(again) is type(err) and str(again) == "at trace time"


def test_groups_stand_ins_and_collectives_kept_apart():
    assert _trace.group_name(None) is None and _trace.resolve_group(None) is None
    t = _trace.stand_in((3, 4), torch.float64, torch.device("cpu"))
    assert (t.shape, t.dtype, t.device, t.stride()) == (torch.Size([3, 4]), torch.float64, torch.device("cpu"), (0, 0))
    _trace.keep_collectives_apart()
    from torch._functorch.compile_utils import rand_ops
    assert torch.ops._c10d_functional.all_reduce in rand_ops
