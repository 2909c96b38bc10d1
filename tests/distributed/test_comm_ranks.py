"""asynctron.comm on real gloo ranks (2 and 3), against PyTorch DDP on the same model, data and
bucket size: gradients every step, parameters after the optimizer steps, all-reduce count and
launch order, unused parameters, no_sync accumulation, bf16, the AsyncDataParallel face, and the
awaitable object collectives.

Spawning is slow (torch imports), so each world size is spawned once and every scenario runs
in it; each test below checks one scenario's outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import traceback
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch
import torch.distributed as dist
import uvloop
from torch.nn.parallel import DistributedDataParallel as DDP

from asynctron._launch import run_local_ranks
from asynctron.comm import (
    AsyncDataParallel,
    BucketManager,
    CollectiveGroup,
    new_gloo_group,
    wait_work,
)
from asynctron.engine import Engine
from asynctron.errors import BusyError
from asynctron.testing import LoopWatchdog

BUCKET_MB = 0.01  # 10 KiB: several buckets even for these small models (DDP's bucket_cap_mb)
BUCKET_BYTES = int(BUCKET_MB * 2**20)  # the same cap, as BucketManager takes it


def mlp(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(dtype)


class Branchy(torch.nn.Module):
    """`extra` is used only when asked (on some ranks), `never` only when asked (on none)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.trunk = torch.nn.Linear(32, 64)
        self.extra = torch.nn.Linear(64, 4)
        self.never = torch.nn.Linear(64, 4)
        self.out = torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor, use_extra: bool = False,
                use_never: bool = False) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        y = self.out(h)
        if use_extra:
            y = y + self.extra(h)
        if use_never:
            y = y + self.never(h)
        return y


class HeadFirst(torch.nn.Module):
    """Registers its output layer first: gradients become ready in an order that differs from
    reverse registration, so buckets become ready out of launch order."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.head = torch.nn.Linear(64, 4)
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                        torch.nn.Linear(64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def batch(rank: int, step: int, dtype: torch.dtype = torch.float32
          ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 32, generator=g).to(dtype), torch.randn(8, 4, generator=g).to(dtype)


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.float(), target.float())


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


def assert_grads_equal(ours: torch.nn.Module, theirs: torch.nn.Module, where: str,
                       **tolerance: float) -> None:
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        if b.grad is None:
            assert a.grad is None, f"{where} {name}: DDP left .grad None, ours {a.grad}"
            continue
        assert a.grad is not None, f"{where} {name}: no .grad, DDP has one"
        torch.testing.assert_close(a.grad, b.grad, msg=lambda m, n=name: f"{where} {n}: {m}",
                                   **tolerance)


def assert_params_equal(ours: torch.nn.Module, theirs: torch.nn.Module, **tolerance: float) -> None:
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, n=name: f"param {n}: {m}", **tolerance)


def end_step(manager: BucketManager, ours: torch.nn.Module, ddp: DDP,
             optimizers: tuple[torch.optim.Optimizer, torch.optim.Optimizer], where: str,
             **tolerance: float) -> None:
    """Compare the synchronized gradients with DDP's, then step and reset both."""
    assert_grads_equal(ours, ddp.module, where, **tolerance)
    for optimizer in optimizers:
        optimizer.step()
    manager.zero_grad()
    ddp.zero_grad()


# scenarios: run on every rank -------------------------------------------------------------------

def parity(rank: int, world: int) -> dict[str, Any]:
    ours, theirs = mlp(0), mlp(0)
    manager = BucketManager(ours, bucket_size_bytes=BUCKET_BYTES, first_bucket_size_bytes=1000)
    ddp = DDP(theirs, bucket_cap_mb=BUCKET_MB)
    optimizers = sgd(ours.parameters()), sgd(ddp.parameters())

    async def run() -> None:
        for step in range(4):
            x, y = batch(rank, step)
            loss_of(ours(x), y).backward()
            await manager.synchronize()
            loss_of(ddp(x), y).backward()
            end_step(manager, ours, ddp, optimizers, f"step {step}", rtol=1e-6, atol=1e-7)

    uvloop.run(run())
    assert_params_equal(ours, theirs, rtol=1e-6, atol=1e-7)
    assert manager.last_step is not None
    return {"num_buckets": len(manager.buckets)}


