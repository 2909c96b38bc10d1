"""A process SIGKILLed in the middle of a save: the previous checkpoint still loads bit-exact,
and the half-written one is never taken for a checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import asynctron
from asynctron import CheckpointNotFoundError
from asynctron.storage.backends.local._publish import resolve_checkpoint

CHILD = textwrap.dedent("""
    import asyncio, sys, torch, uvloop
    from asynctron import Engine
    from asynctron.testing import FaultyBackend

    def state(seed):
        g = torch.Generator().manual_seed(seed)
        return {"w": torch.randn(4_000_000, generator=g), "step": seed}

    async def main(root, phase):
        backend = FaultyBackend(fsync_delay_s=30)
        opening = backend.hold("open")  # a data file about to be made: the save's area exists
        async with Engine(slab_bytes=1 << 20, memory_budget_bytes=8 << 20,
                          backend=backend) as engine:
            task = engine.save(state(2), f"{root}/step_2")
            if phase == "staging":
                await opening.reached()
            else:
                opening.release()
                await task.staged
            print("ready", flush=True)
            await task

    uvloop.run(main(sys.argv[1], sys.argv[2]))
""")


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4_000_000, generator=g), "step": seed}


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["staging", "writing"])
def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path: object, phase: str) -> None:
    root = str(tmp_path)
    asynctron.save(_state(1), f"{root}/step_1")
    with subprocess.Popen([sys.executable, "-c", CHILD, root, phase], stdout=subprocess.PIPE,
                          text=True) as child:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL

    loaded = asynctron.load(root)  # follows `latest`
    expected = _state(1)
    assert loaded["step"] == 1 and torch.equal(loaded["w"], expected["w"])
    assert not os.path.exists(f"{root}/step_2")
    leftovers = [name for name in os.listdir(root) if name.startswith(".asynctron.tmp-")]
    assert len(leftovers) == 1
    with pytest.raises(CheckpointNotFoundError):
        resolve_checkpoint(f"{root}/{leftovers[0]}")
    # A later save of the same step succeeds, and its commit removes the dead save's debris.
    asynctron.save(_state(2), f"{root}/step_2")
    assert asynctron.load(root)["step"] == 2
    assert sorted(os.listdir(root)) == ["latest", "step_1", "step_2"]
