"""CollectiveGroup on one rank: each collective's result, argument checks, the timeout knob.
(Several ranks, a dead peer and a late one: tests/distributed/.)"""

from __future__ import annotations

import pickle

import pytest
import torch.distributed as dist

from asynctron.comm import CollectiveGroup, new_gloo_group
from asynctron.engine import Engine


async def test_every_collective_on_a_group_of_one(world_one: None) -> None:
    async with Engine(num_workers=1) as engine:
        group = CollectiveGroup(new_gloo_group(timeout_s=5), run_blocking=engine.run_blocking,
                                timeout_s=5)
        assert (group.rank, group.world_size, group.timeout_s) == (0, 1, 5.0)
        assert await group.all_gather_object({"a": [1, 2]}) == [{"a": [1, 2]}]
        assert await group.gather_object(b"\x00" * 10_000) == [b"\x00" * 10_000]
        assert await group.scatter_object([{"plan": 1}]) == {"plan": 1}
        assert await group.broadcast_object(("x", None)) == ("x", None)
        await group.barrier()
        assert repr(group) == "<CollectiveGroup rank 0 of 1, timeout 5 s, 5 calls>"


@pytest.mark.parametrize("timeout_s", [0, -1.0, True, "5"])
def test_timeout_must_be_positive_seconds(timeout_s: object) -> None:
    with pytest.raises(ValueError, match=rf"^timeout_s: expected a number of seconds > 0, found "
                                         rf"{timeout_s!r}$"):
        new_gloo_group(timeout_s=timeout_s)  # type: ignore[arg-type]


async def test_ranks_out_of_the_group_and_unpicklable_objects_raise_before_sending(
        world_one: None) -> None:
    async with Engine(num_workers=1) as engine:
        group = CollectiveGroup(dist.group.WORLD, run_blocking=engine.run_blocking, timeout_s=5)
        with pytest.raises(ValueError, match=r"^dst: expected a rank in 0\.\.0, found 1$"):
            await group.gather_object("x", dst=1)
        with pytest.raises(ValueError, match=r"^src: expected a rank in 0\.\.0, found -1$"):
            await group.broadcast_object("x", src=-1)
        with pytest.raises(ValueError, match=r"^objs: expected 1 objects \(one per rank\) on "
                                             r"rank 0, found 2 objects$"):
            await group.scatter_object(["a", "b"])
        with pytest.raises((pickle.PicklingError, TypeError, AttributeError)):
            await group.all_gather_object(lambda: None)
        assert await group.all_gather_object(1) == [1]  # nothing was half sent
