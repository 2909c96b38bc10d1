"""Flattening: what may be saved, and clear errors for what may not."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from asynctron.storage.format._plan import (
    PlainPlan,
    flatten,
    is_plain,
    plan_plain_global,
    plan_save,
    unflatten,
)


def test_structure_round_trips_containers_and_json_leaves() -> None:
    state = {"a": {"b": [1, 2.5, (True, None)], 3: "x"}, "t": torch.zeros(2), "raw": b"\x00\x01"}
    flat = flatten(state)
    assert sorted(flat.values) == ["raw", "t"] and flat.kinds == {"t": "tensor", "raw": "bytes"}
    assert json.loads(flat.structure_json) == flat.structure
    rebuilt = unflatten(flat.structure, flat.values)
    assert rebuilt["a"] == {"b": [1, 2.5, (True, None)], 3: "x"}
    assert isinstance(rebuilt["a"]["b"][2], tuple)
    assert list(rebuilt["a"]) == ["b", 3]


def test_structure_json_escapes_keys_and_keeps_json_values() -> None:
    state = {'q"uote': {"\\back": 1.5, "ünï": "x\ny"}, 7: [None, False, float("inf")],
             "t": torch.zeros(1)}
    structure = flatten(state).structure
    assert unflatten(structure, {"t": "T"}) == {'q"uote': {"\\back": 1.5, "ünï": "x\ny"},
                                                7: [None, False, float("inf")], "t": "T"}


@pytest.mark.parametrize(
    ("state", "error", "message"),
    [
        ({"x": {1, 2}}, TypeError, r"^value at key 'x': expected a tensor, .* found builtins\.set"),
        ({"a": {"b": object()}}, TypeError, r"^value at key 'a\.b': .*found builtins\.object"),
        ({(1, 2): 3}, TypeError, r"^state dict key \(1, 2\) under '<root>': expected str or int"),
        ({"bad\x00key": 1}, ValueError, r"contains NUL$"),
        ({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, ValueError,
         r"^state dict key 'a\.b': two different paths flatten to this key"),
        # values alias too: `load_into` finds them by this key
        ({"a.b": 1, "a": {"b": 2}}, ValueError,
         r"^state dict key 'a\.b': two different paths flatten to this key"),
        ({"a.b": torch.ones(1), "a": {"b": 2}}, ValueError, r"^state dict key 'a\.b': two"),
        ({"a": [5], "a.0": "x"}, ValueError, r"^state dict key 'a\.0': two"),
        ({1: "int key", "1": "str key"}, ValueError, r"^state dict key '1': two"),
        ([1, 2], TypeError, r"^state_dict: expected a dict, found list"),
    ],
)
def test_bad_input_names_the_key(state: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        flatten(state)  # type: ignore[arg-type]


def test_cycles_are_refused() -> None:
    state: dict = {"a": {}}
    state["a"]["self"] = state["a"]
    with pytest.raises(ValueError, match=r"^state dict at key 'a\.self': contains itself"):
        flatten(state)


def test_unsupported_dtypes_and_layouts_name_the_key() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized tensors are deprecated
        quantized = torch.quantize_per_tensor(torch.ones(2), 1.0, 0, torch.qint8)
    with pytest.raises(TypeError, match=r"^tensor at key 'q': dtype torch\.qint8 cannot be saved"):
        plan_save(flatten({"q": quantized}))
    with pytest.raises(TypeError, match=r"^tensor at key 's': expected a strided"):
        plan_save(flatten({"s": torch.eye(2).to_sparse()}))
    with pytest.raises(TypeError, match=r"^ndarray at key 'o': dtype '\|O' cannot be saved"):
        flatten({"o": np.array([object()])})
    with pytest.raises(TypeError, match=r"^ndarray at key 'be': dtype '>f4' cannot be saved"):
        flatten({"be": np.zeros(2, dtype=">f4")})


def test_plan_items_use_local_chunks() -> None:
    plan = plan_save(flatten({"w": torch.zeros(4, 8), "b": b"xyz"}))
    by_key = {item.index.fqn: item for item in plan.items}
    assert tuple(by_key["w"].tensor_data.chunk.sizes) == (4, 8)
    assert plan.payload(by_key["b"]) == b"xyz"


def test_plain_plans_write_each_replicated_key_once_spread_by_size() -> None:
    """DCP's dedup rule, without DCP's objects: a key several ranks hold goes to the holder
    with the fewest bytes so far; a key one rank holds stays there."""
    tensors = (True,) * 4
    plans = [PlainPlan(("a", "b", "c", "own0"), (100, 100, 100, 5), tensors),
             PlainPlan(("a", "b", "c", "own1"), (100, 100, 100, 7), tensors)]
    assert plan_plain_global(plans) == [[True, False, True, True], [False, True, False, True]]


def test_plain_plans_name_the_key_ranks_disagree_on() -> None:
    with pytest.raises(ValueError, match=r"^save plan: key 'a' holds \[4, 100\] bytes on "
                                         r"different ranks"):
        plan_plain_global([PlainPlan(("a",), (100,), (True,)),
                           PlainPlan(("a",), (4,), (True,))])
    with pytest.raises(ValueError, match=r"^save plan: key 'a' is a tensor on rank 0 and "
                                         r"bytes on rank 1"):
        plan_plain_global([PlainPlan(("a",), (4,), (True,)), PlainPlan(("a",), (4,), (False,))])


def test_only_plain_tensors_and_bytes_are_planned_without_dcp() -> None:
    assert is_plain(flatten({"w": torch.ones(2), "n": np.ones(3), "b": b"x", "step": 3}))
    assert not is_plain(flatten({"w": torch.ones(2), "extra": (1, 2)}, values_as_items=True))
