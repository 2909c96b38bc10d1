"""BucketManager on one rank: its config, the step's states and the errors that guard them.
(Agreement with DDP across real ranks: tests/distributed/test_comm_ranks.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asynctron import BackgroundEngine
from asynctron.comm import AsyncDataParallel, BucketConfig, BucketManager
from asynctron.comm._manager import BucketOptions
from asynctron.errors import BusyError


def model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)
                               ).to(dtype)


def backward(net: torch.nn.Module, seed: int = 0) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed)).to(
        next(net.parameters()).dtype)
    net(x).float().square().mean().backward()


def local_grads(seed: int = 0) -> list[torch.Tensor]:
    net = model()
    backward(net, seed)
    return [p.grad for p in net.parameters()]


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("bucket_size_bytes", 0, "an int of bytes >= 1"),
    ("bucket_size_bytes", True, "an int of bytes >= 1"),
    ("bucket_size_bytes", 25.0, "an int of bytes >= 1"),
    ("first_bucket_size_bytes", -1, "an int of bytes >= 1"),
    ("find_unused_parameters", "yes", "a bool"),
    ("grad_dtype", torch.int32, "None or a floating torch.dtype"),
])
def test_config_names_the_bad_field(field: str, value: object, expected: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: expected {expected}, found {value!r}$"):
        BucketConfig(**{field: value})


def test_first_bucket_cap_never_exceeds_the_bucket_cap() -> None:
    config = BucketConfig(bucket_size_bytes=1 << 19, first_bucket_size_bytes=4 << 20)
    assert config.limits_bytes() == [1 << 19, 1 << 19]


def test_needs_an_initialized_process_group() -> None:
    with pytest.raises(RuntimeError, match=r"^bucket manager: expected torch\.distributed to be "
                                           r"initialized, found it is not; "):
        BucketManager(model())


def test_needs_parameters_that_require_grad(world_one: None) -> None:
    frozen = model().requires_grad_(False)
    with pytest.raises(ValueError, match=r"^module Sequential: expected parameters that require "
                                         r"grad, found none; "):
        BucketManager(frozen)


def test_config_object_or_keywords_never_both(world_one: None) -> None:
    config = BucketConfig(bucket_size_bytes=4096)
    assert BucketManager(model(), config).config is config
    assert AsyncDataParallel(model(), config=config).manager.config is config
    assert BucketManager(model(), bucket_size_bytes=4096).config == config
    with pytest.raises(TypeError, match=r"^BucketManager grad_dtype: expected config= or "
                                        r"BucketConfig fields as keywords, found both; "):
        BucketManager(model(), config, grad_dtype=torch.float32)


def test_keyword_options_are_the_config_fields() -> None:
    assert set(BucketOptions.__annotations__) == {f.name for f in dataclasses.fields(BucketConfig)}


def test_a_sync_trainer_synchronizes_through_a_background_engine(world_one: None) -> None:
    """From a plain thread: backward, then `run(synchronize())` on the engine's loop."""
    net = model()
    with BackgroundEngine(num_workers=1) as engine:
        manager = BucketManager(net, run_blocking=engine.engine.run_blocking)
        backward(net)
        engine.run(manager.synchronize(), timeout=30)
        for param, expected in zip(net.parameters(), local_grads(), strict=True):
            torch.testing.assert_close(param.grad, expected)
        manager.zero_grad()


async def test_synchronized_grads_are_the_buckets_views(world_one: None) -> None:
    net = model()
    manager = BucketManager(net, bucket_size_bytes=1024, first_bucket_size_bytes=1024)
    for step in range(2):
        backward(net, step)
        await manager.synchronize()
        await manager.synchronize()  # already synchronized: returns at once
        for param, expected in zip(net.parameters(), local_grads(step), strict=True):
            torch.testing.assert_close(param.grad, expected)  # one rank: the mean is itself
            assert param.grad is manager.main_grad(param)
        manager.zero_grad()
        assert all(p.grad is None for p in net.parameters())
    assert manager.last_step is not None
    assert manager.last_step.num_all_reduces == len(manager.buckets) >= 2
    assert 0 <= manager.last_step.exposed_s <= manager.last_step.reduce_s
    assert "synchronized" not in repr(manager) and "idle" in repr(manager)


async def test_zero_grad_in_place_keeps_views_and_accepts_the_next_backward(
        world_one: None) -> None:
    net = model()
    manager = BucketManager(net)
    backward(net, 0)
    await manager.synchronize()
    manager.zero_grad(set_to_none=False)
    assert all(p.grad is manager.main_grad(p) and not p.grad.any() for p in net.parameters())
    backward(net, 1)
    await manager.synchronize()
    for param, expected in zip(net.parameters(), local_grads(1), strict=True):
        torch.testing.assert_close(param.grad, expected)


