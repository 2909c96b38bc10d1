"""Storage faults during a save: the error is clear, nothing is left behind, the engine lives on."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import asynctron
from asynctron import Engine, StorageError
from asynctron.testing import FaultyBackend
from tests.conftest import assert_same

SMALL = {"slab_bytes": 64 << 10, "memory_budget_bytes": 256 << 10}


def _state(value: float) -> dict:
    return {"w": torch.full((500_000,), value), "b": torch.full((1000,), value), "step": value}


def _leftovers(root: str) -> list[str]:
    return sorted(name for name in os.listdir(root) if ".tmp-" in name)


@pytest.mark.parametrize(
    ("fault", "code"),
    [
        ({"enospc_after_bytes": 1 << 20}, errno.ENOSPC),
        ({"eio_after_bytes": 300 << 10}, errno.EIO),
        ({"fail_fsync": True}, errno.EIO),
    ],
)
async def test_failed_save_keeps_the_previous_checkpoint(
        shm_path: str, fault: dict, code: int) -> None:
    good = _state(1.0)
    async with Engine(**SMALL) as engine:
        await engine.save(good, f"{shm_path}/step_1")
    faulty = FaultyBackend(**fault)
    async with Engine(backend=faulty, **SMALL) as engine:
        task = engine.save(_state(2.0), f"{shm_path}/step_2")
        with pytest.raises(StorageError, match=r"failed: E[A-Z]+ \(.*\); check the storage") as e:
            await task
        assert e.value.errno == code and isinstance(e.value.__cause__, OSError)
        assert ".tmp-" in e.value.path and e.value.path.startswith(shm_path)
        assert engine.budget.borrowed_bytes == 0
        try:  # staging finished before the failure (a failing fsync comes last), or failed with it
            await task.staged
        except StorageError as staging_error:
            assert staging_error is e.value
        # The engine keeps working once the storage recovers.
        faulty.enospc_after_bytes = faulty.eio_after_bytes = None
        faulty.fail_fsync = False
        await engine.save(_state(3.0), f"{shm_path}/step_3")
        assert_same(good, await engine.load(f"{shm_path}/step_1"))
        assert (await engine.load(shm_path))["step"] == 3.0
    assert _leftovers(shm_path) == [] and not os.path.exists(f"{shm_path}/step_2")


async def test_short_writes_are_completed(shm_path: str) -> None:
    faulty = FaultyBackend(max_write_bytes=10_000)
    state = _state(5.0)
    async with Engine(backend=faulty, **SMALL) as engine:
        await engine.save(state, f"{shm_path}/s")
        assert_same(state, await engine.load(f"{shm_path}/s"))
    assert faulty.num_short_writes > 100


async def test_read_errors_are_storage_errors(shm_path: str) -> None:
    async with Engine(**SMALL) as engine:
        await engine.save(_state(1.0), f"{shm_path}/s")
    async with Engine(backend=FaultyBackend(eio_on_read=True), **SMALL) as engine:
        with pytest.raises(StorageError, match=r"^reading '.*__0_\d\.distcp' failed: EIO"):
            await engine.load(f"{shm_path}/s")


@pytest.mark.parametrize("max_write_bytes", [None, 10_000])
async def test_round_trip_on_disk_with_o_direct(tmp_path: object, max_write_bytes: int | None
                                                ) -> None:
    """On a real filesystem, whole slabs go O_DIRECT and unaligned tails buffered; short
    writes under O_DIRECT are completed too."""
    state = {"a": torch.randn(300_001), "b": torch.arange(7, dtype=torch.int8), "c": b"x" * 5000}
    faulty = FaultyBackend(max_write_bytes=max_write_bytes)
    async with Engine(backend=faulty, **SMALL) as engine:
        await engine.save(state, f"{tmp_path}/ckpt")
        assert_same(state, await engine.load(f"{tmp_path}/ckpt"))
    if max_write_bytes is not None:
        assert faulty.num_short_writes > 0


REAL_LIMIT_CHILD = """
import resource, signal, sys, uvloop, torch
from asynctron import Engine, StorageError

async def main(root):
    async with Engine(slab_bytes=1 << 20, memory_budget_bytes=8 << 20) as engine:
        await engine.save({"w": torch.ones(1000)}, f"{root}/step_1")
        # From now on no file of this process may grow past 1 MiB: the kernel refuses the
        # write (EFBIG), as a full disk refuses it (ENOSPC).
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        try:
            await engine.save({"w": torch.ones(4 << 20)}, f"{root}/step_2")
        except StorageError as error:
            print("raised:", error.errno, error)
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        await engine.save({"w": torch.full((3,), 3.0)}, f"{root}/step_3")

uvloop.run(main(sys.argv[1]))
"""


@pytest.mark.slow
def test_the_kernel_refusing_a_write_keeps_the_previous_checkpoint(tmp_path: object) -> None:
    """A real write failure from the kernel (a file-size limit: EFBIG), not an injected one:
    a clear StorageError, no debris, the previous checkpoint intact, the engine goes on."""
    import subprocess
    import sys

    root = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", REAL_LIMIT_CHILD, root], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"raised: {errno.EFBIG} writing '{root}/.asynctron.tmp-" in done.stdout
    assert "failed: EFBIG (File too large); check the storage and retry" in done.stdout
    assert _leftovers(root) == [] and not os.path.exists(f"{root}/step_2")
    assert sorted(os.listdir(root)) == ["latest", "step_1", "step_3"]
    assert_same({"w": torch.ones(1000)}, asynctron.load(f"{root}/step_1"))
