"""The save plan: a nested state dict flattened into items, planned with DCP's planner types.

Stages: `flatten` walks dicts/lists/tuples, turning tensors, numpy arrays and bytes into *items*
keyed by their dotted path and keeping every other leaf (str, int, float, bool, None) as a JSON
value in the *structure* (written as JSON text during the walk); `plan_save` hands the items to
torch.distributed.checkpoint's `DefaultSavePlanner`, so sharded tensors (DTensor) and
deduplication come from DCP.
Keys are names, never paths: no key ever becomes part of a file name.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan as DcpSavePlan
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from asynctron.storage.format._dtypes import dtype_name, numpy_dtype_name

ItemKind = Literal["tensor", "ndarray", "bytes", "object"]
"""What an item holds; `"object"` (a pickled Python value) only in stock DCP checkpoints."""

#: JSON encoding of the nested structure: {"dict": [[key, node], ...]} | {"list": [...]} |
#: {"tuple": [...]} | {"item": flat_key} | {"value": json_value}.
Structure = dict[str, Any]

_JSON_LEAVES = (str, int, float, bool, type(None))


@dataclass(frozen=True, slots=True, eq=False)
class FlatStateDict:
    """A state dict as its structure (the JSON text of its nesting and JSON values) plus its
    items by flat key.

    Flat: no object per item but the caller's own payloads (a state dict of 100k tensors adds
    a few objects for the garbage collector to walk, not 100k).
    """

    structure_json: str
    """The structure as JSON text (`Structure`), as the manifest stores it."""
    values: dict[str, Any]
    """Each item's payload: a tensor (an ndarray viewed as one), bytes, or (kind `"object"`,
    DCP's format) a Python value DCP pickles."""
    kinds: dict[str, ItemKind]
    arrays: dict[str, tuple[str, np.ndarray]]
    """The ndarray items: their numpy dtype name and the caller's array (which `values` views
    as a tensor)."""

    @property
    def structure(self) -> Structure:
        """The structure, parsed (a fresh object per call)."""
        return json.loads(self.structure_json)

    def original(self, key: str) -> Any:
        """The caller's own object for `key`: its ndarray, else the payload itself."""
        array = self.arrays.get(key)
        return array[1] if array is not None else self.values[key]


