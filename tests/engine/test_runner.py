"""BackgroundEngine: Engine's methods with Engine's arguments for a synchronous trainer, and the
calls that drive a loader and other coroutines on its loop from a plain thread."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
import torch

from asynctron import BackgroundEngine, ClosedError, Engine, EngineConfig
from asynctron.datasets import AsyncLoader

SMALL = {"num_workers": 2, "num_bins": 2, "memory_budget_bytes": 1 << 20,
         "slab_bytes": 64 << 10}


@pytest.mark.parametrize("name", ["__init__", "save", "load", "load_into", "prefault_staging",
                                  "run_blocking"])
def test_same_methods_and_keywords_as_engine(name: str) -> None:
    """Every public call of Engine is on BackgroundEngine with the same parameters (names,
    kinds, defaults, annotations); only the coroutines became blocking calls."""
    ours = inspect.signature(getattr(BackgroundEngine, name))
    theirs = inspect.signature(getattr(Engine, name))
    assert list(ours.parameters.values()) == list(theirs.parameters.values())


def test_every_public_engine_call_is_offered() -> None:
    public = {name for name in dir(Engine) if not name.startswith("_")}
    lifecycle = {"start", "aclose", "budget", "plan_cache"}  # the runner owns the loop: close()
    assert public - lifecycle <= set(dir(BackgroundEngine))


def test_load_and_load_into_from_a_plain_thread(shm_path: str) -> None:
    state = {"w": torch.arange(1000.0), "step": 7}
    with BackgroundEngine(config=EngineConfig(**SMALL)) as engine:
        engine.save(state, f"{shm_path}/c").result(timeout=30)
        fresh = engine.load(f"{shm_path}/c")
        target = {"w": torch.zeros(1000), "step": 0}
        filled = engine.load_into(target, f"{shm_path}/c")
        assert engine.run_blocking(sum, [1, 2, 3]) == 6
    assert torch.equal(fresh["w"], state["w"]) and fresh["step"] == 7
    assert filled["w"] is target["w"] and torch.equal(target["w"], state["w"])
    assert filled["step"] == 7


def test_run_returns_a_coroutines_result_and_times_out_with_timeout_error() -> None:
    with BackgroundEngine(**SMALL) as engine:

        async def on_the_loop() -> bool:
            return asyncio.get_running_loop() is engine.engine._loop

        assert engine.run(on_the_loop())
        cancelled = asyncio.Event()

        async def forever() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                cancelled.set()

        with pytest.raises(TimeoutError, match=r"^background engine: coroutine not done within "
                                               r"0\.05 s; it was cancelled$"):
            engine.run(forever(), timeout=0.05)
        engine.run(cancelled.wait())  # the timed-out coroutine was cancelled on the loop


def test_calls_on_its_own_loop_thread_are_refused() -> None:
    with BackgroundEngine(**SMALL) as engine:

        async def nested() -> None:
            engine.run_blocking(sum, [1])

        with pytest.raises(RuntimeError, match=r"^background engine: called on its own loop "
                                               r"thread"):
            engine.run(nested())


def test_closed_refuses_calls() -> None:
    engine = BackgroundEngine(**SMALL)
    engine.close()
    with pytest.raises(ClosedError, match=r"^background engine: closed; create a new one$"):
        engine.load("anywhere")


def test_a_sync_trainer_iterates_an_async_loader() -> None:
    """`enter` and `iterate` run the loader's `async with` and `async for` on the loop."""
    dataset = [{"x": torch.tensor([i])} for i in range(12)]
    with BackgroundEngine(**SMALL) as engine:
        loader = AsyncLoader(dataset, micro_batch_size=4, run_blocking=engine.engine.run_blocking,
                             prefetch_budget=1 << 20, num_ready_batches=2, num_workers=0)
        with engine.enter(loader) as entered:
            assert entered is loader
            batches = [batch["x"].flatten().tolist() for batch in engine.iterate(loader)]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_enter_passes_the_error_to_aexit() -> None:
    seen: list[Any] = []

    class Resource:
        async def __aenter__(self) -> str:
            return "in"

        async def __aexit__(self, *exc_info: Any) -> None:
            seen.append(exc_info[0])

    with BackgroundEngine(**SMALL) as engine:
        with pytest.raises(KeyError), engine.enter(Resource()):
            raise KeyError("x")
        with engine.enter(Resource()) as value:
            assert value == "in"
    assert seen == [KeyError, None]