def launch_order(rank: int, world: int) -> dict[str, Any]:
    model = HeadFirst()
    manager = BucketManager(model, bucket_size_bytes=4000, first_bucket_size_bytes=1000)
    bucket_at = {bucket.buffer.data_ptr(): bucket.index for bucket in manager.buckets}
    launched: list[int] = []
    real_all_reduce = dist.all_reduce

    def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        launched.append(bucket_at.get(tensor.data_ptr(), -1))
        return real_all_reduce(tensor, *args, **kwargs)

    async def run() -> list[list[int]]:
        async with Engine(num_workers=1) as engine:
            group = CollectiveGroup(None, run_blocking=engine.run_blocking, timeout_s=30)
            x, y = batch(rank, 0)
            dist.all_reduce = spy
            try:
                loss_of(model(x), y).backward()
                await manager.synchronize()
            finally:
                dist.all_reduce = real_all_reduce
            return await group.all_gather_object(launched)

    orders = uvloop.run(run())
    names = [bucket.names for bucket in manager.buckets]
    return {"orders": orders, "num_buckets": len(manager.buckets), "names": names}


def unused(rank: int, world: int) -> None:
    ours, theirs = Branchy(), Branchy()
    manager = BucketManager(ours, bucket_size_bytes=BUCKET_BYTES, find_unused_parameters=True)
    ddp = DDP(theirs, bucket_cap_mb=BUCKET_MB, find_unused_parameters=True)
    optimizers = sgd(ours.parameters()), sgd(ddp.parameters())

    async def run() -> None:
        for step in range(3):
            x, y = batch(rank, step)
            loss_of(ours(x, use_extra=rank == 0), y).backward()
            await manager.synchronize()
            loss_of(ddp(x, use_extra=rank == 0), y).backward()
            assert ours.never.weight.grad is None
            assert manager.last_step is not None
            assert manager.last_step.num_all_reduces == len(manager.buckets) + 1
            end_step(manager, ours, ddp, optimizers, f"step {step}", rtol=1e-6, atol=1e-7)

    uvloop.run(run())
    assert_params_equal(ours, theirs, rtol=1e-6, atol=1e-7)


def missing_gradient(rank: int, world: int) -> dict[str, str]:
    model = Branchy()
    manager = BucketManager(model, bucket_size_bytes=BUCKET_BYTES)
    errors = {}

    async def run() -> None:
        x, y = batch(rank, 0)
        try:
            loss_of(model(x, use_extra=True), y).backward()
        except RuntimeError as exc:
            errors["backward"] = str(exc)
        try:
            await manager.synchronize()
        except RuntimeError as exc:
            errors["synchronize"] = str(exc)
        manager.zero_grad()
        loss_of(model(x, use_extra=True, use_never=True), y).backward()  # every rank recovers
        await manager.synchronize()
        assert model.never.weight.grad is not None

    uvloop.run(run())
    return errors


def no_sync(rank: int, world: int) -> None:
    ours, theirs = mlp(0), mlp(0)
    manager = BucketManager(ours, bucket_size_bytes=BUCKET_BYTES)
    ddp = DDP(theirs, bucket_cap_mb=BUCKET_MB)
    optimizers = sgd(ours.parameters()), sgd(ddp.parameters())

    async def run() -> None:
        for step in range(2):
            for micro in range(3):
                x, y = batch(rank, 10 * step + micro)
                if micro < 2:
                    with manager.no_sync():
                        loss_of(ours(x), y).backward()
                    with ddp.no_sync():
                        loss_of(ddp(x), y).backward()
                else:
                    loss_of(ours(x), y).backward()
                    loss_of(ddp(x), y).backward()
            await manager.synchronize()
            end_step(manager, ours, ddp, optimizers, f"step {step}", rtol=1e-6, atol=1e-6)

    uvloop.run(run())
    assert_params_equal(ours, theirs, rtol=1e-6, atol=1e-6)