def flatten(state_dict: Mapping[str, Any], *, values_as_items: bool = False) -> FlatStateDict:
    """Split `state_dict` into a JSON structure and the items that need bytes on storage.

    With `values_as_items` (DCP's format), the state dict is cut where DCP's own traversal
    cuts it: every value that is not a tensor becomes an item of kind `"object"`, as DCP
    pickles it, and so do tuples and lists holding no tensor or dict (e.g. `betas`).

    Blocks (CPU-bound, about a microsecond per value): the engine runs it on its executor.

    Raises:
        TypeError: a key, a leaf or a tensor dtype/layout asynctron cannot store (names the key
            path).
        ValueError: a key with a NUL character, two paths that flatten to one key, or a cycle.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict: expected a dict, found {type(state_dict).__name__}; "
            "wrap the value in a dict"
        )
    parts: list[str] = []
    values: dict[str, Any] = {}
    kinds: dict[str, ItemKind] = {}
    arrays: dict[str, tuple[str, np.ndarray]] = {}
    active: set[int] = set()
    value_paths: set[str] = set()
    emit = parts.append

    def claim(path: str) -> None:
        """Refuse a second leaf at `path`: a load (`load_into`, DCP) finds leaves by it."""
        if path in values or path in value_paths:
            raise ValueError(
                f"state dict key {path!r}: two different paths flatten to this key (e.g. "
                "{'a.b': ..., 'a': {'b': ...}}); rename one (keys are joined with '.')"
            )

    def add_item(path: str, kind: ItemKind, value: Any) -> None:
        claim(path)
        values[path] = value
        kinds[path] = kind
        emit(f'{{"item":{_json_string(path)}}}')

    def walk(node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            _check_tensor(node, path)
            add_item(path, "tensor", node)
        elif values_as_items and _dcp_terminal(node):
            _check_object(node, path)
            add_item(path, "object", bytes(node) if isinstance(
                node, bytearray | memoryview) else node)
        elif isinstance(node, np.ndarray):
            name = numpy_dtype_name(node.dtype, path)
            add_item(path, "ndarray", _ndarray_tensor(node))
            arrays[path] = (name, node)
        elif isinstance(node, bytes | bytearray | memoryview):
            add_item(path, "bytes", bytes(node))
        elif isinstance(node, _JSON_LEAVES):
            claim(path)
            value_paths.add(path)
            emit(f'{{"value":{json.dumps(node)}}}')
        elif id(node) in active:
            raise ValueError(f"state dict at key {path!r}: contains itself; remove the cycle")
        elif isinstance(node, Mapping):
            active.add(id(node))
            emit('{"dict":[')
            for index, (key, value) in enumerate(node.items()):
                _check_key(key, path)
                emit(f"[{json.dumps(key)}," if index == 0 else f",[{json.dumps(key)},")
                walk(value, f"{path}.{key}" if path else str(key))
                emit("]")
            emit("]}")
            active.discard(id(node))
        elif type(node) in (list, tuple):
            active.add(id(node))
            emit(f'{{"{type(node).__name__}":[')
            for index, value in enumerate(node):
                if index:
                    emit(",")
                walk(value, f"{path}.{index}" if path else str(index))
            emit("]}")
            active.discard(id(node))
        else:
            raise TypeError(
                f"value at key {path!r}: expected a tensor, ndarray, bytes, str, int, float, "
                f"bool, None, dict, list or tuple, found "
                f"{type(node).__module__}.{type(node).__qualname__}; "
                "convert it to one of these before saving"
            )

    walk(state_dict, "")
    return FlatStateDict(structure_json="".join(parts), values=values, kinds=kinds,
                         arrays=arrays)


_json_string = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]


def _dcp_terminal(value: Any) -> bool:
    """Whether DCP's traversal (`torch.distributed.checkpoint._traverse`) keeps `value` whole:
    anything but a tensor, a mapping, or a list holding tensors or such containers."""
    if isinstance(value, torch.Tensor | Mapping):
        return False
    if not isinstance(value, list):
        return True
    return all(not isinstance(entry, torch.Tensor) and (
        not isinstance(entry, Mapping | list) or _dcp_terminal(entry)) for entry in value)


def _check_object(value: Any, path: str) -> None:
    """A value DCP pickles must hold only what loading admits (`weights_only`): JSON values,
    bytes, ndarrays, tensors, and lists, tuples and dicts of them."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
        elif isinstance(node, np.ndarray):
            numpy_dtype_name(node.dtype, path)
        elif not isinstance(node, (torch.Tensor, bytes, bytearray, memoryview, *_JSON_LEAVES)):
            raise TypeError(
                f"value at key {path!r}: expected tensors, ndarrays, bytes, JSON values and "
                f"containers of them, found {type(node).__module__}.{type(node).__qualname__}; "
                "convert it before saving")


def _check_key(key: object, path: str) -> str | int:
    if isinstance(key, bool) or not isinstance(key, str | int):
        raise TypeError(
            f"state dict key {key!r} under {path or '<root>'!r}: expected str or int, "
            f"found {type(key).__name__}"
        )
    if isinstance(key, str) and "\x00" in key:
        raise ValueError(f"state dict key {key!r} under {path or '<root>'!r}: contains NUL")
    return key


def _check_tensor(tensor: torch.Tensor, path: str) -> None:
    dtype_name(tensor.dtype, path)
    if tensor.layout != torch.strided:
        raise TypeError(
            f"tensor at key {path!r}: expected a strided (dense) tensor, found layout "
            f"{tensor.layout}; call .to_dense() before saving"
        )


