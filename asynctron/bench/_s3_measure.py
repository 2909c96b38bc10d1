"""What each rank of `asynctron bench s3` measures of one method: an untimed save and load,
then the timed save and load between barriers, with the process's CPU time, the loop's worst
heartbeat delay, the peak RSS growth and the requests in flight; the loaded state checked
against the saved. The Azure and GCS benches measure their methods with `measure_method`."""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Awaitable
from typing import Any, TypeVar

import torch

from asynctron.bench import _baselines
from asynctron.bench._rank_clock import cpu_s
from asynctron.bench._s3_methods import (
    FSSPEC,
    OURS,
    RAW_SIGNED,
    S3TORCH,
    THROTTLE_METHODS,
    TORCH_SAVE,
    AsynctronMethod,
    DcpMethod,
    Job,
    Method,
    RawMethod,
    RawS3,
    TorchSaveMethod,
    _client_config,
)

T = TypeVar("T")


def rank_state(rank: int, nbytes: int, seed: int) -> dict[str, torch.Tensor]:
    state = _baselines.make_state_dict(nbytes, seed=seed + rank)
    return {f"rank{rank}.{key}": tensor for key, tensor in state.items()}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) << 10


def _reset_peak_rss() -> int:
    """Reset Linux's high-water mark to the current RSS; returns that RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def _same(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> bool:
    return expected.keys() == found.keys() and all(
        torch.equal(tensor.view(-1).view(torch.uint8), found[name].reshape(-1).view(torch.uint8))
        for name, tensor in expected.items())


async def measure_method(rank: int, job: Job, method: Method, state: dict[str, torch.Tensor],
                         warmup: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One method's timed save and load of `state` in this rank (any store: `job.url`'s), after
    an untimed save and load of `warmup` (clients, pools and imports warm); between barriers.
    Returns this rank's figures (`summarize` reads them)."""
    import torch.distributed as dist

    await method.setup(warmup)
    await method.prepare(warmup)
    await method.save(warmup, f"{job.url}/warmup")
    await method.load({k: torch.zeros_like(t) for k, t in warmup.items()}, f"{job.url}/warmup")
    await method.setup(state)
    template = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    gc.collect()
    dist.barrier()
    rss_before = _reset_peak_rss()
    await method.prepare(state)
    prepare_rss = _status_bytes("VmRSS") - rss_before
    blocking_s, save_s, save_cpu_s, save_delay_s = await _timed(method.save(state, job.url))
    save_rss = _status_bytes("VmHWM") - rss_before
    gc.collect()
    dist.barrier()
    rss_before = _reset_peak_rss()
    loaded, load_s, load_cpu_s, load_delay_s = await _timed(method.load(template, job.url))
    load_rss = _status_bytes("VmHWM") - rss_before
    dist.barrier()
    return {"rank": rank, "nbytes": sum(t.nbytes for t in state.values()),
            "num_tensors": len(state), "save_s": save_s,
            "blocking_s": save_s if blocking_s is None else blocking_s, "load_s": load_s,
            "save_cpu_s": save_cpu_s, "load_cpu_s": load_cpu_s,
            "loop_worst_delay_s": save_delay_s, "load_loop_worst_delay_s": load_delay_s,
            "save_peak_rss_growth_bytes": save_rss, "prepare_rss_growth_bytes": prepare_rss,
            "load_peak_rss_growth_bytes": load_rss,
            "most_in_flight": method.most_in_flight(), "verified": _same(state, loaded),
            **method.extra}


async def _timed(work: Awaitable[T]) -> tuple[T, float, float, float]:
    """What `work` returns, its seconds and this process's CPU seconds, and the event loop's
    worst heartbeat delay meanwhile."""
    from asynctron.testing import LoopWatchdog

    async with LoopWatchdog() as dog:
        started, cpu = time.perf_counter(), cpu_s()
        value = await work
        elapsed_s, used_s = time.perf_counter() - started, cpu_s() - cpu
    return value, elapsed_s, used_s, dog.report().worst_delay_s


async def _measure(rank: int, job: Job, state: dict[str, torch.Tensor],
                   warmup: dict[str, torch.Tensor]) -> dict[str, Any]:
    from aiobotocore.session import get_session

    from asynctron import Engine

    async def run(method: Method) -> dict[str, Any]:
        return await measure_method(rank, job, method, state, warmup)

    if job.method in (S3TORCH, FSSPEC):
        return await run(DcpMethod(job, job.method))
    if job.method in (OURS, *THROTTLE_METHODS):
        from asynctron.storage.backends.s3 import S3Backend, S3Config

        config = (S3Config() if job.max_requests is None
                  else S3Config(max_requests=job.max_requests))
        backend = S3Backend(config)
        async with Engine(backend=backend) as engine:
            return await run(AsynctronMethod(engine, backend.client,
                                             collective=job.collective))
    signed = job.method == RAW_SIGNED
    async with get_session().create_client(
            "s3", config=_client_config(signed=signed, num_requests=job.num_requests)) as client:
        raw = RawS3(client, part_bytes=job.part_bytes, num_requests=job.num_requests)
        return await run(TorchSaveMethod(raw, rank) if job.method == TORCH_SAVE
                         else RawMethod(raw, rank))


def run_rank(rank: int, world: int, job: Job) -> dict[str, Any]:
    """A spawned rank's run of `job` (a module-level function: it is pickled)."""
    import uvloop

    # aiohttp warns of every bytes body over 1 MiB (s3fs's parts) that it "might lock the event
    # loop": the benchmark measures what it does instead
    warnings.filterwarnings("ignore", category=ResourceWarning)
    state = rank_state(rank, job.state_bytes, seed=100)
    warmup = rank_state(rank, job.warmup_bytes, seed=7)
    return uvloop.run(_measure(rank, job, state, warmup))