def bf16(rank: int, world: int) -> None:
    ours, theirs, local = mlp(0, torch.bfloat16), mlp(0, torch.bfloat16), mlp(0, torch.bfloat16)
    wide = mlp(0, torch.bfloat16)
    manager = BucketManager(ours, bucket_size_bytes=BUCKET_BYTES)
    wide_manager = BucketManager(wide, bucket_size_bytes=BUCKET_BYTES, grad_dtype=torch.float32)
    ddp = DDP(theirs, bucket_cap_mb=BUCKET_MB)
    assert {b.buffer.dtype for b in manager.buckets} == {torch.bfloat16}
    assert {b.buffer.dtype for b in wide_manager.buckets} == {torch.float32}

    async def run() -> None:
        async with Engine(num_workers=1) as engine:
            group = CollectiveGroup(None, run_blocking=engine.run_blocking, timeout_s=30)
            local_grads = []
            for micro in range(2):  # fp32 buffers accumulate the micro-batches in fp32
                x, y = batch(rank, micro, torch.bfloat16)
                with wide_manager.no_sync() if micro == 0 else contextlib.nullcontext():
                    loss_of(wide(x), y).backward()
                local.zero_grad()
                loss_of(local(x), y).backward()  # the same bf16 gradients, kept apart
                local_grads.append([p.grad.float() for p in local.parameters()])
            x, y = batch(rank, 0, torch.bfloat16)
            loss_of(ours(x), y).backward()
            await manager.synchronize()
            loss_of(ddp(x), y).backward()
            await wide_manager.synchronize()
            everyone = await group.all_gather_object(local_grads)
        # Two ranks: a + b is exact whatever the order, so the results are bit-identical. With
        # three, gloo's ring sums each chunk of a bucket in another rank order, and the chunks
        # fall elsewhere in our buckets than in DDP's: bf16 rounding then differs by an ulp.
        exact = world == 2
        assert_grads_equal(ours, theirs, "bf16 buffers", rtol=0 if exact else 1.6e-2,
                           atol=0 if exact else 1e-3)
        for i, param in enumerate(wide.parameters()):
            # every rank's two micro-batch gradients (bf16 values), summed and averaged in
            # fp32: what the fp32 buffer must hold
            expected = sum(micro[i] for grads in everyone for micro in grads) / world
            main = wide_manager.main_grad(param)
            assert main.dtype == torch.float32 and param.grad.dtype == torch.bfloat16
            torch.testing.assert_close(main, expected, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(param.grad, main.to(torch.bfloat16), rtol=0, atol=0)

    uvloop.run(run())


def misuse(rank: int, world: int) -> dict[str, str]:
    model, reference = mlp(0), DDP(mlp(0), bucket_cap_mb=BUCKET_MB)
    manager = BucketManager(model, bucket_size_bytes=BUCKET_BYTES)
    optimizer = sgd(model.parameters())
    errors = {}

    async def run() -> None:
        x, y = batch(rank, 0)
        loss_of(model(x), y).backward()
        try:
            loss_of(model(x), y).backward()  # a second backward in the same step
        except RuntimeError as exc:
            errors["second_backward"] = str(exc)
        await manager.synchronize()  # the first backward's step completes, untouched
        loss_of(reference(x), y).backward()
        assert_grads_equal(model, reference.module, "after a refused backward", rtol=1e-6,
                           atol=1e-7)
        optimizer.step()
        try:
            loss_of(model(x), y).backward()  # no zero_grad after the step
        except RuntimeError as exc:
            errors["stale"] = str(exc)
        manager.zero_grad()
        loss_of(model(x), y).backward()
        await manager.synchronize()
        optimizer.step()
        optimizer.zero_grad()  # set_to_none: seen as a reset
        loss_of(model(x), y).backward()
        await manager.synchronize()

    uvloop.run(run())
    return errors


def cancelled_synchronize(rank: int, world: int) -> dict[str, str]:
    """Rank 0 cancels synchronize() while rank 1 has not even run backward (it waits on a
    barrier of a dedicated group that rank 0 joins only after the cancellation)."""
    dedicated = new_gloo_group(timeout_s=30)
    ours, reference = mlp(0), DDP(mlp(0), bucket_cap_mb=BUCKET_MB)
    manager = BucketManager(ours, bucket_size_bytes=BUCKET_BYTES)
    seen = {}

    async def run() -> None:
        async with Engine(num_workers=1) as engine:
            group = CollectiveGroup(dedicated, run_blocking=engine.run_blocking, timeout_s=30)
            x, y = batch(rank, 0)
            if rank == 0:
                loss_of(ours(x), y).backward()
                task = asyncio.get_running_loop().create_task(
                    _announced(waiting := asyncio.Event(), manager.synchronize()))
                await waiting.wait()  # synchronize() waits on the launched all-reduces
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    seen["cancelled"] = "yes"
                try:
                    manager.zero_grad()
                except BusyError as exc:
                    seen["zero_grad"] = str(exc)
                await group.barrier()  # now rank 1 may go on
            else:
                await group.barrier()
                loss_of(ours(x), y).backward()
            await manager.synchronize()
            loss_of(reference(x), y).backward()
            assert_grads_equal(ours, reference.module, "after a cancelled synchronize",
                               rtol=1e-6, atol=1e-7)

    uvloop.run(run())
    return seen


def data_parallel(rank: int, world: int) -> None:
    net = mlp(100 + rank)  # different weights on every rank until broadcast
    reference = DDP(mlp(100 + rank), bucket_cap_mb=BUCKET_MB)  # DDP broadcasts rank 0's
    model = AsyncDataParallel(net, bucket_size_bytes=BUCKET_BYTES)
    opt_a, opt_b = sgd(model.parameters()), sgd(reference.parameters())

    async def run() -> None:
        await model.broadcast_parameters()
        assert_params_equal(net, reference.module, rtol=0, atol=0)
        for step in range(3):
            x, y = batch(rank, step)
            loss_of(model(x), y).backward()
            await model.step(opt_a)
            loss_of(reference(x), y).backward()
            opt_b.step()
            opt_b.zero_grad()
        assert all(p.grad is None for p in model.parameters())

    uvloop.run(run())
    assert_params_equal(net, reference.module, rtol=1e-6, atol=1e-7)
    assert list(model.state_dict()) == [f"module.{k}" for k in net.state_dict()]


async def _announced(started: asyncio.Event, call: Coroutine[Any, Any, Any]) -> Any:
    """Run `call`, having set `started`: it runs to its first wait before the task that
    awaits `started` resumes, so that task then finds the call in flight."""
    started.set()
    return await call


def collectives(rank: int, world: int) -> dict[str, Any]:
    dedicated = new_gloo_group(timeout_s=30)
    ordering = new_gloo_group(timeout_s=30)  # orders the ranks around the cancelled call

    async def run() -> dict[str, Any]:
        async with Engine(num_workers=2) as engine, LoopWatchdog() as dog:
            group = CollectiveGroup(dedicated, run_blocking=engine.run_blocking, timeout_s=30)
            blobs = await group.all_gather_object({"rank": rank, "blob": b"x" * (1000 * rank)})
            gathered = await group.gather_object(10 * rank, dst=world - 1)
            broadcast = await group.broadcast_object(f"from {rank}", src=1)
            scattered = await group.scatter_object(
                [{"to": r, "pad": "y" * 100 * r} for r in range(world)] if rank == 1 else None,
                src=1)
            await group.barrier()
            # Rank 0 cancels its call while the others are late (they join it only once rank 0
            # has cancelled, told by a barrier of another group): its part still completes.
            order = CollectiveGroup(ordering, run_blocking=engine.run_blocking, timeout_s=30)
            if rank == 0:
                calls = group.num_calls
                task = asyncio.get_running_loop().create_task(
                    _announced(issued := asyncio.Event(), group.all_gather_object("mine")))
                await issued.wait()
                assert group.num_calls == calls + 1  # in flight, waiting for the others
                task.cancel()
                await order.barrier()  # now the others join the cancelled call
                cancelled = False
                try:
                    await task
                except asyncio.CancelledError:
                    cancelled = True
                late = None
            else:
                await order.barrier()
                late = await group.all_gather_object("mine")
                cancelled = None
            after = await group.all_gather_object(rank)
            # A Work without a future (gloo reduce_scatter) waits on the engine's thread.
            out = torch.empty(2)
            work = dist.reduce_scatter(out, list((torch.arange(2.0 * world) + rank).chunk(world)),
                                       group=dedicated, async_op=True)
            assert work is not None
            await wait_work(work, run_blocking=engine.run_blocking)
        return {"blobs": blobs, "gathered": gathered, "broadcast": broadcast,
                "scattered": scattered, "late": late,
                "cancelled": cancelled, "after": after, "reduce_scatter": out.tolist(),
                "worst_delay_s": dog.report().worst_delay_s}

    return uvloop.run(run())


def loop_stays_free(rank: int, world: int) -> dict[str, float]:
    torch.manual_seed(3)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])  # 16 MiB
    manager = BucketManager(model, bucket_size_bytes=4 << 20)

    async def run() -> float:
        worst = 0.0
        for _ in range(3):
            x = torch.randn(4, 1024)
            model(x).square().mean().backward()
            async with LoopWatchdog() as dog:
                await manager.synchronize()
            worst = max(worst, dog.report().worst_delay_s)
            manager.zero_grad()
        return worst

    return {"worst_delay_s": uvloop.run(run())}