def _ndarray_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor viewing `array` (a copy if its strides are negative)."""
    viewable = array if all(stride >= 0 for stride in array.strides) else array.copy()
    with warnings.catch_warnings():
        # A read-only array is only ever read from; torch warns about writes we never do.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(viewable)


def unflatten(structure: Structure, items: Mapping[str, Any]) -> Any:
    """Rebuild the nested object from `structure`, taking item payloads from `items`."""
    (tag, body), = structure.items()
    if tag == "value":
        return body
    if tag == "item":
        return items[body]
    if tag == "dict":
        return {key: unflatten(node, items) for key, node in body}
    if tag == "list":
        return [unflatten(node, items) for node in body]
    if tag == "tuple":
        return tuple(unflatten(node, items) for node in body)
    raise ValueError(f"structure node tag {tag!r}: expected dict, list, tuple, item or value")


def item_paths(structure: Structure) -> dict[str, tuple[str | int, ...]]:
    """Every item's nested path, as DCP's planner data records it: dict keys as strings, list
    and tuple positions as ints."""
    paths: dict[str, tuple[str | int, ...]] = {}
    stack: list[tuple[tuple[str | int, ...], Structure]] = [((), structure)]
    while stack:
        path, node = stack.pop()
        (tag, body), = node.items()
        if tag == "item":
            paths[body] = path
        elif tag == "dict":
            stack.extend(((*path, str(key)), child) for key, child in body)
        elif tag in ("list", "tuple"):
            stack.extend(((*path, i), child) for i, child in enumerate(body))
    return paths


def value_paths(structure: Structure, *, whole_lists: bool = False) -> dict[str, Any]:
    """Every JSON value leaf (a step, a learning rate, a name) by its dotted key, as items are
    keyed, in the saved order. With `whole_lists`, the state dict is cut where DCP's traversal
    cuts it: a tuple, or a list holding only values (`betas`), is one value."""
    values: dict[str, Any] = {}

    def visit(prefix: str, node: Structure) -> None:
        (tag, body), = node.items()
        if tag == "value":
            values[prefix] = body
        elif tag == "dict":
            for key, child in body:
                visit(f"{prefix}.{key}" if prefix else str(key), child)
        elif tag in ("list", "tuple"):
            whole = _whole_value(node) if whole_lists else _NOT_A_VALUE
            if whole is not _NOT_A_VALUE:
                values[prefix] = whole
                return
            for i, child in enumerate(body):
                visit(f"{prefix}.{i}" if prefix else str(i), child)

    visit("", structure)
    return values


_NOT_A_VALUE = object()


def _whole_value(node: Structure) -> Any:
    """A value node, or a list or tuple node of only such nodes, as its value; else
    `_NOT_A_VALUE`."""
    (tag, body), = node.items()
    if tag == "value":
        return body
    if tag not in ("list", "tuple"):
        return _NOT_A_VALUE
    parts = [_whole_value(child) for child in body]
    if any(part is _NOT_A_VALUE for part in parts):
        return _NOT_A_VALUE
    return parts if tag == "list" else tuple(parts)


def merge_structures(structures: list[str]) -> str:
    """One structure (JSON text) for several ranks' state dicts: the first's, plus, at every
    depth, the dict keys only later ones have. Values and lists come from the first rank that
    has them. Identical structures (the common case) are not parsed."""
    if all(structure == structures[0] for structure in structures[1:]):
        return structures[0]
    merged = json.loads(structures[0])
    for other in structures[1:]:
        merged = _merge(merged, json.loads(other))
    return json.dumps(merged, separators=(",", ":"))


def _merge(first: Structure, other: Structure) -> Structure:
    if "dict" not in first or "dict" not in other:
        return first
    entries = {key: node for key, node in first["dict"]}
    for key, node in other["dict"]:
        entries[key] = _merge(entries[key], node) if key in entries else node
    return {"dict": [[key, node] for key, node in entries.items()]}


def item_bytes(item: WriteItem, value: Any) -> int:
    """Bytes of a tensor or bytes item on storage: its LOCAL chunk (Megatron's fix), not the
    global tensor. (A pickled object's size is known once pickled: `SavePlan.nbytes`.)"""
    if item.type == WriteItemType.BYTE_IO:
        assert isinstance(value, bytes)
        return len(value)
    assert item.tensor_data is not None
    itemsize = item.tensor_data.properties.dtype.itemsize
    return math.prod(item.tensor_data.chunk.sizes) * itemsize


@dataclass(frozen=True, slots=True)
class SavePlan:
    """What one rank writes: DCP's final write items, their payloads and, on the coordinator,
    the global DCP metadata. Object leaves (DCP's format) are pickled once, by DCP's planner,
    when the plan is made (`pickled`)."""

    flat: FlatStateDict
    items: list[WriteItem]
    metadata: Metadata | None
    planner: DefaultSavePlanner
    pickled: dict[str, bytes]

    def payload(self, item: WriteItem) -> torch.Tensor | bytes:
        """The tensor (local shard for DTensor) or bytes to write for `item`."""
        if item.type == WriteItemType.BYTE_IO:
            key = item.index.fqn
            return self.pickled[key] if key in self.pickled else self.flat.values[key]
        tensor = self.planner.resolve_data(item)
        assert isinstance(tensor, torch.Tensor)
        return tensor.detach()

    def nbytes(self, item: WriteItem) -> int:
        """Bytes of `item` on storage (`item_bytes`, or its pickle's size)."""
        key = item.index.fqn
        return len(self.pickled[key]) if key in self.pickled else item_bytes(
            item, self.flat.values[key])


PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
"""Tensor types whose plan never changes for one shape (subclasses, DTensor among them, may
be sharded differently each time)."""


def is_plain(flat: FlatStateDict) -> bool:
    """Whether every item is a plain tensor (an ndarray viewed as one) or bytes: nothing a
    planner must resolve (DTensor shards, other tensor subclasses, pickled values)."""
    return all(type(value) in PLAIN_TENSORS or (isinstance(value, bytes) and kind == "bytes")
               for value, kind in zip(flat.values.values(), flat.kinds.values(), strict=True))


@dataclass(frozen=True, slots=True)
class PlainPlan:
    """A rank's local plan when all its items are plain: each item's key, bytes and whether
    it is a tensor. DCP's planner costs ~20 µs and a dozen objects per item (seconds and GC
    passes for 100k items); a plain item needs none of it: it is written whole, by one rank."""

    keys: tuple[str, ...]
    nbytes: tuple[int, ...]
    tensors: tuple[bool, ...]

    @classmethod
    def of(cls, flat: FlatStateDict) -> PlainPlan:
        """Blocks (a step per item)."""
        values = flat.values.values()
        return cls(tuple(flat.values), tuple(
            value.numel() * value.dtype.itemsize if isinstance(value, torch.Tensor)
            else len(value) for value in values),
            tuple(isinstance(value, torch.Tensor) for value in values))


def plan_plain_global(plans: Sequence[PlainPlan]) -> list[list[bool]]:
    """The coordinator's step over every rank's plain plan: per rank, per key, whether it
    writes it. A key several ranks hold (a replicated tensor) is written once, by the holder
    with the fewest bytes so far, keys taken in the order ranks list them (DCP's
    `dedup_save_plans` rule).

    Raises:
        ValueError: ranks hold different kinds (tensor, bytes) or sizes under one key.
    """
    holders: dict[str, list[tuple[int, int]]] = {}
    for rank, plan in enumerate(plans):
        for index, key in enumerate(plan.keys):
            holders.setdefault(key, []).append((rank, index))
    assigned = [0] * len(plans)
    writes = [[False] * len(plan.keys) for plan in plans]
    for key, where in holders.items():
        (first_rank, first_index), *others = where
        first_tensor = plans[first_rank].tensors[first_index]
        for rank, index in others:
            if plans[rank].tensors[index] != first_tensor:
                raise ValueError(
                    f"save plan: key {key!r} is {_kind_words(first_tensor)} on rank "
                    f"{first_rank} and {_kind_words(not first_tensor)} on rank {rank}; every "
                    "rank must hold the same kind of value under one key")
        sizes = {plans[rank].nbytes[index] for rank, index in where}
        if len(sizes) > 1:
            raise ValueError(f"save plan: key {key!r} holds {sorted(sizes)} bytes on different "
                             "ranks; every rank must hold the same value under one key")
        rank, index = min(where, key=lambda entry: assigned[entry[0]])
        assigned[rank] += max(plans[rank].nbytes[index], 1)
        writes[rank][index] = True
    return writes


def plan_local(flat: FlatStateDict, *, is_coordinator: bool
               ) -> tuple[DefaultSavePlanner, DcpSavePlan]:
    """DCP's local step for this rank's leaves: a planner set up on them and its local plan.
    Blocks (CPU-bound: about 60 µs per item); `flatten` already validated every leaf."""
    planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=True)
    planner.set_up_planner(dict(flat.values), storage_meta=None,
                           is_coordinator=is_coordinator)
    return planner, planner.create_local_plan()


def plan_global(planner: DefaultSavePlanner, local_plans: list[DcpSavePlan]
                ) -> tuple[list[DcpSavePlan], Metadata]:
    """DCP's global step (on the coordinator): every rank's local plan, deduplicated (an item
    several ranks hold is written by one of them, spread by size), and the global metadata.

    Raises:
        ValueError: ranks hold different kinds of value (tensor, bytes) under one key.
    """
    try:
        return planner.create_global_plan(local_plans)
    except AssertionError as error:  # DCP asserts one kind of item per key
        raise ValueError(f"save plan: {_kind_conflict(local_plans)}; every rank must hold the "
                         "same kind of value under one key") from error


def _kind_conflict(local_plans: list[DcpSavePlan]) -> str:
    """The first key that ranks hold as different kinds of item, in words."""
    seen: dict[str, tuple[int, WriteItemType]] = {}
    for rank, plan in enumerate(local_plans):
        for item in plan.items:
            first = seen.setdefault(item.index.fqn, (rank, item.type))
            if (first[1] == WriteItemType.BYTE_IO) != (item.type == WriteItemType.BYTE_IO):
                first_tensor = first[1] != WriteItemType.BYTE_IO
                return (f"key {item.index.fqn!r} is {_kind_words(first_tensor)} on rank "
                        f"{first[0]} and {_kind_words(not first_tensor)} on rank {rank}")
    return "DCP's global planning step failed"


def _kind_words(tensor: bool) -> str:
    return "a tensor" if tensor else "bytes"


def plan_final(flat: FlatStateDict, planner: DefaultSavePlanner, plan: DcpSavePlan,
               metadata: Metadata | None) -> SavePlan:
    """DCP's finish step for this rank's share of the global plan (object leaves pickled by
    DCP's planner, as `torch.save` blobs)."""
    items = list(planner.finish_plan(plan).items)
    pickled = {item.index.fqn: planner.resolve_data(item).getvalue() for item in items
               if item.type == WriteItemType.BYTE_IO
               and flat.kinds[item.index.fqn] == "object"}
    return SavePlan(flat=flat, items=items, metadata=metadata, planner=planner, pickled=pickled)


def plan_save(flat: FlatStateDict) -> SavePlan:
    """Plan a single-process save: local, global and finish steps in one."""
    planner, local = plan_local(flat, is_coordinator=True)
    (plan,), metadata = plan_global(planner, [local])
    return plan_final(flat, planner, plan, metadata)