async def test_fp32_buffers_for_bf16_parameters(world_one: None) -> None:
    net = model(torch.bfloat16)
    manager = BucketManager(net, grad_dtype=torch.float32)
    backward(net, 0)
    assert all(p.grad is None for p in net.parameters())  # held in fp32 by the buckets
    await manager.synchronize()
    for param in net.parameters():
        assert param.grad.dtype == torch.bfloat16
        assert manager.main_grad(param).dtype == torch.float32
        torch.testing.assert_close(param.grad, manager.main_grad(param).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="expected zero_grad"):
        backward(net, 1)


async def test_a_second_backward_in_one_step_is_refused_before_it_touches_a_bucket(
        world_one: None) -> None:
    net = model()
    manager = BucketManager(net)
    backward(net, 0)
    with pytest.raises(RuntimeError, match=r"^parameter '2\.bias': expected one gradient per "
                                           r"step, found a second before synchronize\(\); run "
                                           r"the extra backward passes inside no_sync\(\), or "
                                           r"await synchronize\(\) and zero_grad\(\) in "
                                           r"between$"):
        backward(net, 1)
    await manager.synchronize()
    for param, expected in zip(net.parameters(), local_grads(0), strict=True):
        torch.testing.assert_close(param.grad, expected)  # the refused gradient left no trace


async def test_a_backward_on_top_of_synchronized_grads_is_refused(world_one: None) -> None:
    net = model()
    manager = BucketManager(net)
    backward(net, 0)
    await manager.synchronize()
    with pytest.raises(RuntimeError, match=r"^parameter '2\.bias': expected zero_grad\(\) "
                                           r"between a synchronized step and the next backward, "
                                           r"found the synchronized gradient still in place; "):
        backward(net, 1)
    torch.optim.SGD(net.parameters(), lr=0.1).zero_grad()  # set_to_none: a reset
    backward(net, 1)
    await manager.synchronize()


async def test_synchronize_needs_a_backward_outside_no_sync(world_one: None) -> None:
    net = model()
    manager = BucketManager(net)
    with pytest.raises(RuntimeError, match=r"^bucket manager: expected a backward before "
                                           r"synchronize\(\), found none since the last "
                                           r"zero_grad\(\); "):
        await manager.synchronize()
    with manager.no_sync():
        backward(net, 0)
    with pytest.raises(RuntimeError, match=r"^bucket manager: expected a backward outside "
                                           r"no_sync\(\) before synchronize\(\), found only "
                                           r"no_sync\(\) backwards since the last reset; "):
        await manager.synchronize()
    backward(net, 1)
    await manager.synchronize()
    for param, first, second in zip(net.parameters(), local_grads(0), local_grads(1),
                                    strict=True):
        torch.testing.assert_close(param.grad, first + second)


async def test_a_parameter_without_gradient_fails_the_step(world_one: None) -> None:
    net = model()
    net.append(torch.nn.Linear(8, 8))  # never used below
    manager = BucketManager(net)
    message = (r"^parameters '3\.bias', '3\.weight': expected a gradient from this backward, "
               r"found none; make every parameter take part in the loss, set "
               r"requires_grad=False on the ones that never do, or pass "
               r"find_unused_parameters=True$")
    x = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match=message):
        net[:3](x).sum().backward()
    with pytest.raises(BusyError, match=r"^bucket manager: expected no step in flight, found "
                                        r"one \(0 all-reduces launched\); await "
                                        r"synchronize\(\) before zero_grad\(\)$"):
        manager.zero_grad()
    with pytest.raises(RuntimeError, match=message):
        await manager.synchronize()  # the step is dropped
    manager.zero_grad()
    net(x).sum().backward()
    await manager.synchronize()


async def test_find_unused_parameters_reduces_zeros_and_leaves_grad_alone(
        world_one: None) -> None:
    net = model()
    net.append(torch.nn.Linear(8, 8))
    manager = BucketManager(net, find_unused_parameters=True)
    net[:3](torch.randn(4, 16)).sum().backward()
    await manager.synchronize()
    assert net[3].weight.grad is None and net[0].weight.grad is not None
    assert manager.last_step is not None
    assert manager.last_step.num_all_reduces == len(manager.buckets) + 1


async def test_sparse_gradients_are_refused(world_one: None) -> None:
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    BucketManager(embedding)
    with pytest.raises(TypeError, match=r"^parameter 'weight': expected a dense gradient, found "
                                        r"a sparse one; "):
        embedding(torch.tensor([1, 2])).sum().backward()


def test_main_grad_of_a_foreign_parameter(world_one: None) -> None:
    manager = BucketManager(model())
    with pytest.raises(ValueError, match=r"^parameter of shape \(3,\): expected one of this "
                                         r"manager's parameters, found another; "):
        manager.main_grad(torch.nn.Parameter(torch.zeros(3)))


async def test_close_removes_the_hooks(world_one: None) -> None:
    net = model()
    manager = BucketManager(net)
    manager.close()
    backward(net, 0)
    with pytest.raises(RuntimeError, match="expected a backward before synchronize"):
        await manager.synchronize()
    for param, expected in zip(net.parameters(), local_grads(0), strict=True):
        torch.testing.assert_close(param.grad, expected)