SCENARIOS: dict[str, Callable[[int, int], Any]] = {
    fn.__name__: fn for fn in (parity, launch_order, unused, missing_gradient, no_sync, bf16,
                               misuse, cancelled_synchronize, data_parallel, collectives,
                               loop_stays_free)}
THREE_RANKS = ("parity", "launch_order", "unused", "no_sync", "bf16", "collectives")


def all_scenarios(rank: int, world: int) -> dict[str, tuple[Any, str | None]]:
    outcomes: dict[str, tuple[Any, str | None]] = {}
    for name, scenario in SCENARIOS.items():
        if world == 3 and name not in THREE_RANKS:
            continue
        try:
            outcomes[name] = (scenario(rank, world), None)
        except Exception:
            outcomes[name] = (None, traceback.format_exc())
    return outcomes


# tests: check each scenario's outcome ----------------------------------------------------------

@pytest.fixture(scope="module")
def spawned() -> Callable[[int], list[dict[str, Any]]]:
    """`spawned(size)`: every rank's scenario outcomes, spawning `size` ranks on first use."""
    cache: dict[int, list[dict[str, Any]]] = {}

    def get(size: int) -> list[dict[str, Any]]:
        if size not in cache:
            cache[size] = [r.unwrap() for r in run_local_ranks(all_scenarios, size,
                                                               timeout_s=240)]
        return cache[size]

    return get


def outcome(per_rank: list[dict[str, Any]], name: str) -> list[Any]:
    values = []
    for rank, outcomes in enumerate(per_rank):
        value, error = outcomes[name]
        assert error is None, f"rank {rank} of {len(per_rank)}, scenario {name}:\n{error}"
        values.append(value)
    return values


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("size", [2, 3])
def test_gradients_and_parameters_match_ddp(spawned: Any, size: int) -> None:
    values = outcome(spawned(size), "parity")
    assert values[0]["num_buckets"] >= 3


@pytest.mark.parametrize("size", [2, 3])
def test_one_all_reduce_per_bucket_in_the_same_order_on_every_rank(spawned: Any,
                                                                   size: int) -> None:
    values = outcome(spawned(size), "launch_order")
    num_buckets = values[0]["num_buckets"]
    assert num_buckets >= 3
    for orders in (v["orders"] for v in values):
        assert orders == [list(range(num_buckets))] * size
    # the first bucket holds the last registered parameters (reverse registration order)
    assert values[0]["names"][0][0] == "body.2.bias"


@pytest.mark.parametrize("size", [2, 3])
def test_unused_parameters_match_ddp_with_find_unused(spawned: Any, size: int) -> None:
    outcome(spawned(size), "unused")


def test_a_parameter_without_gradient_is_a_clear_error(spawned: Any) -> None:
    for errors in outcome(spawned(2), "missing_gradient"):
        for where in ("backward", "synchronize"):
            assert errors[where].startswith("parameters 'never.bias', 'never.weight': expected a "
                                            "gradient from this backward, found none; ")
            assert "find_unused_parameters=True" in errors[where]


@pytest.mark.parametrize("size", [2, 3])
def test_no_sync_accumulation_matches_ddp(spawned: Any, size: int) -> None:
    outcome(spawned(size), "no_sync")


@pytest.mark.parametrize("size", [2, 3])
def test_bf16_with_bf16_and_fp32_buffers(spawned: Any, size: int) -> None:
    outcome(spawned(size), "bf16")


def test_a_second_backward_or_a_missing_reset_is_a_clear_error(spawned: Any) -> None:
    for errors in outcome(spawned(2), "misuse"):
        assert "expected one gradient per step, found a second" in errors["second_backward"]
        assert "expected zero_grad() between a synchronized step and the next backward" in (
            errors["stale"])


def test_a_cancelled_synchronize_can_be_resumed(spawned: Any) -> None:
    seen = outcome(spawned(2), "cancelled_synchronize")[0]
    assert seen["cancelled"] == "yes"
    assert seen["zero_grad"].startswith("bucket manager: expected no step in flight, found one")


def test_data_parallel_face_trains_like_ddp(spawned: Any) -> None:
    outcome(spawned(2), "data_parallel")


@pytest.mark.parametrize("size", [2, 3])
def test_object_collectives_on_a_dedicated_gloo_group(spawned: Any, size: int) -> None:
    values = outcome(spawned(size), "collectives")
    for rank, value in enumerate(values):
        assert value["blobs"] == [{"rank": r, "blob": b"x" * (1000 * r)} for r in range(size)]
        assert value["gathered"] == ([10 * r for r in range(size)] if rank == size - 1 else None)
        assert value["broadcast"] == "from 1"
        assert value["scattered"] == {"to": rank, "pad": "y" * 100 * rank}
        assert value["after"] == list(range(size))
        # sum over ranks of (arange(2 * size) + rank), this rank's 2-element share
        total = [sum(2 * rank + i + r for r in range(size)) for i in range(2)]
        assert value["reduce_scatter"] == total
        assert value["worst_delay_s"] < 0.25
    assert values[0]["cancelled"] is True
    for value in values[1:]:  # the cancelled rank's part went through
        assert value["late"] == ["mine"] * size


def test_the_loop_stays_free_while_synchronizing(spawned: Any) -> None:
    values = outcome(spawned(2), "loop_stays_free")
    worst = max(v["worst_delay_s"] for v in values)
    print(f"worst loop delay during synchronize(): {worst * 1e3:.1f} ms")
    assert worst < 0.25
